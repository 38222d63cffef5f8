"""The data position survives crashes, in real processes: three replica
groups read one epoch through ManagedDataLoader (one of them with loader
worker processes) while the test discards a step everywhere, SIGKILLs a
replica in the middle of a step and another at a random point, and
restarts both (each heals from a peer); the number of participants goes
3, 2, 3, 2, 3.  The samples of the committed steps must be exactly the
epoch: no sample skipped, none repeated.
(tests/py/helpers/data_worker.py, tests/py/helpers/train_harness.py)
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from train_harness import Job, job_factory, zygote, wait_for  # noqa: F401

SAMPLES, BATCH = 900, 3
PACE = ("--step-sleep", "0.03")  # leave CPU for the restarts


def takes_and_commits(job: Job):
    """Every take event, and {step: [take that led to a commit]}, pairing
    each committed step event with the take before it in the same file."""
    takes, committed = [], defaultdict(list)
    for rid in job.groups:
        for inc in range(job.groups[rid].incarnation + 1):
            last = None
            for e in job.events(rid, inc=inc):
                if e["ev"] == "take":
                    takes.append(e)
                    last = e
                elif e["ev"] == "step":
                    if e["ok"]:
                        assert last is not None and last["step"] == e["before"], (rid, e)
                        committed[e["before"]].append(last)
                    last = None
    return takes, committed


def committed_steps(job: Job, rid: str, n: int | None = None) -> list[dict]:
    g = job.groups[rid]
    return [e for e in job.steps(rid, inc=g.incarnation)
            if e["ok"] and (n is None or e["n"] == n)]


def check_epoch(job: Job, samples: int = SAMPLES, ranks: int = 1) -> dict:
    """The committed steps' samples are exactly one epoch (plus the start
    of the next, without a repeat); returns counts for the caller."""
    takes, committed = takes_and_commits(job)
    steps = sorted(committed)
    assert steps == list(range(len(steps))), f"committed steps with gaps: {steps}"
    # every committer of a step read it from the same position and split
    pos, split = 0, {}
    for s in steps:
        # (a healer that commits its healing step did not take part in it)
        views = {(t["pos"], t["n"]) for t in committed[s] if t["prank"] is not None}
        assert len(views) == 1, f"step {s}: committers disagree: {committed[s]}"
        (p, n), = views
        assert p == pos, f"step {s} began at {p}, the previous steps end at {pos}"
        split[s] = (p, n)
        pos += n * ranks * BATCH
    assert pos >= samples
    # the same (step, position, split, rank) always serves the same batch:
    # a discarded step's batch is served again, by whoever reads that slice
    by_slice: dict[tuple, dict] = {}
    for t in takes:
        assert [k[1] for k in t["keys"]] == t["idx"], f"batch is not its slice: {t}"
        if t["prank"] is None:
            continue
        key = (t["step"], t["pos"], t["n"], t["prank"], t["g"])
        prev = by_slice.setdefault(key, t)
        assert (prev["keys"], prev["draw"]) == (t["keys"], t["draw"]), (prev, t)
    # a sample's random draw is its own, whoever reads it
    draws: dict[tuple, set] = defaultdict(set)
    readers: dict[tuple, set] = defaultdict(set)
    for t in takes:
        for k, d in zip(t["keys"], t["draw"]):
            draws[tuple(k)].add(d)
            readers[tuple(k)].add((t["rid"], t["inc"]))
    assert all(len(d) == 1 for d in draws.values()), \
        [(k, d) for k, d in draws.items() if len(d) > 1][:5]
    shared = sum(1 for r in readers.values() if len(r) > 1)
    # the samples of the committed steps
    seen = []
    for s in steps:
        p, n = split[s]
        for r in range(n):
            for g in range(ranks):
                t = by_slice.get((s, p, n, r, g))
                assert t is not None, f"step {s}: nobody logged participant {r}'s batch (g{g})"
                seen.extend(tuple(k) for k in t["keys"])
    epoch0 = sorted(i for e, i in seen if e == 0)
    assert epoch0 == list(range(samples)), (
        f"epoch 0: {len(epoch0)} samples, {len(set(epoch0))} distinct, "
        f"missing {sorted(set(range(samples)) - set(epoch0))[:10]}")
    rest = [k for k in seen if k[0] != 0]
    assert all(e == 1 for e, _ in rest) and len(rest) == len(set(rest)), rest
    return {"steps": len(steps), "shared": shared,
            "splits": sorted({n for _, n in split.values()})}


def test_one_epoch_under_kills_restarts_and_a_discarded_step(job_factory):
    job = job_factory(min_replicas=2, worker="data_worker", hard_timeout=240)
    common = ("--samples", str(SAMPLES), "--batch", str(BATCH), "--discard-at", "10", *PACE)
    job.start_group("data_0", 1, *common, "--data-workers", "2")
    job.start_group("data_1", 1, *common)
    job.start_group("data_2", 1, *common, "--mid-at", "16", "--mid-sleep", "60")
    # data_2 has read its batch of step 16 (or of the first step after it
    # that it took part in: "mid" says which) and run its forward pass; it
    # dies before its gradients reach the others, who discard the step
    mid = wait_for(lambda: job.events("data_2", ev="mid"), 90, "data_2 mid-step", job)[0]
    job.kill_group("data_2")
    wait_for(lambda: len(committed_steps(job, "data_0", n=2)) >= 3, 60,
             "3 steps of two replicas", job)
    job.restart_group("data_2", "--mid-at", "-1")
    wait_for(lambda: len(committed_steps(job, "data_2", n=3)) >= 3, 90,
             "the restarted data_2 to heal and commit 3 steps beside the others", job)
    # the replica whose loader has worker processes dies at a random point
    job.kill_group("data_0")
    wait_for(lambda: len(committed_steps(job, "data_1", n=2)) >= 3, 60,
             "3 steps of two replicas again", job)
    job.restart_group("data_0")
    for rid in ("data_0", "data_1", "data_2"):
        assert job.wait_exit(rid, 120) == [0], job.summary()
    got = check_epoch(job)
    assert got["splits"] == [2, 3], got
    assert got["shared"] > 0, "no sample was read by two processes"
    # the discarded step: each replica was served its batch again
    for rid in ("data_0", "data_1"):
        at = [e for e in job.events(rid, inc=0, ev="take") if e["step"] == 10]
        assert len(at) >= 2, f"{rid}: step 10 was not taken twice: {at}"
        a, b = at[0], at[1]
        assert (a["n"], a["prank"], a["pos"]) == (b["n"], b["prank"], b["pos"]), (a, b)
        assert a["keys"] == b["keys"] and a["draw"] == b["draw"], (a, b)
    # the step data_2 died in was discarded by the others in its quorum (a
    # survivor that came too late for that quorum was not in it), then
    # re-split between the two survivors
    with_victim = 0
    for rid in ("data_0", "data_1"):
        at = [e for e in job.steps(rid, inc=0) if e["before"] == mid["step"]]
        assert at and at[-1]["ok"] and at[-1]["n"] == 2, (rid, mid, at)
        if mid["qid"] is None or at[0]["qid"] == mid["qid"]:
            assert not at[0]["ok"], (rid, mid, at)
            with_victim += 1
    assert with_victim >= 1, "min_replicas=2: data_2's quorum held a survivor"
    # the replacements healed: their first committed step is a peer's
    for rid in ("data_0", "data_2"):
        first = committed_steps(job, rid)[0]
        assert first["before"] > 10, first
    job.assert_identical(10)


@pytest.mark.long
def test_one_epoch_sync_quorum(job_factory):
    job = job_factory(min_replicas=2, worker="data_worker", hard_timeout=240)
    common = ("--samples", "600", "--batch", str(BATCH), "--sync-quorum", *PACE)
    job.start_group("data_0", 1, *common, "--data-workers", "1")
    job.start_group("data_1", 1, *common, "--mid-at", "12", "--mid-sleep", "60")
    job.start_group("data_2", 1, *common)
    wait_for(lambda: job.events("data_1", ev="mid"), 90, "data_1 mid-step", job)
    job.kill_group("data_1")
    wait_for(lambda: len(committed_steps(job, "data_0", n=2)) >= 3, 60,
             "3 steps of two replicas", job)
    job.restart_group("data_1", "--mid-at", "-1")
    for rid in ("data_0", "data_1", "data_2"):
        assert job.wait_exit(rid, 120) == [0], job.summary()
    got = check_epoch(job, samples=600)
    assert got["splits"] == [2, 3], got


@pytest.mark.long
def test_one_epoch_groups_of_two_ranks(job_factory):
    """Each replica group's slice is cut again by group rank."""
    job = job_factory(min_replicas=1, worker="data_worker", hard_timeout=240)
    common = ("--samples", "480", "--batch", str(BATCH), *PACE)
    job.start_group("data_0", 2, *common, "--data-workers", "1")
    job.start_group("data_1", 2, *common, "--mid-at", "8", "--mid-sleep", "60")
    wait_for(lambda: job.events("data_1", ev="mid"), 90, "data_1 mid-step", job)
    job.kill_group("data_1")
    wait_for(lambda: len(committed_steps(job, "data_0", n=1)) >= 3, 60,
             "3 steps of data_0 alone", job)
    job.restart_group("data_1", "--mid-at", "-1")
    for rid in ("data_0", "data_1"):
        assert job.wait_exit(rid, 120) == [0, 0], job.summary()
    got = check_epoch(job, samples=480, ranks=2)
    assert got["splits"] == [1, 2], got
