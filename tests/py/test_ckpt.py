"""NativeTransport: bit-identical round trips, refusals, striping, sources
killed mid-transfer (real processes, over TCP and same-host reads), bad
input, and the torchft interface.
"""

from __future__ import annotations

import array
import collections
import gc
import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
import torch

from stepguard import _C
from stepguard.checkpointing.native_transport import (
    NativeTransport,
    native_address,
    parse_sources,
)
from stepguard.checkpointing.transport import CheckpointTransport

T5 = timedelta(seconds=5)
T60 = timedelta(seconds=60)


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def assert_identical(a, b) -> None:
    """Same tree, same leaves; tensors: same dtype, shape, stride and bits."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.layout == torch.strided:
            assert a.stride() == b.stride()
            assert _bits(a) == _bits(b)
        else:
            assert torch.equal(a.to_dense(), b.to_dense())
        assert a.requires_grad == b.requires_grad
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            assert_identical(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_identical(x, y)
    else:
        assert a == b


Point = collections.namedtuple("Point", ["x", "y"])


def many_dtypes_state() -> dict:
    g = torch.Generator().manual_seed(0)
    user: dict = {}
    for dt in [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    ]:
        raw = torch.randint(0, 256, (5, 7, 8), dtype=torch.uint8, generator=g)
        user[str(dt)] = raw.view(dt) if dt.itemsize <= 8 else raw
    for name in ["float8_e4m3fn", "float8_e5m2", "uint16", "uint32"]:
        dt = getattr(torch, name, None)
        if dt is not None:
            user[name] = torch.randint(0, 256, (64,), dtype=torch.uint8).view(dt)
    nan = torch.tensor([float("nan"), -0.0, float("inf")])
    nan[0] = struct.unpack("<f", b"\x01\x00\xc0\x7f")[0]  # a NaN payload
    base = torch.randn(6, 8, generator=g)
    user.update(
        {
            "nan": nan,
            "scalar": torch.tensor(3.5),
            "transposed": base.t(),
            "stepped": base[::2, 1::3],
            "expanded": torch.randn(1, 4, generator=g).expand(5, 4),
            "offset_view": base[3:, 2:5],
            # over 1 MiB: staged in malloc'd memory, viewed the same way
            "big_transposed": torch.randn(1024, 600, generator=g).t(),
            "big_stepped": torch.randn(2048, 600, generator=g)[::2, 1:],
            "big_bf16": torch.randn(3, 1 << 19, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 3),
            "empty_strided": torch.empty_strided((0, 4), (1, 0)),
            "param": torch.nn.Parameter(torch.randn(3, 3, generator=g)),
            "grad": torch.randn(2, generator=g).requires_grad_(True),
            "sparse": torch.randn(4, 4, generator=g).to_sparse(),
            "nested": {
                "list": [torch.arange(5), {"deep": (torch.ones(2, 2), "s")}],
                "tuple": (1, 2.5, None, b"bytes"),
                "od": collections.OrderedDict(b=torch.zeros(3), a=7),
                "point": Point(torch.tensor([1, 2]), "y"),
            },
            "text": "hello",
            "none": None,
        }
    )
    return {"user": {"model": user}, "torchft": {"step": 12, "batches_committed": 40}}


@pytest.fixture
def pair():
    a = NativeTransport(T60, hostname="127.0.0.1", auth_token="tok")
    b = NativeTransport(T60, hostname="127.0.0.1", auth_token="tok", in_place=True)
    try:
        yield a, b
    finally:
        a.shutdown()
        b.shutdown()


def test_is_a_checkpoint_transport(pair) -> None:
    a, _ = pair
    assert isinstance(a, CheckpointTransport)
    assert a.metadata().startswith("http://127.0.0.1:")
    assert native_address(a.metadata()) == f"127.0.0.1:{a._server.port()}"
    assert parse_sources("sgckpt://h:1,sgckpt://[::1]:2/") == ["h:1", "[::1]:2"]
    assert parse_sources(["sgckpt://h:1", "h:1", "g:3"]) == ["h:1", "g:3"]
    with pytest.raises(ValueError):
        parse_sources(" , ")


def test_round_trip_is_bit_identical(pair) -> None:
    a, b = pair
    sd = many_dtypes_state()
    a.send_checkpoint([1], 12, sd, T60)
    got = b.recv_checkpoint(0, a.metadata(), 12, T60)
    assert_identical(sd, got)
    assert gc.isenabled()
    assert isinstance(got["user"]["model"]["param"], torch.nn.Parameter)
    # received tensors own fresh memory
    before = _bits(sd["user"]["model"]["torch.int64"])
    got["user"]["model"]["torch.int64"].zero_()
    assert _bits(sd["user"]["model"]["torch.int64"]) == before != bytes(len(before))
    assert sum(b.last_recv_bytes) == a.stats()["bytes_sent"] > 0
    a.disallow_checkpoint()


def test_tensor_data_is_not_in_the_header(pair) -> None:
    a, b = pair
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    a.send_checkpoint([1], 1, {"w": big}, T60)
    fetch = _C.CkptFetch()
    header, lens, _ = fetch.info(native_address(a.metadata()), "tok", 1, 5.0)
    assert lens == [4 << 20]
    assert len(header) < 2048
    got = b.recv_checkpoint(0, a.metadata(), 1, T60)
    assert torch.equal(got["w"], big)


def test_refusals(pair) -> None:
    a, b = pair
    # a source that serves nothing yet is waited for until the deadline
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="serving -1 but got step=3"):
        b.recv_checkpoint(0, a.metadata(), 3, timedelta(seconds=0.5))
    assert time.monotonic() - t0 >= 0.45
    a.send_checkpoint([1], 3, {"w": torch.ones(4)}, T60)
    with pytest.raises(RuntimeError, match="serving 3 but got step=4"):
        b.recv_checkpoint(0, a.metadata(), 4, T5)
    c = NativeTransport(T60, hostname="127.0.0.1", auth_token="other")
    try:
        with pytest.raises(RuntimeError, match="auth token"):
            c.recv_checkpoint(0, a.metadata(), 3, T5)
    finally:
        c.shutdown()
    # a new step replaces the old one; the old one is refused
    a.send_checkpoint([1], 4, {"w": torch.zeros(4)}, T60)
    assert torch.equal(b.recv_checkpoint(0, a.metadata(), 4, T5)["w"], torch.zeros(4))
    with pytest.raises(RuntimeError, match="serving 4 but got step=3"):
        b.recv_checkpoint(0, a.metadata(), 3, T5)
    a.disallow_checkpoint()
    a.disallow_checkpoint()  # idempotent
    with pytest.raises(RuntimeError, match="serving -1"):
        b.recv_checkpoint(0, a.metadata(), 4, timedelta(seconds=0.2))
    assert a.stats()["refused"] >= 4


def test_nothing_listening_and_deadline() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    b = NativeTransport(T5, hostname="127.0.0.1")
    try:
        with pytest.raises(RuntimeError, match="no source serves"):
            b.recv_checkpoint(0, f"sgckpt://127.0.0.1:{port}", 1, T5)
        # a listener that never answers: the deadline holds
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            b.recv_checkpoint(
                0,
                f"sgckpt://127.0.0.1:{silent.getsockname()[1]}",
                1,
                timedelta(seconds=0.5),
            )
        assert time.monotonic() - t0 < 30
        silent.close()
    finally:
        b.shutdown()


def test_striped_across_three_sources() -> None:
    g = torch.Generator().manual_seed(1)
    sd = {"w": [torch.randn(1 << 20, generator=g) for _ in range(6)], "s": 3}
    srcs = [NativeTransport(T60, hostname="127.0.0.1") for _ in range(3)]
    b = NativeTransport(T60, hostname="127.0.0.1", streams_per_source=1)
    try:
        for s in srcs:
            s.send_checkpoint([3], 7, sd, T60)
        got = b.recv_checkpoint_striped([s.metadata() for s in srcs], 7, T60)
        assert_identical(sd, got)
        total = 6 * (4 << 20)
        sent = [s.stats()["bytes_sent"] for s in srcs]
        assert b.last_recv_bytes == sent
        assert sum(sent) == total
        assert all(x > 0 for x in sent), sent
        # comma-joined metadata strips the same way
        got = b.recv_checkpoint(0, ",".join(s.metadata() for s in srcs), 7, T60)
        assert_identical(sd, got)
        assert all(x > 0 for x in b.last_recv_bytes)
    finally:
        for s in srcs:
            s.shutdown()
        b.shutdown()


def test_disallow_waits_for_a_transfer_in_flight(pair) -> None:
    a, _ = pair
    big = torch.ones(8 << 20)  # 32 MiB
    a.send_checkpoint([1], 2, {"w": big}, T60)
    addr = native_address(a.metadata())
    fetch = _C.CkptFetch()
    _, lens, layout = fetch.info(addr, "tok", 2, 5.0)
    # a raw reader that asks for everything and reads slowly
    host, port = addr.rsplit(":", 1)
    r = socket.create_connection((host, int(port)), timeout=10)
    tok = b"tok"
    req = struct.pack(
        "<IHHqQQQHHI", 0x51434753, 1, 2, 2, layout, 0, lens[0], len(tok), 0, 0
    )
    r.sendall(req + tok)
    r.recv(4096)
    released = threading.Event()

    def disallow() -> None:
        a.disallow_checkpoint()
        released.set()

    th = threading.Thread(target=disallow)
    th.start()
    assert not released.wait(0.3)  # held while the reader is behind
    got = 4096
    while got < lens[0] + 48:
        n = len(r.recv(1 << 20))
        if n == 0:
            break
        got += n
    assert released.wait(30)
    th.join()
    r.close()
    assert a.stats()["cut"] == 0


_SERVE_AND_DIE = r"""
import os, signal, sys, time
from datetime import timedelta
import torch
from stepguard.checkpointing.native_transport import NativeTransport
mb, die_after = int(sys.argv[1]), int(sys.argv[2])
on_map = len(sys.argv) > 3 and sys.argv[3] == "map"
g = torch.Generator().manual_seed(5)
sd = {"w": torch.randn(mb << 18, generator=g), "k": "v"}
t = NativeTransport(timedelta(seconds=60), hostname="127.0.0.1", streams_per_source=1)
t.send_checkpoint([1], 9, sd, timedelta(seconds=60))
print(t.metadata(), flush=True)
while True:
    st = t.stats()
    if die_after >= 0 and (st["maps"] if on_map else st["bytes_sent"]) > die_after:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-transfer
    time.sleep(0.0005)
