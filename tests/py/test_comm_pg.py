"""ProcessGroupTCP over real processes.

Each test starts its ranks as separate Python processes around a TCPStore
held by the test, and collects what they report through files.  Results
are compared with torch's Gloo process group, run in the same processes on
the same data: bit-for-bit where the data is exact (small integers), and
closely (plus bit-identical across our ranks) for random floats.  Failure
tests SIGKILL a rank mid-allreduce, abort from another thread, and check
that a reconfiguration builds a new communicator.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import TCPStore

WORKER = r'''
import json, os, sys, threading, time
from datetime import timedelta
import torch
import torch.distributed as dist
from torch.distributed import (AllreduceOptions, BroadcastOptions, PrefixStore,
                               ReduceOp, TCPStore)
from stepguard.process_group import ProcessGroupTCP

port, rank, world, scenario, out = (int(sys.argv[1]), int(sys.argv[2]),
                                    int(sys.argv[3]), sys.argv[4], sys.argv[5])
T = timedelta(seconds=20)
ADDR = f"127.0.0.1:{port}"

def tcp(prefix="q/1", quorum_id=1, w=world, r=rank, timeout=T,
        progress_timeout=None):
    pg = ProcessGroupTCP(timeout=timeout, progress_timeout=progress_timeout)
    pg.configure(f"{ADDR}/{prefix}", "replica", r, w, quorum_id=quorum_id)
    return pg

def gloo():
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                     timeout=T)
    return dist.ProcessGroupGloo(PrefixStore("gloo", store), rank, world, T)

def data(dtype, seed, exact=True):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    if exact:
        v = torch.randint(1, 5, (1003,), generator=g)
        if dtype in (torch.int8, torch.int32, torch.int64, torch.float32,
                     torch.float64, torch.float16, torch.bfloat16):
            v = v * (1 if rank % 2 else -1)
        return v.to(dtype)
    return (torch.rand(200003, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)

res = {}
if scenario == "compare":
    ours, ref = tcp(), gloo()
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
              torch.int8, torch.uint8, torch.int32, torch.int64]
    ops = {"sum": ReduceOp.SUM, "min": ReduceOp.MIN, "max": ReduceOp.MAX,
           "product": ReduceOp.PRODUCT}
    for dt in dtypes:
        for name, op in ops.items():
            a = data(dt, len(res))
            b = a.clone()
            ours.allreduce([a], op).wait()
            opts = AllreduceOptions(); opts.reduceOp = op
            ref.allreduce([b], opts).wait()
            res[f"{dt}-{name}"] = [a.view(torch.uint8).tolist() if False else
                                   a.float().tolist(), b.float().tolist(),
                                   bytes(a.view(torch.uint8).numpy()).hex()[:4000]]
    # random floats: ours must be bit-identical across ranks
    for size in (5, 200003):
        a = data(torch.float32, 99, exact=False)[:size].clone()
        b = a.clone()
        ours.allreduce([a], ReduceOp.SUM).wait()
        ref.allreduce([b]).wait()
        res[f"rand-{size}"] = [float((a - b).abs().max()),
                               bytes(a.numpy().tobytes()).hex()]
    # AVG (Gloo has none): against Gloo's SUM / world
    a = data(torch.float64, 7); b = a.clone()
    ours.allreduce([a], ReduceOp.AVG).wait(); ref.allreduce([b]).wait()
    res["avg"] = [a.tolist(), (b / world).tolist()]
    # broadcast, allgather, alltoall, reduce_scatter, send/recv, barrier
    for root in range(world):
        a = torch.full((70001,), float(rank)); b = a.clone()
        o = BroadcastOptions(); o.rootRank = root
        ours.broadcast([a], o).wait(); ref.broadcast([b], o).wait()
        res[f"bcast-{root}"] = [a.tolist()[:5], b.tolist()[:5], bool(torch.equal(a, b))]
    a = torch.arange(10, dtype=torch.int64) + 100 * rank
    outs = [torch.zeros(10, dtype=torch.int64) for _ in range(world)]
    refs = [torch.zeros(10, dtype=torch.int64) for _ in range(world)]
    ours.allgather([outs], [a]).wait(); ref.allgather([refs], [a]).wait()
    res["allgather"] = [torch.cat(outs).tolist(), torch.cat(refs).tolist()]
    flat = torch.zeros(10 * world, dtype=torch.int64)
    ours.allgather_into_tensor_coalesced([flat], [a]).wait()
    res["allgather_flat"] = [flat.tolist(), torch.cat(refs).tolist()]
    x = torch.arange(world * 3, dtype=torch.float32) + 1000 * rank
    y = torch.empty_like(x); yr = torch.empty_like(x)
    ours.alltoall_base(y, x, [], [], None).wait()
    ref.alltoall_base(yr, x, [], [], dist.AllToAllOptions()).wait()
    res["alltoall"] = [y.tolist(), yr.tolist()]
    ins = [torch.full((4,), float(rank * 10 + i)) for i in range(world)]
    o = torch.zeros(4)
    ours.reduce_scatter([o], [ins], ReduceOp.SUM).wait()
    res["reduce_scatter"] = [o.tolist(), [float(sum(q * 10 + rank for q in range(world)))] * 4]
    # non-contiguous: staged where Gloo gets it right (broadcast into a
    # view, allgather from and into views), refused where it does not
    nc = torch.full((10,), float(rank))[::2]
    o = BroadcastOptions(); o.rootRank = world - 1
    ours.broadcast([nc], o).wait()
    nin = (torch.arange(20, dtype=torch.int64) + 100 * rank)[::2]
    nouts = [torch.zeros(20, dtype=torch.int64)[::2] for _ in range(world)]
    ours.allgather([nouts], [nin]).wait()
    try:
        ours.allreduce([torch.ones(4, 5).t()], ReduceOp.SUM)
        refused = ""
    except ValueError as e:
        refused = str(e)
    res["noncontig"] = [nc.tolist(), [float(world - 1)] * 5,
                        torch.cat(nouts).tolist(), refused]
    if rank == 0:
        ours.send([torch.arange(6, dtype=torch.float32)], world - 1, 0).wait()
    if rank == world - 1:
        r = torch.zeros(6); ours.recv([r], 0, 0).wait(); res["recv"] = r.tolist()
    c1, c2 = torch.ones(3), torch.full((5,), 2, dtype=torch.int32)
    ours.allreduce_coalesced([c1, c2], dist.AllreduceCoalescedOptions()).wait()
    res["coalesced"] = [c1.tolist(), c2.tolist()]
    flat_in = torch.arange(3 * world, dtype=torch.float64) + rank
    flat_out = torch.zeros(3, dtype=torch.float64)
    o = dist.ReduceScatterOptions(); o.reduceOp = ReduceOp.MAX
    ours.reduce_scatter_tensor_coalesced([flat_out], [flat_in], o).wait()
    res["rs_flat"] = flat_out.tolist()
    one = torch.full((4,), float(rank))
    ours.broadcast_one(one, world - 1).wait()
    res["bcast_one"] = one.tolist()
    fut = ours.allreduce([torch.ones(3)], ReduceOp.SUM).get_future()
    res["future"] = fut.wait()[0].tolist()
    ours.barrier().wait()
    res["size"] = [ours.size(), ours.getBackendName(), ours.errored() is None]
    ours.shutdown()
elif scenario in ("kill", "hang", "stall"):
    # hang: the operation deadline alone (no progress deadline); stall: a
    # 60 s operation deadline and the 1 s progress deadline (set through
    # the environment)
    pg = tcp(timeout={"hang": timedelta(seconds=3),
                      "stall": timedelta(seconds=60)}.get(scenario, T),
             progress_timeout=0 if scenario == "hang" else None)
    t = torch.zeros(4 << 20)
    print("ready", flush=True)
    t0 = None
    try:
        for i in range(100000):
            pg.allreduce([t], ReduceOp.SUM).wait()
            if i == 1:
                open(out + ".ready", "w").close()
    except Exception as e:
        res = {"type": type(e).__name__, "msg": str(e), "t": time.monotonic(),
               "errored": repr(pg.errored()),
               "same_host": pg.uses_same_host((rank - 1) % world)}
    pg.shutdown()
elif scenario == "abort":
    pg = tcp(timeout=timedelta(seconds=60))
    if rank == 0:
        w = pg.allreduce([torch.zeros(100)], ReduceOp.SUM)
        threading.Timer(0.2, pg.abort).start()
        t0 = time.monotonic()
        try:
            w.wait()
            res["raised"] = None
        except Exception as e:
            res["raised"] = type(e).__name__ + ": " + str(e)
        res["elapsed"] = time.monotonic() - t0
        open(out + ".aborted", "w").close()  # rank 1 may leave now
        res["errored"] = pg.errored() is not None
        try:
            pg.allreduce([torch.zeros(1)], ReduceOp.SUM)
            res["after"] = None
        except Exception as e:
            res["after"] = str(e)
        # an abort also stops a configure that waits for absent peers
        threading.Timer(0.3, pg.abort).start()
        t0 = time.monotonic()
        try:
            pg.configure(f"{ADDR}/q/nobody", "replica", 0, 2, quorum_id=9)
            res["configure_abort"] = None
        except Exception as e:
            res["configure_abort"] = [type(e).__name__, str(e), time.monotonic() - t0]
        # a new configuration makes it usable again
        pg.configure(f"{ADDR}/q/2", "replica", 0, 1, quorum_id=2)
        t = torch.ones(3); pg.allreduce([t], ReduceOp.SUM).wait()
        res["reconfigured"] = t.tolist()
    else:
        # stays until rank 0's wait has ended: had it left after a fixed
        # time, a slow rank 0 would see a vanished peer instead of its abort
        rank0_out = out[:-len(f"{rank}.json")] + "0.json.aborted"
        deadline = time.monotonic() + 60
        while not os.path.exists(rank0_out) and time.monotonic() < deadline:
            time.sleep(0.05)
    pg.shutdown()
elif scenario == "reconfigure":
    pg = tcp("q/1", 1)
    t = torch.ones(4); pg.allreduce([t], ReduceOp.SUM).wait()
    res["q1"] = t.tolist()
    if rank < world - 1:  # the last rank leaves; the others go on as a smaller quorum
        pg.configure(f"{ADDR}/q/2", "replica", rank, world - 1, quorum_id=2)
        t = torch.ones(4); pg.allreduce([t], ReduceOp.SUM).wait()
        res["q2"] = t.tolist()
        res["size"] = pg.size()
    pg.shutdown()
elif scenario == "fork":
    import gc
    pg = tcp()
    t = torch.ones(8); pg.allreduce([t], ReduceOp.SUM).wait()
    pid = os.fork()
    if pid == 0:  # a DataLoader-style worker drops its copy of the group
        try:
            pg.allreduce([torch.ones(1)], ReduceOp.SUM)
            code = 3  # must not be usable here
        except Exception:
            code = 0
        pg.abort(); pg.shutdown(); del pg; gc.collect()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    res["child"] = os.waitstatus_to_exitcode(status)
    t = torch.ones(8); pg.allreduce([t], ReduceOp.SUM).wait()
    res["after"] = t.tolist()
    res["errored"] = pg.errored() is None
    pg.shutdown()
elif scenario == "stale":
    # rank 1 still thinks it is in quorum 1; rank 0 is in quorum 2 (same prefix)
    try:
        tcp("q/same", 2 if rank == 0 else 1, timeout=timedelta(seconds=3))
        res = {"type": None}
    except Exception as e:
        res = {"type": type(e).__name__, "msg": str(e)}
elif scenario == "init":
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=T)
    dist.init_process_group(backend="stepguard_tcp", store=store, rank=rank,
                            world_size=world)
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    outs = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(outs, t)
    b = torch.full((2,), float(rank)); dist.broadcast(b, src=world - 1)
    dist.barrier()
    res = {"sum": t.tolist(), "gather": [o.tolist() for o in outs], "bcast": b.tolist(),
           "rank": dist.get_rank(), "world": dist.get_world_size()}
    # plain torch DDP over the backend: its construction checks the
    # parameters with an allgather sized by c10d's view of the group and
    # waits on it with c10d's default (no) timeout
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x = torch.full((3, 4), float(rank + 1))
    ddp(x).sum().backward()
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    ref(torch.cat([torch.full((3, 4), float(r + 1)) for r in range(world)])).sum().backward()
    res["ddp_grads_match"] = all(
        torch.allclose(p.grad, q.grad / world, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()))
    w = dist.all_reduce(torch.ones(2), async_op=True)
    res["wait_no_timeout"] = w.wait(timedelta(0))
    dist.destroy_process_group()
with open(out, "w") as f:
    json.dump(res, f)
'''


def _start(procs, tmp_path: Path, world: int, scenario: str, same_host: str = ""):
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=30))
    outs = [tmp_path / f"out{r}.json" for r in range(world)]
    env = dict(os.environ)
    if same_host:
        env["STEPGUARD_SAME_HOST"] = same_host
    ps = [
        procs.spawn(WORKER, str(store.port), str(r), str(world), scenario, str(outs[r]),
                    env=env)
        for r in range(world)
    ]
    return store, ps, outs


def _finish(ps, outs, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    for p in ps:
        p.wait(timeout=max(deadline - time.monotonic(), 1))
    for p in ps:
        assert p.returncode == 0, f"worker exited with {p.returncode}"
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.parametrize("world", [2, 3])
def test_matches_gloo(procs, tmp_path, world):
    store, ps, outs = _start(procs, tmp_path, world, "compare")
    res = _finish(ps, outs)
    r0 = res[0]
    for key, val in r0.items():
        if key.startswith("torch."):
            ours, gloo, hexbits = val
            assert ours == gloo, key  # exact data: the same values as Gloo
            for other in res[1:]:
                assert other[key][2] == hexbits, key  # same bits on every rank
    for size in ("rand-5", "rand-200003"):
        assert r0[size][0] < 1e-5  # close to Gloo
        for other in res[1:]:
            assert other[size][1] == r0[size][1]  # identical bits on every rank
    assert r0["avg"][0] == pytest.approx(r0["avg"][1])
    for root in range(world):
        for r in res:
            assert r[f"bcast-{root}"][2], f"broadcast from {root} differs from Gloo"
            assert r[f"bcast-{root}"][0] == [float(root)] * 5
    for r in res:
        assert r["allgather"][0] == r["allgather"][1]
        assert r["allgather_flat"][0] == r["allgather_flat"][1]
        assert r["alltoall"][0] == r["alltoall"][1]
        assert r["reduce_scatter"][0] == r["reduce_scatter"][1]
        assert r["noncontig"][0] == r["noncontig"][1]
        want = [100 * q + 2 * i for q in range(world) for i in range(10)]
        assert r["noncontig"][2] == want
        assert "allreduce: non-contiguous" in r["noncontig"][3]
        assert "tensor.contiguous()" in r["noncontig"][3]
        assert r["future"] == [float(world)] * 3
        assert r["coalesced"] == [[float(world)] * 3, [2 * world] * 5]
        assert r["bcast_one"] == [float(world - 1)] * 4
    for rank, r in enumerate(res):
        # MAX over members q of (3 * rank + i + q): the last member's
        assert r["rs_flat"] == [float(3 * rank + i + world - 1) for i in range(3)]
        assert r["size"] == [world, "stepguard-tcp", True]
    assert res[-1]["recv"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("same_host", ["1", "0"], ids=["same-host", "tcp"])
def test_sigkill_names_the_rank(procs, tmp_path, same_host):
    world, victim = 3, 1
    store, ps, outs = _start(procs, tmp_path, world, "kill", same_host)
    ready = [Path(str(o) + ".ready") for o in outs]
    deadline = time.monotonic() + 60
    while not all(r.exists() for r in ready):
        assert time.monotonic() < deadline, "ranks never got going"
        assert all(p.poll() is None for p in ps)
        time.sleep(0.05)
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
        assert res["errored"] != "None"
        assert res["t"] - t_kill < 10.0  # seen from the connection, not the 20 s deadline
        assert res["same_host"] == (same_host == "1")  # the path under test


@pytest.mark.parametrize("same_host", ["1", "0"], ids=["same-host", "tcp"])
def test_hung_peer_times_out(procs, tmp_path, same_host):
    """A peer that stops (SIGSTOP) without closing anything: the others fail
    at the 3 s deadline with TimeoutError naming it, and are poisoned."""
    world, victim = 2, 1
    store, ps, outs = _start(procs, tmp_path, world, "hang", same_host)
    ready = [Path(str(o) + ".ready") for o in outs]
    deadline = time.monotonic() + 60
    while not all(r.exists() for r in ready):
        assert time.monotonic() < deadline, "ranks never got going"
        assert all(p.poll() is None for p in ps)
        time.sleep(0.05)
    t_stop = time.monotonic()
    os.kill(ps[victim].pid, signal.SIGSTOP)
    try:
        ps[0].wait(timeout=60)
    finally:
        os.kill(ps[victim].pid, signal.SIGKILL)
    assert ps[0].returncode == 0
    res = json.loads(outs[0].read_text())
    assert res["type"] == "TimeoutError", res
    assert f"rank {victim}" in res["msg"], res
    assert res["errored"] != "None"
    assert res["t"] - t_stop < 30.0  # the 3 s deadline, loosely


@pytest.mark.parametrize("same_host", ["1", "0"], ids=["same-host", "tcp"])
def test_stopped_peer_fails_at_the_progress_deadline(procs, tmp_path, same_host,
                                                     monkeypatch):
    """A peer stopped (SIGSTOP) mid-training sends nothing, not even
    keepalives: with a 60 s operation timeout and a 1 s progress timeout
    (STEPGUARD_COMM_PROGRESS_TIMEOUT_SEC), the other rank's allreduce fails
    within seconds with an error naming the peer's rank and address."""
    world, victim = 2, 1
    monkeypatch.setenv("STEPGUARD_COMM_PROGRESS_TIMEOUT_SEC", "1")
    store, ps, outs = _start(procs, tmp_path, world, "stall", same_host)
    ready = [Path(str(o) + ".ready") for o in outs]
    deadline = time.monotonic() + 60
    while not all(r.exists() for r in ready):
        assert time.monotonic() < deadline, "ranks never got going"
        assert all(p.poll() is None for p in ps)
        time.sleep(0.05)
    t_stop = time.monotonic()
    os.kill(ps[victim].pid, signal.SIGSTOP)
    try:
        ps[0].wait(timeout=30)
    finally:
        os.kill(ps[victim].pid, signal.SIGCONT)
        os.kill(ps[victim].pid, signal.SIGKILL)
    assert ps[0].returncode == 0
    res = json.loads(outs[0].read_text())
    assert res["type"] == "Error", res
    assert f"rank {victim}" in res["msg"], res
    assert "progress deadline" in res["msg"], res
    assert "127.0.0.1:" in res["msg"], res  # the peer's address
    assert res["errored"] != "None"
    took = res["t"] - t_stop
    print(f"allreduce failed {took:.2f} s after SIGSTOP: {res['msg']}")
    assert took < 10.0  # the 1 s progress deadline, far below the 60 s timeout


