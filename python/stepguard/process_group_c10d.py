"""The c10d backends of :mod:`stepguard.process_group`: Gloo, NCCL and XCCL
groups rebuilt at every configuration (:class:`ProcessGroupWrapper`'s
``_create_pg``), and the deadline that aborts an NCCL or XCCL group whose
operation overruns it.

Import these names from :mod:`stepguard.process_group` (torchft's module
path), which loads this module on first use.  ``context_timeout``,
``stream_timeout`` and ``trigger_nccl_fr_trace_through_pipe`` are looked up
on that module at each call, where torchft's tests patch them.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Generator, List, Optional, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup as BaseProcessGroup, Store
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    ReduceScatterOptions,
    Work,
)
from torch.futures import Future

from stepguard import config
from stepguard import process_group as _pg
from stepguard.process_group import ProcessGroup, ProcessGroupWrapper

__all__ = ["ProcessGroupGloo", "ProcessGroupNCCL", "ProcessGroupXCCL"]

logger: logging.Logger = logging.getLogger("stepguard.process_group")

T = TypeVar("T")


def _group_name(quorum_id: Optional[int], group_rank: Optional[int],
                group_world_size: Optional[int]) -> Optional[str]:
    # torchft names the group only when group_rank is truthy, so group rank
    # 0 never gets a name; every group rank gets one here.
    if group_rank is None or not group_world_size:
        return None
    return f"torchft_quorum_{quorum_id}_rank_{group_rank % group_world_size}"


class ProcessGroupGloo(ProcessGroupWrapper):
    """A reconfigurable Gloo process group (CPU tensors; CUDA through
    Gloo's staging).  Gloo has no reduce-scatter."""

    #: torch 2.13's Gloo abort does not end an operation in flight (it
    #: returns when the peer goes), and tearing the group down under one has
    #: corrupted the heap: the Manager's lost-member watcher leaves it alone
    #: (the step fails at the operation's own deadline)
    abort_ends_operations = False

    def _create_pg(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        from torch.distributed import ProcessGroupGloo as BaseProcessGroupGloo

        pg = BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(BaseProcessGroup.BackendType.GLOO)
        setup = max(self._timeout, self._setup_timeout or self._timeout)
        backend = BaseProcessGroupGloo(store, rank, world_size, setup)
        if setup != self._timeout:
            backend._set_default_timeout(self._timeout)
        backend._set_sequence_number_for_group()
        if self._global_ranks:
            backend.options.global_ranks_in_group = self._global_ranks
        name = _group_name(self._quorum_id, self._group_rank, self._group_world_size)
        if name is not None:
            backend.options.group_name = name
        pg._register_backend(torch.device("cpu"), BaseProcessGroup.BackendType.GLOO, backend)
        if torch.cuda.is_available():
            pg._register_backend(
                torch.device("cuda"), BaseProcessGroup.BackendType.GLOO, backend
            )
        return pg

    def getBackendName(self) -> str:
        return "torchft-gloo"

    def reduce_scatter(  # type: ignore[override]
        self,
        output_tensors: List[torch.Tensor],
        input_tensors: List[List[torch.Tensor]],
        opts: object,
    ) -> Work:
        """Not supported by Gloo: raises RuntimeError."""
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter.")

    def reduce_scatter_tensor_coalesced(  # type: ignore[override]
        self,
        output_tensors: List[torch.Tensor],
        input_tensors: List[torch.Tensor],
        opts: ReduceScatterOptions,
    ) -> Work:
        """Not supported by Gloo: raises RuntimeError."""
        raise RuntimeError(
            "ProcessGroupGloo does not support reduce_scatter_tensor_coalesced."
        )


class _WorkAcceleratorTimeout(Work):
    """A work whose wait (and the stream work queued behind it) aborts its
    group when it overruns the deadline."""

    def __init__(self, pg: ProcessGroup, work: Work, timeout: timedelta) -> None:
        super().__init__()
        self._pg = pg
        self._work = work
        self._timeout = timeout

    def _abort_later(self) -> None:
        _pg.stream_timeout(self._pg.abort, self._timeout)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        with _pg.context_timeout(self._pg.abort, timeout or self._timeout):
            self._work.wait()
        self._abort_later()
        return True

    def get_future(self) -> Future[object]:
        fut = self._work.get_future()

        def done(_: Future[object]) -> None:
            self._abort_later()

        fut.add_done_callback(done)
        return fut


class _AcceleratorProcessGroup(ProcessGroupWrapper):
    """What NCCL and XCCL share: operations run under a deadline that
    aborts the whole group, and an abort is reported by ``errored()``."""

    _env_nonblocking = ""
    _use_abort = False

    def __init__(self, timeout: timedelta = timedelta(seconds=60.0)) -> None:
        super().__init__(timeout)
        self._errored: Optional[Exception] = None
        if self._env_nonblocking and config.raw(self._env_nonblocking) is None:
            logger.warning(
                "%s is not set, setting it to %d s",
                self._env_nonblocking,
                int(timeout.total_seconds()),
            )
            os.environ[self._env_nonblocking] = str(int(timeout.total_seconds()))

    def _opts_hook(self, opts: T) -> T:
        # The deadline is ours (abort on overrun), not the c10d watchdog's.
        if not self._use_abort:
            return opts
        if hasattr(opts, "timeout"):
            opts.timeout = AllgatherOptions().timeout  # type: ignore[attr-defined]
        return opts

    def _wrap_work(self, work: Work, opts: object) -> Work:
        if not self._use_abort:
            return work
        timeout = getattr(opts, "timeout", None)
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            timeout = self._timeout
        return _WorkAcceleratorTimeout(self, work, timeout)

    @contextmanager
    def _run_context(self) -> Generator[None, None, None]:
        if not self._use_abort:
            yield
            return
        with _pg.context_timeout(self.abort, self._timeout):
            yield

    def abort(self, errored: bool = True) -> None:
        if errored and config.get("TORCHFT_TRIGGER_FR_ON_ABORT") and self._rank is not None:
            _pg.trigger_nccl_fr_trace_through_pipe(self._rank)
        self._errored = RuntimeError("aborted")
        super().abort(errored)


class ProcessGroupNCCL(_AcceleratorProcessGroup):
    """A reconfigurable NCCL process group (CUDA tensors).

    With NCCL 2.25 or newer, every operation runs under the group's deadline:
    an overrun aborts the communicator (``errored()`` then reports it, and
    the manager discards the step) instead of waiting for c10d's watchdog.

    Args:
        timeout: deadline of the rendezvous and of every operation.
    """

    _env_nonblocking = "TORCH_NCCL_NONBLOCKING_TIMEOUT"

    def __init__(self, timeout: timedelta = timedelta(seconds=60.0)) -> None:
        self._use_abort = bool(
            torch.cuda.is_available()
            and dist.is_nccl_available()
            and torch.cuda.nccl.version() >= (2, 25)
        )
        super().__init__(timeout)

    def _create_pg(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        from torch.distributed import ProcessGroupNCCL as BaseProcessGroupNCCL

        self._errored = None
        pg = BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(BaseProcessGroup.BackendType.NCCL)
        opts = BaseProcessGroupNCCL.Options()
        opts.config.blocking = False
        if self._global_ranks:
            opts.global_ranks_in_group = self._global_ranks
        name = _group_name(self._quorum_id, self._group_rank, self._group_world_size)
        if name is not None:
            opts.group_name = name
        backend = BaseProcessGroupNCCL(store, rank, world_size, opts)
        device = torch.device("cuda", torch.cuda.current_device())
        backend.eager_connect_single_device(device)
        backend._set_sequence_number_for_group()
        pg._register_backend(torch.device("cuda"), BaseProcessGroup.BackendType.NCCL, backend)
        return pg

    def errored(self) -> Optional[Exception]:
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        return self._errored

    def getBackendName(self) -> str:
        return "torchft-nccl"


class ProcessGroupXCCL(_AcceleratorProcessGroup):
    """A reconfigurable XCCL process group (Intel XPU tensors), with the
    same deadline and abort behaviour as :class:`ProcessGroupNCCL`.

    Args:
        timeout: deadline of the rendezvous and of every operation.
    """

    _env_nonblocking = "TORCH_XCCL_NONBLOCKING_TIMEOUT"

    def __init__(self, timeout: timedelta = timedelta(seconds=60.0)) -> None:
        self._use_abort = bool(torch.xpu.is_available())
        super().__init__(timeout)

    def _create_pg(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        from torch.distributed import ProcessGroupXCCL as BaseProcessGroupXCCL  # type: ignore[attr-defined]

        self._errored = None
        pg = BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(BaseProcessGroup.BackendType.XCCL)
        backend = BaseProcessGroupXCCL(store, rank, world_size)
        pg._register_backend(torch.device("xpu"), BaseProcessGroup.BackendType.XCCL, backend)
        return pg

    def errored(self) -> Optional[Exception]:
        if torch.xpu.is_available():
            torch.xpu.current_stream().synchronize()
        return self._errored

    def getBackendName(self) -> str:
        return "torchft-xccl"
