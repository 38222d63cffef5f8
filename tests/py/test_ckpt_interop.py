"""NativeTransport and torchft's HTTPTransport in one job: the metadata a
NativeTransport advertises is an http:// URL that torchft's HTTPTransport
fetches from as it is (whole and in chunks), while ours reads the native
address out of it and fetches natively; old sgckpt:// metadata still works;
the HTTP side follows the native serving rules (waits before the first
serve, stops at disallow, cuts a reader that holds disallow past its
deadline), refuses torchft peers with 403 when a token is set, and survives
garbage, truncated, oversized and slow requests.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch
from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTP

from stepguard.checkpointing.http_transport import HTTPTransport, _Staged, _StateServer
from stepguard.checkpointing.native_transport import (
    NativeTransport,
    native_address,
    parse_sources,
)
from test_ckpt import assert_identical, many_dtypes_state

T2 = timedelta(seconds=2)
T5 = timedelta(seconds=5)
T30 = timedelta(seconds=30)


@pytest.fixture
def src():
    t = NativeTransport(T5, hostname="127.0.0.1")
    try:
        yield t
    finally:
        t.shutdown()


def _torchft(num_chunks: int = 0) -> TorchftHTTP:
    return TorchftHTTP(T30, num_chunks=num_chunks)


def _http_port(meta: str) -> int:
    return int(meta.split("/")[2].rsplit(":", 1)[1])


def _raw(port: int, data: bytes, *, read_s: float = 10.0) -> bytes:
    """Sends ``data`` on a fresh connection, half-closes, returns all it got."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_s) as s:
        try:
            if data:
                s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except (ConnectionResetError, BrokenPipeError, OSError) as e:
            # a server that closes at once (connection limit) with our bytes
            # unread resets the connection: whatever it sent is still read below
            if not isinstance(e, (ConnectionResetError, BrokenPipeError)) and e.errno != errno.ENOTCONN:
                raise
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return out


def _status(resp: bytes) -> int:
    if not resp.startswith(b"HTTP/1."):
        # an HTTP/0.9-style request line gets the error page alone
        assert b"Error code: " in resp, resp[:100]
        return int(resp.split(b"Error code: ", 1)[1][:3])
    return int(resp.split(b" ", 2)[1])


# ---- metadata ---------------------------------------------------------------


def test_metadata_round_trip(src) -> None:
    meta = src.metadata()
    native = src._server.port()
    assert meta.startswith("http://127.0.0.1:") and meta.endswith("/checkpoint/")
    assert f"/sgckpt={native}/" in meta
    assert _http_port(meta) != native
    assert native_address(meta) == f"127.0.0.1:{native}"
    assert src.metadata() == meta  # stable
    # the older form, bare addresses, lists and comma-joined lists
    assert native_address("sgckpt://h:1/") == "h:1"
    assert native_address("h:2") == "h:2"
    assert native_address("http://[::1]:5/sgckpt=6/checkpoint/") == "[::1]:6"
    assert native_address("http://h:5/checkpoint/") is None  # a torchft peer
    torchft_meta = "http://t:9/checkpoint/"
    assert parse_sources(f"sgckpt://a:1,{meta}, {torchft_meta},a:1") == [
        "a:1",
        f"127.0.0.1:{native}",
    ]
    assert parse_sources([meta, meta]) == [f"127.0.0.1:{native}"]
    for bad in ("http://h:1/sgckpt=x/checkpoint/", "http://h:1/sgckpt=70000/c/",
                "http://h:1/sgckpt=0/", "http://:1/sgckpt=5/"):  # fmt: skip
        with pytest.raises(ValueError):
            native_address(bad)
    with pytest.raises(ValueError):
        parse_sources(torchft_meta)  # no native source in it


def test_serve_http_off_keeps_the_old_metadata() -> None:
    t = NativeTransport(T5, hostname="127.0.0.1", serve_http=False)
    try:
        assert t.metadata() == f"sgckpt://127.0.0.1:{t._server.port()}"
        assert t._http is None
    finally:
        t.shutdown()


# ---- torchft healing from us ------------------------------------------------


def test_torchft_fetches_the_whole_state(src) -> None:
    sd = many_dtypes_state()
    src.send_checkpoint([1], 12, sd, T5)
    theirs = _torchft()
    try:
        got = theirs.recv_checkpoint(0, src.metadata(), 12, T30)
    finally:
        theirs.shutdown()
    assert_identical(sd, got)
    # what torchft's own server gives for the same state, bit for bit
    ref_src, ref_dst = _torchft(), _torchft()
    try:
        ref_src.send_checkpoint([1], 12, sd, T5)
        ref = ref_dst.recv_checkpoint(0, ref_src.metadata(), 12, T30)
    finally:
        ref_src.shutdown()
        ref_dst.shutdown()
    assert_identical(ref, got)
    src.disallow_checkpoint()


