"""Demonstration: three replica groups train a small Llama while one is
killed every ~20 s and relaunched.

It runs for about three minutes on CPU, printing a progress line every few
seconds, then writes ``demo-out/``:

``chart.png``      loss against step with the failures marked, and the
                   number of participating replicas over time;
``summary.txt``    failures, recoveries, committed and discarded steps,
                   kill -> survivors' next commit, relaunch -> first
                   commit, goodput, and whether all replicas ended with
                   bit-identical parameters (``summary.json`` too);
``timeline.jsonl`` every launch, exit, injection, quorum change, commit
                   and recovery (see stepguard.launch);
``logs/``          each rank's output, per incarnation.

The last stretch is quiet (no kills), then the launcher asks every replica
to stop at the same step and the final parameters are compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from stepguard.launch import LaunchConfig, Launcher, parse_failure_spec  # noqa: E402
from stepguard.soak import goodput  # noqa: E402

TRAINER_API = ("Manager", "DistributedDataParallel", "Optimizer", "ProcessGroupGloo")


def pick_impl(requested: str) -> str:
    """'auto' is stepguard when its training API is importable, else torchft."""
    if requested != "auto":
        return requested
    try:
        import stepguard

        if all(hasattr(stepguard, n) for n in TRAINER_API):
            return "stepguard"
        missing = [n for n in TRAINER_API if not hasattr(stepguard, n)]
        print(f"demo: stepguard does not export {', '.join(missing)} yet; "
              "training with torchft's API from torchft-nightly instead", flush=True)
    except ImportError as e:
        print(f"demo: cannot import stepguard ({e}); using torchft", flush=True)
    return "torchft"


class Progress:
    """Follows the timeline and prints a line every few seconds."""

    def __init__(self, groups: int, every: float) -> None:
        self.groups = groups
        self.every = every
        self.last_print = 0.0
        self.max_step = -1
        self.loss: dict[int, float] = {}
        self.participants = 0
        self.failures = 0
        self.rejoins = 0
        self.commits = 0
        self.discards = 0
        self.running: set[int] = set()
        self.gave_up: dict[str, Any] | None = None

    def on_event(self, rec: dict[str, Any]) -> None:
        ev = rec["event"]
        if ev in ("commit", "discard") and rec.get("rank") == 0:
            if ev == "commit":
                self.commits += 1
                self.max_step = max(self.max_step, rec["step"])
                self.loss[rec["group"]] = rec["loss"]
                self.participants = rec.get("participants") or self.participants
            else:
                self.discards += 1
        elif ev == "inject":
            self.failures += 1
            self.running.discard(rec["group"])
            print(f"[{rec['elapsed']:6.1f}s] >>> killed replica group {rec['group']} "
                  f"(pid {rec['pid']})", flush=True)
        elif ev == "give_up":
            self.gave_up = rec
            print(f"[{rec['elapsed']:6.1f}s] !!! replica group {rec['group']} keeps failing "
                  f"on its own ({rec['reason']}); stopping the demo", flush=True)
            if rec.get("tail"):
                print(f"--- end of {rec['log']} ---\n{rec['tail'].rstrip()}\n---", flush=True)
        elif ev in ("launch", "restart"):
            self.running.add(rec["group"])
        elif ev == "recovery" and rec["kind"] in ("survivors", "rejoin"):
            # (full_strength, the same first commit timed from the kill, is
            # in the timeline and the summary's goodput, not printed twice)
            if rec["kind"] == "rejoin":
                self.rejoins += 1
            who = "survivors committed" if rec["kind"] == "survivors" else \
                f"group {rec['group']} rejoined and committed"
            print(f"[{rec['elapsed']:6.1f}s] <<< {who} step {rec['step']} "
                  f"{rec['duration_s']:.2f}s after the "
                  f"{'kill' if rec['kind'] == 'survivors' else 'relaunch'}", flush=True)

    def tick(self, elapsed: float) -> None:
        if elapsed - self.last_print < self.every:
            return
        self.last_print = elapsed
        if self.max_step < 0:
            print(f"[{elapsed:6.1f}s] starting: {len(self.running)} replica groups "
                  "launched, waiting for the first committed step", flush=True)
            return
        loss = statistics.mean(self.loss.values()) if self.loss else float("nan")
        print(f"[{elapsed:6.1f}s] step {max(self.max_step, 0):4d}  loss {loss:6.3f}  "
              f"replicas in quorum {self.participants}/{self.groups}  "
              f"kills {self.failures}  rejoins {self.rejoins}  "
              f"commits {self.commits}  discards {self.discards}", flush=True)


def compare_params(out: Path, groups: int, ranks: int = 1) -> tuple[bool, str]:
    """Compares every replica's final (full) parameters bit for bit with
    group 0's, rank by rank."""
    for r in range(1, ranks):
        ok, why = _compare_rank(out, groups, r)
        if not ok:
            return ok, f"rank {r}: {why}"
    return _compare_rank(out, groups, 0)