"""


def _spawn_source(procs, mb: int, die_after: int, on: str = "bytes") -> str:
    import subprocess

    p = procs.spawn(
        _SERVE_AND_DIE, str(mb), str(die_after), on, stdout=subprocess.PIPE, text=True
    )
    line = p.stdout.readline().strip()
    assert line.startswith("http://") and native_address(line), line
    return line


def test_source_killed_mid_transfer(procs, monkeypatch) -> None:
    monkeypatch.setenv("STEPGUARD_SAME_HOST", "0")  # the TCP path
    mb = 128
    expect = torch.randn(mb << 18, generator=torch.Generator().manual_seed(5))
    b = NativeTransport(T60, hostname="127.0.0.1", streams_per_source=1)
    try:
        dying = _spawn_source(procs, mb, 1 << 20)
        with pytest.raises(RuntimeError, match="truncated|closed|reset|refused"):
            b.recv_checkpoint(0, dying, 9, T60)
        assert procs.popens[-1].wait(timeout=30) < 0  # it was killed
        # a later try from a healthy source recovers
        healthy = _spawn_source(procs, mb, -1)
        got = b.recv_checkpoint(0, healthy, 9, T60)
        assert torch.equal(got["w"], expect) and got["k"] == "v"
        # striped over a dying and a healthy source: the healthy one finishes
        dying = _spawn_source(procs, mb, 1 << 20)
        got = b.recv_checkpoint_striped([dying, healthy], 9, T60)
        assert torch.equal(got["w"], expect)
        assert b.last_recv_bytes[1] >= (mb << 20) // 2
        assert sum(b.last_recv_bytes) == mb << 20
        assert b.last_recv_stats["tcp_bytes"] == mb << 20
    finally:
        b.shutdown()


def test_same_host_round_trip_and_tcp_fallback(procs, monkeypatch) -> None:
    """A source in another process of this host is read from its memory; with
    STEPGUARD_SAME_HOST=0 the same fetch goes over TCP; both bit-identical."""
    mb = 16
    expect = torch.randn(mb << 18, generator=torch.Generator().manual_seed(5))
    b = NativeTransport(T60, hostname="127.0.0.1", streams_per_source=2)
    try:
        src = _spawn_source(procs, mb, -1)
        got = b.recv_checkpoint(0, src, 9, T60)
        assert torch.equal(got["w"], expect) and got["k"] == "v"
        assert b.last_recv_stats["same_host_bytes"] == mb << 20
        assert b.last_recv_stats["tcp_bytes"] == 0
        assert b.last_recv_stats["same_host_sources"] == 1
        monkeypatch.setenv("STEPGUARD_SAME_HOST", "0")
        got = b.recv_checkpoint(0, src, 9, T60)
        assert torch.equal(got["w"], expect)
        assert b.last_recv_stats["tcp_bytes"] == mb << 20
        assert b.last_recv_stats["same_host_bytes"] == 0
    finally:
        b.shutdown()


def test_same_host_source_killed_while_granted(procs) -> None:
    """A source that dies once it has granted a same-host read: striped with a
    healthy one, the healthy one delivers what the dead one could not."""
    mb = 64
    expect = torch.randn(mb << 18, generator=torch.Generator().manual_seed(5))
    b = NativeTransport(T60, hostname="127.0.0.1", streams_per_source=1)
    try:
        healthy = _spawn_source(procs, mb, -1)
        dying = _spawn_source(procs, mb, 0, "map")
        got = b.recv_checkpoint_striped([dying, healthy], 9, T60)
        assert torch.equal(got["w"], expect)
        assert sum(b.last_recv_bytes) == mb << 20
        assert b.last_recv_stats["same_host_bytes"] == mb << 20
        assert procs.popens[-1].wait(timeout=30) < 0  # it did die
    finally:
        b.shutdown()


def test_fetch_in_place_into_the_replicas_tensors(pair) -> None:
    """Tensors whose counterpart in ``into`` matches land in its memory; the
    others (other shape or dtype, gaps, an alias, a missing key) get fresh
    memory; the result is bit-identical either way."""
    a, b = pair
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 40, generator=g)
    sd = {
        "user": {
            "model": {
                "w": w,
                "t": torch.randn(16, 8, generator=g).t(),  # dense, transposed
                "gaps": torch.arange(40)[::3],  # span with gaps
                "half": torch.randn(64, generator=g).half(),
                "shape": torch.randn(10, 10, generator=g),
                "tied": w,
            },
            "optim": {"m": torch.randn(300, 40, generator=g), "lr": 0.5},
        },
        "torchft": {"step": 4, "batches_committed": 8},
    }
    a.send_checkpoint([1], 4, sd, T60)
    mine_w = torch.zeros(300, 40)
    into = {
        "user": {
            "model": {
                "w": mine_w,
                "t": torch.zeros(16, 8).t(),
                "gaps": torch.zeros(14, dtype=torch.int64),  # dense: no match
                "half": torch.zeros(64),  # float32: no match
                "shape": torch.zeros(100),
                "tied": mine_w,
            },
            # the optimizer state has a different tree: matched by key path
            "optim": {"m": torch.zeros(300, 40), "extra": torch.zeros(3)},
        },
        "torchft": {"step": 0, "batches_committed": 0},
    }
    ptr_m = into["user"]["optim"]["m"].data_ptr()
    got = b.recv_checkpoint(0, a.metadata(), 4, T60, into=into)
    assert_identical(sd, got)
    model = got["user"]["model"]
    assert model["w"].data_ptr() == mine_w.data_ptr()
    assert torch.equal(mine_w, w)
    assert model["t"].data_ptr() == into["user"]["model"]["t"].data_ptr()
    assert got["user"]["optim"]["m"].data_ptr() == ptr_m
    assert model["tied"].data_ptr() != mine_w.data_ptr()  # fetched once in place
    for k in ("gaps", "half", "shape"):
        assert model[k].data_ptr() != into["user"]["model"][k].data_ptr(), k
    assert not into["user"]["model"]["shape"].any()  # a mismatch is untouched
    moved = (("model", "w"), ("model", "t"), ("optim", "m"))
    expect = sum(sd["user"][x][k].numel() * 4 for x, k in moved)
    assert b.last_recv_stats["in_place_bytes"] == expect
    a.disallow_checkpoint()

    # off: nothing in place
    c = NativeTransport(T60, hostname="127.0.0.1", auth_token="tok", in_place=False)
    try:
        a.send_checkpoint([1], 5, sd, T60)
        got = c.recv_checkpoint(0, a.metadata(), 5, T60, into=into)
        assert_identical(sd, got)
        assert c.last_recv_stats["in_place_bytes"] == 0
        assert got["user"]["model"]["w"].data_ptr() != mine_w.data_ptr()
    finally:
        c.shutdown()


def test_mapped_flags_are_checked(pair) -> None:
    """The binding's per-region 'already mapped' flags: bytes, one per
    region, else a clear error before anything moves."""
    a, _ = pair
    a.send_checkpoint([1], 3, {"x": torch.arange(10), "y": torch.ones(4)}, T60)
    f = _C.CkptFetch()
    host_port = native_address(a.metadata())
    _h, lens, layout = f.info(host_port, "tok", 3, 10.0)
    dst = [torch.empty(n, dtype=torch.uint8) for n in lens]
    ptrs = array.array("Q", [t.data_ptr() for t in dst])
    want = array.array("Q", lens)
    for bad, err in ((b"\x01", ValueError), ([1, 1], TypeError), (b"\x01" * 3, ValueError)):
        with pytest.raises(err):
            f.data([host_port], "tok", 3, layout, ptrs, want, 1, 10.0, mapped=bad)
    assert f.data([host_port], "tok", 3, layout, ptrs, want, 1, 10.0, mapped=b"\x01\x00")
    assert torch.equal(dst[0].view(torch.int64), torch.arange(10))
    assert torch.equal(dst[1].view(torch.float32), torch.ones(4))


def test_no_fetch_in_place_while_serving(pair) -> None:
    """The memory a transport serves must not change: a transport that
    serves fetches into fresh memory even when given ``into``."""
    a, b = pair
    sd = {"w": torch.arange(1000.0)}
    mine = {"w": torch.zeros(1000)}
    a.send_checkpoint([1], 2, sd, T60)
    b.send_checkpoint([0], 2, mine, T60)
    got = b.recv_checkpoint(0, a.metadata(), 2, T60, into=mine)
    assert torch.equal(got["w"], sd["w"]) and not mine["w"].any()
    assert b.last_recv_stats["in_place_bytes"] == 0


def test_in_place_fetch_cut_half_way_then_healed(procs, monkeypatch) -> None:
    """A source killed during an in-place fetch: an error, and the replica's
    tensor is partly overwritten (why the Manager reports step -1 until a
    fetch succeeds); a later fetch into the same tensor completes it."""
    monkeypatch.setenv("STEPGUARD_SAME_HOST", "0")  # the TCP path
    mb = 128
    expect = torch.randn(mb << 18, generator=torch.Generator().manual_seed(5))
    b = NativeTransport(T60, hostname="127.0.0.1", streams_per_source=1, in_place=True)
    try:
        mine = {"w": torch.zeros(mb << 18), "k": "old"}
        dying = _spawn_source(procs, mb, 1 << 20)
        with pytest.raises(RuntimeError, match="truncated|closed|reset|refused"):
            b.recv_checkpoint(0, dying, 9, T60, into=mine)
        assert gc.isenabled()  # paused only while tensors are built
        same = (mine["w"] == expect).sum().item()
        assert 0 < same < expect.numel(), same  # half-loaded: never returned
        healthy = _spawn_source(procs, mb, -1)
        got = b.recv_checkpoint(0, healthy, 9, T60, into=mine)
        assert got["w"].data_ptr() == mine["w"].data_ptr()
        assert torch.equal(mine["w"], expect) and got["k"] == "v"
        assert b.last_recv_stats["in_place_bytes"] == mb << 20
    finally:
        b.shutdown()


_SERVE_MANY = r"""
import sys, time
from datetime import timedelta
import torch
from stepguard.checkpointing.native_transport import NativeTransport
n = int(sys.argv[1])
g = torch.Generator().manual_seed(7)
sd = {f"p{i}": torch.randn(1 + (i * 97) % 3000, generator=g) for i in range(n)}
sd["empty"] = torch.zeros(0)
t = NativeTransport(timedelta(seconds=60), hostname="127.0.0.1")
t.send_checkpoint([1], 2, sd, timedelta(seconds=60))
print(t.metadata(), flush=True)
time.sleep(600)
"""


def test_same_host_many_small_tensors(procs) -> None:
    """Thousands of small tensors from another process's memory (vectored
    same-host reads, more regions than one call takes), into fresh memory
    and in place: bit-identical."""
    import subprocess

    n = 2500
    g = torch.Generator().manual_seed(7)
    expect = {f"p{i}": torch.randn(1 + (i * 97) % 3000, generator=g) for i in range(n)}
    expect["empty"] = torch.zeros(0)
    total = sum(t.numel() * 4 for t in expect.values())
    p = procs.spawn(_SERVE_MANY, str(n), stdout=subprocess.PIPE, text=True)
    src = p.stdout.readline().strip()
    assert src.startswith("http://") and native_address(src), src
    b = NativeTransport(T60, hostname="127.0.0.1", in_place=True)
    try:
        got = b.recv_checkpoint(0, src, 2, T60)
        assert_identical(expect, got)
        assert b.last_recv_stats["same_host_bytes"] == total
        mine = {k: torch.zeros_like(v) for k, v in expect.items()}
        got = b.recv_checkpoint(0, src, 2, T60, into=mine)
        assert_identical(expect, got)
        assert_identical(expect, mine)
        assert b.last_recv_stats["in_place_bytes"] == total
        assert b.last_recv_stats["same_host_bytes"] == total
    finally:
        b.shutdown()


def test_server_survives_garbage(pair) -> None:
    a, b = pair
    a.send_checkpoint([1], 1, {"w": torch.arange(1000)}, T60)
    host, port = native_address(a.metadata()).rsplit(":", 1)
    junk_inputs = [
        b"\x00" * 100,
        b"GET / HTTP/1.1\r\n\r\n",
        b"SGCQ" + b"\xff" * 60,
        b"SG",
    ]
    for junk in junk_inputs:
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(junk)
        if len(junk) >= 4:
            resp = s.recv(48)
            assert resp[:4] == b"SGCR"
        s.close()
    got = b.recv_checkpoint(0, a.metadata(), 1, T60)
    assert torch.equal(got["w"], torch.arange(1000))
    assert a.stats()["bad_input"] >= 3


def test_shutdown_is_idempotent() -> None:
    a = NativeTransport(T5, hostname="127.0.0.1")
    a.send_checkpoint([], 0, {"x": torch.ones(1)}, T5)
    a.shutdown()
    a.shutdown()
    with pytest.raises(RuntimeError):
        a.metadata()


def test_forked_child_drops_its_copy(pair) -> None:
    import os

    a, b = pair
    a.send_checkpoint([1], 6, {"w": torch.arange(100)}, T60)
    pid = os.fork()
    if pid == 0:  # a DataLoader-like worker: drop the inherited transport
        code = 0
        try:
            a.disallow_checkpoint()
            a.shutdown()
        except BaseException:  # noqa: BLE001 - report through the status
            code = 3
        os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung dropping the transport")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    got = b.recv_checkpoint(0, a.metadata(), 6, T60)  # the parent serves on
    assert torch.equal(got["w"], torch.arange(100))


def test_fetches_from_a_torchft_http_peer() -> None:
    torchft_http = pytest.importorskip("torchft.checkpointing.http_transport")
    peer = torchft_http.HTTPTransport(T60, num_chunks=0)
    b = NativeTransport(T60, hostname="127.0.0.1")
    try:
        sd = {"user": {"w": torch.randn(64, 3)}, "torchft": {"step": 2}}
        peer.send_checkpoint([1], 2, sd, T60)
        got = b.recv_checkpoint(0, peer.metadata(), 2, T60)
        assert_identical(sd, got)
    finally:
        peer.shutdown()
        b.shutdown()


# "ready" comes once the fetch's connection reached the silent source, so
# the SIGINT lands in the fetch, never before its try (a traceback then).
_CTRL_C = r"""
import socket, sys, threading, time
from datetime import timedelta
from stepguard.checkpointing.native_transport import NativeTransport
silent = socket.socket()
silent.bind(("127.0.0.1", 0))
silent.listen(4)
held = []


