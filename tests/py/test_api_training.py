"""The rest of the training API: deadlines (futures.py), the sampler, the
optimizer wrapper, DDP through the Manager, and a torchft-style training
script run with ``import stepguard as torchft``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from typing import List, Optional
from unittest.mock import MagicMock

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore
from torch.utils.data import Dataset

from stepguard.coordination import LighthouseServer
from stepguard.data import DistributedSampler
from stepguard.ddp import DistributedDataParallel, PureDistributedDataParallel
from stepguard.futures import context_timeout, future_timeout, future_wait, stream_timeout
from stepguard.manager import Manager
from stepguard.optim import OptimizerWrapper
from stepguard.process_group import ProcessGroupGloo

TD = timedelta(seconds=20)


# -- futures ----------------------------------------------------------------


def test_future_timeout_fires_and_passes_results() -> None:
    never: torch.futures.Future[int] = torch.futures.Future()
    with pytest.raises(TimeoutError, match="did not complete within"):
        future_timeout(never, timedelta(milliseconds=50)).wait()
    ok: torch.futures.Future[int] = torch.futures.Future()
    fut = future_timeout(ok, timedelta(seconds=30))
    ok.set_result(5)
    assert fut.wait() == 5
    bad: torch.futures.Future[int] = torch.futures.Future()
    fut = future_timeout(bad, timedelta(seconds=30))
    bad.set_exception(ValueError("x"))
    with pytest.raises(ValueError):
        fut.wait()
    # Completing after the deadline does not disturb the timed-out future.
    late: torch.futures.Future[int] = torch.futures.Future()
    fut = future_timeout(late, timedelta(milliseconds=20))
    with pytest.raises(TimeoutError):
        fut.wait()
    late.set_result(1)
    m = MagicMock()
    assert future_timeout(m, timedelta(seconds=1)) is m


def test_future_wait() -> None:
    f: torch.futures.Future[int] = torch.futures.Future()
    with pytest.raises(TimeoutError):
        future_wait(f, timedelta(milliseconds=50))
    threading.Timer(0.05, lambda: f.set_result(3)).start()
    assert future_wait(f, timedelta(seconds=30)) == 3
    assert future_wait(f, timedelta(seconds=0)) == 3


def test_context_timeout_fires_only_when_late() -> None:
    fired = threading.Event()
    with context_timeout(fired.set, timedelta(milliseconds=30)):
        assert fired.wait(10)
    # A block that ended before its deadline is never called back.  Load can
    # hold even an empty block past 200 ms, and then a call is right: such a
    # try proves nothing, so the check is made on the first quick one.
    for _ in range(5):
        quiet = threading.Event()
        t0 = time.monotonic()
        with context_timeout(quiet.set, timedelta(milliseconds=200)):
            pass
        if time.monotonic() - t0 < 0.2:
            time.sleep(0.4)
            assert not quiet.is_set()
            return
    pytest.fail("five empty blocks each took 200 ms or more")


def test_blocking_callback_does_not_delay_other_deadlines() -> None:
    release = threading.Event()
    second = threading.Event()
    with context_timeout(lambda: release.wait(30), timedelta(milliseconds=10)):
        time.sleep(0.05)
    # The first callback is blocked; the next deadline still fires.
    with context_timeout(second.set, timedelta(milliseconds=10)):
        assert second.wait(10)
    release.set()


def test_stream_timeout_without_accelerator_is_inert() -> None:
    if torch.accelerator.is_available():
        pytest.skip("this check is for CPU-only machines")
    called = threading.Event()
    stream_timeout(called.set, timedelta(milliseconds=1))
    time.sleep(0.1)
    assert not called.is_set()


def test_timer_is_fresh_after_fork() -> None:
    code = textwrap.dedent(
        """
        import os, sys, threading, time
        from datetime import timedelta
        from stepguard.futures import context_timeout
        with context_timeout(lambda: None, timedelta(milliseconds=1)):
            time.sleep(0.05)
        pid = os.fork()
        if pid == 0:
            ev = threading.Event()
            with context_timeout(ev.set, timedelta(milliseconds=10)):
                ok = ev.wait(10)
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
        """
    )
    p = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert p.returncode == 0


# -- sampler ------------------------------------------------------------------


class Numbers(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def test_sampler_shards_over_all_groups() -> None:
    s = DistributedSampler(Numbers(1000), replica_rank=1, num_replica_groups=2,
                           group_rank=3, num_replicas=4, shuffle=False)
    assert s.global_rank == 7 and s.global_world_size == 8
    assert list(s)[:3] == [7, 15, 23] and len(s) == 125
    seen: List[int] = []
    for rr in range(3):
        for gr in range(2):
            seen += list(DistributedSampler(Numbers(60), replica_rank=rr, num_replica_groups=3,
                                            group_rank=gr, num_replicas=2, shuffle=False))
    assert sorted(seen) == list(range(60))
    shuffled = list(DistributedSampler(Numbers(1000), 1, 2, group_rank=3, num_replicas=4))
    assert sorted(shuffled) != shuffled and len(shuffled) == 125


# -- optimizer wrapper ------------------------------------------------------


def test_optimizer_wrapper_steps_only_on_commit() -> None:
    p = nn.Parameter(torch.ones(2))
    inner = torch.optim.SGD([p], lr=1.0)
    manager = MagicMock()
    opt = OptimizerWrapper(manager, inner)
    p.grad = torch.ones(2)
    opt.zero_grad()
    manager.start_quorum.assert_called_once()
    assert p.grad is None
    p.grad = torch.ones(2)
    manager.should_commit.return_value = False
    opt.step()
    assert torch.equal(p.detach(), torch.ones(2))
    manager.should_commit.return_value = True
    opt.step()
    assert torch.equal(p.detach(), torch.zeros(2))
    assert opt.param_groups is inner.param_groups
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(AssertionError):
        opt.step(lambda: 0.0)


# -- DDP and a whole training step -------------------------------------------


def make_manager(lh: LighthouseServer, idx: int, pg: object, model: nn.Module) -> Manager:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    m = Manager(pg, model.load_state_dict, model.state_dict,  # type: ignore[arg-type]
                min_replica_size=1, rank=0, world_size=1, store_addr="127.0.0.1",
                store_port=store.port, lighthouse_addr=lh.address(),
                replica_id=f"ddp_{idx}", timeout=TD, quorum_timeout=TD,
                # Same initial weights: no healing at step 0, so both
                # replicas contribute gradients from the first step.
                init_sync=False,
                connect_timeout=TD, hostname="127.0.0.1")
    m._test_store = store  # type: ignore[attr-defined]
    return m


@pytest.mark.parametrize("wrapper,pg", [("ddp", "gloo"), ("pure", "gloo"), ("ddp", "tcp")])
def test_ddp_averages_gradients_over_replicas(wrapper: str, pg: str) -> None:
    """Both replicas get the mean of their gradients, bitwise for DDP
    (torchft's sum then division); over ProcessGroupTCP the group averages
    DDP's buckets itself (its AVG), with the same bits."""
    from stepguard.process_group_tcp import ProcessGroupTCP

    lh = LighthouseServer("127.0.0.1:0", 2, join_timeout_ms=100)
    torch.manual_seed(0)
    models = [nn.Linear(3, 2) for _ in range(2)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    ops: List[object] = []

    def group() -> object:
        if pg == "gloo":
            return ProcessGroupGloo(timeout=TD)
        g = ProcessGroupTCP(timeout=TD)
        real = g.allreduce

        def allreduce(tensors, opts):  # type: ignore[no-untyped-def]
            ops.append(getattr(opts, "reduceOp", opts))
            return real(tensors, opts)

        g.allreduce = allreduce  # type: ignore[method-assign]
        return g

    managers = [make_manager(lh, i, group(), models[i]) for i in range(2)]
    grads: List[List[torch.Tensor]] = [[], []]
    reference = nn.Linear(3, 2)
    reference.load_state_dict(models[0].state_dict())
    xs = [torch.randn(4, 3) for _ in range(2)]

    def replica(i: int) -> None:
        m = managers[i]
        net = (DistributedDataParallel(m, models[i]) if wrapper == "ddp"
               else PureDistributedDataParallel(m, models[i]))
        opt = OptimizerWrapper(m, torch.optim.SGD(models[i].parameters(), lr=0.1))
        for _ in range(2):
            opt.zero_grad()
            net(xs[i]).sum().backward()
            grads[i] = [p.grad.clone() for p in models[i].parameters()]
            opt.step()

    ths = [threading.Thread(target=replica, args=(i,), daemon=True) for i in range(2)]
    try:
        for t in ths:
            t.start()
        for t in ths:
            t.join(90)
            assert not t.is_alive()
        # The expected gradient of the last step: the mean of both replicas'
        # gradients at the shared weights of the second step.
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for _ in range(2):
            ref_opt.zero_grad()
            per = []
            for x in xs:
                reference.zero_grad()
                reference(x).sum().backward()
                per.append([p.grad.clone() for p in reference.parameters()])
            mean = [(a + b) / 2 for a, b in zip(*per)]
            for p, g in zip(reference.parameters(), mean):
                p.grad = g
            ref_opt.step()
        for i in range(2):
            for g, e in zip(grads[i], mean):
                assert torch.allclose(g, e, atol=1e-6)
                if wrapper == "ddp":
                    assert torch.equal(g, e)
        if pg == "tcp":
            assert ops and all(op == torch.distributed.ReduceOp.AVG for op in ops), ops
            for p, r in zip(models[i].parameters(), reference.parameters()):
                assert torch.allclose(p, r, atol=1e-6)
        assert [m.current_step() for m in managers] == [2, 2]
    finally:
        for m in managers:
            m.shutdown(wait=False)
        lh.shutdown()


def test_torchft_style_script_runs_with_stepguard(tmp_path) -> None:
    """A training loop written against torchft's API, with torchft's import
    names pointing at stepguard, runs to completion in a child process."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(
        """
        import sys
        import stepguard, stepguard.process_group, stepguard.manager
        sys.modules["torchft"] = stepguard
        sys.modules["torchft.process_group"] = stepguard.process_group
        sys.modules["torchft.manager"] = stepguard.manager
        from datetime import timedelta
        import torch
        from torch import nn
        from torch.distributed import TCPStore
        import torchft
        from torchft import (DistributedDataParallel, Manager, Optimizer,
                             ProcessGroupGloo)
        from stepguard.coordination import LighthouseServer

        lh = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        m = nn.Linear(4, 1)
        manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1,
                          load_state_dict=m.load_state_dict, state_dict=m.state_dict,
                          replica_id="train_ddp_0", lighthouse_addr=lh.address(),
                          rank=0, world_size=1, store_addr="127.0.0.1",
                          store_port=store.port, hostname="127.0.0.1",
                          timeout=timedelta(seconds=20))
        model = DistributedDataParallel(manager, m)
        optimizer = Optimizer(manager, torch.optim.AdamW(m.parameters()))
        while manager.current_step() < 5:
            optimizer.zero_grad()
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            optimizer.step()
        print("done", manager.current_step(), manager.batches_committed())
        manager.shutdown()
        lh.shutdown()
        """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "TORCHFT_LIGHTHOUSE": ""})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "done 5 5" in p.stdout


def test_ddp_bucket_failure_fails_the_step_not_backward() -> None:
    """A bucket's allreduce that fails (its future raises) while backward
    goes on: backward still returns, the manager records the error, the
    step is not committed, and the next step is clean."""
    from stepguard.process_group import FakeProcessGroupWrapper

    lh = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=100)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    pg = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=TD))
    m = make_manager(lh, 0, pg, model)
    try:
        net = DistributedDataParallel(m, model)
        opt = OptimizerWrapper(m, torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.randn(4, 3)
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        m.wait_quorum()
        pg.report_future_error(RuntimeError("injected bucket failure"))
        net(x).sum().backward()  # must not raise
        err = m.errored()
        assert err is not None and "injected bucket failure" in str(err.original_exception)
        opt.step()
        assert m.current_step() == 0  # not committed
        for p, b in zip(model.parameters(), before):
            assert torch.equal(p.detach(), b)  # the optimizer did not step
        # the next step is clean again and commits
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
        assert m.errored() is None and m.current_step() == 1
    finally:
        m.shutdown(wait=False)
        lh.shutdown()


def test_ddp_backward_that_raises_midway_leaves_nothing_pending() -> None:
    """A backward that raises after DDP started a bucket (a later gradient
    hook fails): the bucket's completion is not left behind, and the next
    steps run and commit."""
    lh = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=100)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    m = make_manager(lh, 0, ProcessGroupGloo(timeout=TD), model)
    try:
        net = DistributedDataParallel(m, model, bucket_cap_mb=1e-6)  # a bucket per parameter
        assert len(net._buckets or []) > 1
        opt = OptimizerWrapper(m, torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.randn(4, 3)
        fail = [True]

        def boom(g: torch.Tensor) -> torch.Tensor:
            if fail[0]:
                raise RuntimeError("injected backward failure")
            return g

        # the input's gradient comes after the last layer's buckets were
        # handed to the manager
        opt.zero_grad()
        inp = x.clone().requires_grad_(True)
        out = net(inp)
        inp.register_hook(boom)
        with pytest.raises(RuntimeError, match="injected backward failure"):
            out.sum().backward()
        assert net._hook_state.finishers, "no bucket was in flight when backward raised"
        fail[0] = False
        for _ in range(2):
            opt.zero_grad()
            net(x).sum().backward()
            assert not net._hook_state.finishers
            opt.step()
        # the step after the failed backward fails (its buckets were not
        # all reduced), the next one commits
        assert m.current_step() == 1
    finally:
        m.shutdown(wait=False)
        lh.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_average_is_bitwise_a_division(dtype: torch.dtype) -> None:
    """The manager's average (a multiplication by the inverse for a power
    of two) gives exactly the bits of torchft's division, subnormals,
    extremes, infinities and NaN included."""
    from stepguard.manager import _average

    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, info.tiny, -info.tiny, info.tiny / 4, info.max, -info.max,
                            info.smallest_normal * 3, float("inf"), float("-inf"), float("nan")],
                           dtype=torch.float64).to(dtype)
    for scale in (1.0, 1e-3, 1e3):
        x = torch.cat([(torch.randn(100_000, generator=g, dtype=torch.float64) * scale).to(dtype),
                       special, (torch.rand(1000, generator=g, dtype=torch.float64) * info.tiny).to(dtype)])
        for n in (1, 2, 3, 4, 6, 8, 1024):
            got = x.clone()
            _average(got, n)
            want = x.clone().div_(n)
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
            assert torch.equal(got.view(bits), want.view(bits)), (dtype, n, scale)



class _NeverDone(torch.distributed.distributed_c10d.Work):
    """A collective that never completes.  With ``honours`` its
    ``wait(timeout)`` raises at the timeout, as c10d's works do, and its
    future must not be used (DDP completes such a bucket by waiting on the
    work); without, its ``wait`` ignores the timeout (as a wrapper's Python
    work may) and only its future, never completed, can be bounded."""

    def __init__(self, honours: bool, release: threading.Event) -> None:
        super().__init__()
        self._wait_honours_timeout = honours
        self.release = release
        self.waited: List[float] = []
        self.fut: torch.futures.Future = torch.futures.Future()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self.waited.append(timeout.total_seconds())
        if self._wait_honours_timeout:
            self.release.wait(timeout.total_seconds())
            raise RuntimeError("Operation timed out!")
        # bounded only so that a regression fails the test instead of hanging it
        if not self.release.wait(60):
            raise AssertionError("DDP waited on a work whose wait ignores its timeout")
        return True

    def get_future(self) -> torch.futures.Future:
        if self._wait_honours_timeout:
            raise AssertionError("a bucket was completed on the process group's thread")
        return self.fut


@pytest.mark.parametrize("honours", [True, False], ids=["wait-honours-timeout", "wait-ignores-it"])
def test_ddp_bucket_that_never_completes_fails_the_step_within_the_timeout(honours: bool) -> None:
    """A bucket allreduce that hangs: backward returns once the manager's
    timeout (1 s here, counted from the bucket's start) has passed, the
    step fails with a TimeoutError and is not committed, the next step is
    clean.  A work whose wait gives up at the timeout is waited on at the
    end of backward (the process group's thread runs nothing of ours); one
    whose wait may not is bounded through its future and the shared timer."""
    from stepguard.process_group import ProcessGroupWrapper

    release = threading.Event()

    class Hang(ProcessGroupWrapper):
        hung: Optional[_NeverDone] = None
        hang_next = False

        def allreduce(self, tensors, opts):  # type: ignore[no-untyped-def, override]
            if self.hang_next:
                self.hang_next = False
                self.hung = _NeverDone(honours, release)
                return self.hung
            return super().allreduce(tensors, opts)

    lh = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=100)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    pg = Hang(pg=ProcessGroupGloo(timeout=TD))
    m = make_manager(lh, 0, pg, model)
    m._timeout = timedelta(seconds=1)
    try:
        net = DistributedDataParallel(m, model)
        opt = OptimizerWrapper(m, torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.randn(4, 3)
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
        assert m.current_step() == 1
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        pg.hang_next = True
        t = time.monotonic()
        net(x).sum().backward()  # must not raise, must not hang
        took = time.monotonic() - t
        assert took < 10, f"backward took {took:.1f}s with a 1s timeout"
        assert pg.hung is not None
        if honours:
            assert len(pg.hung.waited) == 1 and 0 < pg.hung.waited[0] <= 1.0
        else:
            assert not pg.hung.waited, "DDP waited on a work whose wait ignores its timeout"
        err = m.errored()
        assert err is not None and isinstance(err.original_exception, TimeoutError)
        opt.step()
        assert m.current_step() == 1  # not committed
        for p, b in zip(model.parameters(), before):
            assert torch.equal(p.detach(), b)
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
        assert m.errored() is None and m.current_step() == 2
    finally:
        release.set()
        m.shutdown(wait=False)
        lh.shutdown()
