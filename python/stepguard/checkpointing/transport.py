"""The interface every checkpoint transport implements.

A transport moves one replica's state dict to the replicas that are behind
(healing).  The Manager drives it: an up-to-date replica calls
``send_checkpoint`` and, once the step's healing is done,
``disallow_checkpoint``; a healing replica calls ``recv_checkpoint`` with the
string its source's ``metadata()`` returned (carried by the manager).

Interface-compatible with torchft's ``CheckpointTransport``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Generic, List, TypeVar

T = TypeVar("T")

__all__ = ["CheckpointTransport"]


class CheckpointTransport(Generic[T], ABC):
    """Sends and receives a state dict of type ``T`` between replicas."""

    @abstractmethod
    def metadata(self) -> str:
        """What a healing peer needs to reach this transport (an address).

        The manager passes it through to every healing replica unchanged.
        """

    @abstractmethod
    def send_checkpoint(
        self, dst_ranks: List[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Make ``state_dict`` at ``step`` available to ``dst_ranks``.

        Called only when some replica is behind.  May return before the data
        has moved; the state dict must stay unchanged until
        ``disallow_checkpoint`` returns.
        """

    def disallow_checkpoint(self) -> None:
        """Stop serving; once this returns the state dict may change again."""

    @abstractmethod
    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> T:
        """Fetch the state dict at ``step`` from the replica ``src_rank``.

        ``metadata`` is what that replica's ``metadata()`` returned.  Raises
        on a deadline, a vanished source or a wrong step; never returns a
        partly received state.
        """

    def shutdown(self, wait: bool = True) -> None:
        """Release the transport's resources; ``wait`` joins its threads."""