def announce():
    held.append(silent.accept()[0])  # kept open, never answered
    print("ready", flush=True)


threading.Thread(target=announce, daemon=True).start()
t = NativeTransport(timedelta(seconds=5), hostname="127.0.0.1")
t0 = time.monotonic()
try:
    t.recv_checkpoint(0, "sgckpt://127.0.0.1:%d" % silent.getsockname()[1], 1,
                      timedelta(seconds=600))
except KeyboardInterrupt:
    print("interrupted after %.1f" % (time.monotonic() - t0), flush=True)
    t.shutdown()
    sys.exit(0)
sys.exit(2)
"""


def test_ctrl_c_stops_a_fetch(procs) -> None:
    import signal
    import subprocess

    p = procs.spawn(_CTRL_C, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"  # the fetch is in flight
    p.send_signal(signal.SIGINT)
    out = procs.rest_of_stdout(p, timeout=30)
    assert p.returncode == 0, out
    assert out.startswith("interrupted after"), out
    assert float(out.split()[-1]) < 10.0, out  # not the 600 s deadline


def test_a_source_that_starts_serving_late_is_waited_for(pair) -> None:
    """Like torchft's HTTP server, which holds a request until serving is
    allowed: a healer whose source has not announced the step yet waits."""
    a, b = pair
    timer = threading.Timer(0.3, a.send_checkpoint, ([1], 5, {"w": torch.ones(8)}, T60))
    timer.start()
    try:
        got = b.recv_checkpoint(0, a.metadata(), 5, T5)
    finally:
        timer.cancel()
    assert torch.equal(got["w"], torch.ones(8))


def test_cuda_tensors_are_served_from_a_host_copy(pair) -> None:
    """CUDA tensors are staged in host memory when served: the healer gets
    the values as they were at send_checkpoint, bit-identical, even when the
    device tensors change afterwards."""
    if not torch.cuda.is_available():
        reason = "CUDA is not available on this machine"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    a, b = pair
    dev = torch.device("cuda")
    w = torch.randn(4096, generator=torch.Generator().manual_seed(8)).to(dev)
    strided = torch.arange(64, dtype=torch.int32, device=dev).reshape(8, 8).t()
    sd = {"w": w, "t": strided, "z": torch.empty(0, device=dev), "k": 3}
    expect = {k: v.cpu().clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    a.send_checkpoint([1], 2, sd, T60)
    w.add_(1.0)  # the served copy must not see this
    got = b.recv_checkpoint(0, a.metadata(), 2, T60)
    for k, v in expect.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert _bits(got[k]) == _bits(v), k
    assert got["t"].stride() == expect["t"].stride()
    assert got["k"] == 3
    a.disallow_checkpoint()


_Pair = collections.namedtuple("_Pair", ["a", "b"])


def _odd_tree(g: torch.Generator) -> dict:
    return {
        "d": collections.OrderedDict(x=torch.randn(5, generator=g), n=None),
        "l": [torch.randn(3, generator=g), (torch.randn(2, generator=g), 7), []],
        "nt": _Pair(torch.randn(4, generator=g), "s"),
        "e": {},
        "none": None,
    }


def test_structure_walk_and_rebuild_match_pytree() -> None:
    """The fetch's own walk along a received tree and its rebuild give what
    torch's pytree gives: the same leaves in the same order, the same tree
    (dicts, lists, tuples, OrderedDict, None, empty nodes, namedtuples), and a
    different structure is reported as such."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from stepguard.checkpointing import native_transport as nt

    tree = _odd_tree(torch.Generator().manual_seed(1))
    leaves, spec = tree_flatten(tree)
    out: list = []
    walked = nt._along(spec, tree, out)
    # a namedtuple's spec type is not its class: the walk gives up there
    assert not walked
    del tree["nt"]
    leaves, spec = tree_flatten(tree)
    out = []
    assert nt._along(spec, tree, out)
    assert len(out) == len(leaves) and all(a is b for a, b in zip(out, leaves))
    rebuilt = nt._unflatten(leaves, spec)
    theirs = tree_flatten(tree_unflatten(leaves, spec))[1]
    assert tree_flatten(rebuilt)[1] == spec == theirs
    assert all(a is b for a, b in zip(tree_flatten(rebuilt)[0], leaves))
    assert type(rebuilt["d"]) is collections.OrderedDict and rebuilt["none"] is None
    for other in (
        {**tree, "e": {"k": 1}},  # another number of children
        {**tree, "d": dict(tree["d"])},  # another node type
        {**tree, "extra": 1},  # other keys
    ):
        assert not nt._along(spec, other, [])
    # a node where the received tree has a leaf: that leaf's candidate is
    # the node (no match), the rest still line up
    swapped = {**tree, "none": None, "l": [{"x": 1}, tree["l"][1], []]}
    got: list = []
    assert nt._along(spec, swapped, got)
    assert got[2] == {"x": 1} and got[3] is tree["l"][1][0]


