"""The soak's fault schedule: seeded, so a seed replays the same schedule.

A schedule is a list of :class:`Entry` (when, which kind, the launcher
specs to inject at once).  The seed fixes the kinds, their order, their
times and their parameters; it does not fix the interleaving with the
trainers (which group a kill hits is the launcher's seeded choice among the
groups running at that moment, and which replica reaches an armed fault
point first is up to the run).

Kinds live in one table, :data:`KINDS`: a name and a function that draws
its launcher specs.  A new kind (the slow and lossy link kinds, once the
launcher shapes links) is one more entry there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from stepguard.launch.spec import FailureSpec

__all__ = ["KINDS", "Entry", "SoakParams", "make_schedule"]


@dataclass
class SoakParams:
    """What the kinds' parameters depend on."""

    op_timeout: float = 4.0  # the trainers' manager timeout (hang > this)
    partition_s: float = 8.0
    lighthouse_down_s: float = 3.0
    arm_s: float = 60.0  # an armed fault point expires after this
    link_s: float = 8.0  # a slow or lossy link window


def _kill_group(rng: random.Random, p: SoakParams) -> list[FailureSpec]:
    return [FailureSpec(kind="kill", rank=-1, seed=rng.randrange(1 << 30))]


def _kill_rank(rng: random.Random, p: SoakParams) -> list[FailureSpec]:
    return [FailureSpec(kind="kill", rank=1, seed=rng.randrange(1 << 30))]


def _hang(rng: random.Random, p: SoakParams) -> list[FailureSpec]:
    d = round(p.op_timeout * rng.uniform(1.5, 2.5), 2)
    return [FailureSpec(kind="hang", duration=d, then="cont", seed=rng.randrange(1 << 30))]


def _partition(rng: random.Random, p: SoakParams) -> list[FailureSpec]:
    return [FailureSpec(kind="partition", duration=p.partition_s,
                        seed=rng.randrange(1 << 30))]


def _slow_link(rng: random.Random, p: SoakParams) -> list[FailureSpec]:
    # a thin, far link: 50 Mbit/s each way, 20 +- 5 ms each way
    return [FailureSpec(kind="link", duration=p.link_s, rate=50e6, delay=0.02,
                        jitter=0.005, seed=rng.randrange(1 << 30))]


def _lossy_link(rng: random.Random, p: SoakParams) -> list[FailureSpec]:
    # 5% of the packets lost each way, and one TCP segment in 500 resets
    # its connection
    return [FailureSpec(kind="link", duration=p.link_s, loss=0.05, reset=0.002,
                        seed=rng.randrange(1 << 30))]


def _lighthouse(id_file: bool) -> Callable[[random.Random, SoakParams], list[FailureSpec]]:
    def draw(rng: random.Random, p: SoakParams) -> list[FailureSpec]:
        return [FailureSpec(kind="lighthouse", duration=p.lighthouse_down_s, id_file=id_file)]
    return draw


def _armed(kind: str) -> Callable[[random.Random, SoakParams], list[FailureSpec]]:
    def draw(rng: random.Random, p: SoakParams) -> list[FailureSpec]:
        return [FailureSpec(kind=kind, duration=p.arm_s, seed=rng.randrange(1 << 30))]
    return draw


# Kinds two of which make a "double" (two faults at once).
_SIMPLE = ("kill_group", "kill_rank", "hang", "partition")


def _double(rng: random.Random, p: SoakParams) -> list[FailureSpec]:
    a, b = rng.sample(_SIMPLE, 2)
    return KINDS[a](rng, p) + KINDS[b](rng, p)


# name -> draws the launcher specs of one fault of that kind.
KINDS: dict[str, Callable[[random.Random, SoakParams], list[FailureSpec]]] = {
    "kill_group": _kill_group,
    "kill_rank": _kill_rank,
    "hang": _hang,
    "partition": _partition,
    "slow_link": _slow_link,
    "lossy_link": _lossy_link,
    "lighthouse": _lighthouse(True),
    "lighthouse_no_id_file": _lighthouse(False),
    "kill_source": _armed("kill_source"),
    "kill_after_heal": _armed("kill_after_heal"),
    "double": _double,
}


@dataclass
class Entry:
    at: float  # seconds after the fault phase began
    kind: str
    specs: list[FailureSpec] = field(default_factory=list)


def make_schedule(seed: int, duration_s: float, gap_s: float,
                  params: SoakParams | None = None,
                  kinds: list[str] | None = None) -> list[Entry]:
    """Entries about every ``gap_s`` (uniform in [0.7, 1.3] x gap) over
    ``duration_s``: first every kind once in a seeded order, then kinds
    drawn uniformly.  The same arguments give the same schedule."""
    p = params or SoakParams()
    names = list(kinds or KINDS)
    unknown = [n for n in names if n not in KINDS]
    if unknown:
        raise ValueError(f"unknown soak fault kinds {unknown} (known: {', '.join(KINDS)})")
    rng = random.Random(seed)
    first = names[:]
    rng.shuffle(first)
    out: list[Entry] = []
    t = gap_s * rng.uniform(0.7, 1.3)
    while t < duration_s:
        name = first.pop(0) if first else rng.choice(names)
        out.append(Entry(at=round(t, 3), kind=name, specs=KINDS[name](rng, p)))
        t += gap_s * rng.uniform(0.7, 1.3)
    return out
