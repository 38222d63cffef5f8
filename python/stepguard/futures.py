"""Deadlines for futures, blocks of code and accelerator streams.

Every function here arms a timer on one timer thread per process.  When a
deadline passes, its callback runs on a thread of its own, so a callback
that blocks (aborting a process group can) never delays another deadline.
There is no watchdog that ends the process: a stuck callback only holds its
own thread.  After ``fork()`` the child gets a fresh timer.

Same names and signatures as ``torchft.futures``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Generator, List, Optional, Tuple, TypeVar
from unittest.mock import Mock

import torch
from torch.futures import Future

__all__ = ["context_timeout", "future_timeout", "future_wait", "stream_timeout"]

T = TypeVar("T")

_log = logging.getLogger(__name__)


class _TimerHandle:
    """A scheduled callback; ``cancel()`` stops it if it has not fired."""

    __slots__ = ("_cancelled",)

    def __init__(self) -> None:
        self._cancelled = False

    def cancel(self) -> None:
        """Stops the callback from firing (no effect once it has fired)."""
        self._cancelled = True


class _Timer:
    """A heap of deadlines served by one lazily started daemon thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: List[Tuple[float, int, _TimerHandle, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._thread: Optional[threading.Thread] = None

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> _TimerHandle:
        """Runs ``fn`` on its own thread after ``delay_s`` seconds."""
        handle = _TimerHandle()
        entry = (time.monotonic() + delay_s, next(self._seq), handle, fn)
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="stepguard-timer", daemon=True
                )
                self._thread.start()
            # The thread sleeps until the earliest deadline, so it only
            # needs waking when this one is earlier.  Every collective arms
            # a deadline: waking the thread for each would cost a context
            # switch per allreduce on a busy host.
            if self._heap[0] is entry:
                self._cond.notify()
        return handle

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                deadline, _, handle, fn = self._heap[0]
                now = time.monotonic()
                if deadline > now:
                    self._cond.wait(deadline - now)
                    continue
                heapq.heappop(self._heap)
            if handle._cancelled:
                continue
            threading.Thread(
                target=_run_callback, args=(fn,), name="stepguard-timeout", daemon=True
            ).start()


def _run_callback(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - a timeout callback must not kill the thread
        _log.exception("timeout callback failed")


_TIMER = _Timer()


def _reset_after_fork() -> None:
    global _TIMER
    _TIMER = _Timer()


os.register_at_fork(after_in_child=_reset_after_fork)


def _call_later(timeout: timedelta, fn: Callable[[], None]) -> _TimerHandle:
    return _TIMER.call_later(max(timeout.total_seconds(), 0.0), fn)


def future_timeout(fut: Future[T], timeout: timedelta) -> Future[T]:
    """A future that completes like ``fut``, or with ``TimeoutError`` if
    ``fut`` is not done within ``timeout``.

    Args:
        fut: the future to watch.
        timeout: how long to wait for it.

    Returns:
        A new future; ``fut`` itself is left alone.
    """
    if isinstance(fut, Mock):
        return fut

    out: Future[T] = Future()
    lock = threading.Lock()
    settled = [False]

    def settle(result: object, exc: Optional[BaseException]) -> None:
        with lock:
            if settled[0]:
                return
            settled[0] = True
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(result)  # type: ignore[arg-type]

    def on_timeout() -> None:
        settle(None, TimeoutError(f"future did not complete within {timeout}"))

    handle = _call_later(timeout, on_timeout)

    def on_done(f: Future[T]) -> None:
        handle.cancel()
        try:
            value = f.value()
        except Exception as e:  # noqa: BLE001 - passed on to the new future
            settle(None, e)
            return
        settle(value, None)

    fut.add_done_callback(on_done)
    return out


def future_wait(fut: Future[T], timeout: timedelta) -> T:
    """Waits for ``fut`` and returns its value.

    Raises:
        TimeoutError: ``fut`` was not done within ``timeout``.
        Exception: whatever ``fut`` completed with.
    """
    if fut.done():
        return fut.wait()
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    if not done.wait(max(timeout.total_seconds(), 0.0)):
        raise TimeoutError(f"future did not complete within {timeout}")
    return fut.wait()


@contextmanager
def context_timeout(
    callback: Callable[[], None], timeout: timedelta
) -> Generator[None, None, None]:
    """Calls ``callback`` (on another thread) if the block is still running
    after ``timeout``.  The block itself is not interrupted."""
    handle = _call_later(timeout, callback)
    try:
        yield
    finally:
        handle.cancel()


def stream_timeout(callback: Callable[[], None], timeout: timedelta) -> None:
    """Calls ``callback`` if the work queued so far on the current
    accelerator stream has not finished within ``timeout``.

    Without an accelerator there is nothing queued, so nothing is armed.
    """
    if not torch.accelerator.is_available():
        return
    event = torch.accelerator.current_stream().record_event()

    def check() -> None:
        if not event.query():
            callback()

    _call_later(timeout, check)
