"""Coordination (low-level API): lighthouse and manager servers and clients.

The same names, signatures and defaults as ``torchft.coordination``, over
stepguard's C lighthouse and manager.  Deadlines raise
:class:`TimeoutError`; every other failure raises :class:`RuntimeError`
(:class:`stepguard.Error`).  Blocking calls release the GIL, and Ctrl-C
stops them (the client is aborted then; make a new one).

stepguard additions, all keyword-only: ``auth_token`` (default: the
``STEPGUARD_AUTH_TOKEN`` environment variable); on the lighthouse server
``disconnect_grace_ms``, ``prune_after_ms``, ``quorum_id_file``,
``hostname``, ``max_replicas`` and ``max_connections``; on the manager
server ``disconnect_grace_ms`` and ``kill_handler``; on the manager client
``server`` (in-process calls to this process's manager),
``_quorum_start``/``_quorum_wait`` (a quorum started without a thread) and
``_wait_lost`` (a long poll for a lost member of the quorum).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Hashable, Optional

from stepguard import _C, config

__all__ = [
    "LighthouseClient",
    "LighthouseServer",
    "ManagerClient",
    "ManagerServer",
    "Quorum",
    "QuorumMember",
    "QuorumResult",
    "Timestamp",
    "lighthouse_main",
]


@dataclass
class Timestamp:
    """Wall-clock time at which a quorum was created."""

    seconds: int
    nanos: int


@dataclass
class QuorumMember:
    """One replica group in a quorum.

    Args:
        replica_id: the replica group's id.
        address: ``http://host:port`` of the group's manager.
        store_address: ``host:port`` of the group's TCPStore.
        step: the group's step when it asked to join.
        world_size: number of group ranks.
        shrink_only: the group asked for a quorum that only drops replicas.
        data: the JSON-decodable data the group sent with its request.
        commit_failures: the group's count of consecutive failed commits.
    """

    replica_id: str
    address: str
    store_address: str
    step: int
    world_size: int
    shrink_only: bool
    data: dict[Hashable, object] | None = None
    commit_failures: int = 0


@dataclass
class Quorum:
    """A quorum as issued by the lighthouse.

    Args:
        quorum_id: the quorum's id; it increases when the members change
            or one of them reports failed commits.
        participants: the members, ordered by ``replica_id``.
        created: when the lighthouse formed the quorum.
    """

    quorum_id: int
    participants: list[QuorumMember] = field(default_factory=list)
    created: Timestamp = field(default_factory=lambda: Timestamp(0, 0))


class LighthouseServer:
    """Runs the C lighthouse on a thread of this process.

    Args:
        bind: address to bind, e.g. ``"[::]:29510"`` or ``"127.0.0.1:0"``.
        min_replicas: minimum number of replica groups in a quorum.
        join_timeout_ms: wait this long for heartbeating stragglers
            (default 100, like torchft's Python binding).
        quorum_tick_ms: periodic re-check (default 100); decisions are also
            taken on every request, heartbeat and disconnect.
        heartbeat_timeout_ms: silence after which a replica is dead
            (default 5000).
        state_loss_wait_ms: a quorum whose members are all behind the step
            the job reached waits for a replica that holds it, this long
            after one was last heard (default 60000); -1 until one is back,
            0 not at all (torchft's behaviour) (docs/lighthouse.md, "The
            step floor").
    """

    def __init__(
        self,
        bind: str,
        min_replicas: int,
        join_timeout_ms: int | None = None,
        quorum_tick_ms: int | None = None,
        heartbeat_timeout_ms: int | None = None,
        *,
        disconnect_grace_ms: int | None = None,
        prune_after_ms: int | None = None,
        auth_token: str | None = None,
        quorum_id_file: str | None = None,
        hostname: str | None = None,
        max_replicas: int | None = None,
        max_connections: int | None = None,
        state_loss_wait_ms: int | None = None,
    ) -> None:
        kw: dict[str, object] = {
            "join_timeout_ms": 100 if join_timeout_ms is None else join_timeout_ms,
            "quorum_tick_ms": 100 if quorum_tick_ms is None else quorum_tick_ms,
            "heartbeat_timeout_ms": (
                5000 if heartbeat_timeout_ms is None else heartbeat_timeout_ms
            ),
        }
        for name, value in (
            ("disconnect_grace_ms", disconnect_grace_ms),
            ("prune_after_ms", prune_after_ms),
            ("max_replicas", max_replicas),
            ("max_connections", max_connections),
            ("state_loss_wait_ms", state_loss_wait_ms),
        ):
            if value is not None:
                kw[name] = value
        self._server = _C.LighthouseServer(
            bind,
            min_replicas,
            auth_token=config.auth_token(auth_token),
            quorum_id_file=quorum_id_file,
            hostname=hostname,
            **kw,
        )

    def address(self) -> str:
        """Returns ``http://{hostname}:{port}``."""
        return self._server.address()

    def port(self) -> int:
        """Returns the bound port."""
        return self._server.port()

    def shutdown(self) -> None:
        """Stops the server; waiting calls fail with UNAVAILABLE."""
        self._server.shutdown()

    def __enter__(self) -> LighthouseServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class LighthouseClient:
    """A client of a lighthouse (stepguard's or torchft's).

    Args:
        addr: ``http://host:port`` of the lighthouse, or several
            comma-separated (replicated lighthouses: a call that finds a
            follower or a dead one is made again on the next within its
            deadline).
        connect_timeout: how long construction may try to connect.
    """

    def __init__(
        self,
        addr: str,
        connect_timeout: timedelta,
        *,
        auth_token: str | None = None,
    ) -> None:
        self.addr = addr
        self.connect_timeout = connect_timeout
        self._client = _C.LighthouseClient(
            addr, config.seconds(connect_timeout), config.auth_token(auth_token)
        )

    def quorum(
        self,
        replica_id: str,
        timeout: timedelta,
        address: str | None = None,
        store_address: str | None = None,
        step: int | None = None,
        world_size: int | None = None,
        shrink_only: bool | None = None,
        data: dict[Hashable, object] | None = None,
        *,
        commit_failures: int = 0,
    ) -> Quorum:
        """Requests to join the next quorum and waits for it.

        Returns:
            The quorum, with ``data`` of every member decoded from JSON.
        Raises:
            TimeoutError: no quorum within ``timeout``.
            RuntimeError: any other failure.
        """
        quorum_id, secs, nanos, members = self._client.quorum(
            replica_id,
            config.seconds(timeout),
            address or "",
            store_address or "",
            step or 0,
            world_size or 0,
            bool(shrink_only),
            json.dumps(data) if data is not None else "",
            commit_failures,
        )
        return Quorum(
            quorum_id=quorum_id,
            participants=[
                QuorumMember(
                    replica_id=m[0],
                    address=m[1],
                    store_address=m[2],
                    step=m[3],
                    world_size=m[4],
                    shrink_only=m[5],
                    data=json.loads(m[6]) if m[6] else None,
                    commit_failures=m[7],
                )
                for m in members
            ],
            created=Timestamp(secs, nanos),
        )

    def heartbeat(
        self, replica_id: str, timeout: timedelta = timedelta(seconds=5)
    ) -> None:
        """Sends one heartbeat for ``replica_id``."""
        self._client.heartbeat(replica_id, config.seconds(timeout))

    def close(self) -> None:
        """Closes the connection (the lighthouse sees it close)."""
        self._client.close()


@dataclass
class QuorumResult:
    """What one group rank learns from a manager quorum.

    ``replica_rank``/``replica_world_size`` count every replica in the
    quorum; the ``max_*`` fields describe the replicas at the highest step.
    ``heal`` is set when this replica must fetch state from
    ``recover_src_manager_address`` (replica ``recover_src_replica_rank``);
    ``recover_dst_replica_ranks`` are the replicas this one sends to.
    ``up_to_date_manager_addresses`` (stepguard; empty from a torchft
    manager) lists the managers of every up-to-date replica, so a healer
    can fetch from all of them.
    """

    quorum_id: int = 0
    replica_rank: int = 0
    replica_world_size: int = 1
    recover_src_manager_address: str = ""
    recover_src_replica_rank: int | None = None
    recover_dst_replica_ranks: list[int] = field(default_factory=list)
    store_address: str = ""
    max_step: int = 0
    max_replica_rank: int | None = None
    max_world_size: int = 1
    heal: bool = False
    commit_failures: int = 0
    replica_ids: list[str] = field(default_factory=list)
    reconfigure_handles: list[str] = field(default_factory=list)
    up_to_date_manager_addresses: list[str] = field(default_factory=list)


_log = logging.getLogger("stepguard.manager")


def _exit_on_kill(msg: str) -> None:
    """The default Kill handler: log, flush, and end the process now."""
    _log.error("got kill request: %s", msg)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(1)


class ManagerServer:
    """Runs the C manager of one replica group on threads of this process.

    Start it in group rank 0.  It joins every group rank's ``_quorum`` into
    one lighthouse quorum for the group, ANDs ``should_commit`` votes, and
    heartbeats to the lighthouse.  If a group rank's connections all close
    and it stays silent for ``disconnect_grace_ms`` (default 250), the
    group leaves the job at once; the whole group must then restart.

    Args:
        replica_id: this replica group's id (unique per incarnation).
        lighthouse_addr: ``http://host:port`` of the lighthouse, or several
            comma-separated (replicated lighthouses).
        hostname: host name to advertise; ``STEPGUARD_ADVERTISE_HOST`` (a
            host or a network interface name) overrides it.
        bind: address to bind, e.g. ``"[::]:0"``.
        store_addr: ``host:port`` of the group's TCPStore.
        world_size: number of group ranks.
        heartbeat_interval: time between heartbeats.
        connect_timeout: bounds the lighthouse connection at construction.
        quorum_retries: lighthouse quorum retries, as torchft.
        kill_handler: called with the message of a Kill request (default:
            log and ``os._exit(1)``, as torchft).
    """

    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str,
        bind: str,
        store_addr: str,
        world_size: int,
        heartbeat_interval: timedelta,
        connect_timeout: timedelta,
        quorum_retries: int = 0,
        *,
        auth_token: str | None = None,
        disconnect_grace_ms: int | None = None,
        kill_handler: Callable[[str], None] | None = None,
    ) -> None:
        self._server = _C.ManagerServer(
            replica_id,
            lighthouse_addr,
            hostname,
            bind,
            store_addr,
            world_size,
            config.seconds(heartbeat_interval),
            config.seconds(connect_timeout),
            quorum_retries,
            auth_token=config.auth_token(auth_token),
            disconnect_grace_ms=disconnect_grace_ms or 0,
            kill_handler=kill_handler or _exit_on_kill,
        )

    def address(self) -> str:
        """Returns ``http://{hostname}:{port}``."""
        return self._server.address()

    def port(self) -> int:
        """Returns the bound port."""
        return self._server.port()

    def has_left(self) -> bool:
        """True once the group lost a rank and left the job."""
        return self._server.has_left()

    def wait_lost(self, after_quorum_id: int, timeout: timedelta) -> Optional[int]:
        """Waits up to ``timeout`` for the lighthouse to report a member of
        a quorum newer than ``after_quorum_id`` lost (its heartbeats
        stopped, or its connections closed): that quorum's id, or None.
        A stepguard lighthouse reports it in its heartbeat answers; a
        torchft lighthouse never does.  Not to be called while another
        thread shuts the server down."""
        return self._server.wait_lost(after_quorum_id, config.seconds(timeout))

    def shutdown(self) -> None:
        """Stops the server; waiting calls fail."""
        self._server.shutdown()

    def __enter__(self) -> ManagerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class ManagerClient:
    """A group rank's client of its replica group's manager.

    Works with stepguard's and torchft's managers.  Keep it open for the
    life of training: the manager treats a rank whose connections all close
    as dead.

    Args:
        addr: ``http://host:port`` of the manager.
        connect_timeout: how long construction may try to connect.
        server: the :class:`ManagerServer` at ``addr`` when it runs in this
            process (group rank 0): quorum and commit calls are then handed
            to it directly, with the same answers and errors as over the
            connection but without a network round trip or a thread hop.
    """

    # Built in __new__, like torchft's native class (whose __init__ is
    # object's): mock.create_autospec of either then accepts the same calls.
    def __new__(
        cls,
        addr: str,
        connect_timeout: timedelta,
        *,
        auth_token: str | None = None,
        server: ManagerServer | None = None,
    ) -> "ManagerClient":
        self = super().__new__(cls)
        self._client = _C.ManagerClient(
            addr,
            config.seconds(connect_timeout),
            config.auth_token(auth_token),
            server=server._server if server is not None else None,
        )
        return self

    def _quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        init_sync: bool = True,
        commit_failures: int = 0,
        timeout: timedelta = timedelta(seconds=60),
        reconfigure_handle: str = "",
    ) -> QuorumResult:
        """Joins this step's quorum and waits for it.

        Raises:
            TimeoutError: no quorum within ``timeout``.
            RuntimeError: any other failure (the lighthouse call failed,
                the group left the job, a bad argument).
        """
        d = self._client._quorum(
            group_rank,
            step,
            checkpoint_metadata,
            shrink_only,
            init_sync,
            commit_failures,
            config.seconds(timeout),
            reconfigure_handle or "",
        )
        return QuorumResult(**d)

    def _quorum_start(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        init_sync: bool = True,
        commit_failures: int = 0,
        timeout: timedelta = timedelta(seconds=60),
        reconfigure_handle: str = "",
    ) -> None:
        """Starts :meth:`_quorum` in the background (no Python thread) and
        returns at once; collect it with :meth:`_quorum_wait`.  One at a
        time.

        Raises:
            RuntimeError: a started quorum was not collected yet.
        """
        self._client._quorum_start(
            group_rank,
            step,
            checkpoint_metadata,
            shrink_only,
            init_sync,
            commit_failures,
            config.seconds(timeout),
            reconfigure_handle or "",
        )

    def _quorum_wait(self) -> QuorumResult:
        """The result of the quorum :meth:`_quorum_start` started (raising
        what :meth:`_quorum` raises).

        Raises:
            RuntimeError: no quorum was started.
        """
        return QuorumResult(**self._client._quorum_wait())

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        """The checkpoint metadata group rank ``rank`` sent with its last
        quorum call (``RuntimeError`` if it never did)."""
        return self._client._checkpoint_metadata(rank, config.seconds(timeout))

    def should_commit(
        self,
        group_rank: int,
        step: int,
        should_commit: bool,
        timeout: timedelta,
    ) -> bool:
        """Votes for this step; True only if every group rank voted yes."""
        return self._client.should_commit(
            group_rank, step, should_commit, config.seconds(timeout)
        )

    def kill(self, msg: str, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Asks the manager's process to end (its Kill handler runs)."""
        self._client.kill(msg, config.seconds(timeout))

    def _wait_lost(self, after_quorum_id: int, timeout: timedelta) -> Optional[int]:
        """stepguard: waits up to ``timeout`` for the manager to learn from
        the lighthouse that a member of a quorum newer than
        ``after_quorum_id`` was lost (a long poll, so that every group rank
        can abort that quorum's collectives): that quorum's id, or None.

        Use a client of its own for it (a rank's liveness is judged on the
        connection of its quorum and commit calls).

        Raises:
            RuntimeError: the call failed (a torchft manager, which lacks
                the method, answers UNIMPLEMENTED).
        """
        return self._client._wait_lost(after_quorum_id, config.seconds(timeout))

    def abort(self) -> None:
        """Fails every call in progress and every later one."""
        self._client.abort()

    def close(self) -> None:
        """Closes the connection."""
        self._client.close()


def lighthouse_main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stepguard-lighthouse`` console script."""
    args = list(sys.argv if argv is None else argv)
    args[0] = "stepguard-lighthouse"
    return _C.lighthouse_main(args)


def _console_main() -> None:
    sys.exit(lighthouse_main())


if __name__ == "__main__":
    _console_main()
