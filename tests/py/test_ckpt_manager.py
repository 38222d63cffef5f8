"""NativeTransport under stepguard's Manager: two replica groups that start
with different weights; at step 0 (init_sync) the second heals from the
first through the transport, and from then on they step in lockstep with
identical parameters.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from stepguard.checkpointing.native_transport import NativeTransport
from stepguard.coordination import LighthouseServer

manager_mod = pytest.importorskip("stepguard.manager")
pg_mod = pytest.importorskip("stepguard.process_group")

STEPS = 3


def _manager(
    model: torch.nn.Module,
    lighthouse: str,
    replica_id: str,
    min_replica_size: int,
    **kwargs,
) -> tuple:
    """A Manager of a replica group of one rank for ``model``, with its own
    store; returns both (the store must outlive the Manager)."""
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False
    )
    manager = manager_mod.Manager(
        pg=pg_mod.ProcessGroupGloo(timeout=timedelta(seconds=20)),
        load_state_dict=lambda sd: model.load_state_dict(sd),
        state_dict=lambda: model.state_dict(),
        min_replica_size=min_replica_size,
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=20),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=replica_id,
        port=0,
        hostname="127.0.0.1",
        **kwargs,
    )
    return manager, store


def _run_two(target, lighthouse: str, out: dict, errors: list) -> None:
    """Runs ``target(i, lighthouse, out, errors)`` for replicas 0 and 1 in
    threads and fails if either is still running after 120 s."""
    threads = [
        threading.Thread(target=target, args=(i, lighthouse, out, errors))
        for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "replicas hung"


def _replica(idx: int, lighthouse: str, out: dict, errors: list) -> None:
    try:
        torch.manual_seed(100 + idx)  # different weights in each group
        model = torch.nn.Linear(6, 3)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        transport = NativeTransport(timedelta(seconds=30), hostname="127.0.0.1")
        manager, _store = _manager(
            model, lighthouse, f"ckpt_{idx}", 2, checkpoint_transport=transport
        )
        hashes = []
        try:
            while manager.current_step() < STEPS:
                gen = torch.Generator().manual_seed(manager.current_step())
                x = torch.randn(4, 6, generator=gen)
                y = torch.randn(4, 3, generator=gen)
                manager.start_quorum()
                inner.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                for p in model.parameters():
                    manager.allreduce(p.grad).wait()
                if manager.should_commit():
                    inner.step()
                params = [p.detach().clone() for p in model.parameters()]
                hashes.append((manager.current_step(), params))
            out[idx] = {"hashes": hashes, "sent": transport.stats()["bytes_sent"]}
        finally:
            manager.shutdown(wait=False)
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def test_heal_through_native_transport() -> None:
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    out: dict = {}
    errors: list = []
    try:
        _run_two(_replica, lh.address(), out, errors)
    finally:
        lh.shutdown()
    assert not errors, errors
    assert sorted(out) == [0, 1]
    # exactly one replica group served its state at step 0 (init_sync)
    sent = [out[i]["sent"] for i in range(2)]
    assert sorted(x > 0 for x in sent) == [False, True], sent
    a, b = out[0]["hashes"], out[1]["hashes"]
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, STEPS + 1))
    for (_, pa), (_, pb) in zip(a, b):
        for x, y in zip(pa, pb):
            assert torch.equal(x, y)


def _striping_replica(
    idx: int, lighthouse: str, gate: threading.Event, reached: threading.Event,
    joined: threading.Event, out: dict, errors: list,
) -> None:
    """Trains to step 6; replica 2 starts only once the others are at step 2,
    so it heals from both of them (the Manager's default transport).  The
    others wait at step 2 until replica 2 has asked for its first quorum:
    without that, a slow start let them run on to step 6 and leave it alone
    below min_replicas."""
    try:
        if not gate.wait(120):
            raise TimeoutError("never let in")
        torch.manual_seed(200 + idx)
        model = torch.nn.Linear(1024, 1024)  # 4 MiB: several chunks
        inner = torch.optim.SGD(model.parameters(), lr=0.01)
        manager, _store = _manager(model, lighthouse, f"stripe_{idx}", 2)
        transport = manager._checkpoint_transport
        assert isinstance(transport, NativeTransport)  # the default
        healed_from: list = []
        try:
            while manager.current_step() < 6:
                if manager.current_step() >= 2:
                    reached.set()
                    if idx < 2 and not joined.wait(120):
                        raise TimeoutError("replica 2 never asked for a quorum")
                gen = torch.Generator().manual_seed(manager.current_step())
                x = torch.randn(8, 1024, generator=gen)
                manager.start_quorum()
                if idx == 2:
                    joined.set()
                inner.zero_grad()
                model(x).square().mean().backward()
                for p in model.parameters():
                    manager.allreduce(p.grad).wait()
                if manager.should_commit():
                    inner.step()
                if transport.last_recv_bytes and not healed_from:
                    healed_from = list(transport.last_recv_bytes)
            out[idx] = {
                "params": [p.detach().clone() for p in model.parameters()],
                "sent": transport.stats()["bytes_sent"],
                "healed_from": healed_from,
            }
        finally:
            manager.shutdown(wait=False)
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def test_late_replica_heals_striped_across_both_up_to_date_peers() -> None:
    # A quorum waits this long for a heartbeating replica that has not asked
    # yet: with 100 ms, a busy host formed one of replica 2 and a single
    # early replica, which then healed it alone.
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=30000)
    out: dict = {}
    errors: list = []
    go, reached, joined = threading.Event(), threading.Event(), threading.Event()
    go.set()
    late = threading.Event()
    try:
        threads = [
            threading.Thread(
                target=_striping_replica,
                args=(i, lh.address(), go if i < 2 else late, reached, joined, out,
                      errors),
            )
            for i in range(3)
        ]
        for t in threads:
            t.start()
        assert reached.wait(120), "the first two replicas did not reach step 2"
        late.set()
        for t in threads:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in threads), "replicas hung"
    finally:
        late.set()
        joined.set()
        lh.shutdown()
    assert not errors, errors
    assert sorted(out) == [0, 1, 2]
    # the late replica fetched its whole state from both sources together.
    # How it splits is timing: a source whose streams start late has its
    # share taken by the other's (one source took all 4 MiB under load);
    # that each of two sources contributes is test_ckpt.c's
    # test_striped_two_sources, which holds the streams back to check it.
    got = out[2]["healed_from"]
    state = sum(p.numel() * p.element_size() for p in out[2]["params"])
    assert len(got) == 2 and sum(got) == state, (got, state)
    assert out[0]["sent"] + out[1]["sent"] >= state, (out[0]["sent"], out[1]["sent"])
    for a, b in ((0, 1), (0, 2)):
        for x, y in zip(out[a]["params"], out[b]["params"]):
            assert torch.equal(x, y)


class _CutOnce(NativeTransport):
    """Fails its first fetch half way: half of what it fetched in place is
    overwritten again (as a source killed mid-transfer leaves it), then the
    fetch raises."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cuts = 0
        self.in_place = []  # in_place_bytes of each fetch that completed

    def recv_checkpoint_striped(self, sources, step, timeout, *, into=None):
        got = super().recv_checkpoint_striped(sources, step, timeout, into=into)
        if self.cuts == 0:
            self.cuts += 1
            assert into is not None, "the Manager fetches in place"
            w = into["user"]["default"]["weight"]
            w.view(-1)[: w.numel() // 2] = float("nan")
            raise RuntimeError("checkpoint source: truncated stream")
        self.in_place.append(self.last_recv_stats["in_place_bytes"])
        return got


def _cut_replica(idx: int, lighthouse: str, out: dict, errors: list) -> None:
    try:
        torch.manual_seed(300 + idx)
        model = torch.nn.Linear(64, 32)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        cls = _CutOnce if idx == 1 else NativeTransport
        transport = cls(timedelta(seconds=30), hostname="127.0.0.1", in_place=True)
        manager, _store = _manager(
            model, lighthouse, f"cut_{idx}", 1, checkpoint_transport=transport
        )
        steps, commits = [], []
        try:
            while manager.current_step() < 4 and len(steps) < 20:
                gen = torch.Generator().manual_seed(max(manager.current_step(), 0))
                x = torch.randn(4, 64, generator=gen)
                manager.start_quorum()
                inner.zero_grad()
                model(x).square().mean().backward()
                for p in model.parameters():
                    manager.allreduce(p.grad).wait()
                ok = manager.should_commit()
                if ok:
                    inner.step()
                commits.append(ok)
                steps.append(manager.current_step())
            out[idx] = {
                "steps": steps,
                "commits": commits,
                "params": [p.detach().clone() for p in model.parameters()],
                "in_place": list(getattr(transport, "in_place", [])),
            }
        finally:
            manager.shutdown(wait=False)
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def test_in_place_fetch_cut_half_way_reports_step_minus_one_and_heals_later() -> None:
    """Replica 1 heals in place at step 0 and its fetch fails half way: it
    does not commit, reports step -1 (never a source), and heals at the next
    quorum, in place, into identical parameters."""
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    out: dict = {}
    errors: list = []
    try:
        _run_two(_cut_replica, lh.address(), out, errors)
    finally:
        lh.shutdown()
    assert not errors, errors
    assert sorted(out) == [0, 1]
    healer = out[1]
    # the cut step: no commit, step -1; then healed and in lockstep
    assert healer["commits"][0] is False and healer["steps"][0] == -1, healer
    assert -1 not in healer["steps"][1:], healer
    assert healer["steps"][-1] == 4 == out[0]["steps"][-1]
    nbytes = sum(p.numel() * 4 for p in out[0]["params"])
    assert healer["in_place"] == [nbytes], healer["in_place"]
    for x, y in zip(out[0]["params"], healer["params"]):
        assert not x.isnan().any()
        assert torch.equal(x, y)


def test_a_stripe_peer_that_died_is_left_out_within_the_op_timeout(caplog) -> None:
    """A healer asks every up-to-date peer of its quorum for its transport
    metadata to stripe the fetch.  A peer that died since the quorum
    formed (its port refuses) is left out with a warning, within the
    operation timeout: the assigned source alone heals, and the heal is
    not held up for the connect timeout (which retries a refused
    connection, for a peer that is still starting)."""
    import socket
    import time
    from types import SimpleNamespace

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()  # nothing listens there now
    m = manager_mod.Manager.__new__(manager_mod.Manager)
    m._step = 3
    m._group_rank = 0
    m._timeout = timedelta(seconds=2)
    m._connect_timeout = timedelta(seconds=60)
    m._checkpoint_transport = SimpleNamespace(recv_checkpoint_striped=None)
    m._logger = manager_mod._ManagerLogger(m, "healer", 0)
    quorum = SimpleNamespace(up_to_date_manager_addresses=["http://src:1", dead])
    t0 = time.monotonic()
    with caplog.at_level("WARNING"):
        got = m._stripe_sources(quorum, "http://src:1", "http://src-meta")
    took = time.monotonic() - t0
    assert got == ["http://src-meta"]
    assert f"no checkpoint metadata from {dead}" in caplog.text
    assert took < 30, f"{took:.1f} s: the dead peer held the heal up"
