"""Quantized collectives with torchft's signatures (``allreduce_quantized``,
``reduce_scatter_quantized``) and its padding helpers
(``get_padded_sizes``, ``allocate_reduce_scatter_output``).

torchft quantizes to FP8 with Triton kernels on CUDA.  stepguard
quantizes in C on the host, inside :class:`ProcessGroupTCP`: each member
quantizes its tensors (int8 or float8 e4m3fn, one scale per block of 512
elements), sends each owner its part, the owner reduces in float32 and
quantizes the result once, and every member dequantizes the same bits
(``docs/quantization.md``).  About a quarter of the full-precision bytes
cross the network.

A group quantizes only when every member of its quorum advertised the
format (agreed when the group was configured,
:meth:`ProcessGroupTCP.quantized_format`).  Otherwise, and with any other
process group, these functions do the full-precision collective instead
and log one warning that says why.  CUDA tensors are staged through host
memory (a float32 copy each way).
"""

from __future__ import annotations

import logging
import math
import threading
from typing import List, Optional, Tuple, Union

import torch
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import (
    AllreduceOptions,
    ReduceScatterOptions,
    Work,
)

from stepguard.process_group import ProcessGroup, _FutureWork

__all__ = [
    "allreduce_quantized",
    "reduce_scatter_quantized",
    "get_padded_sizes",
    "allocate_reduce_scatter_output",
    "quantized_format",
]

logger = logging.getLogger(__name__)

_SUPPORTED_OPS = (ReduceOp.AVG, ReduceOp.SUM)


def _reduce_op(opts: Union[AllreduceOptions, ReduceScatterOptions, ReduceOp]) -> ReduceOp:
    if isinstance(opts, (AllreduceOptions, ReduceScatterOptions)):
        return opts.reduceOp
    return opts


def _check_op(what: str, op: ReduceOp) -> None:
    if op not in _SUPPORTED_OPS:
        raise NotImplementedError(
            f"ReduceOp {op} is not supported for {what}, only AVG and SUM are supported"
        )


def quantized_format(process_group: object) -> Tuple[Optional[str], str]:
    """The format a quantized collective over ``process_group`` uses
    (``"fp8"`` or ``"int8"``), or None and why it cannot quantize."""
    from stepguard.process_group_tcp import ProcessGroupTCP

    if not isinstance(process_group, ProcessGroupTCP):
        return None, (
            f"{type(process_group).__name__} has no quantized collectives "
            "(ProcessGroupTCP has)"
        )
    return process_group.quantized_format()


_warned_lock = threading.Lock()
_warned: set = set()


def warn_full_precision(why: str, log: Optional[logging.Logger] = None) -> None:
    """Logs once per reason that a quantized collective runs in full
    precision."""
    with _warned_lock:
        if why in _warned:
            return
        _warned.add(why)
    (log or logger).warning(f"quantized collective not possible, using full precision: {why}")


def get_padded_sizes(
    tensors: list[torch.Tensor],
    world_size: int,
) -> list[torch.Size]:
    """Each tensor's size with its first dimension rounded up to a multiple
    of ``world_size`` (a 1-D tensor of n elements counts as n rows of one
    column: ``(ceil(n / W) * W, 1)``)."""
    sizes = []
    for t in tensors:
        shape = tuple(t.size())
        if len(shape) == 1:
            shape = (shape[0], 1)
        rows = math.ceil(shape[0] / world_size) * world_size
        sizes.append(torch.Size((rows, *shape[1:])))
    return sizes


