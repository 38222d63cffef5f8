"""Streaming (de)serialization of state dicts, the format torchft's
transports put on the wire: torch's streaming save/load when this torch has
it (2.7+), else ``torch.save``/``torch.load``."""

from __future__ import annotations

import io
import warnings
from typing import IO, cast

import torch

__all__: list[str] = []


def _fallback_save(obj: object, f: io.BufferedIOBase) -> None:
    warnings.warn("torch has no streaming save; using torch.save (slower)")
    torch.save(obj, cast(IO[bytes], f))


def _fallback_load(f: io.BufferedIOBase, weights_only: bool = True) -> object:
    warnings.warn("torch has no streaming load; using torch.load (slower)")
    # torch.load needs a seekable file.
    return torch.load(io.BytesIO(f.read()), weights_only=weights_only)


try:
    from torch.distributed._serialization import _streaming_load, _streaming_save
except ImportError:  # torch < 2.7
    _streaming_load = _fallback_load  # type: ignore[assignment]
    _streaming_save = _fallback_save  # type: ignore[assignment]
