"""stepguard.manager.Manager against a real in-process lighthouse.

Several Managers run on threads of this one process (each with its own
TCPStore and manager server), so these tests also prove the API keeps no
process-wide state.  Every thread is joined with a deadline.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Callable, Dict, List
from unittest.mock import MagicMock

import pytest
import torch
from torch.distributed import ReduceOp, TCPStore

from stepguard.checkpointing import HTTPTransport
from stepguard.coordination import LighthouseServer
from stepguard.manager import (
    ExceptionWithTraceback,
    Manager,
    WorldSizeMode,
    extract_trailing_digits,
    get_timeout,
)
from stepguard.process_group import (
    FakeProcessGroupWrapper,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupNCCL,
)
from stepguard.work import _DummyWork

TD = timedelta(seconds=20)


def run_threads(fns: List[Callable[[], object]], limit_s: float = 90) -> List[object]:
    """Runs each fn on a thread; returns results, re-raises the first error."""
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
        assert not t.is_alive(), f"a replica did not finish within {limit_s} s"
    if errs:
        raise errs[0]
    return out


class Replica:
    """One single-rank replica group: its store, state and Manager."""

    def __init__(self, lh: LighthouseServer, idx: int, pg: object = None,
                 init: float = 0.0, **kw: object) -> None:
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.w = torch.full((4,), init)
        self.loaded: List[Dict[str, torch.Tensor]] = []
        self.pg = pg if pg is not None else ProcessGroupGloo(timeout=TD)
        args: Dict[str, object] = dict(
            min_replica_size=2, rank=0, world_size=1, store_addr="127.0.0.1",
            store_port=self.store.port, lighthouse_addr=lh.address(),
            replica_id=f"replica_{idx}", timeout=TD, quorum_timeout=TD,
            connect_timeout=TD, hostname="127.0.0.1",
        )
        args.update(kw)
        self.manager = Manager(self.pg, self._load, lambda: {"w": self.w}, **args)  # type: ignore[arg-type]

    def _load(self, sd: Dict[str, torch.Tensor]) -> None:
        # a copy: a transport that fetches in place hands over the
        # replica's own tensors, which keep changing after the load
        self.loaded.append({k: v.clone() for k, v in sd.items()})
        self.w.copy_(sd["w"])

    def step(self, grad: float) -> tuple:
        m = self.manager
        m.start_quorum()
        g = torch.full((4,), grad)
        ok = m.allreduce(g).wait()
        committed = m.should_commit()
        if committed:
            self.w.add_(g)
        return ok, committed, g[0].item(), m.num_participants()


@pytest.fixture
def lighthouse():
    lh = LighthouseServer("127.0.0.1:0", 2, join_timeout_ms=100)
    yield lh
    lh.shutdown()


def shutdown_all(replicas: List[Replica]) -> None:
    for r in replicas:
        r.manager.shutdown(wait=False)


def test_two_replicas_average_heal_and_commit(lighthouse) -> None:
    rs = [Replica(lighthouse, i, init=float(10 * i)) for i in range(2)]
    try:
        results = run_threads([lambda r=r, i=i: [r.step(float(i + 1)) for _ in range(3)]
                               for i, r in enumerate(rs)])
        for i, steps in enumerate(results):
            assert [s[1] for s in steps] == [True, True, True], steps
            # Step 1: replica 1 heals (init_sync) and contributes zeros, the
            # divisor still counts both: (1 + 0) / 2.  Then (1 + 2) / 2.
            assert [s[2] for s in steps] == [0.5, 1.5, 1.5], steps
            assert all(s[3] == 2 for s in steps)
        # Replica 1 received replica 0's weights (0.0) before its first update.
        assert len(rs[1].loaded) == 1 and rs[1].loaded[0]["w"][0].item() == 0.0
        assert rs[0].loaded == []
        assert torch.equal(rs[0].w, rs[1].w)
        assert rs[0].w[0].item() == pytest.approx(3.5)
        for r in rs:
            assert r.manager.current_step() == 3
            assert r.manager.batches_committed() == 6
            assert r.manager.state_dict() == {"step": 3, "batches_committed": 6}
    finally:
        shutdown_all(rs)


def test_sync_quorum_heals_before_forward(lighthouse) -> None:
    rs = [Replica(lighthouse, i, init=float(10 * i), use_async_quorum=False) for i in range(2)]
    try:
        def first(r: Replica) -> tuple:
            r.manager.start_quorum()
            # Healing is done when start_quorum returns: the weights are the
            # source's and this replica participates fully.
            return r.w[0].item(), r.manager.is_participating(), r.manager.participating_rank()

        got = run_threads([lambda r=r: first(r) for r in rs])
        assert got[0] == (0.0, True, 0) and got[1] == (0.0, True, 1)
    finally:
        shutdown_all(rs)


def test_replica_ids_get_a_uuid_and_global_rank(lighthouse) -> None:
    rs = run_threads([lambda i=i: Replica(lighthouse, i + 3) for i in range(2)])
    try:
        ids = [r.manager._logger._replica_id for r in rs]  # type: ignore[union-attr]
        assert ids[0].startswith("replica_3:") and len(ids[0]) > len("replica_3:") + 30
        assert rs[1].manager._global_rank == 4  # type: ignore[union-attr]
    finally:
        shutdown_all(rs)  # type: ignore[arg-type]


def test_future_error_fails_the_step_and_reconfigures(lighthouse) -> None:
    pgs = [FakeProcessGroupWrapper(ProcessGroupGloo(timeout=TD)) for _ in range(2)]
    # min_replica_size 1: while replica 0 heals (async quorum), only replica
    # 1 participates, and one participant must be enough to commit.
    rs = run_threads([lambda i=i: Replica(lighthouse, i, pg=pgs[i], min_replica_size=1)
                      for i in range(2)])
    try:
        run_threads([lambda r=r: r.step(1.0) for r in rs])
        # Replica 0's next allreduce fails: it must not raise, and replica 0
        # must discard the step (replica 1's allreduce worked: it commits).
        pgs[0].report_future_error(RuntimeError("injected"))
        got = run_threads([lambda r=r: r.step(1.0) for r in rs])
        # The failure is swallowed by wrap_future (wait() does not raise).
        assert got[0][1] is False and got[1][1] is True
        assert isinstance(rs[0].manager.errored(), ExceptionWithTraceback)
        assert "injected" in str(rs[0].manager.errored().original_exception)
        assert [r.manager.current_step() for r in rs] == [1, 2]
        q1 = rs[0].manager._quorum_id
        # The failure is reported at the next quorum, which gets a new id and
        # rebuilds the process group; replica 0 heals from replica 1 and both
        # commit with identical weights.
        got = run_threads([lambda r=r: r.step(1.0) for r in rs])
        assert got[0][1] is True and got[1][1] is True
        assert rs[0].manager._quorum_id != q1
        assert rs[0].manager.errored() is None
        assert [r.manager.current_step() for r in rs] == [3, 3]
        assert torch.equal(rs[0].w, rs[1].w)
    finally:
        shutdown_all(rs)  # type: ignore[arg-type]


def test_allreduce_after_error_is_a_noop_and_int_avg_raises(lighthouse) -> None:
    lh1 = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    r = Replica(lh1, 0, pg=ProcessGroupDummy(0, 1), min_replica_size=1)
    try:
        m = r.manager
        m.start_quorum()
        t = torch.ones(3)
        assert m.allreduce(t).wait() is True
        assert torch.equal(t, torch.ones(3))  # one participant: average of itself
        with pytest.raises(ValueError):
            m.allreduce(torch.ones(3, dtype=torch.int64))
        s = torch.ones(2, dtype=torch.int64)
        assert m.allreduce(s, reduce_op=ReduceOp.SUM).wait() is True
        m.report_error(RuntimeError("boom"))
        t = torch.full((3,), 7.0)
        work = m.allreduce(t)
        assert isinstance(work, _DummyWork)
        assert torch.equal(t, torch.full((3,), 7.0))
        assert m.should_commit() is False
    finally:
        r.manager.shutdown(wait=False)
        lh1.shutdown()


def test_max_retries_raises_after_consecutive_failures(lighthouse) -> None:
    lh1 = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    # min_replica_size 2 with one replica: every step fails to commit.
    r = Replica(lh1, 0, pg=ProcessGroupDummy(0, 1), min_replica_size=2, max_retries=2)
    try:
        m = r.manager
        for _ in range(2):
            m.start_quorum()
            assert m.should_commit() is False
        m.start_quorum()
        with pytest.raises(RuntimeError, match="exceeding max_retries=2"):
            m.should_commit()
        assert m.current_step() == 0
    finally:
        r.manager.shutdown(wait=False)
        lh1.shutdown()


def test_fixed_with_spares_counts_at_most_min_replicas() -> None:
    lh = LighthouseServer("127.0.0.1:0", 3, join_timeout_ms=100)
    rs = run_threads([lambda i=i: Replica(lh, i, min_replica_size=2, init=0.0,
                                          world_size_mode=WorldSizeMode.FIXED_WITH_SPARES,
                                          init_sync=False)
                      for i in range(3)])
    try:
        got = run_threads([lambda r=r, i=i: (r.step(float(i + 1)),
                                             r.manager.participating_rank(),
                                             r.manager.is_participating())
                           for i, r in enumerate(rs)])
        parts = sorted((g[1] if g[1] is not None else 99) for g in got)
        assert parts == [0, 1, 99]  # two participants, one spare
        for (ok, committed, value, n), rank, participating in got:
            assert committed and n == 2
            assert participating == (rank is not None)
        # The spare's gradient (zeros) is not in the sum: (g_a + g_b) / 2
        # over the two participants.
        grads = {rank: i + 1.0 for i, (_, rank, _) in enumerate(got)}
        expect = (sum(v for k, v in grads.items() if k is not None)) / 2
        assert all(g[0][2] == pytest.approx(expect) for g in got)
    finally:
        shutdown_all(rs)  # type: ignore[arg-type]
        lh.shutdown()


def test_should_commit_order() -> None:
    """The exact order of should_commit: pg error, healing load, vote,
    disallow, then the step counters."""
    lh1 = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    r = Replica(lh1, 0, pg=ProcessGroupDummy(0, 1), min_replica_size=1)
    m = r.manager
    try:
        m.start_quorum()
        m.wait_quorum()
        calls: List[str] = []
        pg_err = RuntimeError("pg failed")
        m._pg.errored = lambda: (calls.append("pg.errored"), pg_err)[1]  # type: ignore[method-assign]
        m._healing = True
        m._pending_state_dict = {"user": {"default": {"w": torch.full((4,), 5.0)}},
                                 "torchft": {"step": 0, "batches_committed": 0}}
        orig_load = m._load_state_dict_fns["default"]
        m._load_state_dict_fns["default"] = lambda sd: (calls.append("load"), orig_load(sd))
        real_client = m._client
        votes: List[bool] = []

        def vote(rank: int, step: int, local: bool, timeout: timedelta) -> bool:
            calls.append("vote")
            votes.append(local)
            return real_client.should_commit(rank, step, local, timeout)

        fake = MagicMock()
        fake.should_commit.side_effect = vote
        m._client = fake
        transport = m._checkpoint_transport
        orig_disallow = transport.disallow_checkpoint
        transport.disallow_checkpoint = lambda: (calls.append("disallow"), orig_disallow())  # type: ignore[method-assign]
        assert m.should_commit() is False
        assert calls == ["pg.errored", "load", "vote", "disallow"]
        assert votes == [False]  # the pg error was reported before the vote
        assert r.w[0].item() == 5.0  # healed weights applied
        assert m.errored() is not None and m.errored().original_exception is pg_err
        assert m._commit_failures == 1 and m.current_step() == 0
        m._client = real_client
    finally:
        m.shutdown(wait=False)
        lh1.shutdown()


def test_wrap_future_timeout_reports_and_returns_default(lighthouse) -> None:
    lh1 = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    r = Replica(lh1, 0, pg=ProcessGroupDummy(0, 1), min_replica_size=1)
    m = r.manager
    try:
        never: torch.futures.Future[int] = torch.futures.Future()
        fut = m.wrap_future(never, default=42, timeout=timedelta(milliseconds=50))
        assert fut.wait() == 42
        assert isinstance(m.errored().original_exception, TimeoutError)  # type: ignore[union-attr]
        m._errored = None
        failing: torch.futures.Future[int] = torch.futures.Future()
        fut = m.wrap_future(failing, default=7)
        failing.set_exception(RuntimeError("bad"))
        assert fut.wait() == 7
        assert "bad" in str(m.errored())
        ok: torch.futures.Future[int] = torch.futures.Future()
        m._errored = None
        fut = m.wrap_future(ok, default=0)
        ok.set_result(3)
        assert fut.wait() == 3 and m.errored() is None
    finally:
        m.shutdown(wait=False)
        lh1.shutdown()


def test_managed_work_chain_runs_lazily_in_order(lighthouse) -> None:
    lh1 = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    r = Replica(lh1, 0, pg=ProcessGroupDummy(0, 1), min_replica_size=1)
    m = r.manager
    try:
        m.start_quorum()
        t = torch.full((2,), 4.0)
        work = m.allreduce(t, reduce_op=ReduceOp.SUM)
        seen: List[object] = []
        # as torchft's: the first callback gets the reduced tensor itself
        # (not the process group's list), each later one its predecessor's result
        fut = work.get_future().then(lambda f: (seen.append("a"), f.value() * 2)[1])
        fut = fut.then(lambda f: (seen.append("b"), f.value() + 1)[1])
        assert seen == []  # nothing runs before the work is waited on
        with pytest.raises(NotImplementedError):
            fut.value()
        assert work.wait() is True
        assert seen == ["a", "b"]
        assert torch.equal(fut._fut.value(), torch.full((2,), 9.0))  # type: ignore[attr-defined]
        # A failing callback fails the step instead of raising (as torchft's,
        # wrap_future around the first link records it and completes it).
        work = m.allreduce(torch.ones(1), reduce_op=ReduceOp.SUM)
        work.get_future().then(lambda f: 1 / 0)
        work.wait()
        assert m.errored() is not None
        # torch wraps a callback's exception in a RuntimeError naming it.
        assert "ZeroDivisionError" in str(m.errored().original_exception)  # type: ignore[union-attr]
    finally:
        m.shutdown(wait=False)
        lh1.shutdown()


def test_managed_work_on_cuda_keeps_its_stream() -> None:
    """On a GPU (NCCL, a world of one) a managed work belongs to the stream
    current when it was made: its callbacks run on that stream, not on the
    waiter's; waiting from another stream is refused; block_current_stream
    and synchronize order that stream after the operation."""
    if not torch.cuda.is_available():
        reason = "no CUDA device: _ManagedWork's streams need one (scripts/gpu-check runs it)"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    lh1 = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    r = Replica(lh1, 0, pg=ProcessGroupNCCL(timeout=TD), min_replica_size=1)
    m = r.manager
    try:
        m.start_quorum()
        side = torch.cuda.Stream()
        seen: List[int] = []

        def record(f: object) -> object:
            seen.append(torch.cuda.current_stream().cuda_stream)
            return f.value() * 2  # type: ignore[attr-defined]

        with torch.cuda.stream(side):
            t = torch.full((1 << 16,), 3.0, device="cuda")
            work = m.allreduce(t)  # AVG: a callback of the manager's own first
            fut = work.get_future().then(record)
        assert torch.cuda.current_stream().cuda_stream != side.cuda_stream
        with pytest.raises(AssertionError, match="stream it was created on"):
            work.wait()
        assert seen == []
        with torch.cuda.stream(side):
            assert work.wait() is True
        assert seen == [side.cuda_stream]
        side.synchronize()
        assert torch.equal(fut._fut.value(), torch.full((1 << 16,), 6.0, device="cuda"))  # type: ignore[attr-defined]
        for how in ("block_current_stream", "synchronize"):
            with torch.cuda.stream(side):
                u = torch.full((1 << 16,), 5.0, device="cuda")
                w = m.allreduce(u, reduce_op=ReduceOp.SUM)
                getattr(w, how)()
                v = u * 2  # queued on `side` behind the allreduce
            side.synchronize()
            assert torch.equal(v, torch.full((1 << 16,), 10.0, device="cuda")), how
        assert m.errored() is None
        assert m.should_commit()
    finally:
        m.shutdown(wait=False)
        lh1.shutdown()


def test_env_overrides_arguments_everywhere(monkeypatch, lighthouse) -> None:
    monkeypatch.setenv("STEPGUARD_TIMEOUT_SEC", "7")
    monkeypatch.setenv("TORCHFT_QUORUM_TIMEOUT_SEC", "9")
    monkeypatch.setenv("STEPGUARD_CONNECT_TIMEOUT_SEC", "11")
    monkeypatch.setenv("STEPGUARD_LIGHTHOUSE", lighthouse.address())
    lh_addr = None
    r = Replica(lighthouse, 0, pg=ProcessGroupDummy(0, 1), lighthouse_addr=lh_addr)
    m = r.manager
    try:
        assert m._timeout == timedelta(seconds=7)
        assert m._quorum_timeout == timedelta(seconds=9)
        assert m._connect_timeout == timedelta(seconds=11)
        # The default transport and the state lock follow the override too.
        assert m._checkpoint_transport._timeout == timedelta(seconds=7)  # type: ignore[attr-defined]
        assert m._state_dict_lock._timeout == 7
    finally:
        m.shutdown(wait=False)


def test_state_dict_read_gate_blocks_checkpoint_reads(lighthouse) -> None:
    lh1 = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    r = Replica(lh1, 0, pg=ProcessGroupDummy(0, 1), min_replica_size=1,
                timeout=timedelta(milliseconds=200))
    m = r.manager
    try:
        m.disallow_state_dict_read()
        m.disallow_state_dict_read()  # idempotent
        with pytest.raises(TimeoutError):
            m._manager_state_dict()
        m.allow_state_dict_read()
        m.allow_state_dict_read()
        sd = m._manager_state_dict()
        assert set(sd) == {"user", "torchft"} and "default" in sd["user"]  # type: ignore[operator]
    finally:
        m.shutdown(wait=False)
        lh1.shutdown()


def test_register_state_dict_fn_rejects_duplicates(lighthouse) -> None:
    lh1 = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    r = Replica(lh1, 0, pg=ProcessGroupDummy(0, 1), min_replica_size=1)
    try:
        with pytest.raises(AssertionError):
            r.manager.register_state_dict_fn("default", lambda sd: None, lambda: {})
        r.manager.register_state_dict_fn("extra", lambda sd: None, lambda: {"x": 1})
        assert r.manager._manager_state_dict()["user"]["extra"] == {"x": 1}  # type: ignore[index]
        assert r.manager.num_participants() == 0
        assert r.manager.participating_rank() is None
    finally:
        r.manager.shutdown(wait=False)
        lh1.shutdown()


def test_non_reconfigurable_pg_is_rejected(lighthouse) -> None:
    with pytest.raises(ValueError, match="reconfigurable"):
        Manager(object(), None, None, 1, rank=0, world_size=1,  # type: ignore[arg-type]
                store_addr="127.0.0.1", store_port=1, lighthouse_addr=lighthouse.address())


def test_helpers() -> None:
    assert extract_trailing_digits("train_ddp_3") == 3
    assert extract_trailing_digits("abc") == 0
    assert extract_trailing_digits("x12") == 12
    assert get_timeout(None, timedelta(seconds=5)) == timedelta(seconds=5)
    assert get_timeout("3", timedelta(seconds=5)) == timedelta(seconds=3)
    e = ExceptionWithTraceback(ValueError("v"))
    assert isinstance(e.original_exception, ValueError) and "ValueError" in e.stack_trace
    assert WorldSizeMode.DYNAMIC.value == 0 and WorldSizeMode.FIXED_WITH_SPARES.value == 1


def test_quorum_logs(lighthouse, caplog) -> None:
    lh1 = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    r = Replica(lh1, 0, pg=ProcessGroupDummy(0, 1), min_replica_size=1)
    try:
        with caplog.at_level(logging.INFO):
            r.manager.start_quorum()
            r.manager.should_commit()
        quorums = [rec for rec in caplog.records if rec.name == "torchft_quorums"]
        commits = [rec for rec in caplog.records if rec.name == "torchft_commits"]
        assert len(quorums) == 1 and quorums[0].replica_id == "replica_0"  # type: ignore[attr-defined]
        assert len(commits) == 1 and commits[0].commit_result is True  # type: ignore[attr-defined]
        assert r.pg.configure_count == 1  # type: ignore[attr-defined]
    finally:
        r.manager.shutdown(wait=False)
        lh1.shutdown()


@pytest.mark.parametrize("transport", ["http", "pg"])
@pytest.mark.parametrize("torchft_index", [0, 1])
def test_mixed_job_with_a_torchft_manager(lighthouse, torchft_index: int, transport: str) -> None:
    """A torchft Manager (its own process group and transport) and a
    stepguard Manager train in one quorum: they rebuild one Gloo group from
    the handles the lighthouse carries, and the one that is behind heals
    from the other (index 0 is the source: replica ranks follow ids), both
    ways, over HTTP or over each side's PGTransport on its own group."""
    tfm = pytest.importorskip("torchft.manager")
    tfp = pytest.importorskip("torchft.process_group")
    tft = pytest.importorskip("torchft.checkpointing.pg_transport")
    import stepguard.checkpointing.pg_transport as sgt
    import stepguard.manager as sgm
    import stepguard.process_group as sgp

    kinds = [(sgm, sgp, sgt), (sgm, sgp, sgt)]
    kinds[torchft_index] = (tfm, tfp, tft)
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    ws = [torch.full((3,), float(10 * i)) for i in range(2)]
    managers: List[object] = [None, None]
    received: List[int] = []

    def make(i: int) -> None:
        mod, pgmod, tmod = kinds[i]
        pg = pgmod.ProcessGroupGloo(timeout=TD)
        if transport == "pg":
            class Counted(tmod.PGTransport):  # type: ignore[name-defined, misc]
                def recv_checkpoint(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                    received.append(i)
                    return super().recv_checkpoint(*args, **kwargs)

            extra = {"checkpoint_transport": Counted(pg, timeout=TD, device="cpu")}
        else:
            # torchft heals over HTTP in its own format: a stepguard replica
            # in a mixed job serves that format too.
            extra = {} if mod is tfm else {"checkpoint_transport": HTTPTransport(TD, 0)}
        managers[i] = mod.Manager(
            pg, lambda sd, i=i: ws[i].copy_(sd["w"]),
            lambda i=i: {"w": ws[i]}, min_replica_size=1, rank=0, world_size=1,
            store_addr="127.0.0.1", store_port=stores[i].port,
            lighthouse_addr=lighthouse.address(), replica_id=f"mixed_{i}", timeout=TD,
            quorum_timeout=TD, connect_timeout=TD, hostname="127.0.0.1", **extra)

    def train(i: int) -> list:
        m = managers[i]
        out = []
        for _ in range(3):
            m.start_quorum()  # type: ignore[attr-defined]
            g = torch.full((3,), float(i + 1))
            m.allreduce(g).wait()  # type: ignore[attr-defined]
            committed = m.should_commit()  # type: ignore[attr-defined]
            if committed:
                ws[i].add_(g)
            out.append((committed, g[0].item()))
        return out

    run_threads([lambda i=i: make(i) for i in range(2)])
    try:
        got = run_threads([lambda i=i: train(i) for i in range(2)])
        assert got[0] == got[1] == [(True, 0.5), (True, 1.5), (True, 1.5)]
        assert torch.equal(ws[0], ws[1]) and ws[0][0].item() == pytest.approx(3.5)
        if transport == "pg":
            assert received == [1]  # replica 1 healed, once, over PGTransport
    finally:
        for m in managers:
            if m is not None:
                m.shutdown(wait=False)  # type: ignore[attr-defined]


def test_managed_process_group_goes_through_the_manager() -> None:
    from torch.distributed.distributed_c10d import AllreduceOptions

    from stepguard.process_group import ManagedProcessGroup

    lh1 = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    r = Replica(lh1, 0, pg=ProcessGroupDummy(0, 1), min_replica_size=1)
    m = r.manager
    try:
        mpg = ManagedProcessGroup(m)
        assert mpg.getBackendName() == "torchft-dummy"
        assert mpg.size() == 0  # no quorum yet
        m.start_quorum()
        assert mpg.size() == 1
        t = torch.full((2,), 3.0)
        assert mpg.allreduce([t], ReduceOp.SUM).wait() is True
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.AVG
        assert mpg.allreduce([t], opts).wait() is True
        assert torch.equal(t, torch.full((2,), 3.0))
        with pytest.raises(AssertionError):
            mpg.allreduce([t, t], ReduceOp.SUM)
        m.report_error(RuntimeError("x"))
        assert isinstance(mpg.allreduce([t], ReduceOp.SUM), _DummyWork)
    finally:
        m.shutdown(wait=False)
        lh1.shutdown()


def test_store_rendezvous_when_a_replica_has_no_handle(lighthouse) -> None:
    """One replica cannot produce a reconfigure handle: every replica then
    meets on the quorum's store (the path for managers that carry no
    handles) and training goes on."""

    reconfigures: List[int] = []

    class Counting(ProcessGroupGloo):
        def reconfigure(self, opts):  # type: ignore[no-untyped-def, override]
            reconfigures.append(1)
            return super().reconfigure(opts)

    class NoHandle(Counting):
        def get_reconfigure_handle(self) -> str:
            raise OSError("no address")

    rs = run_threads([lambda i=i: Replica(lighthouse, i, min_replica_size=1,
                                          pg=(NoHandle if i == 0 else Counting)(timeout=TD))
                      for i in range(2)])
    try:
        got = run_threads([lambda r=r: [r.step(1.0) for _ in range(2)] for r in rs])
        assert got[0] == got[1] == [(True, True, 0.5, 2), (True, True, 1.0, 2)]
        # The group was built by configure() on the quorum store.
        assert reconfigures == []
        assert rs[1].pg._world_size == 2 and rs[1].pg._global_ranks == [0, 1]  # type: ignore[attr-defined]
        assert torch.equal(rs[0].w, rs[1].w)
    finally:
        shutdown_all(rs)  # type: ignore[arg-type]


def test_two_groups_of_two_ranks_vote_per_group(lighthouse) -> None:
    """Two replica groups of two ranks each (four Managers on threads):
    group rank r of each group shares a process group, and a failure on one
    rank fails the commit of both ranks of its group only."""
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    pgs = {(g, r): FakeProcessGroupWrapper(ProcessGroupGloo(timeout=TD))
           for g in range(2) for r in range(2)}
    ws = {k: torch.full((2,), float(10 * k[0] + k[1])) for k in pgs}
    managers: Dict[tuple, Manager] = {}

    def make(g: int, r: int) -> None:
        managers[(g, r)] = Manager(
            pgs[(g, r)], lambda sd, k=(g, r): ws[k].copy_(sd["w"]),
            lambda k=(g, r): {"w": ws[k]}, min_replica_size=1, rank=r, world_size=2,
            store_addr="127.0.0.1", store_port=stores[g].port,
            lighthouse_addr=lighthouse.address(), replica_id=f"group_{g}", timeout=TD,
            quorum_timeout=TD, connect_timeout=TD, hostname="127.0.0.1")

    def step(k: tuple, fail: bool) -> bool:
        m = managers[k]
        m.start_quorum()
        if fail:
            pgs[k].report_future_error(RuntimeError("rank failure"))
        g = torch.full((2,), 1.0)
        m.allreduce(g).wait()
        committed = m.should_commit()
        if committed:
            ws[k].add_(g)
        return committed

    keys = sorted(pgs)
    run_threads([lambda k=k: make(*k) for k in keys])
    try:
        assert run_threads([lambda k=k: step(k, False) for k in keys]) == [True] * 4
        # Group 0's rank 1 fails: group 0 (both ranks) discards the step.
        got = run_threads([lambda k=k: step(k, k == (0, 1)) for k in keys])
        assert dict(zip(keys, got)) == {(0, 0): False, (0, 1): False, (1, 0): True, (1, 1): True}
        assert [managers[k].current_step() for k in keys] == [1, 1, 2, 2]
        # Next step group 0 heals from group 1, rank by rank.
        assert run_threads([lambda k=k: step(k, False) for k in keys]) == [True] * 4
        for r in range(2):
            assert torch.equal(ws[(0, r)], ws[(1, r)])
        assert ws[(1, 0)][0].item() != ws[(1, 1)][0].item()  # ranks hold their own shard
    finally:
        for m in managers.values():
            m.shutdown(wait=False)
