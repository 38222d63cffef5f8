"""Hostile input against the manager port (a ManagerServer in a child
process, with its own lighthouse).

After every case the manager must still be running and serve its group
rank, whose client stays connected for the whole module (as a real group
rank's does): an autouse fixture checks a quorum and a commit vote.
Requests the server rejects never count as a group rank speaking, so they
cannot make the group leave.
"""

from __future__ import annotations

import random
import socket
import struct
import subprocess
import sys
import time

import pytest

from lighthouse_util import (
    DEADLINE_EXCEEDED,
    H2_PREFACE,
    INVALID_ARGUMENT,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    UNIMPLEMENTED,
    H2Client,
    LogProc,
    grpc_frame,
    h2_frame,
    pb_bytes,
    pb_int,
    td,
)
from stepguard.coordination import ManagerClient

MGR = "torchft.ManagerService"
TIMEOUT = [("grpc-timeout", "10S")]

CHILD = """
import time
from datetime import timedelta
from stepguard.coordination import LighthouseServer, ManagerServer
lh = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
m = ManagerServer("bad-input", lh.address(), "127.0.0.1", "127.0.0.1:0",
                  "s:1", 1, timedelta(seconds=0.1), timedelta(seconds=5))
print("MANAGER", m.address(), flush=True)
time.sleep(3600)
"""


class Mgr(LogProc):
    def __init__(self, popen):
        super().__init__(popen)
        self.port = int(self.wait_line(r"MANAGER http://127\.0\.0\.1:(\d+)", 30).group(1))
        self.addr = f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def mgr():
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    try:
        m = Mgr(p)
        m.client = ManagerClient(m.addr, td(10))
        m.step = 0
        yield m
        m.client.close()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def assert_serving(m) -> None:
    assert m.popen.poll() is None, "manager died:\n" + m.output()[-4000:]
    q = m.client._quorum(0, m.step, "probe-md", False, True, 0, td(10))
    assert q.replica_ids == ["bad-input"]
    assert m.client.should_commit(0, m.step, True, td(10))
    m.step += 1


@pytest.fixture(autouse=True)
def still_serving(mgr):
    yield
    assert_serving(mgr)


def raw(m) -> socket.socket:
    return socket.create_connection(("127.0.0.1", m.port), timeout=10)


def drain(sock: socket.socket, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return "open"
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return "eof"
        except socket.timeout:
            return "open"
        except ConnectionResetError:
            return "reset"


def send_quietly(sock, data):
    try:
        sock.sendall(data)
    except OSError:
        pass


def call(m, method, msg=None, **kw):
    kw.setdefault("extra", TIMEOUT)
    with H2Client(m.port) as h:
        return h.call(method, msg, service=MGR, **kw)


def qreq(group_rank=0, step=0, metadata=b"md", handle=b"") -> bytes:
    out = pb_int(1, group_rank) + pb_int(2, step) + pb_bytes(3, metadata)
    return out + (pb_bytes(7, handle) if handle else b"")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_garbage_on_tcp(mgr, seed):
    rnd = random.Random(seed)
    with raw(mgr) as s:
        send_quietly(s, bytes(rnd.getrandbits(8) for _ in range(20000)))
        assert drain(s, 10) in ("eof", "reset")


@pytest.mark.parametrize("seed", [11, 12])
def test_h2_preface_then_garbage(mgr, seed):
    rnd = random.Random(seed)
    with raw(mgr) as s:
        send_quietly(s, H2_PREFACE + bytes(rnd.getrandbits(8) for _ in range(5000)))
        assert drain(s, 10) in ("eof", "reset")


@pytest.mark.parametrize("seed", range(21, 24))
def test_h2_well_framed_garbage_frames(mgr, seed):
    rnd = random.Random(seed)
    out = H2_PREFACE + h2_frame(4, 0, 0, b"")
    for _ in range(200):
        out += h2_frame(rnd.randrange(0, 12), rnd.getrandbits(8),
                        rnd.randrange(0, 8),
                        bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(0, 64))))
    with raw(mgr) as s:
        send_quietly(s, out)
        drain(s, 1)


def test_truncated_frame_and_vanished_peer(mgr):
    with raw(mgr) as s:
        send_quietly(s, H2_PREFACE + h2_frame(4, 0, 0, b"")
                     + h2_frame(1, 4, 1, b"\x00\x01", declared_len=100))
        assert drain(s, 0.5) == "open"
    # closed mid-frame; a half-sent request then vanishes too
    with H2Client(mgr.port) as h:
        sid = h.request_headers("Quorum", service=MGR, extra=TIMEOUT)
        h.send_data(sid, grpc_frame(qreq())[:4], end_stream=False)