@pytest.mark.parametrize("n", [1, 3, 7])
def test_torchft_fetches_in_chunks(n) -> None:
    t = NativeTransport(T5, hostname="127.0.0.1", http_chunks=n)
    theirs = _torchft(n)
    try:
        sd = {"a": torch.arange(10), "b": [torch.ones(3), 2.5, "x"], "c": {"d": torch.zeros(2, 2)}}
        t.send_checkpoint([1], 4, sd, T5)
        assert_identical(sd, theirs.recv_checkpoint(0, t.metadata(), 4, T30))
    finally:
        theirs.shutdown()
        t.shutdown()


def test_chunk_count_mismatch_is_a_clear_error(src) -> None:
    src.send_checkpoint([1], 3, {"a": torch.arange(4), "b": torch.ones(2)}, T5)
    theirs = _torchft(2)
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            theirs.recv_checkpoint(0, src.metadata(), 3, T30)
        assert e.value.code == 404
        assert "http_chunks" in e.value.read().decode()
    finally:
        theirs.shutdown()


def test_a_request_before_serving_waits_for_it(src) -> None:
    meta = src.metadata()
    theirs = _torchft()
    out: list = []
    th = threading.Thread(target=lambda: out.append(theirs.recv_checkpoint(0, meta, 5, T30)))
    try:
        th.start()
        time.sleep(0.3)
        assert not out  # nothing served yet: the request waits
        sd = {"w": torch.randn(100)}
        src.send_checkpoint([1], 5, sd, T5)
        th.join(20)
        assert not th.is_alive()
        assert_identical(sd, out[0])
    finally:
        theirs.shutdown()


def test_wrong_step_and_disallowed_state_are_refused() -> None:
    t = NativeTransport(T2, hostname="127.0.0.1")
    try:
        meta = t.metadata()
        t.send_checkpoint([1], 6, {"w": torch.ones(3)}, T2)
        with pytest.raises(urllib.error.HTTPError) as e:
            TorchftHTTP._load_from_address(f"{meta}7/full", T5)
        assert e.value.code == 400 and "serving 6" in e.value.read().decode()
        t.disallow_checkpoint()
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as e:
            TorchftHTTP._load_from_address(f"{meta}6/full", T5)
        assert e.value.code == 503
        assert time.monotonic() - t0 >= 1.5  # waited for a serve first
    finally:
        t.shutdown()


def test_the_http_side_serves_the_state_served_natively(src) -> None:
    meta = src.metadata()
    for step in (1, 2):
        sd = {"w": torch.full((5,), float(step)), "step": step}
        src.send_checkpoint([1], step, sd, T5)  # the second replaces the first
        got = TorchftHTTP._load_from_address(f"{meta}{step}/full", T5)
        assert_identical(sd, got)
    with pytest.raises(urllib.error.HTTPError):
        TorchftHTTP._load_from_address(f"{meta}1/full", T5)


