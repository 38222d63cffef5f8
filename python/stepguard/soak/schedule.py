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
from dataclasses import dataclass, field, replace
from typing import Callable

from stepguard.launch.spec import FailureSpec

__all__ = ["KINDS", "NEEDS", "Entry", "Pacer", "SoakParams", "make_schedule"]


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
    # queued again after the launcher skipped it: "missing" (its kind was
    # never injected), "again" (once, for a kind injected before)
    retry: str | None = None
    origin: str | None = None  # the tag of the entry a retry repeats


def make_schedule(seed: int, duration_s: float, gap_s: float,
                  params: SoakParams | None = None,
                  kinds: list[str] | None = None) -> list[Entry]:
    """Entries about every ``gap_s`` (uniform in [0.7, 1.3] x gap) over
    ``duration_s``: first every kind once in a seeded order, then kinds
    drawn uniformly.  The same arguments give the same schedule.

    Raises ValueError when ``duration_s`` cannot hold every kind once even
    at the longest gaps: a schedule always has every kind."""
    p = params or SoakParams()
    names = list(kinds or KINDS)
    unknown = [n for n in names if n not in KINDS]
    if unknown:
        raise ValueError(f"unknown soak fault kinds {unknown} (known: {', '.join(KINDS)})")
    if len(names) * gap_s * 1.3 >= duration_s:
        raise ValueError(f"{duration_s:g} s of faults every ~{gap_s:g} s cannot hold each of "
                         f"the {len(names)} kinds once: lengthen it or shorten the gap")
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


# Groups holding the state an entry needs before it fires (one more than it
# may take down; none for the lighthouse kinds).
NEEDS = {"double": 3, "lighthouse": 0, "lighthouse_no_id_file": 0}


class Pacer:
    """Which entry of a schedule to inject now.

    The schedule gives every kind once first, but a schedule alone does not
    make a run inject every kind: an entry waits while too few groups hold
    the state (see :data:`NEEDS`), so entries behind it come due together,
    and the launcher skips a fault that finds only the last holder of the
    state to hit (or an armed point nobody reaches).  So:

    - at most one entry at a time, ``spacing_s`` apart: entries that came
      due together would otherwise be queued before the launcher has seen
      what the first one took down, and be skipped;
    - an entry waits for ``NEEDS`` holders, ``patience_new_s`` at most for
      a kind not injected yet, ``patience_s`` after;
    - a kind whose fault was skipped before it was ever injected is queued
      again, to be the next entry (``max_retries`` times at most; a retry
      of a kind injected meanwhile is dropped);
    - any other skipped entry is queued again once (not one skipped because
      its fault point was still armed by the same kind: that one is struck
      yet), so that skips do not thin the run out.

    The runner reports what the launcher did through :meth:`injected` and
    :meth:`skipped`.  Times are seconds since the fault phase began.
    """

    def __init__(self, schedule: list[Entry], spacing_s: float = 2.0,
                 patience_s: float = 15.0, patience_new_s: float = 60.0,
                 max_retries: int = 3) -> None:
        self.queue = list(schedule)
        self.spacing_s = spacing_s
        self.patience_s = patience_s
        self.patience_new_s = patience_new_s
        self.max_retries = max_retries
        self.done: set[str] = set()  # kinds injected at least once
        self.retries: dict[str, int] = {}
        self.last_at: float | None = None
        self._by_tag: dict[str, Entry] = {}
        self._landed: set[str] = set()  # entries with a fault injected
        self._n = 0

    def next(self, at: float, holders: int) -> tuple[str, Entry] | None:
        """The entry to inject at ``at`` with ``holders`` groups holding the
        state, and its tag (``<kind>#<n>``; a spec's tag adds ``.i``), or
        None."""
        while self.queue and self.queue[0].retry == "missing" \
                and self.queue[0].kind in self.done:
            self.queue.pop(0)
        if not self.queue or self.queue[0].at > at:
            return None
        if self.last_at is not None and at - self.last_at < self.spacing_s:
            return None
        e = self.queue[0]
        patience = self.patience_s if e.kind in self.done else self.patience_new_s
        if holders < NEEDS.get(e.kind, 2) and at - e.at < patience:
            return None
        self.queue.pop(0)
        self.last_at = at
        tag = f"{e.kind}#{self._n}"
        self._n += 1
        self._by_tag[tag] = e
        return tag, e

    @staticmethod
    def _entry_tag(tag: str) -> str | None:
        """``kind#n`` of a spec's tag (``kind#n.i``), None for a fault the
        launcher added (an armed kind's heal trigger)."""
        if ":" in tag:
            return None
        return tag.split(".", 1)[0]

    def injected(self, tag: str) -> None:
        t = self._entry_tag(tag)
        if t is not None and t in self._by_tag:
            self.done.add(self._by_tag[t].kind)
            self._landed.add(t)
            # part of the entry landed (one fault of a double): no retry
            self.queue = [q for q in self.queue if q.origin != t]

    def skipped(self, tag: str, at: float, reason: str = "") -> None:
        """The launcher skipped the fault of ``tag`` at ``at``, for
        ``reason`` (the ``inject_skipped`` record's)."""
        t = self._entry_tag(tag)
        e = self._by_tag.get(t) if t is not None else None
        if e is None or t in self._landed:
            return
        if e.kind in self.done:
            if e.retry is not None or "already armed" in reason:
                return
            retry = "again"
        else:
            n = self.retries.get(e.kind, 0)
            if n >= self.max_retries or any(q.retry == "missing" and q.kind == e.kind
                                            for q in self.queue):
                return
            self.retries[e.kind] = n + 1
            retry = "missing"
        self.queue.insert(0, Entry(at=at, kind=e.kind, specs=[replace(s, tag=None)
                                                              for s in e.specs],
                                   retry=retry, origin=t))
