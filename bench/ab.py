"""Benchmark two builds of stepguard against each other in one run: the
working tree's (new) and a git revision's (old), for a change that must
cost no speed.

A shared machine moves a step time by tens of percent between runs minutes
apart, so two builds measured one after the other say little.  Here the
builds take turns, round by round (which goes first alternates), each round
running one benchmark that also measures a fixed competitor in the same
process: ``bench/manager.py`` (stepguard's manager against torchft's) or
``bench/step.py`` (stepguard's DDP against plain torch DDP).  A build's
figure in a round is its time *divided by the competitor's in that run*,
so the load of the moment cancels; the change's cost is the ratio of the
two builds' figures in the same round, reported as the median over rounds
with the lowest and highest.  Raw medians are printed too.

The old build (and the new one, given ``--new REV``, to compare two
revisions, as a bisection does) is installed (not editable) into a virtual
environment of its own under ``--cache`` (built once per revision), which
reads every other package from this environment's site-packages.  The benchmark script is the
working tree's for both builds.

    .venv/bin/python bench/ab.py --old fc58c18                 # bench/manager.py
    .venv/bin/python bench/ab.py --old fc58c18 --bench step --rounds 4

Results go to ``bench/results/ab-<bench>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sh(*cmd: str, cwd: Path | None = None, env: dict | None = None) -> str:
    return subprocess.run(cmd, cwd=cwd, env=env, check=True, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT).stdout


def build_at(rev: str, cache: Path) -> Path:
    """The python of a virtual environment holding stepguard at `rev`."""
    full = sh("git", "-C", str(ROOT), "rev-parse", "--verify", rev + "^{commit}").strip()
    home = cache / full[:12]
    py = home / "venv" / "bin" / "python"
    if (home / "built").exists():
        return py
    home.mkdir(parents=True, exist_ok=True)
    src = home / "src"
    if not src.exists():
        src.mkdir()
        # the tree at `rev`, without touching this repository's worktrees
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", full],
                                 check=True, stdout=subprocess.PIPE).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    sh(sys.executable, "-m", "venv", str(home / "venv"))
    site = sh(str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    # torch, torchft and the build tools come from this environment; a
    # path line does not run the editable install's hook, so the old
    # build's own package is the one imported
    Path(site, "ab-shared-site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    print(f"building {rev} ({full[:12]}) into {home} ...", flush=True)
    sh(str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(src),
       env=env)
    (home / "built").write_text(full + "\n")
    return py


def where_from(py: Path) -> str:
    code = "import stepguard, os; print(os.path.dirname(stepguard.__file__))"
    return sh(str(py), "-c", code, env={**os.environ, "PYTHONPATH": ""}).strip()


def run_manager(py: Path, a: argparse.Namespace, out: Path) -> dict[str, tuple[float, float]]:
    """shape -> (ours median ms, ours / torchft) for one run."""
    subprocess.run([str(py), str(ROOT / "bench/manager.py"), "--steps", str(a.steps),
                    "--ranks", a.ranks, "--groups", a.groups, "--out", str(out)],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=a.run_timeout)
    rows = json.loads(out.read_text())["rows"]
    return {f"{r['ranks']}x{r['groups']}": (r["ours_median_ms"], r["ratio"]) for r in rows}


def run_step(py: Path, a: argparse.Namespace, out: Path) -> dict[str, tuple[float, float]]:
    """replicas -> (stepguard median ms, stepguard / plain DDP) for one run."""
    subprocess.run([str(py), str(ROOT / "bench/step.py"), "--kinds", "plain,stepguard",
                    "--replicas", a.replicas, "--rounds", "1", "--blocks", str(a.blocks),
                    "--output", str(out)],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=a.run_timeout)
    summary = json.loads(out.read_text())["results"]
    return {f"{n} replicas": (s["kinds"]["stepguard"]["median_ms"],
                              s["ratios"]["stepguard/plain"]["median"])
            for n, s in summary.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="git revision of the old build")
    ap.add_argument("--new", default="", help="git revision of the new build "
                    "(default: this tree's, as installed in this environment)")
    ap.add_argument("--bench", choices=("manager", "step"), default="manager")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "stepguard-ab"))
    ap.add_argument("--steps", type=int, default=300, help="manager: steps per shape")
    ap.add_argument("--ranks", default="1,8", help="manager: group ranks")
    ap.add_argument("--groups", default="2,4", help="manager: replica groups")
    ap.add_argument("--replicas", default="2", help="step: replica counts")
    ap.add_argument("--blocks", type=int, default=6, help="step: blocks per kind and run")
    ap.add_argument("--run-timeout", type=float, default=900.0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    builds = {"old": build_at(a.old, Path(a.cache)),
              "new": build_at(a.new, Path(a.cache)) if a.new else Path(sys.executable)}
    for name, py in builds.items():
        print(f"{name}: stepguard from {where_from(py)}", flush=True)
    run = run_manager if a.bench == "manager" else run_step
    figures: dict[str, dict[str, list[tuple[float, float]]]] = {"old": {}, "new": {}}
    with tempfile.TemporaryDirectory(prefix="sg-ab-") as tmp:
        for rnd in range(a.rounds):
            order = ("old", "new") if rnd % 2 == 0 else ("new", "old")
            for name in order:
                res = run(builds[name], a, Path(tmp) / f"{name}-{rnd}.json")
                for shape, fig in res.items():
                    figures[name].setdefault(shape, []).append(fig)
            line = "  ".join(
                f"{shape} new/old {figures['new'][shape][-1][1] / figures['old'][shape][-1][1]:.3f}"
                for shape in figures["new"])
            print(f"round {rnd + 1}/{a.rounds} ({order[0]} first): {line}", flush=True)

    competitor = "torchft" if a.bench == "manager" else "plain DDP"
    print(f"\nbench/{a.bench}.py, {a.rounds} rounds; a build's figure is its median "
          f"over {competitor}'s in the same run")
    print(f"{'shape':>12} | {'old ms':>8} {'new ms':>8} | {'old/' + competitor:>14} "
          f"{'new/' + competitor:>14} | {'new/old (paired)':>16} {'min':>6} {'max':>6}")
    rows = []
    for shape in figures["new"]:
        old, new = figures["old"][shape], figures["new"][shape]
        paired = [n[1] / o[1] for o, n in zip(old, new)]
        row = {"shape": shape,
               "old_median_ms": statistics.median(o[0] for o in old),
               "new_median_ms": statistics.median(n[0] for n in new),
               "old_over_competitor": statistics.median(o[1] for o in old),
               "new_over_competitor": statistics.median(n[1] for n in new),
               "new_over_old": statistics.median(paired),
               "new_over_old_min": min(paired), "new_over_old_max": max(paired)}
        rows.append(row)
        print(f"{shape:>12} | {row['old_median_ms']:>8.3f} {row['new_median_ms']:>8.3f} | "
              f"{row['old_over_competitor']:>14.3f} {row['new_over_competitor']:>14.3f} | "
              f"{row['new_over_old']:>16.3f} {min(paired):>6.3f} {max(paired):>6.3f}")
    worst = max(r["new_over_old"] for r in rows)
    print(f"\nworst shape: new/old {worst:.3f} (goal: at most 1.10)")
    out = Path(a.out or ROOT / f"bench/results/ab-{a.bench}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"old": a.old, "bench": a.bench, "rounds": a.rounds,
                               "rows": rows, "raw": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
