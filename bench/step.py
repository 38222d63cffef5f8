"""Benchmark: steady-state training step time with stepguard's
DistributedDataParallel against plain torch DistributedDataParallel over a
Gloo process group, and against torchft's DDP, in the same run.

Every replica is one process (one rank per replica group) training the same
small MLP on CPU.  A step is ``zero_grad`` (for the fault-tolerant kinds:
the quorum), forward, backward (the gradient allreduce) and
``optimizer.step`` (the commit vote), timed by each process after a warm-up.

Each replica process holds all three kinds (a model, optimizer and process
group each; a lighthouse per fault-tolerant kind) and runs them in turn in
blocks of ``--block`` steps, the order rotated every round, so that the
kinds see the same machine within a fraction of a second: on a shared
machine the load moves a step time by 30% between runs seconds apart.
Every block records replica 0's step times, its CPU time per step (every
thread of the process), its context switches per step (a wakeup or a
preemption each) and the CPU its kind's lighthouse process used.  A kind's
ratio to plain DDP is taken per pair of blocks of the same round, and
reported as the median of those ratios with their quartiles and a 95%
bootstrap confidence interval, for wall time and CPU time; the goal for
stepguard is at most 1.05x.  ``--separate`` runs each kind in processes of
its own instead (the earlier method).  Results go to
``bench/results/step.json``.

Run with ``.venv/bin/python bench/step.py`` (a few minutes on 2 cores), or
``--replicas 2 --rounds 1 --blocks 4`` for a quick look.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("plain", "torchft", "stepguard")
# plain DDP with find_unused_parameters=True, as torchft's DDP builds it
# (how much of its cost is that flag), and stepguard with the buckets DDP's
# own rebuild makes (STEPGUARD_DDP_BUCKETS=rebuilt), and stepguard completing
# each bucket on the process group's thread (STEPGUARD_DDP_COMPLETION=thread):
# --kinds to add them
# and stepguard over its own ProcessGroupTCP whatever --pg says
# (stepguard-tcp: against plain DDP over Gloo in the same run), and plain DDP
# with torch's own Python allreduce comm hook (plain-python-hook: what a comm
# hook written in Python costs by itself, the floor of any DDP that routes
# its buckets through Python, as stepguard's and torchft's do), and
# stepguard's DDP with its buckets allreduced and divided by a comm hook in
# C++ (stepguard-native-hook, bench/native_hook.cpp, compiled by this script
# against the installed torch: what taking the per-bucket work out of Python
# would gain; Gloo only)
REFERENCE_KINDS = ("plain-unused", "stepguard-rebuilt-buckets", "stepguard-thread-completion",
                   "stepguard-tcp", "plain-python-hook", "stepguard-native-hook")
# the environment each stepguard reference kind builds its DDP under
KIND_ENV = {"stepguard-rebuilt-buckets": ("STEPGUARD_DDP_BUCKETS", "rebuilt"),
            "stepguard-thread-completion": ("STEPGUARD_DDP_COMPLETION", "thread")}
LISTEN_RE = re.compile(r"Lighthouse listening on:? http://\S+:(\d+)")
# --pg: the c10d backend plain DDP is built on, and the Manager's group
PG_BACKEND = {"gloo": "gloo", "tcp": "stepguard_tcp"}
PG_CLASS = {"gloo": "ProcessGroupGloo", "tcp": "ProcessGroupTCP"}
PG_LABEL = {"gloo": "Gloo", "tcp": "stepguard's ProcessGroupTCP"}
# where the compiled bench/native_hook.cpp is, for the workers
NATIVE_HOOK_ENV = "SG_BENCH_NATIVE_HOOK_DIR"
NATIVE_HOOK_MODULE = "sg_bench_native_hook"
# what the stepguard kind needs from the package
API = ("Manager", "DistributedDataParallel", "Optimizer", "ProcessGroupGloo")


# ---- the C++ comm hook of stepguard-native-hook -----------------------


def build_native_hook(out_dir: str) -> str | None:
    """Compiles bench/native_hook.cpp into `out_dir` with torch's own
    extension builder (in a child process: this one does not import
    torch); returns why it could not, or None."""
    code = ("import sys\n"
            "from torch.utils.cpp_extension import load\n"
            "load(name=sys.argv[1], sources=[sys.argv[2]], build_directory=sys.argv[3])\n")
    try:
        r = subprocess.run([sys.executable, "-c", code, NATIVE_HOOK_MODULE,
                            str(ROOT / "bench/native_hook.cpp"), out_dir],
                           capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"building it: {e}"
    if r.returncode != 0:
        return f"building it failed: {(r.stdout + r.stderr).strip()[-500:]}"
    return None


def native_hook_ddp(ft):
    """stepguard's DistributedDataParallel with the C++ comm hook in
    place of the Python one: the hook reads the step's group and
    participants, set after the forward pass (the quorum the forward pass
    overlapped), and a failure it recorded is reported before the vote."""
    import weakref

    sys.path.insert(0, os.environ[NATIVE_HOOK_ENV])
    native = importlib.import_module(NATIVE_HOOK_MODULE)

    class NativeHookDDP(ft.DistributedDataParallel):
        def register_comm_hook(self, state, hook) -> None:
            self._native = native.HookState()
            native.register(self.reducer, self._native)
            state.manager._commit_checks.append(weakref.WeakMethod(self._report))

        def forward(self, *inputs, **kwargs):
            out = super().forward(*inputs, **kwargs)
            m = self._hook_state.manager
            m.wait_quorum()
            self._native.set(m._pg.parent, m.num_participants(), m.is_participating())
            return out

        def _report(self) -> None:
            err = self._native.take_error()
            if err is not None:
                self._hook_state.manager.report_error(RuntimeError(err))

    return NativeHookDDP


# ---- worker: one replica ---------------------------------------------


def wait_file(path: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


def thread_cpu_ns() -> dict[int, int]:
    """CPU nanoseconds of each thread of this process so far."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread ended
    return out


