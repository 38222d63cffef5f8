"""DDP's gradient buckets, in one process: fixed at construction (torchft's
by default, with STEPGUARD_DDP_BUCKETS=rebuilt the ones DDP's own rebuild
makes), kept through every step so that replicas started at different
times cut the same buckets, without the per-step search for unused
parameters; a model that leaves a parameter without a gradient costs one
step and then runs with that search, same buckets.

The manager is a stand-in that records what DDP hands it (a world of one:
the allreduce gives the bucket back).  The real allreduces across replicas
are in tests/py/test_train_buckets.py.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import stepguard.ddp as sgddp
from stepguard.ddp import DistributedDataParallel
from stepguard.process_group import ProcessGroupDummy

torchft_ddp = pytest.importorskip("torchft.ddp", reason="torchft (the reference) is not installed")


class StubManager:
    """What DistributedDataParallel uses of a Manager, recording calls; its
    buckets go to StubBuckets (below)."""

    def __init__(self) -> None:
        self._commit_checks: list[weakref.WeakMethod] = []
        self.errors: list[Exception] = []
        self.buffers: list[torch.Tensor] = []  # a copy of each allreduced bucket

    def allreduce(self, tensor: torch.Tensor):  # torchft's DDP, never stepped here
        raise AssertionError("not stepped")

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)

    def should_commit(self) -> bool:
        for ref in self._commit_checks:
            check = ref()
            if check is not None:
                check()
        return not self.errors


class StubBuckets:
    """Stands for DDP's bucket path (stepguard.ddp._Buckets) of a
    StubManager: records a copy of each bucket in the manager's
    ``buffers`` and gives the bucket back."""

    def __init__(self, manager: StubManager) -> None:
        self.manager = manager

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        self.manager.buffers.append(tensor.clone())
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(tensor)
        return fut

    def allreduce_deferred(self, tensor: torch.Tensor, finishers: list) -> torch.futures.Future[torch.Tensor]:
        self.manager.buffers.append(tensor.clone())
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        finishers.append(lambda: fut.set_result(tensor))
        return fut


@pytest.fixture(autouse=True)
def stub_bucket_path(monkeypatch):
    """DDP hands a StubManager's buckets to StubBuckets."""
    real = sgddp._bucket_path
    monkeypatch.setattr(sgddp, "_bucket_path",
                        lambda m: StubBuckets(m) if isinstance(m, StubManager) else real(m))


