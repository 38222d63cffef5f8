"""Reconfigurable process groups for the replica dimension.

A torch process group has a fixed membership.  Fault-tolerant training needs
one whose membership changes at every quorum: the :class:`ProcessGroup`
here is a ``torch.distributed.ProcessGroup`` that is rebuilt in place by
``configure()`` (or by ``reconfigure()``, from the ordered handles the
manager carries through the lighthouse) and can be aborted at any time.

Map of this file:

* :class:`ProcessGroup` - the base class: every collective of c10d's
  ``ProcessGroup``, ``configure``/``reconfigure``, ``abort``/``shutdown``/
  ``errored``, ``register``/``unregister`` for DeviceMesh use.
* :class:`ProcessGroupWrapper` - builds a c10d process group per
  configuration (``_create_pg``) and forwards collectives to it through
  three hooks (``_run_context``, ``_opts_hook``, ``_wrap_work``).
* :class:`ProcessGroupGloo`, :class:`ProcessGroupNCCL`,
  :class:`ProcessGroupXCCL` - the c10d backends (in
  ``process_group_c10d.py``).
* :class:`ProcessGroupDummy` - a world of one, for tests and for DDP's
  initial broadcast.
* :class:`ErrorSwallowingProcessGroupWrapper`,
  :class:`FakeProcessGroupWrapper`, :class:`ManagedProcessGroup` - wrappers.
* ``ProcessGroupBaby*`` - torchft runs these in a child process; here they
  are the in-process groups under torchft's names (see
  :class:`ProcessGroupBaby`, in ``process_group_baby.py``).
* :class:`ProcessGroupTCP` - stepguard's native collectives (in
  ``process_group_tcp.py``).
* :func:`create_store_client`, :func:`reconfigure_with_store`.

The classes that live in the other files are names of this module too,
loaded on first use (those files import this one for their base classes).

Names, signatures and backend names are torchft's, so
``torchft.process_group`` code runs against this module.
"""

from __future__ import annotations

import importlib
import json
import logging
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    Generator,
    List,
    Optional,
    Set,
    Tuple,
    TypeVar,
    Union,
    cast,
)

import torch
import torch.distributed as dist
from torch.distributed import (
    BroadcastOptions,
    PrefixStore,
    ProcessGroup as BaseProcessGroup,
    ReduceOp,
    Store,
    TCPStore,
)
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    ReduceScatterOptions,
    Work,
)
from torch.futures import Future

from stepguard import _C, config
# not used here: torchft's tests patch them on this module, where
# process_group_c10d looks them up
from stepguard.futures import context_timeout, stream_timeout  # noqa: F401
from stepguard.work import _DummyWork

if TYPE_CHECKING:
    from stepguard.manager import Manager

__all__ = [
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ManagedProcessGroup",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupWrapper",
    "ProcessGroupXCCL",
    "ReconfigureOptions",
    "create_store_client",
    "reconfigure_with_store",
    "trigger_nccl_fr_trace_through_pipe",
]

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")

TORCH_NCCL_DEBUG_INFO_PIPE_FILE_ENV_VAR = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
TORCHFT_TRIGGER_FR_ON_ABORT = "TORCHFT_TRIGGER_FR_ON_ABORT"


def trigger_nccl_fr_trace_through_pipe(rank: int) -> bool:
    """Asks NCCL's flight recorder to dump its trace through its debug pipe.

    Returns:
        False when the pipe is not configured
        (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` unset), else True after giving
        the dump 60 s to finish.
    """
    prefix = config.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
    if not prefix:
        logger.info("[rank %d] no NCCL debug pipe configured, no trace dump", rank)
        return False
    with open(f"{prefix}{rank}.pipe", "w") as pipe:
        logger.info("[rank %d] asking NCCL for a flight recorder dump", rank)
        pipe.write("1\n")
        time.sleep(60)
    return True


def _split_store_addr(store_addr: str) -> tuple[str, int, str]:
    """``host:port/prefix`` (host may be ``[v6]`` or a bare v6 address) ->
    (host, port, prefix)."""
    hostport, _, prefix = store_addr.partition("/")
    if hostport.count(":") > 1 and not hostport.startswith("["):
        # a torchft peer writes an IPv6 host without brackets
        h, _, p = hostport.rpartition(":")
        hostport = f"[{h}]:{p}"
    try:
        host, port = _C.split_address(hostport)
    except _C.Error as e:
        raise ValueError(
            f"store address must be host:port/prefix, got {store_addr!r}: {e}"
        ) from None
    return host, port, prefix


