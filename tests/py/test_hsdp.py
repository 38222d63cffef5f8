"""FT-HSDP on CPU: FSDP2 inside replica groups of two ranks (Gloo), the
Manager across groups; real processes (tests/py/helpers/hsdp_worker.py).

After every committed step each rank logs a hash of the full (unsharded)
parameters and optimizer state: replica groups at the same step must agree.

The scenarios cover the options pairwise, not as a full product (each line
is one test):

    groups kill          transport cross-pg algo     precision wiring  quorum
    3      group         native    gloo     hsdp     fp32      helper  async
    2      rank 1        http      tcp      hsdp     bf16      torchft async
    3      during heal   native    tcp      hsdp     bf16      helper  sync
    2      group         native    gloo     diloco   fp32      -       sync
    2      group         http      gloo     localsgd bf16      -       async
    2      20 heals      native    gloo     hsdp     fp32      helper  async

``make test-hsdp-matrix`` runs the full product of the cheap axes.  On a
GPU, one more: two groups of one rank each on CUDA (NCCL inside, bf16,
Gloo across), a group killed and healed (scripts/gpu-check; it skips
without a GPU).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from train_harness import _kill, job_factory, require_cuda, wait_for, zygote  # noqa: F401

pytestmark = pytest.mark.skipif(
    os.environ.get("STEPGUARD_TRAIN_IMPL", "stepguard") != "stepguard",
    reason="FT-HSDP scenarios use stepguard's API (stepguard.hsdp)")


# the trainers run until finish() tells them where to stop: a group that is
# still healing when the others are done would wait for a quorum forever
LONG = 100000


def hsdp_job(job_factory, hard_timeout=240, **kw):
    return job_factory(hard_timeout=hard_timeout, worker="hsdp_worker",
                       heartbeat_timeout_ms=2000, **kw)


def start(job, n, steps, *args):
    for i in range(n):
        job.start_group(f"hsdp_{i}", 2, "--steps", str(steps), *args)


def kill_restart(job, rid, *, rank=None):
    """SIGKILLs the group (or one rank of it, then the rest, as a launcher
    ends a group whose rank died) and starts its next incarnation."""
    if rank is not None:
        g = job.groups[rid]
        pid = next(e["pid"] for e in job.events(rid, g=rank, inc=g.incarnation, ev="start"))
        _kill(pid)
        g.popens[rank].wait(timeout=30)
    job.kill_group(rid)
    job.restart_group(rid)


def healed_and_committed(job, rid):
    g = job.groups[rid]
    return all(any(e["ok"] and e["step"] > 1 for e in job.steps(rid, g=r, inc=g.incarnation))
               for r in range(g.ranks))


def finish(job, compared):
    """Stops every trainer a few steps past the furthest one, waits for all
    to finish, and checks what every scenario checks."""
    top = max(job.committed(rid, r) for rid, g in job.groups.items() for r in range(g.ranks))
    job.stop_at(top + 3)
    wait_for(lambda: all(not job.alive(r) for r in job.groups), 150, "the run to end", job)
    for rid, g in job.groups.items():
        for r in range(g.ranks):
            done = job.events(rid, g=r, inc=g.incarnation, ev="done")
            assert done, f"{rid} g{r} did not finish\n{job.summary()}"
    assert not job.events(ev="unsafe_read"), job.events(ev="unsafe_read")
    job.assert_identical(min_compared=compared)


def test_three_groups_kill_one_min_replicas(job_factory):
    job = hsdp_job(job_factory, min_replicas=2)
    start(job, 3, LONG, "--min-replica-size", "2")
    wait_for(lambda: job.all_committed(3), 90, "every group to commit step 3", job)
    kill_restart(job, "hsdp_2")
    wait_for(lambda: healed_and_committed(job, "hsdp_2"), 90, "hsdp_2 to heal", job)
    finish(job, 10)
    # never committed with fewer than min_replica_size participants
    low = [e for e in job.steps() if e["ok"] and e["n"] < 2]
    assert not low, low[:3]
    # the cross-replica functional collectives saw every participant (in a
    # quorum where nobody heals: a healer contributes zeros, and at step 0
    # every replica but one heals from it)
    healing = {e["step"] for e in job.steps() if e["healing"] or e["before"] == 0}
    full = [e for e in job.steps() if e["ok"] and e["n"] == 3 and e["step"] not in healing]
    assert full and all(e["sum"] == 6.0 and e["max"] == 3.0 for e in full), full[:3]


def test_kill_rank1_http_tcp_bf16_torchft_wiring(job_factory):
    job = hsdp_job(job_factory)
    start(job, 2, LONG, "--transport", "http", "--pg", "tcp", "--mixed-precision",
          "--wiring", "torchft")
    wait_for(lambda: job.all_committed(3), 90, "both groups to commit step 3", job)
    kill_restart(job, "hsdp_1", rank=1)
    wait_for(lambda: healed_and_committed(job, "hsdp_1"), 90, "hsdp_1 to heal", job)
    finish(job, 8)


def test_kill_during_heal(job_factory):
    """A source killed while a group heals from it, then the healer itself
    killed between receiving the state and loading it: both forced by the
    heal hook, and the job goes on to identical replicas.  (A quorum needs
    two replicas: a restarted group never trains on its own.)"""
    job = hsdp_job(job_factory, min_replicas=2, join_timeout_ms=1000)
    start(job, 3, LONG, "--pg", "tcp", "--mixed-precision", "--sync-quorum",
          "--min-replica-size", "2")
    wait_for(lambda: job.all_committed(3), 90, "every group to commit step 3", job)
    d = Path(job.dir)

    def paused(rid):
        return all((d / f"paused.{rid}.g{r}").exists() for r in range(2))

    # 1. the healer stops with the sources' addresses in hand; a source dies
    job.kill_group("hsdp_2")
    job.groups["hsdp_2"].args += ("--pause-at", "fetch")
    job.restart_group("hsdp_2")
    wait_for(lambda: paused("hsdp_2"), 90, "hsdp_2 to reach its fetch", job)
    job.kill_group("hsdp_0")
    (d / "resume").write_text("go")
    wait_for(lambda: healed_and_committed(job, "hsdp_2"), 120, "hsdp_2 to heal", job)
    job.restart_group("hsdp_0")
    wait_for(lambda: healed_and_committed(job, "hsdp_0"), 120, "hsdp_0 to heal", job)
    # 2. the healer dies with the state received but not loaded
    (d / "resume").unlink()
    job.kill_group("hsdp_1")
    job.groups["hsdp_1"].args += ("--pause-at", "fetched")
    job.restart_group("hsdp_1")
    wait_for(lambda: paused("hsdp_1"), 90, "hsdp_1 to receive the state", job)
    job.groups["hsdp_1"].args = job.groups["hsdp_1"].args[:-2]
    kill_restart(job, "hsdp_1")
    wait_for(lambda: healed_and_committed(job, "hsdp_1"), 120, "hsdp_1 to heal", job)
    finish(job, 10)


def test_diloco_over_fsdp2(job_factory):
    job = hsdp_job(job_factory)
    start(job, 2, LONG, "--algo", "diloco")
    wait_for(lambda: job.all_committed(2), 90, "both groups to sync twice", job)
    kill_restart(job, "hsdp_1")
    wait_for(lambda: healed_and_committed(job, "hsdp_1"), 90, "hsdp_1 to heal", job)
    finish(job, 5)


def test_localsgd_over_fsdp2_http_bf16(job_factory):
    job = hsdp_job(job_factory)
    start(job, 2, LONG, "--algo", "localsgd", "--transport", "http", "--mixed-precision")
    wait_for(lambda: job.all_committed(2), 90, "both groups to sync twice", job)
    kill_restart(job, "hsdp_1")
    wait_for(lambda: healed_and_committed(job, "hsdp_1"), 90, "hsdp_1 to heal", job)
    finish(job, 5)


def test_cuda_one_rank_groups_heal_sharded_state(job_factory):
    """FT-HSDP on one GPU: two replica groups of one rank each (FSDP2 over a
    1-rank CUDA mesh, NCCL inside, bf16 parameters, Gloo across); the
    survivor sleeps in its forward pass while a killed group's replacement
    heals its CUDA shards from it: never read mid-forward, and identical
    after.  Skips without a GPU (scripts/gpu-check runs it on one)."""
    require_cuda("FT-HSDP on CUDA")
    job = hsdp_job(job_factory)
    job.start_group("hsdp_0", 1, "--steps", str(LONG), "--device", "cuda",
                    "--mixed-precision", "--forward-sleep", "0.3")
    job.start_group("hsdp_1", 1, "--steps", str(LONG), "--device", "cuda",
                    "--mixed-precision")
    wait_for(lambda: job.all_committed(3), 90, "both groups to commit step 3", job)
    kill_restart(job, "hsdp_1")
    wait_for(lambda: healed_and_committed(job, "hsdp_1"), 90, "hsdp_1 to heal", job)
    finish(job, 6)
    assert job.events("hsdp_1", g=0, ev="loaded")


HEALS = int(os.environ.get("STEPGUARD_HSDP_HEALS", "20"))


def test_state_never_read_mid_forward(job_factory):
    """Every heal overlaps the source's forward pass (it sleeps there, with
    FSDP's parameters unsharded); the state is never read then, and every
    heal succeeds, {HEALS} times over."""
    job = hsdp_job(job_factory, hard_timeout=120 + 12 * HEALS)
    job.start_group("hsdp_0", 2, "--steps", "100000", "--forward-sleep", "0.3")
    job.start_group("hsdp_1", 2, "--steps", "100000")
    wait_for(lambda: job.all_committed(2), 90, "both groups to commit step 2", job)
    for _ in range(HEALS):
        kill_restart(job, "hsdp_1")
        wait_for(lambda: healed_and_committed(job, "hsdp_1"), 60, "hsdp_1 to heal", job)
    finish(job, HEALS)
    heals = [e for e in job.events("hsdp_1", g=0, ev="loaded")]
    assert len(heals) >= HEALS, len(heals)


def test_negative_control_reading_on_the_quorum_thread_is_caught(job_factory):
    """The same overlap with the Manager reading the state where its quorum
    runs (as torchft does): the worker's check sees a read in the middle of
    the forward or backward pass, so the test above can fail."""
    job = hsdp_job(job_factory)
    job.start_group("hsdp_0", 2, "--steps", "100000", "--forward-sleep", "0.3",
                    "--read-state-anywhere")
    job.start_group("hsdp_1", 2, "--steps", "100000", "--read-state-anywhere")
    wait_for(lambda: job.all_committed(2), 90, "both groups to commit step 2", job)
    kill_restart(job, "hsdp_1")
    wait_for(lambda: job.events(ev="unsafe_read"), 60, "a read during the forward pass", job)


test_state_never_read_mid_forward.__doc__ = test_state_never_read_mid_forward.__doc__.format(
    HEALS=HEALS)


# the full product of the cheap axes: make test-hsdp-matrix
MATRIX = list(itertools.product(("native", "http"), ("gloo", "tcp"), (False, True),
                                ("helper", "torchft"), (False, True)))


@pytest.mark.long
@pytest.mark.parametrize("transport,pg,bf16,wiring,sync", MATRIX)
def test_matrix(job_factory, transport, pg, bf16, wiring, sync):
    job = hsdp_job(job_factory)
    args = ["--transport", transport, "--pg", pg, "--wiring", wiring]
    args += ["--mixed-precision"] if bf16 else []
    args += ["--sync-quorum"] if sync else []
    start(job, 2, LONG, *args)
    wait_for(lambda: job.all_committed(3), 90, "both groups to commit step 3", job)
    kill_restart(job, "hsdp_1")
    wait_for(lambda: healed_and_committed(job, "hsdp_1"), 90, "hsdp_1 to heal", job)
    finish(job, 6)
