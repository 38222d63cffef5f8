"""A fault-tolerant parameter server built on reconfigurable process groups.

torchft's parameter server prototype, with the same module path, class and
wire: a server hands every client *session* a process group of two (the
server is rank 0, the client rank 1) and runs :meth:`ParameterServer.forward`
for it in a thread of its own.  A session that fails (its client died, an
operation timed out, ``forward`` raised) is dropped alone; the server goes
on serving the others, and the client starts a new session.  No lighthouse
is involved.

The wire, the same as torchft's so each side interoperates with the other:

1. ``GET /new_session`` on the server's HTTP port answers 200 with the JSON
   ``{"session_id": ID, "store_addr": "HOST:PORT/session/ID"}`` and a
   newline, then closes the connection.  stepguard adds ``"backend"`` (the
   process group's backend name), which torchft's client ignores.
2. Both sides swap reconfigure handles through the server's TCPStore under
   that prefix (:func:`stepguard.process_group.reconfigure_with_store`):
   ``handle/0``, ``handle/1`` and the communicator id ``uuid`` (set by the
   server).
3. Each side builds its process group from the handles; then ``forward``
   (server) and the caller of :meth:`ParameterServer.new_session` (client)
   talk over it.

The two sides must use the same kind of process group: ProcessGroupTCP (the
default here) speaks only to ProcessGroupTCP, and a torchft peer needs
ProcessGroupGloo on both sides.  A stepguard client learns the server's
backend from the reply and refuses a mismatch at once; a torchft client
cannot, and its session fails at the setup deadline.

Differences from torchft, all on the side of bounded waits and bad input:

* the request line and headers must arrive within ``request_timeout``
  (10 s) and fit in ``max_request_bytes`` (8 KiB); a garbage, truncated,
  oversized or slow request gets an HTTP error (400, 400, 431, 408), a
  wrong method 405, and nothing else: no session, no store keys;
* at most ``max_pending`` connections are read at once and at most
  ``max_sessions`` sessions live at once; more get 503 at once;
* the session setup (store exchange and process group configuration) is
  bounded by ``session_timeout`` on both sides; the client's HTTP call by
  ``request_timeout``; a session whose client never comes is dropped;
* the session's store keys are deleted once it is set up, so a long-lived
  server's store does not grow with every session;
* :meth:`ParameterServer.shutdown` stops the server (torchft has none).

Map: :func:`_parse_request` (pure: bytes of a request head to a path),
:class:`_BadRequest`, :class:`ParameterServer` (accept loop, request
reading, sessions), ``new_session`` (the client).
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

from torch.distributed import PrefixStore, TCPStore

from stepguard.process_group import (
    ProcessGroup,
    ReconfigureOptions,
    reconfigure_with_store,
)

__all__ = ["ParameterServer"]

logger: logging.Logger = logging.getLogger(__name__)

#: the only path the server answers
SESSION_PATH = "/new_session"

#: the largest reply a client reads (a real one is about 150 bytes)
_MAX_REPLY_BYTES = 64 * 1024

_REASONS = {
    200: "OK",
    400: "Bad Request",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class _BadRequest(Exception):
    """A request the server refuses, with the HTTP status to answer."""

    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code


def _head_end(buf: bytes) -> int:
    """The length of the request head in ``buf`` (through the blank line
    that ends it), or -1 when it has not all arrived."""
    for sep in (b"\r\n\r\n", b"\n\n"):
        i = buf.find(sep)
        if i >= 0:
            return i + len(sep)
    return -1


def _parse_request(head: bytes) -> str:
    """Checks a request head (request line and headers) and returns the
    request's path, without its query string.

    Pure, for tests and fuzzing.

    Raises:
        _BadRequest: 400 for anything that is not an HTTP/1.x request line
        followed by well-formed header lines, 405 for a method other than
        GET.
    """
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise _BadRequest(400, "request is not ASCII") from None
    lines = text.replace("\r\n", "\n").split("\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not all(parts):
        raise _BadRequest(400, f"malformed request line {lines[0][:100]!r}")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise _BadRequest(400, f"unsupported protocol {version[:20]!r}")
    if not method.isalpha() or not method.isupper():
        raise _BadRequest(400, f"malformed method {method[:20]!r}")
    for line in lines[1:]:
        if not line:
            continue
        name, sep, _ = line.partition(":")
        if not sep or not name or name != name.strip() or any(c in name for c in " \t"):
            raise _BadRequest(400, f"malformed header line {line[:100]!r}")
        if not line.replace("\t", " ").isprintable():
            raise _BadRequest(400, "control character in a header")
    if not target.startswith("/") or not target.isprintable():
        raise _BadRequest(400, f"malformed path {target[:100]!r}")
    if method != "GET":
        raise _BadRequest(405, f"method {method} not allowed, only GET")
    return target.partition("?")[0]


def _response(code: int, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.1 {code} {_REASONS.get(code, 'Error')}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _error_response(code: int, msg: str) -> bytes:
    return _response(code, (msg + "\n").encode("utf-8", "replace"), "text/plain; charset=utf-8")


def _listen(port: int) -> socket.socket:
    """A listening socket on every interface: IPv6 with IPv4-mapped
    addresses, or IPv4 where the host has no IPv6."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        except OSError:
            pass
        host = "::"
    except OSError:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        host = "0.0.0.0"
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass
class _Session:
    """One live session, as :meth:`ParameterServer.sessions` shows it."""

    session_id: str
    state: str = "configuring"  # "configuring", then "serving"
    pg: Optional[ProcessGroup] = None
    thread: Optional[threading.Thread] = None
    started: float = field(default_factory=time.monotonic)