def test_plan_checks_the_header_against_the_region_table() -> None:
    """The binding's one-pass planner: leaf records that are not well formed,
    a region table that disagrees with the header, or an unknown dtype are a
    clear error; a good header gives every tensor leaf its place."""
    f = _C.CkptFetch()
    args = (torch, {}, torch.dtype, torch.strided, torch.Tensor, torch.nn.Parameter)
    good = [("t", "float32", (2, 3), (3, 1), 6, False, False, "cpu"), ("v", 5)]
    lens = array.array("Q", [24])
    own = torch.zeros(2, 3)
    values, ptrs, mapped, rest, in_place = f.plan(good, [own, None], lens, *args)
    assert values[0] is own and values[1] == 5 and rest == []
    assert memoryview(ptrs).cast("Q")[0] == own.data_ptr() and mapped == b"\x01"
    assert in_place == 24
    values, ptrs, mapped, rest, in_place = f.plan(good, None, lens, *args)
    assert values == [None, 5] and rest == [(0, 0, None)] and in_place == 0
    assert bytes(ptrs) == bytes(8) and mapped == b"\x00"
    bad_records = [
        [("t", "float32", (2, 3), (3, 1), 6)],  # short
        [("x", 1)],  # unknown kind
        [("t", "float32", (2, -3), (3, 1), 6, False, False, "cpu")],
        [("t", "float32", (2, 3), (3,), 6, False, False, "cpu")],
        [("t", "float32", [2, 3], (3, 1), 6, False, False, "cpu")],
        [("t", "float32", (2, 3), (3, 1), -6, False, False, "cpu")],
        [("t", "no_such_dtype", (2, 3), (3, 1), 6, False, False, "cpu")],
        [("t", "Tensor", (2, 3), (3, 1), 6, False, False, "cpu")],  # not a dtype
        ["t"],
    ]
    for recs in bad_records:
        with pytest.raises(RuntimeError, match="bad checkpoint header"):
            f.plan(recs, None, lens, *args)
    for recs, ls in (
        (good, array.array("Q", [20])),  # length differs
        (good, array.array("Q", [24, 8])),  # more regions than tensors
        (good + good, lens),  # fewer
    ):
        with pytest.raises(RuntimeError, match="disagree"):
            f.plan(recs, None, ls, *args)
    with pytest.raises(ValueError):
        f.plan(good, [own], lens, *args)  # one candidate per leaf