def mlp(width: int = 512, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


class Tied(nn.Module):
    """Shares one weight between two layers, and has a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(64, 64)
        self.frozen = nn.Linear(64, 64)
        self.frozen.requires_grad_(False)
        self.b = nn.Linear(64, 64)
        self.b.weight = self.a.weight
        self.head = nn.Linear(64, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.frozen(self.a(x[:, :64]))))


class WithUnused(nn.Module):
    """An MLP plus a layer its forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(128)
        self.spare = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def layout(ddp: nn.Module, model: nn.Module) -> list[list[str]]:
    """The reducer's buckets in the order it reduces them, by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in b.parameters()]
            for b in ddp.reducer._get_zeros_like_grad_buckets()]


def step(ddp: nn.Module, mgr: StubManager, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 256, generator=gen)
    for p in ddp.parameters():
        p.grad = None
    ddp(x).square().mean().backward()
    mgr.should_commit()


CASES = {
    "mlp": (mlp, {}),
    "mlp, 0.3 MB buckets": (mlp, {"bucket_cap_mb": 0.3}),
    "mlp, 0.05 MB buckets, grads as bucket views": (
        lambda: mlp(256), {"bucket_cap_mb": 0.05, "gradient_as_bucket_view": True}),
    "tied and frozen": (Tied, {"bucket_cap_mb": 0.02}),
}


def rebuilt_by_torch(make, kw) -> list[list[str]]:
    """The buckets plain torch DDP ends with after its first backward."""
    model = make()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=ProcessGroupDummy(0, 1),
                                                    **kw)
    for i in range(2):
        ddp(torch.randn(8, 256)).square().mean().backward()
    assert ddp.reducer._rebuild_buckets() is False  # rebuilt at the second forward
    return layout(ddp, model)


@pytest.mark.parametrize("case", ["mlp", "mlp, 0.3 MB buckets"])
def test_rebuilt_buckets_are_those_of_torchs_rebuild(case, monkeypatch):
    monkeypatch.setenv("STEPGUARD_DDP_BUCKETS", "rebuilt")
    make, kw = CASES[case]
    model = make()
    ddp = DistributedDataParallel(StubManager(), model, **kw)
    assert ddp.find_unused_parameters is False
    # the same buckets in the same order; inside a bucket the order is the
    # parameters' own (torch's follows the arrival of the gradients)
    assert [sorted(b) for b in layout(ddp, model)] == \
        [sorted(b) for b in rebuilt_by_torch(make, kw)]
    # the last bucket reduced is not the one holding most of the MLP
    sizes = [b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets()]
    assert sizes[-1] < max(sizes)


@pytest.mark.parametrize("torchft_buckets", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_buckets_stay(case, torchft_buckets, monkeypatch):
    make, kw = CASES[case]
    if not torchft_buckets:
        monkeypatch.setenv("STEPGUARD_DDP_BUCKETS", "rebuilt")
    ref_model, model = make(), make()
    if torchft_buckets:
        ref = torchft_ddp.DistributedDataParallel(StubManager(), ref_model, **kw)
    else:  # a fresh one: what a replica started later has
        ref = DistributedDataParallel(StubManager(), ref_model, **kw)
    want = layout(ref, ref_model)
    mgr = StubManager()
    ddp = DistributedDataParallel(mgr, model, **kw)
    assert ddp.find_unused_parameters is False, "the fixed buckets were not used"
    assert layout(ddp, model) == want
    for i in range(4):
        step(ddp, mgr, i)
    # no rebuild after the first backward: a replica started later (a fresh
    # DistributedDataParallel) has what this one has after its steps
    assert layout(ddp, model) == want
    assert len(want) >= 2
    assert not mgr.errors
    sizes = [len(b) for b in want]
    assert len(mgr.buffers) == 4 * len(sizes)
    assert [b.numel() for b in mgr.buffers[-len(sizes):]] == [
        sum(dict(model.named_parameters())[n].numel() for n in names) for names in want]


@pytest.mark.parametrize("torchft_buckets", [False, True])
def test_gradients_match_the_search_for_unused_parameters(torchft_buckets, monkeypatch):
    """The fixed buckets' gradients are bitwise torchft's construction's
    (find_unused_parameters=True), and so are the allreduced buffers with
    torchft's buckets."""
    if not torchft_buckets:
        monkeypatch.setenv("STEPGUARD_DDP_BUCKETS", "rebuilt")
    fast_mgr, slow_mgr = StubManager(), StubManager()
    fast_model, slow_model = mlp(), mlp()
    fast = DistributedDataParallel(fast_mgr, fast_model, bucket_cap_mb=0.3)
    slow = DistributedDataParallel(slow_mgr, slow_model, bucket_cap_mb=0.3,
                                   find_unused_parameters=True)
    assert fast.find_unused_parameters is False and slow.find_unused_parameters is True
    for i in range(3):
        step(fast, fast_mgr, i)
        step(slow, slow_mgr, i)
        for (n, a), b in zip(fast_model.named_parameters(), slow_model.parameters()):
            assert a.grad is not None and torch.equal(a.grad, b.grad), n
    assert len(slow_mgr.buffers) == 9
    if torchft_buckets:
        assert len(fast_mgr.buffers) == 9
        for a, b in zip(fast_mgr.buffers, slow_mgr.buffers):
            assert torch.equal(a, b)
    else:
        assert torch.equal(torch.cat(fast_mgr.buffers).sort().values,
                           torch.cat(slow_mgr.buffers).sort().values)


@pytest.mark.parametrize("how", ["argument", "environment", "static_graph", "two dtypes",
                                 "gradient hook", "another torch"])
def test_torchfts_construction_where_asked_or_needed(how, monkeypatch):
    model = mlp(64)
    kw: dict = {}
    if how == "argument":
        kw["find_unused_parameters"] = True
    elif how == "environment":
        monkeypatch.setenv("STEPGUARD_DDP_FIND_UNUSED", "1")
    elif how == "static_graph":
        kw["static_graph"] = True
    elif how == "two dtypes":
        model[4].double()
    elif how == "another torch":
        def missing(*args, **kw):
            raise AttributeError("no such DDP internal")

        monkeypatch.setattr(DistributedDataParallel, "_layout", missing)
    seen: list[torch.Tensor] = []
    if how == "gradient hook":
        # e.g. an optimizer applied in backward: must not see a construction step
        model[2].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p))
    mgr = StubManager()
    ddp = DistributedDataParallel(mgr, model, **kw)
    assert ddp.find_unused_parameters is True
    assert not seen
    assert not mgr._commit_checks
    ref_model = mlp(64)
    if how == "two dtypes":
        ref_model[4].double()
    ref = torchft_ddp.DistributedDataParallel(StubManager(), ref_model,
                                              **({"static_graph": True} if how == "static_graph"
                                                 else {}))
    assert layout(ddp, model) == layout(ref, ref_model)


