"""The data position as committed state, in one process: the sampler's
position round trip, the step slice arithmetic, and ManagedDataLoader
driven by a stand-in Manager through commits, discarded steps, changes in
the number of participants and heals (with and without worker processes).
The same under real replicas, kills and restarts: test_data_procs.py."""

from __future__ import annotations

import collections
import random
from typing import List, Optional

import pytest
import torch

from stepguard.data import DistributedSampler, ManagedDataLoader, step_slice


class Samples(torch.utils.data.Dataset):
    """Sample i is (i, a draw from torch's generator, one from Python's)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor(i), torch.rand(()), torch.tensor(random.random())


class FakeManager:
    """What ManagedDataLoader reads from the Manager: a new quorum per
    step, its participants, and the committed batch count."""

    def __init__(self, group_rank: int = 0, group_world_size: int = 1) -> None:
        self._group_rank = group_rank
        self._group_world_size = group_world_size
        self._quorum_future: Optional[object] = None
        self._participants = 1
        self._rank: Optional[int] = 0
        self._batches = 0

    def start_quorum(self, participants: int, rank: Optional[int]) -> None:
        self._quorum_future = object()
        self._participants, self._rank = participants, rank

    def num_participants(self) -> int:
        return self._participants

    def participating_rank(self) -> Optional[int]:
        return self._rank

    def batches_committed(self) -> int:
        return self._batches

    def commit(self) -> None:
        self._batches += self._participants


# -- DistributedSampler -------------------------------------------------------


def test_sampler_state_round_trip_resumes_its_shard():
    ds = list(range(50))
    a = DistributedSampler(ds, replica_rank=1, num_replica_groups=2, group_rank=0,
                           num_replicas=2, shuffle=True, seed=7)
    a.set_epoch(3)
    full = list(a)
    assert len(full) == 13 and len(set(full)) == 13
    a.advance(5)
    assert list(a) == full[5:] and len(a) == 8
    sd = a.state_dict()
    assert sd == {"epoch": 3, "seed": 7, "offset": 5}
    b = DistributedSampler(ds, replica_rank=1, num_replica_groups=2, group_rank=0,
                           num_replicas=2, shuffle=True, seed=0)
    b.load_state_dict(sd)
    assert list(b) == full[5:]
    b.set_epoch(4)  # a new epoch starts at its beginning
    assert b.offset == 0 and len(list(b)) == 13 and list(b) != full
    b.set_epoch(4)  # the same epoch again keeps the position
    b.advance(2)
    b.set_epoch(4)
    assert b.offset == 2
    # the shard is torch's (torchft's) static shard
    assert a.global_rank == 2 and a.global_world_size == 4


@pytest.mark.parametrize("bad", [{}, {"epoch": 1, "seed": 0}, {"epoch": -1, "seed": 0, "offset": 0},
                                 {"epoch": "x", "seed": 0, "offset": 0}, None])
def test_sampler_rejects_a_bad_state_and_keeps_its_own(bad):
    s = DistributedSampler(list(range(10)), 0, 1, group_rank=0, num_replicas=1)
    s.advance(3)
    with pytest.raises(ValueError, match="not a sampler state"):
        s.load_state_dict(bad)
    assert s.state_dict() == {"epoch": 0, "seed": 0, "offset": 3}
    with pytest.raises(ValueError):
        s.advance(-1)


def test_sampler_order_is_the_epoch_permutation():
    s = DistributedSampler(list(range(30)), 0, 1, group_rank=0, num_replicas=1,
                           shuffle=True, seed=3)
    for e in range(3):
        s.set_epoch(e)
        assert s.order(e) == list(s)  # one shard of one: the whole order
    assert s.order(0) != s.order(1)
    assert sorted(s.order(2)) == list(range(30))


# -- the step slice -------------------------------------------------------------


def test_step_slice_cuts_the_global_batch_by_participant_then_group_rank():
    seen = []
    for r in range(3):
        for g in range(2):
            seen.append(step_slice(100, 4, 3, r, 2, g))
    assert seen == [(100 + 4 * i, 104 + 4 * i) for i in range(6)]
    assert step_slice(0, 5, 1, 0) == (0, 5)
    for bad in [(0, 0, 1, 0), (0, 4, 0, 0), (0, 4, 2, 2), (0, 4, 2, -1), (-1, 4, 1, 0)]:
        with pytest.raises(ValueError):
            step_slice(*bad)
    with pytest.raises(ValueError):
        step_slice(0, 4, 2, 0, 2, 2)


def test_resplit_arithmetic_loses_and_repeats_nothing():
    """Any sequence of participant counts: the committed steps' slices tile
    the stream from 0 without a gap or an overlap."""
    rng = random.Random(5)
    for _ in range(50):
        b, w = rng.randint(1, 5), rng.randint(1, 3)
        pos, covered = 0, []
        for _ in range(rng.randint(1, 30)):
            p = rng.randint(1, 6)
            slices = [step_slice(pos, b, p, r, w, g) for r in range(p) for g in range(w)]
            if rng.random() < 0.2:
                continue  # discarded: the position stays
            covered.extend(slices)
            pos += p * w * b
        flat = [i for a, z in covered for i in range(a, z)]
        assert flat == list(range(pos))


# -- ManagedDataLoader, driven by hand ---------------------------------------------


def drive(loader, mgr, plan, log):
    """plan: (participants, rank, commits) per step; appends served keys."""
    for participants, rank, commits in plan:
        mgr.start_quorum(participants, rank)
        idx, t, p = next(loader)
        log.append((loader.last, idx.tolist(), t.tolist(), p.tolist()))
        if commits:
            mgr.commit()


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_serves_a_discarded_step_again_and_resplits(workers):
    n, b = 32, 3
    mgr = FakeManager()
    sampler = DistributedSampler(Samples(n), 0, 1, group_rank=0, num_replicas=1,
                                 shuffle=True, seed=11)
    loader = ManagedDataLoader(mgr, Samples(n), b, sampler=sampler, num_workers=workers)
    log: list = []
    try:
        # rank 1 of 2, a discard, then alone (a peer died), then rank 2 of 3
        drive(loader, mgr, [(2, 1, True), (2, 1, False), (2, 1, True), (1, 0, True),
                            (3, 2, True), (3, 2, True)], log)
        order = sampler.order(0)
        starts = [e[0].start for e in log]
        assert starts == [3, 9, 9, 12, 21, 30]
        for sl, idx, _, _ in log:
            assert [k[1] for k in sl.keys] == idx
        # the discarded step's batch, served again: same samples, same draws
        assert log[1][1:] == log[2][1:]
        assert log[0][1] == order[3:6]
        # positions 30-32: the stream runs into epoch 1, in its own order
        assert log[5][0].keys == [(0, order[30]), (0, order[31]), (1, sampler.order(1)[0])]
        assert loader.position() == 2 * b + 2 * b + b + 3 * b * 2
        assert loader.epoch == 1
    finally:
        loader.close()


def test_loader_draws_are_the_samples_own_and_leave_the_trainer_rng_alone():
    n = 20
    torch.manual_seed(123)
    random.seed(4)
    before = (torch.rand(()).item(), random.random())
    torch.manual_seed(123)
    random.seed(4)
    mgr = FakeManager()
    loader = ManagedDataLoader(mgr, Samples(n), 4)
    log: list = []
    drive(loader, mgr, [(1, 0, True), (2, 1, True)], log)
    assert (torch.rand(()).item(), random.random()) == before
    # another split reading the same samples draws the same values
    mgr2 = FakeManager()
    other = ManagedDataLoader(mgr2, Samples(n), 2)
    log2: list = []
    drive(other, mgr2, [(2, 0, True), (2, 0, True), (2, 1, True)], log2)
    draws = {i: (t, p) for _, idx, ts, ps in log for i, t, p in zip(idx, ts, ps)}
    draws2 = {i: (t, p) for _, idx, ts, ps in log2 for i, t, p in zip(idx, ts, ps)}
    common = set(draws) & set(draws2)
    assert len(common) >= 4 and all(draws[i] == draws2[i] for i in common)
    assert len({v for v in draws.values()}) == len(draws)  # distinct per sample


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_simulated_replicas_tile_one_epoch_exactly(workers):
    """Three replica groups of two ranks each through commits, discards,
    deaths, joins and heals (the state moved with state_dict): the samples
    of the committed steps are exactly one epoch and some of the next."""
    n, b, w = 300, 2, 2
    rng = random.Random(1)
    alive = {0: None, 1: None, 2: None}  # replica -> its state (None: fresh)

    def make(state):
        mgrs = [FakeManager(g, w) for g in range(w)]
        loaders = [ManagedDataLoader(m, Samples(n), b, num_workers=workers if g == 0 else 0,
                                     sampler=DistributedSampler(Samples(n), 0, 1, group_rank=g,
                                                                num_replicas=w, shuffle=True,
                                                                seed=2))
                   for g, m in enumerate(mgrs)]
        if state is not None:
            for m, ld in zip(mgrs, loaders):
                m._batches = state[0]
                ld.load_state_dict(state[1])
        return mgrs, loaders

    groups = {r: make(None) for r in alive}
    committed: List[int] = []
    try:
        while groups[min(groups)][1][0].position() < n:
            members = sorted(groups)
            up = members[0]
            for _ in range(1):
                ev = rng.random()
                if ev < 0.08 and len(members) > 1:  # a death: the step is discarded
                    victim = rng.choice(members)
                    for ld in groups.pop(victim)[1]:
                        ld.close()
                    members = sorted(groups)
                    continue
                if ev < 0.16 and len(members) < 3:  # a replacement heals from a peer
                    new = min(set(range(3)) - set(members))
                    src_m, src_l = groups[members[0]]
                    groups[new] = make((src_m[0].batches_committed(), src_l[0].state_dict()))
                    members = sorted(groups)
            up = members[0]
            p = len(members)
            commits = rng.random() > 0.1
            for rank, rid in enumerate(members):
                for g in range(w):
                    mgr, ld = groups[rid][0][g], groups[rid][1][g]
                    mgr.start_quorum(p, rank)
                    idx = next(ld)[0].tolist()
                    assert [k[1] for k in ld.last.keys] == idx
                    if commits:
                        committed.extend(ld.last.keys)
            if commits:
                for rid in members:
                    for mgr in groups[rid][0]:
                        mgr.commit()
            del up
        epoch0 = sorted(i for e, i in committed if e == 0)
        assert epoch0 == list(range(n))
        later = [(e, i) for e, i in committed if e > 0]
        assert len(later) == len(set(later))
        assert collections.Counter(e for e, _ in committed).keys() <= {0, 1}
    finally:
        for _, loaders in groups.values():
            for ld in loaders:
                ld.close()


def test_loader_misuse_and_bad_state():
    mgr = FakeManager()
    loader = ManagedDataLoader(mgr, Samples(10), 2)
    with pytest.raises(RuntimeError, match="after its quorum has started"):
        next(loader)
    mgr.start_quorum(1, 0)
    next(loader)
    with pytest.raises(RuntimeError, match="once per step"):
        next(loader)
    good = loader.state_dict()
    for bad in [{}, {**good, "position": -1}, {**good, "dataset_len": 11},
                {**good, "seed": "x"}, None]:
        with pytest.raises(ValueError):
            loader.load_state_dict(bad)
    assert loader.state_dict() == good
    with pytest.raises(TypeError):
        ManagedDataLoader(mgr, torch.utils.data.IterableDataset(), 2)
    with pytest.raises(ValueError):
        ManagedDataLoader(mgr, Samples(10), 0)
    with pytest.raises(ValueError):
        ManagedDataLoader(mgr, Samples(0), 1)
    # a Manager whose committed count is behind the loaded position's
    loader.load_state_dict({**good, "batches_committed": 5})
    with pytest.raises(RuntimeError, match="behind"):
        loader.position()


def test_non_participant_reads_but_is_marked():
    mgr = FakeManager()
    loader = ManagedDataLoader(mgr, Samples(10), 2)
    mgr.start_quorum(2, None)  # healing: not a participant this step
    next(loader)
    assert loader.last.participant_rank is None


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_resumes_a_checkpoint_with_another_batch_size_and_seed(workers):
    """The loaded position counts on from the Manager's committed batches,
    whatever batch size read up to it; a loaded seed replaces the
    configured one (in the worker processes too)."""
    n = 50
    mgr = FakeManager()
    a = ManagedDataLoader(mgr, Samples(n), 3, sampler=DistributedSampler(
        Samples(n), 0, 1, group_rank=0, num_replicas=1, shuffle=True, seed=5))
    drive(a, mgr, [(2, 0, True), (3, 1, True), (1, 0, False)], [])
    saved, batches = a.state_dict(), mgr.batches_committed()
    assert saved["position"] == 15 and batches == 5
    # the job restarts from the checkpoint with 4 samples per rank
    mgr2 = FakeManager()
    mgr2._batches = batches
    b = ManagedDataLoader(mgr2, Samples(n), 4, num_workers=workers, sampler=DistributedSampler(
        Samples(n), 0, 1, group_rank=0, num_replicas=1, shuffle=True, seed=99))
    try:
        drive(b, mgr2, [(1, 0, False)], [])  # its workers run (with seed 99)
        b.load_state_dict(saved)
        assert b.position() == 15 and b.sampler.seed == 5
        log: list = []
        drive(b, mgr2, [(2, 1, True), (1, 0, True)], log)
        order = a.sampler.order(0)
        assert log[0][1] == order[19:23] and log[1][1] == order[23:27]
        assert b.position() == 27 and b.state_dict()["position"] == 27
        # the draws are those of seed 5, not 99 (a reads sample order[19]
        # at position 19 as well)
        mgr.start_quorum(1, 0)
        mgr._batches = 0
        a.load_state_dict({**saved, "position": 19, "batches_committed": 0})
        _, t, p = next(a)
        assert (t[0].item(), p[0].item()) == (log[0][2][0], log[0][3][0])
    finally:
        b.close()


def test_unseeded_loader_reads_with_the_generators_as_they_are():
    mgr = FakeManager()
    loader = ManagedDataLoader(mgr, Samples(10), 2, seeded=False)
    torch.manual_seed(1)
    drive(loader, mgr, [(1, 0, False)], log := [])
    torch.manual_seed(2)
    drive(loader, mgr, [(1, 0, True)], log)
    # the same samples, served again, with other draws: nobody seeded them
    assert log[0][1] == log[1][1] and log[0][2] != log[1][2]