def test_abort_from_another_thread(procs, tmp_path):
    store, ps, outs = _start(procs, tmp_path, 2, "abort")
    res = _finish(ps, outs)[0]
    assert res["raised"] is not None and "abort" in res["raised"]
    assert res["elapsed"] < 10.0  # not the 60 s deadline
    assert res["errored"]
    assert res["after"] is not None
    assert res["reconfigured"] == [1.0, 1.0, 1.0]
    kind, msg, elapsed = res["configure_abort"]
    assert "abort" in msg, res["configure_abort"]
    assert elapsed < 30.0  # not the 60 s timeout


def test_reconfigure_to_a_smaller_quorum(procs, tmp_path):
    store, ps, outs = _start(procs, tmp_path, 3, "reconfigure")
    res = _finish(ps, outs)
    for r in res:
        assert r["q1"] == [3.0] * 4
    for r in res[:2]:
        assert r["q2"] == [2.0] * 4
        assert r["size"] == 2


def test_other_generation_is_refused(procs, tmp_path):
    """A rank of another quorum id is refused at the handshake (it learns
    why); the rank it tried to join times out waiting for the real one."""
    store, ps, outs = _start(procs, tmp_path, 2, "stale")
    res = _finish(ps, outs)
    assert res[1]["type"] == "Error", res[1]
    assert "rank 0" in res[1]["msg"] and "refused" in res[1]["msg"], res[1]
    assert res[0]["type"] == "TimeoutError", res[0]
    assert "rank" in res[0]["msg"] and "1" in res[0]["msg"], res[0]


