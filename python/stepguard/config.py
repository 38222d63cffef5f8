"""Every environment variable stepguard reads, in one table.

:data:`VARIABLES` lists each variable the Python package or the C library
reads: its name, the second spelling read when the name is unset (the
``STEPGUARD_`` spelling of a torchft variable), its type, its default, what
it does and which layer reads it.  Every name is spelled out in full so that
``grep`` finds each place that reads it.  Python code reads the environment
only through the getters here (:func:`get`, :func:`raw`, :func:`auth_token`);
C code calls ``getenv`` and is listed with ``layers=("C",)``.
``docs/configuration.md`` is generated from the table by
``scripts/gen-config-docs``.

Precedence: a variable's ``name`` wins over its ``alias`` when both are set
(``TORCHFT_TIMEOUT_SEC`` over ``STEPGUARD_TIMEOUT_SEC``), as in torchft mode
a torchft job's own settings must not be overridden by ours.

Parsing by type, for a variable that is set:

- ``str``: the value as it is (an empty string stays empty).
- ``int``, ``float``: ``int(value)``, ``float(value)``; empty means unset.
- ``seconds``: ``timedelta(seconds=int(value))``; empty means unset.
- ``bool``: true when the value is in ``true_if`` (if given), otherwise true
  unless it is in ``false_if``; each variable keeps the rule it always had.

This module must not import torch: ``import stepguard`` reads it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Dict, FrozenSet, Mapping, NamedTuple, Optional, Tuple

__all__ = [
    "VARIABLES",
    "Var",
    "auth_token",
    "get",
    "lookup",
    "raw",
    "render_markdown",
    "seconds",
]

_TYPES = ("str", "int", "float", "bool", "seconds")
_LAYERS = ("python", "C")


class Var(NamedTuple):
    """One environment variable.

    Args:
        name: the variable; it wins over ``alias`` when both are set.
        alias: a second spelling read when ``name`` is unset, or None.
        type: ``"str"``, ``"int"``, ``"float"``, ``"bool"`` or ``"seconds"``.
        default: the value when unset (a call site may pass its own).
        meaning: one line for the docs.
        layers: which layers read it: ``"python"``, ``"C"`` or both.
        note: extra words for the docs (e.g. who sets it).
        true_if: ``bool`` only: the values that mean true.
        false_if: ``bool`` only: the values that mean false (when
            ``true_if`` is None).
    """

    name: str
    alias: Optional[str]
    type: str
    default: Any
    meaning: str
    layers: Tuple[str, ...]
    note: str = ""
    true_if: Optional[FrozenSet[str]] = None
    false_if: Optional[FrozenSet[str]] = None


_PY = ("python",)
_C = ("C",)
_BOTH = ("python", "C")
_TORCHRUN = "set by torchrun"


VARIABLES: Tuple[Var, ...] = (
    # --- the Manager (torchft's names, each also read as STEPGUARD_*) ---
    Var("TORCHFT_LIGHTHOUSE", "STEPGUARD_LIGHTHOUSE", "str", None,
        "lighthouse address for group rank 0 when Manager gets no lighthouse_addr; "
        "several comma-separated for replicated lighthouses (docs/lighthouse.md)", _PY),
    Var("TORCHFT_MANAGER_PORT", "STEPGUARD_MANAGER_PORT", "int", 0,
        "port of the manager server on group rank 0 when Manager gets no port (0: any)",
        _PY),
    Var("TORCHFT_TIMEOUT_SEC", "STEPGUARD_TIMEOUT_SEC", "seconds", None,
        "Manager timeout for collectives, checkpoint transfer and the state lock; "
        "overrides the argument", _PY),
    Var("TORCHFT_QUORUM_TIMEOUT_SEC", "STEPGUARD_QUORUM_TIMEOUT_SEC", "seconds", None,
        "Manager quorum timeout; overrides the argument", _PY),
    Var("TORCHFT_CONNECT_TIMEOUT_SEC", "STEPGUARD_CONNECT_TIMEOUT_SEC", "seconds", None,
        "Manager connect timeout (lighthouse, manager server); overrides the argument",
        _PY),
    Var("TORCHFT_QUORUM_RETRIES", "STEPGUARD_QUORUM_RETRIES", "int", None,
        "times a failed quorum is retried; overrides the argument", _PY),
    Var("STEPGUARD_LIGHTHOUSE_OUTAGE_SEC", None, "seconds", timedelta(minutes=10),
        "how long a quorum is retried while the lighthouse is unreachable", _PY),
    Var("TORCHFT_TRIGGER_FR_ON_ABORT", "STEPGUARD_TRIGGER_FR_ON_ABORT", "bool", False,
        "an errored abort of a NCCL/XCCL group asks NCCL for a flight recorder dump",
        _PY, true_if=frozenset({"true"})),
    Var("TORCHFT_WATCHDOG_TIMEOUT_SEC", None, "float", 30.0,
        "seconds the futures timer thread may block a callback before the watchdog "
        "reports it", _PY),
    Var("TORCHFT_USE_BUCKETIZATION", "STEPGUARD_USE_BUCKETIZATION", "bool", False,
        "DiLoCo allreduces fragments in buckets when the argument does not ask for it",
        _PY, true_if=frozenset({"True"})),
    # --- OpenTelemetry logging ---
    Var("TORCHFT_USE_OTEL", "STEPGUARD_USE_OTEL", "bool", False,
        "the torchft_* loggers also export through OpenTelemetry", _PY,
        false_if=frozenset({"", "false"})),
    Var("TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON", "STEPGUARD_OTEL_RESOURCE_ATTRIBUTES_JSON",
        "str", None,
        "JSON file of OpenTelemetry resource attributes, by logger name", _PY),
    # --- DDP ---
    Var("STEPGUARD_DDP_FIND_UNUSED", None, "bool", False,
        "DDP searches the autograd graph for unused parameters after every forward",
        _PY, false_if=frozenset({"", "0"})),
    Var("STEPGUARD_DDP_BUCKETS", None, "str", "",
        "`rebuilt`: DDP rebuilds its buckets as torch does (default: fixed at "
        "construction)", _PY),
    Var("STEPGUARD_DDP_COMPLETION", None, "str", "",
        "`thread`: each bucket completes on the process group's thread", _PY),
    # --- process groups and collectives ---
    Var("STEPGUARD_COMM_HOST", None, "str", None,
        "address ProcessGroupTCP advertises to its peers, as given (default: "
        "STEPGUARD_ADVERTISE_HOST's rule, then the address routing to the store)", _PY),
    Var("STEPGUARD_COMM_PROGRESS_TIMEOUT_SEC", None, "float", 2.0,
        "ProcessGroupTCP: a peer silent this long (seconds, fractions allowed) "
        "during an operation fails it; 0 off; wins over the progress_timeout "
        "argument", _PY),
    Var("STEPGUARD_QUANTIZE", None, "str", "fp8,int8",
        "ProcessGroupTCP: the quantized formats this member advertises to its "
        "quorum, preferred first (fp8, int8); empty advertises none. A "
        "quantized collective uses the first format of rank 0's list that "
        "every member advertises, else full precision", _PY),
    Var("STEPGUARD_AUTH_TOKEN", None, "str", None,
        "shared secret for the lighthouse, manager, collectives and checkpoint "
        "server when no token is passed", _BOTH),
    Var("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", None, "str", "",
        "prefix of NCCL's debug pipe, used to ask for a flight recorder dump", _PY,
        note="torch's variable"),
    Var("TORCH_NCCL_NONBLOCKING_TIMEOUT", None, "str", None,
        "ProcessGroupBabyNCCL sets it to its timeout when unset", _PY,
        note="torch's variable"),
    Var("TORCH_XCCL_NONBLOCKING_TIMEOUT", None, "str", None,
        "ProcessGroupBabyXCCL sets it to its timeout when unset", _PY,
        note="torch's variable"),
    Var("TORCH_FR_DUMP_TEMP_FILE", None, "str", None,
        "where torch writes flight recorder dumps; the Manager restores it", _PY,
        note="torch's variable"),
    # --- checkpoint transfer ---
    Var("STEPGUARD_ADVERTISE_HOST", None, "str", None,
        "host (or interface name) peers use to reach this process's manager, "
        "checkpoint and collectives servers; wins over a hostname argument", _BOTH),
    # --- the launcher and its workers ---
    Var("STEPGUARD_EVENTS_FD", None, "str", None,
        "pipe a worker writes its events to", _PY, note="set by the launcher"),
    Var("STEPGUARD_STOP_FILE", None, "str", None,
        "file naming the step at which workers finish", _PY,
        note="set by the launcher"),
    Var("STEPGUARD_HOOK_DIR", None, "str", None,
        "folder where the launcher arms fault points (hook_point)", _PY,
        note="set by the launcher"),
    Var("STEPGUARD_INCARNATION", None, "int", 0,
        "how many times this worker was restarted", _PY, note="set by the launcher"),
    Var("REPLICA_GROUP_ID", None, "int", 0,
        "the worker's replica group", _PY, note="set by the launcher"),
    # --- warm spares (docs/spares.md) ---
    Var("STEPGUARD_SPARE_FD", None, "str", None,
        "a warm spare's file descriptor on which its takeover message arrives; "
        "unset in a process that is not a spare", _PY, note="set by the launcher"),
    Var("STEPGUARD_SPARE_ID", None, "int", None,
        "which warm spare of the job this process is (in its events)", _PY,
        note="set by the launcher"),
    Var("STEPGUARD_SPARE_TIMEOUT_SEC", None, "float", 86400.0,
        "how long a warm spare waits for its takeover message before it fails", _PY),
    # --- torchft mode ---
    Var("STEPGUARD_TORCHFT", None, "bool", False,
        "the name `torchft` imports stepguard in every process", _PY,
        false_if=frozenset({"", "0"})),
    Var("XDG_CACHE_HOME", None, "str", None,
        "cache folder for torchft mode's scripts (default: ~/.cache)", _PY),
    # --- set by torchrun ---
    Var("MASTER_ADDR", None, "str", None,
        "store host when Manager or ProcessGroupTCP gets none", _PY, note=_TORCHRUN),
    Var("MASTER_PORT", None, "int", None,
        "store port when Manager gets none", _PY, note=_TORCHRUN),
    Var("RANK", None, "int", None,
        "the process's group rank when Manager gets none", _PY, note=_TORCHRUN),
    Var("WORLD_SIZE", None, "int", None,
        "the group's size when Manager gets none", _PY, note=_TORCHRUN),
    Var("JOB_ID", None, "str", "unknown",
        "job id in the quorum, commit and error logs", _PY,
        note="set by the scheduler"),
    # --- the C library ---
    Var("STEPGUARD_LOG", None, "str", "info",
        "log level: trace, debug, info, warn (warning), error", _C),
    Var("RUST_LOG", None, "str", "info",
        "log level when STEPGUARD_LOG is unset or not a level (torchft's variable)", _C),
    Var("STEPGUARD_SAME_HOST", None, "bool", True,
        "the same-host memory path between processes of one host", _C,
        false_if=frozenset({"0", "false", "off"})),
)

_BY_NAME: Dict[str, Var] = {}
for _v in VARIABLES:
    assert _v.type in _TYPES and set(_v.layers) <= set(_LAYERS), _v
    for _n in (_v.name, _v.alias):
        if _n is not None:
            assert _n not in _BY_NAME, _n
            _BY_NAME[_n] = _v
del _v, _n

_UNSET: Any = object()


def lookup(name: str) -> Var:
    """The table's entry for ``name`` (its name or its alias).

    Raises:
        KeyError: ``name`` is not in the table.
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not in stepguard.config.VARIABLES") from None


