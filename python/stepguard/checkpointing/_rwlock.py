"""A readers-writer lock with deadlines, not owned by any thread.

Readers share the lock; a writer holds it alone.  Readers are preferred: a
waiting writer does not stop new readers.  Unlike ``threading.Lock``, the
write side may be released by a thread other than the one that took it
(the checkpoint transport takes it on the training thread and releases it
on the quorum thread).

Same interface as torchft's ``RWLock``.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Generator, Optional

__all__ = ["RWLock"]


class RWLock:
    """Readers-writer lock.

    Args:
        timeout: seconds every acquisition may wait before raising
            ``TimeoutError``; negative waits without limit.
    """

    def __init__(self, timeout: float = -1) -> None:
        self._timeout = timeout
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False

    def _wait_s(self) -> Optional[float]:
        return None if self._timeout < 0 else self._timeout

    def r_acquire(self) -> None:
        """Takes a shared hold; waits while a writer holds the lock."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._writer, self._wait_s()):
                raise TimeoutError(
                    f"Timed out waiting for rlock after {self._timeout} seconds"
                )
            self._readers += 1

    def r_release(self) -> None:
        """Drops a shared hold."""
        with self._cond:
            if self._readers <= 0:
                raise RuntimeError("r_release without r_acquire")
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    @contextmanager
    def r_lock(self) -> Generator[None, None, None]:
        """Holds the lock shared for the block."""
        self.r_acquire()
        try:
            yield
        finally:
            self.r_release()

    def w_acquire(self) -> None:
        """Takes the lock alone; waits for readers and any writer."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: not self._writer and self._readers == 0, self._wait_s()
            ):
                raise TimeoutError(
                    f"Timed out waiting for wlock after {self._timeout} seconds"
                )
            self._writer = True

    def w_release(self) -> None:
        """Releases the exclusive hold (any thread may)."""
        with self._cond:
            if not self._writer:
                raise RuntimeError("w_release without w_acquire")
            self._writer = False
            self._cond.notify_all()

    @contextmanager
    def w_lock(self) -> Generator[None, None, None]:
        """Holds the lock alone for the block."""
        self.w_acquire()
        try:
            yield
        finally:
            self.w_release()

    def w_locked(self) -> bool:
        """True while a writer holds the lock."""
        with self._cond:
            return self._writer
