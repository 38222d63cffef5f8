"""NativeTransport and DTensor leaves (FSDP2 shards, e.g. torchtitan's state).

A DTensor is served as its local shard, zero-copy like any tensor, with its
spec in the header; a healer whose own state has a DTensor at that place
gets the shard fetched into that DTensor's local tensor, and the DTensor
back on the healer's own device mesh.  A pickled DTensor would carry the
sender's mesh, whose process-group names mean nothing in the healer's
process (torchtitan names its default group after the group's global ranks,
so they differ between replica groups): a later collective on such a
tensor fails ("Could not resolve the process group registered under the
name ...").  One process, a Gloo world of 1: two meshes stand for the two
replicas' own.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from stepguard.checkpointing.native_transport import NativeTransport

T60 = timedelta(seconds=60)


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def pair():
    a = NativeTransport(T60, hostname="127.0.0.1", auth_token="tok")
    b = NativeTransport(T60, hostname="127.0.0.1", auth_token="tok", in_place=True)
    try:
        yield a, b
    finally:
        a.shutdown()
        b.shutdown()


def _mesh() -> DeviceMesh:
    """A mesh over a process group of its own (a name of its own)."""
    return DeviceMesh.from_group(dist.new_group([0]), "cpu")


def _state(mesh: DeviceMesh, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": distribute_tensor(torch.randn(8, 4, generator=g), mesh, [Shard(0)]),
                  "b": distribute_tensor(torch.randn(4, generator=g), mesh, [Replicate()])},
        "optim": {"w.exp_avg": distribute_tensor(torch.randn(8, 4, generator=g), mesh, [Shard(0)]),
                  "step": torch.tensor(3.0)},
    }


def test_dtensor_heals_into_the_healers_own_mesh_and_memory(world, pair) -> None:
    a, b = pair
    mesh_a = _mesh()
    mesh_b = _mesh()  # the healer's own: another process group
    assert mesh_a.get_group().group_name != mesh_b.get_group().group_name
    src, mine = _state(mesh_a, 1), _state(mesh_b, 2)
    a.send_checkpoint([1], 5, src, T60)
    got = b.recv_checkpoint(0, a.metadata(), 5, T60, into=mine)
    for part, key in (("model", "w"), ("model", "b"), ("optim", "w.exp_avg")):
        t = got[part][key]
        assert t is mine[part][key], (part, key)  # fetched in place, the same object
        assert t.device_mesh is mesh_b
        assert t.placements == src[part][key].placements
        assert torch.equal(t.to_local(), src[part][key].to_local())
    assert torch.equal(got["optim"]["step"], src["optim"]["step"])
    a.disallow_checkpoint()


def test_dtensor_without_a_counterpart_keeps_the_senders_spec(world, pair) -> None:
    a, b = pair
    mesh_a = _mesh()
    src = _state(mesh_a, 1)
    a.send_checkpoint([1], 6, src, T60)
    got = b.recv_checkpoint(0, a.metadata(), 6, T60)
    t = got["model"]["w"]
    assert isinstance(t, DTensor) and t.placements == (Shard(0),)
    assert tuple(t.shape) == (8, 4)
    assert torch.equal(t.to_local(), src["model"]["w"].to_local())
    # fresh memory, not the source's
    assert t.to_local().data_ptr() != src["model"]["w"].to_local().data_ptr()
    a.disallow_checkpoint()


def test_dtensor_of_another_sharding_is_a_clear_error(world, pair) -> None:
    a, b = pair
    mesh_a, mesh_b = _mesh(), _mesh()
    src = _state(mesh_a, 1)
    mine = _state(mesh_b, 2)
    mine["model"]["w"] = distribute_tensor(torch.zeros(16, 2), mesh_b, [Shard(0)])
    a.send_checkpoint([1], 7, src, T60)
    with pytest.raises(RuntimeError, match="same number of ranks and sharding"):
        b.recv_checkpoint(0, a.metadata(), 7, T60, into=mine)
    a.disallow_checkpoint()
