"""Kill -> back at full strength: warm spares, hot spares, plain restarts, torchft.

Every configuration runs ``examples/train_llama.py`` (the small Llama, same
model, data and seed) under ``stepguard.launch`` with the same kill schedule
(``kill:every=K,start=W,seed=S``: the first kill once every trainer
and spare is set up) and lighthouse flags (``--min_replicas 1
--quorum_tick_ms 100 --join_timeout_ms 10000``), one after the other in the
same run.  The metric: from the SIGKILL of one replica group to the moment
the job trains at full strength again:

- without spares (``torchft``, ``stepguard``) and with warm spares
  (``stepguard-warm``, ``--spares 1``): the replacement's first committed
  step (the launcher's ``full_strength`` recovery: a relaunch imports
  torch, builds the model, joins and heals; a warm spare only joins and
  heals);
- with hot spares (``stepguard-hot``, ``torchft-hot``:
  ``WorldSizeMode.FIXED_WITH_SPARES``, one replica group more than the
  participants, ``--min-replicas G``): the first commit by a survivor of a
  quorum formed after the kill with ``G`` participants (the hot spare steps
  in; it already holds the weights).

Also: SIGKILL -> the survivors' next commit, and for warm spares the
takeover -> first commit part and the spare's setup time.  Warm and hot
spares run one process more than the others (the spare), the same for
both.  Results go to ``bench/results/spares.md``.

Run with ``.venv/bin/python bench/spares.py`` (about 13 minutes), or
``--duration 60 --configs torchft,stepguard-warm``; after ``--``, arguments
for ``train_llama.py`` (a smaller model: ``-- --dim 64 --layers 2``).  A
refilled warm spare must finish its setup before the next kill to be of
use: the table counts the takeovers that found it still setting up.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from e2e import CONFIGS as E2E, fmt, hot_full, med, ratio  # noqa: E402
from e2e import run_config as e2e_run  # noqa: E402

# the configurations compared here (their table: bench/e2e.py's CONFIGS)
CONFIGS = {n: E2E[n] for n in ("torchft", "stepguard", "stepguard-warm", "stepguard-hot",
                               "torchft-hot")}


def run_config(name: str, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    return e2e_run(name, args, out, every=args.kill_every, duration=args.duration,
                   tag=name, pg=args.pg, who="spares")


def measure(name: str, tl: list[dict[str, Any]], groups: int) -> dict[str, Any]:
    rec = [r for r in tl if r["event"] == "recovery"]
    surv: dict[int, float] = {}
    for r in rec:
        if r["kind"] == "survivors":
            surv.setdefault(r["failure"], r["duration_s"])
    if CONFIGS[name][3]:
        full = hot_full(tl, groups)
    else:
        full = sorted(r["duration_s"] for r in rec if r["kind"] == "full_strength")
    takeovers = [r for r in tl if r["event"] == "takeover"]
    waiting = {r["spare"] for r in takeovers if r.get("ready")}
    warm_full = sorted(r["duration_s"] for r in rec if r["kind"] == "full_strength"
                       and r.get("spare") in waiting)
    rejoin = [r for r in rec if r["kind"] == "rejoin"]
    return {
        "kills": sum(1 for r in tl if r["event"] == "inject"),
        "full": full,
        "full_waiting": warm_full,
        "survivors": sorted(surv.values()),
        "join": sorted(r["join_s"] for r in rejoin if "join_s" in r),
        "takeovers": len(takeovers),
        "cold": sum(1 for r in takeovers if not r.get("ready")),
        "setup": sorted(r["setup_s"] for r in tl if r["event"] == "spare_ready"),
    }


def table(res: dict[str, dict[str, Any]]) -> str:
    cols = list(res)
    base = "torchft" if "torchft" in res else None
    head = "| metric | " + " | ".join(cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]

    def row(label: str, key: str, fn) -> None:
        lines.append(f"| {label} | " + " | ".join(
            fmt(fn(res[c][key])) if res[c][key] else "n/a" for c in cols) + " |")

    row("kill -> full strength, median", "full", med)
    row("kill -> full strength, min", "full", min)
    row("kill -> full strength, max", "full", max)
    row("the same, kills that found a spare waiting: median", "full_waiting", med)
    row("the same, kills that found a spare waiting: max", "full_waiting", max)
    row("kill -> survivors' next commit, median", "survivors", med)
    row("(re)start or takeover -> first commit, median", "join", med)
    row("warm spare setup (start -> waiting), median", "setup", med)
    lines.append("| kills / measured / takeovers (not ready) | " + " | ".join(
        f"{res[c]['kills']} / {len(res[c]['full'])} / {res[c]['takeovers']} "
        f"({res[c]['cold']})" for c in cols) + " |")
    if base:
        lines.append("| torchft / this, full strength median | " + " | ".join(
            ratio(med(res[base]["full"]), med(res[c]["full"])) for c in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=3,
                   help="participating replica groups (hot spares add one)")
    p.add_argument("--duration", type=float, default=150.0, help="seconds per config")
    p.add_argument("--kill-every", type=float, default=20.0)
    p.add_argument("--first-kill", type=float, default=30.0,
                   help="seconds before the first kill (every group and spare set up)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--omp-threads", type=int, default=1)
    p.add_argument("--pg", choices=("tcp", "gloo"), default="tcp",
                   help="stepguard's process group (torchft always uses Gloo)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default=str(ROOT / "build" / "bench-spares"))
    p.add_argument("--results", default=str(ROOT / "bench" / "results" / "spares.md"))
    p.add_argument("train_args", nargs="*", help="extra train_llama.py arguments (after --)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        p.error(f"unknown configs {bad} (from {', '.join(CONFIGS)})")
    load0 = os.getloadavg()
    res = {}
    for c in configs:
        res[c] = measure(c, run_config(c, args, out), args.groups)
        m = res[c]
        print(f"spares: {c}: kills {m['kills']}, full strength {[round(x, 2) for x in m['full']]}"
              f", median {fmt(med(m['full']))}", flush=True)
    tbl = table(res)
    header = (
        f"# Kill -> full strength: warm spares, hot spares, restarts, torchft\n\n"
        f"`bench/spares.py`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{platform.machine()} with {os.cpu_count()} CPUs (shared), Python "
        f"{platform.python_version()}.  The small Llama"
        f"{' (' + ' '.join(args.train_args) + ')' if args.train_args else ''}, "
        f"{args.groups} participating "
        f"replica groups x 1 rank, OMP_NUM_THREADS={args.omp_threads}, "
        f"{args.duration:.0f} s per configuration, `kill:every={args.kill_every:g}s,"
        f"start={args.first_kill:g}s,seed={args.seed}`, lighthouse `--quorum_tick_ms 100 "
        f"--join_timeout_ms 10000`; "
        f"stepguard's process group: {args.pg}, torchft's: Gloo.  Warm: one warm spare "
        f"(`--spares 1`); hot: one group more, `FIXED_WITH_SPARES` with "
        f"`--min-replicas {args.groups}`.  Full strength: the replacement's first "
        f"committed step (hot: the first commit of a new quorum of {args.groups} "
        f"participants).  Load average at the start and end of the run (other jobs "
        f"share the machine): {load0[0]:.1f}, {os.getloadavg()[0]:.1f}.\n\n")
    print()
    print(tbl)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(header + tbl + "\n")
    print(f"\nwrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