def test_huge_declared_lengths(mgr):
    with raw(mgr) as s:
        send_quietly(s, H2_PREFACE + h2_frame(4, 0, 0, b"")
                     + h2_frame(0, 0, 1, b"x" * 10, declared_len=(1 << 24) - 1))
        assert drain(s, 10) in ("eof", "reset")
    res = call(mgr, "Quorum", raw_body=b"\x00" + struct.pack(">I", 1 << 30) + b"abc")
    assert res.reset is not None or res.grpc_status == RESOURCE_EXHAUSTED, res


def test_oversized_fields(mgr):
    res = call(mgr, "Quorum", qreq(metadata=b"m" * 70000))
    assert res.grpc_status == INVALID_ARGUMENT, res
    res = call(mgr, "Quorum", qreq(handle=b"h" * 70000))
    assert res.grpc_status == INVALID_ARGUMENT, res
    body = qreq(metadata=b"m" * (5 << 20))
    with H2Client(mgr.port, timeout=30) as h:
        sid = h.request_headers("Quorum", service=MGR, extra=TIMEOUT)
        try:
            h.send_data(sid, grpc_frame(body))
        except Exception:  # noqa: BLE001 - refused before the end is fine
            pass
        res = h.read_result(sid, 20)
    assert res.reset is not None or res.closed or res.grpc_status in (
        RESOURCE_EXHAUSTED, INVALID_ARGUMENT), res


def test_invalid_protobuf_and_strings(mgr):
    # field 2 of ShouldCommit (an int64) sent length-delimited; protobuf-c
    # reads a length-delimited bool as a packed one, so field 1 is not used
    for method, f in (("Quorum", 1), ("ShouldCommit", 2),
                      ("CheckpointMetadata", 1), ("Kill", 1), ("WaitLost", 100)):
        for body in (b"\xff\xff\xff", b"\x08", pb_bytes(f, b"\xff" * 4)):
            res = call(mgr, method, body)
            assert res.grpc_status == INVALID_ARGUMENT, (method, body, res)
    for bad in (b"\xff\xfe", b"a\x00b"):
        res = call(mgr, "Quorum", qreq(metadata=bad))
        assert res.grpc_status == INVALID_ARGUMENT, res
        res = call(mgr, "Quorum", qreq(handle=bad))
        assert res.grpc_status == INVALID_ARGUMENT, res
    # the probe's metadata was not replaced by any of it
    assert mgr.client._checkpoint_metadata(0, td(5)) in ("probe-md", "")


def test_out_of_range_ranks(mgr):
    for g in (1, -1, 1 << 40):
        assert call(mgr, "Quorum", qreq(group_rank=g)).grpc_status == INVALID_ARGUMENT
        res = call(mgr, "ShouldCommit", pb_int(1, 1) + pb_int(2, g))
        assert res.grpc_status == INVALID_ARGUMENT
    res = call(mgr, "CheckpointMetadata", pb_int(1, 7))
    assert res.grpc_status in (INVALID_ARGUMENT, NOT_FOUND), res


def test_timeouts_methods_and_framing(mgr):
    res = call(mgr, "Quorum", qreq(), extra=[])
    assert res.grpc_status == INVALID_ARGUMENT and "timeout" in res.grpc_message
    for v in ("abc", "123456789S", "10x", "-1S"):
        res = call(mgr, "Quorum", qreq(), extra=[("grpc-timeout", v)])
        assert res.grpc_status == INVALID_ARGUMENT, (v, res)
    assert call(mgr, "NoSuch", b"").grpc_status == UNIMPLEMENTED
    # stepguard's long poll: it must have a deadline, and ends at it
    res = call(mgr, "WaitLost", pb_int(100, 0), extra=[])
    assert res.grpc_status == INVALID_ARGUMENT and "timeout" in res.grpc_message
    res = call(mgr, "WaitLost", pb_int(100, 1 << 40), extra=[("grpc-timeout", "200m")])
    assert res.grpc_status == DEADLINE_EXCEEDED, res
    with H2Client(mgr.port) as h:
        res = h.call("Heartbeat", b"", service="torchft.LighthouseService",
                     extra=TIMEOUT)
    assert res.grpc_status == UNIMPLEMENTED, res
    for body in (b"", b"\x00\x00\x00", b"\x00" + struct.pack(">I", 100) + b"abc",
                 b"\x01" + struct.pack(">I", 3) + b"abc"):
        res = call(mgr, "ShouldCommit", raw_body=body)
        assert res.grpc_status not in (None, 0), (body, res)


def test_silent_clients_do_not_block_the_group(mgr):
    with raw(mgr) as silent, raw(mgr) as preface_only:
        preface_only.sendall(H2_PREFACE)
        t0 = time.monotonic()
        assert_serving(mgr)
        assert time.monotonic() - t0 < 10
        assert silent.fileno() >= 0
