"""The Manager: per-step fault tolerance for one rank of a replica group.

Every step is a transaction over the replica groups in the current quorum:

1. ``start_quorum()`` (from ``Optimizer.zero_grad``) asks the group's manager
   server for this step's quorum, in the background.  On a new quorum the
   replica process group is rebuilt; a replica that is behind fetches the
   state of an up-to-date one (live recovery) while the others serve it.
2. ``allreduce()`` (from the DDP comm hook) averages gradients over the
   participating replicas; a failure marks the step failed instead of
   raising.
3. ``should_commit()`` (from ``Optimizer.step``) votes: the step commits only
   if every rank of the group is healthy and enough replicas took part.

Group rank 0 runs the group's :class:`~stepguard.coordination.ManagerServer`
(a C server on threads of this process) and publishes its address in the
group's TCPStore; every rank keeps one
:class:`~stepguard.coordination.ManagerClient` open for the life of
training (the server treats a rank whose connections all close as dead).

Constructor, methods, defaults, environment variables and log records are
torchft's (``TORCHFT_*``; every one also read as ``STEPGUARD_*``).  Where
torchft applies an environment override only partly, this module applies it
everywhere (see ``Manager.__init__``).

Two chapters live in files of their own: the road every quorum takes
(``_Quorum``, ``_QuorumCall``) in ``manager_quorum.py``, and the work that
``allreduce`` returns with its callback chain (``_ManagedWork``) in
``manager_work.py``.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import threading
import time
import traceback
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from enum import Enum
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    List,
    Optional,
    TypeVar,
    cast,
)

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp, TCPStore
from torch.distributed.distributed_c10d import AllreduceOptions, Work
from torch.utils._pytree import tree_map

from stepguard.checkpointing import CheckpointTransport, NativeTransport
from stepguard.checkpointing._rwlock import RWLock
from stepguard import collectives, config
from stepguard import coordination as _coordination
from stepguard import hsdp as _hsdp
from stepguard.coordination import ManagerClient, ManagerServer, QuorumResult
from stepguard.futures import future_timeout
# the quorum's road and the managed work are chapters of their own; their
# names are this module's too (torchft code imports _ManagedWork and
# _ManagedFuture from the manager module)
from stepguard.manager_quorum import (  # noqa: F401
    _Quorum,
    _QuorumCall,
    _ThreadQuorumCall,
)
from stepguard.manager_work import (  # noqa: F401
    _accelerator,
    _ManagedFuture,
    _ManagedWork,
    _SimpleFuture,
    _stream_context,
)
from stepguard.process_group import ReconfigureOptions
from stepguard.work import _DummyWork

if TYPE_CHECKING:
    from stepguard.process_group import ProcessGroup

__all__ = ["ExceptionWithTraceback", "Manager", "WorldSizeMode"]

MANAGER_ADDR_KEY: str = "manager_addr"
MANAGER_PORT_ENV: str = "TORCHFT_MANAGER_PORT"
REPLICA_ID_KEY: str = "replica_id"

TIMEOUT_SEC_ENV: str = "TORCHFT_TIMEOUT_SEC"
QUORUM_TIMEOUT_SEC_ENV: str = "TORCHFT_QUORUM_TIMEOUT_SEC"
CONNECT_TIMEOUT_SEC_ENV: str = "TORCHFT_CONNECT_TIMEOUT_SEC"
QUORUM_RETRIES_ENV: str = "TORCHFT_QUORUM_RETRIES"
TORCH_FR_DUMP_TEMP_FILE_ENV: str = "TORCH_FR_DUMP_TEMP_FILE"

T = TypeVar("T")
S = TypeVar("S")


def get_timeout(
    timeout_sec_env: Optional[str], default_timeout_sec: timedelta
) -> timedelta:
    """``timedelta(seconds=int(timeout_sec_env))`` if the variable was set,
    else ``default_timeout_sec``."""
    if timeout_sec_env is not None and timeout_sec_env != "":
        return timedelta(seconds=int(timeout_sec_env))
    return default_timeout_sec


def _required(name: str) -> Any:
    """A variable the Manager cannot start without when no argument gave it.

    Raises:
        KeyError: it is unset.
    """
    value = config.get(name)
    if value is None:
        raise KeyError(name)
    return value


def extract_trailing_digits(s: str) -> int:
    """The number at the end of ``s`` (``"train_ddp_3"`` -> 3), else 0."""
    m = re.search(r"(\d+)$", s)
    return int(m.group(1)) if m else 0


class WorldSizeMode(Enum):
    """How many replicas take part in a step.

    DYNAMIC: every replica in the quorum; gradients are averaged over them.
    FIXED_WITH_SPARES: at most ``min_replica_size``; the others are spares
        that contribute zeros and are not counted.
    """

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


class ExceptionWithTraceback(Exception):
    """An error reported to the manager, with the traceback where it was
    caught (``original_exception``, ``stack_trace``)."""

    def __init__(self, e: Exception) -> None:
        self.original_exception = e
        self.stack_trace: str = "".join(
            traceback.format_exception(type(e), e, e.__traceback__)
        )
        super().__init__(f"{e}\n{self.stack_trace}")


def _traced(name: str) -> Callable[[Callable[..., S]], Callable[..., S]]:
    """Records calls of the decorated function as ``name`` in a running
    torch profiler.  ``torch.profiler.record_function`` as a decorator costs
    tens of microseconds per call even with no profiler running, twice a
    step; this checks for one first."""

    def decorate(fn: Callable[..., S]) -> Callable[..., S]:
        @functools.wraps(fn)
        def traced(*args: object, **kwargs: object) -> S:
            if not torch.autograd._profiler_enabled():
                return fn(*args, **kwargs)
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return traced

    return decorate


class Manager:
    """Manages one rank of a replica group: quorum, live recovery, error
    swallowing and the commit vote.

    The default torch process group of the replica group (torchelastic /
    ``init_process_group``) must exist, as must its TCPStore at
    ``MASTER_ADDR:MASTER_PORT``.  Save and restore ``state_dict()`` with
    your periodic checkpoints.

    When state is read: the first ``start_quorum`` reads the registered
    state once, on the training thread.  A state without DTensors is read
    from then on where the quorum runs, as torchft does.  A state with
    DTensors (FSDP2) is read only where the training thread cannot be in a
    forward or backward pass: in ``start_quorum`` with a sync quorum, in
    ``should_commit`` with an async one (the step's collectives then wait
    only for the process group, not for the recovery); a source serves a
    copy until its next ``should_commit``.  See ``docs/hsdp.md``.

    Args:
        pg: a reconfigurable process group over the replicas (a
            :class:`~stepguard.process_group.ProcessGroup`).
        load_state_dict: loads the user state received when healing.
        state_dict: returns the user state sent to healing replicas (both
            registered under ``"default"`` when given).
        min_replica_size: replicas needed to commit a step.
        use_async_quorum: run the quorum during the forward pass (healing
            replicas then load their state at ``should_commit``).
        timeout: default deadline: collectives (``wrap_future``), the
            commit vote, checkpoint metadata and transfer, the state lock.
        quorum_timeout: deadline of a quorum (longer than a step).
        connect_timeout: deadline of connecting to the manager/lighthouse.
        rank: group rank (else ``RANK``).
        world_size: group size (else ``WORLD_SIZE``).
        world_size_mode: see :class:`WorldSizeMode`.
        store_addr: the group's TCPStore host (else ``MASTER_ADDR``).
        store_port: its port (else ``MASTER_PORT``).
        lighthouse_addr: group rank 0: the lighthouse (else
            ``TORCHFT_LIGHTHOUSE``).
        replica_id: group rank 0: the replica's name; a uuid is appended.
        port: group rank 0: the manager port (else ``TORCHFT_MANAGER_PORT``,
            else any free port).
        hostname: group rank 0: the host name to advertise.
        heartbeat_interval: manager -> lighthouse heartbeat period.
        checkpoint_transport: moves state to healing replicas (default
            ``NativeTransport(timeout)``: zero-copy serving, and a healer
            fetches striped across every up-to-date replica; a torchft
            replica heals from it over its HTTP side, unless an auth token
            is set; torchft's default is
            ``HTTPTransport(timeout, num_chunks=0)``).
        init_sync: heal replicas from each other at step 0 too.
        max_retries: consecutive failed commits allowed before
            ``should_commit`` raises (None: no limit).
        quorum_retries: lighthouse quorum retries on failure (a lighthouse
            that answers with an error; one that is unreachable is an
            outage: the quorum is retried for up to
            ``STEPGUARD_LIGHTHOUSE_OUTAGE_SEC`` (default 600 s) while the
            trainer waits, nothing commits, and training goes on from the
            same step when the lighthouse is back; torchft fails at once).
    """

    # The quorum being applied while _reconfigure_pg runs (a class default
    # too, so that a Manager made without __init__, as torchft's tests make
    # one to call _reconfigure_pg alone, takes the handles path).
    _reconfiguring: Optional[QuorumResult] = None

    def __init__(
        self,
        pg: dist.ProcessGroup,
        load_state_dict: Optional[Callable[[T], None]],
        state_dict: Optional[Callable[[], T]],
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta = timedelta(seconds=60),
        quorum_timeout: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=60),
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: Optional[str] = None,
        store_port: Optional[int] = None,
        lighthouse_addr: Optional[str] = None,
        replica_id: Optional[str] = None,
        port: Optional[int] = None,
        hostname: str = socket.gethostname(),
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        checkpoint_transport: Optional[CheckpointTransport[Dict[str, T]]] = None,
        init_sync: bool = True,
        max_retries: Optional[int] = None,
        quorum_retries: int = 0,
    ) -> None:
        if not getattr(pg, "supports_reconfigure", False):
            raise ValueError(
                "the Manager needs a reconfigurable process group (a "
                "stepguard.process_group.ProcessGroup, or a native torch group "
                "created with enable_reconfigure=True)"
            )

        self.quorum_logger: logging.Logger = logging.getLogger("torchft_quorums")
        self.commits_logger: logging.Logger = logging.getLogger("torchft_commits")
        self.errors_logger: logging.Logger = logging.getLogger("torchft_errors")

        self._load_state_dict_fns: Dict[str, Callable[[object], None]] = {}
        self._user_state_dicts: Dict[str, Callable[[], object]] = {}
        self._original_fr_dump_temp_file: Optional[str] = config.get(
            "TORCH_FR_DUMP_TEMP_FILE"
        )
        self._replica_id = replica_id

        # Environment overrides win over arguments (as torchft).  torchft
        # then still hands the raw arguments to the manager server and
        # client, the default transport and the state lock; here the
        # overridden values are used everywhere.
        self._timeout: timedelta = config.get("TORCHFT_TIMEOUT_SEC", timeout)
        self._quorum_timeout: timedelta = config.get(
            "TORCHFT_QUORUM_TIMEOUT_SEC", quorum_timeout
        )
        self._connect_timeout: timedelta = config.get(
            "TORCHFT_CONNECT_TIMEOUT_SEC", connect_timeout
        )
        self._quorum_retries: int = int(
            config.get("TORCHFT_QUORUM_RETRIES", quorum_retries)
        )
        # not an argument: the signature stays torchft's
        self._outage_timeout: timedelta = config.get("STEPGUARD_LIGHTHOUSE_OUTAGE_SEC")

        self._state_dict_lock = RWLock(timeout=self._timeout.total_seconds())
        if load_state_dict and state_dict:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

        self._pending_state_dict: Optional[Dict[str, object]] = None
        self._use_async_quorum = use_async_quorum
        self._replica_world_size_mode = world_size_mode
        self._init_sync = init_sync
        self._max_retries = max_retries
        self._commit_failures = 0

        store_addr = store_addr or _required("MASTER_ADDR")
        store_port = store_port or _required("MASTER_PORT")
        self._group_rank: int = rank if rank is not None else _required("RANK")
        self._group_world_size: int = world_size or _required("WORLD_SIZE")
        self._min_replica_size = min_replica_size

        if checkpoint_transport is None:
            checkpoint_transport = NativeTransport[Dict[str, T]](
                timeout=self._timeout
            )
        self._checkpoint_transport: CheckpointTransport[Dict[str, T]] = (
            checkpoint_transport
        )
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="async_quorum"
        )
        self._quorum_future: Optional[_Quorum] = None

        self._store = TCPStore(
            host_name=store_addr,
            port=store_port,
            is_master=False,
            wait_for_workers=False,
        )
        self._pg = pg
        self._manager: Optional[ManagerServer] = None
        self._recovery_stream: Optional[torch.Stream] = (
            torch.Stream() if _accelerator() else None
        )
        self._recovery_event: Optional[torch.Event] = None

        if self._group_rank == 0:
            if port is None:
                port = config.get("TORCHFT_MANAGER_PORT")
            lighthouse_addr = lighthouse_addr or config.get("TORCHFT_LIGHTHOUSE")
            if not lighthouse_addr:
                raise KeyError(
                    "TORCHFT_LIGHTHOUSE (or STEPGUARD_LIGHTHOUSE) is not set "
                    "and no lighthouse_addr was given"
                )
            # A quickly restarted replica must be a new member of the job.
            suffix = str(uuid.uuid4())
            full_id = suffix if not replica_id else f"{replica_id}:{suffix}"
            self._manager = ManagerServer(
                replica_id=full_id,
                lighthouse_addr=lighthouse_addr,
                hostname=hostname,
                bind=f"[::]:{port}",
                store_addr=f"{store_addr}:{store_port}",
                world_size=self._group_world_size,
                heartbeat_interval=heartbeat_interval,
                connect_timeout=self._connect_timeout,
                quorum_retries=self._quorum_retries,
            )
            self._store.set(MANAGER_ADDR_KEY, self._manager.address())
            self._store.set(REPLICA_ID_KEY, full_id)

        addr = self._store.get(MANAGER_ADDR_KEY).decode("utf-8")
        # Group rank 0 hands its quorum and commit calls to the server it
        # runs; the others reach it over the connection.
        self._client = ManagerClient(
            addr, connect_timeout=self._connect_timeout, server=self._manager
        )
        full_replica_id = self._store.get(REPLICA_ID_KEY).decode("utf-8")
        self._logger = _ManagerLogger(self, full_replica_id, self._group_rank)
        # stepguard: the lighthouse tells the members of a quorum when one of
        # them stops heartbeating; the step's collectives are aborted then,
        # not at the operation timeout.  Group rank 0 hears it from the
        # server it runs, the other group ranks from a long poll to it, on a
        # client of their own that the watcher makes (their liveness is
        # judged on self._client's connection; shutdown aborts this one to
        # end the poll).
        self._lost_stop = threading.Event()
        self._lost_lock = threading.Lock()
        # the quorum whose step runs now (-1 from start_quorum until the new
        # one is applied), under _lost_lock: a lost-member report that comes
        # late must not fail, or abort, the next step
        self._active_quorum_id = -1
        self._lost_addr = addr
        self._lost_client: Optional[ManagerClient] = None
        self._lost_watcher: Optional[threading.Thread] = threading.Thread(
            target=self._watch_lost, name="stepguard-lost", daemon=True
        )

        self._step = 0
        self._quorum_id = -1
        self._errored: Optional[ExceptionWithTraceback] = None
        self._healing = False
        self._batches_committed = 0
        # called first thing in should_commit (weak references: DDP's check
        # that its last backward reduced every bucket)
        self._commit_checks: List["weakref.WeakMethod[Callable[[], None]]"] = []
        self._participating_replica_rank: Optional[int] = None
        self._participating_replica_world_size: int = 0
        # the quorum being joined, while _reconfigure_pg runs
        self._reconfiguring: Optional[QuorumResult] = None
        self._last_quorum: Optional[QuorumResult] = None
        self._is_state_dict_read_allowed = True
        self._warned_quantize = ""  # the last reason warned about
        # When state is read (see the class doc): None until the first
        # start_quorum looks at the registered state; True for a state with
        # DTensors (FSDP2), whose reads then happen on the training thread.
        self._read_state_on_training_thread: Optional[bool] = None
        # the state read in the first start_quorum, for a heal in that step
        self._state_snapshot: Optional[Dict[str, object]] = None
        # a send the quorum asked for, left to should_commit
        self._deferred_send: Optional[tuple] = None
        # should_commit serves a copy this step (kept until the next one)
        self._serving_copy = False
        # set once this step's quorum has configured the process group and
        # decided who participates (the recovery may still be running)
        self._configured = threading.Event()

        self._global_rank: int = (
            self._group_rank
            if self._replica_id is None
            else extract_trailing_digits(self._replica_id) * self._group_world_size
            + self._group_rank
        )
        if hasattr(pg, "set_rank_info"):
            pg.set_rank_info(
                self._replica_id or "0",
                self._group_rank,
                self._group_world_size,
                self._global_rank,
            )
        self._update_fr_path()
        if self._lost_watcher is not None:
            self._lost_watcher.start()

    # -- user state ---------------------------------------------------------

    def allow_state_dict_read(self) -> None:
        """Lets checkpoint sends read the state again (after
        ``disallow_state_dict_read``)."""
        if self._is_state_dict_read_allowed:
            return
        self._is_state_dict_read_allowed = True
        self._state_dict_lock.w_release()

    def disallow_state_dict_read(self) -> None:
        """Blocks checkpoint sends from reading the state (while weights are
        being updated); waits for reads in progress."""
        if not self._is_state_dict_read_allowed:
            return
        self._is_state_dict_read_allowed = False
        self._state_dict_lock.w_acquire()

    def register_state_dict_fn(
        self,
        key: str,
        load_state_dict: Callable[[T], None],
        state_dict: Callable[[], T],
    ) -> None:
        """Registers one component of the state sent to healing replicas.

        Args:
            key: a name unique among the registered components.
            load_state_dict: loads the component received when healing.
            state_dict: returns the component to send.
        """
        assert key not in self._load_state_dict_fns, f"key {key} already registered"
        self._load_state_dict_fns[key] = cast(Callable[[object], None], load_state_dict)
        self._user_state_dicts[key] = state_dict

    def set_state_dict_fns(
        self, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Deprecated: use ``register_state_dict_fn``."""
        self._logger.warn("set_state_dict_fns is deprecated, use register_state_dict_fn")
        self.register_state_dict_fn("set_state_dict_fns", load_state_dict, state_dict)

    def shutdown(self, wait: bool = True) -> None:
        """Stops the transport, the manager server (group rank 0) and the
        quorum thread."""
        self._checkpoint_transport.shutdown(wait=wait)
        lost_stop = getattr(self, "_lost_stop", None)
        if lost_stop is not None:
            with self._lost_lock:
                lost_stop.set()
                if self._lost_client is not None:
                    self._lost_client.abort()  # ends its long poll now
            if self._lost_watcher is not None and self._lost_watcher.is_alive():
                self._lost_watcher.join()
        if self._manager is not None:
            self._manager.shutdown()
        self._executor.shutdown(wait=wait)

    # -- collectives and errors ----------------------------------------------

    @_traced("stepguard::manager::allreduce")
    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: ReduceOp = ReduceOp.AVG,
    ) -> Work:
        """Reduces ``tensor`` in place over the participating replicas.

        Never raises for a communication failure: the step is marked failed
        and the returned work completes with the tensor as it is.  A
        replica that is healing or a spare contributes zeros.  AVG is a sum
        divided by the number of participants (floating point only).

        Args:
            tensor: the tensor to reduce.
            should_quantize: quantize (``stepguard.collectives``): done
                when the process group can (ProcessGroupTCP whose quorum
                agreed on a format); otherwise full precision, with one
                warning naming the reason.
            reduce_op: AVG (default), SUM, MAX, MIN, PRODUCT, ...

        Returns:
            A work whose ``wait()`` returns False if the step failed.

        Raises:
            ValueError: AVG on a non floating point tensor.
        """
        if self.errored():
            return _DummyWork(tensor)

        self._wait_configured()
        num_participants: int = self.num_participants()
        if not self.is_participating():
            tensor.zero_()

        if reduce_op == ReduceOp.AVG:
            if not torch.is_floating_point(tensor):
                raise ValueError(
                    "average reduce op is only supported for floating point tensors"
                )
            pg_reduce_op = ReduceOp.SUM
        else:
            pg_reduce_op = reduce_op

        try:
            fmt = None
            if should_quantize:
                fmt, why = collectives.quantized_format(self._pg)
                if fmt is None and why != self._warned_quantize:
                    self._warned_quantize = why
                    self._logger.warn(f"not quantizing the allreduce: {why}")
            if fmt is not None:
                work = self._pg.allreduce_quantized([tensor], pg_reduce_op, fmt)  # type: ignore[attr-defined]
            else:
                opts = AllreduceOptions()
                opts.reduceOp = pg_reduce_op
                work = self._pg.allreduce([tensor], opts)
            managed = _ManagedWork(self, work, tensor)

            if reduce_op == ReduceOp.AVG:

                def average(fut: _SimpleFuture) -> torch.Tensor:
                    fut.value()
                    if num_participants > 0:
                        _average(tensor, num_participants)
                    return tensor

                managed.get_future().then(average)
            return managed
        except Exception as e:  # noqa: BLE001 - a failed step, not a crash
            self._logger.exception(f"got exception in all reduce -- skipping remaining: {e}")
            self.report_error(e)
            return _DummyWork(tensor)

    def _watch_lost(self) -> None:
        """Aborts the process group's collectives when the lighthouse
        reports a member of the current quorum lost (a hung or cut-off
        replica, or this replica itself once a newer quorum left it out):
        the step fails as for a crash, within the heartbeat timeout, and
        the next quorum goes on without it.  Every group rank does it; a
        report of a quorum this rank has not joined yet is kept, and acted
        on if it joins that quorum.

        The step fails through the process group (its operations fail, and
        ``errored()`` reports the abort to ``should_commit``), not through
        ``report_error``: the report can arrive when this rank has already
        left that quorum's step (its own collective failed first) and waits
        for the next quorum, whose step it must not fail (a rank whose step
        failed skips its collectives, and the others would wait for it).
        The quorum id is checked again just before the abort, so that a
        process group being rebuilt for a newer quorum is left alone."""
        server = self._manager
        poll = timedelta(milliseconds=200 if server is not None else 500)
        seen = 0  # the newest quorum reported lost
        acted = 0  # the last quorum whose collectives were aborted
        failures = 0
        while not self._lost_stop.is_set():
            try:
                if server is not None:
                    qid = server.wait_lost(seen, poll)
                else:
                    qid = self._lost_client_poll(seen, poll)
                failures = 0
            except Exception as e:  # noqa: BLE001 - never fatal to training
                if self._lost_stop.is_set():
                    return
                if "UNIMPLEMENTED" in str(e):
                    self._logger.info("the manager reports no lost members (torchft's)")
                    return
                failures += 1
                if failures == 1:
                    self._logger.warn(f"waiting for lost members failed (retrying): {e}")
                self._lost_stop.wait(1.0)
                continue
            if isinstance(qid, int):
                seen = max(seen, qid)
            # under the lock: start_quorum cannot move on to the next step
            # (and its process group) between the check and the abort
            with self._lost_lock:
                current = self._active_quorum_id
                if seen != current or acted == current:
                    continue
                acted = current
                abort = getattr(self._pg, "abort", None)
                if not getattr(self._pg, "abort_ends_operations", True):
                    # (Gloo) the operation's own deadline fails the step
                    abort = None
                self._logger.warn(
                    f"the lighthouse holds a member of quorum {current} unhealthy"
                    + (": aborting this step's collectives" if abort is not None else "")
                )
                if abort is not None:
                    try:
                        abort()
                    except Exception as e:  # noqa: BLE001 - the step fails anyway
                        self._logger.warn(f"process group abort failed: {e}")

    def _lost_client_poll(self, after: int, poll: timedelta) -> Optional[int]:
        """One long poll to group rank 0's manager (group ranks > 0), on a
        client made on first use (a failed connection raises, and the next
        poll tries again)."""
        client = self._lost_client
        if client is None:
            client = _coordination.ManagerClient(
                self._lost_addr, connect_timeout=self._connect_timeout
            )
            with self._lost_lock:
                self._lost_client = client
                if self._lost_stop.is_set():
                    client.abort()
        return client._wait_lost(after, poll)

    def report_error(self, e: Exception) -> None:
        """Marks this step failed (it will not commit); the process group
        is rebuilt at the next quorum."""
        self._errored = ExceptionWithTraceback(e)

    def errored(self) -> Optional[ExceptionWithTraceback]:
        """The error that failed this step, or None."""
        return self._errored

    def wrap_future(
        self,
        fut: torch.futures.Future[T],
        default: T,
        timeout: Optional[timedelta] = None,
    ) -> torch.futures.Future[T]:
        """Bounds ``fut`` by a deadline and swallows its failure: the
        returned future yields ``default`` and the step is marked failed.

        Args:
            fut: the future to wrap.
            default: the value on failure or timeout.
            timeout: deadline (default: the manager's timeout).
        """
        fut = future_timeout(fut, timeout or self._timeout)
        stream = torch.accelerator.current_stream() if _accelerator() else None

        def callback(f: torch.futures.Future[T]) -> T:
            with _stream_context(stream):
                try:
                    return f.value()
                except Exception as e:  # noqa: BLE001 - swallowed on purpose
                    self._logger.exception(f"got exception in future -- skipping remaining: {e}")
                    self.report_error(e)
                    return default

        return fut.then(callback)

    # -- quorum ---------------------------------------------------------------

    def start_quorum(
        self,
        allow_heal: bool = True,
        shrink_only: bool = False,
        timeout: Optional[timedelta] = None,
    ) -> None:
        """Starts this step's quorum (in the background unless
        ``use_async_quorum=False``).  Prefer ``Optimizer.zero_grad``.

        Args:
            allow_heal: heal replicas that are behind (equal on all
                replicas).
            shrink_only: only accept a quorum without new members.
            timeout: quorum deadline (default ``quorum_timeout``).

        Raises:
            Exception: the previous quorum failed (a quorum failure is
                fatal: restart the process).
        """
        if self._quorum_future is not None:
            self._quorum_future.result()

        with self._lost_lock:
            self._active_quorum_id = -1
            self._errored = None
        self._healing = False
        self._configured = threading.Event()
        if self._read_state_on_training_thread is None and self._user_state_dicts:
            # Once, here on the training thread before the forward pass: a
            # state with DTensors is read only at such points from now on;
            # this first read also serves a heal in this step.
            self._state_snapshot = self._manager_state_dict()
            self._read_state_on_training_thread = _hsdp.SHARDS_KEY in self._state_snapshot

        curr_device = torch.accelerator.current_device_index() if _accelerator() else -1
        self._quorum_future = _Quorum(
            self, allow_heal, shrink_only, timeout or self._quorum_timeout, curr_device
        )
        if not self._use_async_quorum:
            self.wait_quorum()
            if self._healing:
                # Heal now, before the forward pass, and take full part.
                self._apply_pending_state_dict()
                self._healing = False

    def wait_quorum(self) -> None:
        """Waits for the quorum started by ``start_quorum``; raises its
        error."""
        assert self._quorum_future is not None, "must call start_quorum before wait_quorum"
        self._quorum_future.result()

    def _defers_state_reads(self) -> bool:
        """Whether this step's state reads wait for should_commit: a state
        read only on the training thread, and a quorum that runs while that
        thread is in the forward and backward passes."""
        return bool(self._read_state_on_training_thread) and self._use_async_quorum

    def _wait_configured(self) -> None:
        """Waits until this step's quorum has configured the process group
        and decided the participants.  Where state reads are deferred the
        quorum's recovery can only finish in should_commit, after this
        step's collectives: those wait for this much only.  Elsewhere it is
        ``wait_quorum`` (torchft's behaviour)."""
        fut = self._quorum_future
        assert fut is not None, "must call start_quorum before wait_quorum"
        if self._defers_state_reads():
            fut.configured()
        else:
            fut.result()

    def _reconfigure_pg(self, quorum_id: int, handles: List[str]) -> None:
        """Joins the process group of quorum ``quorum_id``: over the handles
        its members exchanged through the lighthouse, or, from a manager that
        does not carry handles, on the quorum's store (one namespace per
        quorum and group rank)."""
        quorum = self._reconfiguring
        if quorum is not None and not (
            len(handles) == quorum.replica_world_size and all(handles)
        ):
            ranks_in_quorum = [
                extract_trailing_digits(rid.split(":")[0]) * self._group_world_size
                + self._group_rank
                for rid in quorum.replica_ids
            ]
            self._pg.configure(  # type: ignore[attr-defined]
                f"{quorum.store_address}/torchft/{quorum_id}/{self._group_rank}",
                self._replica_id or "0",
                quorum.replica_rank,
                quorum.replica_world_size,
                quorum_id,
                self._group_rank,
                self._group_world_size,
                ranks_in_quorum,
            )
            return
        opts = ReconfigureOptions()
        opts.uuid = quorum_id
        opts.handles = handles
        opts.timeout = self._timeout
        self._pg.reconfigure(opts).wait()  # type: ignore[attr-defined]

    def _reconfigure_handle(self) -> str:
        if hasattr(self._pg, "get_reconfigure_handle"):
            try:
                return self._pg.get_reconfigure_handle()
            except Exception as e:  # noqa: BLE001 - fall back to the quorum's store
                # Without our handle no replica gets a full handle list, so
                # every one meets on the quorum's store instead.
                self._logger.exception(f"no reconfigure handle, using the quorum store: {e}")
        return ""

    # what a manager server answers a round with when its lighthouse stayed
    # unreachable until the round's deadline
    _UNREACHABLE = "lighthouse unreachable"

    def _through_outages(
        self, call: Callable[[], QuorumResult], again: Optional[Callable[[], None]] = None
    ) -> QuorumResult:
        """``call()``, made again (after ``again()``, which restarts it) for
        as long as it fails with an unreachable lighthouse, up to the outage
        timeout from the first such failure."""
        deadline: Optional[float] = None
        while True:
            try:
                quorum = call()
            except Exception as e:  # noqa: BLE001 - re-raised unless an outage
                now = time.monotonic()
                if self._UNREACHABLE not in str(e):
                    raise
                if deadline is None:
                    deadline = now + self._outage_timeout.total_seconds()
                    self._logger.warn(
                        f"{e}; retrying the quorum at step {self._step} for up "
                        f"to {self._outage_timeout.total_seconds():.0f} s"
                    )
                if now >= deadline:
                    raise
                # a round shorter than the manager's answer margin fails at
                # once: never ask faster than ten times a second
                time.sleep(0.1)
                if again is not None:
                    again()
                continue
            if deadline is not None:
                self._logger.info(f"lighthouse reachable again: quorum at step {self._step}")
            return quorum

    def _quorum_is_quiet(self, quorum: QuorumResult, allow_heal: bool) -> bool:
        """Whether applying ``quorum`` only records the participation: the
        same quorum as the last step's and nothing to send or fetch."""
        return quorum.quorum_id == self._quorum_id and (
            not allow_heal
            or (
                not quorum.heal
                and not quorum.recover_dst_replica_ranks
                and not self._serves_stripes(quorum)
            )
        )

    def _apply_quorum(self, quorum: QuorumResult, allow_heal: bool, curr_device: int) -> None:
        """Everything a quorum entails after the call: participation,
        reconfiguring the process group, sending and fetching state."""
        configured = self._configured
        try:
            self._apply_quorum_body(quorum, allow_heal, curr_device, configured)
        finally:
            configured.set()
            self._state_snapshot = None

    def _apply_quorum_body(
        self,
        quorum: QuorumResult,
        allow_heal: bool,
        curr_device: int,
        configured: threading.Event,
    ) -> None:
        if curr_device >= 0 and _accelerator():
            torch.accelerator.set_device_index(curr_device)
        self._last_quorum = quorum

        quorum_id = quorum.quorum_id
        replica_rank = quorum.replica_rank
        replica_world_size = quorum.replica_world_size
        max_step = quorum.max_step
        heal = quorum.heal

        # Async: healing replicas are still recovering during this step and
        # do not count.  Sync: recovery is done before the forward pass.
        if self._use_async_quorum or not allow_heal:
            rank, world = quorum.max_replica_rank, quorum.max_world_size
        else:
            rank, world = replica_rank, replica_world_size
        if self._replica_world_size_mode == WorldSizeMode.FIXED_WITH_SPARES:
            world = min(world, self._min_replica_size)
            if rank is not None and rank >= self._min_replica_size:
                rank = None
        self._participating_replica_rank = rank
        self._participating_replica_world_size = world

        if quorum_id != self._quorum_id:
            self.quorum_logger.info(
                "",
                extra={
                    "job_id": config.get("JOB_ID"),
                    "replica_id": self._replica_id,
                    "rank": self._group_rank,
                    "quorum_id": quorum_id,
                    "step": max_step,
                },
            )
            self._logger.info(f"reconfiguring for quorum_id={quorum_id}")
            try:
                self._quorum_id = quorum_id
                if _accelerator():
                    torch.accelerator.synchronize()
                self._reconfiguring = quorum
                try:
                    self._reconfigure_pg(quorum_id, list(quorum.reconfigure_handles))
                finally:
                    self._reconfiguring = None
                self._update_fr_path()
                reset = getattr(torch._C._distributed_c10d, "_reset_fr_recording_nccl", None)
                if reset is not None:
                    reset()
            except Exception as e:  # noqa: BLE001 - a failed step, not a crash
                self._logger.exception(f"got exception in pg configure: {e}")
                self.report_error(e)
                return

        with self._lost_lock:
            self._active_quorum_id = quorum_id
        if self._step < 0 and not (allow_heal and heal):
            # A failed in-place fetch left this replica's state half loaded:
            # it must not train or commit until a later heal succeeds.
            self.report_error(RuntimeError("state lost in a failed recovery; waiting to heal"))
            return

        if heal and allow_heal:
            self._healing = True
        # the step's collectives may start; what follows is recovery
        configured.set()
        # whether the state may be read here (see "When state is read")
        may_read = not self._defers_state_reads()

        if allow_heal:
            with _stream_context(self._recovery_stream):
                try:
                    if quorum.recover_dst_replica_ranks or self._serves_stripes(quorum):
                        self._logger.info(
                            f"peers need recovery from us {quorum.recover_dst_replica_ranks}"
                        )
                        if may_read and self._read_state_on_training_thread:
                            # (sync quorum) from a copy as well: see _serve
                            self._serve(list(quorum.recover_dst_replica_ranks), max_step)
                        elif may_read:
                            _at("serve", self)
                            self._checkpoint_transport.send_checkpoint(
                                dst_ranks=quorum.recover_dst_replica_ranks,
                                step=max_step,
                                state_dict=self._manager_state_dict(),
                                timeout=self._timeout,
                            )
                        else:
                            # served from should_commit, on the training thread
                            self._deferred_send = (
                                list(quorum.recover_dst_replica_ranks),
                                max_step,
                            )
                    if heal:
                        self._fetch(quorum, may_read)
                except Exception as e:  # noqa: BLE001 - a failed step, not a crash
                    self._logger.exception(f"got exception in recovery: {e}")
                    self.report_error(e)
                self._recovery_event = (
                    torch.accelerator.current_stream().record_event()
                    if self._recovery_stream is not None
                    else None
                )

    def _fetch(self, quorum: QuorumResult, may_read: bool) -> None:
        """Fetches the state this replica heals from (kept pending until
        it is loaded on the training thread)."""
        max_step = quorum.max_step
        src = quorum.recover_src_manager_address
        self._logger.info(
            f"healing required, fetching checkpoint metadata from {src} max_step={max_step}"
        )
        metadata = self._peer_checkpoint_metadata(src)
        src_rank = quorum.recover_src_replica_rank
        assert src_rank is not None, "must have a recover rank when healing"
        sources = self._stripe_sources(quorum, src, metadata)
        _at("fetch", self)
        into: Dict[str, object] = {}
        if getattr(self._checkpoint_transport, "fetches_in_place", False):
            # Into this replica's own tensors: until the fetch completes it
            # reports step -1, never a source.  Its state is read here only
            # where it may be (else from the first start_quorum's read).
            own = self._manager_state_dict() if may_read else self._state_snapshot
            if own is not None:
                self._step = -1
                into["into"] = own
        if len(sources) > 1:
            self._logger.info(
                f"fetching checkpoint striped over {len(sources)} replicas: {sources}"
            )
            self._pending_state_dict = (
                self._checkpoint_transport.recv_checkpoint_striped(  # type: ignore[attr-defined]
                    sources, step=max_step, timeout=self._timeout, **into
                )
            )
        else:
            self._logger.info(f"fetching checkpoint from replica {src_rank} with metadata {metadata}")
            self._pending_state_dict = self._checkpoint_transport.recv_checkpoint(
                src_rank=src_rank,
                metadata=metadata,
                step=max_step,
                timeout=self._timeout,
                **into,
            )
        _at("fetched", self)
        self.load_state_dict(cast(Dict[str, int], self._pending_state_dict["torchft"]))
        self._step = max_step

    def _stripes(self) -> bool:
        """Whether the transport fetches from several sources at once."""
        return hasattr(self._checkpoint_transport, "recv_checkpoint_striped")

    def _serves_stripes(self, quorum: QuorumResult) -> bool:
        """An up-to-date replica of a quorum where someone heals serves too,
        not only when it is the assigned source, so that healers can stripe
        their fetch across every up-to-date replica (stepguard; torchft
        serves from the assigned source only)."""
        up_to_date = quorum.up_to_date_manager_addresses
        return (
            self._stripes()
            and not quorum.heal
            and 0 < len(up_to_date) < quorum.replica_world_size
        )

    def _peer_checkpoint_metadata(self, manager_address: str) -> str:
        """This group rank's transport metadata at a peer's manager.  The
        peer was in the quorum just now: one that does not answer within
        the operation timeout has died since, and a refused connection is
        not retried for the whole connect timeout."""
        client = ManagerClient(
            manager_address, connect_timeout=min(self._connect_timeout, self._timeout)
        )
        try:
            return client._checkpoint_metadata(self._group_rank, timeout=self._timeout)
        finally:
            client.close()

    def _stripe_sources(
        self, quorum: QuorumResult, src_address: str, src_metadata: str
    ) -> List[str]:
        """The transport metadata of every up-to-date replica, the assigned
        source first; just the assigned source when the transport cannot
        stripe or a peer does not speak its protocol (a torchft replica).
        A peer whose metadata cannot be had is left out: the assigned
        source alone still heals us."""
        if not self._stripes():
            return [src_metadata]
        scheme = src_metadata.split("://", 1)[0]
        sources = [src_metadata]
        for address in quorum.up_to_date_manager_addresses:
            if address == src_address:
                continue
            try:
                meta = self._peer_checkpoint_metadata(address)
            except Exception as e:  # noqa: BLE001 - striping is an optimisation
                self._logger.warn(f"no checkpoint metadata from {address}: {e}")
                continue
            if meta.split("://", 1)[0] != scheme:
                return [src_metadata]
            sources.append(meta)
        return sources

    def _update_fr_path(self) -> None:
        """Points the flight recorder dump at a per-quorum folder."""
        if self._original_fr_dump_temp_file is not None:
            folder = f"{self._original_fr_dump_temp_file}_quorum_{self._quorum_id}"
            os.makedirs(folder, exist_ok=True)
            os.environ[TORCH_FR_DUMP_TEMP_FILE_ENV] = f"{folder}/{self._global_rank}"

    def _apply_pending_state_dict(self) -> None:
        assert self._healing, "must be in healing state"
        assert self._quorum_future is not None, "must call step before should_commit"
        self._quorum_future.result()
        pending = self._pending_state_dict
        if pending is None:
            assert self.errored(), "checkpoint was not staged and no error occured"
            return
        self._logger.info("applying pending state dict")
        assert len(self._load_state_dict_fns) > 0, "user load_state_dict is not initialized."
        user = cast(Dict[str, object], pending["user"])
        shards = pending.get(_hsdp.SHARDS_KEY)
        if shards:
            # local shards: rebuilt as DTensors on this rank's own mesh (its
            # state is read here, on the training thread after the backward)
            with self._state_dict_lock.r_lock():
                own = {key: fn() for key, fn in self._user_state_dicts.items()}
            try:
                user = cast(
                    Dict[str, object],
                    _hsdp.from_local_shards(user, cast(Dict[str, Any], shards), own),
                )
            except _hsdp.ShardMismatch as e:
                self._pending_state_dict = None
                self._step = -1  # not the step it fetched: heal again
                self._logger.exception(f"cannot load the received state: {e}")
                self.report_error(e)
                return
        for key, load in self._load_state_dict_fns.items():
            load(user[key])
        self._pending_state_dict = None
        _at("loaded", self)
        self._logger.info("Loaded state dict.")

    # -- commit ---------------------------------------------------------------

    @_traced("stepguard::manager::should_commit")
    def _run_commit_checks(self) -> None:
        live = []
        for ref in self._commit_checks:
            check = ref()
            if check is not None:
                check()
                live.append(ref)
        if len(live) != len(self._commit_checks):
            self._commit_checks = live

    def should_commit(self, timeout: Optional[timedelta] = None) -> bool:
        """Votes on this step with every rank of the replica group.

        Call after the backward pass, before the optimizer step; step the
        optimizer only if this returns True.  A healing replica loads the
        received state here (async quorum).

        Args:
            timeout: deadline of the vote (default: the manager's timeout).

        Returns:
            True if every rank of the group is healthy and at least
            ``min_replica_size`` replicas took part.

        Raises:
            RuntimeError: more than ``max_retries`` consecutive failures.
        """
        if self._commit_checks:
            self._run_commit_checks()
        if self._recovery_event is not None:
            self._recovery_event.synchronize()
            self._recovery_event = None
        if _accelerator():
            torch.accelerator.current_stream().synchronize()

        errored_fn = getattr(self._pg, "errored", None)
        if errored_fn is not None:
            err = errored_fn()
            if err is not None:
                self.report_error(err)

        if self._defers_state_reads() and self._quorum_future is not None:
            # the quorum's recovery, which waited for this safe point
            self._quorum_future.result()
            self._send_deferred()

        if self._healing:
            self._apply_pending_state_dict()

        enough_replicas = self.num_participants() >= self._min_replica_size
        local_should_commit = enough_replicas and self._errored is None
        should_commit = self._client.should_commit(
            self._group_rank,
            self._step,
            local_should_commit,
            timeout=timeout or self._timeout,
        )
        # Once a step: build the records only when someone listens.
        if self._logger.enabled(logging.INFO):
            self._logger.info(
                f"should_commit={should_commit} enough_replicas={enough_replicas}, errored={self._errored}"
            )
        if self.commits_logger.isEnabledFor(logging.INFO):
            self.commits_logger.info(
                "",
                extra={
                    "job_id": config.get("JOB_ID"),
                    "replica_id": self._replica_id,
                    "rank": self._group_rank,
                    "quorum_id": self._quorum_id,
                    "step": self._step,
                    "commit_result": should_commit,
                },
            )

        if self._serving_copy:
            self._serving_copy = False  # served until the next should_commit
        else:
            self._checkpoint_transport.disallow_checkpoint()

        if should_commit:
            self._step += 1
            self._batches_committed += self.num_participants()
            self._commit_failures = 0
        else:
            self._commit_failures += 1
            if self._max_retries is not None and self._commit_failures > self._max_retries:
                msg = (
                    f"should_commit failed {self._commit_failures} times consecutively, "
                    f"exceeding max_retries={self._max_retries}"
                )
                self._logger.exception(msg)
                raise RuntimeError(msg)
        return should_commit

    def _send_deferred(self) -> None:
        """Serves the state this step's quorum asked for, read here on the
        training thread (after the backward pass, before the optimizer
        step)."""
        req = self._deferred_send
        self._deferred_send = None
        if req is not None:
            self._serve(*req)

    def _serve(self, dst_ranks: List[int], step: int) -> None:
        """Reads the (sharded) state, where it may be read, and serves it."""
        try:
            _at("serve", self)
            state: Dict[str, object] = self._manager_state_dict()
            if getattr(self._checkpoint_transport, "serves_in_background", False):
                # Served from a copy, until the next should_commit: a
                # healer that has not asked yet still gets this step while
                # our own tensors move on.  By then every healer has it: it
                # loads it in its own should_commit, before its next
                # step's collectives, which ours wait for.
                def copy(leaf: object) -> object:
                    return leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf

                state = tree_map(copy, state)
                self._serving_copy = True
            self._checkpoint_transport.send_checkpoint(
                dst_ranks=dst_ranks, step=step, state_dict=state, timeout=self._timeout
            )
        except Exception as e:  # noqa: BLE001 - a failed step, not a crash
            self._logger.exception(f"got exception in recovery: {e}")
            self.report_error(e)

    # -- manager state ----------------------------------------------------------

    def load_state_dict(self, state_dict: Dict[str, int]) -> None:
        """Restores the manager's own state (``step``,
        ``batches_committed``) from a checkpoint."""
        self._step = state_dict["step"]
        self._batches_committed = state_dict["batches_committed"]

    def _manager_state_dict(self) -> Dict[str, object]:
        """The state sent to a healing replica: the user's (every DTensor
        replaced by its local shard, described under a third key) and the
        manager's own."""
        with self._state_dict_lock.r_lock():
            assert len(self._user_state_dicts) > 0, "user state_dict is not initialized."
            user = {key: fn() for key, fn in self._user_state_dicts.items()}
            local, shards = _hsdp.local_shards(user)
            out: Dict[str, object] = {"user": local, "torchft": self.state_dict()}
            if shards:
                out[_hsdp.SHARDS_KEY] = shards
            return out

    def state_dict(self) -> Dict[str, int]:
        """The manager's own state, to save with periodic checkpoints."""
        return {"step": self._step, "batches_committed": self._batches_committed}

    def current_step(self) -> int:
        """The number of committed steps (the step being computed)."""
        return self._step

    def last_quorum(self) -> Optional[QuorumResult]:
        """The quorum this step runs in (members, ``max_step``, id), as
        this group rank was answered; None before the first.  Waits for the
        quorum.  For logs and checkers (stepguard only)."""
        if self._quorum_future is not None:
            self._wait_configured()
        return self._last_quorum

    def batches_committed(self) -> int:
        """The number of batches committed, summed over participants."""
        return self._batches_committed

    def participating_rank(self) -> Optional[int]:
        """This replica's rank among the participants, None if it does not
        participate (or no quorum was started).  Waits for the quorum."""
        if self._quorum_future is None:
            return None
        self._wait_configured()
        return self._participating_replica_rank

    def num_participants(self) -> int:
        """The number of participating replicas (0 before the first
        quorum).  Waits for the quorum."""
        if self._quorum_future is None:
            return 0
        self._wait_configured()
        assert self._participating_replica_world_size >= 0, "internal error"
        return self._participating_replica_world_size

    def is_participating(self) -> bool:
        """False for a spare or a replica that is healing this step."""
        if self._participating_replica_rank is None:
            return False
        if self._healing:
            assert self._use_async_quorum
            return False
        return True


