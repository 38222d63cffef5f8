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


def _replica(idx: int, lighthouse: str, out: dict, errors: list) -> None:
    try:
        torch.manual_seed(100 + idx)  # different weights in each group
        model = torch.nn.Linear(6, 3)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        store = torch.distributed.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False
        )
        transport = NativeTransport(timedelta(seconds=30), hostname="127.0.0.1")
        manager = manager_mod.Manager(
            pg=pg_mod.ProcessGroupGloo(timeout=timedelta(seconds=20)),
            load_state_dict=lambda sd: model.load_state_dict(sd),
            state_dict=lambda: model.state_dict(),
            min_replica_size=2,
            timeout=timedelta(seconds=20),
            quorum_timeout=timedelta(seconds=30),
            connect_timeout=timedelta(seconds=20),
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=store.port,
            lighthouse_addr=lighthouse,
            replica_id=f"ckpt_{idx}",
            port=0,
            hostname="127.0.0.1",
            checkpoint_transport=transport,
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
        threads = [
            threading.Thread(target=_replica, args=(i, lh.address(), out, errors))
            for i in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "replicas hung"
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
