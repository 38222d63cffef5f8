"""A lighthouse outage costs no trainer and no committed step (real
processes): the lighthouse is SIGKILLed during training and restarted on
the same port; every trainer waits in its quorum, none exits, and the job
goes on from the step it had reached, replicas bitwise identical.
(tests/py/helpers/train_harness.py, tests/py/helpers/train_worker.py)
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from train_harness import Job, job_factory, require_api, zygote, wait_for  # noqa: F401

require_api()

RIDS = ("train_0", "train_1", "train_2")


def run_outage(job: Job, down_s: float, *worker_args: str) -> None:
    """The job's lighthouse has min_replicas 3: every quorum holds all three
    trainers, so none trains alone while the others start (or reconnect
    after the restart), and every committed step is held by all three (the
    id file's last quorum too)."""
    for rid in RIDS:
        job.start_group(rid, 1, "--steps", "100000", "--step-sleep", "0.05",
                        *worker_args)
    wait_for(lambda: job.all_committed(5, RIDS), 90, "every group to commit 5 steps", job)
    job.kill_lighthouse()
    reached = {rid: job.committed(rid) for rid in RIDS}
    time.sleep(down_s)
    # nobody exited while the lighthouse was down
    assert all(job.alive(rid) for rid in RIDS), job.summary()
    job.restart_lighthouse()
    top = max(reached.values())
    wait_for(lambda: job.all_committed(top + 5, RIDS), 90,
             "every group to commit 5 more steps after the restart", job)
    # the same processes (incarnation 0) went on from the steps they had
    # reached, and quorum ids never went backwards
    job.assert_went_on(RIDS, reached)


@pytest.mark.parametrize("id_file", [False, True])
def test_lighthouse_restart_costs_no_trainer(job_factory, tmp_path, id_file):
    args = ("--quorum_id_file", str(tmp_path / "qid")) if id_file else ()
    job = job_factory(hard_timeout=240, lighthouse_args=args,
                      heartbeat_timeout_ms=2000, min_replicas=3)
    run_outage(job, 5.0)
    if id_file:
        # the id file holds the last quorum: its id and the step the job
        # reached, then its members
        lines = (tmp_path / "qid").read_text().splitlines()
        qid, step = (int(v) for v in lines[0].split())
        assert qid > 0 and step >= 5, lines[0]  # every group had committed 5
        assert sorted(m.split(":")[0] for m in lines[1:]) == list(RIDS), lines


def test_lighthouse_down_longer_than_a_quorum_timeout(job_factory):
    # each quorum round gives up at its 3 s deadline; the Manager asks again
    job = job_factory(hard_timeout=240, heartbeat_timeout_ms=2000, min_replicas=3)
    run_outage(job, 8.0, "--quorum-timeout", "3")


def test_a_hold_longer_than_a_quorum_timeout_costs_no_trainer(job_factory):
    """The lighthouse holds a newcomer's quorum while the only replica
    holding the job's step hangs (the step floor: issuing it would start the
    job over).  The hold outlasts the newcomer's quorum timeout several
    times; the newcomer waits it out, as through an outage, and heals from
    the replica once it is back."""
    job = job_factory(hard_timeout=240, heartbeat_timeout_ms=1000,
                      lighthouse_args=("--state_loss_wait_ms", "120000"))
    job.start_group("train_0", 1, "--steps", "100000", "--step-sleep", "0.05")
    wait_for(lambda: job.committed("train_0") >= 5, 90, "train_0 to commit 5 steps", job)
    hung = job.worker_pids("train_0")
    for pid in hung:
        os.kill(pid, signal.SIGSTOP)
    try:
        reached = job.committed("train_0")
        job.start_group("train_1", 1, "--steps", "100000", "--step-sleep", "0.05",
                        "--quorum-timeout", "2")
        log = job.dir / "logs" / f"train_1.i{job.groups['train_1'].incarnation}.log"
        wait_for(lambda: "holds the quorum" in log.read_text(errors="replace"), 90,
                 "train_1's quorum to be held", job)
        time.sleep(6.0)  # three of its quorum timeouts
        assert job.alive("train_1"), job.summary()
        assert job.committed("train_1") < 0, job.summary()  # nothing yet
        assert "Holding a quorum at step 0" in job.lighthouse_log.read_text()
    finally:
        for pid in hung:
            os.kill(pid, signal.SIGCONT)
    wait_for(lambda: job.committed("train_1") > reached, 90,
             "train_1 to heal from train_0 and commit", job)
    assert any(e["healed"] for e in job.steps("train_1")), job.summary()
    assert "starts over" not in job.lighthouse_log.read_text()
    # steps up to the heal were train_0's alone: not compared
    job.assert_went_on(("train_0", "train_1"), {"train_0": reached, "train_1": 0},
                       slack=reached + 1)