def _compare_rank(out: Path, groups: int, rank: int) -> tuple[bool, str]:
    import torch

    loaded = {}
    for g in range(groups):
        f = out / f"params_g{g}_r{rank}.pt"
        if not f.exists():
            return False, f"group {g} wrote no final parameters"
        loaded[g] = torch.load(f, map_location="cpu")
    ref = loaded[0]
    for g in range(1, groups):
        other = loaded[g]
        if other["step"] != ref["step"]:
            return False, f"group {g} ended at step {other['step']}, group 0 at {ref['step']}"
        for name, a in ref["params"].items():
            b = other["params"].get(name)
            if b is None or b.shape != a.shape or b.dtype != a.dtype:
                return False, f"group {g}: {name} missing or of another shape/dtype"
            ai = a.contiguous().view(-1).view(torch.uint8)
            bi = b.contiguous().view(-1).view(torch.uint8)
            if not torch.equal(ai, bi):
                diff = (a.reshape(-1) != b.reshape(-1)).nonzero()
                i = int(diff[0]) if diff.numel() else 0
                return False, (f"group {g} differs from group 0 in {name} at flat index "
                               f"{i}: {a.reshape(-1)[i].item()!r} vs "
                               f"{b.reshape(-1)[i].item()!r}")
    return True, f"{groups} replicas at step {ref['step']}, {len(ref['params'])} tensors"


def demo_goodput(tl: list[dict[str, Any]], groups: int,
                 every: float) -> tuple[float | None, float | None]:
    """(goodput, fault-free rate) by ``stepguard.soak.goodput``: replica-steps
    committed from the first kill to as many kill intervals later as there
    were kills, against the rate of the full-quorum steps while no replica
    was setting up: in that window, or where a relaunch was setting up at
    every kill (a loaded machine), in the whole run (its quiet end)."""
    win = goodput.kill_window(tl, every)
    if win is None:
        return None, None
    rate = goodput.window_rate(tl, groups, *win)
    if rate is None:
        return None, None
    n = goodput.committed_replica_steps(tl, *win)
    return goodput.goodput(n, groups, rate, win[1] - win[0]), rate


def summarize(tl: list[dict[str, Any]], groups: int, identical: tuple[bool, str],
              impl: str, lighthouse: str, every: float = 20.0) -> dict[str, Any]:
    kills = [r for r in tl if r["event"] == "inject"]
    surv = {}
    for r in tl:
        if r["event"] == "recovery" and r["kind"] == "survivors":
            surv.setdefault(r["failure"], r["duration_s"])
    rejoins = [r for r in tl if r["event"] == "recovery" and r["kind"] == "rejoin"]
    rejoin = [r["duration_s"] for r in rejoins]
    join = [r["join_s"] for r in rejoins if "join_s" in r]
    commits = [r for r in tl if r["event"] == "commit" and r.get("rank") == 0]
    discards = [r for r in tl if r["event"] == "discard" and r.get("rank") == 0]
    steps = {r["step"] for r in commits}
    s = list(surv.values())
    gp, rate = demo_goodput(tl, groups, every)
    return {
        "impl": impl,
        "lighthouse": lighthouse,
        "groups": groups,
        "failures_injected": len(kills),
        "restarts": sum(1 for r in tl if r["event"] == "restart"),
        "recoveries_survivors": len(s),
        "recoveries_rejoined": len(rejoin),
        "committed_steps": len(steps),
        "replica_commits": len(commits),
        "replica_discards": len(discards),
        "kill_to_survivor_commit_median_s": statistics.median(s) if s else None,
        "kill_to_survivor_commit_max_s": max(s) if s else None,
        "relaunch_to_first_commit_median_s": statistics.median(rejoin) if rejoin else None,
        "ready_to_first_commit_median_s": statistics.median(join) if join else None,
        "final_step": max(steps) + 1 if steps else 0,
        "goodput": gp,
        "fault_free_rate": rate,
        "kill_every_s": every,
        "replicas_identical": identical[0],
        "replicas_detail": identical[1],
    }