def create_store_client(store_addr: str, timeout: timedelta) -> Store:
    """Connects to an existing TCPStore and scopes it to a prefix.

    Args:
        store_addr: ``host:port/prefix``, e.g. ``localhost:1234/my/prefix``.
        timeout: the store's operation timeout.

    Returns:
        ``PrefixStore(prefix, TCPStore(host, port, is_master=False))``.
    """
    host, port, prefix = _split_store_addr(store_addr)
    store = TCPStore(
        host_name=host,
        port=port,
        is_master=False,
        wait_for_workers=False,
        timeout=timeout,
    )
    return PrefixStore(prefix, store)


try:
    from torch._C._distributed_c10d import (  # type: ignore[attr-defined]
        ReconfigureOptions,
    )
except ImportError:

    @dataclass
    class ReconfigureOptions:  # type: ignore[no-redef]
        """What ``ProcessGroup.reconfigure`` needs (torch before 2.14 has
        no native type): a communicator id shared by every member, the
        ordered member handles, and a deadline."""

        uuid: int = 0
        handles: Union[List[str], Set[str]] = field(default_factory=list)
        timeout: Optional[timedelta] = None
        hints: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Rendezvous:
    """Where and as which rank one reconfiguration meets its peers."""

    store_addr: str
    rank: int
    world_size: int
    uuid: int
    global_ranks: Optional[List[int]]


def _rendezvous(opts: ReconfigureOptions, handle_id: str) -> _Rendezvous:
    """Reads ordered reconfigure handles: our rank is the index of our own
    handle, and everyone meets on the first handle's store under a prefix
    named after the communicator id."""
    handles = opts.handles
    if not isinstance(handles, list):
        raise ValueError("reconfigure needs the handles as an ordered list")
    if not handles:
        raise ValueError("reconfigure needs at least one handle")
    peers = []
    for h in handles:
        try:
            peer = json.loads(h)
            peers.append(
                {"id": str(peer["id"]), "store": str(peer["store"]),
                 "global_rank": peer.get("global_rank")}
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"malformed reconfigure handle {h!r}: {e}") from e
    ids = [p["id"] for p in peers]
    if handle_id not in ids:
        raise ValueError(f"this process group's handle {handle_id} is not among {ids}")
    global_ranks = [p["global_rank"] for p in peers]
    return _Rendezvous(
        store_addr=f"{peers[0]['store']}/torchft/{opts.uuid}",
        rank=ids.index(handle_id),
        world_size=len(peers),
        uuid=int(opts.uuid),
        global_ranks=None if None in global_ranks else [int(r) for r in global_ranks],
    )


_RECONFIGURE_TIMEOUT = timedelta(seconds=60)


def reconfigure_with_store(
    pg: BaseProcessGroup,
    store_addr: str,
    rank: int,
    world_size: int,
    timeout: timedelta = _RECONFIGURE_TIMEOUT,
) -> None:
    """Reconfigures ``pg`` without a Manager: the members swap their
    reconfigure handles through a store.

    Args:
        pg: the process group to reconfigure.
        store_addr: ``host:port/prefix``, unique for every call.
        rank: this member's rank in the new group.
        world_size: the size of the new group.
        timeout: bounds the exchange and the reconfiguration.
    """
    store = create_store_client(store_addr, timeout)
    store.set(f"handle/{rank}", pg.get_reconfigure_handle())  # type: ignore[attr-defined]
    if rank == 0:
        store.set("uuid", str(uuid.uuid4().int & ((1 << 63) - 1)))
    keys = ["uuid"] + [f"handle/{r}" for r in range(world_size)]
    store.wait(keys, timeout)
    values = store.multi_get(keys)
    opts = ReconfigureOptions()
    opts.uuid = int(values[0])
    opts.handles = [v.decode("utf-8") for v in values[1:]]
    opts.timeout = timeout
    pg.reconfigure(opts).wait()  # type: ignore[attr-defined]


def _not_implemented(name: str) -> NotImplementedError:
    return NotImplementedError(f"{name} is not implemented by this process group")


