"""stepguard.checkpointing: HTTPTransport round trips, interop with torchft's
HTTPTransport in both directions, hostile requests, PGTransport, RWLock."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.parse
from datetime import timedelta
from typing import Callable, List

import pytest
import torch
from torch.distributed import TCPStore

from stepguard.checkpointing import CheckpointTransport, HTTPTransport, PGTransport
from stepguard.checkpointing._rwlock import RWLock
from stepguard.process_group import ProcessGroupGloo

TD = timedelta(seconds=10)


def state(step: int = 5) -> dict:
    base = torch.arange(12.0)
    return {
        "user": {
            "default": {
                "w": base.view(3, 4)[:, 1:3],  # a strided view
                "b": torch.ones(2, dtype=torch.bfloat16),
                "i": torch.tensor([1, 2, 3]),
                "lr": 0.1,
                "name": "model",
                "nested": [torch.zeros(1), {"k": 7}],
            }
        },
        "torchft": {"step": step, "batches_committed": 9},
    }


def assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b):  # type: ignore[call-overload]
            assert_same(x, y)
    else:
        assert a == b


@pytest.fixture
def transports():
    made: List[CheckpointTransport] = []

    def make(cls=HTTPTransport, timeout=TD, num_chunks=0):
        t = cls(timeout=timeout, num_chunks=num_chunks)
        made.append(t)
        return t

    yield make
    for t in made:
        t.shutdown(wait=True)


@pytest.mark.parametrize("num_chunks", [0, 3])
def test_http_round_trip(transports, num_chunks) -> None:
    src = transports(num_chunks=num_chunks)
    dst = transports(num_chunks=num_chunks)
    sd = state()
    src.send_checkpoint([1], 5, sd, TD)
    got = dst.recv_checkpoint(0, src.metadata(), 5, TD)
    assert_same(sd, got)
    assert got["user"]["default"]["w"].stride() == (4, 1)


def test_http_metadata_format(transports) -> None:
    t = transports()
    m = t.metadata()
    u = urllib.parse.urlparse(m)
    assert u.scheme == "http" and u.path == "/checkpoint/" and u.port


def test_http_wrong_step_is_a_clear_error(transports) -> None:
    src, dst = transports(), transports()
    src.send_checkpoint([1], 5, state(), TD)
    with pytest.raises(urllib.error.HTTPError, match="Error 400.*serving 5 but got step=6") as e:
        dst.recv_checkpoint(0, src.metadata(), 6, TD)
    # torchft's type and code, the server's message as reason, and the URL
    assert e.value.code == 400
    assert e.value.reason == "invalid checkpoint requested, serving 5 but got step=6"
    assert f"{src.metadata()}6/full" in str(e.value)


def test_http_unreachable_or_zero_timeout_is_a_urlerror(transports) -> None:
    src, dst = transports(), transports()
    src.send_checkpoint([1], 5, state(), TD)
    with pytest.raises(urllib.error.URLError, match="urlopen error") as e:
        dst.recv_checkpoint(0, src.metadata(), 5, timedelta(seconds=0))
    assert not isinstance(e.value, urllib.error.HTTPError)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    url = f"http://127.0.0.1:{port}/checkpoint/"
    with pytest.raises(urllib.error.URLError, match="urlopen error") as e:
        dst.recv_checkpoint(0, url, 5, TD)
    assert isinstance(e.value.reason, ConnectionRefusedError)
    assert f"{url}5/full" in str(e.value)


def test_http_locking_bookkeeping(transports) -> None:
    t = transports()
    assert t._checkpoint_lock.w_locked() and t._disallowed and t._step == -1
    t.allow_checkpoint(1)
    assert not t._checkpoint_lock.w_locked() and not t._disallowed and t._step == 1
    t.disallow_checkpoint()
    t.disallow_checkpoint()
    assert t._checkpoint_lock.w_locked() and t._disallowed and t._step == 1
    t.send_checkpoint([1], 3, state(3), TD)
    assert not t._checkpoint_lock.w_locked() and t._step == 3


def test_http_nothing_served_before_send_or_after_disallow(transports) -> None:
    src = transports(timeout=timedelta(milliseconds=300))
    dst = transports(timeout=timedelta(seconds=5))
    with pytest.raises(urllib.error.HTTPError, match="Error 503"):
        dst.recv_checkpoint(0, src.metadata(), -1, timedelta(seconds=5))
    src.send_checkpoint([1], 2, state(2), TD)
    dst.recv_checkpoint(0, src.metadata(), 2, TD)
    src.disallow_checkpoint()
    src.disallow_checkpoint()  # idempotent
    with pytest.raises(urllib.error.HTTPError, match="Error 503"):
        dst.recv_checkpoint(0, src.metadata(), 2, timedelta(seconds=5))


def test_http_request_waits_for_allow(transports) -> None:
    src, dst = transports(), transports()
    sd = state(3)
    out: list = []
    th = threading.Thread(
        target=lambda: out.append(dst.recv_checkpoint(0, src.metadata(), 3, TD)), daemon=True
    )
    th.start()
    time.sleep(0.2)
    assert out == []  # still waiting: nothing is served yet
    src.send_checkpoint([1], 3, sd, TD)
    th.join(10)
    assert not th.is_alive()
    assert_same(sd, out[0])


def test_http_interop_torchft_fetches_from_us(transports) -> None:
    tf_http = pytest.importorskip("torchft.checkpointing.http_transport")
    ours = transports()
    theirs = transports(cls=tf_http.HTTPTransport)
    sd = state(4)
    ours.send_checkpoint([1], 4, sd, TD)
    assert_same(sd, theirs.recv_checkpoint(0, ours.metadata(), 4, TD))


def test_http_interop_we_fetch_from_torchft(transports) -> None:
    tf_http = pytest.importorskip("torchft.checkpointing.http_transport")
    ours = transports()
    theirs = transports(cls=tf_http.HTTPTransport)
    sd = state(8)
    theirs.send_checkpoint([1], 8, sd, TD)
    assert_same(sd, ours.recv_checkpoint(0, theirs.metadata(), 8, TD))


@pytest.mark.parametrize("num_chunks", [2])
def test_http_interop_chunked_both_ways(transports, num_chunks) -> None:
    tf_http = pytest.importorskip("torchft.checkpointing.http_transport")
    ours = transports(num_chunks=num_chunks)
    theirs = transports(cls=tf_http.HTTPTransport, num_chunks=num_chunks)
    sd = state(1)
    ours.send_checkpoint([1], 1, sd, TD)
    theirs.send_checkpoint([1], 1, sd, TD)
    assert_same(sd, theirs.recv_checkpoint(0, ours.metadata(), 1, TD))
    assert_same(sd, ours.recv_checkpoint(0, theirs.metadata(), 1, TD))


def raw(port: int, data: bytes, read: bool = True, timeout: float = 5) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if not read:
            return b""
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            c = s.recv(65536)
            if not c:
                break
            chunks.append(c)
        return b"".join(chunks)


def test_http_survives_hostile_requests(transports) -> None:
    src = transports(timeout=timedelta(seconds=1))
    dst = transports()
    sd = state(5)
    src.send_checkpoint([1], 5, sd, TD)
    port = urllib.parse.urlparse(src.metadata()).port
    assert port
    cases = {
        b"\x00\xff garbage\r\n\r\n": b"400",
        b"GET /checkpoint/5 HTTP/1.1\r\nHost: x\r\n\r\n": b"400",
        b"GET /nope/5/full HTTP/1.1\r\nHost: x\r\n\r\n": b"400",
        b"GET /checkpoint/x/full HTTP/1.1\r\nHost: x\r\n\r\n": b"400",
        b"GET /checkpoint/5/99 HTTP/1.1\r\nHost: x\r\n\r\n": b"404",
        b"GET /checkpoint/5/-1 HTTP/1.1\r\nHost: x\r\n\r\n": b"404",
        b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n": b"414",
        b"POST /checkpoint/5/full HTTP/1.1\r\nHost: x\r\n\r\n": b"501",
    }
    for req, code in cases.items():
        resp = raw(port, req)
        # Garbage without an HTTP version gets an HTTP/0.9 style answer (no
        # status line), so look for the code in the whole response.
        head = resp.split(b" ", 2)[1] if resp.startswith(b"HTTP/") else resp
        assert code in head, (req[:40], resp[:80])
    # Truncated request and a peer that goes away mid-response.
    raw(port, b"GET /checkpoint/5/fu", read=False)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /checkpoint/5/full HTTP/1.1\r\nHost: x\r\n\r\n")
        s.recv(10)
    # A slow peer that never finishes its request does not block others.
    slow = socket.create_connection(("127.0.0.1", port), timeout=5)
    slow.sendall(b"GET /checkp")
    try:
        assert_same(sd, dst.recv_checkpoint(0, src.metadata(), 5, TD))
        # The slow peer is cut off after the request timeout (1 s).
        slow.settimeout(5)
        deadline = time.monotonic() + 5
        closed = False
        while time.monotonic() < deadline:
            try:
                if slow.recv(100) == b"":
                    closed = True
                    break
            except (ConnectionResetError, socket.timeout):
                closed = True
                break
        assert closed, "the server kept a silent peer open past its timeout"
    finally:
        slow.close()
    assert_same(sd, dst.recv_checkpoint(0, src.metadata(), 5, TD))


def test_http_unreachable_source_fails_in_time(transports) -> None:
    dst = transports()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)  # accepts, never answers
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(Exception):
            dst.recv_checkpoint(0, f"http://127.0.0.1:{port}/checkpoint/", 1,
                                timedelta(milliseconds=500))
        assert time.monotonic() - t0 < 8


def test_http_shutdown_nowait_stops_serving(transports) -> None:
    t = HTTPTransport(timeout=TD, num_chunks=0)
    port = urllib.parse.urlparse(t.metadata()).port
    t.shutdown(wait=False)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            time.sleep(0.05)
        except OSError:
            break
    else:
        pytest.fail("the server still accepts connections 10 s after shutdown")


def test_pg_transport_round_trip_in_place() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pgs = [ProcessGroupGloo(timeout=TD) for _ in range(2)]
    sd = state(5)
    # The receiver already holds tensors of the same storage size at the
    # same paths: they must be filled in place.
    mine = state(0)
    for k in ("b", "i"):
        mine["user"]["default"][k] = torch.zeros_like(sd["user"]["default"][k])
    mine["user"]["default"]["w"] = torch.zeros(12).view(3, 4)[:, 1:3]
    own_w = mine["user"]["default"]["w"]
    out: list = []

    def rank(r: int) -> None:
        pgs[r].configure(f"127.0.0.1:{store.port}/pgt", "0", r, 2)
        if r == 0:
            PGTransport(pgs[0], TD, torch.device("cpu")).send_checkpoint([1], 5, sd, TD)
        else:
            t = PGTransport(pgs[1], TD, torch.device("cpu"), state_dict=lambda: mine)
            assert t.metadata() == "<n/a>"
            out.append(t.recv_checkpoint(0, "<n/a>", 5, TD))

    ths = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
        assert not th.is_alive()
    got = out[0]
    assert_same(sd, got)
    # Received in place: the returned tensor shares the storage we offered.
    assert got["user"]["default"]["w"].untyped_storage().data_ptr() == \
        own_w.untyped_storage().data_ptr()
    assert torch.equal(own_w, sd["user"]["default"]["w"])
    for p in pgs:
        p.shutdown()


def test_pg_transport_wrong_step_raises() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pgs = [ProcessGroupGloo(timeout=TD) for _ in range(2)]
    errs: list = []

    def rank(r: int) -> None:
        pgs[r].configure(f"127.0.0.1:{store.port}/pgs", "0", r, 2)
        t = PGTransport(pgs[r], TD, torch.device("cpu"))
        if r == 0:
            t.send_checkpoint([1], 5, {"x": 1}, TD)
        else:
            try:
                t.recv_checkpoint(0, "<n/a>", 6, TD)
            except RuntimeError as e:
                errs.append(e)

    ths = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
        assert not th.is_alive()
    assert len(errs) == 1 and "step 6" in str(errs[0])


def test_rwlock() -> None:
    lock = RWLock(timeout=0.2)
    with lock.r_lock():
        with lock.r_lock():  # readers share
            with pytest.raises(TimeoutError, match="wlock"):
                lock.w_acquire()
    lock.w_acquire()
    assert lock.w_locked()
    with pytest.raises(TimeoutError, match="rlock"):
        lock.r_acquire()
    # Another thread may release the write side.
    th = threading.Thread(target=lock.w_release)
    th.start()
    th.join(5)
    assert not lock.w_locked()
    with lock.w_lock():
        assert lock.w_locked()
    with pytest.raises(RuntimeError):
        lock.w_release()
    with pytest.raises(RuntimeError):
        lock.r_release()
    waiter: List[Callable[[], None]] = []
    lock.w_acquire()
    th = threading.Thread(target=lambda: (RWLock.r_acquire(lock), waiter.append(lambda: None)))
    th.start()
    time.sleep(0.05)
    assert waiter == []
    lock.w_release()
    th.join(5)
    assert len(waiter) == 1


@pytest.mark.parametrize("body", [b"garbage" * 100, b"", "truncated"])
def test_http_bad_source_fails_cleanly(transports, body) -> None:
    """A source that answers 200 with garbage, nothing, or a cut-off
    checkpoint makes recv_checkpoint raise (not hang, not return junk)."""
    if body == "truncated":
        src = transports()
        src.send_checkpoint([1], 1, state(1), TD)
        port = urllib.parse.urlparse(src.metadata()).port
        full = raw(port, b"GET /checkpoint/1/full HTTP/1.0\r\n\r\n")
        head, _, payload = full.partition(b"\r\n\r\n")
        body = payload[: len(payload) // 2]
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]

    def serve() -> None:
        try:
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(5)
                conn.recv(65536)
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-type: application/octet-stream\r\n\r\n" + body)
        except OSError:
            pass

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    dst = transports()
    t0 = time.monotonic()
    with pytest.raises(Exception):
        dst.recv_checkpoint(0, f"http://127.0.0.1:{port}/checkpoint/", 1, timedelta(seconds=5))
    assert time.monotonic() - t0 < 8
    th.join(10)
    srv.close()
