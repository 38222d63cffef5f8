"""Hostile input against our lighthouse (the CLI, as a child process).

After every case the lighthouse must still be running and serve a
well-behaved client (an autouse fixture checks a heartbeat and a quorum).
Random input comes from fixed seeds, so every run sends the same bytes.
"""

from __future__ import annotations

import os
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import time

import h2.exceptions
import pytest

from lighthouse_util import (
    H2_PREFACE,
    INVALID_ARGUMENT,
    OURS_CODE,
    RESOURCE_EXHAUSTED,
    UNIMPLEMENTED,
    H2Client,
    LighthouseProc,
    grpc_frame,
    h2_frame,
    http_get,
    http_post,
    pb_bytes,
    pb_heartbeat_request,
    pb_member,
    pb_quorum_request,
    start_ours,
    status,
    td,
)
from stepguard.coordination import LighthouseClient


@pytest.fixture(scope="module")
def lh():
    p = subprocess.Popen([sys.executable, "-c", OURS_CODE, "--bind", "127.0.0.1:0",
                          "--min_replicas", "1"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    try:
        proc = LighthouseProc(p)
        c = LighthouseClient(proc.addr, td(10), auth_token="")
        c.quorum("probe", td(10))  # the first quorum: later ones are fast
        c.close()
        yield proc
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


def assert_serving(lh: LighthouseProc) -> None:
    assert lh.popen.poll() is None, "lighthouse died:\n" + lh.output()[-4000:]
    c = LighthouseClient(lh.addr, td(10), auth_token="")
    try:
        c.heartbeat("probe", td(10))
        q = c.quorum("probe", td(10))
        assert "probe" in [m.replica_id for m in q.participants]
    finally:
        c.close()


@pytest.fixture(autouse=True)
def still_serving(lh):
    yield
    assert_serving(lh)


def raw(lh) -> socket.socket:
    return socket.create_connection(("127.0.0.1", lh.port), timeout=10)


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[str, bytes]:
    """('eof' | 'reset' | 'open', bytes read) after at most `timeout` s."""
    deadline = time.monotonic() + timeout
    got = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return "open", got
        sock.settimeout(left)
        try:
            d = sock.recv(65536)
        except socket.timeout:
            return "open", got
        except ConnectionResetError:
            return "reset", got
        if not d:
            return "eof", got
        got += d


def h2_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream, payload) of the complete frames in `data`."""
    out = []
    while len(data) >= 9:
        n = int.from_bytes(data[:3], "big")
        if len(data) < 9 + n:
            break
        out.append((data[3], data[4], int.from_bytes(data[5:9], "big") & 0x7FFFFFFF,
                    data[9:9 + n]))
        data = data[9 + n:]
    return out


def goaway_code(data: bytes) -> int | None:
    for t, _, _, payload in h2_frames(data):
        if t == 7:
            return int.from_bytes(payload[4:8], "big")
    return None


def send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the server may close while we are still sending


# ---- raw TCP / HTTP/1.1 -------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_garbage_on_tcp(lh, seed):
    rnd = random.Random(seed)
    with raw(lh) as s:
        send_quietly(s, bytes(rnd.getrandbits(8) for _ in range(65536)))
        how, _ = read_until_closed(s, 10)
    assert how in ("eof", "reset")


def test_http1_request_line_then_garbage(lh):
    rnd = random.Random(7)
    with raw(lh) as s:
        send_quietly(s, b"GET / HTTP/1.1\r\n" + bytes(rnd.getrandbits(8) for _ in range(4000)))
        how, got = read_until_closed(s, 10)
    assert how in ("eof", "reset")
    assert got == b"" or got.startswith(b"HTTP/1.1 4"), got[:100]


def test_http1_enormous_header(lh):
    with raw(lh) as s:
        send_quietly(s, b"GET /status HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20)
                     + b"\r\n\r\n")
        how, got = read_until_closed(s, 10)
    assert how in ("eof", "reset")
    assert got == b"" or got.startswith(b"HTTP/1.1 4"), got[:100]


def test_http1_many_headers_and_bad_paths(lh):
    for path in ("/%ff%fe", "/replica/%00/kill", "/" + "a" * 5000, "/replica//kill"):
        code, _, _ = http_get(lh.port, path)
        assert 400 <= code < 500, (path, code)
    hdrs = {f"X-H{i}": "v" for i in range(500)}
    try:
        code, _, _ = http_get(lh.port, "/status", headers=hdrs)
        assert code in (200, 400, 431)
    except (ConnectionError, OSError):
        pass  # closing the connection is an acceptable answer


def test_http1_post_body_too_large(lh):
    code, _, _ = http_get(lh.port, "/status")
    assert code == 200
    try:
        code, _, _ = http_post(lh.port, "/replica/x/kill", body=b"z" * (1 << 20))
        assert code in (404, 413)
    except (ConnectionError, OSError):
        pass


def test_http1_flood_over_the_limit_does_not_block_grpc_and_recovers(procs):
    """More half-sent HTTP/1.1 requests than the HTTP connection limit (256),
    three rounds; gRPC keeps working, and once the flood is closed the
    dashboard answers again.  Its own lighthouse: a wedged HTTP side must
    not spill into the other cases."""
    own = start_ours(procs, "--min_replicas", "1")
    for rnd in range(3):
        socks = []
        try:
            for _ in range(300):
                s = raw(own)
                send_quietly(s, b"GET /status HTTP/1.1\r\nHost: x\r\n")
                socks.append(s)
            assert_serving(own)
        finally:
            for s in socks:
                s.close()
        # At worst a connection whose close went unnoticed is reaped by the
        # HTTP side's 10 s idle timeout; past that, a slot leaked for good.
        t_closed = time.monotonic()
        deadline = t_closed + 15
        while True:
            try:
                if http_get(own.port, "/status", timeout=2)[0] == 200:
                    print(f"round {rnd}: dashboard back after "
                          f"{time.monotonic() - t_closed:.2f} s")
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (
                f"round {rnd}: HTTP side never recovered after the flood closed")
            time.sleep(0.1)
    assert own.popen.poll() is None


# ---- HTTP/2 framing ----------------------------------------------------


@pytest.mark.parametrize("seed", [11, 12])
def test_h2_preface_then_garbage(lh, seed):
    rnd = random.Random(seed)
    with raw(lh) as s:
        send_quietly(s, H2_PREFACE + bytes(rnd.getrandbits(8) for _ in range(5000)))
        how, got = read_until_closed(s, 10)
    assert how in ("eof", "reset")
    if how == "eof":
        assert goaway_code(got) not in (None, 0), h2_frames(got)


@pytest.mark.parametrize("seed", range(21, 27))
def test_h2_well_framed_garbage_frames(lh, seed):
    """Valid frame headers with random types, flags, streams and payloads."""
    rnd = random.Random(seed)
    out = H2_PREFACE + h2_frame(4, 0, 0, b"")
    for _ in range(200):
        out += h2_frame(rnd.randrange(0, 12), rnd.getrandbits(8),
                        rnd.randrange(0, 8),
                        bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(0, 64))))
    with raw(lh) as s:
        send_quietly(s, out)
        read_until_closed(s, 1)


def test_h2_truncated_frame_then_close(lh):
    with raw(lh) as s:
        send_quietly(s, H2_PREFACE + h2_frame(4, 0, 0, b"")
                     + h2_frame(1, 4, 1, b"\x00\x01", declared_len=100))
        how, _ = read_until_closed(s, 0.5)
        assert how == "open"  # waiting for the rest of the frame is fine


def test_h2_data_frame_with_huge_declared_length(lh):
    with raw(lh) as s:
        send_quietly(s, H2_PREFACE + h2_frame(4, 0, 0, b"")
                     + h2_frame(0, 0, 1, b"x" * 10, declared_len=(1 << 24) - 1))
        how, got = read_until_closed(s, 10)
    assert how in ("eof", "reset")
    if how == "eof":
        assert goaway_code(got) == 6, h2_frames(got)  # FRAME_SIZE_ERROR


def test_h2_max_concurrent_streams_held_open(lh):
    """Every stream the server allows, each with an unfinished request."""
    with H2Client(lh.port) as h:
        h.conn.receive_data(b"")  # nothing yet; limits come with SETTINGS
        h.sock.settimeout(10)
        h.conn.receive_data(h.sock.recv(65536))
        h.flush()
        limit = min(h.conn.remote_settings.max_concurrent_streams, 1000)
        for _ in range(limit):
            sid = h.request_headers("Quorum")
            h.conn.send_data(sid, b"\x00\x00\x00", end_stream=False)
            h.flush()
        assert_serving(lh)


# ---- gRPC messages -----------------------------------------------------


def call(lh, method: str, msg: bytes | None = None, **kw):
    with H2Client(lh.port) as h:
        return h.call(method, msg, **kw)


def test_grpc_prefix_declares_one_gib(lh):
    with H2Client(lh.port) as h:
        sid = h.request_headers("Quorum")
        h.send_data(sid, b"\x00" + struct.pack(">I", 1 << 30) + b"abc", end_stream=False)
        res = h.read_result(sid, 10)
    assert res.reset is not None or res.grpc_status == RESOURCE_EXHAUSTED, res


def test_grpc_prefix_declares_one_gib_then_end_stream(lh):
    res = call(lh, "Quorum", raw_body=b"\x00" + struct.pack(">I", 1 << 30) + b"abc")
    assert res.reset is not None or res.grpc_status == RESOURCE_EXHAUSTED, res


def test_grpc_message_over_4_mib(lh):
    body = pb_quorum_request(pb_member("big") + pb_bytes(7, b"y" * (5 << 20)))
    with H2Client(lh.port, timeout=30) as h:
        sid = h.request_headers("Quorum")
        try:
            h.send_data(sid, grpc_frame(body))
        except (AssertionError, OSError, h2.exceptions.H2Error):
            pass  # window closed, stream reset: refused before the end
        res = h.read_result(sid, 20)
    assert res.reset is not None or res.grpc_status == RESOURCE_EXHAUSTED or res.closed, res


def test_grpc_invalid_protobuf(lh):
    for body in (b"\xff\xff\xff", pb_bytes(1, b"\xff\xff\xff\xff"), b"\x08"):
        res = call(lh, "Quorum", body)
        assert res.grpc_status == INVALID_ARGUMENT, (body, res)


def test_grpc_replica_id_not_utf8(lh):
    res = call(lh, "Quorum", pb_quorum_request(pb_member(b"\xff\xfe")))
    assert res.grpc_status == INVALID_ARGUMENT, res
    res = call(lh, "Heartbeat", pb_heartbeat_request(b"\xff\xfe"))
    assert res.grpc_status == INVALID_ARGUMENT, res
    names = [h["replica_id"] for h in status(lh.port)["heartbeats"]]
    assert all("\ufffd" not in n for n in names), names


def test_grpc_missing_requester(lh):
    res = call(lh, "Quorum", b"")
    assert res.grpc_status == INVALID_ARGUMENT, res
    assert "missing requester" in res.grpc_message


def test_grpc_bad_strings_and_sizes(lh):
    cases = {
        "empty id": pb_quorum_request(pb_member(b"")),
        "long id": pb_quorum_request(pb_member(b"x" * 2000)),
        "big data": pb_quorum_request(pb_member(b"x") + pb_bytes(7, b"y" * 70000)),
        "nul in id": pb_quorum_request(pb_member(b"a\x00b")),
        "bad address": pb_quorum_request(pb_member(b"ok") + pb_bytes(2, b"\xc3")),
    }
    for name, body in cases.items():
        res = call(lh, "Quorum", body)
        assert res.grpc_status == INVALID_ARGUMENT, (name, res)
    assert call(lh, "Heartbeat", b"").grpc_status == INVALID_ARGUMENT


def test_grpc_bad_framing_of_the_message(lh):
    for body in (b"", b"\x00\x00\x00", b"\x00" + struct.pack(">I", 100) + b"abc",
                 grpc_frame(pb_heartbeat_request("x")) * 2,
                 b"\x01" + struct.pack(">I", 3) + b"abc"):
        res = call(lh, "Heartbeat", raw_body=body)
        assert res.grpc_status not in (None, 0), (body, res)


def test_grpc_unknown_method(lh):
    res = call(lh, "NoSuchMethod", b"")
    assert res.grpc_status == UNIMPLEMENTED, res
    res = call(lh, "Quorum", b"", service="torchft.ManagerService")
    assert res.grpc_status == UNIMPLEMENTED, res


def test_grpc_bad_timeout_header(lh):
    for v in ("abc", "123456789S", "10x", "", "-1S"):
        res = call(lh, "Quorum", pb_quorum_request(pb_member("t")),
                   extra=[("grpc-timeout", v)])
        assert res.grpc_status == INVALID_ARGUMENT, (v, res)


# ---- silent and idle clients ----------------------------------------------


def test_silent_clients_do_not_block_others(lh):
    with raw(lh) as silent, raw(lh) as preface_only, raw(lh) as half_http:
        preface_only.sendall(H2_PREFACE)
        half_http.sendall(b"GET /status HTTP/1.1\r\nHo")
        t0 = time.monotonic()
        assert_serving(lh)
        assert http_get(lh.port, "/status")[0] == 200
        assert time.monotonic() - t0 < 10
        assert silent.fileno() >= 0


def test_thousand_idle_connections(lh):
    need = 2500
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    socks = []
    try:
        for _ in range(1000):
            socks.append(raw(lh))
        for _ in range(3):
            assert_serving(lh)
        assert http_get(lh.port, "/status")[0] == 200
    finally:
        for s in socks:
            s.close()
        if soft < need:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
