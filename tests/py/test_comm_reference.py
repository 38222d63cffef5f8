"""ProcessGroupTCP against a float64 reference, in real processes.

One spawn per world size (2, 3 and 4 ranks) runs every case in a loop:
allreduce and reduce_scatter over every dtype x reduction x size (zero,
one, odd, and large enough for the pipelined ring and the same-host path),
broadcast from every root, allgather, uneven alltoall, send/recv, barrier,
a non-contiguous tensor (staged for broadcast) and the inputs the group
refuses (a non-contiguous one for allreduce among them).

Every rank generates every rank's inputs from a seed, so it computes the
reference itself: the exact result in float64 (inputs are chosen so that
integer results do not overflow and float products stay in range).  Floats
must lie within the bound of docs/internals/comm.md (m roundings along an
element's path, m = n - 1 for the ring and ceil(log2 n) for recursive
doubling):

    SUM      |c - e| <= gamma_m * sum_i |x_i|
    AVG      |c - e| <= gamma_m * sum_i |x_i| / n + u |c|
    PRODUCT  |c - e| <= gamma_(n-1) * |e|   (n - 1 multiplications, each
                                            rounded, whatever the algorithm)
    MIN/MAX  c == e

with gamma_m = m u / (1 - m u), u the unit roundoff of the type (for the
half types plus 2^-24 for the float32 operation inside each hop), and the
float64 reference's own rounding added.  Integers must be exact.  Each rank
reports a digest of every result; the digests must agree across ranks (the
same bits everywhere).  Mismatches are reported with the case and the
worst element.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

WORKER = r'''
import hashlib, json, math, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
from torch.distributed import BroadcastOptions, ReduceOp
from stepguard.process_group import ProcessGroupTCP

port, rank, world, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
pg = ProcessGroupTCP(timeout=timedelta(seconds=60))
pg.configure(f"127.0.0.1:{port}/ref", "replica", rank, world, quorum_id=1)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int8": torch.int8, "uint8": torch.uint8,
          "int32": torch.int32, "int64": torch.int64}
UNIT = {"float32": 2.0 ** -24, "float64": 2.0 ** -53,
        "float16": 2.0 ** -11 + 2.0 ** -24, "bfloat16": 2.0 ** -8 + 2.0 ** -24}
OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "min": ReduceOp.MIN,
       "max": ReduceOp.MAX, "product": ReduceOp.PRODUCT}
SIZES = [0, 1, 7, 1001, 100003]
SMALL_MAX = (1 << 20) if world == 2 else (64 << 10)  # recursive doubling up to this

res = {"digests": {}, "errors": [], "paths": [], "checked": 0}

def gen(key, q, count, dname, op):
    """Rank q's input for case `key`: the same on every rank."""
    g = torch.Generator().manual_seed(hash_key(key) * 64 + q)
    dt = DTYPES[dname]
    if dt.is_floating_point:
        if op == "product":
            mag = torch.rand(count, generator=g, dtype=torch.float64) * 1.5 + 0.5
            sign = torch.randint(0, 2, (count,), generator=g) * 2 - 1
            return (mag * sign).to(dt)
        return (torch.rand(count, generator=g, dtype=torch.float64) * 2 - 1).to(dt)
    lo, hi = {"sum": (-10, 11), "avg": (-10, 11), "product": (-3, 4),
              "min": (-100, 101), "max": (-100, 101)}[op]
    if dt == torch.uint8:
        lo = 0
    return torch.randint(lo, hi, (count,), generator=g).to(dt)

def hash_key(key):
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:6], "little")

def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]

def gamma(m, u):
    return m * u / (1 - m * u)

def check_reduction(key, dname, op, got, xs, m):
    """got: our result; xs: [world, count] float64 inputs; m: roundings."""
    res["checked"] += 1
    c = got.to(torch.float64)
    if got.numel() == 0:
        return
    dt = DTYPES[dname]
    if not dt.is_floating_point:
        if op == "sum":
            e = xs.sum(0)
        elif op == "avg":
            e = torch.trunc(xs.sum(0) / world)
        elif op == "product":
            e = xs.prod(0)
        elif op == "min":
            e = xs.min(0).values
        else:
            e = xs.max(0).values
        bad = (c != e).nonzero()
        if len(bad):
            i = int(bad[0])
            res["errors"].append(f"{key}: element {i}: got {c[i].item()} want {e[i].item()}")
        return
    u = UNIT[dname]
    ref_u = gamma(world, 2.0 ** -53)  # the float64 reference's own rounding
    absx = xs.abs().sum(0)
    if op == "sum":
        e = xs.sum(0)
        bound = (gamma(m, u) + ref_u) * absx
    elif op == "avg":
        e = xs.sum(0) / world
        bound = (gamma(m, u) + ref_u) * absx / world + u * c.abs()
    elif op == "product":
        # a product rounds once per multiplication, whatever the tree's
        # depth: n - 1 roundings with either algorithm
        e = xs.prod(0)
        bound = (gamma(world - 1, u) + ref_u) * e.abs()
    elif op == "min":
        e, bound = xs.min(0).values, torch.zeros_like(c)
    else:
        e, bound = xs.max(0).values, torch.zeros_like(c)
    excess = (c - e).abs() - bound
    i = int(excess.argmax())
    if excess[i] > 0:
        res["errors"].append(
            f"{key}: element {i}: got {c[i].item()!r} want {e[i].item()!r} "
            f"(error {abs(c[i] - e[i]).item():.3g} > bound {bound[i].item():.3g})")

