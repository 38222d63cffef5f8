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

from stepguard.manager import _ManagedFuture
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
        if not torch.accelerator.is_available():
            # Nothing to order on a stream: one future that DDP waits for
            # at the end of backward, so this bucket's allreduce overlaps
            # the gradients of the next buckets.
            return state._bucket_allreduce(buffer)
        work = state.allreduce(buffer)
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
