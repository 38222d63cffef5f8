"""Serving a replica's state dict over HTTP to the replicas that heal from it.

Wire format (torchft's, so a torchft healer can fetch from us and the other
way round): ``GET /checkpoint/{step}/{key}`` on the address ``metadata()``
returns, where key is ``full`` (the whole state dict), ``metadata`` (the
pytree spec) or a chunk index; every body is torch's streaming save of the
object, ``application/octet-stream``.

One server, ``_StateServer`` (below), does the serving, for this transport
and for NativeTransport (which serves its native state through it too, so
a torchft healer can heal from a replica that uses NativeTransport).
Serving is gated: nothing is served before the first ``send_checkpoint``,
a request that comes while serving is disallowed waits for the next
``allow_checkpoint`` and fails after ``timeout``, and disallowing waits for
the requests in flight (up to ``timeout``, then cuts them).

Differences from torchft: a malformed path gets 400 and an unknown chunk 404
(torchft: 500 for both); a request that waits past the deadline gets 503;
a request whose line and headers do not arrive within ``min(timeout, 10
s)`` is cut, and connections beyond 64 are closed at once; the sockets are
closed in forked children, so a DataLoader worker cannot keep a dead
trainer's port open.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Generator, Iterator, List, Optional, TypeVar, cast

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from stepguard.checkpointing._serialization import _streaming_load, _streaming_save
from stepguard.checkpointing.transport import CheckpointTransport

__all__ = ["HTTPTransport"]

_MAX_STEP_DIGITS = 20  # a step is an int64

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")


@contextmanager
def _time(msg: str) -> Generator[None, None, None]:
    start = time.perf_counter()
    yield
    logger.info("%s took %.3fs", msg, time.perf_counter() - start)


class _Server(ThreadingHTTPServer):
    """Dual-stack (IPv6 with IPv4-mapped) threading server."""

    address_family = socket.AF_INET6
    request_queue_size = 1024
    daemon_threads = True

    def server_bind(self) -> None:
        try:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        except OSError:
            pass
        super().server_bind()


def _make_server(handler: type, host: str = "", cls: type = _Server) -> ThreadingHTTPServer:
    """A server on ``host`` (all interfaces when empty), port 0; IPv4 when
    ``host`` is an IPv4 address or the host has no IPv6."""
    v4 = type(f"{cls.__name__}4", (cls,), {"address_family": socket.AF_INET})
    if host and ":" not in host:
        try:
            socket.inet_pton(socket.AF_INET, host)
            return v4((host, 0), handler)
        except OSError:
            pass  # a name: try IPv6 first
    try:
        return cls((host, 0), handler)
    except OSError:  # no IPv6 on this host
        return v4((host, 0), handler)


class _BadRequest(Exception):
    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code


class HTTPTransport(CheckpointTransport[T]):
    """Serves the state dict from an HTTP server in this process and fetches
    from peers over HTTP.

    Fetching, a source that answers it still serves an earlier step is
    asked again until ``timeout``: a replica that serves at a safe point of
    its step (see the Manager) is about to serve the step asked for.

    Args:
        timeout: deadline of a request: socket reads and writes on both
            sides, and the wait while serving is disallowed.
        num_chunks: 0 fetches the state dict in one request; n > 0 splits
            its leaves round-robin into n chunks fetched in parallel.
    """

    def __init__(self, timeout: timedelta, num_chunks: int) -> None:
        if num_chunks < 0:
            raise ValueError(f"num_chunks must be >= 0, got {num_chunks}")
        self._timeout = timeout
        self._num_chunks = num_chunks
        # the last state sent (host values and spec), served again by
        # allow_checkpoint under a new step
        self._values: Optional[List[object]] = None
        self._spec: Optional[TreeSpec] = None
        self._stream: Optional[torch.Stream] = (
            torch.Stream(torch.accelerator.current_accelerator())
            if torch.accelerator.is_available()
            else None
        )
        # Nothing is served before the first send_checkpoint.
        self._server = _StateServer(timeout.total_seconds())
        # torchft's bookkeeping, kept for code that inspects it: the step
        # last passed to allow_checkpoint (-1 before any) and whether the
        # caller has disallowed serving (True until the first allow).
        self._step = -1
        self._disallowed = True
        self._checkpoint_lock = _GateView(self)
        logger.info("serving checkpoints on %s", self.address())

    #: serves from a background thread until disallowed (the Manager keeps
    #: a copy served where a healer may ask late)
    serves_in_background = True

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        """Fetches and deserializes one object from ``address``.

        Raises:
            urllib.error.HTTPError: the peer answered with an error status
                (its message is the reason; the text names the URL too).
            urllib.error.URLError: the peer could not be reached (or the
                timeout is 0).
            TimeoutError/OSError: the peer went silent or away mid-transfer.
        """
        msg = f"fetching checkpoint from {address}"
        logger.info(msg)
        try:
            with _time(msg), urllib.request.urlopen(
                address, timeout=timeout.total_seconds()
            ) as f:
                # Non-tensor state (schedulers, ...) needs full unpickling.
                return _streaming_load(f, weights_only=False)
        except urllib.error.HTTPError as e:
            # same code, reason, headers and body; the text adds the URL
            raise _FetchHTTPError(address, e.code, e.msg, e.hdrs, e.fp) from None
        except urllib.error.URLError as e:
            raise _FetchURLError(e.reason, address) from None

    def address(self) -> str:
        """``http://{hostname}:{port}/checkpoint/``; append ``{step}/{key}``."""
        return f"http://{socket.gethostname()}:{self._server.port()}/checkpoint/"

    def metadata(self) -> str:
        return self.address()

    def disallow_checkpoint(self) -> None:
        """Stops serving: new requests wait (up to the timeout) for the next
        ``allow_checkpoint``; those in flight are waited for up to the
        timeout, then cut."""
        self._disallowed = True
        self._server.close_gate()
        self._server.wait_idle(self._timeout.total_seconds())

    def allow_checkpoint(self, step: int) -> None:
        """Serves the last state sent as ``step`` (before any was sent,
        requests keep waiting for the first ``send_checkpoint``)."""
        self._step = step
        self._disallowed = False
        if self._values is not None and self._spec is not None:
            self._server.serve(_Staged(step, self._values, self._spec, {}, self._num_chunks))

    def send_checkpoint(
        self, dst_ranks: List[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Stages ``state_dict`` (accelerator tensors copied to CPU) and
        serves it as ``step``; returns at once."""
        values, spec = tree_flatten(state_dict)
        with _time("copying state_dict to CPU"):
            self._values = _to_cpu(values, self._stream)
        self._spec = spec
        self.allow_checkpoint(step)

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> T:
        base = f"{metadata}{step}"
        deadline = time.monotonic() + timeout.total_seconds()
        pause = 0.005
        while True:
            try:
                return self._recv(base, timeout)
            except urllib.error.HTTPError as e:
                # (the reason line names the step served)
                served = _SERVING.search(str(e)) if e.code == 400 else None
                if served is None or int(served.group(1)) >= step:
                    raise
                if time.monotonic() + pause >= deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def _recv(self, base: str, timeout: timedelta) -> T:
        if self._num_chunks == 0:
            return cast(T, self._load_from_address(f"{base}/full", timeout))
        urls = [f"{base}/metadata"] + [f"{base}/{i}" for i in range(self._num_chunks)]
        with ThreadPoolExecutor(max_workers=len(urls)) as pool:
            results = [f.result() for f in [pool.submit(self._load_from_address, u, timeout) for u in urls]]
        spec = cast(TreeSpec, results[0])
        values = _merge_chunks(cast(List[List[object]], results[1:]), self._num_chunks)
        return cast(T, tree_unflatten(values, spec))

    def shutdown(self, wait: bool = True) -> None:
        """Stops the server; ``wait`` joins its thread."""
        self._server.close(wait)


# a source's refusal: the step it serves is not the one asked for
_SERVING = re.compile(r"serving (-?\d+) but got step=")


class _GateView:
    """Stands in for torchft's ``HTTPTransport._checkpoint_lock`` (a
    readers-writer lock whose write side is held while serving is
    disallowed): ``w_locked()`` is True from construction and after
    ``disallow_checkpoint`` until the next ``allow_checkpoint``.  It
    reports the caller's allow/disallow calls; the gate itself is the
    server's, which stays shut until a state has been sent.  Only
    ``w_locked`` is provided."""

    def __init__(self, transport: "HTTPTransport[Any]") -> None:
        self._transport = weakref.ref(transport)

    def w_locked(self) -> bool:
        t = self._transport()
        return t is None or t._disallowed


class _FetchHTTPError(urllib.error.HTTPError):
    """urllib's HTTPError for a checkpoint fetch, whose text names the URL."""

    def __str__(self) -> str:
        return f"HTTP Error {self.code}: {self.msg} (GET {self.filename})"


class _FetchURLError(urllib.error.URLError):
    """urllib's URLError (same reason) for a checkpoint fetch, whose text
    names the URL."""

    def __init__(self, reason: Any, url: Optional[str] = None) -> None:
        super().__init__(reason, url)

    def __str__(self) -> str:
        where = f" (GET {self.filename})" if self.filename else ""
        return f"<urlopen error {self.reason}{where}>"


def _to_cpu(values: List[object], stream: Optional[torch.Stream]) -> List[object]:
    out: List[object] = []
    copied = False
    for v in values:
        if isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta"):
            out.append(v.cpu())
            copied = True
        else:
            out.append(v)
    if copied and stream is not None:
        stream.synchronize()
    return out


def _split_chunks(values: List[T], num_chunks: int) -> List[List[T]]:
    return [values[i::num_chunks] for i in range(num_chunks)]


def _merge_chunks(chunks: List[List[T]], num_chunks: int) -> List[T]:
    out: List[T] = []
    longest = max((len(c) for c in chunks), default=0)
    for i in range(longest):
        for c in chunks:
            if i < len(c):
                out.append(c[i])
    return out


# ---- the HTTP side of another transport's state ------------------------------


class _Limited(_Server):
    """A threading server that closes connections beyond ``max_conns`` at
    once instead of starting a thread for each."""

    max_conns = 64

    def __init__(self, *args: Any, **kw: Any) -> None:
        self._count_lock = threading.Lock()
        self.active = 0
        super().__init__(*args, **kw)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        with self._count_lock:
            if self.active >= self.max_conns:
                logger.warning("checkpoint HTTP: %d connections, refusing more", self.active)
                return False
            self.active += 1
            return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            with self._count_lock:
                self.active -= 1


class _Staged:
    """One served state, as torchft's HTTP transport lays it out: ``full``
    (the tree), ``metadata`` (its spec) and ``num_chunks`` chunks of its
    leaves taken round-robin.  Built from the serving transport's own
    leaves: nothing is copied (``copies`` gives the host copy of each leaf
    that lives on an accelerator), and the tree is rebuilt on the first
    request for it, not when the state is staged."""

    def __init__(
        self,
        step: int,
        leaves: List[object],
        spec: TreeSpec,
        copies: Dict[int, object],
        num_chunks: int,
    ) -> None:
        self.step = step
        self._leaves = leaves
        self._spec = spec
        self._copies = copies
        self._num_chunks = num_chunks
        self._lock = threading.Lock()
        self._values: Optional[List[object]] = None
        self._full: Optional[object] = None

    def _host_values(self) -> List[object]:
        with self._lock:
            if self._values is None:
                if self._copies:
                    vals = list(self._leaves)
                    for i, t in self._copies.items():
                        vals[i] = t
                else:
                    vals = self._leaves
                # leaves on a device that no copy was made for (tensors the
                # native header pickles whole): copied here, as torchft does
                self._values = _to_cpu(vals, None)
            return self._values

    def get(self, key: str) -> object:
        """The object ``key`` names; raises _BadRequest(404) for no such."""
        if key == "metadata":
            return self._spec
        values = self._host_values()
        if key == "full":
            with self._lock:
                if self._full is None:
                    self._full = tree_unflatten(values, self._spec)
                return self._full
        if key.isdigit() and len(key) <= 6 and int(key) < self._num_chunks:
            return values[int(key) :: self._num_chunks]
        if self._num_chunks == 0:
            raise _BadRequest(
                404,
                f"no chunk {key[:32]!r}: this replica serves the whole state "
                "(key 'full'); a healer that fetches in chunks needs the "
                "source's http_chunks set to its num_chunks",
            )
        raise _BadRequest(404, f"no chunk {key[:32]!r} (have {self._num_chunks})")


class _StateServer:
    """Serves another transport's state in torchft's HTTP format.

    ``GET [{prefix}]/checkpoint/{step}/{key}``, where ``prefix`` is the
    owner's extra path segment (``/sgckpt=PORT`` for NativeTransport), so a
    torchft healer can use the owner's metadata as it is.

    Gating: requests wait (up to ``timeout_s``, then 503) until
    :meth:`serve`; :meth:`close_gate` stops new readers at once and
    :meth:`wait_idle` waits for those in flight, then cuts their
    connections, so the owner's memory may change after it.  With
    ``refuse`` set every request gets 403 with that text (the owner needs an
    auth token, which torchft's HTTP client cannot send).

    Bad input: the request line and headers must arrive within
    ``min(timeout_s, 10)`` seconds; more than ``max_conns`` connections are
    closed on accept; malformed paths get 400.
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        host: str = "",
        prefix: str = "",
        refuse: Optional[str] = None,
        max_conns: int = 64,
    ) -> None:
        self._timeout = float(timeout_s)
        self._prefix = prefix.rstrip("/")
        self._refuse = refuse
        self._cond = threading.Condition(threading.Lock())
        self._allowed = False
        self._staged: Optional[_Staged] = None
        self._readers = 0
        self._conns: set = set()  # sockets of requests that read the state
        self._closed = False
        server_cls = type("_LimitedN", (_Limited,), {"max_conns": max_conns})
        self._server = _make_server(self._handler_class(), host, server_cls)
        self._server.timeout = 0.5  # how soon the loop sees a close
        self._thread = threading.Thread(
            target=self._loop, name="stepguard-ckpt-http", daemon=True
        )
        self._thread.start()
        ref = weakref.ref(self)

        def close_in_child() -> None:
            # a forked child (a DataLoader worker) must not keep our
            # listening socket or a healer's connection open after we die
            me = ref()
            if me is not None:
                for sock in [me._server.socket, *me._conns]:
                    try:
                        sock.close()
                    except OSError:
                        pass

        os.register_at_fork(after_in_child=close_in_child)

    def port(self) -> int:
        return int(self._server.socket.getsockname()[1])

    def _loop(self) -> None:
        """Accepts until closed.  Not serve_forever: :meth:`close` must not
        wait for this thread or start one (it may run in a finalizer at
        interpreter exit), so closing the socket has to end the loop."""
        while not self._closed:
            try:
                self._server.handle_request()
            except (OSError, ValueError) as e:  # the socket closed under us
                if not self._closed:
                    logger.warning("checkpoint HTTP server: %s", e)
                    time.sleep(0.1)

    def _handler_class(self) -> type:
        owner = self
        socket_timeout = self._timeout
        head_s = min(self._timeout, 10.0)

        class Handler(BaseHTTPRequestHandler):
            timeout = socket_timeout

            def setup(self) -> None:
                super().setup()
                # a peer that does not finish its request line and headers
                # in time (slowloris) is cut; cancelled once they are read
                self._head_timer = threading.Timer(head_s, self._cut)
                self._head_timer.daemon = True
                self._head_timer.start()

            def _cut(self) -> None:
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def parse_request(self) -> bool:
                ok = super().parse_request()  # reads the headers too
                self._head_timer.cancel()
                return ok

            def finish(self) -> None:
                self._head_timer.cancel()
                try:
                    super().finish()
                except OSError:
                    pass

            def log_message(self, format: str, *args: object) -> None:
                logger.debug("%s - %s", self.address_string(), format % args)

            def do_GET(self) -> None:
                try:
                    owner._get(self)
                except _BadRequest as e:
                    try:
                        self.send_error(e.code, str(e))
                    except OSError:
                        self.close_connection = True
                except (OSError, socket.timeout) as e:
                    logger.info("checkpoint request %s: peer went away: %s", self.path[:200], e)
                    self.close_connection = True
                except Exception as e:  # noqa: BLE001 - reported to the peer
                    logger.exception("checkpoint request %s failed", self.path[:200])
                    try:
                        self.send_error(500, str(e))
                    except OSError:
                        self.close_connection = True

        return Handler

    def _parse(self, path: str) -> tuple[int, str]:
        if self._prefix and path.startswith(self._prefix + "/"):
            path = path[len(self._prefix) :]
        parts = path.split("/")
        if len(parts) != 4 or parts[0] != "" or parts[1] != "checkpoint":
            raise _BadRequest(
                400,
                f"invalid url format, expected [{self._prefix}]/checkpoint/step/key "
                f"but got {path[:200]}",
            )
        raw = parts[2]
        digits = raw[1:] if raw.startswith("-") else raw
        if not digits.isdigit() or not digits.isascii() or len(digits) > _MAX_STEP_DIGITS:
            raise _BadRequest(400, f"invalid step {raw[:32]!r}")
        return int(raw), parts[3]

    @contextmanager
    def _reading(self, req: BaseHTTPRequestHandler) -> Iterator[_Staged]:
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while not self._allowed and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _BadRequest(
                        503, f"checkpoint not available: not served within {self._timeout:.1f}s"
                    )
                self._cond.wait(left)
            if self._closed or self._staged is None:
                raise _BadRequest(503, "checkpoint server is shutting down")
            staged = self._staged
            self._readers += 1
            self._conns.add(req.connection)
        try:
            yield staged
        finally:
            with self._cond:
                self._readers -= 1
                self._conns.discard(req.connection)
                self._cond.notify_all()

    def _get(self, req: BaseHTTPRequestHandler) -> None:
        if self._refuse is not None:
            raise _BadRequest(403, self._refuse)
        step, key = self._parse(req.path)
        with self._reading(req) as staged:
            if step != staged.step:
                raise _BadRequest(
                    400,
                    f"invalid checkpoint requested, serving {staged.step} but got step={step}",
                )
            obj = staged.get(key)
            req.send_response(200)
            req.send_header("Content-type", "application/octet-stream")
            req.end_headers()
            _streaming_save(obj, req.wfile)

    def serve(self, staged: _Staged) -> None:
        """Serves ``staged`` until :meth:`close_gate`; does not block."""
        with self._cond:
            self._staged = staged
            self._allowed = True
            self._cond.notify_all()

    def close_gate(self) -> None:
        """No new request reads the state (they wait for the next serve)."""
        with self._cond:
            self._allowed = False
            self._staged = None

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for requests in flight, then cuts the
        connections of any left (nothing more of the state reaches them);
        True when none had to be cut."""
        with self._cond:
            if self._cond.wait_for(lambda: self._readers == 0, max(timeout_s, 0.0)):
                return True
            for sock in list(self._conns):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            # their writes fail at once; the threads leave soon after
            self._cond.wait_for(lambda: self._readers == 0, 1.0)
            return False

    def close(self, wait: bool = True) -> None:
        """Stops serving and closes the socket (idempotent)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self.wait_idle(0.0)
        if wait and self._thread is not threading.current_thread():
            self._thread.join(5.0)  # the loop checks every 0.5 s
        # handler threads are daemons: closing joins none of them
        self._server.server_close()