class ParameterServer(ABC):
    """A threaded parameter server: each client session gets a process
    group of two and a thread running :meth:`forward`.

    Subclasses implement :meth:`forward` and may override
    :meth:`new_process_group` (ProcessGroupTCP by default; ProcessGroupGloo
    to serve torchft clients, or set ``backend = "gloo"``).  The limits
    below are class attributes so a subclass can change them; the client
    side (:meth:`new_session`) reads them from the class it is called on.

    Args:
        port: the HTTP port (0: any free port; :meth:`address` tells it).
        store_port: the port of the session store (0: any free port).
    """

    #: the default process group kind: "tcp" (ProcessGroupTCP) or "gloo"
    backend: str = "tcp"
    #: bounds each side's session setup (store exchange and process group
    #: configuration), and the default process group's operations
    session_timeout: timedelta = timedelta(seconds=60)
    #: a request's line and headers must arrive within this; it also bounds
    #: writing the reply and the client's whole HTTP exchange
    request_timeout: timedelta = timedelta(seconds=10)
    #: the largest request head (line and headers) the server reads
    max_request_bytes: int = 8192
    #: connections being read at once; more get 503
    max_pending: int = 64
    #: sessions alive at once; more get 503
    max_sessions: int = 256

    def __init__(self, port: int, store_port: int = 0) -> None:
        """Starts the session store and the HTTP server.

        Args:
            port: the port to bind the HTTP server to (0: any).
            store_port: the port to bind the session store to (0: any).
        """
        if self.backend not in ("tcp", "gloo"):
            raise ValueError(f"backend must be 'tcp' or 'gloo', got {self.backend!r}")
        self.store = TCPStore(
            host_name="0.0.0.0",
            port=store_port,
            is_master=True,
            wait_for_workers=False,
        )
        self._hostname = socket.gethostname()
        self._lock = threading.Lock()
        self._sessions: Dict[str, _Session] = {}
        self._pending = 0
        self._closed = False
        self._stats = {
            "requests": 0,  # connections accepted
            "refused": 0,  # answered with an HTTP error
            "sessions_started": 0,  # answered 200
            "sessions_failed": 0,  # setup or forward raised
            "sessions_finished": 0,  # forward returned
        }
        self._sock = _listen(port)
        self._sock.setblocking(False)
        ref = weakref.ref(self)

        def close_in_child() -> None:
            # a forked child (a DataLoader worker) must not hold the port
            me = ref()
            if me is not None:
                try:
                    me._sock.close()
                except OSError:
                    pass

        os.register_at_fork(after_in_child=close_in_child)
        self._thread = threading.Thread(
            target=self._accept_loop, name="stepguard-ps-accept", daemon=True
        )
        self._thread.start()
        logger.info("started parameter server on %s", self.address())

    # -- addresses and state ----------------------------------------------------

    def address(self) -> str:
        """The HTTP address that creates a new session on this server.

        Returns:
            ``http://HOST:PORT/new_session``.
        """
        port = self._sock.getsockname()[1]
        return f"http://{self._hostname}:{port}{SESSION_PATH}"

    def sessions(self) -> List[str]:
        """The ids of the sessions alive now (being set up or serving)."""
        with self._lock:
            return list(self._sessions)

    def stats(self) -> Dict[str, int]:
        """Counters since start: ``requests`` (connections accepted),
        ``refused`` (answered with an HTTP error), ``sessions_started``,
        ``sessions_failed`` (setup or ``forward`` raised) and
        ``sessions_finished`` (``forward`` returned)."""
        with self._lock:
            return dict(self._stats)

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    # -- process groups ----------------------------------------------------------

    @classmethod
    def new_process_group(cls) -> ProcessGroup:
        """A new, unconfigured process group for one side of a session.

        Both sides of a session must build the same kind.  The default is
        ProcessGroupTCP (``backend = "tcp"``) or ProcessGroupGloo
        (``backend = "gloo"``, what a torchft peer speaks), each with
        ``session_timeout`` as its deadline; override it for anything else.

        Returns:
            A process group that :func:`reconfigure_with_store` can set up.
        """
        if cls.backend == "gloo":
            from stepguard.process_group import ProcessGroupGloo

            return ProcessGroupGloo(timeout=cls.session_timeout)
        if cls.backend == "tcp":
            from stepguard.process_group_tcp import ProcessGroupTCP

            return ProcessGroupTCP(timeout=cls.session_timeout)
        raise ValueError(f"backend must be 'tcp' or 'gloo', got {cls.backend!r}")

    @classmethod
    def new_session(cls, address: str) -> ProcessGroup:
        """Starts a session on the server at ``address`` and returns a
        process group configured for it: the client is rank 1, the server
        rank 0.

        Bounded: the HTTP exchange by ``request_timeout``, the setup by
        ``session_timeout``.

        Args:
            address: the server's :meth:`address`.

        Returns:
            The session's process group (shut it down when done).

        Raises:
            ConnectionError: the server refused the session or its reply
                was not a session.
            ValueError: the server's process group kind differs from ours.
            Exception: the setup failed (timeout, peer gone).
        """
        session_id, store_addr, backend = cls._request_session(address)
        logger.info("connecting to session %s at %s", session_id, store_addr)
        pg = cls.new_process_group()
        try:
            ours = pg.getBackendName()
            if backend is not None and backend != ours:
                raise ValueError(
                    f"the parameter server at {address} uses {backend} process "
                    f"groups and this client {ours}; both sides must use the same"
                )
            if backend is None and ours == "stepguard-tcp":
                raise ValueError(
                    f"the parameter server at {address} is torchft's (its reply "
                    "names no backend), which ProcessGroupTCP cannot talk to: use "
                    "ProcessGroupGloo on both sides"
                )
            reconfigure_with_store(pg, store_addr, 1, 2, timeout=cls.session_timeout)
        except BaseException:
            try:
                pg.shutdown()
            except Exception as e:  # noqa: BLE001 - the first error matters
                logger.warning("shutting down the failed session's group: %s", e)
            raise
        return pg

    @classmethod
    def _request_session(cls, address: str) -> Tuple[str, str, Optional[str]]:
        """The HTTP half of :meth:`new_session`: (session id, store
        address, the server's backend name or None)."""
        timeout = cls.request_timeout.total_seconds()
        deadline = time.monotonic() + timeout
        try:
            with urllib.request.urlopen(address, timeout=timeout) as f:
                body = b""
                # read() alone would wait out a server that trickles bytes
                while len(body) <= _MAX_REPLY_BYTES:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"parameter server {address} did not finish its reply in {timeout} s"
                        )
                    chunk = f.read1(_MAX_REPLY_BYTES + 1 - len(body))
                    if not chunk:
                        break
                    body += chunk
        except urllib.error.HTTPError as e:
            detail = e.read(1024).decode("utf-8", "replace").strip()
            raise ConnectionError(
                f"parameter server {address} refused the session: {e.code} {detail}"
            ) from None
        if len(body) > _MAX_REPLY_BYTES:
            raise ConnectionError(f"parameter server {address}: reply over {_MAX_REPLY_BYTES} bytes")
        try:
            data = json.loads(body)
            session_id, store_addr = data["session_id"], data["store_addr"]
            backend = data.get("backend")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConnectionError(
                f"parameter server {address} sent no session: {body[:200]!r} ({e})"
            ) from None
        if not isinstance(session_id, str) or not isinstance(store_addr, str):
            raise ConnectionError(f"parameter server {address} sent a malformed session: {data!r}")
        if backend is not None and not isinstance(backend, str):
            raise ConnectionError(f"parameter server {address} sent a malformed backend: {backend!r}")
        return session_id, store_addr, backend

    @abstractmethod
    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        """Serves one session; called once per session in a thread of its
        own.  Loop inside it to serve several operations.

        If it raises (the client died, an operation timed out), the session
        is dropped and its process group shut down; the client must start
        a new session.  The server is rank 0, the client rank 1.

        Args:
            session_id: the session's unique id.
            pg: the session's process group, configured.
        """
        ...

    # -- serving -------------------------------------------------------------------

    #: a refused connection is drained for this long before it is closed,
    #: so that closing it with the request unread does not reset it and
    #: lose the 503 on its way to the client
    _LINGER_S = 1.0
    _MAX_LINGERING = 256

    def _accept_loop(self) -> None:
        """Accepts connections and hands each to a request thread; refuses
        (503) those beyond the limits itself, without a thread, and drains
        them for a moment before closing them."""
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        lingering: Dict[socket.socket, float] = {}
        try:
            while not self._closed:
                try:
                    events = sel.select(timeout=0.2)
                except (OSError, ValueError):
                    if self._closed:
                        return
                    raise
                now = time.monotonic()
                for key, _ in events:
                    if key.fileobj is self._sock:
                        self._accept_one(sel, lingering)
                    else:
                        conn = key.fileobj
                        try:
                            more = conn.recv(65536)  # type: ignore[union-attr]
                        except (BlockingIOError, InterruptedError):
                            continue
                        except OSError:
                            more = b""
                        if not more:
                            lingering[conn] = now  # type: ignore[index]
                for conn, until in list(lingering.items()):
                    if until <= now or self._closed:
                        del lingering[conn]
                        sel.unregister(conn)
                        conn.close()
        finally:
            for conn in lingering:
                conn.close()
            sel.close()

    def _accept_one(self, sel: selectors.BaseSelector, lingering: Dict[socket.socket, float]) -> None:
        try:
            conn, peer = self._sock.accept()
        except (BlockingIOError, InterruptedError, socket.timeout):
            return
        except OSError as e:
            if not self._closed:
                logger.warning("parameter server accept: %s", e)
                time.sleep(0.05)  # out of descriptors: let some close
            return
        self._count("requests")
        with self._lock:
            busy = self._pending >= self.max_pending
            if not busy:
                self._pending += 1
        if not busy:
            try:
                threading.Thread(
                    target=self._handle, args=(conn, peer), name="stepguard-ps-request", daemon=True
                ).start()
                return
            except RuntimeError as e:  # no more threads
                with self._lock:
                    self._pending -= 1
                msg = f"cannot start a thread: {e}"
        else:
            msg = f"{self.max_pending} requests in progress, try again"
        self._count("refused")
        try:
            conn.setblocking(False)
            conn.send(_error_response(503, msg))
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        if len(lingering) >= self._MAX_LINGERING:
            conn.close()
            return
        lingering[conn] = time.monotonic() + self._LINGER_S
        sel.register(conn, selectors.EVENT_READ)

    def _read_head(self, conn: socket.socket) -> bytes:
        """Reads a request head within ``request_timeout`` and
        ``max_request_bytes``."""
        deadline = time.monotonic() + self.request_timeout.total_seconds()
        buf = b""
        while True:
            end = _head_end(buf)
            if end >= 0:
                return buf[:end]
            if len(buf) >= self.max_request_bytes:
                raise _BadRequest(431, f"request head over {self.max_request_bytes} bytes")
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                raise _BadRequest(408, f"request not complete within {self.request_timeout}")
            conn.settimeout(min(left, 0.5))
            try:
                chunk = conn.recv(self.max_request_bytes - len(buf))
            except socket.timeout:
                continue
            if not chunk:
                if not buf:
                    raise ConnectionAbortedError("closed before sending a request")
                raise _BadRequest(400, "truncated request: connection closed before its end")
            buf += chunk

    def _send(self, conn: socket.socket, data: bytes) -> None:
        conn.settimeout(self.request_timeout.total_seconds())
        conn.sendall(data)

    def _close(self, conn: socket.socket) -> None:
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.close()

    #: after an error answer, the rest of the request is read and dropped
    #: for at most this long (and this many bytes) before the close
    _LINGER_CLOSE_S = 2.0
    _LINGER_CLOSE_BYTES = 1 << 20

    def _linger_close(self, conn: socket.socket) -> None:
        """Closes a connection whose request was refused unread: a close
        with unread bytes sends a reset, which can destroy the error answer
        before the client reads it, so the answer is followed by our FIN
        and the rest of the request is drained, within bounds, first."""
        try:
            conn.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + self._LINGER_CLOSE_S
            drained = 0
            while drained < self._LINGER_CLOSE_BYTES and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                conn.settimeout(min(left, 0.5))
                try:
                    chunk = conn.recv(65536)
                except socket.timeout:
                    continue
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass
        conn.close()

    def _handle(self, conn: socket.socket, peer: object) -> None:
        """One connection: read and check the request, answer it, and, for
        a session, become the session's thread."""
        session: Optional[_Session] = None
        refused = False
        try:
            try:
                path = _parse_request(self._read_head(conn))
                if path != SESSION_PATH:
                    raise _BadRequest(400, f"invalid path, got {path[:200]}, expected {SESSION_PATH}")
                session, reply = self._open_session()
                self._send(conn, reply)
            except _BadRequest as e:
                refused = True
                self._count("refused")
                logger.info("parameter server: refused a request from %s: %d %s", peer, e.code, e)
                try:
                    self._send(conn, _error_response(e.code, str(e)))
                except OSError:
                    pass
                if session is not None:
                    self._end_session(session, failed=True)
                    session = None
                return
            except OSError as e:
                logger.info("parameter server: request from %s: %s", peer, e)
                if session is not None:
                    self._end_session(session, failed=True)
                    session = None
                return
            finally:
                if refused:
                    self._linger_close(conn)
                else:
                    self._close(conn)
                with self._lock:
                    self._pending -= 1
        except BaseException:
            logger.exception("parameter server: request from %s", peer)
            return
        if session is not None:
            self._serve_session(session)

    def _open_session(self) -> Tuple[_Session, bytes]:
        """Registers a new session and its process group; returns it with
        the reply that tells the client where to meet it."""
        session = _Session(str(uuid.uuid4()))
        with self._lock:
            if self._closed:
                raise _BadRequest(503, "the parameter server is shutting down")
            if len(self._sessions) >= self.max_sessions:
                raise _BadRequest(503, f"{len(self._sessions)} sessions alive, the most allowed")
            self._sessions[session.session_id] = session
        try:
            session.pg = self.new_process_group()
            backend = session.pg.getBackendName()
        except Exception as e:
            self._end_session(session, failed=None)
            logger.exception("parameter server: new_process_group failed")
            raise _BadRequest(500, f"the server could not make a process group: {e}") from None
        session.thread = threading.current_thread()
        reply = {
            "session_id": session.session_id,
            "store_addr": f"{self._hostname}:{self.store.port}/session/{session.session_id}",
            "backend": backend,
        }
        body = (json.dumps(reply) + "\n").encode()
        self._count("sessions_started")
        logger.info("creating new session %s", session.session_id)
        return session, _response(200, body, "application/json")

    def _serve_session(self, session: _Session) -> None:
        """Sets the session's process group up (rank 0) and runs forward."""
        sid = session.session_id
        pg = session.pg
        assert pg is not None
        failed = True
        try:
            try:
                self._setup(sid, pg)
            finally:
                self._forget_keys(sid)
            with self._lock:
                session.state = "serving"
                closed = self._closed
            if closed:
                raise RuntimeError("the parameter server shut down")
            self.forward(sid, pg)
            failed = False
        except Exception as e:  # noqa: BLE001 - one session's failure
            logger.warning("parameter server: session %s dropped: %s", sid, e)
        finally:
            self._end_session(session, failed=failed)

    def _setup(self, sid: str, pg: ProcessGroup) -> None:
        """The server's half of :func:`reconfigure_with_store` (the same
        keys), on the store it hosts, waiting in short slices so that
        :meth:`shutdown` stops it; bounded by ``session_timeout``."""
        deadline = time.monotonic() + self.session_timeout.total_seconds()
        store = PrefixStore(f"session/{sid}", self.store)
        store.set("handle/0", pg.get_reconfigure_handle())
        store.set("uuid", str(uuid.uuid4().int & ((1 << 63) - 1)))
        keys = ["uuid", "handle/0", "handle/1"]
        # polled, not store.wait: a wait cannot be interrupted, and each
        # slice of one that times out logs a warning from torch
        pause = 0.0005
        while not store.check(keys):
            if self._closed:
                raise RuntimeError("the parameter server shut down")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"the client did not join within {self.session_timeout}"
                )
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.005)
        values = store.multi_get(keys)
        opts = ReconfigureOptions()
        opts.uuid = int(values[0])
        opts.handles = [v.decode("utf-8", "replace") for v in values[1:]]
        opts.timeout = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        pg.reconfigure(opts).wait()

    def _forget_keys(self, sid: str) -> None:
        """Deletes a session's store keys: both sides read them before
        either's group is configured, so they are garbage after."""
        for key in ("uuid", "handle/0", "handle/1"):
            try:
                self.store.delete_key(f"session/{sid}/{key}")
            except Exception as e:  # noqa: BLE001 - only a leak
                logger.debug("deleting session key %s: %s", key, e)

    def _end_session(self, session: _Session, failed: Optional[bool]) -> None:
        """Forgets a session and shuts its group down; ``failed`` None: it
        never started (not counted)."""
        with self._lock:
            self._sessions.pop(session.session_id, None)
            if failed is not None:
                self._stats["sessions_failed" if failed else "sessions_finished"] += 1
        pg = session.pg
        if pg is not None:
            try:
                pg.shutdown()
            except Exception as e:  # noqa: BLE001 - the session is over
                logger.warning("session %s: shutting its group down: %s", session.session_id, e)

    # -- shutdown --------------------------------------------------------------------

    def shutdown(self, timeout: Optional[timedelta] = None) -> None:
        """Stops accepting, aborts every session's process group where an
        abort ends operations in flight (ProcessGroupTCP; a Gloo session
        ends at its operation's deadline), and waits up to ``timeout``
        (``session_timeout`` by default) for the session threads.

        Args:
            timeout: how long to wait for the session threads.
        """
        with self._lock:
            self._closed = True
            sessions = list(self._sessions.values())
        try:
            self._sock.close()
        except OSError:
            pass
        self._thread.join(timeout=5)
        for s in sessions:
            pg = s.pg
            if pg is not None and getattr(pg, "abort_ends_operations", True):
                try:
                    pg.abort()
                except Exception as e:  # noqa: BLE001
                    logger.warning("session %s: abort: %s", s.session_id, e)
        deadline = time.monotonic() + (timeout or self.session_timeout).total_seconds()
        for s in sessions:
            t = s.thread
            if t is not None and t is not threading.current_thread():
                t.join(timeout=max(0.0, deadline - time.monotonic()))
