"""Type stubs for stepguard._C, the thin binding over libstepguard."""

from typing import Any, Callable

OK: int
EINVAL: int
ENOMEM: int
EAGAIN: int
ETIMEDOUT: int
ECANCELED: int
ECONNRESET: int
ECONNREFUSED: int
EPIPE: int
EADDRINUSE: int
EIO: int
ETOOBIG: int
EAUTH: int
ENOTFOUND: int
ESTATE: int
ECLOSED: int
EABORTED: int
EPEER: int
EPROTO: int

class Error(RuntimeError):
    code: int

def version() -> str: ...
def strerror(code: int) -> str: ...
def err_name(code: int) -> str: ...
def err_is_fatal(code: int) -> bool: ...
def monotonic_ns() -> int: ...
def log(level: int, subsystem: str, msg: str) -> None: ...
def set_log_level(name: str) -> None: ...
def tcp_listen(host: str, port: int, backlog: int = 128) -> tuple[int, int]: ...
def tcp_connect(host: str, port: int, timeout_s: float) -> int: ...
def tcp_close(fd: int) -> None: ...
def registered_sockets() -> int: ...
def fork_count() -> int: ...
def _raise_error(code: int, detail: str = "") -> None: ...
def lighthouse_main(argv: list[str]) -> int: ...

class LighthouseServer:
    def __init__(
        self,
        bind: str,
        min_replicas: int,
        join_timeout_ms: int = ...,
        quorum_tick_ms: int = ...,
        heartbeat_timeout_ms: int = ...,
        disconnect_grace_ms: int = ...,
        prune_after_ms: int = ...,
        auth_token: str | None = None,
        quorum_id_file: str | None = None,
        hostname: str | None = None,
        max_replicas: int = ...,
        max_connections: int = ...,
    ) -> None: ...
    def address(self) -> str: ...
    def port(self) -> int: ...
    def shutdown(self) -> None: ...

_Member = tuple[str, str, str, int, int, bool, str, int]

class LighthouseClient:
    def __init__(
        self, addr: str, connect_timeout_s: float, auth_token: str | None = None
    ) -> None: ...
    def quorum(
        self,
        replica_id: str,
        timeout_s: float,
        address: str = "",
        store_address: str = "",
        step: int = 0,
        world_size: int = 0,
        shrink_only: bool = False,
        data: str = "",
        commit_failures: int = 0,
    ) -> tuple[int, int, int, list[_Member]]: ...
    def heartbeat(self, replica_id: str, timeout_s: float = 5.0) -> None: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...

class ManagerServer:
    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str | None,
        bind: str | None,
        store_addr: str | None,
        world_size: int,
        heartbeat_interval_s: float,
        connect_timeout_s: float,
        quorum_retries: int,
        auth_token: str | None = None,
        disconnect_grace_ms: int = 0,
        kill_handler: Callable[[str], object] | None = None,
    ) -> None: ...
    def address(self) -> str: ...
    def port(self) -> int: ...
    def has_left(self) -> bool: ...
    def shutdown(self) -> None: ...

class ManagerClient:
    def __init__(
        self, addr: str, connect_timeout_s: float, auth_token: str | None = None
    ) -> None: ...
    def _quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        init_sync: bool,
        commit_failures: int,
        timeout_s: float,
        reconfigure_handle: str = "",
    ) -> dict[str, Any]: ...
    def _checkpoint_metadata(self, rank: int, timeout_s: float) -> str: ...
    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout_s: float
    ) -> bool: ...
    def kill(self, msg: str, timeout_s: float = 10.0) -> None: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...