class ProcessGroup(BaseProcessGroup):
    """A process group whose membership is set by ``configure()``.

    Subclasses implement ``configure`` (rebuild the group for a new set of
    members, blocking until it is usable) and the collectives.  The manager
    reaches ``configure`` through ``reconfigure()``, which turns the ordered
    handles of the quorum into a store address and a rank.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group_name: Optional[str] = None
        self._reconfigure_id: str = uuid.uuid4().hex
        self._rendezvous_store: Optional[TCPStore] = None
        self._rendezvous_host = ""
        self._handle_lock = threading.Lock()
        self._handle_cache: Optional[Tuple[Tuple[str, str, int, Optional[int]], str]] = None
        self._replica_id: Optional[str] = None
        self._group_rank: Optional[int] = None
        self._group_world_size: Optional[int] = None
        self._global_rank: Optional[int] = None

    # -- collectives (torch.distributed semantics) ---------------------------

    def allgather(  # type: ignore[override]
        self,
        output_tensors: List[List[torch.Tensor]],
        input_tensor: List[torch.Tensor],
        opts: AllgatherOptions,
    ) -> Work:
        """Gathers every member's tensors into ``output_tensors``."""
        raise _not_implemented("allgather")

    def allgather_into_tensor_coalesced(  # type: ignore[override]
        self,
        output_tensors: List[torch.Tensor],
        input_tensors: List[torch.Tensor],
        opts: AllgatherOptions,
    ) -> Work:
        """Gathers each input into the matching flat output tensor."""
        raise _not_implemented("allgather_into_tensor_coalesced")

    def allreduce(  # type: ignore[override]
        self,
        tensors: List[torch.Tensor],
        opts: Union[AllreduceOptions, ReduceOp],
    ) -> Work:
        """Reduces ``tensors`` in place across every member."""
        raise _not_implemented("allreduce")

    def allreduce_coalesced(  # type: ignore[override]
        self,
        tensors: List[torch.Tensor],
        opts: AllreduceCoalescedOptions,
    ) -> Work:
        """Reduces several tensors as one operation."""
        raise _not_implemented("allreduce_coalesced")

    def alltoall_base(  # type: ignore[override]
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: List[int],
        input_split_sizes: List[int],
        opts: AllToAllOptions,
    ) -> Work:
        """Scatters splits of ``input_buffer`` and gathers the peers'."""
        raise _not_implemented("alltoall_base")

    def barrier(self, opts: BarrierOptions) -> Work:  # type: ignore[override]
        """Waits until every member has reached the barrier."""
        raise _not_implemented("barrier")

    def broadcast(  # type: ignore[override]
        self, tensor_list: List[torch.Tensor], opts: BroadcastOptions
    ) -> Work:
        """Copies the root's tensors to every member."""
        raise _not_implemented("broadcast")

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> Work:
        """Broadcasts one tensor from member ``root``."""
        opts = BroadcastOptions()
        opts.rootRank = root
        return self.broadcast([tensor], opts)

    def recv(  # type: ignore[override]
        self, tensors: List[torch.Tensor], src_rank: int, tag: int
    ) -> Work:
        """Receives ``tensors`` from member ``src_rank``."""
        raise _not_implemented("recv")

    def reduce_scatter(  # type: ignore[override]
        self,
        output_tensors: List[torch.Tensor],
        input_tensors: List[List[torch.Tensor]],
        opts: ReduceScatterOptions,
    ) -> Work:
        """Reduces, then gives each member its share."""
        raise _not_implemented("reduce_scatter")

    def reduce_scatter_tensor_coalesced(  # type: ignore[override]
        self,
        output_tensors: List[torch.Tensor],
        input_tensors: List[torch.Tensor],
        opts: ReduceScatterOptions,
    ) -> Work:
        """Reduce-scatter of flat tensors, several as one operation."""
        raise _not_implemented("reduce_scatter_tensor_coalesced")

    def send(  # type: ignore[override]
        self, tensors: List[torch.Tensor], dst_rank: int, tag: int
    ) -> Work:
        """Sends ``tensors`` to member ``dst_rank``."""
        raise _not_implemented("send")

    def size(self) -> int:
        """The number of members in the current configuration."""
        raise _not_implemented("size")

    def getBackendName(self) -> str:
        """The backend name registered with c10d (``torchft-*``)."""
        raise _not_implemented("getBackendName")

    # -- membership -----------------------------------------------------------

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: Optional[int] = None,
        group_rank: Optional[int] = None,
        group_world_size: Optional[int] = None,
        global_ranks: Optional[List[int]] = None,
    ) -> None:
        """Rebuilds the group for a new membership; blocks until it is usable.

        Args:
            store_addr: ``host:port/prefix`` of the rendezvous store; must
                be unique for every call.
            replica_id: the id of this replica group.
            rank: this member's rank in the new group.
            world_size: the number of members.
            quorum_id: the id of the quorum (used in names and logs).
            group_rank: this process's rank inside its replica group.
            group_world_size: the size of the replica group.
            global_ranks: every member's global rank (flight recorder).

        Raises:
            Exception: the group could not be built; it is then unusable
            until the next successful ``configure``.
        """
        raise _not_implemented("configure")

    @property
    def supports_reconfigure(self) -> bool:  # type: ignore[override]
        """True: the manager may call ``reconfigure``."""
        return True

    def set_rank_info(
        self,
        replica_id: str,
        group_rank: int,
        group_world_size: int,
        global_rank: Optional[int] = None,
    ) -> None:
        """Records who this process is; the global rank goes into the
        reconfigure handle."""
        self._replica_id = replica_id
        self._group_rank = group_rank
        self._group_world_size = group_world_size
        self._global_rank = global_rank

    def _handle_id(self) -> str:
        return self._reconfigure_id

    def get_reconfigure_handle(self) -> str:
        """A JSON handle naming this group, a rendezvous store it hosts, and
        its global rank.  The store starts on first use."""
        with self._handle_lock:
            if self._rendezvous_store is None:
                # the name the store was started under is the one to
                # advertise (and asking the system every step costs a call)
                self._rendezvous_host = socket.gethostname()
                self._rendezvous_store = TCPStore(
                    host_name=self._rendezvous_host,
                    port=0,
                    is_master=True,
                    wait_for_workers=False,
                )
            port = self._rendezvous_store.port
            # Asked for at every quorum, on the quorum thread, which holds
            # the GIL the training loop needs: encode it once per identity.
            key = (self._handle_id(), self._rendezvous_host, port, self._global_rank)
            if self._handle_cache is None or self._handle_cache[0] != key:
                handle = json.dumps(
                    {"id": key[0], "store": f"{key[1]}:{key[2]}", "global_rank": key[3]}
                )
                self._handle_cache = (key, handle)
            return self._handle_cache[1]

    def reconfigure(self, opts: ReconfigureOptions) -> Work:
        """Rebuilds the group from the ordered handles in ``opts``: this
        group's rank is the index of its own handle.  Blocks until the new
        group is usable; raises on error.

        Returns:
            A finished work (the group is ready when this returns).
        """
        r = _rendezvous(opts, self._handle_id())
        # The reconfigure's own timeout bounds the set-up (a group whose
        # operations time out in 1 s still gets that long to connect on a
        # loaded host); the operations keep the group's timeout.
        setup = getattr(opts, "timeout", None)
        self._setup_timeout = setup if isinstance(setup, timedelta) else None
        try:
            self.configure(
                r.store_addr,
                self._replica_id or "0",
                r.rank,
                r.world_size,
                quorum_id=r.uuid,
                group_rank=self._group_rank,
                group_world_size=self._group_world_size,
                global_ranks=r.global_ranks,
            )
        finally:
            self._setup_timeout = None
        return _DummyWork(None)

    # -- registration with c10d -------------------------------------------------

    def _register(self, name: str) -> str:
        group_name = f"{self.getBackendName()}:{name}"

        def create_pg(
            prefix_store: PrefixStore, rank: int, world_size: int, timeout: float
        ) -> ProcessGroup:
            return self

        devices = ["cpu"]
        if torch.cuda.is_available():
            devices.append("cuda")
        elif torch.xpu.is_available():
            devices.append("xpu")
        dist.Backend.register_backend(group_name, create_pg, devices=devices)
        return group_name

    def register(self, name: str) -> "ProcessGroup":
        """Registers this group with c10d as a world-size-1 group, so
        DeviceMesh and functional collectives can use it.  Needs an
        initialized default process group; call once per name.

        Args:
            name: a name unique in this process.
        """
        group_name = self._register(name)
        return cast(
            ProcessGroup,
            dist.new_group(
                ranks=[dist.get_rank()],
                backend=group_name,
                group_desc=group_name,
                timeout=timedelta(seconds=60.0),
            ),
        )

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """The name set at registration (ValueError before that)."""
        if self._group_name is None:
            raise ValueError("ProcessGroup name not set")
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def unregister(self) -> None:
        """Removes the registration made by ``register``."""
        dist.destroy_process_group(self)

    # -- lifecycle ------------------------------------------------------------

    #: whether ``abort`` ends operations in flight, from another thread
    #: (what the Manager's lost-member watcher needs)
    abort_ends_operations = True

    def abort(self) -> None:
        """Fails every operation in progress; ``configure`` makes the group
        usable again."""

    def shutdown(self) -> None:
        """Releases the group's resources."""

    def errored(self) -> Optional[Exception]:
        """An asynchronous error that requires reconfiguring, or None."""
        return None

    def set_timeout(self, timeout: timedelta) -> None:  # type: ignore[override]
        """Sets the default deadline of operations."""
        raise _not_implemented("set_timeout")

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"