def roundings(nbytes, count, ring_only=False):
    if world == 1:
        return 0
    if ring_only or not (nbytes <= SMALL_MAX or count < world):
        return world - 1
    return math.ceil(math.log2(world))

def expect_equal(key, got, want):
    res["checked"] += 1
    if not torch.equal(got, want):
        res["errors"].append(f"{key}: bytes differ from the sender's")

prev = (rank - 1) % world
res["paths"].append(pg.uses_same_host(prev) if world > 1 else None)

# allreduce: every dtype x op x size
for dname in DTYPES:
    for op in OPS:
        for count in SIZES:
            key = f"allreduce/{dname}/{op}/{count}"
            ins = [gen(key, q, count, dname, op) for q in range(world)]
            t = ins[rank].clone()
            pg.allreduce([t], OPS[op]).wait()
            xs = torch.stack([x.to(torch.float64) for x in ins]) if count else torch.zeros(world, 0)
            m = roundings(t.numel() * t.element_size(), count)
            check_reduction(key, dname, op, t, xs, m)
            res["digests"][key] = digest(t)

# reduce_scatter: member r gets op over q of q's ins[r] (always the ring)
for dname in DTYPES:
    for op in OPS:
        for count in (0, 1, 7, 30011):
            key = f"reduce_scatter/{dname}/{op}/{count}"
            mine = [gen(f"{key}/{r}", rank, count, dname, op) for r in range(world)]
            o = torch.empty(count, dtype=DTYPES[dname])
            pg.reduce_scatter([o], [mine], OPS[op]).wait()
            xs = torch.stack([gen(f"{key}/{rank}", q, count, dname, op).to(torch.float64)
                              for q in range(world)]) if count else torch.zeros(world, 0)
            check_reduction(key, dname, op, o, xs, roundings(0, count, ring_only=True))

# broadcast from every root, one float and one byte type
for dname in ("float32", "int8"):
    for count in (0, 7, 300007):
        for root in range(world):
            key = f"broadcast/{dname}/{count}/{root}"
            want = gen(key, root, count, dname, "sum")
            t = want.clone() if rank == root else torch.zeros(count, dtype=DTYPES[dname])
            o = BroadcastOptions(); o.rootRank = root
            pg.broadcast([t], o).wait()
            expect_equal(key, t, want)
            res["digests"][key] = digest(t)

# allgather
for count in (0, 7, 100003):
    key = f"allgather/{count}"
    outs = [torch.empty(count, dtype=torch.bfloat16) for _ in range(world)]
    pg.allgather([outs], [gen(key, rank, count, "bfloat16", "sum")]).wait()
    for q in range(world):
        expect_equal(f"{key}/from {q}", outs[q], gen(key, q, count, "bfloat16", "sum"))
    res["digests"][key] = digest(torch.cat(outs))

# alltoall with uneven splits (some empty)
for big in (0, 70001):
    key = f"alltoall/{big}"
    rows = lambda s, d: (s * 7 + d * 3) % 4 + (big if (s + d) % 2 else 0)
    block = lambda s, d: gen(f"{key}/{s}->{d}", s, rows(s, d), "float64", "sum")
    x = torch.cat([block(rank, d) for d in range(world)])
    y = torch.empty(sum(rows(s, rank) for s in range(world)), dtype=torch.float64)
    pg.alltoall_base(y, x, [rows(s, rank) for s in range(world)],
                     [rows(rank, d) for d in range(world)], None).wait()
    expect_equal(key, y, torch.cat([block(s, rank) for s in range(world)]))

# send/recv around the ring; even ranks send first so nobody waits in a circle
for count in (0, 7, 100003):
    key = f"sendrecv/{count}"
    mine = gen(f"{key}/{rank}", rank, count, "int32", "min")
    got = torch.empty(count, dtype=torch.int32)
    if world > 1:
        if rank % 2 == 0:
            pg.send([mine], (rank + 1) % world, 0).wait()
            pg.recv([got], prev, 0).wait()
        else:
            pg.recv([got], prev, 0).wait()
            pg.send([mine], (rank + 1) % world, 0).wait()
        expect_equal(key, got, gen(f"{key}/{prev}", prev, count, "int32", "min"))

