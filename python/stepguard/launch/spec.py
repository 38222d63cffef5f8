"""Failure schedules: ``KIND[:key=value,...]`` parsed into a FailureSpec.

The syntax is in the package docstring (:mod:`stepguard.launch`); the
launcher turns each spec into a schedule of injections.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["FailureSpec", "parse_failure_spec", "parse_link_spec"]

_KINDS = ("kill", "hang", "slow", "partition", "link", "lighthouse",
          "kill_source", "kill_after_heal")
_DURATION_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(ms|s|m)?$")
_RATE_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(bit|kbit|mbit|gbit)$", re.IGNORECASE)
_RATE_SCALE = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_MIN_RATE = 8000.0  # bits per second; tc's tbf cannot go much lower
_MAX_LINK_DELAY = 60.0  # seconds, delay + jitter
# The link keys, which only the link kind takes.
_LINK_KEYS = ("rate", "delay", "jitter", "loss", "reset")


def _parse_duration(text: str, key: str) -> float:
    m = _DURATION_RE.match(text.strip())
    if not m:
        raise ValueError(f"{key}={text!r}: expected a duration like 20s, 500ms, 2m")
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]
    return float(m.group(1)) * scale


def _parse_rate(text: str) -> float:
    """``100mbit``, ``1gbit``, ``500kbit``, ``64000bit``: bits per second."""
    m = _RATE_RE.match(text.strip())
    if not m:
        raise ValueError(f"rate={text!r}: expected a rate like 100mbit, 1gbit, 500kbit "
                         "(bits per second)")
    rate = float(m.group(1)) * _RATE_SCALE[m.group(2).lower()]
    if rate < _MIN_RATE:
        raise ValueError(f"rate={text!r}: at least 8kbit")
    return rate


def _parse_fraction(text: str, key: str) -> float:
    """``1%``, ``0.5%`` or ``0.01``: a fraction in [0, 1]."""
    t = text.strip()
    try:
        v = float(t[:-1]) / 100.0 if t.endswith("%") else float(t)
    except ValueError:
        raise ValueError(f"{key}={text!r}: expected a percentage like 1% or a "
                         "fraction like 0.01") from None
    if not 0.0 <= v <= 1.0 or v != v:
        raise ValueError(f"{key}={text!r}: must be between 0% and 100%")
    return v


@dataclass
class FailureSpec:
    """One failure schedule (see the module docstring for the syntax)."""

    kind: str
    every: float | None = None  # seconds between injections
    start: float | None = None  # first injection (default: every)
    stop: float | None = None  # no injection after this many seconds
    count: int | None = None  # at most this many injections
    random: bool = False  # intervals uniform in [0.5, 1.5] x every
    seed: int = 0
    group: int | None = None  # victim group (default: random)
    rank: int | None = None  # victim rank for kill (default: random; -1: every rank)
    duration: float = 10.0  # hang, slow and partition
    then: str = "cont"  # hang: "cont" or "kill" after duration
    cpu: float = 0.25  # slow: fraction of one CPU
    id_file: bool = True  # lighthouse: restart it with --quorum_id_file
    tag: str | None = None  # a driver's name for it, copied into its records
    # link: the shape of the group's link while the window lasts
    rate: float | None = None  # bits per second (tc tbf), both directions
    delay: float = 0.0  # seconds added to every packet, each direction
    jitter: float = 0.0  # seconds, delay varies uniformly by +- this
    loss: float = 0.0  # fraction of IPv4 packets dropped, each direction
    reset: float = 0.0  # fraction of TCP segments whose connection is reset

    def shapes_link(self) -> bool:
        """Whether a link spec changes anything (one key at least)."""
        return (self.rate is not None or self.delay > 0 or self.jitter > 0
                or self.loss > 0 or self.reset > 0)

    def first_at(self) -> float:
        if self.start is not None:
            return self.start
        return self.every if self.every is not None else 0.0


def parse_failure_spec(text: str) -> FailureSpec:
    """Parses ``KIND[:key=value,...]``; raises ValueError with the reason."""
    kind, _, rest = text.partition(":")
    kind = kind.strip()
    if kind not in _KINDS:
        raise ValueError(f"{text!r}: unknown failure kind {kind!r} (one of {', '.join(_KINDS)})")
    spec = FailureSpec(kind=kind)
    _parse_keys(spec, text, rest)
    if spec.every is not None and spec.every <= 0:
        raise ValueError(f"{text!r}: every must be positive")
    if kind != "slow" and spec.every is None and spec.start is None:
        raise ValueError(f"{text!r}: give every= or start=")
    if kind == "slow" and spec.every is None and spec.count is None:
        spec.count = 1
    if kind == "link":
        _check_link(spec, text)
    return spec


def parse_link_spec(text: str) -> FailureSpec:
    """Parses a static link shape, ``key=value,...`` with the link keys
    (``rate``, ``delay``, ``jitter``, ``loss``, ``reset``) and optionally
    ``group`` (default: every group), for the launcher's ``--link``; raises
    ValueError with the reason."""
    spec = FailureSpec(kind="link")
    _parse_keys(spec, text, text)
    extra = [k for k in ("every", "start", "stop", "count", "rank")
             if getattr(spec, k) is not None] + (["random"] if spec.random else [])
    if extra:
        raise ValueError(f"{text!r}: a static link shape takes no schedule "
                         f"({', '.join(extra)}); use --inject link:... for a window")
    _check_link(spec, text)
    return spec


def _check_link(spec: FailureSpec, text: str) -> None:
    if not spec.shapes_link():
        raise ValueError(f"{text!r}: a link spec needs one of {', '.join(_LINK_KEYS)}")
    if spec.jitter > spec.delay:
        raise ValueError(f"{text!r}: jitter ({spec.jitter:g} s) larger than delay "
                         f"({spec.delay:g} s)")
    if spec.delay + spec.jitter > _MAX_LINK_DELAY:
        raise ValueError(f"{text!r}: delay + jitter above {_MAX_LINK_DELAY:g} s")
    if spec.rank is not None:
        raise ValueError(f"{text!r}: a link belongs to a whole group (no rank=)")


def _parse_keys(spec: FailureSpec, text: str, rest: str) -> None:
    kind = spec.kind
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if key == "random" and not eq:
            spec.random = True
            continue
        if not eq:
            raise ValueError(f"{text!r}: {item!r} is not key=value")
        if key in ("every", "start", "stop", "duration"):
            setattr(spec, key, _parse_duration(value, key))
        elif key == "rank" and value == "all":
            spec.rank = -1
        elif key == "id_file":
            spec.id_file = value.lower() in ("1", "true", "yes")
        elif key in ("count", "seed", "group", "rank"):
            try:
                setattr(spec, key, int(value))
            except ValueError:
                raise ValueError(f"{text!r}: {key}={value!r} is not an integer") from None
        elif key == "then":
            if value not in ("cont", "kill"):
                raise ValueError(f"{text!r}: then={value!r} (cont or kill)")
            spec.then = value
        elif key == "cpu":
            spec.cpu = float(value)
            if not 0.0 < spec.cpu < 1.0:
                raise ValueError(f"{text!r}: cpu={value} must be in (0, 1)")
        elif key == "random":
            spec.random = value.lower() in ("1", "true", "yes")
        elif key in _LINK_KEYS:
            if kind != "link":
                raise ValueError(f"{text!r}: {key}= is a key of the link kind")
            if key == "rate":
                spec.rate = _parse_rate(value)
            elif key in ("delay", "jitter"):
                setattr(spec, key, _parse_duration(value, key))
            else:
                setattr(spec, key, _parse_fraction(value, key))
        else:
            raise ValueError(f"{text!r}: unknown key {key!r}")