def summary_text(s: dict[str, Any]) -> str:
    def secs(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f} s"

    lines = [
        f"implementation: {s['impl']} (lighthouse: {s['lighthouse']}), {s['groups']} replica groups",
        f"failures injected: {s['failures_injected']} (SIGKILL), restarts: {s['restarts']}",
        f"recoveries: {s['recoveries_survivors']} survivor recoveries, "
        f"{s['recoveries_rejoined']} relaunched replicas rejoined",
        f"committed steps: {s['committed_steps']} (final step {s['final_step']}); "
        f"per replica: {s['replica_commits']} commits, {s['replica_discards']} discarded",
        f"kill -> survivors' next committed step: median "
        f"{secs(s['kill_to_survivor_commit_median_s'])}, max "
        f"{secs(s['kill_to_survivor_commit_max_s'])}",
        f"relaunched replica start -> healed and committed: median "
        f"{secs(s['relaunch_to_first_commit_median_s'])}; from the end of its setup "
        f"(imports, data, model): {secs(s['ready_to_first_commit_median_s'])}",
        "goodput: n/a" if s.get("goodput") is None else
        f"goodput: {s['goodput']:.3f} (committed replica-steps / ({s['groups']} replicas x "
        f"{s['fault_free_rate']:.2f} steps/s x wall time), from the first kill over "
        f"{s['failures_injected']} kill intervals of {s['kill_every_s']:g} s; "
        f"docs/soak.md, Goodput)",
    ]
    if s["replicas_identical"]:
        lines.append(f"replicas identical: yes ({s['replicas_detail']})")
    else:
        lines.append(f"replicas identical: NO ({s['replicas_detail']})")
    return "\n".join(lines)