pg.barrier().wait()

# a non-contiguous tensor is staged and written back where Gloo accepts it
# and gets it right (broadcast), refused where Gloo silently reduces the
# wrong elements (allreduce: see the refusals)
base = torch.arange(35, dtype=torch.float32).reshape(5, 7)
nc = (base * (rank + 1)).t()
assert not nc.is_contiguous()
o = BroadcastOptions(); o.rootRank = world - 1
pg.broadcast([nc], o).wait()
expect_equal("noncontiguous", nc, (base * world).t())

# what the group refuses: a clear error, raised before anything is sent
refusals = {}
for name, call in {
    "bool": lambda: pg.allreduce([torch.ones(3, dtype=torch.bool)], ReduceOp.SUM),
    "complex": lambda: pg.allreduce([torch.ones(3, dtype=torch.complex64)], ReduceOp.SUM),
    "band": lambda: pg.allreduce([torch.ones(3)], ReduceOp.BAND),
    "rs_count": lambda: pg.reduce_scatter([torch.ones(3)], [[torch.ones(3)]], ReduceOp.SUM),
    "noncontig": lambda: pg.allreduce([(base * (rank + 1)).t()], ReduceOp.SUM),
    "a2a_split": lambda: pg.alltoall_base(torch.ones(world), torch.ones(world),
                                          [world + 1] + [0] * (world - 1), [], None),
}.items():
    try:
        call()
        refusals[name] = None
    except Exception as e:
        refusals[name] = [type(e).__name__, str(e)]
res["refusals"] = refusals
# the refusals left the group healthy
t = torch.ones(4); pg.allreduce([t], ReduceOp.SUM).wait()
res["after"] = t.tolist()
res["errored"] = repr(pg.errored())
pg.shutdown()
with open(out, "w") as f:
    json.dump(res, f)
'''


def _run(procs, tmp_path: Path, world: int, env_extra: dict) -> list:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=30))
    env = dict(os.environ, **env_extra)
    outs = [tmp_path / f"ref{r}.json" for r in range(world)]
    ps = [procs.spawn(WORKER, str(store.port), str(r), str(world), str(outs[r]), env=env)
          for r in range(world)]
    deadline = time.monotonic() + 300
    for p in ps:
        p.wait(timeout=max(deadline - time.monotonic(), 1))
    for p in ps:
        assert p.returncode == 0, f"worker exited with {p.returncode}"
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.parametrize(
    "world,same_host",
    [(2, True), (3, True), (4, True), (3, False)],
    ids=["2-same-host", "3-same-host", "4-same-host", "3-tcp"],
)
def test_against_float64_reference(procs, tmp_path, world, same_host):
    env = {} if same_host else {"STEPGUARD_SAME_HOST": "0"}
    if same_host:
        env["STEPGUARD_SAME_HOST"] = "1"
    res = _run(procs, tmp_path, world, env)
    for rank, r in enumerate(res):
        assert r["errors"] == [], f"rank {rank}: " + "\n".join(r["errors"][:20])
        # 200 allreduces, 160 reduce-scatters, and the byte operations
        assert r["checked"] >= 8 * 5 * (5 + 4) + 6 * world + 3 * world + 2 + 3 + 1
        # the path under test is the one taken (the same-host one needs
        # /proc and ptrace rights, which CI's containers give)
        assert r["paths"] == [same_host], r["paths"]
        assert r["after"] == [float(world)] * 4
        assert r["errored"] == "None"
        ref = r["refusals"]
        assert ref["bool"][0] == "TypeError" and "torch.bool" in ref["bool"][1]
        assert ref["complex"][0] == "TypeError" and "complex" in ref["complex"][1]
        assert ref["band"][0] == "ValueError" and "reduce op" in ref["band"][1]
        assert ref["rs_count"][0] == "ValueError" and "tensors" in ref["rs_count"][1]
        assert ref["a2a_split"][0] == "ValueError" and "split" in ref["a2a_split"][1]
        assert ref["noncontig"][0] == "ValueError"
        assert ref["noncontig"][1].startswith("allreduce: non-contiguous")
        assert "tensor.contiguous()" in ref["noncontig"][1]
    # the same bits on every rank, for every case
    keys = set(res[0]["digests"])
    assert len(keys) > 200
    for rank, r in enumerate(res[1:], start=1):
        assert set(r["digests"]) == keys
        differ = [k for k in keys if r["digests"][k] != res[0]["digests"][k]]
        assert differ == [], f"rank {rank} differs from rank 0 in {sorted(differ)[:10]}"
