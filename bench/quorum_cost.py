"""Benchmark: what one replica's in-process quorum costs its training thread.

Group rank 0 of a replica group holds its manager server and calls it
in-process (``ManagerClient(server=...)``): ``_quorum_start`` right after
``start_quorum``, ``_quorum_wait`` at the first gradient bucket.  This
driver runs exactly that, with nothing else: a lighthouse process, and
``--replicas`` replica processes (a group of one each) in lockstep, each
doing per step::

    _quorum_start -> a busy "forward" of --forward-us (GIL held) ->
    _quorum_wait -> should_commit

It prints, per replica, the medians of each call's wall time and thread
CPU time, and per step the CPU time, run-queue wait and context switches
of every thread of the process (from /proc/self/task/*/schedstat and
status), so a cost can be told apart from a wakeup that preempts the
caller.  ``--pin`` puts every replica process on one CPU and ``--load N``
runs N busy processes alongside, as a loaded machine does.

To compare builds in the same run (load on a shared machine moves these
figures by tens of percent from one minute to the next), copy each
build's ``stepguard/_C*.so`` aside and pass each with ``--ext``; with
``--rounds R`` the builds alternate R times (a fresh lighthouse each run)
and the medians over runs are printed side by side with their ratios to
the first build.

Run with ``.venv/bin/python bench/quorum_cost.py`` (about 20 s), or
``--steps N --replicas 2 --load 2``, or
``--rounds 4 --ext /tmp/before.so --ext /tmp/after.so``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta


def start_lighthouse(min_replicas: int, log_path: str) -> tuple[subprocess.Popen, str]:
    code = ("import sys\nfrom stepguard.coordination import lighthouse_main\n"
            "sys.exit(lighthouse_main())\n")
    log = open(log_path, "wb")
    p = subprocess.Popen(
        [sys.executable, "-c", code, "--bind", "127.0.0.1:0", "--min_replicas",
         str(min_replicas), "--join_timeout_ms", "60000"],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "STEPGUARD_LOG": "info"})
    log.close()
    rx = re.compile(r"Lighthouse listening on:? http://\S+:(\d+)")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and p.poll() is None:
        with open(log_path, errors="replace") as f:
            m = rx.search(f.read())
        if m:
            return p, f"http://127.0.0.1:{m.group(1)}"
        time.sleep(0.05)
    p.kill()
    p.wait()
    raise RuntimeError("lighthouse did not start")


def thread_stats() -> dict[int, tuple[str, int, int, int, int]]:
    """tid -> (name, cpu ns, run-queue wait ns, voluntary, involuntary)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        base = f"/proc/self/task/{tid}"
        try:
            with open(f"{base}/schedstat") as f:
                run, wait, _ = (int(x) for x in f.read().split())
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            vol = inv = 0
            with open(f"{base}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol = int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        inv = int(line.split()[1])
        except OSError:
            continue
        out[int(tid)] = (name, run, wait, vol, inv)
    return out


def spin(us: float) -> None:
    end = time.perf_counter_ns() + int(us * 1000)
    while time.perf_counter_ns() < end:
        pass


def load_ext(path: str) -> None:
    """Makes `path` (a built stepguard._C) the extension stepguard uses."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("stepguard._C", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["stepguard._C"] = mod


def replica_main(args: argparse.Namespace) -> int:
    if args.ext:
        load_ext(args.ext[0])
    from stepguard import coordination
    from stepguard.coordination import ManagerClient, ManagerServer

    if args.ext and coordination._C.__file__ != args.ext[0]:
        raise RuntimeError(f"loaded {coordination._C.__file__}, not {args.ext[0]}")

    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    rid = f"r{args.index}"
    srv = ManagerServer(rid, args.lighthouse, "127.0.0.1", "127.0.0.1:0",
                        "127.0.0.1:1", 1, timedelta(seconds=0.1),
                        timedelta(seconds=10))
    cli = ManagerClient(srv.address(), timedelta(seconds=10), server=srv)
    main_tid = threading.get_native_id()
    t_start, t_wait, c_start, c_wait, t_commit = [], [], [], [], []
    before = after = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            before = thread_stats()
        a0, ac0 = time.perf_counter_ns(), time.thread_time_ns()
        cli._quorum_start(0, step, "md", False, True, 0, timedelta(seconds=30))
        a1, ac1 = time.perf_counter_ns(), time.thread_time_ns()
        spin(args.forward_us)
        b0, bc0 = time.perf_counter_ns(), time.thread_time_ns()
        q = cli._quorum_wait()
        b1, bc1 = time.perf_counter_ns(), time.thread_time_ns()
        cli.should_commit(0, step, True, timedelta(seconds=30))
        c1 = time.perf_counter_ns()
        if q.replica_world_size != args.replicas:
            raise RuntimeError(f"quorum of {q.replica_world_size} replicas")
        if step >= args.warmup:
            t_start.append((a1 - a0) / 1e3)
            c_start.append((ac1 - ac0) / 1e3)
            t_wait.append((b1 - b0) / 1e3)
            c_wait.append((bc1 - bc0) / 1e3)
            t_commit.append((c1 - b1) / 1e3)
    after = thread_stats()
    threads = []
    for tid, (name, run, wait, vol, inv) in after.items():
        if tid not in before:
            continue
        _, run0, wait0, vol0, inv0 = before[tid]
        threads.append({
            "tid": tid, "name": "main" if tid == main_tid else name,
            "cpu_us": (run - run0) / 1e3 / args.steps,
            "runq_us": (wait - wait0) / 1e3 / args.steps,
            "vol": (vol - vol0) / args.steps, "inv": (inv - inv0) / args.steps})
    cli.close()
    srv.shutdown()
    med = statistics.median
    print(json.dumps({
        "replica": args.index,
        "start_us": med(t_start), "start_cpu_us": med(c_start),
        "wait_us": med(t_wait), "wait_cpu_us": med(c_wait),
        "commit_us": med(t_commit),
        "start_p90_us": sorted(t_start)[int(0.9 * len(t_start))],
        "wait_p90_us": sorted(t_wait)[int(0.9 * len(t_wait))],
        "threads": threads}), flush=True)
    return 0


def run_once(args: argparse.Namespace, ext: str | None) -> list[dict]:
    """One run: a fresh lighthouse and the replicas; their results."""
    lh, addr = start_lighthouse(args.replicas,
                                f"/tmp/quorum_cost_lh.{os.getpid()}.log")
    procs = []
    out = []
    try:
        for i in range(args.replicas):
            cmd = [sys.executable, __file__, "--replica", "--index", str(i),
                   "--lighthouse", addr, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--replicas",
                   str(args.replicas), "--forward-us", str(args.forward_us)]
            if args.pin is not None:
                cmd += ["--pin", str(args.pin)]
            if ext:
                cmd += ["--ext", ext]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE))
        deadline = time.monotonic() + args.timeout
        for p in procs:
            o, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode:
                raise RuntimeError(f"replica exited with {p.returncode}")
            out.append(json.loads(o.decode().strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lh.kill()
        lh.wait()
    return out


def summary(r: dict) -> dict[str, float]:
    """The figures compared between builds, from one replica's result."""
    mgr = [t for t in r["threads"] if t["name"] != "main"]
    main = [t for t in r["threads"] if t["name"] == "main"][0]
    return {
        "start_us": r["start_us"], "start_cpu_us": r["start_cpu_us"],
        "wait_us": r["wait_us"], "wait_cpu_us": r["wait_cpu_us"],
        "commit_us": r["commit_us"],
        "mgr_cpu_us": sum(t["cpu_us"] for t in mgr),
        "mgr_switches": sum(t["vol"] + t["inv"] for t in mgr),
        "main_invol": main["inv"],
    }


def print_result(r: dict) -> None:
    print(f"replica {r['replica']}: _quorum_start {r['start_us']:.1f} us "
          f"(cpu {r['start_cpu_us']:.1f}, p90 {r['start_p90_us']:.1f}), "
          f"_quorum_wait {r['wait_us']:.1f} us (cpu "
          f"{r['wait_cpu_us']:.1f}, p90 {r['wait_p90_us']:.1f}), "
          f"should_commit {r['commit_us']:.1f} us")
    for t in sorted(r["threads"], key=lambda t: -t["cpu_us"]):
        if t["cpu_us"] < 0.5 and t["vol"] + t["inv"] < 0.01:
            continue
        print(f"    {t['name']:<16} {t['tid']:>7}: cpu {t['cpu_us']:8.1f} "
              f"us/step, runq {t['runq_us']:7.1f} us/step, switches "
              f"{t['vol']:.2f} vol + {t['inv']:.2f} invol per step")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--forward-us", type=float, default=2000.0)
    ap.add_argument("--pin", type=int, default=None,
                    help="run every replica process on this CPU")
    ap.add_argument("--load", type=int, default=0,
                    help="busy processes to run alongside (a loaded machine)")
    ap.add_argument("--ext", action="append", default=[],
                    help="a stepguard._C build to load instead of the tree's; "
                         "repeat to compare builds in turn in the same run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs per build (builds alternate)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--replica", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.replica:
        return replica_main(args)
    exts = args.ext or [None]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.load)]
    runs: dict[int, list[dict[str, float]]] = {i: [] for i in range(len(exts))}
    try:
        for rnd in range(args.rounds):
            order = list(range(len(exts)))
            if rnd % 2:
                order.reverse()
            for i in order:
                res = run_once(args, exts[i])
                if len(exts) == 1 and args.rounds == 1:
                    for r in res:
                        print_result(r)
                runs[i] += [summary(r) for r in res]
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    if len(exts) > 1 or args.rounds > 1:
        med = statistics.median
        keys = list(runs[0][0])
        print(f"medians over {args.rounds} runs x {args.replicas} replicas "
              f"of {args.steps} steps (per step):")
        print(f"{'build':<40} " + " ".join(f"{k:>12}" for k in keys))
        base = None
        for i, ext in enumerate(exts):
            m = {k: med(x[k] for x in runs[i]) for k in keys}
            print(f"{str(ext)[-40:]:<40} " +
                  " ".join(f"{m[k]:12.1f}" for k in keys))
            if base is None:
                base = m
            else:
                print(f"{'  ratio to the first':<40} " + " ".join(
                    f"{m[k] / base[k] if base[k] else float('nan'):12.2f}"
                    for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
