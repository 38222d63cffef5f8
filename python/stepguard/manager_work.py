"""The work a :class:`~stepguard.manager.Manager` hands back from
``allreduce``: :class:`_ManagedWork` and the callback chain of its futures
(:class:`_ManagedFuture`, :class:`_SimpleFuture`), run lazily on the stream
current when the work was made.  Names and behaviour are torchft's; torchft
code imports them from the manager module (``stepguard.manager._ManagedWork``
is this class).
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, ContextManager, Optional, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Work

if TYPE_CHECKING:
    from stepguard.manager import Manager

S = TypeVar("S")


def _accelerator() -> bool:
    return torch.accelerator.is_available()


def _stream_context(stream: Optional[torch.Stream]) -> ContextManager[object]:
    if stream is None:
        return nullcontext()
    return cast(ContextManager[object], stream)


class _SimpleFuture(torch.futures.Future):
    """A finished future holding ``value``: what each callback of a managed
    work's chain receives."""

    def __init__(self, value: object) -> None:
        super().__init__()
        self._value = value

    def value(self) -> object:
        return self._value

    def then(self, callback: Callable[["_SimpleFuture"], S]) -> "_SimpleFuture":  # type: ignore[override]
        return _SimpleFuture(callback(self))

    def wait(self) -> object:
        return self._value

    def done(self) -> bool:
        return True

    def add_done_callback(self, callback: Callable[[torch.futures.Future], None]) -> None:
        raise NotImplementedError("add_done_callback is not supported on _SimpleFuture")

    def set_result(self, result: object) -> None:
        raise NotImplementedError("set_result is not supported on _SimpleFuture")

    def set_exception(self, result: object) -> None:
        raise NotImplementedError("set_exception is not supported on _SimpleFuture")


class _ManagedFuture(torch.futures.Future):
    """One link of a managed work's callback chain.  ``then`` only records
    the callback; the chain runs when the work is waited on."""

    def __init__(self, managed_work: "weakref.ReferenceType[_ManagedWork]") -> None:
        super().__init__()
        self._managed_work = managed_work
        self._next: Optional[_ManagedFuture] = None
        self._callback: Optional[Callable[[_SimpleFuture], object]] = None
        self._fut: Optional[torch.futures.Future[object]] = None

    def then(self, callback: Callable[[torch.futures.Future], S]) -> "_ManagedFuture":  # type: ignore[override]
        work = self._managed_work()
        assert work is not None, "the managed work is gone"
        assert self._next is None, "then() was already called on this future"
        nxt = _ManagedFuture(self._managed_work)
        nxt._callback = cast(Callable[[_SimpleFuture], object], callback)
        self._next = nxt
        work._tail = nxt
        return nxt

    def wait(self) -> object:
        work = self._managed_work()
        assert work is not None, "the managed work is gone"
        work.wait()
        assert self._fut is not None
        return self._fut.wait()

    def value(self) -> object:
        raise NotImplementedError("value() is not supported on a managed future; wait() instead")

    def done(self) -> bool:
        raise NotImplementedError("done() is not supported on a managed future")

    def add_done_callback(self, callback: Callable[[torch.futures.Future], None]) -> None:
        raise NotImplementedError("add_done_callback is not supported on a managed future")

    def set_result(self, result: object) -> None:
        raise NotImplementedError("set_result is not supported on a managed future")

    def set_exception(self, result: object) -> None:
        raise NotImplementedError("set_exception is not supported on a managed future")


class _ManagedWork(dist._Work):
    """A process group work whose result goes through the manager: a
    deadline and error swallowing (``wrap_future``) first, then the
    callbacks added with ``get_future().then(...)``, run lazily on the
    stream current at creation."""

    def __init__(self, manager: Manager, work: Work, value: object) -> None:
        super().__init__()
        self._manager = manager
        self._work = work
        self._value = value
        self._stream: Optional[torch.Stream] = (
            torch.accelerator.current_stream() if _accelerator() else None
        )
        self._head = _ManagedFuture(weakref.ref(self))
        self._tail = self._head
        self._built = False

    def _build(self) -> None:
        """Links the recorded callbacks onto the operation's future.

        As torchft's: each callback gets a future of the running value (the
        value the work was made with, then each callback's result), not the
        operation's own result; errors and the deadline come from
        ``wrap_future`` around the first link (around the operation's future
        itself when there is no callback)."""
        if self._built:
            return
        self._built = True
        stream = self._stream
        running = [self._value]
        head = self._head
        head._fut = self._work.get_future()
        if head._next is None:
            head._fut = self._manager.wrap_future(head._fut, running[0])
            return
        node: _ManagedFuture = head
        wrapped = False
        while node._next is not None:
            nxt = node._next
            cb = nxt._callback
            assert cb is not None and node._fut is not None

            def run(
                f: torch.futures.Future[object],
                cb: Callable[[_SimpleFuture], object] = cb,
            ) -> object:
                with _stream_context(stream):
                    f.wait()
                    running[0] = cb(_SimpleFuture(running[0]))
                    return running[0]

            fut = node._fut.then(run)
            if not wrapped:
                fut = self._manager.wrap_future(fut, running[0])
                wrapped = True
            nxt._fut = fut
            node = nxt

    def _assert_same_stream(self) -> None:
        if self._stream is not None:
            assert self._stream == torch.accelerator.current_stream(), (
                "a managed work must be waited on the stream it was created on"
            )

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Waits for the operation and its callbacks; False (and the step
        marked failed) if anything went wrong."""
        self._assert_same_stream()
        try:
            with _stream_context(self._stream):
                if timeout is not None:
                    self._work.wait(timeout)
                else:
                    self._work.wait()
                self._build()
                assert self._tail._fut is not None
                self._tail._fut.wait()
            return True
        except Exception as e:  # noqa: BLE001 - a failed step, not a crash
            self._manager._logger.exception(f"exception waiting for work: {e}")
            self._manager.report_error(e)
            return False

    def block_current_stream(self, timeout: Optional[timedelta] = None) -> None:
        """Makes the current stream wait for the operation and builds the
        callback chain."""
        self._assert_same_stream()
        self._work.block_current_stream()
        self._build()

    def synchronize(self) -> None:
        """Accelerator: ``block_current_stream``; else builds the chain."""
        if self._stream is not None and torch.cuda.is_available():
            self.block_current_stream()
        else:
            self._build()

    def get_future(self) -> torch.futures.Future[object]:  # type: ignore[override]
        """The tail of the callback chain (a :class:`_ManagedFuture`)."""
        return self._tail
