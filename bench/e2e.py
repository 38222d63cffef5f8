"""End-to-end benchmark: the small Llama under periodic SIGKILLs, stepguard
against torchft in the same run, with plain DDP as the step-time baseline.

Every configuration runs ``examples/train_llama.py`` (same model, data and
seed) in ``--groups`` replica groups under ``stepguard.launch``, with the
same kill schedule (``kill:every=K,seed=S``) and lighthouse flags
``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``.  From the
launcher's timeline it measures:

(a) SIGKILL -> the survivors' next committed step;
(b) the steady-state step time (all replicas in the quorum, none healing),
    against plain ``torch.distributed`` DDP over the same ranks;
(c) relaunched replica start -> its first committed step (process start,
    imports, joining, healing from a peer, one step); (c') the same from
    the moment the trainer reported ``ready`` (imports, corpus and model
    done), which is the part fault tolerance is responsible for.

Configurations: ``plain`` (torch DDP, no fault tolerance), ``torchft``
(torchft's trainer and lighthouse), ``stepguard`` (stepguard's trainer and
lighthouse, with ProcessGroupGloo like torchft; only when stepguard provides
the training API), ``stepguard-tcp`` (the same with stepguard's native
ProcessGroupTCP), and ``sg-lighthouse`` (torchft's trainer under stepguard's
lighthouse, which isolates what the lighthouse changes).  Medians, maxima and ratios go to
``bench/results/e2e.md``.

Run with ``.venv/bin/python bench/e2e.py`` (about five minutes on two
CPUs), or ``--duration 60 --kill-every 15 --configs torchft,stepguard``.

``--scenarios hang,partition`` (default ``kill``) adds the survivors' stall
after a hang (every rank of a group SIGSTOPped for ``--fault-duration``
seconds, then SIGCONT) and after a partition (a group cut off the network
for as long, in a network namespace per group: root only, skipped with the
reason otherwise), with the same ``--heartbeat-timeout-ms`` and operation
timeout (``--op-timeout``: the trainer's process group and manager
timeouts) for every configuration: the time from the injection to the
first commit by another group of a quorum without the victim (or, if no
quorum dropped it, to the first commit after the fault ended).  A fault
longer than the operation timeout lets a survivor that waits in a
collective give up on the victim at that timeout; stepguard's manager
aborts the collective once the lighthouse holds the victim unhealthy.
Results go to ``bench/results/e2e-faults.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train_llama.py"
TRAINER_API = ("Manager", "DistributedDataParallel", "Optimizer", "ProcessGroupGloo")

from stepguard.launch import LaunchConfig, Launcher, parse_failure_spec  # noqa: E402
from stepguard.soak import goodput  # noqa: E402


def stepguard_has_trainer() -> bool:
    try:
        import stepguard
    except ImportError:
        return False
    return all(hasattr(stepguard, n) for n in TRAINER_API)


def run_config(name: str, args: argparse.Namespace, out: Path,
               scenario: str = "kill") -> list[dict[str, Any]]:
    """Runs one configuration under one failure scenario; returns its
    timeline."""
    trainer, lh, pg = {
        "plain": ("plain", "stepguard", "gloo"),
        "torchft": ("torchft", "torchft", "gloo"),
        "stepguard": ("stepguard", "stepguard", "gloo"),
        "stepguard-tcp": ("stepguard", "stepguard", "tcp"),
        "sg-lighthouse": ("torchft", "stepguard", "gloo"),
    }[name]
    train_args = ["--device", "cpu", "--pg", pg, *args.train_args]
    failures = []
    hb = 5000
    if trainer == "plain":
        train_args += ["--plain", "--steps", str(args.plain_steps)]
        groups, nproc, duration = 1, args.groups, None
    else:
        train_args += ["--impl", trainer]
        groups, nproc, duration = args.groups, 1, args.duration
        if scenario == "kill":
            spec = f"kill:every={args.kill_every}s,seed={args.seed}"
        else:
            spec = (f"{scenario}:every={args.fault_every}s,duration={args.fault_duration}s,"
                    f"seed={args.seed}")
            train_args += ["--pg-timeout", str(args.op_timeout), "--timeout",
                           str(args.op_timeout)]
            hb = args.heartbeat_timeout_ms
        failures = [parse_failure_spec(spec)]
    tag = name if scenario == "kill" else f"{name}-{scenario}"
    cfg = LaunchConfig(
        cmd=[sys.executable, str(TRAIN), *train_args], groups=groups, nproc_per_group=nproc,
        lighthouse_impl=lh, min_replicas=1, join_timeout_ms=10000, quorum_tick_ms=100,
        heartbeat_timeout_ms=hb,
        omp_threads=args.omp_threads, duration=duration, failures=failures,
        timeline=str(out / f"{tag}.jsonl"), log_dir=str(out / f"logs-{tag}"), quiet=True,
        max_restarts=1000,
    )
    print(f"e2e: {tag}: trainer {trainer}, lighthouse {lh}, process group {pg}, "
          f"{'%d ranks of plain DDP' % nproc if trainer == 'plain' else '%d groups' % groups}",
          flush=True)
    t0 = time.monotonic()
    rc = Launcher(cfg).run()
    if rc != 0:
        raise SystemExit(f"e2e: {tag}: launcher exited with {rc}; see {out}/logs-{tag}/")
    print(f"e2e: {tag}: done in {time.monotonic() - t0:.0f} s", flush=True)
    return [json.loads(line) for line in (out / f"{tag}.jsonl").read_text().splitlines()]


def fault_stalls(tl: list[dict[str, Any]], groups: int) -> dict[str, Any]:
    """Per hang or partition that hit a member of a full quorum: seconds
    from the injection to the first commit by another group of a quorum
    without the victim, or (when no quorum dropped it) to the first commit
    by another group after the fault ended."""
    stalls, kept = [], 0
    injects = [r for r in tl if r["event"] == "inject" and r["kind"] in ("hang", "partition")]
    ends = {r["failure"]: r["t"] for r in tl
            if r["event"] in ("hang_end", "partition_end")}
    commits = [r for r in tl if r["event"] == "commit"]
    for inj in injects:
        t0, victim = inj["t"], inj["group"]
        before = [c for c in commits if c["group"] != victim and c["t"] <= t0]
        if not before or before[-1].get("participants") != groups:
            continue  # the victim was not in the survivors' quorum
        after = [c for c in commits if c["group"] != victim and c["t"] > t0]
        dropped = [c for c in after if (c.get("participants") or groups) < groups]
        end = ends.get(inj["failure"])
        if dropped and (end is None or dropped[0]["t"] <= end + 1.0):
            stalls.append(dropped[0]["t"] - t0)
        elif end is not None:
            late = [c for c in after if c["t"] > end]
            if late:
                stalls.append(late[0]["t"] - t0)
                kept += 1
    return {"faults": len(injects), "stalls": sorted(stalls), "kept": kept}


def fault_table(res: dict[str, dict[str, dict[str, Any]]], cols: list[str]) -> str:
    fast = next((c for c in ("stepguard-tcp", "stepguard") if c in cols), None)
    head = "| scenario | metric | " + " | ".join(cols) + (
        f" | torchft / {fast} |" if fast and "torchft" in cols else " |")
    sep = "|---" * (len(cols) + 2 + (1 if fast and "torchft" in cols else 0)) + "|"
    lines = [head, sep]
    for scen, by in res.items():
        for label, fn in (("stall, median", med), ("stall, max", lambda v: max(v) if v else None)):
            vals = {c: fn(by[c]["stalls"]) if c in by else None for c in cols}
            line = f"| {scen} | {label} | " + " | ".join(fmt(vals[c]) for c in cols)
            if fast and "torchft" in cols:
                line += f" | {ratio(vals.get('torchft'), vals.get(fast))}"
            lines.append(line + " |")
        line = f"| {scen} | faults / measured / victim kept | " + " | ".join(
            f"{by[c]['faults']} / {len(by[c]['stalls'])} / {by[c]['kept']}" if c in by else "n/a"
            for c in cols)
        lines.append(line + (" | |" if fast and "torchft" in cols else " |"))
    return "\n".join(lines)


def measure(tl: list[dict[str, Any]], groups: int, warmup: int) -> dict[str, Any]:
    surv: dict[int, float] = {}
    for r in tl:
        if r["event"] == "recovery" and r["kind"] == "survivors":
            surv.setdefault(r["failure"], r["duration_s"])
    rejoins = [r for r in tl if r["event"] == "recovery" and r["kind"] == "rejoin"]
    rejoin = [r["duration_s"] for r in rejoins]
    join = [r["join_s"] for r in rejoins if "join_s" in r]
    # Steady state: a committed step of a full quorum, nobody healing, and
    # not among the first `warmup` steps of an incarnation.
    seen: dict[tuple[int, int, int], int] = {}
    times = []
    for r in tl:
        if r["event"] != "commit":
            continue
        key = (r["group"], r["rank"], r["incarnation"])
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= warmup or r.get("healed"):
            continue
        if r.get("participants") != groups:
            continue
        times.append(r["step_time"])
    steps = {r["step"] for r in tl if r["event"] == "commit"}
    # goodput (stepguard.soak.goodput): from the first commit to the last,
    # against the steady-state step rate of this configuration
    commit_t = [r["t"] for r in tl if r["event"] == "commit"]
    rate = goodput.rate_from_step_times(times)
    gp = None
    if rate and len(commit_t) > 1:
        gp = goodput.goodput(goodput.committed_replica_steps(tl), groups, rate,
                             max(commit_t) - min(commit_t))
    return {
        "goodput": gp,
        "kills": sum(1 for r in tl if r["event"] == "inject"),
        "survivors": sorted(surv.values()),
        "rejoin": sorted(rejoin),
        "join": sorted(join),
        "step_times": times,
        "committed_steps": len(steps),
        "discards": sum(1 for r in tl if r["event"] == "discard" and r.get("rank") == 0),
    }


def med(v: list[float]) -> float | None:
    return statistics.median(v) if v else None


def fmt(v: float | None, unit: str = "s") -> str:
    if v is None:
        return "n/a"
    return f"{v * 1000:.0f} ms" if unit == "ms" else f"{v:.2f} s"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{a / b:.2f}x"


def table(res: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    cols = [c for c in ("plain", "torchft", "stepguard", "stepguard-tcp", "sg-lighthouse")
            if c in res]
    fast = next((c for c in ("stepguard-tcp", "stepguard", "sg-lighthouse") if c in res), None)
    head = "| metric | " + " | ".join(cols) + (f" | torchft / {fast} |" if fast else " |")
    sep = "|---" * (len(cols) + 1 + (1 if fast else 0)) + "|"
    rows = []

    def row(label: str, key: str, fn, unit: str = "s") -> None:
        vals = {c: fn(res[c][key]) if res[c].get(key) is not None else None for c in cols}
        line = f"| {label} | " + " | ".join(fmt(vals[c], unit) for c in cols)
        if fast:
            line += f" | {ratio(vals.get('torchft'), vals.get(fast))}"
        rows.append(line + " |")

    row("(a) kill -> survivors' next commit, median", "survivors", med)
    row("(a) kill -> survivors' next commit, max", "survivors",
        lambda v: max(v) if v else None)
    row("(b) step time, median (full quorum)", "step_times", med, "ms")
    row("(c) relaunch -> first commit, median", "rejoin", med)
    row("(c) relaunch -> first commit, max", "rejoin", lambda v: max(v) if v else None)
    row("(c') trainer ready -> first commit, median", "join", med)
    row("(c') trainer ready -> first commit, max", "join", lambda v: max(v) if v else None)
    counts = "| kills / committed steps / discarded | " + " | ".join(
        f"{res[c]['kills']} / {res[c]['committed_steps']} / {res[c]['discards']}"
        for c in cols) + (" | |" if fast else " |")
    plain = med(res["plain"]["step_times"]) if "plain" in res else None
    over = []
    for c in cols:
        if c != "plain" and plain:
            m = med(res[c]["step_times"])
            if m is not None:
                over.append(f"{c} {m / plain:.2f}x")
    gps = "| goodput (stepguard.soak.goodput) | " + " | ".join(
        f"{res[c]['goodput']:.2f}" if res[c].get("goodput") is not None else "n/a"
        for c in cols) + (" | |" if fast else " |")
    lines = [head, sep, *rows, counts, gps]
    if over:
        lines.append("")
        lines.append("Step time relative to plain DDP: " + ", ".join(over) + ".")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--duration", type=float, default=75.0, help="seconds per FT config")
    p.add_argument("--kill-every", type=float, default=15.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--plain-steps", type=int, default=40)
    p.add_argument("--omp-threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3, help="steps per incarnation not timed")
    p.add_argument("--configs", default="plain,torchft,stepguard,stepguard-tcp,sg-lighthouse")
    p.add_argument("--out", default=str(ROOT / "build" / "bench-e2e"))
    p.add_argument("--results", default=str(ROOT / "bench" / "results" / "e2e.md"))
    p.add_argument("--scenarios", default="kill",
                   help="comma-separated: kill (the table above), hang, partition")
    p.add_argument("--fault-every", type=float, default=30.0,
                   help="hang/partition: seconds between injections")
    p.add_argument("--fault-duration", type=float, default=15.0,
                   help="hang/partition: how long each lasts")
    p.add_argument("--op-timeout", type=float, default=10.0,
                   help="hang/partition: the trainer's process group and manager timeouts")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000,
                   help="hang/partition: the lighthouse's heartbeat timeout")
    p.add_argument("--fault-results", default=str(ROOT / "bench" / "results" / "e2e-faults.md"))
    p.add_argument("train_args", nargs="*", help="extra train_llama.py arguments (after --)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    notes = []
    if not stepguard_has_trainer():
        configs = [c for c in configs if c not in ("stepguard", "stepguard-tcp")]
        notes.append("stepguard's training API (Manager, DDP, Optimizer, ProcessGroupGloo) "
                     "was not available in this build, so the stepguard columns are absent.")
        print("e2e: " + notes[-1], flush=True)
    notes.append("`stepguard` uses ProcessGroupGloo like torchft; `stepguard-tcp` uses "
                 "stepguard's native ProcessGroupTCP; `sg-lighthouse` runs torchft's "
                 "trainer under stepguard's lighthouse.  The ratio column is torchft over "
                 "the first of stepguard-tcp, stepguard, sg-lighthouse present.")
    scenarios = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    faults = [x for x in scenarios if x in ("hang", "partition")]
    if "partition" in faults:
        from stepguard.launch import netns_unavailable

        why = netns_unavailable()
        if why is not None:
            print(f"e2e: SKIP partition: {why}", flush=True)
            faults.remove("partition")
    if faults:
        fcols = [c for c in configs if c not in ("plain", "sg-lighthouse")]
        fres: dict[str, dict[str, dict[str, Any]]] = {}
        for scen in faults:
            fres[scen] = {}
            for c in fcols:
                fres[scen][c] = fault_stalls(run_config(c, args, out, scen), args.groups)
                m = fres[scen][c]
                print(f"e2e: {c}-{scen}: {m['faults']} faults, stalls "
                      f"{[round(x, 2) for x in m['stalls']]}", flush=True)
        ftbl = fault_table(fres, fcols)
        fheader = (
            f"# End-to-end: survivors' stall after a hang or a partition\n\n"
            f"`bench/e2e.py --scenarios {','.join(faults)}`, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()} "
            f"with {os.cpu_count()} CPUs (shared).  {args.groups} replica groups x 1 rank of "
            f"the small Llama, {args.duration:.0f} s per configuration and scenario, one "
            f"fault every {args.fault_every:g} s lasting {args.fault_duration:g} s "
            f"(seed {args.seed}), the same lighthouse heartbeat timeout "
            f"({args.heartbeat_timeout_ms} ms) and operation timeout ({args.op_timeout:g} s: "
            f"`--pg-timeout` and `--timeout`) for every configuration.  Stall: injection to "
            f"the first commit by another group of a quorum without the victim (or, where "
            f"no quorum dropped it, to the first commit after the fault ended: 'victim "
            f"kept').  Only faults that hit a member of a full quorum are measured.\n\n")
        print()
        print(ftbl)
        Path(args.fault_results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.fault_results).write_text(fheader + ftbl + "\n")
        print(f"\nwrote {args.fault_results}")
    if "kill" not in scenarios:
        return 0
    res = {}
    for c in configs:
        tl = run_config(c, args, out)
        # plain DDP reports its world size (= groups) as participants
        res[c] = measure(tl, args.groups, args.warmup)
        m = res[c]
        print(f"e2e: {c}: kills {m['kills']}, survivors {fmt(med(m['survivors']))}, "
              f"step {fmt(med(m['step_times']), 'ms')}, rejoin {fmt(med(m['rejoin']))}",
              flush=True)
    tbl = table(res, args)
    header = (
        f"# End-to-end: small Llama under SIGKILLs\n\n"
        f"`bench/e2e.py`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{platform.machine()} with {os.cpu_count()} CPUs (shared), Python "
        f"{platform.python_version()}.  {args.groups} replica groups x 1 rank, "
        f"OMP_NUM_THREADS={args.omp_threads}, {args.duration:.0f} s per configuration, "
        f"`kill:every={args.kill_every:g}s,seed={args.seed}`, lighthouse `--min_replicas 1 "
        f"--quorum_tick_ms 100 --join_timeout_ms 10000`; plain DDP: {args.groups} ranks, "
        f"{args.plain_steps} steps.  Medians over all kills / steady-state steps / "
        f"relaunches.\n\n"
    )
    text = header + tbl + "\n" + "".join(f"\n{n}\n" for n in notes)
    print()
    print(tbl)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(text)
    print(f"\nwrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