def test_disallow_waits_for_an_http_reader_then_cuts_it() -> None:
    t = NativeTransport(T2, hostname="127.0.0.1")
    try:
        t.send_checkpoint([1], 2, {"w": torch.ones(16 << 20)}, T2)  # 64 MiB
        s = socket.create_connection(("127.0.0.1", _http_port(t.metadata())), timeout=10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        path = t.metadata().split("/", 3)[3]
        s.sendall(f"GET /{path}2/full HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert s.recv(16).startswith(b"HTTP/1.0 200")  # then never reads
        while t._http._readers == 0:
            time.sleep(0.01)
        t0 = time.monotonic()
        t.disallow_checkpoint()
        dt = time.monotonic() - t0
        assert 1.5 <= dt < 30, dt  # waited out the 2 s timeout, then cut
        assert t._http._readers == 0
        s.close()
        # serving again works
        sd = {"w": torch.zeros(3)}
        t.send_checkpoint([1], 3, sd, T2)
        assert_identical(sd, TorchftHTTP._load_from_address(f"{t.metadata()}3/full", T5))
    finally:
        t.shutdown()


def test_disallow_does_not_wait_without_http_readers() -> None:
    t = NativeTransport(timedelta(seconds=60), hostname="127.0.0.1")
    try:
        meta = t.metadata()  # the HTTP side is up
        sd = {"w": torch.ones(4)}
        t.send_checkpoint([1], 1, sd, T5)
        assert_identical(sd, TorchftHTTP._load_from_address(f"{meta}1/full", T5))
        t0 = time.monotonic()
        t.disallow_checkpoint()
        assert time.monotonic() - t0 < 30  # waiting out the 60 s timeout would show
    finally:
        t.shutdown()


# ---- ours healing natively from the new metadata ----------------------------


def test_ours_fetches_natively_from_the_http_metadata(src) -> None:
    sd = many_dtypes_state()
    src.send_checkpoint([1], 12, sd, T5)
    dst = NativeTransport(T5, hostname="127.0.0.1")
    try:
        got = dst.recv_checkpoint(0, src.metadata(), 12, T30)
        assert_identical(sd, got)
        assert sum(dst.last_recv_bytes) > 0
        assert src.stats()["requests"] > 0  # the native server served it
        assert src._http is not None and src._http._server.active == 0
    finally:
        dst.shutdown()
        src.disallow_checkpoint()


def test_ours_stripes_over_new_and_old_metadata_and_skips_torchft() -> None:
    a = NativeTransport(T5, hostname="127.0.0.1")
    b = NativeTransport(T5, hostname="127.0.0.1", serve_http=False)
    theirs = _torchft()
    dst = NativeTransport(T5, hostname="127.0.0.1", streams_per_source=1)
    try:
        sd = {"w": torch.randn(4 << 20, generator=torch.Generator().manual_seed(1))}
        for t in (a, b, theirs):
            t.send_checkpoint([1], 9, sd, T5)
        metas = [theirs.metadata(), a.metadata(), b.metadata()]
        assert metas[2].startswith("sgckpt://")
        got = dst.recv_checkpoint_striped(metas, 9, T30)
        assert_identical(sd, got)
        assert len(dst.last_recv_bytes) == 2 and sum(dst.last_recv_bytes) == 16 << 20
        got = dst.recv_checkpoint(0, ",".join(metas[1:]), 9, T30)
        assert_identical(sd, got)
        # only a torchft source: its HTTP format
        assert_identical(sd, dst.recv_checkpoint(0, metas[0], 9, T30))
    finally:
        for t in (a, b, theirs, dst):
            t.shutdown()


def test_ours_heals_from_our_http_side_too(src) -> None:
    # a stepguard HTTPTransport healer (torchft's format) fetches from us too
    sd = {"w": torch.arange(6.0), "k": "v"}
    src.send_checkpoint([1], 2, sd, T5)
    h = HTTPTransport(T30, num_chunks=0)
    try:
        assert_identical(sd, h.recv_checkpoint(0, src.metadata(), 2, T30))
    finally:
        h.shutdown()


# ---- auth -------------------------------------------------------------------


def test_with_a_token_torchft_gets_403_and_ours_fetches_natively() -> None:
    a = NativeTransport(T5, hostname="127.0.0.1", auth_token="tok")
    b = NativeTransport(T5, hostname="127.0.0.1", auth_token="tok")
    theirs = _torchft()
    try:
        sd = {"w": torch.randn(10)}
        a.send_checkpoint([1], 1, sd, T5)
        with pytest.raises(urllib.error.HTTPError) as e:
            theirs.recv_checkpoint(0, a.metadata(), 1, T30)
        assert e.value.code == 403 and "auth token" in e.value.read().decode()
        assert_identical(sd, b.recv_checkpoint(0, a.metadata(), 1, T30))
        c = NativeTransport(T5, hostname="127.0.0.1", auth_token="wrong")
        try:
            with pytest.raises(RuntimeError):
                c.recv_checkpoint(0, a.metadata(), 1, T2)
        finally:
            c.shutdown()
    finally:
        for t in (a, b, theirs):
            t.shutdown()


# ---- bad input --------------------------------------------------------------


def test_http_side_survives_bad_requests() -> None:
    t = NativeTransport(T2, hostname="127.0.0.1")
    try:
        meta = t.metadata()
        port = _http_port(meta)
        prefix = "/" + meta.split("/", 3)[3]  # /sgckpt=N/checkpoint/
        sd = {"w": torch.randn(1 << 16)}
        t.send_checkpoint([1], 4, sd, T2)
        cases = {
            b"\x00\xff garbage\r\n\r\n": 400,
            b"GET\r\n\r\n": 400,
            b"POST /checkpoint/4/full HTTP/1.1\r\n\r\n": 501,
            b"GET /checkpoint/x/full HTTP/1.1\r\n\r\n": 400,
            b"GET /checkpoint/99999999999999999999999/full HTTP/1.1\r\n\r\n": 400,
            b"GET /checkpoint/4 HTTP/1.1\r\n\r\n": 400,
            b"GET /checkpoint/4/full/x HTTP/1.1\r\n\r\n": 400,
            b"GET /other/4/full HTTP/1.1\r\n\r\n": 400,
            b"GET /sgckpt=1/checkpoint/4/full HTTP/1.1\r\n\r\n": 400,  # not ours
            b"GET /checkpoint/4/nochunk HTTP/1.1\r\n\r\n": 404,
            b"GET /checkpoint/4/99999999999 HTTP/1.1\r\n\r\n": 404,
            b"GET /checkpoint/5/full HTTP/1.1\r\n\r\n": 400,
            b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n": 414,
            b"GET /checkpoint/4/full HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n": 431,
        }
        for req, code in cases.items():
            assert _status(_raw(port, req)) == code, req[:60]
        # a truncated request line gets 400; nothing at all, no answer
        assert _status(_raw(port, b"GET /checkp")) == 400
        assert _raw(port, b"") == b""
        # a reader that vanishes mid-body
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(f"GET {prefix}4/full HTTP/1.1\r\n\r\n".encode())
            s.recv(10)
        # still serving everyone else, with and without our prefix
        assert _status(_raw(port, f"GET {prefix}4/metadata HTTP/1.1\r\n\r\n".encode())) == 200
        assert_identical(sd, TorchftHTTP._load_from_address(f"{meta}4/full", T5))
        assert_identical(sd, TorchftHTTP._load_from_address(
            f"http://127.0.0.1:{port}/checkpoint/4/full", T5))  # fmt: skip
        t.disallow_checkpoint()
        assert t._http._readers == 0
    finally:
        t.shutdown()


def test_a_slow_request_is_cut() -> None:
    t = NativeTransport(T2, hostname="127.0.0.1")  # headers due within 2 s
    try:
        port = _http_port(t.metadata())
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            t0 = time.monotonic()
            s.sendall(b"GET /checkpoint/1/full HTTP/1.1\r\n")
            got = b"x"
            try:
                while got:  # drip a header byte now and then
                    s.sendall(b"X")
                    time.sleep(0.2)
                    if time.monotonic() - t0 > 15:
                        break
            except OSError:
                got = b""
            dt = time.monotonic() - t0
        assert dt < 10, f"a header dripped for {dt:.1f}s was not cut"
    finally:
        t.shutdown()


def test_connections_beyond_the_limit_are_closed() -> None:
    srv = _StateServer(5.0, host="127.0.0.1", max_conns=2)
    try:
        srv.serve(_Staged(1, [torch.ones(2)], torch.utils._pytree.tree_flatten([torch.ones(2)])[1], {}, 0))
        idle = [socket.create_connection(("127.0.0.1", srv.port()), timeout=5) for _ in range(2)]
        deadline = time.monotonic() + 10
        while srv._server.active < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv._server.active == 2
        assert _raw(srv.port(), b"GET /checkpoint/1/full HTTP/1.1\r\n\r\n") == b""
        for s in idle:
            s.close()
        while srv._server.active and time.monotonic() < deadline:
            time.sleep(0.01)
        got = TorchftHTTP._load_from_address(f"http://127.0.0.1:{srv.port()}/checkpoint/1/full", T5)
        assert torch.equal(got[0], torch.ones(2))
    finally:
        srv.close()


_EXIT_WITHOUT_SHUTDOWN = r"""
import sys
from datetime import timedelta
import torch
from stepguard.checkpointing.native_transport import NativeTransport
t = NativeTransport(timedelta(seconds=30), hostname="127.0.0.1")
print(t.metadata(), flush=True)
t.send_checkpoint([1], 1, {"w": torch.ones(3)}, timedelta(seconds=30))
sys.exit(0)  # no shutdown: the finalizer closes the HTTP side
"""


def test_a_process_exits_without_shutting_the_transport_down(procs) -> None:
    import subprocess

    p = procs.spawn(_EXIT_WITHOUT_SHUTDOWN, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().startswith("http://")
    assert p.wait(timeout=60) == 0


def test_a_forked_child_holds_no_http_socket(src) -> None:
    import os

    src.metadata()
    http = src._http
    pid = os.fork()
    if pid == 0:  # the child: the listening socket is closed here
        os._exit(0 if http._server.socket.fileno() == -1 else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert http._server.socket.fileno() != -1  # and still open here
