"""DistributedDataParallel for fault-tolerant training.

torch's DDP with its gradient allreduce routed through the Manager: the
allreduce averages over the replicas taking part in the step, and a failure
marks the step failed instead of breaking ``backward()``.  The initial
parameter broadcast is left to the Manager (it heals replicas at step 0).
"""

# No `from __future__ import annotations` here: torch checks the comm
# hook's `bucket` annotation at run time against dist.GradBucket.

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import parallel

from stepguard.manager import _ManagedFuture, _ManagedWork
from stepguard.process_group import ProcessGroupDummy

if TYPE_CHECKING:
    from stepguard.manager import Manager

__all__ = ["DistributedDataParallel", "PureDistributedDataParallel"]


class DistributedDataParallel(parallel.DistributedDataParallel):
    """torch DDP whose buckets are allreduced by ``manager.allreduce``.

    No parameter shape checks are done across replicas.

    Args:
        manager: the stepguard Manager.
        module: the model.
        **kwargs: passed to torch's DistributedDataParallel.
    """

    def __init__(self, manager: "Manager", module: nn.Module, **kwargs: Any) -> None:
        super().__init__(
            module,
            # A world of one takes DDP's construction broadcast; the
            # replicas are synchronized by the Manager instead.
            process_group=ProcessGroupDummy(0, 1),
            # Keeps the reducer from rebuilding its buckets after the first
            # step, which would give a healed replica different buckets.
            find_unused_parameters=True,
            **kwargs,
        )
        self.register_comm_hook(manager, self._comm_hook)

    @staticmethod
    def _comm_hook(
        state: "Manager", bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        work = state.allreduce(buffer)
        if isinstance(work, _ManagedWork) and work._stream is None:
            return _overlapped(state, work, buffer)
        if not work.wait():
            # The step already failed (the manager knows): hand DDP the
            # bucket unchanged rather than failing backward().
            return _completed(buffer)
        fut = work.get_future()
        if not isinstance(fut, _ManagedFuture):
            return cast(torch.futures.Future[torch.Tensor], fut)
        # DDP needs the real torch future, not the lazy chain's handle.
        assert fut._fut is not None, "wait() succeeded but the chain was not built"
        return cast(torch.futures.Future[torch.Tensor], fut._fut)


def _overlapped(
    manager: "Manager", work: _ManagedWork, buffer: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    """Without an accelerator stream: the bucket's result as a future that
    DDP waits for at the end of backward, so that this bucket's allreduce
    runs while the gradients of the next buckets are computed (waiting here
    would serialize every bucket's allreduce with the backward pass).
    Failures are swallowed exactly as ``work.wait()`` would: the step is
    marked failed and DDP gets the bucket as it is."""
    try:
        work.synchronize()
        tail = work.get_future()
        assert isinstance(tail, _ManagedFuture) and tail._fut is not None
        fut = cast(torch.futures.Future[torch.Tensor], tail._fut)
    except Exception as e:  # noqa: BLE001 - a failed step, not a crash
        manager._logger.exception(f"exception waiting for work: {e}")
        manager.report_error(e)
        return _completed(buffer)

    def swallow(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        try:
            return f.value()
        except Exception as e:  # noqa: BLE001 - a failed step, not a crash
            manager._logger.exception(f"exception waiting for work: {e}")
            manager.report_error(e)
            return buffer

    return fut.then(swallow)


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


class PureDistributedDataParallel(nn.Module):
    """A model wrapper that allreduces each gradient as soon as it is
    accumulated (one allreduce per parameter; slow for large models).

    Args:
        manager: the stepguard Manager.
        module: the model.
    """

    def __init__(self, manager: "Manager", module: nn.Module) -> None:
        super().__init__()
        self.module = module

        def post_grad_hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                # torchft does not wait here, so the averaging callback of
                # the lazy work never runs and gradients stay summed; waiting
                # makes the gradient the average before the optimizer reads it.
                manager.allreduce(p.grad).wait()

        for p in module.parameters():
            p.register_post_accumulate_grad_hook(post_grad_hook)

    def forward(self, *args: object) -> object:
        return self.module(*args)
