"""A hung replica costs the survivors a heartbeat timeout, not an operation
timeout (real processes): one group is SIGSTOPped mid-training with a 60 s
operation timeout and ProcessGroupTCP's progress deadline off (so only the
lighthouse's report can end the wait); the lighthouse holds it unhealthy
after its 1 s heartbeat timeout and says so in the survivors' heartbeat
answers, their managers abort the step's collectives (group rank 0 from
the report, the other group ranks from their long poll to it), and they
commit again without it.  The woken group fails its step, rejoins through
a heal, and every replica ends bitwise identical, nothing committed lost
or doubled.
(tests/py/helpers/train_harness.py, tests/py/helpers/train_worker.py)
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from train_harness import job_factory, require_api, zygote, wait_for  # noqa: F401

require_api()

RIDS = ("train_0", "train_1", "train_2")
SURVIVORS = RIDS[:2]
VICTIM = RIDS[2]


def assert_no_step_lost_or_doubled(job, ranks: int) -> None:
    """Each rank's committed steps only go up, one at a time, except where
    it healed (a jump to the others' step); every rank ends at one step."""
    done = set()
    for rid in RIDS:
        for g in range(ranks):
            prev = None
            for e in job.steps(rid, g=g):
                if not e["ok"]:
                    continue
                if prev is not None:
                    assert e["step"] > prev, (rid, g, prev, e)
                    assert e["step"] == prev + 1 or e["healed"], (rid, g, prev, e)
                prev = e["step"]
            done |= {e["step"] for e in job.events(rid, g=g, ev="done")}
    assert len(done) == 1, done


@pytest.mark.parametrize("ranks", [1, 2])
def test_hung_group_costs_survivors_a_heartbeat_timeout(job_factory, ranks):
    job = job_factory(hard_timeout=300, heartbeat_timeout_ms=1000)
    hang_at = 8
    for rid in RIDS:
        # the victim stops in the middle of step hang_at, after joining its
        # quorum: the survivors are then inside that step's allreduce
        mid = ("--mid-at", str(hang_at), "--mid-sleep", "14") if rid == VICTIM else ()
        job.start_group(rid, ranks, "--steps", "100000", "--step-sleep", "0.05",
                        "--timeout", "60", "--pg", "tcp", "--progress-timeout", "0",
                        *mid)
    mids = wait_for(lambda: len(job.events(VICTIM, ev="mid")) == ranks
                    and job.events(VICTIM, ev="mid"), 120, "the victim mid-step", job)
    # the step it stops in: hang_at, or the first after it that it took
    # part in (had it come too late for hang_at's quorum and healed past it)
    hang_at = mids[0]["step"]
    assert all(m["step"] == hang_at for m in mids), mids
    pids = job.worker_pids(VICTIM)
    assert len(pids) == ranks
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        base = max(job.committed(rid, g) for rid in SURVIVORS for g in range(ranks))
        # the 60 s operation timeout would make this impossible; the
        # heartbeat timeout (1 s) plus a step does it
        wait_for(lambda: job.all_committed(base + 2, SURVIVORS), 30,
                 "the survivors to commit 2 steps without the hung group", job)
        stall = time.monotonic() - t0
        assert stall < 10, f"survivors stalled {stall:.1f} s"
        for rid in SURVIVORS:
            for g in range(ranks):
                ok = [e for e in job.steps(rid, g=g) if e["ok"] and e["step"] > base]
                assert ok and all(e["n"] == 2 for e in ok), (rid, g, ok)
        time.sleep(max(0.0, 12 - (time.monotonic() - t0)))  # hung 12 s in all
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    # the woken group's step failed (no zombie commit of a discarded step)
    for g in range(ranks):
        wait_for(lambda: [e for e in job.steps(VICTIM, g=g) if e["before"] == hang_at],
                 60, "the woken group to end its step", job)
        woke = [e for e in job.steps(VICTIM, g=g) if e["before"] == hang_at]
        assert not woke[0]["ok"], woke[0]
    # it rejoins (same process) and trains with the others
    wait_for(lambda: all(any(e["ok"] and e["n"] == 3 and e["step"] > base + 2
                             for e in job.steps(VICTIM, g=g, inc=0))
                         for g in range(ranks)), 90,
             "the woken group to commit with the others again", job)
    target = max(job.committed(rid, g) for rid in RIDS for g in range(ranks)) + 3
    job.stop_at(target)
    for rid in RIDS:
        assert job.wait_exit(rid, 90) == [0] * ranks, job.summary()
    job.assert_identical(target // 2)
    assert_no_step_lost_or_doubled(job, ranks)
