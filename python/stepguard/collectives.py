"""FP8-quantized collectives (torchft's ``allreduce_quantized`` and
``reduce_scatter_quantized``), which need CUDA and Triton.

stepguard has the names and signatures, so that code importing them loads,
but not the FP8 kernels: every call raises an error that says what is
missing.  Unlike torchft's module, this one imports without Triton.
``Manager.allreduce(should_quantize=True)`` does not come here: it logs
once and does a full-precision allreduce (as torchft does without Triton).
"""

from __future__ import annotations

import importlib.util
from typing import List, Optional, Union

import torch
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import (
    AllreduceOptions,
    ReduceScatterOptions,
    Work,
)

from stepguard.process_group import ProcessGroup

__all__ = ["allreduce_quantized", "reduce_scatter_quantized"]

_SUPPORTED_OPS = (ReduceOp.AVG, ReduceOp.SUM)


def _reduce_op(opts: Union[AllreduceOptions, ReduceScatterOptions, ReduceOp]) -> ReduceOp:
    if isinstance(opts, (AllreduceOptions, ReduceScatterOptions)):
        return opts.reduceOp
    return opts


def _unavailable(what: str, op: ReduceOp, tensors: List[torch.Tensor]) -> Exception:
    """The error for a quantized collective: the op first (as torchft),
    then what this machine lacks."""
    if op not in _SUPPORTED_OPS:
        return NotImplementedError(
            f"{what}: only ReduceOp.AVG and ReduceOp.SUM are supported, got {op}"
        )
    missing = []
    if not torch.cuda.is_available():
        missing.append("a CUDA device")
    if importlib.util.find_spec("triton") is None:
        missing.append("the triton package")
    if any(not t.is_cuda for t in tensors):
        missing.append("CUDA tensors")
    if missing:
        return RuntimeError(
            f"{what} needs CUDA and Triton (FP8 kernels); this process lacks "
            f"{', '.join(missing)}.  Use Manager.allreduce(should_quantize=True), "
            "which falls back to a full-precision allreduce, or a plain allreduce"
        )
    return NotImplementedError(
        f"{what}: stepguard does not ship the FP8 kernels yet; use "
        "Manager.allreduce(should_quantize=True), which does a full-precision "
        "allreduce"
    )


def allreduce_quantized(
    tensors: list[torch.Tensor],
    opts: AllreduceOptions | ReduceOp,
    process_group: "ProcessGroup",
    sync_stream: Optional[torch.Stream] = None,
) -> Work:
    """Allreduce in FP8: quantize, all-to-all, reduce, all-gather,
    dequantize into ``tensors`` in place (torchft's algorithm).

    Not available in stepguard yet.

    Raises:
        NotImplementedError: an op other than AVG or SUM, or (on a machine
            with CUDA and Triton) the missing kernels.
        RuntimeError: no CUDA device, no Triton, or CPU tensors.
    """
    raise _unavailable("allreduce_quantized", _reduce_op(opts), tensors)


def reduce_scatter_quantized(
    output: torch.Tensor,
    inputs: list[torch.Tensor],
    opts: ReduceScatterOptions | ReduceOp,
    process_group: "ProcessGroup",
    sync_stream: Optional[torch.Stream] = None,
) -> Work:
    """Reduce-scatter in FP8 (torchft's algorithm).  Not available in
    stepguard yet; raises as :func:`allreduce_quantized`."""
    raise _unavailable("reduce_scatter_quantized", _reduce_op(opts), [output, *inputs])
