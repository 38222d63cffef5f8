"""Sharded state over the wire (stepguard.hsdp): DTensors become their local
shards on the sender and are rebuilt on the receiver's own mesh; a shard
that does not fit is a clear error.  One process, a one-rank Gloo mesh."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from stepguard import hsdp


@pytest.fixture(scope="module")
def mesh():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_round_trip_rebuilds_dtensors(mesh):
    w = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    state = {"model": {"w": w, "n": 3}, "plain": torch.ones(2)}
    sent, shards = hsdp.local_shards(state)
    assert type(sent["model"]["w"]) is torch.Tensor
    assert sent["model"]["w"].data_ptr() == w.to_local().data_ptr()  # no copy
    assert list(shards) == ["['model']['w']"]
    received = {"model": {"w": sent["model"]["w"].clone() + 1, "n": 3}, "plain": torch.zeros(2)}
    out = hsdp.from_local_shards(received, shards, state)
    assert isinstance(out["model"]["w"], DTensor)
    assert out["model"]["w"].placements == w.placements
    torch.testing.assert_close(out["model"]["w"].full_tensor(), w.full_tensor() + 1)
    assert type(out["plain"]) is torch.Tensor


def test_plain_state_unchanged(mesh):
    state = {"a": torch.ones(3)}
    sent, shards = hsdp.local_shards(state)
    assert sent is state and shards == {}


def test_shard_without_counterpart_uses_a_like_layout(mesh):
    """Optimizer state a fresh replica has not created yet."""
    w = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
    _, shards = hsdp.local_shards({"exp_avg": w})
    out = hsdp.from_local_shards({"exp_avg": torch.ones(4, 3)}, shards, {"param": w})
    assert isinstance(out["exp_avg"], DTensor) and out["exp_avg"].shape == (4, 3)


def test_group_size_mismatch_is_a_clear_error(mesh):
    w = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
    # what a rank of a two-rank group sends
    theirs = {"['w']": ((4, 3), repr((Shard(0),)), (2,), (0,))}
    with pytest.raises(hsdp.ShardMismatch, match="group of 1 ranks cannot heal from one of 2"):
        hsdp.from_local_shards({"w": torch.zeros(2, 3)}, theirs, {"w": w})
    with pytest.raises(hsdp.ShardMismatch, match="sender a plain value"):
        hsdp.from_local_shards({"w": torch.zeros(4, 3)}, {}, {"w": w})


def test_replicate_needs_fsdp_modules(mesh):
    class M:
        _read_state_on_training_thread = None

    with pytest.raises(ValueError, match="no FSDP module"):
        hsdp.replicate(torch.nn.Linear(2, 2), M())  # type: ignore[arg-type]