@pytest.mark.parametrize("torchft_buckets", [False, True])
def test_unused_parameter_costs_this_replica_one_step(torchft_buckets, monkeypatch):
    if not torchft_buckets:
        monkeypatch.setenv("STEPGUARD_DDP_BUCKETS", "rebuilt")
    mgr = StubManager()
    model = WithUnused()
    ddp = DistributedDataParallel(mgr, model, bucket_cap_mb=0.02)
    assert ddp.find_unused_parameters is False
    before = layout(ddp, model)
    assert any("spare.weight" in b for b in before)
    n_buckets = len(before)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 128, generator=gen)
    x = torch.nn.functional.pad(x, (0, 128))
    ddp(x).square().mean().backward()
    grads = {n: (p.grad.clone() if p.grad is not None else None)
             for n, p in model.named_parameters()}
    assert grads["spare.weight"] is None
    issued = len(mgr.buffers)
    assert issued < n_buckets, "a bucket holding the unused layer was reduced"
    assert mgr.should_commit() is False
    (err,) = mgr.errors
    assert "received no gradient" in str(err) and "find_unused_parameters=True" in str(err)
    # every bucket was handed on once (the rest after the backward), holding
    # this replica's gradients and zeros for the unused layer
    assert len(mgr.buffers) == n_buckets
    for names, buf in zip(before[issued:], mgr.buffers[issued:]):
        want = torch.cat([grads[n].reshape(-1) if grads[n] is not None
                          else torch.zeros(dict(model.named_parameters())[n].numel())
                          for n in names])
        assert torch.equal(buf, want), names
    # now as torchft's DDP: same buckets, and the next steps go through
    assert ddp.find_unused_parameters is True
    assert layout(ddp, model) == before
    mgr.errors.clear()
    for i in range(3):
        for p in model.parameters():
            p.grad = None
        ddp(x).square().mean().backward()
        assert mgr.should_commit() is True
        assert model.spare.weight.grad is None
        assert model.body[0].weight.grad is not None
    assert len(mgr.buffers) == 4 * n_buckets


def test_unused_parameter_found_at_the_next_forward_without_a_vote():
    """A loop that never calls should_commit still gets the clear error
    path instead of DDP's 'Expected to have finished reduction'."""
    mgr = StubManager()
    model = WithUnused()
    ddp = DistributedDataParallel(mgr, model)
    x = torch.randn(4, 256)
    ddp(x).sum().backward()
    ddp(x).sum().backward()
    assert len(mgr.errors) == 1 and ddp.find_unused_parameters is True


def test_no_check_kept_for_a_dropped_model():
    mgr = StubManager()
    ddp = DistributedDataParallel(mgr, mlp(32))
    assert len(mgr._commit_checks) == 1
    ref = weakref.ref(ddp)
    del ddp
    import gc

    gc.collect()
    assert ref() is None, "the manager keeps the model alive"
    assert mgr._commit_checks[0]() is None
    assert mgr.should_commit() is True


def test_mark_ready_follows_the_requested_order():
    params = [nn.Parameter(torch.randn(3, 2)) for _ in range(5)]
    order = [3, 0, 4, 1, 2]

    class NoReducer:
        def prepare_for_backward(self, outputs) -> None:
            pass

    assert sgddp._mark_ready(NoReducer(), params, order) == order
    assert all(p.grad is None for p in params)
