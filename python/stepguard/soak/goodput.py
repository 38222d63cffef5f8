"""Goodput: the one definition (the soak, ``bench/e2e.py`` and the demo use it).

    goodput = committed replica-steps
              / (replicas x fault-free step rate x wall time)

A *replica-step* is one replica group committing one step (its group rank
0's commit record in the launcher's timeline) as one of the step's
participants: where a commit record says how many replicas took part
(``participants``), at most that many commits count per step, so a hot
spare (``FIXED_WITH_SPARES``: it trains along with zero weight) or a
replica that only healed in that step adds nothing.  The *fault-free step
rate* is measured in the same run, on the same machine (steps per second of
one replica while every replica trains and nothing is injected), so 1.0
means the faults cost nothing and 0.5 that half the possible work was done.
The soak measures it in its fault-free phase; ``bench/e2e.py`` and the demo
with ``window_rate`` in the window itself (the full-quorum steps while no
process sets up), since the load of a shared machine drifts.  A warm spare
set up at a lower priority than the trainers (``--spare-nice``) does not
count as setting up there: it takes only the CPU the training leaves, and
with kills closer together than its setup one is always setting up, which
would leave no step to measure.  That it does not slow the steps is
measured, not assumed: ``bench/e2e.py`` prints the step rate while such a
spare sets up beside the rate otherwise (``steady_rate``'s ``within``).

The *wall time* is a window fixed by the fault schedule, not by when a
configuration happened to start or stop: the soak takes its fault phase,
``bench/e2e.py`` the span from its first kill to a whole number of kill
intervals later (the same length and number of kills for every
configuration it compares).  Start-up (imports, the first quorum) lies
outside both.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

__all__ = ["committed_replica_steps", "fault_free_rate", "goodput", "kill_window", "lowered",
           "rate_from_step_times", "setup_spans", "steady_rate", "window_rate"]


def goodput(replica_steps: int, replicas: int, rate: float, wall_s: float) -> float | None:
    """The definition above; None when it is undefined (no rate or time)."""
    if replicas <= 0 or rate <= 0 or wall_s <= 0:
        return None
    return replica_steps / (replicas * rate * wall_s)


def committed_replica_steps(timeline: Iterable[dict[str, Any]], t0: float | None = None,
                            t1: float | None = None) -> int:
    """Commit records of group rank 0 with ``t0 <= t < t1``, at most
    ``participants`` of them per step where the records say it."""
    per_step: dict[Any, int] = {}
    n = 0
    for r in timeline:
        if r.get("event") != "commit" or r.get("rank", 0) != 0 \
                or (t0 is not None and r["t"] < t0) or (t1 is not None and r["t"] >= t1):
            continue
        cap = r.get("participants")
        if cap and "step" in r:
            per_step[r["step"]] = per_step.get(r["step"], 0) + 1
            if per_step[r["step"]] > cap:
                continue
        n += 1
    return n


def fault_free_rate(timeline: Iterable[dict[str, Any]], t0: float, t1: float,
                    replicas: int) -> float | None:
    """Steps per second of one replica in ``[t0, t1)``, a window without
    faults: committed replica-steps / replicas / window length."""
    if t1 <= t0 or replicas <= 0:
        return None
    n = committed_replica_steps(timeline, t0, t1)
    return n / replicas / (t1 - t0) if n else None


def rate_from_step_times(step_times: list[float]) -> float | None:
    """Steps per second from the median time of fault-free steps (for a run
    without a fault-free window, such as ``bench/e2e.py``'s)."""
    if not step_times:
        return None
    m = statistics.median(step_times)
    return 1.0 / m if m > 0 else None


def kill_window(timeline: Iterable[dict[str, Any]], every: float,
                window: float | None = None) -> tuple[float, float] | None:
    """The wall-time window of a run with one kill every ``every`` seconds:
    from its first kill to ``window`` seconds later (default: as many kill
    intervals as it had kills), so every kill in it has its whole interval
    to cost what it costs.  None without a kill."""
    kills = sorted(r["t"] for r in timeline
                   if r.get("event") == "inject" and r.get("kind") == "kill")
    if not kills:
        return None
    return kills[0], kills[0] + (window if window is not None else len(kills) * every)


def lowered(record: dict[str, Any]) -> bool:
    """Whether a ``spare_start`` record's spare sets up at a lower priority
    than the trainers (its ``nice`` above ``trainer_nice``, 0 where the
    record does not say)."""
    nice = record.get("nice")
    return nice is not None and nice > record.get("trainer_nice", 0)


def setup_spans(timeline: Iterable[dict[str, Any]],
                spares: str = "trainers") -> list[tuple[float, float]]:
    """(start, end) of every process setting up while others train: a
    launch or restart until its ``ready`` (or first step), a warm spare's
    start until ``spare_ready`` (or, when it took over first, until its
    group's ``ready`` or first step).  Open ones end at the last record.

    ``spares``: which warm spares count: ``"trainers"`` (the default)
    those set up at the trainers' priority, since one set up at a lower
    priority (:func:`lowered`) takes only the CPU they leave, until a
    takeover gives it theirs; ``"lowered"`` only those at a lower priority
    (until a takeover), and no launch or restart; ``"all"`` every one."""
    if spares not in ("trainers", "lowered", "all"):
        raise ValueError(f"spares: 'trainers', 'lowered' or 'all', not {spares!r}")
    tl = sorted(timeline, key=lambda r: r["t"])
    if not tl:
        return []
    done: dict[tuple[Any, Any], float] = {}
    spare_done: dict[Any, float] = {}
    spare_group: dict[Any, tuple[Any, Any]] = {}
    taken: dict[Any, float] = {}
    for r in tl:
        ev = r.get("event")
        key = (r.get("group"), r.get("incarnation"))
        if ev in ("ready", "commit", "discard") and r.get("group") is not None:
            done.setdefault(key, r["t"])
        elif ev == "spare_ready":
            spare_done.setdefault(r.get("spare"), r["t"])
        elif ev == "takeover":
            spare_group.setdefault(r.get("spare"), key)
            taken.setdefault(r.get("spare"), r["t"])
    end = tl[-1]["t"]
    spans = []
    for r in tl:
        ev = r.get("event")
        start = r["t"]
        if ev in ("launch", "restart") and spares != "lowered":
            stop = done.get((r.get("group"), r.get("incarnation")), end)
        elif ev == "spare_start":
            s = r.get("spare")
            stop = spare_done.get(s, done.get(spare_group.get(s, (None, None)), end))
            if spares != "all" and lowered(r):
                # lowered until a takeover that came before it was ready
                took = taken.get(s)
                if took is not None and took < stop:
                    start, stop = (took, stop) if spares == "trainers" else (start, took)
                elif spares == "trainers":
                    continue
            elif spares == "lowered":
                continue
        else:
            continue
        spans.append((start, max(start, stop)))
    return spans


def steady_rate(timeline: Iterable[dict[str, Any]], replicas: int, t0: float | None = None,
                t1: float | None = None,
                busy: Iterable[tuple[float, float]] = (),
                within: Iterable[tuple[float, float]] | None = None) -> float | None:
    """The fault-free step rate from a run's own fault-free steps: over the
    gaps between consecutive step records of one incarnation of a replica
    group (group rank 0) that are both commits of a full quorum
    (``participants == replicas``), the later one not healed, inside
    ``[t0, t1]`` and overlapping no ``busy`` span (``setup_spans``: a
    process setting up on the same CPUs), the number of gaps over their
    total length.  It samples the same stretch of time as the faults, so
    a change in the machine's load moves both alike.  With ``within``, only
    the gaps that lie inside one of those spans."""
    spans = list(busy)
    inside = None if within is None else list(within)
    last: dict[tuple[Any, Any], dict[str, Any]] = {}
    n, total = 0, 0.0
    for r in sorted(timeline, key=lambda r: r["t"]):
        if r.get("event") not in ("commit", "discard") or r.get("rank", 0) != 0:
            continue
        key = (r.get("group"), r.get("incarnation"))
        prev, last[key] = last.get(key), r
        if prev is None or r["event"] != "commit" or prev["event"] != "commit" \
                or r.get("healed") or prev.get("participants") != replicas \
                or r.get("participants") != replicas:
            continue
        a, b = prev["t"], r["t"]
        if (t0 is not None and a < t0) or (t1 is not None and b > t1) \
                or any(s < b and a < e for s, e in spans) \
                or (inside is not None and not any(s <= a and b <= e for s, e in inside)):
            continue
        n += 1
        total += b - a
    return n / total if n and total > 0 else None


def window_rate(timeline: Iterable[dict[str, Any]], replicas: int, t0: float,
                t1: float) -> float | None:
    """The fault-free rate for a window ``[t0, t1)`` of faults: ``steady_rate``
    in the window, or where it has no fault-free step (a replacement still
    setting up at every kill), in the whole run (its start and end without
    kills), processes setting up (``setup_spans``) left out either way."""
    tl = list(timeline)
    busy = setup_spans(tl)
    return steady_rate(tl, replicas, t0, t1, busy) or steady_rate(tl, replicas, busy=busy)
