"""stepguard.process_group: reconfigurable Gloo groups on threads of this
process, the dummy group, the wrappers, handles and store addresses."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Callable, List

import pytest
import torch
from torch.distributed import ReduceOp, TCPStore
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)

from stepguard.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ReconfigureOptions,
    _rendezvous,
    create_store_client,
    reconfigure_with_store,
)
from stepguard.work import _DummyWork

TD = timedelta(seconds=20)


def run_threads(fns: List[Callable[[], object]], limit_s: float = 60) -> List[object]:
    out: List[object] = [None] * len(fns)
    errs: List[BaseException] = []

    def run(i: int, fn: Callable[[], object]) -> None:
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i, f), daemon=True) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(limit_s)
        assert not t.is_alive(), f"a rank did not finish within {limit_s} s"
    if errs:
        raise errs[0]
    return out


@pytest.fixture
def store():
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield s


def sum_opts() -> AllreduceOptions:
    o = AllreduceOptions()
    o.reduceOp = ReduceOp.SUM
    return o


def test_gloo_collectives_across_reconfigurations(store) -> None:
    pgs = [ProcessGroupGloo(timeout=TD) for _ in range(3)]

    def rank(r: int) -> list:
        out = []
        pg = pgs[r]
        # First a group of all three, then of two (rank 2 sits out).
        pg.configure(f"127.0.0.1:{store.port}/q/1", "0", r, 3, quorum_id=1,
                     group_rank=0, group_world_size=1)
        t = torch.tensor([float(r + 1)])
        pg.allreduce([t], sum_opts()).wait()
        out.append(t.item())
        outs = [[torch.zeros(1) for _ in range(3)]]
        pg.allgather(outs, [torch.tensor([float(r)])], AllgatherOptions()).wait()
        out.append([x.item() for x in outs[0]])
        b = torch.tensor([float(r)])
        pg.broadcast_one(b, 2).wait()
        out.append(b.item())
        o = torch.zeros(3)
        pg.alltoall_base(o, torch.full((3,), float(r)), [], [], AllToAllOptions()).wait()
        out.append(o.tolist())
        pg.barrier().wait()
        out.append(pg.size())
        if r < 2:
            pg.configure(f"127.0.0.1:{store.port}/q/2", "0", r, 2, quorum_id=2)
            t = torch.tensor([float(r + 1)])
            pg.allreduce([t], ReduceOp.SUM).wait()
            out.append(t.item())
            out.append(pg.size())
        return out

    got = run_threads([lambda r=r: rank(r) for r in range(3)])
    for r, o in enumerate(got):
        assert o[0] == 6.0
        assert o[1] == [0.0, 1.0, 2.0]
        assert o[2] == 2.0
        assert o[3] == [0.0, 1.0, 2.0]
        assert o[4] == 3
        if r < 2:
            assert o[5:] == [3.0, 2]
    for p in pgs:
        p.shutdown()


def test_reconfigure_with_store_uses_handles(store) -> None:
    pgs = [ProcessGroupGloo(timeout=TD) for _ in range(2)]
    for i, p in enumerate(pgs):
        p.set_rank_info("0", 0, 1, global_rank=i)
    handles = [json.loads(p.get_reconfigure_handle()) for p in pgs]
    assert handles[0]["id"] != handles[1]["id"]
    assert handles[1]["global_rank"] == 1

    def rank(r: int) -> float:
        reconfigure_with_store(pgs[r], f"127.0.0.1:{store.port}/h", r, 2, TD)
        t = torch.tensor([float(r + 1)])
        pgs[r].allreduce([t], ReduceOp.SUM).wait()
        return t.item()

    assert run_threads([lambda r=r: rank(r) for r in range(2)]) == [3.0, 3.0]
    assert pgs[1]._global_ranks == [0, 1] and pgs[1]._rank == 1


class _SlowSetupGloo(ProcessGroupGloo):
    """A Gloo group whose set-up starts `delay_s` late (a loaded host)."""

    delay_s = 0.0

    def _create_pg(self, store, rank, world_size):  # type: ignore[no-untyped-def]
        time.sleep(self.delay_s)
        return super()._create_pg(store, rank, world_size)


def test_reconfigure_gives_setup_its_own_timeout(store) -> None:
    # Operations time out in 1 s, and one rank starts connecting 3 s late:
    # the set-up is bounded by the reconfigure's timeout (20 s), not by the
    # operations' 1 s, and the operations still time out at 1 s after it.
    pgs = [_SlowSetupGloo(timeout=timedelta(seconds=1)) for _ in range(2)]
    pgs[1].delay_s = 3.0

    def rank(r: int) -> float:
        reconfigure_with_store(pgs[r], f"127.0.0.1:{store.port}/slow", r, 2, TD)
        t = torch.tensor([float(r + 1)])
        pgs[r].allreduce([t], ReduceOp.SUM).wait()
        return t.item()

    assert run_threads([lambda r=r: rank(r) for r in range(2)]) == [3.0, 3.0]
    t0 = time.monotonic()
    with pytest.raises(Exception, match="[Tt]imed out"):
        pgs[0].allreduce([torch.ones(1)], ReduceOp.SUM).wait()
    # 1 s plus scheduling: far below the 20 s the set-up was given
    assert time.monotonic() - t0 < 10
    for p in pgs:
        p.shutdown()


def test_rendezvous_rejects_bad_handles() -> None:
    good = json.dumps({"id": "a", "store": "h:1", "global_rank": None})
    opts = ReconfigureOptions()
    opts.uuid = 5
    opts.handles = [good, json.dumps({"id": "b", "store": "x:2", "global_rank": 3})]
    r = _rendezvous(opts, "b")
    assert (r.store_addr, r.rank, r.world_size, r.global_ranks) == ("h:1/torchft/5", 1, 2, None)
    for bad in (["not json"], [json.dumps({"store": "h:1"})], []):
        opts.handles = bad
        with pytest.raises(ValueError):
            _rendezvous(opts, "a")
    opts.handles = [good]
    with pytest.raises(ValueError, match="not among"):
        _rendezvous(opts, "zzz")
    opts.handles = {good}  # unordered
    with pytest.raises(ValueError):
        _rendezvous(opts, "a")


def test_create_store_client_addresses(store) -> None:
    c = create_store_client(f"127.0.0.1:{store.port}/a/b", TD)
    c.set("k", "v")
    assert create_store_client(f"127.0.0.1:{store.port}/a/b", TD).get("k") == b"v"
    # Another prefix does not see the key.
    other = create_store_client(f"127.0.0.1:{store.port}/a/c", TD)
    assert other.check(["k"]) is False
    for bad in ("nohostport", "host:notaport/x", ""):
        with pytest.raises(ValueError):
            create_store_client(bad, TD)
    with pytest.raises(Exception):
        # Nobody listens there: bounded by the timeout, then an error.
        create_store_client("127.0.0.1:1/x", timedelta(milliseconds=300))


def test_configure_failure_raises_and_pg_is_unusable() -> None:
    pg = ProcessGroupGloo(timeout=timedelta(milliseconds=300))
    with pytest.raises(Exception):
        pg.configure("127.0.0.1:1/x", "0", 0, 2)
    with pytest.raises(AssertionError, match="not initialized"):
        pg.size()


def test_gloo_rejects_reduce_scatter() -> None:
    pg = ProcessGroupGloo()
    with pytest.raises(RuntimeError, match="reduce_scatter"):
        pg.reduce_scatter([], [], None)
    with pytest.raises(RuntimeError, match="reduce_scatter_tensor_coalesced"):
        pg.reduce_scatter_tensor_coalesced([], [], None)
    assert pg.getBackendName() == "torchft-gloo"


def test_base_class_is_abstract() -> None:
    pg = ProcessGroup(0, 1)
    assert pg.supports_reconfigure is True
    assert pg.errored() is None
    for call in (lambda: pg.allreduce([], ReduceOp.SUM), lambda: pg.size(),
                 lambda: pg.configure("a:1/b", "0", 0, 1), lambda: pg.barrier(None)):
        with pytest.raises(NotImplementedError):
            call()
    with pytest.raises(ValueError):
        _ = pg.group_name


def test_dummy_group() -> None:
    pg = ProcessGroupDummy(0, 1)
    t = torch.ones(2)
    w = pg.allreduce([t], ReduceOp.SUM)
    assert w.wait() is True and w.get_future().value() == [t]
    outs = [[torch.zeros(2)]]
    pg.allgather(outs, [torch.full((2,), 3.0)], AllgatherOptions()).wait()
    assert outs[0][0].tolist() == [3.0, 3.0]
    pg.broadcast([t], BroadcastOptions()).wait()
    pg.configure("x:1/y", "0", 0, 1)
    pg.reconfigure(ReconfigureOptions())
    assert pg.configure_count == 2 and pg.size() == 1
    assert pg.getBackendName() == "torchft-dummy"
    with pytest.raises(AssertionError):
        ProcessGroupDummy(1, 2)


def test_dummy_group_keeps_no_work() -> None:
    """DDP's reducer calls its world-of-one group every step when it
    searches for unused parameters: nothing may pile up."""
    import weakref

    pg = ProcessGroupDummy(0, 1)
    w = pg.allreduce([torch.ones(2)], ReduceOp.SUM)
    ref = weakref.ref(w)
    del w
    assert ref() is None


def test_error_swallowing_wrapper() -> None:
    inner = FakeProcessGroupWrapper(ProcessGroupDummy(0, 1))
    pg = ErrorSwallowingProcessGroupWrapper(inner)
    t = torch.ones(2)
    assert pg.allreduce([t], ReduceOp.SUM).get_future().wait() == [t]
    assert pg.error() is None
    inner.report_future_error(RuntimeError("net down"))
    w = pg.allreduce([t], ReduceOp.SUM)
    # The failure comes back as the default value and a recorded error.
    assert w.get_future().wait() == [t]
    assert isinstance(pg.error(), RuntimeError)
    # Once errored, allreduce is skipped until the next configure.
    assert isinstance(pg.allreduce([t], ReduceOp.SUM), _DummyWork)
    pg.configure("x:1/y", "0", 0, 1)
    assert pg.error() is None
    assert not isinstance(pg.allreduce([t], ReduceOp.SUM), _DummyWork)


def test_error_swallowing_wrapper_issue_time_error() -> None:
    class Broken(ProcessGroupDummy):
        def allreduce(self, tensors, opts):  # type: ignore[no-untyped-def, override]
            raise RuntimeError("cannot issue")

    pg = ErrorSwallowingProcessGroupWrapper(Broken(0, 1))
    w = pg.allreduce([torch.ones(1)], ReduceOp.SUM)
    assert isinstance(w, _DummyWork) and "cannot issue" in str(pg.error())


def test_fake_wrapper_fails_exactly_one_future() -> None:
    pg = FakeProcessGroupWrapper(ProcessGroupDummy(0, 1))
    pg.report_future_error(RuntimeError("once"))
    with pytest.raises(Exception, match="once"):
        pg.allreduce([torch.ones(1)], ReduceOp.SUM).get_future().wait()
    pg.allreduce([torch.ones(1)], ReduceOp.SUM).get_future().wait()


def test_baby_groups_are_in_process_groups() -> None:
    b = ProcessGroupBabyGloo(timeout=2.5)
    assert isinstance(b, ProcessGroupGloo)
    assert b.getBackendName() == "torchft-baby-gloo"
    assert b._timeout == timedelta(seconds=2.5) and b.num_active_work() == 0
    n = ProcessGroupBabyNCCL(timeout=timedelta(seconds=3))
    assert isinstance(n, ProcessGroupNCCL) and n.getBackendName() == "torchft-baby-nccl"
    assert n._timeout == timedelta(seconds=3)


def test_nccl_abort_marks_errored() -> None:
    pg = ProcessGroupNCCL(timeout=TD)
    assert pg.errored() is None
    pg.abort()
    assert isinstance(pg.errored(), RuntimeError)


def require_cuda(what: str) -> None:
    """Skips (with the reason printed) where no CUDA device exists;
    scripts/gpu-check runs these tests on a GPU."""
    if not torch.cuda.is_available():
        reason = f"no CUDA device: {what} needs one (scripts/gpu-check runs it on a GPU)"
        print(f"SKIP: {reason}")
        pytest.skip(reason)


def test_nccl_world_of_one_collectives_abort_and_reconfigure(store) -> None:
    """ProcessGroupNCCL on one GPU at world size 1: each collective gives a
    world of one's result on CUDA tensors (through the deadline wrapper when
    NCCL is 2.25 or newer); abort() reports the group errored and drops its
    communicator; configure() makes it usable again, twice over."""
    require_cuda("ProcessGroupNCCL")
    dev = torch.device("cuda")
    pg = ProcessGroupNCCL(timeout=TD)
    try:
        for q in (1, 2):
            pg.configure(f"127.0.0.1:{store.port}/nccl/{q}", "0", 0, 1, quorum_id=q)
            assert pg.errored() is None and pg.size() == 1
            t = torch.arange(4, dtype=torch.float32, device=dev) + q
            pg.allreduce([t], sum_opts()).wait()
            outs = [[torch.zeros(4, device=dev)]]
            pg.allgather(outs, [t], AllgatherOptions()).wait()
            b = torch.full((3,), 7.0, device=dev)
            pg.broadcast_one(b, 0).wait()
            a2a = torch.zeros(4, device=dev)
            pg.alltoall_base(a2a, t, [], [], AllToAllOptions()).wait()
            rs = torch.zeros(4, device=dev)
            pg.reduce_scatter([rs], [[t]], ReduceScatterOptions()).wait()
            pg.barrier().wait()
            torch.cuda.synchronize()
            want = [float(i + q) for i in range(4)]
            assert t.tolist() == want
            assert outs[0][0].tolist() == want and a2a.tolist() == want
            assert rs.tolist() == want and b.tolist() == [7.0] * 3
            pg.abort()
            assert isinstance(pg.errored(), RuntimeError)
            with pytest.raises(AssertionError, match="not initialized"):
                pg.allreduce([t], sum_opts())
    finally:
        pg.shutdown()


def test_register_presents_the_group_to_c10d(store) -> None:
    """register() makes the reconfigurable group usable through
    torch.distributed calls (as a world of one to c10d)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        pg = ProcessGroupGloo(timeout=TD)
        pg.configure(f"127.0.0.1:{store.port}/reg", "0", 0, 1)
        group = pg.register("api_test_dp")
        t = torch.full((2,), 4.0)
        dist.all_reduce(t, group=group)
        assert t.tolist() == [4.0, 4.0]
        assert dist.get_backend(group) == "torchft-gloo:api_test_dp"
        pg.unregister()
    finally:
        dist.destroy_process_group()


