"""Deadlines for futures, blocks of code and accelerator streams.

Every function here arms a timer on one timer thread per process.  When a
deadline passes, its callback runs on a thread of its own, so a callback
that blocks (aborting a process group can) never delays another deadline.
After ``fork()`` the child gets a fresh timer.

A watchdog reports callbacks that do not return: one still running after
``_TIMEOUT_MANAGER._watchdog_interval`` (``TORCHFT_WATCHDOG_TIMEOUT_SEC``
seconds, default 30) is logged and ``sys.exit(1)`` is called, once per
callback, as torchft does.  That call is made on the watchdog's own thread,
where ``SystemExit`` ends only that thread (the next callback starts a new
watchdog); the stuck callback keeps its thread and no other deadline waits
for it.

Same names and signatures as ``torchft.futures``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import queue
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Dict, Generator, List, Optional, Tuple, TypeVar
from unittest.mock import Mock

import torch
from torch.futures import Future

from stepguard import config

__all__ = ["context_timeout", "future_timeout", "future_wait", "stream_timeout"]

T = TypeVar("T")

_log = logging.getLogger(__name__)

#: the environment variable that sets the watchdog interval, in seconds
WATCHDOG_TIMEOUT_SEC = "TORCHFT_WATCHDOG_TIMEOUT_SEC"

# While a callback runs, the watchdog wakes at least this often, so that a
# change to the interval takes effect without waiting out the old one.
_WATCHDOG_POLL_S = 1.0


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


class _TimeoutManager:
    """Process-wide state beside the timer: the watchdog over running
    callbacks, and the queue of accelerator events waiting to be released.

    Attributes:
        _watchdog_interval: how long a callback may run before the watchdog
            reports it (read on every check, so it may be changed at any
            time).
        _del_queue: events of :func:`stream_timeout` whose check has run.
            Destroying an event can block while the accelerator's queue is
            full, so they are released by :meth:`_clear_del_queue` on the
            thread of the next call to this module, not on a callback's.
    """

    def __init__(self) -> None:
        self._watchdog_interval = timedelta(
            seconds=config.get("TORCHFT_WATCHDOG_TIMEOUT_SEC")
        )
        self._del_queue: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._reset()

    def _reset(self) -> None:
        """Forgets the threads of this process (after fork, in the child)."""
        self._cond = threading.Condition()
        # Callbacks running and not yet reported, oldest first: token ->
        # start time.  Tokens are handed out in start order, so the dict's
        # insertion order is also the order of the start times.
        self._running: Dict[int, float] = {}
        self._tokens = itertools.count()
        self._watchdog: Optional[threading.Thread] = None

    def _callback_started(self) -> int:
        with self._cond:
            token = next(self._tokens)
            self._running[token] = time.monotonic()
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch, name="stepguard-watchdog", daemon=True
                )
                self._watchdog.start()
            else:
                self._cond.notify()
        return token

    def _callback_finished(self, token: int) -> None:
        with self._cond:
            # A finished callback needs no wake-up: the watchdog re-checks
            # when its wait ends.
            self._running.pop(token, None)

    def _watch(self) -> None:
        try:
            while True:
                with self._cond:
                    while True:
                        if not self._running:
                            self._cond.wait()
                            continue
                        token, started = next(iter(self._running.items()))
                        limit = self._watchdog_interval.total_seconds()
                        age = time.monotonic() - started
                        if age >= limit:
                            # reported once; it stays on its own thread
                            del self._running[token]
                            break
                        self._cond.wait(min(limit - age, _WATCHDOG_POLL_S))
                _log.error(
                    "a timeout callback is stuck (running for %.1f s); "
                    "calling sys.exit(1)",
                    age,
                )
                # Looked up at call time so that it can be replaced.
                sys.exit(1)
        finally:
            with self._cond:
                if self._watchdog is threading.current_thread():
                    self._watchdog = None
                    # a callback that started while this thread was ending
                    # found it still set: watch it with a new thread
                    if self._running:
                        self._watchdog = threading.Thread(
                            target=self._watch, name="stepguard-watchdog", daemon=True
                        )
                        self._watchdog.start()

    def _clear_del_queue(self) -> int:
        """Releases every queued event; returns how many there were."""
        count = 0
        # Called before every deadline is armed: test for emptiness first,
        # as raising queue.Empty each time would cost more.
        while not self._del_queue.empty():
            try:
                self._del_queue.get_nowait()
            except queue.Empty:  # another thread took it
                break
            count += 1
        return count


_TIMEOUT_MANAGER = _TimeoutManager()


def _run_callback(fn: Callable[[], None]) -> None:
    token = _TIMEOUT_MANAGER._callback_started()
    try:
        fn()
    except Exception:  # noqa: BLE001 - a timeout callback must not kill the thread
        _log.exception("timeout callback failed")
    finally:
        _TIMEOUT_MANAGER._callback_finished(token)


_TIMER = _Timer()


def _reset_after_fork() -> None:
    # _TIMER is replaced (code that arms timers compares it to see a fork);
    # _TIMEOUT_MANAGER is kept, as importers may hold it, and reset.
    global _TIMER
    _TIMER = _Timer()
    _TIMEOUT_MANAGER._reset()


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
    _TIMEOUT_MANAGER._clear_del_queue()

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
    _TIMEOUT_MANAGER._clear_del_queue()
    handle = _call_later(timeout, callback)
    try:
        yield
    finally:
        handle.cancel()


def stream_timeout(callback: Callable[[], None], timeout: timedelta) -> None:
    """Calls ``callback`` if the work queued so far on the current
    accelerator stream has not finished within ``timeout``.

    Without an accelerator there is nothing queued, so nothing is armed.
    Once checked, the event goes to ``_TIMEOUT_MANAGER._del_queue``.
    """
    _TIMEOUT_MANAGER._clear_del_queue()
    if not torch.accelerator.is_available():
        return
    # The check keeps the event in a list it empties when done, so that the
    # queue then holds the only reference to it.
    box = [torch.accelerator.current_stream().record_event()]

    def check() -> None:
        try:
            if not box[0].query():
                callback()
        finally:
            _TIMEOUT_MANAGER._del_queue.put(box.pop())

    _call_later(timeout, check)
