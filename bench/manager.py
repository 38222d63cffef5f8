"""Benchmark: one step's coordination through stepguard's manager against
torchft's, in the same run.

For each shape (group ranks per replica group x replica groups), every
group rank of every replica group runs on a thread of this process; a step
is: all ranks start together (a barrier), each calls ``_quorum`` and then
``should_commit`` on its group's manager, and the step time is from the
start to the last rank's vote returning.  Both managers sit under the same
lighthouse (stepguard's, in a child process), so the figure is what the
manager adds.  Both bindings release the GIL while waiting.  Prints medians
and p90s with the ratio ours/torchft; the data goes to
``bench/results/manager.json``.

Run with ``.venv/bin/python bench/manager.py`` (about a minute), or
``--steps N --ranks 1,8,32 --groups 2,4,8``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_torchft():
    """torchft._torchft without importing torch."""
    spec = importlib.util.find_spec("torchft")
    pkg = list(spec.submodule_search_locations)[0]
    so = [f for f in os.listdir(pkg) if f.startswith("_torchft") and f.endswith(".so")]
    spec2 = importlib.util.spec_from_file_location("torchft._torchft",
                                                   os.path.join(pkg, so[0]))
    mod = importlib.util.module_from_spec(spec2)
    spec2.loader.exec_module(mod)
    sys.modules["torchft._torchft"] = mod
    return mod


def start_lighthouse(min_replicas: int) -> tuple[subprocess.Popen, str]:
    code = ("import sys\nfrom stepguard.coordination import lighthouse_main\n"
            "sys.exit(lighthouse_main())\n")
    p = subprocess.Popen(
        [sys.executable, "-c", code, "--bind", "127.0.0.1:0", "--min_replicas",
         str(min_replicas), "--join_timeout_ms", "60000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "STEPGUARD_LOG": "info"})
    rx = re.compile(r"Lighthouse listening on:? http://\S+:(\d+)")
    deadline = time.monotonic() + 30
    assert p.stdout is not None
    while time.monotonic() < deadline:
        line = p.stdout.readline().decode()
        m = rx.search(line)
        if m:
            threading.Thread(target=p.stdout.read, daemon=True).start()
            return p, f"http://127.0.0.1:{m.group(1)}"
    p.kill()
    raise RuntimeError("lighthouse did not start")


def run_shape(mod, lh_addr: str, ranks: int, groups: int, steps: int,
              tag: str) -> list[float]:
    servers = [mod.ManagerServer(f"{tag}{g}", lh_addr, "127.0.0.1", "127.0.0.1:0",
                                 f"store{g}:1", ranks, timedelta(milliseconds=100),
                                 timedelta(seconds=10), 0)
               for g in range(groups)]
    clients = [[mod.ManagerClient(s.address(), timedelta(seconds=10))
                for _ in range(ranks)] for s in servers]
    n = ranks * groups
    start = threading.Barrier(n + 1)
    done = threading.Barrier(n + 1)
    errors: list[BaseException] = []
    stop = False

    def rank_main(g: int, r: int) -> None:
        c = clients[g][r]
        step = 0
        while True:
            start.wait()
            if stop:
                return
            try:
                q = c._quorum(group_rank=r, step=step, checkpoint_metadata="",
                              shrink_only=False, init_sync=False,
                              commit_failures=0, timeout=timedelta(seconds=60),
                              reconfigure_handle="")
                c.should_commit(r, step, True, timedelta(seconds=60))
                step = q.max_step + 1
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
            done.wait()

    ts = [threading.Thread(target=rank_main, args=(g, r), daemon=True)
          for g in range(groups) for r in range(ranks)]
    for t in ts:
        t.start()
    times = []
    try:
        for i in range(steps + 3):  # three warm-up steps
            t0 = time.perf_counter()
            start.wait()
            done.wait()
            if errors:
                raise errors[0]
            if i >= 3:
                times.append(time.perf_counter() - t0)
    finally:
        stop = True
        start.wait()
        for t in ts:
            t.join(10)
        for s in servers:
            s.shutdown()
    return times


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ranks", default="1,8,32")
    ap.add_argument("--groups", default="2,4,8")
    ap.add_argument("--out", default=str(ROOT / "bench/results/manager.json"))
    a = ap.parse_args()
    # Both managers run in this process: keep their per-call info logs off
    # the measured path (torchft logs every vote at info).
    os.environ.setdefault("RUST_LOG", "warn")
    os.environ.setdefault("STEPGUARD_LOG", "warn")
    tf = load_torchft()
    from stepguard import coordination as sg

    rows = []
    print(f"{'ranks':>5} {'groups':>6} | {'ours med':>9} {'p90':>8} | "
          f"{'torchft med':>11} {'p90':>8} | {'ours/torchft':>12}")
    for ranks in [int(x) for x in a.ranks.split(",")]:
        for groups in [int(x) for x in a.groups.split(",")]:
            res = {}
            for name, mod in (("stepguard", sg), ("torchft", tf)):
                lh, addr = start_lighthouse(groups)
                try:
                    res[name] = run_shape(mod, addr, ranks, groups, a.steps,
                                          f"{name[:2]}{ranks}x{groups}-")
                finally:
                    lh.kill()
                    lh.wait()
            o, t = res["stepguard"], res["torchft"]
            row = {"ranks": ranks, "groups": groups,
                   "ours_median_ms": statistics.median(o) * 1e3,
                   "ours_p90_ms": pct(o, 0.9) * 1e3,
                   "torchft_median_ms": statistics.median(t) * 1e3,
                   "torchft_p90_ms": pct(t, 0.9) * 1e3}
            row["ratio"] = row["ours_median_ms"] / row["torchft_median_ms"]
            rows.append(row)
            print(f"{ranks:>5} {groups:>6} | {row['ours_median_ms']:>7.2f}ms "
                  f"{row['ours_p90_ms']:>6.2f}ms | {row['torchft_median_ms']:>9.2f}ms "
                  f"{row['torchft_p90_ms']:>6.2f}ms | {row['ratio']:>11.2f}x",
                  flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"steps": a.steps, "rows": rows}, indent=1))
    print(f"ratio < 1 means stepguard is faster; data in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
