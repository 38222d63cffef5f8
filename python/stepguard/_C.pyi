"""Type stubs for stepguard._C, the thin binding over libstepguard."""

from collections.abc import Sequence
from typing import Any, Callable

from typing_extensions import Buffer

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
def quant_wire_bytes(count: int) -> int: ...
def quant_encode(fmt: int, in_ptr: int, count: int, wire_ptr: int) -> int: ...
def quant_decode(fmt: int, wire_ptr: int, nbytes: int, count: int, out_ptr: int) -> None: ...
def fp8_from_f32(in_ptr: int, out_ptr: int, n: int) -> None: ...
def fp8_to_f32(in_ptr: int, out_ptr: int, n: int) -> None: ...
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
def split_address(addr: str) -> tuple[str, int]: ...
def advertised_host(option: str | None = None, fallback: str | None = None) -> str: ...
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
    def wait_lost(self, after_qid: int, timeout_s: float) -> int | None: ...
    def shutdown(self) -> None: ...

class ManagerClient:
    def __init__(
        self,
        addr: str,
        connect_timeout_s: float,
        auth_token: str | None = None,
        server: ManagerServer | None = None,
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
    def _quorum_start(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        init_sync: bool,
        commit_failures: int,
        timeout_s: float,
        reconfigure_handle: str = "",
    ) -> None: ...
    def _quorum_wait(self) -> dict[str, Any]: ...
    def _checkpoint_metadata(self, rank: int, timeout_s: float) -> str: ...
    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout_s: float
    ) -> bool: ...
    def kill(self, msg: str, timeout_s: float = 10.0) -> None: ...
    def _wait_lost(self, after_quorum_id: int, timeout_s: float) -> int | None: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...

# ---- collectives (comm.c) ----------------------------------------------------

COMM_F32: int
COMM_F64: int
COMM_F16: int
COMM_BF16: int
COMM_I8: int
COMM_U8: int
COMM_I32: int
COMM_I64: int
COMM_SUM: int
COMM_AVG: int
COMM_MIN: int
COMM_MAX: int
COMM_PRODUCT: int
QUANT_INT8: int
QUANT_FP8: int

_Done = Callable[[int, str], object]

class Comm:
    """One rank of a communicator; buffers are passed by address and must
    stay alive until ``done(code, message)`` runs (on the progress thread)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        generation: int = 0,
        job: str | None = None,
        auth_token: str | None = None,
        bind_host: str | None = None,
        small_max: int = 0,
        progress_timeout_ms: int = 0,
    ) -> None: ...
    def port(self) -> int: ...
    def same_host(self, peer: int) -> bool: ...
    def connect(self, addrs: Sequence[str], timeout_s: float) -> None: ...
    def allreduce(
        self, ptr: int, count: int, dtype: int, op: int, timeout_s: float, done: _Done
    ) -> None: ...
    def broadcast(
        self, ptr: int, nbytes: int, root: int, timeout_s: float, done: _Done
    ) -> None: ...
    def allgather(
        self, in_ptr: int, nbytes: int, out_ptrs: Sequence[int], timeout_s: float,
        done: _Done,
    ) -> None: ...
    def reduce_scatter(
        self, in_ptrs: Sequence[int], out_ptr: int, count: int, dtype: int, op: int,
        timeout_s: float, done: _Done,
    ) -> None: ...
    def allreduce_quantized(
        self, ptr: int, count: int, fmt: int, op: int, timeout_s: float, done: _Done
    ) -> None: ...
    def reduce_scatter_quantized(
        self, in_ptr: int, out_ptr: int, count: int, fmt: int, op: int,
        timeout_s: float, done: _Done,
    ) -> None: ...
    def alltoall(
        self, in_ptrs: Sequence[int], in_bytes: Sequence[int], out_ptrs: Sequence[int],
        out_bytes: Sequence[int], timeout_s: float, done: _Done,
    ) -> None: ...
    def send(self, ptr: int, nbytes: int, dst: int, timeout_s: float, done: _Done) -> None: ...
    def recv(self, ptr: int, nbytes: int, src: int, timeout_s: float, done: _Done) -> None: ...
    def barrier(self, timeout_s: float, done: _Done) -> None: ...
    def abort(self) -> None: ...
    def error(self) -> tuple[int, str] | None: ...
    def close(self) -> None: ...

# ---- checkpoint serving and fetch (ckpt.c) -------------------------------------

class CkptServer:
    def __init__(
        self,
        bind: str | None = ...,
        auth_token: str | None = ...,
        max_conns: int = ...,
        request_timeout_s: float = ...,
        stall_timeout_s: float = ...,
    ) -> None: ...
    def port(self) -> int: ...
    def serve(self, step: int, header: bytes, ptrs: Buffer, lens: Buffer) -> None: ...
    def disallow(self, timeout_s: float) -> bool: ...
    def stats(self) -> dict[str, int]: ...
    def shutdown(self) -> None: ...

class CkptFetch:
    def info(
        self, addr: str, token: str | None, step: int, timeout_s: float
    ) -> tuple[bytes, list[int], int]: ...
    def data(
        self,
        addrs: Sequence[str],
        token: str | None,
        step: int,
        layout: int,
        ptrs: Buffer,
        lens: Buffer,
        streams: int,
        timeout_s: float,
        min_chunk: int = ...,
        same_host: bool = ...,
        mapped: bytes | None = ...,
    ) -> list[int]: ...
    def abort(self) -> None: ...
