"""A hung replica costs the survivors a heartbeat timeout, not an operation
timeout (real processes): one group is SIGSTOPped mid-training with a 60 s
operation timeout; the lighthouse holds it unhealthy after its 1 s
heartbeat timeout and says so in the survivors' heartbeat answers, their
managers abort the step's collectives, and they commit again without it.
The woken group fails its step, rejoins through a heal, and every replica
ends bitwise identical.
(tests/py/helpers/train_harness.py, tests/py/helpers/train_worker.py)
"""

from __future__ import annotations

import os
import signal
import time

from train_harness import job_factory, require_api, zygote, wait_for  # noqa: F401

require_api()

RIDS = ("train_0", "train_1", "train_2")
SURVIVORS = RIDS[:2]


def test_hung_group_costs_survivors_a_heartbeat_timeout(job_factory):
    job = job_factory(hard_timeout=240, heartbeat_timeout_ms=1000)
    hang_at = 8
    for rid in RIDS:
        # the victim stops in the middle of step hang_at, after joining its
        # quorum: the survivors are then inside that step's allreduce
        mid = ("--mid-at", str(hang_at), "--mid-sleep", "14") if rid == "train_2" else ()
        job.start_group(rid, 1, "--steps", "100000", "--step-sleep", "0.05",
                        "--timeout", "60", "--pg", "tcp", *mid)
    wait_for(lambda: job.events("train_2", ev="mid"), 90, "the victim mid-step", job)
    pid = job.worker_pids("train_2")[0]
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        base = max(job.committed(rid) for rid in SURVIVORS)
        # the 60 s operation timeout would make this impossible; the
        # heartbeat timeout (1 s) plus a step does it
        wait_for(lambda: job.all_committed(base + 2, SURVIVORS), 30,
                 "the survivors to commit 2 steps without the hung group", job)
        stall = time.monotonic() - t0
        assert stall < 10, f"survivors stalled {stall:.1f} s"
        ok = [e for e in job.steps("train_0") if e["ok"] and e["step"] > base]
        assert ok and all(e["n"] == 2 for e in ok), ok
        time.sleep(max(0.0, 12 - (time.monotonic() - t0)))  # hung 12 s in all
    finally:
        os.kill(pid, signal.SIGCONT)
    # the woken group rejoins (same process) and trains with the others
    wait_for(lambda: any(e["ok"] and e["n"] == 3 and e["step"] > base + 2
                         for e in job.steps("train_2", inc=0)), 60,
             "the woken group to commit with the others again", job)
    target = max(job.committed(rid) for rid in RIDS) + 3
    job.stop_at(target)
    for rid in RIDS:
        assert job.wait_exit(rid, 90) == [0], job.summary()
    job.assert_identical(target - 1)
