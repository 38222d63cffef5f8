"""Helpers for the lighthouse tests: processes, HTTP, raw gRPC, protobuf.

Everything binds port 0 and reads the bound port back; every wait has an
explicit deadline.
"""

from __future__ import annotations

import html
import http.client
import json
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions

ROOT = Path(__file__).resolve().parents[3]
NATIVE_LIGHTHOUSE = ROOT / "build/native/src/bin/stepguard-lighthouse"

# Our CLI through the extension (always in sync with the editable build).
OURS_CODE = (
    "import sys\n"
    "from stepguard.coordination import lighthouse_main\n"
    "sys.exit(lighthouse_main())\n"
)

LISTEN_RE = re.compile(r"Lighthouse listening on:? (http://\S+)")

TORCHFT_LIGHTHOUSE_SCRIPT = Path(sys.executable).parent / "torchft_lighthouse"


def td(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def wait_until(pred: Callable[[], object], timeout: float, what: str,
               interval: float = 0.02) -> object:
    """Polls pred() until it is truthy; fails the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---- lighthouse processes ---------------------------------------------


class LogProc:
    """A child process whose merged stdout/stderr is collected line by line."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self._eof = False
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._cv:
                self.lines.append(line)
                self._cv.notify_all()
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def wait_line(self, pattern: str | re.Pattern, timeout: float,
                  start: int = 0) -> re.Match:
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        with self._cv:
            i = start
            while True:
                while i < len(self.lines):
                    m = rx.search(self.lines[i])
                    if m:
                        return m
                    i += 1
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    raise AssertionError(
                        f"no line matching {rx.pattern!r} within {timeout}s "
                        f"(eof={self._eof}); output:\n" + "\n".join(self.lines))
                self._cv.wait(left)

    def output(self) -> str:
        with self._cv:
            return "\n".join(self.lines)

    def wait_exit(self, timeout: float) -> int:
        rc = self.popen.wait(timeout=timeout)
        self._t.join(timeout=5)
        return rc


class LighthouseProc(LogProc):
    """A lighthouse child process (ours or torchft's) and its bound port."""

    def __init__(self, popen: subprocess.Popen, timeout: float = 30) -> None:
        super().__init__(popen)
        m = self.wait_line(LISTEN_RE, timeout)
        self.advertised = m.group(1)
        self.port = int(self.advertised.rsplit(":", 1)[1].rstrip("/"))
        self.addr = f"http://127.0.0.1:{self.port}"


def spawn_logged(procs, code: str, *args: str, env=None) -> subprocess.Popen:
    return procs.spawn(code, *args, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, env=env)


def start_ours(procs, *flags: str, env=None) -> LighthouseProc:
    """Starts `stepguard-lighthouse --bind 127.0.0.1:0 FLAGS` as a child."""
    return LighthouseProc(
        spawn_logged(procs, OURS_CODE, "--bind", "127.0.0.1:0", *flags, env=env))


def start_torchft(procs, *flags: str) -> LighthouseProc:
    """Starts torchft's `torchft_lighthouse` console script as a child."""
    p = subprocess.Popen([str(TORCHFT_LIGHTHOUSE_SCRIPT), "--bind", "127.0.0.1:0",
                          *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    procs.popens.append(p)  # killed by pid at teardown
    return LighthouseProc(p)


# ---- HTTP/1.1 -----------------------------------------------------------


def http_request(port: int, method: str, path: str,
                 headers: dict[str, str] | None = None, body: bytes | None = None,
                 timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data
    finally:
        c.close()


def http_get(port: int, path: str, **kw) -> tuple[int, dict[str, str], bytes]:
    return http_request(port, "GET", path, **kw)


def http_post(port: int, path: str, **kw) -> tuple[int, dict[str, str], bytes]:
    return http_request(port, "POST", path, **kw)


def status(port: int) -> dict:
    code, _, body = http_get(port, "/status")
    assert code == 200, body
    return json.loads(body)


def torchft_reason(port: int) -> str:
    """torchft's "Next quorum status" from its HTML /status fragment."""
    code, _, body = http_get(port, "/status")
    assert code == 200, body
    text = body.decode()
    m = re.search(r"Next quorum status:\s*(.*?)\s*<", text, re.S)
    assert m, text
    return html.unescape(m.group(1)).strip()


# ---- protobuf (hand-encoded) -------------------------------------------


def varint(n: int) -> bytes:
    if n < 0:
        n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def pb_bytes(field: int, value: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(value)) + value


def pb_int(field: int, value: int) -> bytes:
    return varint(field << 3) + varint(value)


def pb_member(replica_id: bytes | str = b"raw", step: int = 0,
              address: str = "", store_address: str = "",
              world_size: int = 1) -> bytes:
    rid = replica_id.encode() if isinstance(replica_id, str) else replica_id
    out = pb_bytes(1, rid)
    if address:
        out += pb_bytes(2, address.encode())
    if store_address:
        out += pb_bytes(3, store_address.encode())
    if step:
        out += pb_int(4, step)
    if world_size:
        out += pb_int(5, world_size)
    return out


def pb_quorum_request(member: bytes) -> bytes:
    return pb_bytes(1, member)


def pb_heartbeat_request(replica_id: bytes | str) -> bytes:
    rid = replica_id.encode() if isinstance(replica_id, str) else replica_id
    return pb_bytes(1, rid)


def grpc_frame(msg: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(msg)) + msg


# ---- raw HTTP/2 / gRPC --------------------------------------------------


class GrpcResult:
    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.trailers: dict[str, str] = {}
        self.data = b""
        self.reset: int | None = None  # RST_STREAM error code
        self.goaway: int | None = None
        self.closed = False  # connection closed before the stream ended

    @property
    def grpc_status(self) -> int | None:
        v = self.trailers.get("grpc-status", self.headers.get("grpc-status"))
        return None if v is None else int(v)

    @property
    def grpc_message(self) -> str:
        return self.trailers.get("grpc-message",
                                 self.headers.get("grpc-message", ""))

    def __repr__(self) -> str:
        return (f"GrpcResult(headers={self.headers}, trailers={self.trailers}, "
                f"data={self.data[:64]!r}, reset={self.reset}, "
                f"goaway={self.goaway}, closed={self.closed})")


class H2Client:
    """A raw HTTP/2 client over a blocking socket, driven by h2."""

    def __init__(self, port: int, timeout: float = 10) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.conn = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=True,
                                             header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.flush()
        self.port = port
        self.pending_events: list = []

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request_headers(self, method: str = "Quorum", *,
                        service: str = "torchft.LighthouseService",
                        path: str | None = None,
                        extra: list[tuple[str, str]] | None = None,
                        end_stream: bool = False) -> int:
        sid = self.conn.get_next_available_stream_id()
        hdrs = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path or f"/{service}/{method}"),
            (":authority", f"127.0.0.1:{self.port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ] + list(extra or [])
        self.conn.send_headers(sid, hdrs, end_stream=end_stream)
        self.flush()
        return sid

    def _pump(self, timeout: float) -> None:
        """Reads once and feeds h2 (SETTINGS, WINDOW_UPDATE, ...)."""
        self.sock.settimeout(timeout)
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionResetError("peer closed the connection")
        self.pending_events.extend(self.conn.receive_data(data))
        self.flush()

    def send_data(self, sid: int, data: bytes, end_stream: bool = True,
                  timeout: float = 10) -> None:
        # respect flow control: chunks no larger than the peer allows
        view = memoryview(data)
        deadline = time.monotonic() + timeout
        while True:
            n = min(len(view), self.conn.max_outbound_frame_size,
                    max(self.conn.local_flow_control_window(sid), 0))
            if len(view) and n == 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError("peer flow-control window stays closed")
                self._pump(left)
                if any(isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset,
                                       h2.events.ConnectionTerminated))
                       and getattr(ev, "stream_id", sid) in (sid, 0, None)
                       for ev in self.pending_events):
                    return  # answered (or refused) before the body was sent
                continue
            last = n == len(view)
            self.conn.send_data(sid, bytes(view[:n]), end_stream=end_stream and last)
            self.flush()
            view = view[n:]
            if last:
                return

    def call(self, method: str, msg: bytes | None, *, raw_body: bytes | None = None,
             extra: list[tuple[str, str]] | None = None,
             service: str = "torchft.LighthouseService",
             timeout: float = 10) -> GrpcResult:
        sid = self.request_headers(method, service=service, extra=extra)
        self.send_data(sid, raw_body if raw_body is not None else grpc_frame(msg or b""))
        return self.read_result(sid, timeout)

    def read_result(self, sid: int, timeout: float = 10) -> GrpcResult:
        res = GrpcResult()
        deadline = time.monotonic() + timeout
        events, self.pending_events = self.pending_events, []
        if self._handle(events, sid, res):
            return res
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no response within {timeout}s: {res!r}")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            if not data:
                res.closed = True
                return res
            try:
                events = self.conn.receive_data(data)
            except h2.exceptions.ProtocolError:
                res.closed = True
                return res
            if self._handle(events, sid, res):
                return res

    def _handle(self, events: list, sid: int, res: GrpcResult) -> bool:
        """Applies events to res; True once the stream (or connection) ended."""
        done = False
        for ev in events:
            if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == sid:
                res.headers = dict(ev.headers)
            elif isinstance(ev, h2.events.TrailersReceived) and ev.stream_id == sid:
                res.trailers = dict(ev.headers)
            elif isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
                res.data += ev.data
                self.conn.acknowledge_received_data(ev.flow_controlled_length, sid)
            elif isinstance(ev, h2.events.StreamReset) and ev.stream_id == sid:
                res.reset = int(ev.error_code)
                done = True
            elif isinstance(ev, h2.events.ConnectionTerminated):
                res.goaway = int(ev.error_code)
                done = True
            elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id == sid:
                done = True
        try:
            self.flush()
        except OSError:
            pass
        return done

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> H2Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def h2_frame(ftype: int, flags: int, sid: int, payload: bytes,
             declared_len: int | None = None) -> bytes:
    n = len(payload) if declared_len is None else declared_len
    return struct.pack(">I", n)[1:] + bytes([ftype, flags]) + struct.pack(">I", sid) + payload


# gRPC status codes used by the tests
OK = 0
CANCELLED = 1
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
UNAVAILABLE = 14
UNAUTHENTICATED = 16


def load_torchft():
    """torchft._torchft without importing torch (torchft/__init__ does, ~2 s).

    Registered in sys.modules so a later ``import torchft`` reuses it (a
    PyO3 module must not be initialized twice in one process).
    """
    import importlib.util
    import os

    mod = sys.modules.get("torchft._torchft")
    if mod is not None:
        return mod
    spec = importlib.util.find_spec("torchft")
    assert spec is not None and spec.submodule_search_locations
    pkg = list(spec.submodule_search_locations)[0]
    so = [f for f in os.listdir(pkg) if f.startswith("_torchft") and f.endswith(".so")]
    assert so, f"no _torchft extension in {pkg}"
    spec2 = importlib.util.spec_from_file_location("torchft._torchft",
                                                   os.path.join(pkg, so[0]))
    mod = importlib.util.module_from_spec(spec2)
    spec2.loader.exec_module(mod)
    sys.modules["torchft._torchft"] = mod
    return mod


# Source for child processes that need torchft's bindings (no torch import).
LOAD_TORCHFT_CODE = (
    "import importlib.util, os, sys\n"
    "_spec = importlib.util.find_spec('torchft')\n"
    "_pkg = list(_spec.submodule_search_locations)[0]\n"
    "_so = [f for f in os.listdir(_pkg) if f.startswith('_torchft') and f.endswith('.so')][0]\n"
    "_s2 = importlib.util.spec_from_file_location('torchft._torchft', os.path.join(_pkg, _so))\n"
    "torchft_c = importlib.util.module_from_spec(_s2)\n"
    "_s2.loader.exec_module(torchft_c)\n"
)