class ProcessGroupWrapper(ProcessGroup):
    """Builds a c10d process group for each configuration, or forwards to
    a wrapped stepguard :class:`ProcessGroup`.

    Args:
        timeout: deadline of the rendezvous store and of the group's
            operations.
        pg: a process group to wrap; None builds one with ``_create_pg``.
    """

    def __init__(
        self,
        timeout: timedelta = timedelta(seconds=60),
        pg: Optional[BaseProcessGroup] = None,
    ) -> None:
        super().__init__(0, 1)
        self._pg: Optional[BaseProcessGroup] = pg
        self._timeout = timeout
        self._rank: Optional[int] = None
        self._uuid: Optional[int] = None
        self._quorum_id: Optional[int] = None
        self._world_size: Optional[int] = None
        self._global_ranks: Optional[List[int]] = None
        # the deadline of the group's set-up while a reconfigure runs (its
        # options' timeout), when longer than the operations' own
        self._setup_timeout: Optional[timedelta] = None
        self.errors_logger: logging.Logger = logging.getLogger("torchft_errors")

    # True where _run_context, _opts_hook and _wrap_work are this class's
    # no-ops, so an operation can go straight to the wrapped group (set for
    # each subclass by __init_subclass__).
    _plain_hooks = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._plain_hooks = all(
            getattr(cls, name) is getattr(ProcessGroupWrapper, name)
            for name in ("_run_context", "_opts_hook", "_wrap_work")
        )

    def getBackendName(self) -> str:
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            return pg.getBackendName()
        raise _not_implemented("getBackendName")

    def set_rank_info(
        self,
        replica_id: str,
        group_rank: int,
        group_world_size: int,
        global_rank: Optional[int] = None,
    ) -> None:
        super().set_rank_info(replica_id, group_rank, group_world_size, global_rank)
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            pg.set_rank_info(replica_id, group_rank, group_world_size, global_rank)

    def _handle_id(self) -> str:
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            return pg._handle_id()
        return super()._handle_id()

    def get_reconfigure_handle(self) -> str:
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            return pg.get_reconfigure_handle()
        return super().get_reconfigure_handle()

    def reconfigure(self, opts: ReconfigureOptions) -> Work:
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            r = _rendezvous(opts, self._handle_id())
            self._record(r.rank, r.world_size, r.uuid, r.global_ranks)
            return pg.reconfigure(opts)
        return super().reconfigure(opts)

    def _record(
        self,
        rank: int,
        world_size: int,
        quorum_id: Optional[int],
        global_ranks: Optional[List[int]],
    ) -> None:
        self._rank = rank
        self._world_size = world_size
        self._uuid = quorum_id
        self._quorum_id = quorum_id
        self._global_ranks = global_ranks

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: Optional[int] = None,
        group_rank: Optional[int] = None,
        group_world_size: Optional[int] = None,
        global_ranks: Optional[List[int]] = None,
    ) -> None:
        self._replica_id = replica_id
        if group_rank is not None:
            self._group_rank = group_rank
        if group_world_size is not None:
            self._group_world_size = group_world_size
        self._record(rank, world_size, quorum_id, global_ranks)
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            pg.configure(
                store_addr,
                replica_id,
                rank,
                world_size,
                quorum_id,
                group_rank,
                group_world_size,
                global_ranks,
            )
            return
        self._rebuild(store_addr, rank, world_size)

    def _rebuild(self, store_addr: str, rank: int, world_size: int) -> None:
        """Drops the current c10d group and builds the next one, meeting the
        peers on the store at ``store_addr``."""
        self.abort(errored=False)
        store = create_store_client(store_addr, timeout=self._timeout)
        self._pg = self._create_pg(store, rank, world_size)

    def abort(self, errored: bool = True) -> None:
        """Aborts the current c10d group (if any) and drops it.

        Args:
            errored: log a ``process_group_abort`` record to
                ``torchft_errors`` (an abort caused by a failure).
        """
        if errored:
            self.errors_logger.info(
                "",
                extra={
                    "job_id": config.get("JOB_ID"),
                    "replica_id": self._replica_id,
                    "rank": self._rank,
                    "quorum_id": self._quorum_id,
                    "error": "process_group_abort",
                },
            )
        pg = self._pg
        if pg is None:
            return
        self._pg = None
        _abort_c10d(pg)

    def shutdown(self) -> None:
        # torchft only drops the group here (its TODO: abort it); we abort
        # it, so no collective of a group being shut down can hang.
        pg = self._pg
        self._pg = None
        if pg is not None:
            _abort_c10d(pg)

    def _create_pg(self, store: Store, rank: int, world_size: int) -> BaseProcessGroup:
        """Builds the c10d group for one configuration."""
        raise _not_implemented("_create_pg")

    def _wrap_work(self, work: Work, opts: object) -> Work:
        return work

    def _opts_hook(self, opts: T) -> T:
        return opts

    @contextmanager
    def _run_context(self) -> Generator[None, None, None]:
        yield

    def set_timeout(self, timeout: timedelta) -> None:  # type: ignore[override]
        self._timeout = timeout

    def allgather(  # type: ignore[override]
        self,
        output_tensors: List[List[torch.Tensor]],
        input_tensor: List[torch.Tensor],
        opts: AllgatherOptions,
    ) -> Work:
        with self._run_context():
            return self._wrap_work(
                self.parent.allgather(output_tensors, input_tensor, self._opts_hook(opts)),
                opts,
            )

    def allgather_into_tensor_coalesced(  # type: ignore[override]
        self,
        output_tensors: List[torch.Tensor],
        input_tensors: List[torch.Tensor],
        opts: AllgatherOptions,
    ) -> Work:
        with self._run_context():
            return self._wrap_work(
                self.parent.allgather_into_tensor_coalesced(
                    output_tensors, input_tensors, self._opts_hook(opts)
                ),
                opts,
            )

    def allreduce(self, tensors: List[torch.Tensor], opts: object) -> Work:  # type: ignore[override]
        pg = self._pg
        if self._plain_hooks and pg is not None:
            # The hot path (every gradient bucket): with the base class's
            # no-op hooks there is nothing to wrap, so one call.
            return pg.allreduce(tensors, opts)  # type: ignore[arg-type]
        with self._run_context():
            return self._wrap_work(
                self.parent.allreduce(tensors, self._opts_hook(opts)), opts  # type: ignore[arg-type]
            )

    def allreduce_coalesced(  # type: ignore[override]
        self, tensors: List[torch.Tensor], opts: Union[AllreduceOptions, ReduceOp]
    ) -> Work:
        with self._run_context():
            return self._wrap_work(
                self.parent.allreduce_coalesced(tensors, self._opts_hook(opts)),  # type: ignore[arg-type]
                opts,
            )

    def alltoall_base(  # type: ignore[override]
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: List[int],
        input_split_sizes: List[int],
        opts: AllToAllOptions,
    ) -> Work:
        with self._run_context():
            return self._wrap_work(
                self.parent.alltoall_base(
                    output_buffer,
                    input_buffer,
                    output_split_sizes,
                    input_split_sizes,
                    self._opts_hook(opts),
                ),
                opts,
            )

    def barrier(self, opts: Optional[BarrierOptions] = None) -> Work:  # type: ignore[override]
        with self._run_context():
            opts = opts if opts is not None else BarrierOptions()
            return self._wrap_work(self.parent.barrier(self._opts_hook(opts)), opts)

    def broadcast(self, tensor_list: List[torch.Tensor], opts: object) -> Work:  # type: ignore[override]
        with self._run_context():
            return self._wrap_work(
                self.parent.broadcast(tensor_list, self._opts_hook(opts)), opts  # type: ignore[arg-type]
            )

    def recv(self, tensors: List[torch.Tensor], src_rank: int, tag: int) -> Work:  # type: ignore[override]
        with self._run_context():
            return self._wrap_work(self.parent.recv(tensors, src_rank, tag), None)

    def reduce_scatter(  # type: ignore[override]
        self,
        output_tensors: List[torch.Tensor],
        input_tensors: List[List[torch.Tensor]],
        opts: object,
    ) -> Work:
        with self._run_context():
            return self._wrap_work(
                self.parent.reduce_scatter(
                    output_tensors, input_tensors, self._opts_hook(opts)  # type: ignore[arg-type]
                ),
                opts,
            )

    def reduce_scatter_tensor_coalesced(  # type: ignore[override]
        self,
        output_tensors: List[torch.Tensor],
        input_tensors: List[torch.Tensor],
        opts: ReduceScatterOptions,
    ) -> Work:
        with self._run_context():
            return self._wrap_work(
                self.parent.reduce_scatter_tensor_coalesced(
                    output_tensors, input_tensors, self._opts_hook(opts)
                ),
                opts,
            )

    def send(self, tensors: List[torch.Tensor], dst_rank: int, tag: int) -> Work:  # type: ignore[override]
        with self._run_context():
            return self._wrap_work(self.parent.send(tensors, dst_rank, tag), None)

    def size(self) -> int:
        return self.parent.size()

    @property
    def parent(self) -> BaseProcessGroup:
        """The current underlying group (AssertionError before configure)."""
        assert self._pg is not None, "process group not initialized"
        return self._pg

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(pg={self._pg})"


