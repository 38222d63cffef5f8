"""Serving a replica's state dict over HTTP to the replicas that heal from it.

Wire format (torchft's, so a torchft healer can fetch from us and the other
way round): ``GET /checkpoint/{step}/{key}`` on the address ``metadata()``
returns, where key is ``full`` (the whole state dict), ``metadata`` (the
pytree spec) or a chunk index; every body is torch's streaming save of the
object, ``application/octet-stream``.

Serving is gated by a readers-writer lock: the transport starts disallowed
(nothing is served before the first ``send_checkpoint``), a request waits
while the state is being changed and fails after ``timeout``.

Differences from torchft: a malformed path gets 400 and an unknown chunk 404
(torchft: 500 for both); a request that waits past the deadline for the
lock gets 503; the listening socket is closed in forked children, so a
DataLoader worker cannot keep a dead trainer's port open.
"""

from __future__ import annotations

import logging
import os
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
from typing import Generator, List, Optional, TypeVar, cast

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from stepguard.checkpointing._rwlock import RWLock
from stepguard.checkpointing._serialization import _streaming_load, _streaming_save
from stepguard.checkpointing.transport import CheckpointTransport

__all__ = ["HTTPTransport"]

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


class _Server4(_Server):
    address_family = socket.AF_INET


def _make_server(handler: type) -> ThreadingHTTPServer:
    try:
        return _Server(("", 0), handler)
    except OSError:  # no IPv6 on this host
        return _Server4(("", 0), handler)


class _BadRequest(Exception):
    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code


class HTTPTransport(CheckpointTransport[T]):
    """Serves the state dict from an HTTP server in this process and fetches
    from peers over HTTP.

    Args:
        timeout: deadline of a request: socket reads and writes on both
            sides, and the wait for the lock while serving is disallowed.
        num_chunks: 0 fetches the state dict in one request; n > 0 splits
            its leaves round-robin into n chunks fetched in parallel.
    """

    def __init__(self, timeout: timedelta, num_chunks: int) -> None:
        if num_chunks < 0:
            raise ValueError(f"num_chunks must be >= 0, got {num_chunks}")
        self._timeout = timeout
        self._num_chunks = num_chunks
        self._checkpoint_lock = RWLock(timeout=timeout.total_seconds())
        self._disallowed = False
        self._step = -1
        self._state_dict: Optional[T] = None
        self._spec: Optional[TreeSpec] = None
        self._chunks: Optional[List[List[object]]] = None
        self._stream: Optional[torch.Stream] = (
            torch.Stream(torch.accelerator.current_accelerator())
            if torch.accelerator.is_available()
            else None
        )
        # Nothing is served before the first send_checkpoint.
        self.disallow_checkpoint()

        self._server = _make_server(self._handler_class())
        self._closed = False
        logger.info("serving checkpoints on %s", self.address())
        self._thread = threading.Thread(
            target=self._serve, name="stepguard-ckpt-http", daemon=True
        )
        self._thread.start()

        ref = weakref.ref(self)

        def close_in_child() -> None:
            me = ref()
            if me is not None:
                try:
                    me._server.socket.close()
                except OSError:
                    pass

        os.register_at_fork(after_in_child=close_in_child)

    def _handler_class(self) -> type:
        transport = self
        socket_timeout = self._timeout.total_seconds()

        class Handler(BaseHTTPRequestHandler):
            timeout = socket_timeout

            def log_message(self, format: str, *args: object) -> None:
                logger.debug("%s - %s", self.address_string(), format % args)

            def do_GET(self) -> None:
                try:
                    transport._serve_get(self)
                except _BadRequest as e:
                    self.send_error(e.code, str(e))
                except (BrokenPipeError, ConnectionResetError, socket.timeout) as e:
                    logger.info("checkpoint request %s: peer went away: %s", self.path, e)
                    self.close_connection = True
                except Exception as e:  # noqa: BLE001 - reported to the peer
                    logger.exception("checkpoint request %s failed", self.path)
                    try:
                        self.send_error(500, str(e))
                    except OSError:
                        self.close_connection = True

        return Handler

    def _serve_get(self, req: BaseHTTPRequestHandler) -> None:
        parts = req.path.split("/")
        if len(parts) != 4 or parts[0] != "" or parts[1] != "checkpoint":
            raise _BadRequest(
                400,
                f"invalid url format, expected /checkpoint/step/key but got {req.path}",
            )
        try:
            step = int(parts[2])
        except ValueError:
            raise _BadRequest(400, f"invalid step in {req.path}") from None
        key = parts[3]
        try:
            self._checkpoint_lock.r_acquire()
        except TimeoutError as e:
            raise _BadRequest(503, f"checkpoint not available: {e}") from None
        try:
            if step != self._step:
                raise _BadRequest(
                    400,
                    f"invalid checkpoint requested, serving {self._step} but got step={step}",
                )
            if key == "full":
                obj: object = self._state_dict
            elif key == "metadata":
                obj = self._spec
            else:
                chunks = self._chunks or []
                if not key.isdigit() or int(key) >= len(chunks):
                    raise _BadRequest(404, f"no chunk {key!r} (have {len(chunks)})")
                obj = chunks[int(key)]
            req.send_response(200)
            req.send_header("Content-type", "application/octet-stream")
            req.end_headers()
            _streaming_save(obj, req.wfile)
        finally:
            self._checkpoint_lock.r_release()

    def _serve(self) -> None:
        try:
            self._server.serve_forever()
        except Exception:  # noqa: BLE001 - logged; the server is gone
            logger.exception("checkpoint server stopped")

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        """Fetches and deserializes one object from ``address``.

        Raises:
            RuntimeError: the peer answered with an error status.
            OSError/TimeoutError: the peer is unreachable or too slow.
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
            raise RuntimeError(
                f"checkpoint fetch {address} failed: HTTP {e.code}: {e.reason}"
            ) from None

    def address(self) -> str:
        """``http://{hostname}:{port}/checkpoint/``; append ``{step}/{key}``."""
        port = self._server.socket.getsockname()[1]
        return f"http://{socket.gethostname()}:{port}/checkpoint/"

    def metadata(self) -> str:
        return self.address()

    def disallow_checkpoint(self) -> None:
        """Stops serving; requests wait (up to the timeout) until the next
        ``allow_checkpoint``."""
        if not self._disallowed:
            self._disallowed = True
            self._checkpoint_lock.w_acquire()

    def allow_checkpoint(self, step: int) -> None:
        """Serves the staged state dict as ``step``."""
        self._step = step
        if self._disallowed:
            self._disallowed = False
            self._checkpoint_lock.w_release()

    def send_checkpoint(
        self, dst_ranks: List[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Stages ``state_dict`` (accelerator tensors copied to CPU) and
        serves it as ``step``; returns at once."""
        values, spec = tree_flatten(state_dict)
        with _time("copying state_dict to CPU"):
            values = _to_cpu(values, self._stream)
        self._state_dict = cast(T, tree_unflatten(values, spec))
        self._spec = spec
        self._chunks = _split_chunks(values, self._num_chunks)
        self.allow_checkpoint(step)

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> T:
        base = f"{metadata}{step}"
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
        if self._closed:
            return
        self._closed = True
        if wait:
            self._stop()
        else:
            threading.Thread(target=self._stop, name="stepguard-ckpt-stop", daemon=True).start()

    def _stop(self) -> None:
        self._server.shutdown()
        self._thread.join()
        self._server.server_close()


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
