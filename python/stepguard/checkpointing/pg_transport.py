"""Sending a state dict over the replicas' own process group.

The sender pickles a description of the state dict (its pytree spec, each
tensor's shape, dtype, strides and storage size, the non-tensor leaves) and
sends, to each healing replica: the description's length (tag 1), the
description (tag 2), then every tensor's whole storage as bytes (tags 3...).
Sending whole storages keeps views and strides exact.  The receiver
receives each storage in place into the tensor its ``state_dict()`` callable
already has at the same key path (same device type and size), so healing
needs no second copy of the model; otherwise it allocates one.

Same constructor, behaviour and bytes on the wire as torchft's
``PGTransport``: the description pickles under torchft's class paths
(``torchft.checkpointing.pg_transport._StateDictMeta`` and its parts) and
those paths unpickle to this module's classes, so stepguard and torchft
replicas heal each other over it, with or without torchft installed.
"""

from __future__ import annotations

import io
import logging
import pickle
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Generator, List, Optional, Tuple, TypeVar, Union, cast

import torch
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import Work
from torch.utils._pytree import (
    KeyPath,
    TreeSpec,
    tree_flatten_with_path,
    tree_unflatten,
)

from stepguard.checkpointing.transport import CheckpointTransport

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment, misc]

__all__ = ["PGTransport"]

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")

_MAX_META_BYTES = 1 << 31


@contextmanager
def _timeit(name: str) -> Generator[None, None, None]:
    start = time.perf_counter()
    yield
    logger.info("%s took %.3fs", name, time.perf_counter() - start)


@dataclass
class _TensorMeta:
    """How to rebuild a tensor from its storage bytes."""

    shape: torch.Size
    dtype: torch.dtype
    storage_offset: int
    stride: Tuple[int, ...]
    nbytes: int


@dataclass
class _DTensorMeta:
    """A DTensor: its local tensor and its sharding spec."""

    local: _TensorMeta
    spec: object


@dataclass
class _StateDictMeta:
    """Everything but the tensor bytes."""

    step: int
    treespec: TreeSpec
    paths: List[KeyPath]
    non_tensor_leaves: List[Union[object, _TensorMeta, _DTensorMeta]]


# the module torchft's replicas pickle these classes under, and expect back
_WIRE_MODULE = "torchft.checkpointing.pg_transport"
_WIRE_CLASSES = {"_TensorMeta", "_DTensorMeta", "_StateDictMeta"}


class _WirePickler(pickle._Pickler):  # type: ignore[misc, name-defined]
    """Writes this module's classes under torchft's module path.

    The C pickler cannot rename a class reference (it checks that the name
    imports back to the same object); the Python one lets save_global do
    it.  The description is small (one entry per tensor), so its speed
    does not matter.
    """

    def save_global(self, obj: object, name: Optional[str] = None) -> None:
        qualname = getattr(obj, "__qualname__", None)
        if getattr(obj, "__module__", None) == __name__ and qualname in _WIRE_CLASSES:
            self.save(_WIRE_MODULE)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


class _WireUnpickler(pickle.Unpickler):
    """Reads torchft's class paths as this module's classes."""

    def find_class(self, module: str, name: str) -> object:
        if module in (_WIRE_MODULE, __name__) and name in _WIRE_CLASSES:
            return globals()[name]
        return super().find_class(module, name)


def _dumps(meta: "_StateDictMeta") -> bytes:
    out = io.BytesIO()
    _WirePickler(out, protocol=4).dump(meta)
    return out.getvalue()


def _loads(blob: bytes) -> "_StateDictMeta":
    # Unpickling a pytree TreeSpec goes through torch's deprecated LeafSpec
    # constructor, which warns at every heal; the warning is torch's, not
    # the caller's to act on.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`",
                                category=FutureWarning)
        return cast(_StateDictMeta, _WireUnpickler(io.BytesIO(blob)).load())


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _prepare_tensor(t: torch.Tensor) -> Tuple[torch.Tensor, _TensorMeta]:
    return _storage_bytes(t), _TensorMeta(
        shape=t.shape,
        dtype=t.dtype,
        storage_offset=t.storage_offset(),
        stride=tuple(t.stride()),
        nbytes=t.untyped_storage().nbytes(),
    )


def _prepare_state_dict(
    state_dict: object, step: int, device: torch.device
) -> Tuple[_StateDictMeta, List[torch.Tensor]]:
    leaves, spec = tree_flatten_with_path(state_dict)
    paths: List[KeyPath] = []
    described: List[object] = []
    buffers: List[torch.Tensor] = []
    for path, v in leaves:
        paths.append(path)
        if DTensor is not None and isinstance(v, DTensor):
            buf, meta = _prepare_tensor(v._local_tensor)
            buffers.append(buf)
            described.append(_DTensorMeta(local=meta, spec=v._spec))
        elif isinstance(v, torch.Tensor):
            buf, meta = _prepare_tensor(v)
            buffers.append(buf)
            described.append(meta)
        else:
            described.append(v)
    return _StateDictMeta(step, spec, paths, described), buffers