def _average(tensor: torch.Tensor, n: int) -> None:
    """Divides the floating point ``tensor`` by ``n`` in place.  By a power
    of two it multiplies by the inverse instead: the same bits (both scale
    exactly and round once), and a faster kernel than division."""
    if n & (n - 1) == 0:
        tensor.mul_(1.0 / n)
    else:
        tensor.div_(n)


_heal_hook: Optional[Callable[[str, "Manager"], None]] = None


def set_heal_hook(hook: Optional[Callable[[str, "Manager"], None]]) -> None:
    """For fault-injection tests: ``hook(point, manager)`` is called at
    fixed points of a heal, so a test can kill or stall a process exactly
    there instead of by luck.  Points: ``"serve"`` (a source, before it
    reads its state for a healer), ``"fetch"`` (a healer, after it has the
    source's address, before the transfer), ``"fetched"`` (a healer, the
    transfer done, nothing loaded yet), ``"loaded"`` (a healer, after its
    load functions ran).  None removes it."""
    global _heal_hook
    _heal_hook = hook


def _at(point: str, manager: "Manager") -> None:
    hook = _heal_hook
    if hook is not None:
        hook(point, manager)


class _ManagerLogger:
    """Log lines prefixed ``[replica_id/group_rank - step N]``."""

    def __init__(self, manager: Manager, replica_id: str, group_rank: int) -> None:
        self._logger: logging.Logger = logging.getLogger(__name__)
        self._replica_id = replica_id
        self._group_rank = group_rank
        self._manager = manager

    def enabled(self, level: int) -> bool:
        return self._logger.isEnabledFor(level)

    def prefix(self) -> str:
        return f"[{self._replica_id}/{self._group_rank} - step {self._manager.current_step()}]"

    def info(self, msg: str) -> None:
        self._logger.info(f"{self.prefix()} {msg}")

    def warn(self, msg: str) -> None:
        self._logger.warning(f"{self.prefix()} {msg}")

    def exception(self, msg: str) -> None:
        self._logger.exception(f"{self.prefix()} {msg}")
