"""stepguard: per-step fault tolerance for PyTorch distributed training.

The coordination core (lighthouse, manager, collectives, checkpoint serving)
is the C library libstepguard; this package is its torch-facing API.  Module
paths and names mirror torchft's, so ``import stepguard as torchft`` serves
torchft training scripts.

The training names below are imported on first use, so tools that need only
``stepguard.coordination`` (the lighthouse CLI) do not pay for importing
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stepguard import _C

__version__: str = _C.version()

Error = _C.Error

# torchft sets up its structured-log loggers at import; so do we (a no-op
# that imports neither torch nor OpenTelemetry unless TORCHFT_USE_OTEL asks)
from stepguard import otel as _otel  # noqa: E402

for _name in ("torchft_quorums", "torchft_commits", "torchft_errors"):
    _otel.setup_logger(_name)
del _name

# name -> (module, attribute)
_LAZY = {
    "DistributedDataParallel": ("stepguard.ddp", "DistributedDataParallel"),
    "DistributedSampler": ("stepguard.data", "DistributedSampler"),
    "Manager": ("stepguard.manager", "Manager"),
    "Optimizer": ("stepguard.optim", "OptimizerWrapper"),
    "ProcessGroupBabyNCCL": ("stepguard.process_group", "ProcessGroupBabyNCCL"),
    "ProcessGroupBabyXCCL": ("stepguard.process_group", "ProcessGroupBabyXCCL"),
    "ProcessGroupGloo": ("stepguard.process_group", "ProcessGroupGloo"),
    "ProcessGroupNCCL": ("stepguard.process_group", "ProcessGroupNCCL"),
    "ProcessGroupXCCL": ("stepguard.process_group", "ProcessGroupXCCL"),
    # stepguard's own: the native collectives with deadlines and abort
    "ProcessGroupTCP": ("stepguard.process_group_tcp", "ProcessGroupTCP"),
}

# the submodules torchft's __init__ imports, so a bare ``import stepguard``
# reaches them as attributes the way ``import torchft`` does
_SUBMODULES = frozenset(
    {
        "checkpointing",
        "coordination",
        "data",
        "ddp",
        "futures",
        "local_sgd",
        "manager",
        "optim",
        "otel",
        "process_group",
        "work",
    }
)

setup_logger = _otel.setup_logger

__all__ = sorted(_LAZY) + ["Error", "__version__"]

if TYPE_CHECKING:
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
    from stepguard.process_group_tcp import ProcessGroupTCP


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"stepguard.{name}")
    try:
        module, attr = _LAZY[name]
    except KeyError:
        # in torchft mode, `from torchft import _test_utils` looks the name
        # up here (this module is torchft): torchft's helpers live in its
        # wheel, under the torchft name
        import sys

        from stepguard.as_torchft import _from_wheel

        if sys.modules.get("torchft") is sys.modules[__name__] and _from_wheel(name):
            try:
                return importlib.import_module(f"torchft.{name}")
            except ImportError:
                pass
        raise AttributeError(f"module 'stepguard' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)
