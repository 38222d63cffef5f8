"""Fault-tolerant HSDP: FSDP2 inside a replica group, the Manager across.

Each replica group shards its model with ``fully_shard`` over the ranks of
the group (a device mesh of the group alone); the replicate dimension is
the Manager: after FSDP's reduce-scatter, every FSDP module's all-reduce
hook averages its gradient shard over the participating replica groups with
``Manager.allreduce`` (a failure fails the step, never the process).  Group
rank ``r`` of every replica group holds the same shard, so it reduces with
group rank ``r`` of the others, and a recovering group's rank ``r`` heals
its shard from rank ``r`` of an up-to-date group (the Manager sends the
local shards of DTensors and rebuilds them on the receiving side).

torchft's pattern works as written::

    mesh = init_device_mesh("cpu", (group_world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    replicate = ManagedProcessGroup(manager).register("dp_replicate")
    def hook(grad): dist.all_reduce(grad, group=replicate, op=ReduceOp.AVG)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(hook)

and :func:`replicate` does the same wiring in one call.

Sharded state is read only at safe points: a state holding DTensors makes
the Manager read it on the training thread (inside ``start_quorum`` or
``should_commit``), never while the training thread may be in the middle
of a forward or backward pass (see ``Manager``, "When state is read").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten, tree_structure

if TYPE_CHECKING:
    from stepguard.manager import Manager
    from stepguard.process_group import ProcessGroup

__all__ = ["replicate", "local_shards", "from_local_shards", "ShardMismatch"]

# the key under which the Manager sends the description of the DTensors it
# replaced by their local shards
SHARDS_KEY = "stepguard.shards"


class ShardMismatch(RuntimeError):
    """The received sharded state does not fit this replica group's
    sharding (a group of another size, or another model)."""


def replicate(
    model: torch.nn.Module,
    manager: "Manager",
    name: str = "dp_replicate",
    register: bool = True,
) -> Optional["ProcessGroup"]:
    """Makes every FSDP module of ``model`` average its gradient shards over
    the replica groups through ``manager``.

    Call after ``fully_shard`` (on the group's ranks only).  Each hook runs
    ``manager.allreduce(shard).wait()``: an AVG over the participating
    replicas (a healing replica contributes zeros), a failed collective
    fails the step (the Manager's vote), never the process.

    Args:
        model: the sharded model (its FSDP modules get the hook).
        manager: this rank's Manager.
        name: the name of the replicate dimension's process group.
        register: also register a :class:`ManagedProcessGroup` under
            ``name`` (needs an initialized default process group) and
            return it, for functional collectives across replicas (e.g. a
            loss reduced with ``funcol.all_reduce(loss, "avg", group)``).

    Returns:
        The registered group, or None with ``register=False``.

    Raises:
        ValueError: ``model`` holds no FSDP module.
    """
    from torch.distributed.fsdp import FSDPModule

    def all_reduce_hook(grad: torch.Tensor) -> None:
        manager.allreduce(grad).wait()

    # sharded state: read only on the training thread (whatever the
    # registered state turns out to hold)
    manager._read_state_on_training_thread = True
    hooked = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(all_reduce_hook)
            hooked += 1
    if not hooked:
        raise ValueError("replicate: the model has no FSDP module (call fully_shard first)")
    if not register:
        return None
    from stepguard.process_group import ManagedProcessGroup

    return ManagedProcessGroup(manager).register(name)


# -- sharded state over the wire ---------------------------------------------

_Spec = Tuple[Tuple[int, ...], str, Tuple[int, ...], Tuple[int, ...]]


def _spec(t: DTensor) -> _Spec:
    """What must match for a local shard to fit: the global shape, the
    placements, the mesh's shape and this rank's coordinate in it."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    return (
        tuple(t.shape),
        repr(tuple(t.placements)),
        tuple(mesh.shape),
        tuple(coord) if coord is not None else (),
    )


def local_shards(tree: object) -> Tuple[object, Dict[str, _Spec]]:
    """``tree`` with every DTensor replaced by its local shard (no copy),
    and a description of each, by key path: what a transport can send
    as plain tensors and :func:`from_local_shards` rebuilds."""
    leaves, spec = tree_flatten_with_path(tree)
    out: List[object] = []
    shards: Dict[str, _Spec] = {}
    for path, leaf in leaves:
        if isinstance(leaf, DTensor):
            shards[keystr(path)] = _spec(leaf)
            out.append(leaf.to_local())
        else:
            out.append(leaf)
    if not shards:
        return tree, shards
    return tree_unflatten(out, tree_structure(tree)), shards


def from_local_shards(received: object, shards: Dict[str, _Spec], own: object) -> object:
    """``received`` (local shards, as :func:`local_shards` made them on the
    sender) with every shard rebuilt as a DTensor on this rank's mesh,
    taken from ``own``, this rank's state of the same structure.

    Raises:
        ShardMismatch: a shard that does not fit (another group size,
            another placement or shape), or a DTensor here where the sender
            had a plain tensor.
    """
    own_leaves, _ = tree_flatten_with_path(own)
    mine = {keystr(path): leaf for path, leaf in own_leaves if isinstance(leaf, DTensor)}
    # a shard with no counterpart here (optimizer state, created at the
    # first step, which this replica has not taken) goes on the mesh of a
    # DTensor here with the same placements and mesh shape
    layouts = {_spec(t)[1:]: t for t in mine.values()}
    leaves, _ = tree_flatten_with_path(received)
    out: List[object] = []
    for path, leaf in leaves:
        key = keystr(path)
        local = mine.get(key)
        theirs = shards.get(key)
        if local is None and theirs is not None:
            like = layouts.get(theirs[1:])
            if like is None:
                meshes = {_ranks(_spec(t)[2]) for t in mine.values()} or {1}
                raise ShardMismatch(
                    f"{key}: a shard of a DTensor on a mesh of {_ranks(theirs[2])} ranks, "
                    f"and no DTensor here laid out so (this replica's meshes: "
                    f"{sorted(meshes)} ranks; the groups must have the same size)"
                )
            assert isinstance(leaf, torch.Tensor), f"{key}: a shard that is not a tensor"
            out.append(
                DTensor.from_local(
                    leaf,
                    like.device_mesh,
                    like.placements,
                    run_check=False,
                    shape=torch.Size(theirs[0]),
                    stride=_contiguous_stride(theirs[0]),
                )
            )
            continue
        if local is None:
            out.append(leaf)
            continue
        if theirs is None:
            raise ShardMismatch(f"{key}: this replica holds a DTensor, the sender a plain value")
        want = _spec(local)
        if theirs[2] != want[2]:
            raise ShardMismatch(
                f"{key}: a replica group of {_ranks(want[2])} ranks cannot heal from one of "
                f"{_ranks(theirs[2])} ranks (sharded state: the groups must have the same size)"
            )
        if theirs != want:
            raise ShardMismatch(f"{key}: sender's shard {theirs} does not fit this one's {want}")
        assert isinstance(leaf, torch.Tensor), f"{key}: a shard that is not a tensor"
        out.append(
            DTensor.from_local(
                leaf,
                local.device_mesh,
                local.placements,
                run_check=False,
                shape=local.shape,
                stride=local.stride(),
            )
        )
    return tree_unflatten(out, tree_structure(received))


def _ranks(mesh_shape: Tuple[int, ...]) -> int:
    n = 1
    for d in mesh_shape:
        n *= d
    return n


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride: List[int] = []
    acc = 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))
