"""The runtime shim that lets torchtitan 0.3.0 train on a CPU-only machine.

Test harness only (tests and examples import it; the stepguard package does
not).  torchtitan 0.3.0 assumes an accelerator in a few places that its
configuration cannot reach; :func:`install` patches exactly those, before
torchtitan is imported, and nothing else.  docs/torchtitan.md lists each
patch and why; every CPU setting torchtitan has an option for is set
through that option instead (``titan_config.py``).
"""

from __future__ import annotations

import sys
import types

_installed = False


def _absent_kernels() -> types.ModuleType:
    """Stands in for ``torchtitan.distributed.minimal_async_ep.kernels``.

    That module defines Triton kernels for expert-parallel all-to-all and
    imports ``triton`` at import time, though torchtitan does not declare
    triton (a CUDA-only package here); every model imports it through
    ``models.common.moe``.  The dense llama3 never calls these kernels: any
    call says why it cannot run.
    """
    mod = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")

    def __getattr__(name: str):  # noqa: N807 - module-level __getattr__
        if name.startswith("__"):
            raise AttributeError(name)

        def absent(*args, **kwargs):
            raise RuntimeError(f"{name}: a Triton kernel; triton is not installed (CPU run)")

        absent.__name__ = name
        return absent

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    return mod


def _cpu_device() -> None:
    """torchtitan's device is "cpu", not "cuda".

    ``torchtitan.tools.utils`` picks ``_get_available_device_type() or
    "cuda"``, and torch names no accelerator on a CPU-only build, so the
    device falls back to "cuda" and the first ``set_device`` fails.  Its
    module-level ``device_type`` and ``device_module`` are set to "cpu" and
    ``torch.cpu`` right after it loads, before any other torchtitan module
    copies them with ``from torchtitan.tools.utils import device_type``.
    """
    import torch
    from torchtitan.tools import utils

    if torch.accelerator.is_available():
        return
    utils.device_type, utils.device_module = "cpu", torch.cpu


def _cpu_memory_monitor() -> None:
    """A memory monitor for the CPU in ``torchtitan.components.metrics``.

    ``DeviceMemoryMonitor`` asks the device module for
    ``get_device_name``, ``get_device_properties``,
    ``reset_peak_memory_stats``, ``empty_cache`` and ``memory_stats``;
    ``torch.cpu`` has none of them.  The stand-in reports this process's
    peak resident set size (``getrusage``) against the machine's memory,
    in the fields torchtitan logs.
    """
    import os
    import resource

    from torchtitan.components import metrics

    class CPUMemoryMonitor:
        def __init__(self, device: str = "cpu") -> None:
            self.device = device
            self.device_name = "cpu"
            self.device_index = 0
            self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            self.device_capacity_gib = self.device_capacity / 2**30

        def get_peak_stats(self):
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            gib, pct = peak / 2**30, 100 * peak / self.device_capacity
            return metrics.DeviceMemStats(gib, pct, gib, pct, 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    metrics.DeviceMemoryMonitor = CPUMemoryMonitor


def _cpu_pg_timeouts() -> None:
    """``set_pg_timeouts`` without ``device_ids`` and ``dist.set_timeout``.

    After the first step torchtitan's trainer calls
    ``torchtitan.distributed.utils.set_pg_timeouts``, which runs
    ``barrier(device_ids=[device_module.current_device()])`` (device ids
    are for NCCL; ``torch.cpu.current_device()`` is the string "cpu") and
    then ``torch.distributed.set_timeout(timeout, group)``, a function torch
    2.13 does not have.  The stand-in does the same on CPU: a plain barrier,
    then each process group's own ``ProcessGroup.set_timeout``.
    """
    import torch.distributed as dist
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools.logging import logger

    def set_pg_timeouts(timeout, parallel_dims) -> None:
        logger.info(f"Synchronizing and adjusting timeout for all ProcessGroups to {timeout}")
        dist.barrier()
        groups = [
            mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()
        ] + [dist.distributed_c10d._get_default_group()]
        for group in groups:
            group.set_timeout(timeout)

    dist_utils.set_pg_timeouts = set_pg_timeouts


def _cpu_flex_attention() -> None:
    """FlexAttention by its definition (masked softmax) on CPU.

    Every torchtitan language model uses ``FlexAttention`` with a
    block-causal ``BlockMask`` (``sdpa`` is refused for language models,
    ``varlen`` is CUDA-only), and torch's ``flex_attention`` raises
    "FlexAttention does not support backward on CPU" when its inputs need
    gradients.  ``FlexAttention._compiled_flex_attn`` (the one function its
    forward calls) becomes the computation ``flex_attention`` defines: the
    mask, evaluated element-wise from the ``BlockMask``'s ``mask_mod``,
    applied to ``q @ k^T * scale``, softmax, times ``v``, with the
    log-sum-exp when asked; autograd differentiates it on CPU.  The
    sequences here are short (tens of tokens), so the dense mask is small.
    """
    import math

    import torch
    from torch.nn.attention.flex_attention import AuxOutput, create_mask
    from torchtitan.models.common.attention import FlexAttention

    def flex_attention_cpu(q, k, v, *, score_mod=None, block_mask=None, scale=None,
                           enable_gqa=False, return_aux=None, kernel_options=None):
        if score_mod is not None:
            raise NotImplementedError("score_mod on the CPU stand-in for flex_attention")
        b, n, lq, h = q.shape
        if enable_gqa and k.shape[1] != n:
            rep = n // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        scale = 1.0 / math.sqrt(h) if scale is None else scale
        scores = (q @ k.transpose(-2, -1)) * scale
        if block_mask is not None:
            mb, mh = block_mask.shape[0], block_mask.shape[1]
            mask = create_mask(block_mask.mask_mod, mb, mh, lq, k.shape[2], device=q.device)
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.softmax(scores, dim=-1) @ v
        want_lse = return_aux is not None and return_aux.lse
        return out, AuxOutput(lse=lse if want_lse else None)

    FlexAttention._compiled_flex_attn = staticmethod(flex_attention_cpu)


def _gloo_sum_reduction() -> None:
    """FSDP's reduce-scatter with SUM instead of ``PREMUL_SUM(1.0)``.

    torchtitan divides gradients itself (by the global token count) and
    turns FSDP's division off with ``set_gradient_divide_factor(1.0)``
    (``torchtitan.distributed.fsdp.disable_fsdp_gradient_division``); FSDP
    then reduce-scatters with ``ReduceOp.PREMUL_SUM(1.0)``, which Gloo
    refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo") once a replica
    group has 2 ranks.  The stand-in also sets
    ``set_force_sum_reduction_for_comms(True)``, so FSDP reduces with SUM
    and divides by 1, i.e. not at all: the same numbers.  (torchtitan's own
    switch for that, ``--parallelism.enable_fsdp_symm_mem``, insists on a
    CUDA device.)
    """
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import fsdp

    def disable_fsdp_gradient_division(model) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division


def install() -> None:
    """Applies every patch (idempotent).  Call before importing torchtitan."""
    global _installed
    if _installed:
        return
    _installed = True
    if "torchtitan.tools.utils" in sys.modules:
        raise RuntimeError("titan_shim.install() must run before torchtitan is imported")
    _cpu_device()
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.modules["torchtitan.distributed.minimal_async_ep.kernels"] = _absent_kernels()
    import torch

    if not torch.accelerator.is_available():
        _cpu_memory_monitor()
        _cpu_pg_timeouts()
        _cpu_flex_attention()
        _gloo_sum_reduction()