def thread_name(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def ctx_switches() -> int:
    """Context switches of every thread of this process so far (voluntary
    and not): each is a wakeup or a preemption the step paid for."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    # voluntary_ctxt_switches, nonvoluntary_ctxt_switches
                    if "ctxt_switches" in line:
                        total += int(line.split()[-1])
        except OSError:
            pass  # the thread ended
    return total


def params_digest(model) -> str:
    """SHA-256 of the model's parameters, bit for bit."""
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def make_model(torch, width: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 10))


def proc_cpu_s(pid: int) -> float:
    """CPU seconds of process `pid` (every thread) so far, from the
    scheduler's nanosecond counts (stat's ticks are 10 ms)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread ended
    return total / 1e9


class Kind:
    """One kind's model, optimizer and (for the fault-tolerant kinds)
    Manager in a replica's process."""

    def __init__(self, kind: str, a: argparse.Namespace, lighthouse: str) -> None:
        import torch
        import torch.distributed as dist

        self.kind = kind
        self.model = make_model(torch, a.width)
        inner = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.manager = None
        self.waited = [0.0]  # this step's time in manager.wait_quorum
        if kind in ("plain", "plain-unused", "plain-python-hook"):
            if a.pg == "tcp":
                importlib.import_module("stepguard.process_group_tcp")  # registers the backend
            if not dist.is_initialized():  # the plain kinds share the default group
                port_file = os.path.join(a.dir, "plain.port")
                if a.rank == 0:
                    self.store = dist.TCPStore("127.0.0.1", 0, a.world, is_master=True,
                                               wait_for_workers=False)
                    tmp = port_file + ".tmp"
                    with open(tmp, "w") as f:
                        f.write(str(self.store.port))
                    os.rename(tmp, port_file)
                else:
                    self.store = dist.TCPStore("127.0.0.1", int(wait_file(port_file, 60)),
                                               a.world, is_master=False)
                dist.init_process_group(PG_BACKEND[a.pg], store=self.store, rank=a.rank,
                                        world_size=a.world, timeout=timedelta(seconds=60))
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                self.model, find_unused_parameters=kind == "plain-unused")
            if kind == "plain-python-hook":
                # divides the bucket, allreduces it and returns the result
                # from a callback on the group's thread
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
                self.ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            self.opt = inner
            return
        ft = importlib.import_module("stepguard" if kind.startswith("stepguard") else kind)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        model = self.model
        manager = ft.Manager(
            pg=getattr(ft, PG_CLASS["tcp" if kind == "stepguard-tcp" else a.pg])(
                timeout=timedelta(seconds=60)),
            load_state_dict=lambda sd: (model.load_state_dict(sd["m"]),
                                        inner.load_state_dict(sd["o"])),
            state_dict=lambda: {"m": model.state_dict(), "o": inner.state_dict()},
            min_replica_size=1, rank=0, world_size=1,
            store_addr="127.0.0.1", store_port=self.store.port,
            lighthouse_addr=lighthouse, replica_id=f"bench_{a.rank}", port=0,
            hostname="127.0.0.1", timeout=timedelta(seconds=60),
            quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=60))
        self.manager = manager
        env = KIND_ENV.get(kind)
        if env:
            os.environ[env[0]] = env[1]
        try:
            ddp_class = (native_hook_ddp(ft) if kind == "stepguard-native-hook"
                         else ft.DistributedDataParallel)
            self.ddp = ddp_class(manager, self.model)
        finally:
            if env:
                os.environ.pop(env[0], None)
        self.opt = ft.Optimizer(manager, inner)
        # time spent waiting for the quorum (inside backward, at the first
        # bucket): how much of the lighthouse round trip the forward pass
        # did not hide
        real_wait = manager.wait_quorum
        waited = self.waited

        def timed_wait() -> None:
            t = time.perf_counter()
            try:
                real_wait()
            finally:
                waited[0] += time.perf_counter() - t

        manager.wait_quorum = timed_wait

    def step(self, x, y, times: list | None, phases: dict | None) -> bool:
        """One training step; appends its timings when `times` is given.
        Returns whether it committed."""
        import torch

        self.waited[0] = 0.0
        t0 = time.perf_counter()
        self.opt.zero_grad()
        ta = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(self.ddp(x), y)
        tb = time.perf_counter()
        loss.backward()
        tc = time.perf_counter()
        before = self.manager.current_step() if self.manager else 0
        self.opt.step()
        t1 = time.perf_counter()
        if times is not None and phases is not None:
            times.append(t1 - t0)
            for k, v in (("zero_grad", ta - t0), ("forward", tb - ta),
                         ("backward", tc - tb), ("step", t1 - tc),
                         ("quorum_wait", self.waited[0])):
                phases[k].append(v)
        return self.manager is None or self.manager.current_step() == before + 1

    def close(self) -> None:
        import torch.distributed as dist

        if self.manager is not None:
            self.manager.shutdown(wait=False)
        elif dist.is_initialized():
            dist.destroy_process_group()


