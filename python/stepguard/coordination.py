"""Coordination (low-level API): the lighthouse server and client.

The same names, signatures and defaults as ``torchft.coordination``, over
stepguard's C lighthouse.  Deadlines raise :class:`TimeoutError`; every
other failure raises :class:`RuntimeError` (:class:`stepguard.Error`).

stepguard additions, all keyword-only: ``auth_token`` (default: the
``STEPGUARD_AUTH_TOKEN`` environment variable), and on the server
``disconnect_grace_ms``, ``prune_after_ms``, ``quorum_id_file``,
``hostname``, ``max_replicas`` and ``max_connections``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Hashable

from stepguard import _C

__all__ = [
    "LighthouseClient",
    "LighthouseServer",
    "Quorum",
    "QuorumMember",
    "Timestamp",
    "lighthouse_main",
]


def _env_token(token: str | None) -> str | None:
    if token is not None:
        return token or None
    return os.environ.get("STEPGUARD_AUTH_TOKEN") or None


def _seconds(t: timedelta | float | int) -> float:
    return t.total_seconds() if isinstance(t, timedelta) else float(t)


@dataclass
class Timestamp:
    """Wall-clock time at which a quorum was created."""

    seconds: int
    nanos: int


@dataclass
class QuorumMember:
    """One replica group in a quorum."""

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
    """A quorum as issued by the lighthouse."""

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
        ):
            if value is not None:
                kw[name] = value
        self._server = _C.LighthouseServer(
            bind,
            min_replicas,
            auth_token=_env_token(auth_token),
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
        addr: ``http://host:port`` of the lighthouse.
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
            addr, _seconds(connect_timeout), _env_token(auth_token)
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
            _seconds(timeout),
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
        self._client.heartbeat(replica_id, _seconds(timeout))

    def close(self) -> None:
        """Closes the connection (the lighthouse sees it close)."""
        self._client.close()


def lighthouse_main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stepguard-lighthouse`` console script."""
    args = list(sys.argv if argv is None else argv)
    args[0] = "stepguard-lighthouse"
    return _C.lighthouse_main(args)


def _console_main() -> None:
    sys.exit(lighthouse_main())