def allocate_reduce_scatter_output(
    tensors: list[torch.Tensor],
    world_size: int,
) -> tuple[torch.Tensor, list[torch.Size]]:
    """A flat output for :func:`reduce_scatter_quantized` of ``tensors``
    (one member's share of every padded tensor, one after the other) and
    the padded sizes.

    Raises:
        AssertionError: tensors on different devices or of different dtypes.
    """
    device, dtype = tensors[0].device, tensors[0].dtype
    for prev, t in zip(tensors, tensors[1:]):
        assert t.device == prev.device, "All inputs must be on the same device"
        assert t.dtype == prev.dtype, "All inputs must be on the same dtype"
    padded = get_padded_sizes(tensors, world_size)
    total = sum(s.numel() // world_size for s in padded)
    return torch.empty((total,), device=device, dtype=dtype), padded


def _average_after(work: Work, tensors: List[torch.Tensor], n: int) -> Work:
    """``work`` (a SUM) followed by a division by n of every tensor."""

    def divide(fut: torch.futures.Future) -> object:
        fut.value()
        for t in tensors:
            t.div_(n)
        return tensors

    return _FutureWork(work, work.get_future().then(divide))


def allreduce_quantized(
    tensors: list[torch.Tensor],
    opts: AllreduceOptions | ReduceOp,
    process_group: "ProcessGroup",
    sync_stream: Optional[torch.Stream] = None,
) -> Work:
    """Quantized allreduce of ``tensors`` in place (SUM or AVG): every
    member ends with the same bits, each element quantized at most twice.

    Args:
        tensors: the tensors, reduced in place (any float dtype or device;
            other than float32 on the CPU they are staged).
        opts: AllreduceOptions or a ReduceOp (AVG or SUM).
        process_group: a configured ProcessGroupTCP quantizes; another
            group, or members that did not all advertise the format, run a
            full-precision allreduce (one warning says why).
        sync_stream: accepted for torchft's signature; unused (the work
            runs on the host).

    Returns:
        The work; ``wait()`` raises the collective's error (a NaN or an
        infinity on any member fails it on every member, naming the rank).

    Raises:
        NotImplementedError: an op other than AVG or SUM.
    """
    op = _reduce_op(opts)
    _check_op("quantized allreduce", op)
    fmt, why = quantized_format(process_group)
    if fmt is not None:
        return process_group.allreduce_quantized(tensors, op, fmt)  # type: ignore[attr-defined]
    warn_full_precision(why)
    o = AllreduceOptions()
    o.reduceOp = ReduceOp.SUM
    work = process_group.allreduce(tensors, o)
    if op == ReduceOp.AVG:
        return _average_after(work, tensors, process_group.size())
    return work


def reduce_scatter_quantized(
    output: torch.Tensor,
    inputs: list[torch.Tensor],
    opts: ReduceScatterOptions | ReduceOp,
    process_group: "ProcessGroup",
    sync_stream: Optional[torch.Stream] = None,
) -> Work:
    """Quantized reduce-scatter (SUM or AVG) in torchft's layout: every
    input is padded to a multiple of the world size in rows
    (:func:`get_padded_sizes`); member r's ``output``
    (:func:`allocate_reduce_scatter_output`) gets its share of each.

    Falls back to full precision as :func:`allreduce_quantized` does.

    Raises:
        NotImplementedError: an op other than AVG or SUM.
        ValueError: an output of the wrong size.
    """
    op = _reduce_op(opts)
    _check_op("quantized reduce-scatter", op)
    fmt, why = quantized_format(process_group)
    if fmt is not None:
        return process_group.reduce_scatter_quantized(output, inputs, op, fmt)  # type: ignore[attr-defined]
    warn_full_precision(why)
    w = process_group.size()
    padded = get_padded_sizes(inputs, w)
    parts: List[List[torch.Tensor]] = [[] for _ in range(w)]
    for t, size in zip(inputs, padded):
        rows = t.detach().reshape(t.shape[0] if t.dim() else 1, -1)
        full = torch.zeros((size[0], rows.shape[1]), dtype=output.dtype, device=output.device)
        full[: rows.shape[0]].copy_(rows)
        for r, chunk in enumerate(full.chunk(w)):
            parts[r].append(chunk.reshape(-1))
    flat = torch.cat([torch.cat(p) for p in parts])
    if flat.numel() != output.numel() * w:
        raise ValueError(
            f"reduce_scatter_quantized: output has {output.numel()} elements, "
            f"the padded inputs give {flat.numel() // max(w, 1)} per member"
        )
    o = ReduceScatterOptions()
    o.reduceOp = ReduceOp.SUM
    work = process_group.reduce_scatter_tensor_coalesced([output], [flat], o)
    if op == ReduceOp.AVG:
        return _average_after(work, [output], w)
    return work