def _cast_tensor(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterprets a uint8 storage as ``dtype`` (no copy)."""
    storage = buf.untyped_storage()
    out = torch.empty(0, dtype=dtype, device=buf.device)
    out.set_(storage, 0, (storage.nbytes() // out.element_size(),), (1,))
    return out


class PGTransport(CheckpointTransport[T]):
    """Checkpoint transport over a process group whose ranks are the
    replica ranks of the Manager's quorum.

    Args:
        pg: the process group (usually the Manager's).
        timeout: the default for each wait of a send or receive; a
            ``timeout`` passed to ``send_checkpoint`` or ``recv_checkpoint``
            takes precedence.
        device: the device tensors travel on (e.g. ``cuda`` for NCCL), a
            :class:`torch.device` or its name.
        state_dict: returns this replica's current state dict; tensors in
            it are received in place.
    """

    def __init__(
        self,
        pg: ProcessGroup,
        timeout: timedelta,
        device: Union[torch.device, str],
        state_dict: Optional[Callable[[], object]] = None,
    ) -> None:
        self._pg = pg
        self._timeout = timeout
        self._device = torch.device(device)
        self._state_dict = state_dict

    def metadata(self) -> str:
        return "<n/a>"

    def disallow_checkpoint(self) -> None:
        pass

    def send_checkpoint(
        self,
        dst_ranks: List[int],
        step: int,
        state_dict: T,
        timeout: Optional[timedelta] = None,
    ) -> None:
        timeout = self._timeout if timeout is None else timeout
        with _timeit("preparing state_dict"):
            meta, buffers = _prepare_state_dict(state_dict, step, self._device)
        blob = _dumps(meta)
        meta_t = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self._device)
        len_t = torch.tensor([len(blob)], dtype=torch.int64, device=self._device)
        works: List[Work] = []
        with _timeit("sending state_dict"):
            for dst in dst_ranks:
                works.append(self._pg.send([len_t], dst, 1))
                works.append(self._pg.send([meta_t], dst, 2))
                for i, buf in enumerate(buffers):
                    on_cpu = buf.device.type == "cpu"
                    works.append(self._pg.send([buf.to(self._device)], dst, 3 + i))
                    if on_cpu and self._device.type != "cpu":
                        # The device copy is freed once it is sent.
                        for w in works:
                            w.wait(timeout)
                        works.clear()
            for w in works:
                w.wait(timeout)

    def recv_checkpoint(
        self,
        src_rank: int,
        metadata: str,
        step: int,
        timeout: Optional[timedelta] = None,
    ) -> T:
        timeout = self._timeout if timeout is None else timeout
        len_t = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._pg.recv([len_t], src_rank, 1).wait(timeout)
        n = int(len_t.item())
        if n <= 0 or n > _MAX_META_BYTES:
            raise RuntimeError(f"bad checkpoint description length {n} from {src_rank}")
        meta_t = torch.empty(n, dtype=torch.uint8, device=self._device)
        self._pg.recv([meta_t], src_rank, 2).wait(timeout)
        meta = _loads(meta_t.cpu().numpy().tobytes())
        if meta.step != step:
            raise RuntimeError(f"expected step {step}, got a checkpoint of step {meta.step}")

        mine: dict = {}
        if self._state_dict is not None:
            for path, v in tree_flatten_with_path(self._state_dict())[0]:
                if DTensor is not None and isinstance(v, DTensor):
                    v = v._local_tensor
                if isinstance(v, torch.Tensor):
                    mine[path] = v

        values: List[object] = []
        works: List[Work] = []
        # (index in values, received bytes, description): filled in once
        # the bytes are here
        pending: List[Tuple[int, torch.Tensor, object]] = []
        tag = 3
        for path, described in zip(meta.paths, meta.non_tensor_leaves):
            tmeta = described.local if isinstance(described, _DTensorMeta) else described
            if not isinstance(tmeta, _TensorMeta):
                values.append(described)
                continue
            own = mine.get(path)
            if (
                own is not None
                and own.device.type == self._device.type
                and own.untyped_storage().nbytes() == tmeta.nbytes
            ):
                buf = _storage_bytes(own)
                in_place = True
            else:
                buf = torch.empty(tmeta.nbytes, dtype=torch.uint8, device=self._device)
                in_place = False
            works.append(self._pg.recv([buf], src_rank, tag))
            tag += 1
            pending.append((len(values), buf, described))
            values.append(in_place)
        for w in works:
            w.wait(timeout)
        for index, buf, described in pending:
            if not values[index]:
                # as torchft: a tensor with no place to land comes back on
                # the CPU (the transport's device is only the wire's)
                buf = buf.cpu()
            tmeta = cast(
                _TensorMeta, described.local if isinstance(described, _DTensorMeta) else described
            )
            t = torch.as_strided(
                _cast_tensor(buf, tmeta.dtype),
                tmeta.shape,
                tmeta.stride,
                tmeta.storage_offset,
            )
            if isinstance(described, _DTensorMeta):
                assert DTensor is not None
                t = DTensor(t, described.spec, requires_grad=False)  # type: ignore[call-arg]
            values[index] = t
        return cast(T, tree_unflatten(values, meta.treespec))