def chart(tl: list[dict[str, Any]], groups: int, path: Path, title: str) -> str | None:
    """Draws the chart; returns None, or why it could not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart"
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7.5))
    # A healing replica's loss comes from its fresh weights (it contributes
    # no gradient in that step), so it is left out.
    by_group: dict[int, list[tuple[int, float]]] = defaultdict(list)
    by_step: dict[int, list[float]] = defaultdict(list)
    for r in tl:
        if r["event"] == "commit" and r.get("rank") == 0 and not r.get("healed"):
            by_group[r["group"]].append((r["step"], r["loss"]))
            by_step[r["step"]].append(r["loss"])
    for g in sorted(by_group):
        pts = sorted(by_group[g])
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], ".", ms=2.5, alpha=0.6,
                 label=f"replica group {g}")
    steps = sorted(by_step)
    ax1.plot(steps, [statistics.mean(by_step[s]) for s in steps], "-", lw=1, color="black",
             label="mean over replicas")
    # A failure happens at the step the job was at when the kill landed.
    last_step = -1
    fail_steps = []
    fail_times = []
    for r in tl:
        if r["event"] == "commit" and r.get("rank") == 0:
            last_step = max(last_step, r["step"])
        elif r["event"] == "inject":
            fail_steps.append(last_step + 1)
            fail_times.append(r["elapsed"])
    for i, s in enumerate(fail_steps):
        ax1.axvline(s, color="red", lw=0.8, ls="--", label="replica killed" if i == 0 else None)
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax1.set_title(title)
    ax1.legend(loc="upper right", fontsize=8)
    # Participating replicas over time, as the committing replicas saw it.
    pts = sorted((r["elapsed"], r.get("participants") or 0) for r in tl
                 if r["event"] == "commit" and r.get("rank") == 0)
    if pts:
        ax2.step([p[0] for p in pts], [p[1] for p in pts], where="post", lw=1.2,
                 label="replicas in the committed step")
    for i, t in enumerate(fail_times):
        ax2.axvline(t, color="red", lw=0.8, ls="--", label="replica killed" if i == 0 else None)
    ax2.set_xlim(left=0)
    ax2.set_ylim(0, groups + 0.5)
    ax2.set_yticks(range(groups + 1))
    ax2.set_xlabel("time since launch (s)")
    ax2.set_ylabel("participating replicas")
    ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=("auto", "stepguard", "torchft"), default="auto")
    p.add_argument("--lighthouse-impl", choices=("stepguard", "torchft"), default=None,
                   help="default: stepguard's (wire-compatible with both)")
    p.add_argument("--pg", choices=("auto", "gloo", "tcp"), default="auto",
                   help="cross-replica process group (auto: stepguard's native "
                   "ProcessGroupTCP with stepguard, ProcessGroupGloo with torchft)")
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--ranks", type=int, default=1,
                   help="ranks per replica group (a kill takes one rank; the "
                   "launcher ends and restarts its group)")
    p.add_argument("--fsdp", action="store_true",
                   help="FT-HSDP: FSDP2 inside each group, the Manager across "
                   "(stepguard only)")
    p.add_argument("--duration", type=float, default=180.0, help="training time in seconds")
    p.add_argument("--kill-every", type=float, default=20.0)
    p.add_argument("--quiet-tail", type=float, default=30.0,
                   help="no kills in the last this many seconds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--omp-threads", type=int, default=1)
    p.add_argument("--out", default="demo-out")
    p.add_argument("--progress-every", type=float, default=5.0)
    p.add_argument("train_args", nargs="*",
                   help="extra arguments for train_llama.py (after --)")
    args = p.parse_args(argv)

    impl = pick_impl(args.impl)
    lh_impl = args.lighthouse_impl or "stepguard"
    pg = args.pg if args.pg != "auto" else ("tcp" if impl == "stepguard" else "gloo")
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    params = out / "params"
    cmd = [sys.executable, str(HERE / "train_llama.py"), "--impl", impl,
           "--device", "cpu", "--pg", pg, "--save-dir", str(params), *args.train_args]
    if args.fsdp:
        if impl != "stepguard":
            raise SystemExit("--fsdp needs stepguard's API")
        cmd.append("--fsdp")
    kill = parse_failure_spec(f"kill:every={args.kill_every}s,seed={args.seed}")
    cfg = LaunchConfig(
        cmd=cmd, groups=args.groups, nproc_per_group=args.ranks,
        lighthouse_impl=lh_impl, min_replicas=1,
        join_timeout_ms=10000, quorum_tick_ms=100, omp_threads=args.omp_threads,
        failures=[kill], timeline=str(out / "timeline.jsonl"), log_dir=str(out / "logs"),
        stop_file=str(out / "stop_step"), quiet=True,
        env={"TORCHFT_QUORUM_TIMEOUT_SEC": "120"},
    )
    print(f"demo: {args.groups} replica groups train a small Llama on CPU with "
          f"{impl}'s API ({pg} process group) and the {lh_impl} lighthouse for about "
          f"{args.duration:.0f} s; "
          f"a replica is killed every {args.kill_every:.0f} s (none in the last "
          f"{args.quiet_tail:.0f} s)", flush=True)
    progress = Progress(args.groups, args.progress_every)
    phase = {"quiet": False, "finish": False, "hard": None}

    def on_tick(launcher: Launcher) -> None:
        el = launcher.elapsed()
        if progress.gave_up is not None:
            launcher.stop()
            return
        progress.tick(el)
        if not phase["quiet"] and el >= args.duration - args.quiet_tail:
            phase["quiet"] = True
            launcher.stop_injecting()
            print(f"[{el:6.1f}s] no more kills; letting every replica catch up", flush=True)
        if not phase["finish"] and el >= args.duration:
            phase["finish"] = True
            stop = max(progress.max_step, 0) + 3
            launcher.finish(step=stop)
            phase["hard"] = el + 120.0
            print(f"[{el:6.1f}s] asking every replica to stop at step {stop}", flush=True)
        if phase["hard"] is not None and el >= phase["hard"]:
            print(f"[{el:6.1f}s] replicas did not stop within 120 s; ending them", flush=True)
            launcher.stop()

    launcher = Launcher(cfg, on_event=progress.on_event, on_tick=on_tick)
    t0 = time.monotonic()
    rc = launcher.run()
    if rc == 130:
        print("demo: interrupted; everything it started has been stopped")
        return rc
    if progress.gave_up is not None:
        print(f"demo: failed: the trainer ({impl}) does not run; see {out / 'logs'}/")
        return 1
    tl = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    identical = compare_params(params, args.groups, args.ranks)
    s = summarize(tl, args.groups, identical, f"{impl} with the {pg} process group", lh_impl,
                  args.kill_every)
    s["wall_s"] = round(time.monotonic() - t0, 1)
    text = summary_text(s)
    (out / "summary.txt").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    why = chart(tl, args.groups, out / "chart.png",
                f"small Llama, {args.groups} replica groups, {impl} "
                f"(kill every {args.kill_every:.0f} s)")
    print()
    print(text)
    print(f"chart: {out / 'chart.png'}" if why is None else f"chart: {why}")
    print(f"timeline: {out / 'timeline.jsonl'}  logs: {out / 'logs'}/")
    if rc != 0:
        print(f"demo: the launcher ended with status {rc}")
        return rc
    return 0 if s["replicas_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
