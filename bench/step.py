"""Benchmark: steady-state training step time with stepguard's
DistributedDataParallel against plain torch DistributedDataParallel over a
Gloo process group, and against torchft's DDP, in the same run.

Every replica is one process (one rank per replica group) training the same
small MLP on CPU.  A step is ``zero_grad`` (for the fault-tolerant kinds:
the quorum), forward, backward (the gradient allreduce) and
``optimizer.step`` (the commit vote), timed by each process after a warm-up;
each process also counts its threads' context switches per step (a wakeup
or a preemption each: on a shared 2-core machine they cost more than the
work they do).
The kinds run in turn, for 2 and 3 replicas, for several rounds, so they see
the same machine; each kind's figure is the median over rounds of the
median step time of replica 0.  Ratios are against plain DDP (the goal for
stepguard is at most 1.05x) and stepguard against torchft.  Results go to
``bench/results/step.json``.

Run with ``.venv/bin/python bench/step.py`` (a few minutes on 2 cores), or
``--replicas 2 --rounds 1 --steps 40`` for a quick look.
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
LISTEN_RE = re.compile(r"Lighthouse listening on:? http://\S+:(\d+)")
# what the stepguard kind needs from the package
API = ("Manager", "DistributedDataParallel", "Optimizer", "ProcessGroupGloo")


# ---- worker: one replica ---------------------------------------------


def wait_file(path: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


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


def make_model(torch, width: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 10))


def worker(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    model = make_model(torch, a.width)
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    manager = None
    waited = [0.0]  # this step's time in manager.wait_quorum
    if a.kind == "plain":
        port_file = os.path.join(a.dir, "plain.port")
        if a.rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, a.world, is_master=True,
                                  wait_for_workers=False)
            tmp = port_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(store.port))
            os.rename(tmp, port_file)
        else:
            store = dist.TCPStore("127.0.0.1", int(wait_file(port_file, 60)), a.world,
                                  is_master=False)
        dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world,
                                timeout=timedelta(seconds=60))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = inner
    else:
        ft = importlib.import_module(a.kind)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        manager = ft.Manager(
            pg=ft.ProcessGroupGloo(timeout=timedelta(seconds=60)),
            load_state_dict=lambda sd: (model.load_state_dict(sd["m"]),
                                        inner.load_state_dict(sd["o"])),
            state_dict=lambda: {"m": model.state_dict(), "o": inner.state_dict()},
            min_replica_size=1, rank=0, world_size=1,
            store_addr="127.0.0.1", store_port=store.port,
            lighthouse_addr=a.lighthouse, replica_id=f"bench_{a.rank}", port=0,
            hostname="127.0.0.1", timeout=timedelta(seconds=60),
            quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=60))
        ddp = ft.DistributedDataParallel(manager, model)
        opt = ft.Optimizer(manager, inner)
        # time spent waiting for the quorum (inside backward, at the first
        # bucket): how much of the lighthouse round trip the forward pass
        # did not hide
        real_wait = manager.wait_quorum

        def timed_wait() -> None:
            t = time.perf_counter()
            try:
                real_wait()
            finally:
                waited[0] += time.perf_counter() - t

        manager.wait_quorum = timed_wait
    gen = torch.Generator().manual_seed(a.rank)
    data = [(torch.randn(a.batch, 256, generator=gen), torch.randint(0, 10, (a.batch,), generator=gen))
            for _ in range(8)]
    times = []
    phases: dict[str, list[float]] = {"zero_grad": [], "forward": [], "backward": [], "step": [],
                                      "quorum_wait": []}
    committed = 0
    cs0 = 0
    for i in range(a.warmup + a.steps):
        x, y = data[i % len(data)]
        if i == a.warmup:
            cs0 = ctx_switches()
        waited[0] = 0.0
        t0 = time.perf_counter()
        opt.zero_grad()
        ta = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        tb = time.perf_counter()
        loss.backward()
        tc = time.perf_counter()
        before = manager.current_step() if manager else 0
        opt.step()
        t1 = time.perf_counter()
        if manager is not None and manager.current_step() == before + 1:
            committed += 1
        if i >= a.warmup:
            times.append(t1 - t0)
            for k, v in (("zero_grad", ta - t0), ("forward", tb - ta),
                         ("backward", tc - tb), ("step", t1 - tc),
                         ("quorum_wait", waited[0])):
                phases[k].append(v)
    cs_per_step = (ctx_switches() - cs0) / max(1, a.steps)
    result = {"kind": a.kind, "rank": a.rank, "world": a.world, "times": times,
              "phases": phases, "ctx_switches_per_step": cs_per_step,
              "committed": committed if manager else len(times) + a.warmup,
              "participants": manager.num_participants() if manager else a.world}
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.rename(tmp, a.out)
    sys.stdout.flush()
    if manager is not None:
        manager.shutdown(wait=False)
    else:
        dist.destroy_process_group()
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


def run_once(kind: str, n: int, a: argparse.Namespace) -> dict:
    """Runs n replicas of `kind`; returns replica 0's result (all checked)."""
    with tempfile.TemporaryDirectory(prefix="sg-step-") as d:
        lh = None
        addr = ""
        if kind != "plain":
            lh, addr = start_lighthouse(kind, n)
        procs = []
        env = dict(os.environ, OMP_NUM_THREADS="1")
        try:
            for r in range(n):
                cmd = [sys.executable, __file__, "--worker", "--kind", kind, "--rank", str(r),
                       "--world", str(n), "--dir", d, "--lighthouse", addr,
                       "--out", os.path.join(d, f"r{r}.json"), "--steps", str(a.steps),
                       "--warmup", str(a.warmup), "--width", str(a.width),
                       "--batch", str(a.batch)]
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
                    raise RuntimeError(f"{kind} replica {r} failed (rc {p.returncode}):\n{log}")
                with open(out) as f:
                    results.append(json.load(f))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            if lh is not None:
                lh.kill()
                lh.wait()
    total = a.steps + a.warmup
    for res in results:
        # a benchmark of steps that did not commit, or without every replica, means nothing
        if res["committed"] < total - 1 or res["participants"] != n:
            raise RuntimeError(f"{kind} with {n} replicas: only {res['committed']}/{total} "
                               f"steps committed, {res['participants']} participants")
    return {"median_ms": 1e3 * statistics.median(results[0]["times"]),
            # where replica 0's step goes: zero_grad (the quorum starts),
            # forward, backward (the allreduce, after the quorum), step (the vote)
            "phase_median_ms": {k: 1e3 * statistics.median(v)
                                for k, v in results[0]["phases"].items()},
            "p90_ms": 1e3 * statistics.quantiles(results[0]["times"], n=10)[-1],
            # every thread of replica 0's process, per timed step
            "ctx_switches_per_step": results[0]["ctx_switches_per_step"],
            "all_replicas_median_ms": 1e3 * statistics.median(
                t for res in results for t in res["times"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", choices=KINDS)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--dir", default="")
    ap.add_argument("--lighthouse", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--replicas", default="2,3", help="comma-separated replica counts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--run-timeout", type=float, default=180.0)
    ap.add_argument("--output", default=str(ROOT / "bench/results/step.json"))
    a = ap.parse_args()
    if a.worker:
        return worker(a)

    unavailable = {k: why for k in ("torchft", "stepguard") if (why := has_api(k))}
    kinds = [k for k in KINDS if k not in unavailable]
    for k, why in unavailable.items():
        print(f"{k}: not measured ({why})")
    counts = [int(x) for x in a.replicas.split(",")]
    runs: dict[int, dict[str, list[dict]]] = {n: {k: [] for k in kinds} for n in counts}
    for rnd in range(a.rounds):
        for n in counts:
            # rotate the order so no kind always runs first
            order = kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]
            for k in order:
                r = run_once(k, n, a)
                runs[n][k].append(r)
                ph = " ".join(f"{p} {v:.2f}" for p, v in r["phase_median_ms"].items())
                print(f"round {rnd + 1}/{a.rounds} replicas {n} {k:9s} "
                      f"median {r['median_ms']:7.2f} ms  p90 {r['p90_ms']:7.2f} ms  "
                      f"cs/step {r['ctx_switches_per_step']:5.1f}  ({ph})", flush=True)

    summary: dict[str, dict] = {}
    print(f"\nmedian step time over {a.rounds} rounds (ms), MLP 256-{a.width}-{a.width}-10, "
          f"batch {a.batch}, Gloo on loopback")
    print(f"{'replicas':>8} " + " ".join(f"{k:>10}" for k in kinds)
          + "  stepguard/plain  torchft/plain  stepguard/torchft")
    for n in counts:
        med = {k: statistics.median(r["median_ms"] for r in runs[n][k]) for k in kinds}
        phase_med = {k: {p: statistics.median(r["phase_median_ms"][p] for r in runs[n][k])
                         for p in runs[n][k][0]["phase_median_ms"]} for k in kinds}
        ratios = {}
        for num, den in (("stepguard", "plain"), ("torchft", "plain"), ("stepguard", "torchft")):
            if num in med and den in med:
                ratios[f"{num}/{den}"] = med[num] / med[den]
        summary[str(n)] = {"median_ms": med, "phase_median_ms": phase_med, "ratios": ratios,
                           "runs": runs[n]}
        print(f"{n:>8} " + " ".join(f"{med[k]:10.2f}" for k in kinds) + "  "
              + "  ".join(f"{ratios.get(key, float('nan')):>15.3f}"
                          for key in ("stepguard/plain", "torchft/plain", "stepguard/torchft")))
    goal_met = all(s["ratios"].get("stepguard/plain", float("inf")) <= 1.05
                   for s in summary.values())
    print(f"goal stepguard/plain <= 1.05: {'met' if goal_met else 'NOT met'}"
          + (" (stepguard not measured)" if "stepguard" in unavailable else ""))
    out = {
        "benchmark": "step",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "config": {"rounds": a.rounds, "steps": a.steps, "warmup": a.warmup,
                   "width": a.width, "batch": a.batch, "replicas": counts},
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
