"""Work objects that need no process group.

``_DummyWork`` stands for an operation that finished at once: the manager
returns one when it skips a collective (the step is already failed, or the
collective could not even be issued), and ``ProcessGroupDummy`` returns one
for everything.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

__all__: list[str] = []


class _DummyWork(dist._Work):
    """A finished work whose future holds ``result``.

    Args:
        result: the value ``get_future()`` resolves to (usually the tensors
            the skipped collective was given).
    """

    def __init__(self, result: object) -> None:
        super().__init__()
        self.result_ = result
        self.future_: torch.futures.Future[object] = torch.futures.Future()
        self.future_.set_result(result)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Returns True at once: there is nothing to wait for."""
        return True

    def get_future(self) -> torch.futures.Future[object]:
        """A future that is already done with the result."""
        return self.future_