def new_phases() -> dict[str, list[float]]:
    return {"zero_grad": [], "forward": [], "backward": [], "step": [], "quorum_wait": []}


def worker(a: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    lighthouses = dict(kv.split("=", 1) for kv in a.lighthouse.split(",") if kv)
    lh_pids = {k: int(v) for k, v in (kv.split("=", 1) for kv in a.lighthouse_pids.split(",")
                                     if kv)}
    kinds = [Kind(k, a, lighthouses.get(k, "")) for k in a.kind.split(",")]
    gen = torch.Generator().manual_seed(a.rank)
    data = [(torch.randn(a.batch, 256, generator=gen), torch.randint(0, 10, (a.batch,), generator=gen))
            for _ in range(8)]
    committed = {k.kind: 0 for k in kinds}
    for i in range(a.warmup):
        for k in kinds:
            committed[k.kind] += k.step(*data[i % len(data)], None, None)
    # blocks: `block` steps of one kind, the kinds in turn (the order rotated
    # each round so that none always follows the same one); every replica
    # runs the same sequence, so they switch kinds together
    blocks: dict[str, list[dict]] = {k.kind: [] for k in kinds}
    prof = None
    if a.profile and a.rank == 0:
        import cProfile

        prof = {k.kind: cProfile.Profile() for k in kinds}
    # each kind takes the batches in the same order (from the first after
    # the warm-up), so kinds that compute the same thing end with the same
    # parameters
    nth = {k.kind: a.warmup for k in kinds}
    for rnd in range(a.blocks):
        order = kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]
        for k in order:
            times: list[float] = []
            phases = new_phases()
            cs0 = ctx_switches()
            th0 = thread_cpu_ns()
            cpu0 = time.process_time()
            lh0 = proc_cpu_s(lh_pids[k.kind]) if k.kind in lh_pids else 0.0
            if prof is not None:
                prof[k.kind].enable()
            for _ in range(a.block):
                committed[k.kind] += k.step(*data[nth[k.kind] % len(data)], times, phases)
                nth[k.kind] += 1
            if prof is not None:
                prof[k.kind].disable()
            cpu = time.process_time() - cpu0
            lh = proc_cpu_s(lh_pids[k.kind]) - lh0 if k.kind in lh_pids else 0.0
            th1 = thread_cpu_ns()
            # CPU per step of each thread that ran in this block, busiest
            # first: the main thread is "main", the others by thread id
            threads = sorted((("main" if tid == os.getpid() else f"{tid}:{thread_name(tid)}"),
                              (ns - th0.get(tid, 0)) / 1e6 / a.block)
                             for tid, ns in th1.items() if ns > th0.get(tid, 0))
            threads.sort(key=lambda kv: -kv[1])
            blocks[k.kind].append({
                "round": rnd, "times": times, "phases": phases,
                # every thread of this process, per step of the block
                "cpu_per_step": cpu / a.block,
                "ctx_switches_per_step": (ctx_switches() - cs0) / a.block,
                "thread_cpu_ms_per_step": dict(threads[:8]),
                # the kind's lighthouse process (shared by the replicas)
                "lighthouse_cpu_per_step": lh / a.block})
    if prof is not None:
        for name, p in prof.items():
            p.dump_stats(f"{a.profile}.{name}.{a.world}")
    result = {"rank": a.rank, "world": a.world, "blocks": blocks,
              "digest": {k.kind: params_digest(k.model) for k in kinds},
              "committed": committed, "total": a.warmup + a.blocks * a.block,
              "participants": {k.kind: (k.manager.num_participants() if k.manager else a.world)
                               for k in kinds}}
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.rename(tmp, a.out)
    sys.stdout.flush()
    for k in kinds:
        k.close()
    os._exit(0)


