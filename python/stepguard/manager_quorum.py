"""The road every quorum of a :class:`~stepguard.manager.Manager` takes:
:class:`_Quorum` (one step's quorum, from ``start_quorum`` to its
application) over :class:`_QuorumCall` (the call to the group's manager
server as a start / wait pair).  Private to ``manager.py``, whose names these
are too (``stepguard.manager._Quorum``).
"""

from __future__ import annotations

import concurrent.futures
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Dict, Optional

from stepguard import coordination as _coordination
from stepguard.coordination import ManagerClient, QuorumResult

if TYPE_CHECKING:
    from stepguard.manager import Manager


class _Quorum:
    """One step's quorum, from ``start_quorum`` to its application: the one
    road every quorum takes.

    The call is started at once through the client's start / wait pair (the
    extension runs it on one of its workers, or hands it to the in-process
    manager server: no Python thread).  The first ``result()`` or
    ``configured()`` collects it and applies it.  A quorum that only records
    the participation (the usual step) is applied right there; one that
    reconfigures the process group or moves state is applied on the
    manager's executor thread: ``result()`` waits for all of it,
    ``configured()`` until the participants are known and the process group
    is ready.  Either returns None or raises what the quorum raised, every
    time it is called.
    """

    def __init__(
        self,
        manager: Manager,
        allow_heal: bool,
        shrink_only: bool,
        quorum_timeout: timedelta,
        curr_device: int,
    ) -> None:
        self._manager = manager
        self._allow_heal = allow_heal
        self._curr_device = curr_device
        self._lock = threading.Lock()
        self._done = False
        self._exc: Optional[BaseException] = None
        self._apply: Optional[concurrent.futures.Future] = None
        self._configured = manager._configured
        self._call = _QuorumCall.of(
            manager._client,
            group_rank=manager._group_rank,
            step=manager._step,
            checkpoint_metadata=manager._checkpoint_transport.metadata(),
            shrink_only=shrink_only,
            init_sync=manager._init_sync,
            commit_failures=manager._commit_failures,
            timeout=quorum_timeout,
            reconfigure_handle=manager._reconfigure_handle(),
        )
        self._call.start()

    def done(self) -> bool:
        return self._done and (self._apply is None or self._apply.done())

    def result(self) -> None:
        self._collect()
        if self._exc is not None:
            raise self._exc
        if self._apply is not None:
            self._apply.result()

    def configured(self) -> None:
        """Waits until the quorum has configured the process group and
        decided the participants (its recovery may still run); raises the
        quorum's error."""
        self._collect()
        if self._exc is not None:
            raise self._exc
        apply = self._apply
        if apply is not None:
            self._configured.wait()
            if apply.done():
                apply.result()

    def _collect(self) -> None:
        if self._done:
            return
        with self._lock:
            if self._done:
                return
            m = self._manager
            try:
                quorum = m._through_outages(self._call.wait, self._call.start)
                if m._quorum_is_quiet(quorum, self._allow_heal):
                    m._apply_quorum(quorum, self._allow_heal, -1)
                else:
                    self._apply = m._executor.submit(
                        m._apply_quorum, quorum, self._allow_heal, self._curr_device
                    )
            except BaseException as e:  # noqa: BLE001 - raised by every result()
                self._exc = e
                self._configured.set()
            finally:
                self._done = True


class _QuorumCall:
    """A quorum call as a start / wait pair.  The extension's client has
    them (``_quorum_start`` / ``_quorum_wait``); a client that is not the
    extension's (a test's mock or wrapper, which has only the blocking
    ``_quorum``, torchft's name) gets them from a thread of its own."""

    def __init__(self, client: ManagerClient, kwargs: Dict[str, object]) -> None:
        self._client = client
        self._kwargs = kwargs

    @staticmethod
    def of(client: ManagerClient, **kwargs: object) -> "_QuorumCall":
        # the class itself, not this module's name for it, which a test may
        # have patched; and type(), not isinstance(), which a mock specced
        # on the class passes
        if issubclass(type(client), _coordination.ManagerClient):
            return _QuorumCall(client, kwargs)
        return _ThreadQuorumCall(client, kwargs)

    def start(self) -> None:
        k = self._kwargs
        self._client._quorum_start(
            k["group_rank"], k["step"], k["checkpoint_metadata"], k["shrink_only"],
            k["init_sync"], k["commit_failures"], k["timeout"], k["reconfigure_handle"],
        )

    def wait(self) -> QuorumResult:
        return self._client._quorum_wait()


class _ThreadQuorumCall(_QuorumCall):
    def start(self) -> None:
        self._result: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(target=self._run, name="async_quorum", daemon=True).start()

    def _run(self) -> None:
        try:
            self._result.set_result(self._client._quorum(**self._kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self._result.set_exception(e)

    def wait(self) -> QuorumResult:
        return self._result.result()
