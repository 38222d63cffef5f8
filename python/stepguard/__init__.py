"""stepguard: per-step fault tolerance for PyTorch distributed training.

The coordination core (lighthouse, manager, collectives, checkpoint serving)
is the C library libstepguard; this package is its torch-facing API.  Module
paths and names mirror torchft's, so ``import stepguard as torchft`` serves
torchft training scripts.
"""

from stepguard import _C
from stepguard.data import DistributedSampler
from stepguard.ddp import DistributedDataParallel
from stepguard.manager import Manager
from stepguard.optim import OptimizerWrapper as Optimizer
from stepguard.process_group import (
    ProcessGroupBabyNCCL,
    ProcessGroupBabyXCCL,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupXCCL,
)

__version__: str = _C.version()

Error = _C.Error

__all__ = [
    "DistributedDataParallel",
    "DistributedSampler",
    "Error",
    "Manager",
    "Optimizer",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupXCCL",
    "__version__",
]