def test_forked_child_leaves_the_group_alone(procs, tmp_path):
    store, ps, outs = _start(procs, tmp_path, 2, "fork")
    for r in _finish(ps, outs):
        assert r["child"] == 0
        assert r["after"] == [2.0] * 8
        assert r["errored"]


def test_init_process_group_backend(procs, tmp_path):
    store, ps, outs = _start(procs, tmp_path, 2, "init")
    res = _finish(ps, outs)
    for rank, r in enumerate(res):
        assert r["sum"] == [3.0] * 3
        assert r["gather"] == [[3.0] * 3, [3.0] * 3]
        assert r["bcast"] == [1.0, 1.0]
        assert r["rank"] == rank and r["world"] == 2
        assert r["ddp_grads_match"], "DDP over the backend did not average the gradients"
        assert r["wait_no_timeout"] is True  # c10d's kNoTimeout waits, it does not expire


def _thread_states() -> int:
    """The interpreter's thread states (CPython's C API through ctypes)."""
    import ctypes

    api = ctypes.pythonapi
    api.PyInterpreterState_Get.restype = ctypes.c_void_p
    api.PyInterpreterState_ThreadHead.restype = ctypes.c_void_p
    api.PyInterpreterState_ThreadHead.argtypes = [ctypes.c_void_p]
    api.PyThreadState_Next.restype = ctypes.c_void_p
    api.PyThreadState_Next.argtypes = [ctypes.c_void_p]
    ts, n = api.PyInterpreterState_ThreadHead(api.PyInterpreterState_Get()), 0
    while ts:
        n += 1
        ts = api.PyThreadState_Next(ts)
    return n