def raw(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The variable's text, None when unset.

    Args:
        name: the variable's name (or alias): both spellings are read, the
            name winning over the alias.
        environ: where to read (default: ``os.environ``).

    Returns:
        The value of the first spelling that is set, else None.
    """
    var = lookup(name)
    env = os.environ if environ is None else environ
    value = env.get(var.name)
    if value is None and var.alias is not None:
        value = env.get(var.alias)
    return value


def _parse(var: Var, value: str) -> Any:
    if var.type == "int":
        return int(value)
    if var.type == "float":
        return float(value)
    if var.type == "seconds":
        return timedelta(seconds=int(value))
    if var.type == "bool":
        if var.true_if is not None:
            return value in var.true_if
        return value not in (var.false_if or frozenset())
    return value


def get(name: str, default: Any = _UNSET,
        environ: Optional[Mapping[str, str]] = None) -> Any:
    """The variable's parsed value, or the default when unset.

    Args:
        name: the variable's name (or alias).
        default: returned when unset (default: the table's default).
        environ: where to read (default: ``os.environ``).

    Returns:
        The value parsed by the variable's type (see the module docstring);
        for every type but ``str`` and ``bool``, an empty value counts as
        unset.

    Raises:
        ValueError: an ``int``, ``float`` or ``seconds`` value that does not
            parse.
    """
    var = lookup(name)
    value = raw(name, environ)
    if value is None or (value == "" and var.type in ("int", "float", "seconds")):
        return var.default if default is _UNSET else default
    return _parse(var, value)


def auth_token(token: Optional[str]) -> Optional[str]:
    """The shared secret to use: ``token`` when given (``""`` means none),
    else ``STEPGUARD_AUTH_TOKEN``, else None."""
    if token is not None:
        return token or None
    return get("STEPGUARD_AUTH_TOKEN") or None


def seconds(t: timedelta | float | int) -> float:
    """A duration as float seconds (a ``timedelta`` or a number of seconds)."""
    return t.total_seconds() if isinstance(t, timedelta) else float(t)


def _show_default(var: Var) -> str:
    d = var.default
    if d is None:
        return "unset"
    if isinstance(d, timedelta):
        s = d.total_seconds()
        return f"{s:g} s"
    if isinstance(d, bool):
        return "true" if d else "false"
    if d == "":
        return '`""`'
    return f"`{d}`"


def _show_type(var: Var) -> str:
    if var.type != "bool":
        return var.type
    if var.true_if is not None:
        return "bool: true if " + " or ".join(f"`{v}`" for v in sorted(var.true_if))
    words = [f"`{v}`" if v else '`""`' for v in sorted(var.false_if or ())]
    return "bool: false if " + " or ".join(words)


def render_markdown() -> str:
    """``docs/configuration.md``: the table as Markdown."""
    lines = [
        "# Configuration: environment variables",
        "",
        "<!-- Generated by scripts/gen-config-docs from python/stepguard/config.py;",
        "     edit the table there and rerun the script. -->",
        "",
        "Every environment variable stepguard reads, from Python (through",
        "`stepguard.config`) and from the C library (`getenv`).  Where a variable",
        "has a second spelling, the first wins when both are set",
        "(`TORCHFT_TIMEOUT_SEC` over `STEPGUARD_TIMEOUT_SEC`).  For `int`, `float`",
        "and `seconds` (whole seconds), an empty value counts as unset.",
        "",
        "| Variable | Also read as | Type | Default | Read by | Meaning |",
        "|---|---|---|---|---|---|",
    ]
    for var in VARIABLES:
        meaning = var.meaning + (f" ({var.note})" if var.note else "")
        lines.append(
            f"| `{var.name}` | {f'`{var.alias}`' if var.alias else ''} "
            f"| {_show_type(var)} | {_show_default(var)} "
            f"| {', '.join(var.layers)} | {meaning} |"
        )
    lines.append("")
    return "\n".join(lines)