# ---- driver ----------------------------------------------------------------


def has_api(kind: str) -> str | None:
    """None if `kind` has the training API, else why not."""
    names = API if kind == "stepguard" else API[:1]
    code = ("import importlib,sys\n"
            f"m=importlib.import_module('{kind}')\n"
            f"missing=[n for n in {names!r} if not hasattr(m, n)]\n"
            "print(','.join(missing)); sys.exit(1 if missing else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    if r.returncode == 0:
        return None
    return (r.stdout.strip() and f"missing {r.stdout.strip()}") or r.stderr.strip()[-200:]


def start_lighthouse(kind: str, n: int) -> tuple[subprocess.Popen, str]:
    flags = ["--bind", "127.0.0.1:0", "--min_replicas", str(n),
             "--join_timeout_ms", "60000"]
    if kind == "torchft":
        cmd = [str(Path(sys.executable).parent / "torchft_lighthouse"), *flags]
    else:
        cmd = [sys.executable, "-c",
               "import sys\nfrom stepguard.coordination import lighthouse_main\n"
               "sys.exit(lighthouse_main())\n", *flags]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert p.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = p.stdout.readline().decode(errors="replace")
        if not line:
            break
        m = LISTEN_RE.search(line)
        if m:
            # keep draining its output so that it never blocks on a full pipe
            out = p.stdout
            threading.Thread(target=lambda: out.read(), daemon=True).start()
            return p, f"http://127.0.0.1:{m.group(1)}"
    p.kill()
    p.wait()
    raise RuntimeError(f"{kind} lighthouse did not start")


def run_once(kinds: list[str], n: int, a: argparse.Namespace, blocks: int,
             block: int) -> list[dict]:
    """Runs n replicas, each running `kinds` in turn in blocks of `block`
    steps; returns every replica's result (all checked)."""
    with tempfile.TemporaryDirectory(prefix="sg-step-") as d:
        lhs: dict[str, tuple[subprocess.Popen, str]] = {}
        procs = []
        env = dict(os.environ, OMP_NUM_THREADS="1")
        try:
            for k in kinds:
                if k.startswith(("torchft", "stepguard")):
                    lhs[k] = start_lighthouse(k, n)
            addrs = ",".join(f"{k}={addr}" for k, (_, addr) in lhs.items())
            pids = ",".join(f"{k}={p.pid}" for k, (p, _) in lhs.items())
            for r in range(n):
                cmd = [sys.executable, __file__, "--worker", "--kind", ",".join(kinds),
                       "--rank", str(r), "--world", str(n), "--dir", d,
                       "--lighthouse", addrs, "--lighthouse-pids", pids,
                       "--out", os.path.join(d, f"r{r}.json"), "--blocks", str(blocks),
                       "--block", str(block), "--warmup", str(a.warmup),
                       "--width", str(a.width), "--batch", str(a.batch),
                       "--pg", a.pg, "--profile", a.profile]
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                              stderr=open(os.path.join(d, f"r{r}.log"), "wb")))
            deadline = time.monotonic() + a.run_timeout
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            results = []
            for r, p in enumerate(procs):
                out = os.path.join(d, f"r{r}.json")
                if p.returncode != 0 or not os.path.exists(out):
                    log = Path(d, f"r{r}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{kinds} replica {r} failed (rc {p.returncode}):\n{log}")
                with open(out) as f:
                    results.append(json.load(f))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            for lh, _ in lhs.values():
                lh.kill()
                lh.wait()
    for res in results:
        for k in kinds:
            # a benchmark of steps that did not commit, or without every
            # replica, means nothing
            if res["committed"][k] < res["total"] - 1 or res["participants"][k] != n:
                raise RuntimeError(f"{k} with {n} replicas: only {res['committed'][k]}/"
                                   f"{res['total']} steps committed, "
                                   f"{res['participants'][k]} participants")
    for k in kinds:
        # every kind keeps its replicas bit-identical, or it computed nothing
        # worth timing
        if len({res["digest"][k] for res in results}) != 1:
            raise RuntimeError(f"{k} with {n} replicas: the replicas' parameters differ")
    return results


