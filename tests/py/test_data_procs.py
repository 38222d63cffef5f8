"""The data position survives crashes, in real processes: three replica
groups read one epoch through ManagedDataLoader (one of them with loader
worker processes) while the test discards a step everywhere, SIGKILLs a
replica in the middle of a step (a warm spare, waiting since before,
takes over its identity mid-epoch) and another at a random point
(restarted); each replacement heals from a peer; the number of
participants goes 3, 2, 3, 2, 3.  Then the same epoch with torchft's hot
spares (FIXED_WITH_SPARES: two participants of three groups), a
participant killed and restarted.  The samples of the committed steps
must be exactly the epoch: no sample skipped, none repeated.
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
    # (the trainers go on past the epoch until told to stop: the stream on
    # is contiguous, as checked above, and repeats nothing)
    rest = [k for k in seen if k[0] != 0]
    assert len(rest) == len(set(rest)), rest
    return {"steps": len(steps), "shared": shared,
            "splits": sorted({n for _, n in split.values()})}


def finish(job: Job, samples: int) -> None:
    """Ends the run without stranding anyone: once every rank of every
    group (its current incarnation) has committed a step past the epoch and
    the latest of those are all of one quorum, every trainer stops two steps
    after the furthest.  (A trainer that exits on its own at the end of the
    epoch can leave behind a peer that was stuck in a dead quorum's
    collective until its deadline: with everyone else gone, that peer never
    reaches a quorum again.)"""
    def frontier():
        last = []
        for rid, g in job.groups.items():
            for r in range(g.ranks):
                ok = [e for e in job.steps(rid, g=r, inc=g.incarnation)
                      if e["ok"] and e["pos"] >= samples]
                if not ok:
                    return None
                last.append(ok[-1])
        if len({e["qid"] for e in last}) != 1:
            return None
        return max(e["step"] for e in last)

    step = wait_for(frontier, 120, "every trainer past the epoch in one quorum", job)
    job.stop_at(step + 2)


def test_one_epoch_under_kills_a_warm_spare_restarts_and_a_discarded_step(job_factory):
    job = job_factory(min_replicas=2, worker="data_worker", hard_timeout=240)
    common = ("--samples", str(SAMPLES), "--batch", str(BATCH), "--discard-at", "10", *PACE)
    # a warm spare (stepguard.spares), set up and waiting before anything
    # fails: not a quorum member, so the job runs with three replicas
    spare = job.start_spare("spare0", *common, "--data-workers", "1")
    waiting = wait_for(lambda: job.spare_waiting(spare), 90, "the spare to wait", job)
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
    # the spare becomes data_2 mid-epoch: it heals from a peer (the data
    # position with the parameters) and reads on where data_2 would have
    job.take_over("data_2", spare)
    wait_for(lambda: len(committed_steps(job, "data_2", n=3)) >= 3, 90,
             "the spare, as data_2, to heal and commit 3 steps beside the others", job)
    # the replica whose loader has worker processes dies at a random point
    # and is restarted (no spare left)
    job.kill_group("data_0")
    wait_for(lambda: len(committed_steps(job, "data_1", n=2)) >= 3, 60,
             "3 steps of two replicas again", job)
    job.restart_group("data_0")
    finish(job, SAMPLES)
    for rid in ("data_0", "data_1", "data_2"):
        assert job.wait_exit(rid, 120) == [0], job.summary()
    got = check_epoch(job)
    # (a step of one participant is no fault: with an async quorum a
    # replica healing into it does not count, e.g. one that missed the
    # first quorum by the join timeout under load)
    assert {2, 3} <= set(got["splits"]), got
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
    # data_2's second incarnation is the spare's process, set up before the
    # kill; it took part in no quorum before the takeover
    start = job.events("data_2", inc=1, ev="start")[0]
    assert start["spare"] and start["pid"] == waiting["pid"], (start, waiting)
    assert waiting["t"] < mid["t"], (waiting, mid)
    # the replacements healed: their first committed step is a peer's
    for rid in ("data_0", "data_2"):
        first = committed_steps(job, rid)[0]
        assert first["before"] > 10 and first["healed"], first
    job.assert_identical(10)


def test_one_epoch_with_a_hot_spare(job_factory):
    """torchft's hot spares (WorldSizeMode.FIXED_WITH_SPARES): three groups,
    two participants.  The spare (data_2: the quorum ranks replicas by id)
    runs every step with zero weight; it is served a batch as if alone (the
    first participant's slice), which is not consumption: a committed step
    consumes its participants' slices only, the position moves by two
    slices, and the spare's read neither takes nor skips a sample of the
    epoch.  A participant dies; the spare takes its place at the next
    quorum (no heal); the victim comes back, heals, and the spare is a
    spare again.  Exactly one epoch is consumed throughout."""
    job = job_factory(min_replicas=2, worker="data_worker", hard_timeout=240)
    common = ("--samples", str(SAMPLES), "--batch", str(BATCH), "--fixed-with-spares",
              "--min-replica-size", "2", *PACE)
    job.start_group("data_0", 1, *common, "--data-workers", "1")
    job.start_group("data_1", 1, *common)
    job.start_group("data_2", 1, *common)

    def spare_steps(rid: str, inc: int = 0) -> list[dict]:
        return [e for e in job.steps(rid, inc=inc)
                if e["ok"] and e["prank"] is None and not e["healed"]]

    def active_steps(rid: str, inc: int) -> list[dict]:
        return [e for e in job.steps(rid, inc=inc) if e["ok"] and e["prank"] is not None]

    wait_for(lambda: len(spare_steps("data_2")) >= 3, 90, "3 steps with data_2 a spare", job)
    # a participant dies at a random point
    job.kill_group("data_0")
    killed_at = job.committed("data_1")
    # the hot spare participates from the next quorum, in place of the victim
    wait_for(lambda: len([e for e in active_steps("data_2", 0)
                          if e["before"] >= killed_at]) >= 3,
             60, "3 steps with the spare taking part", job)
    job.restart_group("data_0", "--mid-at", "-1")
    wait_for(lambda: len(active_steps("data_0", 1)) >= 3, 90,
             "the restarted data_0 to heal and take part in 3 steps", job)
    back = active_steps("data_0", 1)[0]["step"]
    wait_for(lambda: [e for e in spare_steps("data_2") if e["before"] >= back], 60,
             "data_2 to be a spare again", job)
    finish(job, SAMPLES)
    for rid in ("data_0", "data_1", "data_2"):
        assert job.wait_exit(rid, 120) == [0], job.summary()
    got = check_epoch(job)
    assert 2 in got["splits"] and set(got["splits"]) <= {1, 2}, got
    # the spare was never counted: no step had more than two participants,
    # and every step with a spare in lockstep had exactly two
    for e in job.steps():
        if e["ok"]:
            assert e["n"] <= 2, e
    for rid in job.groups:
        for inc in range(job.groups[rid].incarnation + 1):
            for e in spare_steps(rid, inc):
                assert e["n"] == 2, e
    # the spare's own reads were the first participant's slice, counted for
    # nothing: each was served the same batch as participant 0 of that step
    takes, committed = takes_and_commits(job)
    spare_takes = [t for t in takes if t["prank"] is None and t["rid"] == "data_2"]
    assert spare_takes
    by_step = {(t["step"], t["pos"]): t for t in takes if t["prank"] == 0}
    for t in spare_takes:
        p0 = by_step.get((t["step"], t["pos"]))
        if p0 is not None:
            assert (t["n"], t["keys"], t["draw"]) == (1, p0["keys"], p0["draw"]), (t, p0)
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
    finish(job, 600)
    for rid in ("data_0", "data_1", "data_2"):
        assert job.wait_exit(rid, 120) == [0], job.summary()
    got = check_epoch(job, samples=600)
    assert {2, 3} <= set(got["splits"]), got


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
    finish(job, 480)
    for rid in ("data_0", "data_1"):
        assert job.wait_exit(rid, 120) == [0, 0], job.summary()
    got = check_epoch(job, samples=480, ranks=2)
    assert {1, 2} <= set(got["splits"]), got