def test_in_place_with_odd_counterparts(pair) -> None:
    """Counterparts that cannot take bytes in place (sparse, nested, a
    subclass, a non-tensor) get fresh memory without an error; a namedtuple
    in the tree is matched by key path; a Parameter whose flags differ is
    still fetched in place and returned with the sent flags."""
    a, b = pair
    g = torch.Generator().manual_seed(4)
    sd = {
        "sparse": torch.randn(4, 4, generator=g),
        "nested": torch.randn(6, generator=g),
        "sub": torch.randn(3, generator=g),
        "plain": torch.randn(8, generator=g),
        "p": torch.nn.Parameter(torch.randn(5, generator=g), requires_grad=True),
        "nt": _Pair(torch.randn(7, generator=g), "s"),
        "none": None,
    }

    class Sub(torch.Tensor):
        pass

    into = {
        "sparse": torch.zeros(4, 4).to_sparse(),
        "nested": torch.nested.nested_tensor([torch.zeros(3), torch.zeros(3)]),
        "sub": torch.zeros(3).as_subclass(Sub),
        "plain": "not a tensor",
        "p": torch.zeros(5),  # a plain tensor: in place, returned as a Parameter
        "nt": _Pair(torch.zeros(7), "old"),
        "none": None,
    }
    a.send_checkpoint([1], 6, sd, T60)
    got = b.recv_checkpoint(0, a.metadata(), 6, T60, into=into)
    assert_identical(sd, got)
    assert isinstance(got["p"], torch.nn.Parameter) and got["p"].requires_grad
    assert got["p"].data_ptr() == into["p"].data_ptr()
    assert got["nt"].a.data_ptr() == into["nt"].a.data_ptr()
    assert b.last_recv_stats["in_place_bytes"] == 5 * 4 + 7 * 4
    assert not into["sub"].any()
    a.disallow_checkpoint()
