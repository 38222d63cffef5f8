"""DDP with several gradient buckets across real replica processes: a
replica that starts while the others are many steps in cuts the same
buckets (no rebuild after the first step); torchft's DDP and ours in one
job average each other's gradients, and a torchft replica heals from ours;
a model with a parameter that never gets a gradient costs each replica
one step, then trains.
(tests/py/helpers/train_harness.py,
tests/py/helpers/train_worker.py --buckets)
"""

from __future__ import annotations

from train_harness import IMPL, impl_has, job_factory, require_api, wait_for, zygote  # noqa: F401

import pytest

require_api()

BUCKETS = ("--buckets",)


def test_late_replica_cuts_the_same_buckets(job_factory):
    # quorums wait up to 5 s for a live replica that has not asked yet (200
    # ms left a replica slowed by a busy host out of some, and the steps
    # of all three counted below with it)
    job = job_factory(min_replicas=2, join_timeout_ms=5000)
    for rid in ("train_0", "train_1"):
        job.start_group(rid, 1, "--steps", "400", *BUCKETS, "--step-sleep", "0.02")
    wait_for(lambda: job.all_committed(8, ["train_0", "train_1"]), 60,
             "the first two replicas to commit 8 steps", job)
    # a fresh DDP joins replicas whose DDP has run for many steps
    job.start_group("train_2", 1, "--steps", "400", *BUCKETS)
    wait_for(lambda: [e for e in job.steps("train_2") if e["ok"] and e["n"] == 3], 60,
             "the late replica to commit with the others", job)
    target = job.committed("train_0") + 6
    job.stop_at(target)
    for rid in ("train_0", "train_1", "train_2"):
        assert job.wait_exit(rid, 60) == [0], job.summary()
    late = job.steps("train_2")
    assert late and late[0]["healed"], late[:2]
    assert all(e["ok"] for e in late), [e for e in late if not e["ok"]]
    assert sum(e["n"] == 3 for e in late) >= 5
    job.assert_identical(target - 2)


def test_torchft_and_stepguard_replicas_share_buckets(job_factory):
    if IMPL != "stepguard":
        pytest.skip("mixes the two implementations itself")
    steps = 10
    job = job_factory(min_replicas=3)
    # same weights from the start and no step-0 heal: this one is about the
    # gradients alone (healing: test_torchft_replica_heals_from_...)
    same = ("--steps", str(steps), *BUCKETS, "--same-init", "--no-init-sync")
    job.start_group("train_0", 1, *same)
    job.start_group("train_1", 1, *same, impl="torchft")
    job.start_group("train_2", 1, *same)
    for rid in ("train_0", "train_1", "train_2"):
        assert job.wait_exit(rid, 120) == [0], job.summary()
    for e in job.steps():
        assert e["ok"] and e["n"] == 3, e
    assert job.assert_identical(steps) == steps


def test_unused_parameter_costs_each_replica_one_step(job_factory):
    steps = 8
    job = job_factory(min_replicas=2)
    rids = ("train_0", "train_1")
    for rid in rids:
        job.start_group(rid, 1, "--steps", str(steps), *BUCKETS, "--unused-param")
    for rid in rids:
        assert job.wait_exit(rid, 90) == [0], job.summary()
    for rid in rids:
        evs = job.steps(rid)
        failed = [e for e in evs if not e["ok"]]
        if IMPL == "stepguard":
            assert len(failed) == 1, failed
            assert "received no gradient" in (failed[0]["err"] or ""), failed
        else:  # torchft searches for unused parameters from the start
            assert not failed, failed
        assert [e["step"] for e in evs if e["ok"]] == list(range(1, steps + 1))
    job.assert_identical(steps - 1)


def test_torchft_replica_heals_from_stepguard_replicas(job_factory):
    """Default checkpoint transports on both sides: a torchft replica heals
    from a stepguard replica at step 0 (init_sync, different initial weights
    in every replica) and again after a kill and a restart (over HTTP from
    our NativeTransport's metadata, while our replicas heal natively), then
    every replica trains bit-identically."""
    if IMPL != "stepguard":
        pytest.skip("mixes the two implementations itself")
    job = job_factory(hard_timeout=240, min_replicas=3)
    args = ("--steps", "400", *BUCKETS, "--step-sleep", "0.02")
    # train_0 sorts first: the primary every replica heals from at step 0
    job.start_group("train_0", 1, *args)
    job.start_group("train_1", 1, *args, impl="torchft")
    job.start_group("train_2", 1, *args)
    wait_for(lambda: job.all_committed(4), 120, "3 replicas to commit 4 steps", job)
    # without the step-0 heal the first steps' weights would differ
    assert not job.events("train_0", ev="loaded")
    for rid in ("train_1", "train_2"):
        assert job.events(rid, inc=0, ev="loaded"), f"{rid} did not heal at step 0"
    for e in job.steps():
        assert e["ok"] and e["n"] == 3, e
    job.kill_group("train_1")
    job.restart_group("train_1")
    wait_for(lambda: job.events("train_1", inc=1, ev="loaded"), 90,
             "the restarted torchft replica to heal from the stepguard replicas", job)
    wait_for(lambda: job.committed("train_1") >= job.committed("train_0") - 1
             and job.committed("train_1") > 4, 60, "the restarted replica to commit", job)
    target = job.committed("train_0") + 4
    job.stop_at(target)
    for rid in ("train_0", "train_1", "train_2"):
        assert job.wait_exit(rid, 60) == [0], job.summary()
    assert job.committed("train_1") == target
    assert [e for e in job.steps("train_1", inc=1) if e["ok"]], job.summary()
    job.assert_identical(target - 2)