def _abort_c10d(pg: BaseProcessGroup) -> None:
    """Aborts a group, whatever kind it is; a backend without abort is
    just dropped."""
    try:
        if isinstance(pg, ProcessGroup):
            pg.abort()
            return
        if torch.cuda.is_available():
            device: Optional[torch.device] = torch.device("cuda")
        elif torch.xpu.is_available():
            device = torch.device("xpu")
        else:
            device = None
        if device is not None:
            try:
                backend = pg._get_backend(device)
            except RuntimeError:
                backend = None
            if backend is not None and hasattr(backend, "abort"):
                backend.abort()
    except Exception as e:  # noqa: BLE001 - the group is being discarded
        logger.warning("aborting %r failed: %s", pg, e)


class ProcessGroupDummy(ProcessGroup):
    """A process group of one member: every operation finishes at once.

    Gathers and all-to-alls copy the input to the output; reductions and
    broadcasts leave the tensors as they are.  Counts for tests:
    ``configure_count`` (``configure`` and ``reconfigure`` calls),
    ``reconfigure_count`` (``reconfigure`` calls only, as torchft counts),
    ``wait_count`` and ``get_future_count``.
    """

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        assert rank == 0, "ProcessGroupDummy has one member: rank must be 0"
        assert world == 1, "ProcessGroupDummy has one member: world must be 1"
        self._rank = rank
        self._world = world
        self.wait_count = 0
        self.get_future_count = 0
        self.configure_count = 0
        self.reconfigure_count = 0

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: Optional[int] = None,
        group_rank: Optional[int] = None,
        group_world_size: Optional[int] = None,
        global_ranks: Optional[List[int]] = None,
    ) -> None:
        self.configure_count += 1

    def reconfigure(self, opts: ReconfigureOptions) -> Work:
        self.configure_count += 1
        self.reconfigure_count += 1
        return _DummyWork(None)

    def _done(self, result: object) -> Work:
        # Not kept: DDP's reducer calls this group every step when it
        # searches for unused parameters.
        return _DummyWork(result)

    def allgather(self, output_tensors, input_tensor, opts) -> Work:  # type: ignore[no-untyped-def, override]
        for outs in output_tensors:
            for o, i in zip(outs, input_tensor):
                o.copy_(i)
        return self._done(output_tensors)

    def allgather_into_tensor_coalesced(self, output_tensors, input_tensors, opts) -> Work:  # type: ignore[no-untyped-def, override]
        for o, i in zip(output_tensors, input_tensors):
            o.copy_(i)
        return self._done(output_tensors)

    def allreduce(self, tensors, opts) -> Work:  # type: ignore[no-untyped-def, override]
        return self._done(tensors)

    def allreduce_coalesced(self, tensors, opts) -> Work:  # type: ignore[no-untyped-def, override]
        return self._done(tensors)

    def alltoall_base(self, output_buffer, input_buffer, output_split_sizes,  # type: ignore[no-untyped-def, override]
                      input_split_sizes, opts) -> Work:
        output_buffer.copy_(input_buffer)
        return self._done([output_buffer])

    def barrier(self, opts=None) -> Work:  # type: ignore[no-untyped-def, override]
        return self._done(None)

    def broadcast(self, tensor_list, opts) -> Work:  # type: ignore[no-untyped-def, override]
        return self._done(tensor_list)

    def recv(self, tensors, src_rank, tag) -> Work:  # type: ignore[no-untyped-def, override]
        return self._done(tensors)

    def reduce_scatter(self, output_tensors, input_tensors, opts) -> Work:  # type: ignore[no-untyped-def, override]
        for o, ins in zip(output_tensors, input_tensors):
            o.copy_(ins[0])
        return self._done(output_tensors)

    def reduce_scatter_tensor_coalesced(self, output_tensors, input_tensors, opts) -> Work:  # type: ignore[no-untyped-def, override]
        for o, i in zip(output_tensors, input_tensors):
            o.copy_(i)
        return self._done(output_tensors)

    def send(self, tensors, dst_rank, tag) -> Work:  # type: ignore[no-untyped-def, override]
        return self._done(tensors)

    def size(self) -> int:
        return self._world

    def getBackendName(self) -> str:
        return "torchft-dummy"

    def set_timeout(self, timeout: timedelta) -> None:  # type: ignore[override]
        pass