def test_progress_thread_keeps_its_python_state_and_frees_it_at_exit():
    """The communicator's progress thread calls into Python for every
    completion: it keeps one thread state while it runs (a fresh one per
    call cost an mmap and a munmap each) and frees it when it exits, so
    groups built and destroyed one after another leave nothing behind."""
    import stepguard.process_group_tcp  # noqa: F401 - registers the backend

    before = _thread_states()
    for _ in range(4):
        store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        dist.init_process_group(backend="stepguard_tcp", store=store, rank=0, world_size=1,
                                timeout=timedelta(seconds=10))
        t = torch.ones(4)
        for _ in range(5):
            dist.all_reduce(t)
        # the completion thread (Python's) and the progress thread's kept state
        assert _thread_states() >= before + 2
        dist.destroy_process_group()
        deadline = time.monotonic() + 10
        while _thread_states() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _thread_states() == before


def test_bad_arguments_raise():
    from stepguard.process_group import ProcessGroupTCP

    pg = ProcessGroupTCP(timeout=timedelta(seconds=5))
    with pytest.raises(RuntimeError, match="not configured"):
        pg.allreduce([torch.ones(1)], torch.distributed.ReduceOp.SUM)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg.configure(f"127.0.0.1:{store.port}/solo", "r", 0, 1, quorum_id=3)
    with pytest.raises(TypeError):
        pg.allreduce([torch.ones(1, dtype=torch.bool)], torch.distributed.ReduceOp.SUM)
    with pytest.raises(ValueError):
        pg.allreduce([torch.ones(1)], torch.distributed.ReduceOp.BAND)
    with pytest.raises(ValueError, match="tag must be 0, got 7"):
        pg.send([torch.ones(1)], 0, 7)
    with pytest.raises(ValueError, match="tag must be 0, got 3"):
        pg.recv([torch.ones(1)], 0, 3)
    # non-contiguous tensors where torch's Gloo refuses them or silently
    # reduces the wrong elements: a clear error naming the operation and the
    # fix, raised by the call, nothing issued
    strided = torch.arange(8, dtype=torch.float32)[::2]
    flat = torch.zeros(4)
    rs = torch.distributed.ReduceScatterOptions()
    refusals = {
        "allreduce": lambda: pg.allreduce([strided], torch.distributed.ReduceOp.SUM),
        "reduce_scatter": lambda: pg.reduce_scatter([strided], [[flat]], rs),
        "reduce_scatter_tensor": lambda: pg.reduce_scatter_tensor_coalesced(
            [strided], [flat], rs),
        "alltoall_base": lambda: pg.alltoall_base(flat, strided, [], [], None),
        "send": lambda: pg.send([strided], 0, 0),
        "recv": lambda: pg.recv([strided], 0, 0),
    }
    for name, call in refusals.items():
        with pytest.raises(ValueError, match=rf"^{name}: non-contiguous .*tensor\.contiguous\(\)"):
            call()
    with pytest.raises(ValueError, match="alltoall_base: non-contiguous"):
        pg.alltoall_base(strided, flat, [], [], None)  # the output too
    assert strided.tolist() == [0.0, 2.0, 4.0, 6.0]  # untouched
    assert pg.errored() is None  # a refused call does not poison the group
    t = torch.ones(2)
    pg.allreduce([t], torch.distributed.ReduceOp.SUM).wait()  # world of one
    assert t.tolist() == [1.0, 1.0]
    pg.shutdown()
