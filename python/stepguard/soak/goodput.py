"""Goodput: the one definition (the soak and ``bench/e2e.py`` use it).

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

__all__ = ["committed_replica_steps", "fault_free_rate", "goodput", "kill_window",
           "rate_from_step_times"]


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
