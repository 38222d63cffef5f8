"""Healthy data-parallel training through the torchft-compatible API, in real
processes: replicas at the same committed step hold bitwise-identical
parameters, and the step-0 synchronisation and spare replicas behave as
torchft's do.  (tests/py/helpers/train_harness.py, tests/py/helpers/train_worker.py)
"""

from __future__ import annotations

import pytest

from train_harness import IMPL, impl_has, job_factory, require_api, zygote  # noqa: F401

require_api()

PGS = ["gloo", "tcp"]


@pytest.fixture(scope="module")
def have_tcp() -> bool:
    return impl_has("process_group.ProcessGroupTCP")


@pytest.mark.parametrize("pg", PGS)
@pytest.mark.parametrize("ranks", [1, 2])
def test_healthy_replicas_stay_bitwise_identical(job_factory, ranks, pg, have_tcp):
    if pg == "tcp" and not have_tcp:
        pytest.skip(f"{IMPL}.process_group.ProcessGroupTCP does not exist")
    steps = 20
    job = job_factory(min_replicas=3)
    rids = [f"train_{i}" for i in range(3)]
    for rid in rids:
        job.start_group(rid, ranks, "--steps", str(steps), "--pg", pg)
    for rid in rids:
        assert job.wait_exit(rid, 90) == [0] * ranks, job.summary()
    # each replica starts from its own random weights: the step-0 sync is
    # what makes them equal
    for g in range(ranks):
        ready = {e["rid"]: e["hash"] for e in job.events(g=g, ev="ready")}
        assert len(set(ready.values())) == 3, ready
    compared = job.assert_identical(steps * ranks)
    assert compared == steps * ranks
    for e in job.steps():
        assert e["ok"] and e["n"] == 3, e
    # every replica group committed every step, in order
    for rid in rids:
        for g in range(ranks):
            assert [e["step"] for e in job.steps(rid, g=g)] == list(range(1, steps + 1))


def test_without_init_sync_replicas_keep_their_own_weights(job_factory):
    steps = 6
    job = job_factory(min_replicas=2)
    for rid in ("train_0", "train_1"):
        job.start_group(rid, 1, "--steps", str(steps), "--no-init-sync")
    for rid in ("train_0", "train_1"):
        assert job.wait_exit(rid, 90) == [0], job.summary()
    by_step = job.hashes()
    differing = [s for (g, s), h in by_step.items() if len(set(h.values())) == 2]
    # same averaged gradients, different starting points: never equal
    assert len(differing) == steps, by_step
    assert not job.events(ev="loaded"), "nothing should have been healed"


def test_fixed_with_spares_counts_only_min_replica_size(job_factory):
    steps = 8
    job = job_factory(min_replicas=3)
    rids = [f"train_{i}" for i in range(3)]
    for rid in rids:
        job.start_group(rid, 1, "--steps", str(steps), "--fixed-with-spares",
                        "--min-replica-size", "2")
    for rid in rids:
        assert job.wait_exit(rid, 90) == [0], job.summary()
    job.assert_identical(steps)
    for e in job.steps():
        assert e["ok"] and e["n"] == 2, e
    # exactly one spare per step: participating_rank() is None there
    by_step: dict[int, list] = {}
    for e in job.steps():
        by_step.setdefault(e["before"], []).append(e["prank"])
    for step, pranks in by_step.items():
        assert sorted(pranks, key=lambda p: (p is None, p)) == [0, 1, None], (step, pranks)
