"""torchft's ``ProcessGroupBaby*`` groups, in process: the c10d groups of
:mod:`stepguard.process_group_c10d` under torchft's baby names, with the
timeout, closed-handle and per-configuration lifetime behaviour a caller of
torchft's child-process groups sees (see :class:`ProcessGroupBaby`).

Import these names from :mod:`stepguard.process_group` (torchft's module
path), which loads this module on first use.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Optional, Union

import torch.distributed as dist
from torch.distributed import ProcessGroup as BaseProcessGroup

from stepguard.process_group import ProcessGroupWrapper
from stepguard.process_group_c10d import (
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupXCCL,
)

__all__ = [
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
]


class _Generation:
    """The lifetime of one configuration of a baby group: live from the
    ``configure`` that built its c10d group until that group is dropped
    (replaced by the next configuration, aborted or shut down)."""

    __slots__ = ("_live",)

    def __init__(self) -> None:
        self._live = True

    def end(self) -> None:
        self._live = False

    def is_alive(self) -> bool:
        """True while this configuration's group is the current one."""
        return self._live

    def closed(self) -> bool:
        """True once this configuration's group has been dropped."""
        return not self._live

    def __repr__(self) -> str:
        return f"_Generation(live={self._live})"


class ProcessGroupBaby(ProcessGroupWrapper):
    """torchft's "baby" process groups run the collective backend in a
    child process so that a hung NCCL call can be escaped by killing the
    child.  stepguard does not need that isolation: its groups abort hung
    operations at their deadline.  The ``ProcessGroupBaby*`` classes are
    therefore the in-process groups (real subclasses, not a child process)
    under torchft's names and backend names, accepting torchft's float
    timeout.

    What a caller of torchft's baby groups sees is kept:

    * a configuration that is not ready within the timeout raises
      ``TimeoutError`` ("... timed out after <seconds> seconds");
    * after ``shutdown()`` (until the next configuration) collectives raise
      ``OSError("handle is closed")``;
    * ``size()`` is the last configured world size (-1 before any);
    * torchft's per-configuration child process, request pipe and future
      thread (``_p``, ``_future_pipe``, ``_future_thread``) are all one
      :class:`_Generation` here, with the ``is_alive()``/``closed()`` those
      objects answer: each configuration gets a new one, and the previous
      one ends when its c10d group is dropped.

    Args:
        timeout: seconds (float) or a timedelta.
    """

    # class defaults: the NCCL and XCCL babies run their backend's __init__
    # rather than this class's
    _generation: Optional[_Generation] = None
    _closed = False

    def __init__(self, timeout: Union[float, timedelta] = 60.0) -> None:
        if not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=timeout)
        super().__init__(timeout)

    # torchft's names for what a configuration owns (see the class doc)
    @property
    def _p(self) -> Optional[_Generation]:
        return self._generation

    @property
    def _future_pipe(self) -> Optional[_Generation]:
        return self._generation

    @property
    def _future_thread(self) -> Optional[_Generation]:
        return self._generation

    def _end_generation(self) -> None:
        gen = self._generation
        if gen is not None:
            gen.end()

    def _rebuild(self, store_addr: str, rank: int, world_size: int) -> None:
        self._closed = False
        limit = self._timeout.total_seconds()
        started = time.monotonic()
        try:
            super()._rebuild(store_addr, rank, world_size)
        except Exception as e:
            overran = time.monotonic() - started >= limit
            if overran or isinstance(e, TimeoutError) or (
                isinstance(e, dist.DistStoreError) and "timeout" in str(e)
            ):
                raise TimeoutError(
                    f"process group configuration timed out after {limit} seconds"
                ) from e
            raise
        self._generation = _Generation()

    def abort(self, errored: bool = True) -> None:  # type: ignore[override]
        self._end_generation()
        super().abort(errored)  # type: ignore[call-arg]

    def shutdown(self) -> None:
        self._end_generation()
        self._closed = True
        super().shutdown()

    @property
    def parent(self) -> BaseProcessGroup:
        if self._pg is None and self._closed:
            raise OSError("handle is closed")
        return super().parent

    def size(self) -> int:
        pg = self._pg
        if pg is not None:
            return pg.size()
        return self._world_size if self._world_size is not None else -1

    def num_active_work(self) -> int:
        """Operations in flight in the group (0: they run in this process
        and are not tracked)."""
        return 0


class ProcessGroupBabyGloo(ProcessGroupBaby, ProcessGroupGloo):
    """:class:`ProcessGroupGloo` under torchft's ``torchft-baby-gloo`` name
    (in process; see :class:`ProcessGroupBaby`)."""

    def getBackendName(self) -> str:
        return "torchft-baby-gloo"


class ProcessGroupBabyNCCL(ProcessGroupBaby, ProcessGroupNCCL):
    """:class:`ProcessGroupNCCL` under torchft's ``torchft-baby-nccl`` name
    (in process; see :class:`ProcessGroupBaby`)."""

    def __init__(self, timeout: Union[float, timedelta] = 60.0) -> None:
        if not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=timeout)
        ProcessGroupNCCL.__init__(self, timeout)

    def getBackendName(self) -> str:
        return "torchft-baby-nccl"


class ProcessGroupBabyXCCL(ProcessGroupBaby, ProcessGroupXCCL):
    """:class:`ProcessGroupXCCL` under torchft's ``torchft-baby-xccl`` name
    (in process; see :class:`ProcessGroupBaby`)."""

    def __init__(self, timeout: Union[float, timedelta] = 60.0) -> None:
        if not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=timeout)
        ProcessGroupXCCL.__init__(self, timeout)

    def getBackendName(self) -> str:
        return "torchft-baby-xccl"