class _ErrorSwallowingWork(Work):
    """A work whose failure is reported to its group instead of raised;
    its future then yields ``default``."""

    def __init__(
        self, pg: "ErrorSwallowingProcessGroupWrapper", work: Work, default: object
    ) -> None:
        super().__init__()
        self._pg = pg
        self._work = work
        self._default = default

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        try:
            self._work.wait()
        except Exception as e:  # noqa: BLE001 - swallowed on purpose
            self._pg.report_error(e)
        return True

    def get_future(self) -> Future[object]:
        fut = self._work.get_future()

        def callback(f: Future[object]) -> object:
            try:
                return f.value()
            except Exception as e:  # noqa: BLE001 - swallowed on purpose
                self._pg.report_error(e)
                return self._default

        return fut.then(callback)


class ErrorSwallowingProcessGroupWrapper(ProcessGroupWrapper):
    """Turns ``allreduce`` failures into a recorded error: once one has
    happened, allreduces are skipped until the next ``configure``.

    Args:
        pg: the process group to wrap.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg=pg)
        self._error: Optional[Exception] = None

    def configure(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self._error = None
        super().configure(*args, **kwargs)

    def reconfigure(self, opts: ReconfigureOptions) -> Work:
        self._error = None
        return super().reconfigure(opts)

    def report_error(self, e: Exception) -> None:
        """Records ``e``; later allreduces are skipped until reconfigured."""
        self._error = e

    def error(self) -> Optional[Exception]:
        """The recorded error, or None."""
        return self._error

    def allreduce(self, tensors: List[torch.Tensor], opts: object) -> Work:  # type: ignore[override]
        if self._error is not None:
            return _DummyWork(tensors)
        try:
            return _ErrorSwallowingWork(self, super().allreduce(tensors, opts), tensors)
        except Exception as e:  # noqa: BLE001 - swallowed on purpose
            self.report_error(e)
            return _DummyWork(tensors)


class FakeProcessGroupWrapper(ProcessGroupWrapper):
    """A test helper: ``report_future_error(e)`` makes the future of the
    next allreduce fail with ``e``.

    Args:
        pg: the process group to wrap.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg=pg)
        self._future_error: Optional[Exception] = None

    def configure(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self._future_error = None
        super().configure(*args, **kwargs)

    def reconfigure(self, opts: ReconfigureOptions) -> Work:
        self._future_error = None
        return super().reconfigure(opts)

    def report_future_error(self, e: Exception) -> None:
        """The next allreduce's future will fail with ``e`` (once)."""
        self._future_error = e

    def allreduce(self, tensors: List[torch.Tensor], opts: object) -> Work:  # type: ignore[override]
        work = super().allreduce(tensors, opts)
        err = self._future_error
        if err is None:
            return work
        self._future_error = None
        fut = work.get_future()

        def fail(f: Future[object]) -> object:
            raise err

        fut = fut.then(fail)
        return _FutureWork(work, fut)


class _FutureWork(Work):
    """A work whose future is replaced (the wrapped work is still waited)."""

    def __init__(self, work: Work, fut: Future[object]) -> None:
        super().__init__()
        self._work = work
        self._fut = fut

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        self._work.wait()
        self._fut.wait()
        return True

    def get_future(self) -> Future[object]:
        return self._fut


class ManagedProcessGroup(ProcessGroupWrapper):
    """The manager's process group as a plain process group: ``allreduce``
    goes through ``manager.allreduce`` (fault tolerant, averaged over the
    participants) and ``size()`` is the number of participants.  For
    DeviceMesh/FSDP integration.

    Args:
        manager: the stepguard Manager.
    """

    def __init__(self, manager: "Manager") -> None:
        super().__init__(pg=manager._pg)
        self._manager = manager

    def allreduce(self, tensors: List[torch.Tensor], opts: object) -> Work:  # type: ignore[override]
        assert len(tensors) == 1, "ManagedProcessGroup.allreduce takes one tensor"
        if isinstance(opts, ReduceOp):
            return self._manager.allreduce(tensors[0], reduce_op=opts)
        if isinstance(opts, AllreduceOptions):
            return self._manager.allreduce(tensors[0], reduce_op=opts.reduceOp)
        raise AssertionError(f"unsupported allreduce options {opts!r}")

    def size(self) -> int:
        return self._manager.num_participants()

    def getBackendName(self) -> str:
        return self._manager._pg.getBackendName()


# Defined in the modules split off this one, which import it for their base
# classes: loaded on first use, so that any of them may be imported first.
_ELSEWHERE = {
    name: "stepguard.process_group_c10d"
    for name in (
        "ProcessGroupGloo",
        "ProcessGroupNCCL",
        "ProcessGroupXCCL",
        "_AcceleratorProcessGroup",
        "_WorkAcceleratorTimeout",
        "_group_name",
    )
}
_ELSEWHERE.update(
    {
        name: "stepguard.process_group_baby"
        for name in (
            "ProcessGroupBaby",
            "ProcessGroupBabyGloo",
            "ProcessGroupBabyNCCL",
            "ProcessGroupBabyXCCL",
            "_Generation",
        )
    }
)
_ELSEWHERE["ProcessGroupTCP"] = "stepguard.process_group_tcp"
__all__.append("ProcessGroupTCP")


def __getattr__(name: str) -> Any:
    module = _ELSEWHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_ELSEWHERE))


if TYPE_CHECKING:
    from stepguard.process_group_baby import (
        ProcessGroupBaby,
        ProcessGroupBabyGloo,
        ProcessGroupBabyNCCL,
        ProcessGroupBabyXCCL,
    )
    from stepguard.process_group_c10d import (
        ProcessGroupGloo,
        ProcessGroupNCCL,
        ProcessGroupXCCL,
    )
    from stepguard.process_group_tcp import ProcessGroupTCP
