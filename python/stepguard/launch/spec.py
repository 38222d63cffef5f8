"""Failure schedules: ``KIND[:key=value,...]`` parsed into a FailureSpec.

The syntax is in the package docstring (:mod:`stepguard.launch`); the
launcher turns each spec into a schedule of injections.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["FailureSpec", "parse_failure_spec"]

_KINDS = ("kill", "hang", "slow", "partition")
_DURATION_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(ms|s|m)?$")


def _parse_duration(text: str, key: str) -> float:
    m = _DURATION_RE.match(text.strip())
    if not m:
        raise ValueError(f"{key}={text!r}: expected a duration like 20s, 500ms, 2m")
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]
    return float(m.group(1)) * scale


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
    rank: int | None = None  # victim rank for kill (default: random)
    duration: float = 10.0  # hang, slow and partition
    then: str = "cont"  # hang: "cont" or "kill" after duration
    cpu: float = 0.25  # slow: fraction of one CPU

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
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if key == "random" and not eq:
            spec.random = True
            continue
        if not eq:
            raise ValueError(f"{text!r}: {item!r} is not key=value")
        if key in ("every", "start", "stop", "duration"):
            setattr(spec, key, _parse_duration(value, key))
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
        else:
            raise ValueError(f"{text!r}: unknown key {key!r}")
    if spec.every is not None and spec.every <= 0:
        raise ValueError(f"{text!r}: every must be positive")
    if kind in ("kill", "hang", "partition") and spec.every is None and spec.start is None:
        raise ValueError(f"{text!r}: give every= or start=")
    if kind == "slow" and spec.every is None and spec.count is None:
        spec.count = 1
    return spec