def thread_medians(blocks: list[dict]) -> dict[str, float]:
    """Median CPU ms per step of each thread over `blocks` (of one run: a
    thread id means nothing in another), the busiest six."""
    names = {n for b in blocks for n in b["thread_cpu_ms_per_step"]}
    med = {n: statistics.median(b["thread_cpu_ms_per_step"].get(n, 0.0) for b in blocks)
           for n in names}
    return dict(sorted(med.items(), key=lambda kv: -kv[1])[:6])


def median_ci(xs: list[float], reps: int = 2000) -> tuple[float, float]:
    """95% bootstrap confidence interval of the median of `xs`."""
    import random

    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(reps))
    return meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


def summarize(kinds: list[str], results: list[list[dict]]) -> dict:
    """Replica 0's blocks of every run: per kind the median step time (all
    steps pooled), CPU and context switches per step (median of blocks), and
    for each kind against plain the ratio of paired blocks (same run and
    round: the same machine state), their median, spread and a 95%
    confidence interval."""
    per_kind: dict[str, dict] = {}
    blocks = {k: [b for res in results for b in res[0]["blocks"][k]] for k in kinds}
    for k in kinds:
        times = [t for b in blocks[k] for t in b["times"]]
        per_kind[k] = {
            "median_ms": 1e3 * statistics.median(times),
            "p90_ms": 1e3 * statistics.quantiles(times, n=10)[-1],
            "cpu_ms_per_step": 1e3 * statistics.median(b["cpu_per_step"] for b in blocks[k]),
            "lighthouse_cpu_ms_per_step": 1e3 * statistics.median(
                b["lighthouse_cpu_per_step"] for b in blocks[k]),
            "ctx_switches_per_step": statistics.median(
                b["ctx_switches_per_step"] for b in blocks[k]),
            # CPU per step of replica 0's busiest threads (median over
            # the last run's blocks: thread ids differ between runs)
            "thread_cpu_ms_per_step": thread_medians(results[-1][0]["blocks"][k]),
            "phase_median_ms": {p: 1e3 * statistics.median(x for b in blocks[k]
                                                           for x in b["phases"][p])
                                for p in blocks[k][0]["phases"]},
            "all_replicas_median_ms": 1e3 * statistics.median(
                t for res in results for r in res for b in r["blocks"][k] for t in b["times"]),
        }
    ratios: dict[str, dict] = {}
    pairs = [(num, den) for num, den in (("stepguard", "plain"), ("torchft", "plain"),
                                         ("stepguard", "torchft"), ("plain-unused", "plain"),
                                         ("stepguard", "plain-unused"),
                                         ("stepguard-rebuilt-buckets", "plain"),
                                         ("stepguard-rebuilt-buckets", "stepguard"),
                                         ("stepguard-thread-completion", "plain"),
                                         ("stepguard", "stepguard-thread-completion"),
                                         ("stepguard-tcp", "plain"),
                                         ("plain-python-hook", "plain"),
                                         ("stepguard", "plain-python-hook"),
                                         ("stepguard-native-hook", "plain"),
                                         ("stepguard-native-hook", "stepguard"))
             if num in kinds and den in kinds]
    for num, den in pairs:
        wall = [statistics.median(x["times"]) / statistics.median(y["times"])
                for x, y in zip(blocks[num], blocks[den])]
        cpu = [x["cpu_per_step"] / y["cpu_per_step"]
               for x, y in zip(blocks[num], blocks[den]) if y["cpu_per_step"] > 0]
        q = statistics.quantiles(wall, n=4) if len(wall) > 1 else [wall[0]] * 3
        ratios[f"{num}/{den}"] = {
            "pooled": per_kind[num]["median_ms"] / per_kind[den]["median_ms"],
            "blocks": len(wall), "median": statistics.median(wall),
            "q1": q[0], "q3": q[2], "ci95": median_ci(wall),
            "cpu_median": statistics.median(cpu) if cpu else float("nan"),
            "cpu_ci95": median_ci(cpu) if cpu else (float("nan"), float("nan"))}
    return {"kinds": per_kind, "ratios": ratios}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse-pids", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--replicas", default="2,3", help="comma-separated replica counts")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"comma-separated, from {KINDS + REFERENCE_KINDS}")
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs (fresh processes) per replica count")
    ap.add_argument("--blocks", type=int, default=12, help="blocks of each kind per run")
    ap.add_argument("--block", type=int, default=10, help="steps per block")
    ap.add_argument("--separate", action="store_true",
                    help="each kind in processes of its own, one block of --blocks x --block "
                         "steps per run (the earlier method)")
    ap.add_argument("--warmup", type=int, default=15, help="untimed steps of each kind")
    ap.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    ap.add_argument("--pg", choices=sorted(PG_BACKEND), default="gloo",
                    help="the process group of every kind: torch's Gloo, or stepguard's "
                         "ProcessGroupTCP (plain DDP through its c10d backend; torchft not run)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--run-timeout", type=float, default=300.0)
    ap.add_argument("--profile", default="",
                    help="cProfile replica 0's timed steps into PREFIX.<kind>.<replicas> "
                         "(slows the step: for finding costs, not for the figures)")
    ap.add_argument("--output", default=str(ROOT / "bench/results/step.json"))
    a = ap.parse_args()
    if a.worker:
        return worker(a)

    wanted = a.kinds.split(",")
    bad = [k for k in wanted if k not in KINDS + REFERENCE_KINDS]
    if bad:
        ap.error(f"unknown kinds {bad}")
    unavailable = {k: why for k in ("torchft", "stepguard") if k in wanted and (why := has_api(k))}
    if a.pg != "gloo" and "torchft" in wanted:
        unavailable["torchft"] = f"not run over {PG_LABEL[a.pg]}"
    native_dir = None  # kept until the end: the workers import the module from it
    if "stepguard-native-hook" in wanted:
        if a.pg != "gloo":
            unavailable["stepguard-native-hook"] = f"not built for {PG_LABEL[a.pg]}"
        else:
            native_dir = tempfile.TemporaryDirectory(prefix="sg-native-hook-")
            why = build_native_hook(native_dir.name)
            if why:
                unavailable["stepguard-native-hook"] = why
            else:
                os.environ[NATIVE_HOOK_ENV] = native_dir.name
    kinds = [k for k in wanted if k not in unavailable]
    for k, why in unavailable.items():
        print(f"{k}: not measured ({why})")
    counts = [int(x) for x in a.replicas.split(",")]
    runs: dict[int, list[list[dict]]] = {n: [] for n in counts}
    for rnd in range(a.rounds):
        for n in counts:
            if a.separate:
                # rotate the order so no kind always runs first
                order = kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]
                parts = [run_once([k], n, a, 1, a.blocks * a.block) for k in order]
                res = [{"rank": r[0]["rank"],
                        "blocks": {k: b for p in parts for k, b in p[i]["blocks"].items()},
                        "digest": {k: d for p in parts for k, d in p[i]["digest"].items()}}
                       for i, r in enumerate(zip(*parts))]
            else:
                res = run_once(kinds, n, a, a.blocks, a.block)
            runs[n].append(res)
            one = summarize(kinds, [res])
            line = "  ".join(f"{k} {v['median_ms']:.2f} ms cpu {v['cpu_ms_per_step']:.2f} "
                             f"cs {v['ctx_switches_per_step']:.1f}"
                             for k, v in one["kinds"].items())
            print(f"run {rnd + 1}/{a.rounds} replicas {n}: {line}", flush=True)
            # kinds that computed the same steps bit for bit (stepguard's
            # DDP sums then divides as torchft's does; plain DDP divides
            # first): the same parameters, if every step committed in both
            same: dict[str, list[str]] = {}
            for k in kinds:
                same.setdefault(res[0]["digest"][k], []).append(k)
            groups = [" = ".join(g) for g in same.values() if len(g) > 1]
            if groups:
                print(f"  same parameters at the end: {'; '.join(groups)}", flush=True)

    mode = "separate processes per kind" if a.separate else \
        f"kinds interleaved in blocks of {a.block} steps in the same processes"
    print(f"\nMLP 256-{a.width}-{a.width}-10, batch {a.batch}, {PG_LABEL[a.pg]} on loopback; replica 0; "
          f"{a.rounds} runs x {a.blocks} blocks x {a.block} steps per kind; {mode}")
    summary: dict[str, dict] = {}
    for n in counts:
        sm = summarize(kinds, runs[n])
        summary[str(n)] = sm
        print(f"\n{n} replicas   median ms   p90 ms  cpu ms/step  lighthouse cpu  cs/step"
              "   (zero_grad forward backward step quorum_wait, ms)")
        for k, v in sm["kinds"].items():
            ph = " ".join(f"{x:.2f}" for x in v["phase_median_ms"].values())
            print(f"  {k:10s} {v['median_ms']:9.2f} {v['p90_ms']:8.2f} {v['cpu_ms_per_step']:12.2f} "
                  f"{v['lighthouse_cpu_ms_per_step']:15.3f} {v['ctx_switches_per_step']:8.1f}   ({ph})")
        for k, v in sm["kinds"].items():
            print(f"  {k:10s} CPU ms/step by thread: "
                  + ", ".join(f"{n} {x:.2f}" for n, x in v["thread_cpu_ms_per_step"].items()))
        for key, r in sm["ratios"].items():
            print(f"  {key:18s} wall {r['median']:.3f} (paired blocks: IQR {r['q1']:.3f}-"
                  f"{r['q3']:.3f}, 95% CI {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}, "
                  f"n={r['blocks']}; pooled steps {r['pooled']:.3f})  cpu {r['cpu_median']:.3f} "
                  f"(95% CI {r['cpu_ci95'][0]:.3f}-{r['cpu_ci95'][1]:.3f})")
    goal_met = all(s["ratios"].get("stepguard/plain", {}).get("median", float("inf")) <= 1.05
                   for s in summary.values())
    print(f"\ngoal stepguard/plain <= 1.05 (median of paired blocks): "
          f"{'met' if goal_met else 'NOT met'}"
          + (" (stepguard not measured)" if "stepguard" in unavailable else ""))
    out = {
        "benchmark": "step",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "load": os.getloadavg()},
        "config": {"rounds": a.rounds, "blocks": a.blocks, "block": a.block,
                   "separate": a.separate, "warmup": a.warmup,
                   "width": a.width, "batch": a.batch, "replicas": counts, "pg": a.pg},
        "unavailable": unavailable,
        "goal": {"stepguard/plain": 1.05, "met": goal_met if "stepguard" in kinds else None},
        "results": summary,
    }
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    with open(a.output, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
