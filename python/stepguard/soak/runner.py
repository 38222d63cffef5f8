"""``make soak`` / ``make soak-short``: a long mixed-fault run, then the checker.

Runs ``examples/soak_train.py`` (a small Llama) in replica groups of two
ranks under the launcher, and, after a fault-free window that measures the
step rate, injects the seeded schedule of :mod:`.schedule`; then a quiet
tail, a stop step every group ends at, the checks of :mod:`.checker`, and
the summary.  Everything goes to ``--out`` (``docs/soak.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stepguard.launch import LaunchConfig, Launcher
from stepguard.launch.netns import netns_unavailable
from stepguard.soak import checker, goodput
from stepguard.soak.schedule import KINDS, Pacer, SoakParams, make_schedule

# torchft's trainer has no heal hook (the armed kinds) and does not
# survive a lighthouse restart (its quorum call fails, and it exits)
TORCHFT_KINDS = ("kill_group", "kill_rank", "hang", "partition", "double")

# what --short must reach (its gap gives about 24 entries; some are skipped)
SHORT_MIN_FAULTS = 20

_ROOT = Path(__file__).resolve().parents[3]
_TRAINER = _ROOT / "examples" / "soak_train.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=50.0,
                   help="length of the fault phase (default 50: about 230 faults)")
    p.add_argument("--short", action="store_true",
                   help="the CI size: 4 minutes of faults every ~10 s, under 8 minutes "
                   "in all")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gap", type=float, default=None,
                   help="mean seconds between faults (default 13, short 10)")
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--baseline", type=float, default=None,
                   help="seconds of the fault-free window (default 30, short 20)")
    p.add_argument("--tail", type=float, default=25.0, help="quiet seconds before the stop")
    p.add_argument("--kinds", default=None, help="comma-separated subset of the fault kinds")
    p.add_argument("--out", default="soak-out")
    p.add_argument("--impl", choices=("stepguard", "torchft"), default="stepguard",
                   help="torchft: torchft's trainer (Gloo) and lighthouse, on the kinds "
                   f"torchft survives ({', '.join(TORCHFT_KINDS)})")
    p.add_argument("--compare-with", default=None, metavar="DIR",
                   help="print this run's summary next to the one in DIR")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.short:
        a.minutes = min(a.minutes, 4.0)
    if a.gap is None:
        a.gap = 10.0 if a.short else 13.0
    if a.baseline is None:
        a.baseline = 20.0 if a.short else 30.0
    return a


class _Driver:
    """The launcher's on_tick: waits for every group, measures the
    fault-free window, injects the schedule, then stops at a step."""

    def __init__(self, a: argparse.Namespace, schedule: list[Any], out: Path) -> None:
        self.a = a
        self.schedule = list(schedule)
        self.out = out
        self.phase = "start"
        self.t: dict[str, float] = {}
        self.top = -1
        self.committed: set[int] = set()
        self.lh = open(out / "lighthouse.jsonl", "w")  # noqa: SIM115
        self.next_sample = 0.0
        self.pids: set[int] = set()
        self.entries: list[dict[str, Any]] = []
        self.pacer = Pacer(self.schedule)

    def on_event(self, r: dict[str, Any]) -> None:
        if r["event"] == "commit":
            self.top = max(self.top, r.get("step", -1))
            if r.get("group") is not None:
                self.committed.add(r["group"])
        if r["event"] in ("launch", "restart"):
            self.pids.update(r.get("pids", []))
        if r["event"] == "lighthouse" and r.get("pid"):
            self.pids.add(r["pid"])
        if r["event"] == "inject" and r.get("tag"):
            self.pacer.injected(r["tag"])
        if r["event"] == "inject_skipped" and r.get("tag") and "faults0" in self.t:
            self.pacer.skipped(r["tag"], r["t"] - self.t["faults0"], str(r.get("reason", "")))

    def sample(self, launcher: Launcher) -> None:
        now = time.time()
        if now < self.next_sample:
            return
        self.next_sample = now + 5.0
        for pid in launcher.lighthouse_pids():
            try:
                rss = next(int(line.split()[1]) for line in
                           Path(f"/proc/{pid}/status").read_text().splitlines()
                           if line.startswith("VmRSS:"))
                fds = len(os.listdir(f"/proc/{pid}/fd"))
            except (OSError, StopIteration, ValueError):
                continue
            self.lh.write(json.dumps({"t": now, "pid": pid, "rss_kib": rss, "fds": fds}) + "\n")
            self.lh.flush()

    def on_tick(self, launcher: Launcher) -> None:
        self.sample(launcher)
        now = time.time()
        a = self.a
        if self.phase == "start" and len(self.committed) == a.groups:
            self.phase, self.t["settle"] = "settle", now
        elif self.phase == "settle" and now - self.t["settle"] >= 5.0:
            self.phase, self.t["baseline0"] = "baseline", now
        elif self.phase == "baseline" and now - self.t["baseline0"] >= a.baseline:
            self.phase, self.t["faults0"] = "faults", now
            self.say(f"fault-free window done; {len(self.schedule)} scheduled faults "
                     f"over {a.minutes:g} min")
        elif self.phase == "faults":
            at = now - self.t["faults0"]
            # one entry at a time, when enough groups hold the state, a kind
            # skipped before it was ever injected again (schedule.Pacer)
            nxt = self.pacer.next(at, _holders(launcher))
            if nxt is not None:
                tag, e = nxt
                for i, spec in enumerate(e.specs):
                    spec.tag = tag + (f".{i}" if i else "")
                    launcher.inject(spec)
                self.entries.append({"kind": e.kind, "t": now, "at": e.at, "retry": e.retry})
            if at >= a.minutes * 60.0:
                launcher.stop_injecting()
                self.phase, self.t["tail0"] = "tail", now
                self.say("fault phase done; quiet tail")
        elif self.phase == "tail" and now - self.t["tail0"] >= a.tail and (
                all(g.state == "running" and g.first_commit_seen for g in launcher.groups)
                or now - self.t["tail0"] >= a.tail + (45.0 if a.short else 120.0)):
            # every group back (a group still healing when the others stop
            # could never reach the stop step), or waited long enough
            self.phase, self.t["finish"] = "finishing", now
            launcher.finish(step=self.top + 10)
            self.say(f"stop at step {self.top + 10}")
        elif self.phase == "finishing" and now - self.t["finish"] >= 180.0:
            self.phase = "stopped"
            self.say("the groups did not stop within 180 s: stopping them")
            launcher.stop()

    def say(self, msg: str) -> None:
        print(f"[soak] {msg}", flush=True)


def _holders(launcher: Launcher) -> int:
    """Groups holding the job's state, as the launcher's spare_last_holder
    rule counts them (a group hit in the last second is not one)."""
    now = time.monotonic()
    return sum(1 for g in launcher.groups if g.state == "running" and g.first_commit_seen
               and not g.stopped and not g.hung and now - g.hit_at > 1.0)


def _leftovers(pids: set[int], launcher_pid: int) -> dict[str, list[Any]]:
    """Processes, namespaces and cgroups of this launch still there."""
    left: dict[str, list[Any]] = {"processes": [], "namespaces": [], "cgroups": []}
    for pid in sorted(pids):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left["processes"].append(pid)
    tag = f"sgln{launcher_pid}"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=10).stdout
        left["namespaces"] = [line.split()[0] for line in ns.splitlines()
                              if line.startswith(tag)]
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")):
        d = root / f"stepguard-launch-{launcher_pid}"
        if d.exists():
            left["cgroups"].append(str(d))
    return left


def _fmt(v: list[float]) -> str:
    if not v:
        return "n/a"
    return f"{statistics.median(v):6.1f} s / {max(v):6.1f} s"


def _kind_of(rec: dict[str, Any]) -> str | None:
    tag = rec.get("tag")
    if not tag:
        return None
    base = tag.split("#", 1)[0]
    return f"{base} (its heal trigger)" if tag.endswith(":heal_trigger") else base


def report(out: Path, a: argparse.Namespace, drv: _Driver, h: checker.History,
           vs: list[checker.Violation], rc: int) -> dict[str, Any]:
    tl = h.timeline
    injects = [r for r in tl if r.get("event") == "inject"]
    per_kind = Counter(_kind_of(r) or r["kind"] for r in injects)
    skipped = Counter(_kind_of(r) or r["kind"] for r in tl if r.get("event") == "inject_skipped")
    by_failure = {r["failure"]: (_kind_of(r) or r["kind"]) for r in injects}
    surv: dict[str, list[float]] = defaultdict(list)
    seen: set[int] = set()
    for r in tl:
        if r.get("event") == "recovery" and r.get("kind") == "survivors" \
                and r.get("failure") in by_failure and r["failure"] not in seen:
            seen.add(r["failure"])
            surv[by_failure[r["failure"]]].append(r["duration_s"])
    victim: dict[tuple[int, int], str] = {}
    for r in injects:
        if r.get("group") is not None:
            victim.setdefault((r["group"], r.get("incarnation", -1) + 1), by_failure[r["failure"]])
    rejoin: dict[str, list[float]] = defaultdict(list)
    for r in tl:
        if r.get("event") == "recovery" and r.get("kind") == "rejoin":
            rejoin[victim.get((r["group"], r["incarnation"]), "(after an exit of its own)")].append(
                r["duration_s"])
    t = drv.t
    rate = None
    if "faults0" in t:
        rate = goodput.fault_free_rate(tl, t["baseline0"], t["faults0"], a.groups)
    end = t.get("tail0", t.get("finish"))
    g = None
    n = 0
    if rate and "faults0" in t and end:
        n = goodput.committed_replica_steps(tl, t["faults0"], end)
        g = goodput.goodput(n, a.groups, rate, end - t["faults0"])
    survived = sum(1 for f in by_failure if f in seen)
    wanted = set(a.kinds.split(",") if a.kinds else
                 (TORCHFT_KINDS if a.impl == "torchft" else KINDS))
    missing = sorted(wanted - {k for k in per_kind if not k.endswith("(its heal trigger)")})
    lines = [
        f"soak ({a.impl}): seed {a.seed}, {a.minutes:g} min of faults every ~{a.gap:g} s, "
        f"{a.groups} replica groups x {a.ranks} ranks (schedule: schedule.json; the seed "
        "replays the schedule, not the interleaving)",
        f"faults injected: {len(injects)} ({len(drv.entries)} scheduled entries; "
        f"skipped: {dict(skipped) or 'none'})",
        "",
        f"{'kind':34s} {'faults':>6s}  {'survivors next commit med / max':>31s}  "
        f"{'victim rejoin med / max':>23s}",
    ]
    for k in sorted(set(per_kind) | set(rejoin)):
        lines.append(f"{k:34s} {per_kind.get(k, 0):6d}  {_fmt(surv.get(k, [])):>31s}  "
                     f"{_fmt(rejoin.get(k, [])):>23s}")
    lines += [
        "",
        f"survived: {survived} of {len(injects)} (the others committed again after the fault)",
        "coverage: every kind injected" if not missing
        else f"coverage: NOT injected: {', '.join(missing)}",
        f"fault-free rate: {rate:.2f} steps/s per replica" if rate else "fault-free rate: n/a",
        (f"goodput: {g:.3f} ({n} committed replica-steps / ({a.groups} replicas x "
         f"{rate:.2f} steps/s x {end - t['faults0']:.0f} s))") if g is not None
        else "goodput: n/a",
        f"launcher exit status: {rc}",
        checker.summarize(vs),
    ]
    text = "\n".join(lines)
    (out / "summary.txt").write_text(text + "\n")
    summary = {
        "impl": a.impl, "seed": a.seed, "minutes": a.minutes, "groups": a.groups, "ranks": a.ranks,
        "faults": len(injects), "faults_per_kind": dict(per_kind), "skipped": dict(skipped),
        "survived": survived, "violations": [asdict(v) for v in vs],
        "kinds_not_injected": missing,
        "survivors_s": dict(surv), "rejoin_s": dict(rejoin), "fault_free_rate": rate,
        "goodput": g, "committed_replica_steps": n, "launcher_rc": rc, "phases": t,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(text, flush=True)
    _chart(out, tl, injects, t)
    return summary


def _chart(out: Path, tl: list[dict[str, Any]], injects: list[dict[str, Any]],
           t: dict[str, float]) -> None:
    """Committed step per replica over time, faults marked (chart.png)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    t0 = t.get("baseline0", tl[0]["t"] if tl else 0.0)
    fig, ax = plt.subplots(figsize=(12, 5))
    by: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for r in tl:
        if r.get("event") == "commit" and r.get("rank", 0) == 0 and r.get("group") is not None:
            by[r["group"]].append((r["t"] - t0, r["step"]))
    for gid, pts in sorted(by.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", ms=2, label=f"group {gid}")
    for r in injects:
        ax.axvline(r["t"] - t0, color="red", alpha=0.25, lw=0.8)
    ax.set_xlabel("seconds since the fault-free window began")
    ax.set_ylabel("committed step")
    ax.set_title("soak: committed steps per replica; red lines: injected faults")
    if by:
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "chart.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    why = netns_unavailable()
    if why is not None:
        print(f"soak: partitions need network namespaces, and {why}", file=sys.stderr)
        return 2
    out = Path(a.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    (out / "steps").mkdir(parents=True)
    (out / "hooks").mkdir()
    params = SoakParams()
    kinds = a.kinds.split(",") if a.kinds else None
    if a.impl == "torchft" and kinds is None:
        kinds = list(TORCHFT_KINDS)
    try:
        schedule = make_schedule(a.seed, a.minutes * 60.0, a.gap, params, kinds)
    except ValueError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    (out / "schedule.json").write_text(json.dumps(
        [{"at": e.at, "kind": e.kind, "specs": [vars(s) for s in e.specs]} for e in schedule],
        indent=1) + "\n")
    cmd = [sys.executable, str(_TRAINER), "--log-dir", str(out / "steps"),
           "--timeout", str(params.op_timeout), "--quorum-timeout", "90", "--impl", a.impl]
    cfg = LaunchConfig(
        cmd=cmd, groups=a.groups, nproc_per_group=a.ranks, min_replicas=2,
        heartbeat_timeout_ms=2000, timeline=str(out / "timeline.jsonl"),
        log_dir=str(out / "logs"), stop_file=str(out / "stop"), netns=True,
        quorum_id_file=str(out / "quorum_id") if a.impl == "stepguard" else None,
        hook_dir=str(out / "hooks"), lighthouse_impl=a.impl,
        spare_last_holder=True,
        max_restarts=100000, max_failed_starts=5, omp_threads=1, quiet=a.quiet,
    )
    drv = _Driver(a, schedule, out)
    print(f"[soak] seed {a.seed}: {len(schedule)} scheduled faults over {a.minutes:g} min, "
          f"{a.groups} groups x {a.ranks} ranks; output in {out}", flush=True)
    launcher = Launcher(cfg, on_event=drv.on_event, on_tick=drv.on_tick)
    rc = launcher.run()
    drv.lh.close()
    time.sleep(0.5)
    (out / "leftovers.json").write_text(json.dumps(_leftovers(drv.pids, os.getpid())) + "\n")
    h = checker.load(out)
    vs = checker.check(h, checker.Bounds(min_replicas=2))
    if drv.phase == "stopped":
        vs.append(checker.Violation("run_did_not_end",
                                    "the groups did not reach the stop step within 180 s"))
    summary = report(out, a, drv, h, vs, rc)
    if a.short and summary["kinds_not_injected"]:
        print("soak: the short run must inject every kind at least once", flush=True)
        return 1
    if a.short and summary["faults"] < SHORT_MIN_FAULTS:
        print(f"soak: the short run must inject at least {SHORT_MIN_FAULTS} faults", flush=True)
        return 1
    if a.compare_with:
        other = Path(a.compare_with) / "summary.json"
        if other.exists():
            print(side_by_side(summary, json.loads(other.read_text())), flush=True)
        else:
            print(f"soak: nothing to compare with: no {other}", flush=True)
    return 1 if vs else 0


def side_by_side(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Two summaries (e.g. stepguard's and torchft's on one seed) in columns."""
    na, nb = a.get("impl", "this run"), b.get("impl", "other run")

    def med(v: list[float] | None) -> str:
        return f"{statistics.median(v):.1f} s" if v else "n/a"

    rows = [("faults injected", str(a["faults"]), str(b["faults"])),
            ("survived", str(a["survived"]), str(b["survived"])),
            ("violations", str(len(a["violations"])), str(len(b["violations"]))),
            ("fault-free rate (steps/s)", f"{a['fault_free_rate'] or 0:.2f}",
             f"{b['fault_free_rate'] or 0:.2f}"),
            ("goodput", f"{a['goodput'] or 0:.3f}", f"{b['goodput'] or 0:.3f}")]
    for k in sorted(set(a["survivors_s"]) & set(b["survivors_s"])):
        rows.append((f"{k}: survivors' next commit, median", med(a["survivors_s"][k]),
                     med(b["survivors_s"][k])))
    for k in sorted(set(a["rejoin_s"]) & set(b["rejoin_s"])):
        rows.append((f"{k}: victim rejoin, median", med(a["rejoin_s"][k]),
                     med(b["rejoin_s"][k])))
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':{w}s}  {na:>12s}  {nb:>12s}"]
    lines += [f"{r[0]:{w}s}  {r[1]:>12s}  {r[2]:>12s}" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
