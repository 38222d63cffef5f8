"""stepguard: per-step fault tolerance for PyTorch distributed training.

The coordination core (lighthouse, manager, collectives, checkpoint serving)
is the C library libstepguard; this package is its torch-facing API.  Module
paths mirror torchft's, so ``import stepguard as torchft`` serves torchft
scripts as the API fills in.
"""

from stepguard import _C

__version__: str = _C.version()

Error = _C.Error

__all__ = ["Error", "__version__"]
