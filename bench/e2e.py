"""End-to-end benchmark: the small Llama under periodic SIGKILLs, stepguard
against torchft in the same run, with plain DDP as the fault-free reference.

Every configuration runs ``examples/train_llama.py`` (same model, data and
seed) in ``--groups`` replica groups under ``stepguard.launch``, with the
same kill schedules (``kill:every=K,start=F,seed=S`` for each K of
``--kill-every``, default 20 and 60 s, first kill at F = ``--first-kill``)
and lighthouse flags ``--quorum_tick_ms 100 --join_timeout_ms 10000``.  From
the launcher's timeline it measures:

(a) SIGKILL -> the survivors' next committed step;
(b) the steady-state step time (all replicas in the quorum, none healing),
    against plain ``torch.distributed`` DDP over the same ranks;
(c) relaunched replica start -> its first committed step (process start,
    imports, joining, healing from a peer, one step); (c') the same from
    the moment the trainer reported ``ready`` (imports, corpus and model
    done), which is the part fault tolerance is responsible for;
(d) goodput (``stepguard.soak.goodput``, the definition the chaos soak
    uses): committed replica-steps / (replicas x fault-free step rate x
    wall time).  Wall time is the same window for every configuration:
    from its first kill to ``--window`` seconds later, a whole number of
    kill intervals, so start-up (imports, the first quorum) is not counted
    as fault cost and every kill has a full interval to cost what it
    costs.  The fault-free rate is measured in the same window
    (``goodput.window_rate``): one replica's steps per second over the
    gaps between consecutive commits of a full quorum while no process
    (a relaunch, a warm spare) sets up at the trainers' priority (a spare
    niced by ``--spare-nice`` takes only the CPU they leave; the table
    shows the rate while one sets up beside the rate while none does, so
    that this is checked).  Taken there rather than before
    the first kill because the shared machine's load drifts within a run
    (a rate taken before the kills put one window at 1.5).  Hot spares
    count only as participants (at most ``--groups`` commits per step).
    Also: the
    same against plain DDP's rate (what fault tolerance costs without
    faults, included), the median over kill intervals, and the lost part
    split into the victim's absence, the survivors' stall and the rest.

Configurations (``CONFIGS``): ``plain`` (torch DDP, no fault tolerance and
no kills, run once), ``torchft`` (torchft's trainer and lighthouse),
``stepguard`` (stepguard's trainer and lighthouse, with ProcessGroupGloo
like torchft; only when stepguard provides the training API),
``stepguard-tcp`` (the same with stepguard's native ProcessGroupTCP),
``sg-lighthouse`` (torchft's trainer under stepguard's lighthouse, which
isolates what the lighthouse changes), ``stepguard-warm`` (``stepguard-tcp``
with one warm spare, ``--spares 1``: docs/spares.md; ``stepguard-warm2``
with two; ``stepguard-warm-flat`` the same as ``stepguard-warm`` with the
spare at the trainers' priority, ``--spare-nice 0``) and
``stepguard-hot``
(``stepguard-tcp`` with one group more under ``FIXED_WITH_SPARES``,
``--min-replicas`` = ``--groups``); ``torchft-hot`` is torchft's hot spares
(``bench/spares.py`` uses the same table).  (a)-(c) go to
``bench/results/e2e.md``, one table per schedule; (d) to
``bench/results/e2e-goodput.md``.

Run with ``.venv/bin/python bench/e2e.py`` (each configuration takes
``--first-kill`` + ``--window`` + 3 s per schedule: about 35 minutes for
``--configs plain,torchft,stepguard-tcp,stepguard-warm,stepguard-hot``), or
``--kill-every 15 --window 60 --configs torchft,stepguard``.

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


# name -> (trainer, lighthouse, process group, hot spares, warm spares)
CONFIGS = {
    "plain": ("plain", "stepguard", "gloo", False, 0),
    "torchft": ("torchft", "torchft", "gloo", False, 0),
    "stepguard": ("stepguard", "stepguard", "gloo", False, 0),
    "stepguard-tcp": ("stepguard", "stepguard", "tcp", False, 0),
    "sg-lighthouse": ("torchft", "stepguard", "gloo", False, 0),
    "stepguard-warm": ("stepguard", "stepguard", "tcp", False, 1),
    "stepguard-warm2": ("stepguard", "stepguard", "tcp", False, 2),
    "stepguard-warm-flat": ("stepguard", "stepguard", "tcp", False, 1),
    "stepguard-hot": ("stepguard", "stepguard", "tcp", True, 0),
    "torchft-hot": ("torchft", "torchft", "gloo", True, 0),
}


def run_config(name: str, args: argparse.Namespace, out: Path, scenario: str = "kill",
               every: float | None = None, duration: float | None = None,
               tag: str | None = None, pg: str | None = None,
               who: str = "e2e") -> list[dict[str, Any]]:
    """Runs one configuration under one failure scenario; returns its
    timeline.  A kill scenario kills one group every ``every`` seconds
    from ``args.first_kill`` on, none in the last ``every / 2`` seconds of
    ``duration``; ``pg`` replaces the process group of stepguard's trainer
    (``bench/spares.py``'s ``--pg``)."""
    trainer, lh, cpg, hot, warm = CONFIGS[name]
    pg = pg if pg is not None and trainer == "stepguard" else cpg
    train_args = ["--device", "cpu", "--pg", pg, *args.train_args]
    failures = []
    hb = 5000
    min_replicas = 1
    if trainer == "plain":
        train_args += ["--plain", "--steps", str(args.plain_steps)]
        groups, nproc, duration = 1, args.groups, None
    else:
        train_args += ["--impl", trainer]
        groups, nproc = args.groups, 1
        duration = args.duration if duration is None else duration
        if hot:  # one group more, at most args.groups of them take part
            groups += 1
            train_args += ["--world-size-mode", "fixed_with_spares",
                           "--min-replicas", str(args.groups)]
            min_replicas = args.groups
        if scenario == "kill":
            every = args.kill_every if every is None else every
            spec = (f"kill:every={every:g}s,start={args.first_kill:g}s,"
                    f"stop={duration - every / 2:g}s,seed={args.seed}")
        else:
            spec = (f"{scenario}:every={args.fault_every}s,duration={args.fault_duration}s,"
                    f"seed={args.seed}")
            train_args += ["--pg-timeout", str(args.op_timeout), "--timeout",
                           str(args.op_timeout)]
            hb = args.heartbeat_timeout_ms
        failures = [parse_failure_spec(spec)]
    tag = tag or (name if scenario == "kill" else f"{name}-{scenario}")
    cfg = LaunchConfig(
        cmd=[sys.executable, str(TRAIN), *train_args], groups=groups, nproc_per_group=nproc,
        lighthouse_impl=lh, min_replicas=min_replicas, join_timeout_ms=10000,
        quorum_tick_ms=100, heartbeat_timeout_ms=hb,
        omp_threads=args.omp_threads, duration=duration, failures=failures,
        timeline=str(out / f"{tag}.jsonl"), log_dir=str(out / f"logs-{tag}"), quiet=True,
        max_restarts=1000, spares=warm, spare_nice=0 if name.endswith("-flat") else 19,
    )
    print(f"{who}: {tag}: trainer {trainer}, lighthouse {lh}, process group {pg}, "
          f"{'%d ranks of plain DDP' % nproc if trainer == 'plain' else '%d groups' % groups}"
          f"{', a hot spare (FIXED_WITH_SPARES)' if hot else ''}"
          f"{', %d warm spare%s' % (warm, 's' * (warm > 1)) if warm else ''}", flush=True)
    t0 = time.monotonic()
    rc = Launcher(cfg).run()
    if rc != 0:
        raise SystemExit(f"{who}: {tag}: launcher exited with {rc}; see {out}/logs-{tag}/")
    print(f"{who}: {tag}: done in {time.monotonic() - t0:.0f} s", flush=True)
    return [json.loads(line) for line in (out / f"{tag}.jsonl").read_text().splitlines()]


def hot_full(tl: list[dict[str, Any]], target: int) -> list[float]:
    """Per kill: seconds to the first commit by a survivor of a quorum newer
    than the victim's last one, with ``target`` participants (a hot spare
    stepped in)."""
    commits = [r for r in tl if r["event"] == "commit" and r.get("rank") == 0]
    out = []
    for k in (r for r in tl if r["event"] == "inject" and r["kind"] == "kill"):
        mine = [c for c in commits if c["group"] == k["group"] and c["t"] <= k["t"]]
        q = max((c.get("quorum_id") or -1 for c in mine), default=-1)
        after = [c for c in commits if c["t"] > k["t"] and c["group"] != k["group"]
                 and (c.get("quorum_id") or -1) > q and c.get("participants") == target]
        if after:
            out.append(after[0]["t"] - k["t"])
    return sorted(out)


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
    return {
        "kills": sum(1 for r in tl if r["event"] == "inject"),
        "survivors": sorted(surv.values()),
        "rejoin": sorted(rejoin),
        "join": sorted(join),
        "step_times": times,
        "committed_steps": len(steps),
        "discards": sum(1 for r in tl if r["event"] == "discard" and r.get("rank") == 0),
    }


def measure_goodput(tl: list[dict[str, Any]], name: str, groups: int, every: float,
                    window: float, warmup: int) -> dict[str, Any]:
    """Goodput (``stepguard.soak.goodput``) of one run, in the window from
    its first kill to ``window`` seconds later, against the fault-free rate
    of the same window (``goodput.window_rate``: its full-quorum steps
    while no process sets up; the machine's load drifts, so a rate taken
    before the kills would not hold for the window).  Per kill interval
    (a kill to the next), the same against that interval's own rate, where
    it has fault-free steps.  Plain DDP (no kill) is measured from its
    ``warmup``-th step to its last, against itself.  Also splits what was
    lost (1 - goodput) into the victim's absence (kill -> the job's next
    commit at full strength, one replica's work), the survivors' stall
    (kill -> their next commit, every survivor's work) and the rest
    (slower steps while a replacement sets up, the heal step, discarded
    steps)."""
    commits = [r for r in tl if r["event"] == "commit" and r.get("rank") == 0]
    full = [r["t"] for r in commits if r.get("participants") == groups]
    kills = sorted(r["t"] for r in tl if r["event"] == "inject" and r.get("kind") == "kill")
    busy = goodput.setup_spans(tl)
    if CONFIGS[name][0] == "plain":
        # one group of `groups` ranks: rank 0's commits are the steps
        if len(full) < warmup + 2:
            return {"rate": None, "goodput": None}
        t0, t1 = full[warmup], full[-1]
        rate = goodput.steady_rate(tl, groups, t0, t1, busy)
        n = goodput.committed_replica_steps(tl, t0, t1)
        return {"rate": rate, "goodput": goodput.goodput(n, 1, rate or 0, t1 - t0),
                "replica_steps": n, "wall_s": t1 - t0, "kills": 0}
    win = goodput.kill_window(tl, every, window)
    if not full or win is None:
        return {"rate": None, "goodput": None}
    w0, w1 = win
    rate = goodput.window_rate(tl, groups, w0, w1)
    n = goodput.committed_replica_steps(tl, w0, w1)
    gp = goodput.goodput(n, groups, rate or 0, window)
    in_win = [k for k in kills if w0 <= k < w1]
    edges = [*in_win, w1]  # each kill's interval: to the next kill, the last to w1
    per_kill = [goodput.goodput(goodput.committed_replica_steps(tl, a, b), groups,
                                goodput.steady_rate(tl, groups, a, b, busy) or 0, b - a)
                for a, b in zip(edges, edges[1:])]
    rec = [r for r in tl if r["event"] == "recovery" and w0 <= r["t"] - r["duration_s"] < w1]
    surv: dict[int, float] = {}
    for r in rec:
        if r["kind"] == "survivors":
            surv.setdefault(r["failure"], r["duration_s"])
    if CONFIGS[name][3]:
        back = hot_full([r for r in tl if r["event"] != "inject" or w0 <= r["t"] < w1],
                        groups)
    else:
        back = sorted(r["duration_s"] for r in rec if r["kind"] == "full_strength")
    # that a spare set up at a low priority leaves the steps alone, which
    # window_rate takes for granted: the rate while one sets up, and otherwise
    low = goodput.setup_spans(tl, spares="lowered")
    every_setup = goodput.setup_spans(tl, spares="all")
    res = {"rate": rate, "goodput": gp, "replica_steps": n, "wall_s": window,
           "rate_lowered": (goodput.steady_rate(tl, groups, w0, w1, busy, within=low)
                            if low else None,
                            goodput.steady_rate(tl, groups, w0, w1, every_setup)
                            if low else None),
           "kills": len(in_win), "per_kill": sorted(g for g in per_kill if g is not None),
           "survivors": sorted(surv.values()), "full": back,
           "discards": sum(1 for r in tl if r["event"] == "discard" and r.get("rank") == 0
                           and w0 <= r["t"] < w1),
           "takeovers": [bool(r.get("ready")) for r in tl
                         if r["event"] == "takeover" and w0 <= r["t"] < w1]}
    if rate and gp is not None:
        possible = groups * rate * window
        absent = sum(min(d, every) for d in back) * rate / possible
        stall = sum(min(d, every) for d in surv.values()) * (groups - 1) * rate / possible
        res["lost"] = {"absent": absent, "stall": stall, "rest": 1 - gp - absent - stall}
    return res


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
    cols = [c for c in CONFIGS if c in res]
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
    gps = "| goodput (`bench/results/e2e-goodput.md`) | " + " | ".join(
        f"{res[c]['goodput']:.2f}" if res[c].get("goodput") is not None else "n/a"
        for c in cols) + (" | |" if fast else " |")
    lines = [head, sep, *rows, counts, gps]
    if over:
        lines.append("")
        lines.append("Step time relative to plain DDP: " + ", ".join(over) + ".")
    return "\n".join(lines)


def goodput_table(gres: dict[float, dict[str, dict[str, Any]]], cols: list[str],
                  plain_rate: float | None) -> str:
    """One block of rows per kill schedule; a column per configuration."""
    def num(v: float | None, f: str = "{:.3f}") -> str:
        return "n/a" if v is None else f.format(v)

    lines = ["| kill every | metric | " + " | ".join(cols) + " |",
             "|---" * (len(cols) + 2) + "|"]
    for every, by in gres.items():
        def row(label: str, fn) -> None:
            lines.append(f"| {every:g} s | {label} | " + " | ".join(
                fn(by[c]) if c in by else "n/a" for c in cols) + " |")

        base = by.get("torchft", {}).get("goodput")
        row("goodput", lambda m: num(m.get("goodput")))
        row("goodput / torchft's", lambda m: ratio(m.get("goodput"), base))
        row("goodput per kill interval: median (min)", lambda m: (
            f"{med(m['per_kill']):.3f} ({min(m['per_kill']):.3f})" if m.get("per_kill")
            else "n/a"))
        row("goodput against plain DDP's rate", lambda m: num(
            m["goodput"] * m["rate"] / plain_rate if plain_rate and m.get("goodput")
            and m.get("rate") else None))
        row("lost: victim absent / survivors' stall / rest", lambda m: (
            " / ".join(f"{m['lost'][k]:.3f}" for k in ("absent", "stall", "rest"))
            if m.get("lost") else "n/a"))
        row("kill -> full strength, median (max)", lambda m: (
            f"{fmt(med(m['full']))} ({fmt(max(m['full']))})" if m.get("full") else "n/a"))
        row("kill -> survivors' next commit, median", lambda m: fmt(med(m.get("survivors") or [])))
        row("warm: takeovers (spare still setting up)", lambda m: (
            f"{len(m['takeovers'])} ({m['takeovers'].count(False)})" if m.get("takeovers")
            else "n/a"))
        row("fault-free rate (steps/s per replica)", lambda m: num(m.get("rate"), "{:.2f}"))
        row("warm: that rate while a low-priority spare sets up / while none does",
            lambda m: " / ".join(num(x, "{:.2f}") for x in m["rate_lowered"])
            if m.get("rate_lowered") and m["rate_lowered"][0] is not None else "n/a")
        row("kills in window / replica-steps / discarded", lambda m: (
            f"{m.get('kills', 0)} / {m.get('replica_steps', 'n/a')} / {m.get('discards', 0)}"))
        row("load average (1 min), start / end", lambda m: (
            f"{m['load'][0]:.1f} / {m['load'][1]:.1f}" if m.get("load") else "n/a"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--duration", type=float, default=75.0,
                   help="hang/partition: seconds per FT config")
    p.add_argument("--kill-every", default="20,60",
                   help="comma-separated: seconds between kills, one schedule each")
    p.add_argument("--first-kill", type=float, default=40.0,
                   help="seconds before the first kill (every trainer and spare set up)")
    p.add_argument("--window", type=float, default=180.0,
                   help="seconds from the first kill measured (a multiple of every "
                   "--kill-every); each kill run lasts --first-kill + --window + 3 s")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--plain-steps", type=int, default=100)
    p.add_argument("--omp-threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3, help="steps per incarnation not timed")
    p.add_argument("--configs", default="plain,torchft,stepguard,stepguard-tcp,sg-lighthouse,"
                   "stepguard-warm,stepguard-hot")
    p.add_argument("--out", default=str(ROOT / "build" / "bench-e2e"))
    p.add_argument("--results", default=str(ROOT / "bench" / "results" / "e2e.md"))
    p.add_argument("--reuse", action="store_true",
                   help="kill runs: measure the timelines an earlier run left in --out "
                   "(with their load averages) instead of running them again")
    p.add_argument("--goodput-results",
                   default=str(ROOT / "bench" / "results" / "e2e-goodput.md"))
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
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        p.error(f"unknown configs {bad} (from {', '.join(CONFIGS)})")
    everys = [float(x) for x in args.kill_every.split(",") if x.strip()]
    if any(args.window / k != int(args.window / k) for k in everys):
        p.error("--window must be a multiple of every --kill-every")
    notes = []
    if not stepguard_has_trainer():
        configs = [c for c in configs if CONFIGS[c][0] != "stepguard"]
        notes.append("stepguard's training API (Manager, DDP, Optimizer, ProcessGroupGloo) "
                     "was not available in this build, so the stepguard columns are absent.")
        print("e2e: " + notes[-1], flush=True)
    notes.append("`stepguard` uses ProcessGroupGloo like torchft; `stepguard-tcp` uses "
                 "stepguard's native ProcessGroupTCP; `sg-lighthouse` runs torchft's "
                 "trainer under stepguard's lighthouse; `stepguard-warm` and `stepguard-hot` "
                 "are `stepguard-tcp` with one warm spare (`--spares 1`) and with one hot "
                 "spare (one group more, `FIXED_WITH_SPARES`); `stepguard-warm2` keeps two "
                 "warm spares; `stepguard-warm-flat` is "
                 "`stepguard-warm` with the spare at the trainers' priority (`--spare-nice 0`) "
                 "instead of nice 19 until its takeover.  The ratio column is torchft "
                 "over the first of stepguard-tcp, stepguard, sg-lighthouse present.")
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
    load0 = os.getloadavg()
    duration = args.first_kill + args.window + 3.0
    res: dict[float, dict[str, dict[str, Any]]] = {k: {} for k in everys}
    gres: dict[float, dict[str, dict[str, Any]]] = {k: {} for k in everys}
    for every in everys:
        for c in configs:
            if c == "plain" and every != everys[0]:
                res[every][c], gres[every][c] = res[everys[0]][c], gres[everys[0]][c]
                continue  # no kills: once is enough
            tag = c if c == "plain" else f"{c}-k{every:g}"
            load = out / f"{tag}.load.json"
            if args.reuse and load.exists():  # measure the timeline of an earlier run
                tl = [json.loads(x) for x in (out / f"{tag}.jsonl").read_text().splitlines()]
                la, lb = json.loads(load.read_text())
            else:
                la = os.getloadavg()[0]
                tl = run_config(c, args, out, every=every, duration=duration, tag=tag)
                lb = os.getloadavg()[0]
                load.write_text(json.dumps([la, lb]))
            # plain DDP reports its world size (= groups) as participants
            res[every][c] = m = measure(tl, args.groups, args.warmup)
            gres[every][c] = g = measure_goodput(tl, c, args.groups, every, args.window,
                                                 args.warmup)
            g["load"] = (la, lb)
            m["goodput"] = g["goodput"]
            print(f"e2e: {c}, kill every {every:g} s: kills {m['kills']}, survivors "
                  f"{fmt(med(m['survivors']))}, step {fmt(med(m['step_times']), 'ms')}, "
                  f"rejoin {fmt(med(m['rejoin']))}, goodput "
                  f"{'n/a' if g['goodput'] is None else '%.3f' % g['goodput']}", flush=True)
    load1 = os.getloadavg()
    run_load = out / "run.load.json"  # the whole run's, for --reuse
    if args.reuse and run_load.exists():
        load0, load1 = json.loads(run_load.read_text())
    else:
        run_load.write_text(json.dumps([load0, load1]))
    when = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    setup = (f"{platform.machine()} with {os.cpu_count()} CPUs (shared), Python "
             f"{platform.python_version()}.  {args.groups} replica groups x 1 rank, "
             f"OMP_NUM_THREADS={args.omp_threads}, `kill:every=K,start={args.first_kill:g}s,"
             f"seed={args.seed}` for K in {', '.join('%g s' % k for k in everys)}, each run "
             f"{duration:.0f} s, lighthouse `--quorum_tick_ms 100 --join_timeout_ms 10000`; "
             f"plain DDP: {args.groups} ranks, {args.plain_steps} steps.  Load average "
             f"(1, 5, 15 min) at the start: {load0[0]:.2f}, {load0[1]:.2f}, {load0[2]:.2f}; "
             f"at the end: {load1[0]:.2f}, {load1[1]:.2f}, {load1[2]:.2f} (other jobs share "
             f"the machine).")
    tbls = [f"## Kill every {k:g} s\n\n{table(res[k], args)}" for k in everys]
    text = (f"# End-to-end: small Llama under SIGKILLs\n\n`bench/e2e.py`, {when}, {setup}  "
            f"Medians over the kills / steady-state steps / relaunches.\n\n"
            + "\n\n".join(tbls) + "\n" + "".join(f"\n{n}\n" for n in notes))
    plain_rate = gres[everys[0]].get("plain", {}).get("rate")
    gcols = [c for c in CONFIGS if c in configs]
    gtbl = goodput_table(gres, gcols, plain_rate)
    gtext = (
        f"# End-to-end goodput under SIGKILLs\n\n`bench/e2e.py`, {when}, {setup}\n\n"
        f"Goodput (`stepguard.soak.goodput`) = committed replica-steps / (replicas x "
        f"fault-free step rate x wall time).  Wall time: the same window for every "
        f"configuration, from its first kill to {args.window:g} s later (a whole number of "
        f"kill intervals).  Fault-free rate: the same window's, over the gaps between "
        f"consecutive commits of a full quorum while no process (a relaunch, a warm spare) "
        f"sets up at the trainers' priority (`goodput.window_rate`; a spare set up at a "
        f"lower one takes only the CPU the training leaves: the 'rate while a low-priority "
        f"spare sets up' row checks it); per kill interval, that interval's own.  "
        f"Hot spares: {args.groups} of the {args.groups + 1} groups take part, so at most "
        f"{args.groups} commits count per step.  'Against plain DDP's rate' puts plain "
        f"DDP's rate in the denominator instead (the cost of fault tolerance without "
        f"faults included).  Lost = 1 - goodput, split into the victim's absence (kill -> "
        f"the job's next commit at full strength, one replica), the survivors' stall "
        f"(kill -> their next commit, every survivor) and the rest (slower or discarded "
        f"steps while a replacement sets up, the heal step).\n\n{gtbl}\n"
        + "".join(f"\n{n}\n" for n in notes))
    print()
    print("\n\n".join(tbls))
    print()
    print(gtbl)
    for path, body in ((args.results, text), (args.goodput_results, gtext)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(body)
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
