"""How trainers are launched and restarted, in real processes: a replica
group started by a real torchrun, a whole-job restart from disk checkpoints
that include Manager.state_dict(), and a trainer with live DataLoader
workers SIGKILLed (its forked workers must not keep it looking alive).
(tests/py/helpers/train_harness.py, tests/py/helpers/train_worker.py)
"""

from __future__ import annotations

import time

import pytest

from train_harness import IMPL, LIGHTHOUSE, job_factory, require_api, zygote, wait_for  # noqa: F401

require_api()

PACE = ("--step-sleep", "0.05")


def test_replica_group_under_torchrun(job_factory):
    steps = 10
    job = job_factory(min_replicas=2)
    job.start_group("train_0", 2, "--steps", str(steps), torchrun=True)
    job.start_group("train_1", 2, "--steps", str(steps))
    assert job.wait_exit("train_0", 90) == [0], job.summary()
    assert job.wait_exit("train_1", 90) == [0, 0], job.summary()
    starts = {(e["rid"], e["g"]): e for e in job.events(ev="start")}
    assert starts[("train_0", 0)]["torchrun"] and starts[("train_0", 1)]["torchrun"]
    assert not starts[("train_1", 0)]["torchrun"]
    # both ranks are children of torchrun's agent, which the test started
    torchrun_pid = job.groups["train_0"].popens[0].pid
    assert starts[("train_0", 0)]["ppid"] == starts[("train_0", 1)]["ppid"] == torchrun_pid
    job.assert_identical(2 * steps)


def test_whole_job_restart_from_disk_checkpoint(job_factory):
    job = job_factory(min_replicas=2)
    rids = ("train_0", "train_1")
    for rid in rids:
        job.start_group(rid, 1, "--steps", "400", "--ckpt-every", "3", *PACE)
    wait_for(lambda: job.all_committed(8), 60, "8 committed steps", job)
    for rid in rids:  # the whole job dies
        job.kill_group(rid)
    # the checkpoint on disk: the last one "saved", or a later one renamed
    # into place just before the kill, before its "saved" was written
    on_disk = {rid: {e["step"]: e for e in job.events(rid, ev="saved")[-1:]
                     + job.events(rid, ev="saving")[-1:]} for rid in rids}
    assert all(min(s) >= 6 for s in on_disk.values()), on_disk
    for rid in rids:
        job.restart_group(rid, "--resume")
    saved = {}
    for rid in rids:
        resumed = wait_for(lambda: job.events(rid, inc=1, ev="resumed"), 60,
                           f"{rid} to resume", job)
        assert resumed[0]["step"] in on_disk[rid], (resumed, on_disk[rid])
        saved[rid] = on_disk[rid][resumed[0]["step"]]
    top = max(s["step"] for s in saved.values())
    wait_for(lambda: all(job.committed(rid) >= top + 3 for rid in rids), 60,
             "3 steps after the restart", job)
    for rid in rids:
        resumed = job.events(rid, inc=1, ev="resumed")
        assert len(resumed) == 1, resumed
        # the checkpoint restored the manager's step and counters, and the weights
        assert resumed[0]["step"] == saved[rid]["step"], (resumed, saved[rid])
        assert resumed[0]["hash"] == saved[rid]["hash"]
        before_kill = [e for e in job.steps(rid, inc=0) if e["ok"] and e["step"] == saved[rid]["step"]]
        assert resumed[0]["batches"] == before_kill[0]["batches"]
        first = job.steps(rid, inc=1)[0]
        assert first["before"] == top, first  # not step 0
    target = max(job.committed(rid) for rid in rids) + 2
    job.stop_at(target)
    for rid in rids:
        assert job.wait_exit(rid, 60) == [0], job.summary()
    # the replayed steps give the very bits of the first run (hashes() asserts
    # one hash per rank and step across incarnations) and replicas agree
    job.assert_identical(target - 1)
    replayed = [e for e in job.steps("train_0", inc=1) if e["ok"]]
    assert replayed, "no step after the restart"


def test_trainer_with_dataloader_workers_killed(job_factory):
    if LIGHTHOUSE != "ours":
        pytest.skip("measures our lighthouse's crash detection")
    if IMPL == "torchft":
        # measured: its forked DataLoader workers inherit the manager's
        # lighthouse connection, and no quorum drops the trainer within 40 s
        pytest.skip("torchft's sockets outlive the trainer in its forked workers")
    # heartbeat timeout 60 s, join timeout 600 s, and DataLoader workers that
    # check for their parent's death every 600 s (torch: 5 s): only the
    # trainer's own connection, closed by its death and by nothing else,
    # can make the survivors' quorum drop it quickly
    job = job_factory(min_replicas=2, join_timeout_ms=600_000, heartbeat_timeout_ms=60_000)
    for i in range(3):
        job.start_group(f"train_{i}", 1, "--steps", "400", "--data-workers", "2",
                        "--loader-watchdog", "600", *PACE)
    wait_for(lambda: job.all_committed(3), 60, "3 committed steps", job)
    wait_for(lambda: all(e["n"] == 3 for e in job.steps("train_0")[-2:]), 60,
             "a quorum of all three", job)
    loaders = job.child_pids("train_2")
    assert len(loaders) >= 2, f"train_2 has no live DataLoader workers: {loaders}"
    n0 = len(job.steps("train_0"))
    t0 = time.time()
    job.kill_group("train_2")  # the trainer only: its DataLoader workers live on
    e = wait_for(lambda: next((e for e in job.steps("train_0")[n0:] if e["ok"] and e["n"] == 2),
                              None), 40, "a committed step of the two survivors", job)
    took = e["t"] - t0
    print(f"survivors committed without the killed trainer after {took:.2f} s "
          f"(heartbeat timeout 60 s)")
    assert took < 15, f"{took:.1f} s: the killed trainer still looked alive"
    after = job.committed("train_0") + 2
    wait_for(lambda: job.all_committed(after, ["train_0", "train_1"]), 30,
             "the survivors to keep committing", job)
