"""Quantized collectives (``stepguard.collectives``) over ProcessGroupTCP in
real processes.

Each rank regenerates every rank's inputs (seeded by rank), so it can
compute the exact result in float64 and the error bound of the algorithm:
the owner takes its own values exactly, the others' are quantized once
(per block of 512 elements: int8 within half a step, absmax / 254; fp8
within half an ulp of 3 mantissa bits, or half the subnormal step), and
the reduced value is quantized once more.  Inputs: random, zeros, one huge
value per block, float32 subnormals, and tensors of several shapes and
dtypes.  Results must be the same bits on every rank.

Failures: a NaN or infinity on one rank fails the collective on every
rank, naming it, and leaves the group usable; a rank SIGKILLed mid
collective fails the others' operation naming it, as for full precision;
a member that does not advertise quantization makes every member fall back
to full precision (bit-identical to a plain allreduce) with one warning.
The kernels' bit equality with ``torch.float8_e4m3fn`` is checked here too.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

WORKER = r'''
import hashlib, json, logging, os, sys, time
from datetime import timedelta
import torch
from torch.distributed import ReduceOp
from stepguard import collectives
from stepguard.process_group import ProcessGroupTCP

port, rank, world, scenario, out = (int(sys.argv[1]), int(sys.argv[2]),
                                    int(sys.argv[3]), sys.argv[4], sys.argv[5])
T = timedelta(seconds=20)
ADDR = f"127.0.0.1:{port}"
B = 512

def tcp(prefix, quorum_id=1, timeout=T):
    pg = ProcessGroupTCP(timeout=timeout)
    pg.configure(f"{ADDR}/{prefix}", "replica", rank, world, quorum_id=quorum_id)
    return pg

def sha(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]

def inputs(kind, r):
    """rank r's tensors for one case"""
    g = torch.Generator().manual_seed(1000 * r + sum(map(ord, kind)))
    def u(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1
    if kind == "random":
        return [u(3001).float(), (u(40, 30) * 5).float(), u(7).to(torch.bfloat16)]
    if kind == "zeros":
        return [torch.zeros(2000)]
    if kind == "huge":  # one huge value in every block
        x = u(5000)
        x[17::B] = 1e30 * (1 + r)
        return [x.float()]
    if kind == "subnormal":
        return [(u(3000) * 1e-39).float()]
    raise ValueError(kind)

def chunks(count):
    base, extra = divmod(count, world)
    return [(i * base + min(i, extra), base + (i < extra)) for i in range(world)]

def block_absmax(x, parts):
    am = torch.empty_like(x)
    for off, ln in parts:
        nb = -(-ln // B)
        p = torch.zeros(nb * B, dtype=x.dtype)
        p[:ln] = x[off:off + ln].abs()
        am[off:off + ln] = p.view(nb, B).amax(1).repeat_interleave(B)[:ln]
    return am

def qerr(fmt, v, am):
    b = am / 127 / 2 if fmt == "int8" else torch.maximum(v.abs() / 16, am / 448 * 2.0 ** -10)
    return b * 1.01 + v.abs() * 1e-6 + 127 * 2.0 ** -149

def worst(fmt, xs, got, parts, owner, avg, rel=0.0):
    """max |got - exact| / bound over the elements"""
    n = len(xs)
    exact = sum(xs)
    bound = sum(torch.where(owner == q, 0.0, qerr(fmt, x, block_absmax(x, parts)))
                for q, x in enumerate(xs))
    amsum = sum(block_absmax(x, parts) for x in xs)
    s = n if avg else 1
    final_am = (amsum + block_absmax(bound, parts)) / s
    bound = bound / s + qerr(fmt, (exact.abs() + bound) / s, final_am)
    bound = bound + rel * (exact.abs() / s + bound) * 1.01
    err = (got.double() - exact / s).abs()
    return float((err / bound).max()) if err.numel() else 0.0

res = {}
if scenario == "bounds":
    for fmt in ("fp8", "int8"):
        os.environ["STEPGUARD_QUANTIZE"] = fmt
        pg = tcp(f"q/{fmt}")
        res[f"{fmt}-agreed"] = pg.quantized_format()[0]
        for kind in ("random", "zeros", "huge", "subnormal"):
            for avg in (False, True):
                op = ReduceOp.AVG if avg else ReduceOp.SUM
                ts = inputs(kind, rank)
                collectives.allreduce_quantized(ts, op, pg).wait()
                got = torch.cat([t.reshape(-1).double() for t in ts])
                xs = [torch.cat([t.reshape(-1).float() for t in inputs(kind, q)]).double()
                      for q in range(world)]
                parts = chunks(got.numel())
                owner = torch.cat([torch.full((ln,), i) for i, (_, ln) in enumerate(parts)])
                # a bfloat16 tensor is rounded once more on the way back
                rel = torch.cat([torch.full((t.numel(),), 2.0 ** -8 if t.dtype == torch.bfloat16
                                            else 0.0, dtype=torch.float64) for t in ts])
                res[f"ar-{fmt}-{kind}-{avg}"] = [
                    worst(fmt, xs, got, parts, owner, avg, rel), sha(got),
                    float((got - sum(xs) / (world if avg else 1)).abs().max())]
                # reduce-scatter in torchft's layout
                ins = inputs(kind, rank)[:2]
                outp, _ = collectives.allocate_reduce_scatter_output(
                    [i.float() for i in ins], world)
                collectives.reduce_scatter_quantized(outp, [i.float() for i in ins], op, pg).wait()
                def part(q):
                    pieces = []
                    for t in inputs(kind, q)[:2]:
                        rows = t.float().reshape(t.shape[0], -1)
                        m = -(-rows.shape[0] // world) * world
                        full = torch.zeros(m, rows.shape[1])
                        full[:rows.shape[0]] = rows
                        pieces.append(full.chunk(world)[rank].reshape(-1))
                    return torch.cat(pieces).double()
                xs = [part(q) for q in range(world)]
                L = xs[0].numel()
                res[f"rs-{fmt}-{kind}-{avg}"] = [
                    worst(fmt, xs, outp.double(), [(0, L)], torch.full((L,), rank), avg),
                    outp.numel() == L]
        pg.shutdown()
elif scenario == "nonfinite":
    pg = tcp("q/nan")
    res["agreed"] = pg.quantized_format()[0]
    for bad in ("nan", "inf"):
        t = torch.arange(5000, dtype=torch.float32)
        if rank == 1:
            t[1234] = float(bad)
        before = t.clone()
        t0 = time.monotonic()
        try:
            collectives.allreduce_quantized([t], ReduceOp.AVG, pg).wait()
            res[bad] = None
        except Exception as e:
            res[bad] = [type(e).__name__, str(e), time.monotonic() - t0,
                        bool(torch.equal(t, before) or rank == 1)]
    res["errored"] = repr(pg.errored())
    t = torch.full((1000,), float(rank))
    collectives.allreduce_quantized([t], ReduceOp.SUM, pg).wait()
    res["after"] = [sha(t), float(t[0])]
    pg.shutdown()
elif scenario == "kill":
    pg = tcp("q/kill")
    t = torch.randn(4 << 20)
    try:
        for i in range(100000):
            collectives.allreduce_quantized([t], ReduceOp.AVG, pg).wait()
            if i == 1:
                open(out + ".ready", "w").close()
    except Exception as e:
        res = {"type": type(e).__name__, "msg": str(e), "t": time.monotonic(),
               "errored": repr(pg.errored())}
    pg.shutdown()
elif scenario == "mixed":
    if rank == world - 1:
        os.environ["STEPGUARD_QUANTIZE"] = ""
    seen = []
    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    logging.getLogger("stepguard.collectives").addHandler(Catch())
    pg = tcp("q/mixed")
    res["format"] = pg.quantized_format()
    x = torch.randn(10000, generator=torch.Generator().manual_seed(rank))
    a, b = x.clone(), x.clone()
    for _ in range(2):
        a = x.clone()
        collectives.allreduce_quantized([a], ReduceOp.SUM, pg).wait()
    from torch.distributed import AllreduceOptions
    o = AllreduceOptions()
    o.reduceOp = ReduceOp.SUM
    pg.allreduce([b], o).wait()
    res["same_as_full"] = bool(torch.equal(a, b))
    res["warnings"] = [m for m in seen if "full precision" in m]
    pg.shutdown()
with open(out, "w") as f:
    json.dump(res, f)
'''


def _start(procs, tmp_path: Path, world: int, scenario: str, same_host: str = "0"):
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=30))
    outs = [tmp_path / f"out{r}.json" for r in range(world)]
    env = dict(os.environ, STEPGUARD_SAME_HOST=same_host, OMP_NUM_THREADS="1")
    env.pop("STEPGUARD_QUANTIZE", None)
    ps = [procs.spawn(WORKER, str(store.port), str(r), str(world), scenario, str(outs[r]),
                      env=env) for r in range(world)]
    return store, ps, outs


def _finish(ps, outs, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    for p in ps:
        p.wait(timeout=max(deadline - time.monotonic(), 1))
    for p in ps:
        assert p.returncode == 0, f"worker exited with {p.returncode}"
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.parametrize("world", [3, 4])
def test_error_bounds_and_identical_bits(procs, tmp_path, world):
    store, ps, outs = _start(procs, tmp_path, world, "bounds")
    res = _finish(ps, outs)
    for r in res:
        assert r["fp8-agreed"] == "fp8" and r["int8-agreed"] == "int8"
    for key, val in res[0].items():
        if key.startswith("ar-"):
            for r, other in enumerate(res):
                ratio, bits, maxerr = other[key]
                assert ratio <= 1.0, (key, r, ratio, maxerr)
                assert bits == val[1], f"{key}: rank {r} has other bits"
            if "-zeros-" in key:
                assert val[2] == 0.0
        if key.startswith("rs-"):
            for r, other in enumerate(res):
                assert other[key][1], key
                assert other[key][0] <= 1.0, (key, r, other[key][0])


def test_nan_or_inf_fails_every_rank_and_names_it(procs, tmp_path):
    store, ps, outs = _start(procs, tmp_path, 3, "nonfinite")
    res = _finish(ps, outs)
    for r in res:
        assert r["agreed"] == "fp8"
        for bad in ("nan", "inf"):
            kind, msg, took, untouched = r[bad]
            assert "NaN or infinity" in msg and "rank 1" in msg, msg
            assert took < 10.0
            assert untouched  # the tensor is left as it was
        assert r["errored"] == "None"  # the group is still usable
    assert len({r["after"][0] for r in res}) == 1
    assert res[0]["after"][1] == pytest.approx(0 + 1 + 2, rel=0.07)


def test_killed_peer_fails_the_collective_naming_it(procs, tmp_path):
    world, victim = 3, 1
    store, ps, outs = _start(procs, tmp_path, world, "kill")
    ready = [Path(str(o) + ".ready") for o in outs]
    deadline = time.monotonic() + 60
    while not all(r.exists() for r in ready):
        assert time.monotonic() < deadline, "ranks never got going"
        assert all(p.poll() is None for p in ps)
        time.sleep(0.05)
    t_kill = time.monotonic()
    os.kill(ps[victim].pid, signal.SIGKILL)
    for r, p in enumerate(ps):
        if r != victim:
            p.wait(timeout=60)
            assert p.returncode == 0
    for r in range(world):
        if r == victim:
            continue
        res = json.loads(outs[r].read_text())
        assert res["type"] == "Error", res
        assert f"rank {victim}" in res["msg"], res
        assert "quantized" in res["msg"], res
        assert res["errored"] != "None"  # a transport failure poisons the group
        assert res["t"] - t_kill < 10.0  # the connection, not the 20 s deadline


def test_member_not_advertising_means_full_precision_everywhere(procs, tmp_path):
    world = 3
    store, ps, outs = _start(procs, tmp_path, world, "mixed")
    res = _finish(ps, outs)
    for r in res:
        fmt, why = r["format"]
        assert fmt is None and f"[{world - 1}]" in why, r["format"]
        assert r["same_as_full"]
        assert len(r["warnings"]) == 1, r["warnings"]
        assert f"[{world - 1}]" in r["warnings"][0]


def test_fp8_conversion_is_torch_bit_for_bit():
    from stepguard import _C

    # every 61st float32 bit pattern up to 448, both signs, and 448 to 2^20
    u = torch.arange(0, 0x43E00001, 61, dtype=torch.int64).to(torch.int32).view(torch.float32)
    big = torch.linspace(448.0, 2.0**20, 10001)
    x = torch.cat([u, -u, big, -big])
    ours = torch.empty(x.numel(), dtype=torch.uint8)
    _C.fp8_from_f32(x.data_ptr(), ours.data_ptr(), x.numel())
    theirs = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, theirs)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    back = torch.empty(256)
    _C.fp8_to_f32(codes.data_ptr(), back.data_ptr(), 256)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(back.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(back[ok].view(torch.int32), want[ok].view(torch.int32))


def test_kernels_detect_nonfinite_and_check_blocks():
    from stepguard import _C

    x = torch.randn(2000)
    wire = torch.empty(_C.quant_wire_bytes(2000), dtype=torch.uint8)
    for fmt in (_C.QUANT_FP8, _C.QUANT_INT8):
        assert _C.quant_encode(fmt, x.data_ptr(), 2000, wire.data_ptr()) == 0
        y = torch.empty(2000)
        _C.quant_decode(fmt, wire.data_ptr(), wire.numel(), 2000, y.data_ptr())
        assert (y - x).abs().max() < x.abs().max() / 10
        with pytest.raises(_C.Error):
            _C.quant_decode(fmt, wire.data_ptr(), wire.numel(), 1999, y.data_ptr())
        for bad in (float("nan"), float("inf"), float("-inf")):
            z = x.clone()
            z[1500] = bad
            assert _C.quant_encode(fmt, z.data_ptr(), 2000, wire.data_ptr()) == 1


def test_other_groups_fall_back_with_one_warning_naming_them(caplog):
    from torch.distributed import ReduceOp

    from stepguard import collectives
    from stepguard.process_group import ProcessGroupDummy

    pg = ProcessGroupDummy(0, 1)
    t = torch.full((4,), 3.0)
    with caplog.at_level("WARNING", logger="stepguard.collectives"):
        for op in (ReduceOp.AVG, ReduceOp.SUM):
            collectives.allreduce_quantized([t], op, pg).wait()
    assert torch.equal(t, torch.full((4,), 3.0))  # one member: the sum is itself
    msgs = [r.getMessage() for r in caplog.records if "full precision" in r.getMessage()]
    assert len(msgs) == 1 and "ProcessGroupDummy" in msgs[0], msgs


def test_agreement_needs_the_same_wire_version() -> None:
    """Formats are agreed with their wire layout: members of another
    stepguard version (formats without a version, or another one) share no
    format with this one, so all fall back together instead of failing on
    each other's frames."""
    from stepguard.process_group_tcp import QUANT_WIRE, _agree

    now = f"fp8@{QUANT_WIRE},int8@{QUANT_WIRE}"
    assert _agree([now, now, now]) == ("fp8", "")
    assert _agree([f"int8@{QUANT_WIRE}", now]) == ("int8", "")
    for other in ("fp8,int8", f"fp8@{QUANT_WIRE + 1},int8@{QUANT_WIRE + 1}"):
        fmt, why = _agree([now, other])
        assert fmt is None and f"wire version {QUANT_WIRE}" in why, why
        fmt, why = _agree([other, now])
        assert fmt is None, why
    fmt, why = _agree([now, None])
    assert fmt is None and "do not advertise" in why