def test_accelerator_deadline_is_looked_up_where_torchft_patches_it() -> None:
    """torchft's tests patch ``torchft.process_group.context_timeout`` and
    ``stream_timeout``; the NCCL/XCCL deadline, in process_group_c10d.py,
    must call what is on process_group at the time of the call."""
    from unittest import mock

    import stepguard.process_group as pgmod

    pg = ProcessGroupDummy(0, 1)
    with mock.patch("stepguard.process_group.context_timeout") as ctx, \
            mock.patch("stepguard.process_group.stream_timeout") as stream:
        work = pgmod._WorkAcceleratorTimeout(pg, _DummyWork(None), TD)
        assert work.wait()
    ctx.assert_called_once_with(pg.abort, TD)
    stream.assert_called_once_with(pg.abort, TD)


@pytest.mark.parametrize(
    "first", ["process_group", "process_group_c10d", "process_group_baby", "process_group_tcp"]
)
def test_split_modules_import_in_any_order(first: str) -> None:
    """The classes split off process_group.py stay its names whichever of
    the files a program imports first."""
    import subprocess
    import sys

    code = (
        f"import stepguard.{first}\n"
        "import stepguard.process_group as p\n"
        "from stepguard.process_group import ProcessGroupBabyGloo, ProcessGroupNCCL\n"
        "assert ProcessGroupBabyGloo().getBackendName() == 'torchft-baby-gloo'\n"
        "assert issubclass(ProcessGroupBabyGloo, p.ProcessGroupGloo)\n"
        "assert {'ProcessGroupXCCL', 'ProcessGroupTCP'} <= set(dir(p))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
