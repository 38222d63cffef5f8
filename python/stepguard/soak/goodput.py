"""Goodput: the one definition (the soak and ``bench/e2e.py`` use it).

    goodput = committed replica-steps
              / (replicas x fault-free step rate x wall time)

A *replica-step* is one replica group committing one step (its group rank
0's commit record in the launcher's timeline).  The *fault-free step rate*
is measured in the same run, on the same machine (steps per second of one
replica while every replica trains and nothing is injected), so 1.0 means
the faults cost nothing and 0.5 that half the possible work was done.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

__all__ = ["committed_replica_steps", "fault_free_rate", "goodput",
           "rate_from_step_times"]


def goodput(replica_steps: int, replicas: int, rate: float, wall_s: float) -> float | None:
    """The definition above; None when it is undefined (no rate or time)."""
    if replicas <= 0 or rate <= 0 or wall_s <= 0:
        return None
    return replica_steps / (replicas * rate * wall_s)


def committed_replica_steps(timeline: Iterable[dict[str, Any]], t0: float | None = None,
                            t1: float | None = None) -> int:
    """Commit records of group rank 0 with ``t0 <= t < t1``."""
    return sum(1 for r in timeline
               if r.get("event") == "commit" and r.get("rank", 0) == 0
               and (t0 is None or r["t"] >= t0) and (t1 is None or r["t"] < t1))


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
