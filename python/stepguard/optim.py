"""An optimizer wrapper that ties each step to the Manager's protocol:
``zero_grad`` starts the quorum, ``step`` applies the update only if the
step commits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional

import torch
from torch.optim import Optimizer

if TYPE_CHECKING:
    from stepguard.manager import Manager

__all__ = ["OptimizerWrapper"]


class OptimizerWrapper(Optimizer):
    """Wraps ``optim`` (exported as ``stepguard.Optimizer``).

    Args:
        manager: the stepguard Manager.
        optim: the optimizer to drive.
    """

    def __init__(self, manager: "Manager", optim: Optimizer) -> None:
        self.optim = optim
        self.manager = manager

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def state_dict(self) -> Dict[str, Any]:
        return self.optim.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Starts the step's quorum, then zeroes the gradients."""
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Optional[object] = None) -> None:
        """Steps the optimizer if the step commits (closures unsupported)."""
        assert closure is None, "optimizers that use closures are not supported"
        if self.manager.should_commit():
            self.optim.step()

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Mapping[torch.Tensor, object]:  # type: ignore[override]
        return self.optim.state
