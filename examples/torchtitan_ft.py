"""torchtitan's fault-tolerance path on CPU, with stepguard as torchft.

    .venv/bin/python examples/torchtitan_ft.py [--mode hsdp|diloco]
        [--nproc N] [--kill-after STEPS] [--steps-after-rejoin STEPS] [--out DIR]

Two replica groups of N ranks (default 2) run torchtitan 0.3.0's own entry
point with ``--fault_tolerance.enable`` (FT-HSDP: FSDP2 inside each group,
stepguard's fault-tolerant allreduce across; or ``--mode diloco``:
torchtitan's semi-sync DiLoCo) on its llama3 debug model, under
stepguard-launch and stepguard's lighthouse, in torchft mode
(``STEPGUARD_TORCHFT=1``: ``import torchft`` is stepguard).  After group 1
has committed ``--kill-after`` steps with group 0, one of its ranks is
SIGKILLed; the launcher restarts the group, which heals from group 0 and
trains on; then both stop at the same step and the script compares their
parameters bit for bit.

torchtitan needs a tokenizer, data and a few CPU patches that its wheel
does not carry: they come from the test harness in ``tests/py/helpers``
(``titan_assets.py``, ``titan_config.py``, ``titan_shim.py``,
``titan_train.py``); docs/torchtitan.md explains each.  ``--out`` (default
``titan-out/``) keeps the logs, the launcher's timeline and the
per-rank parameter digests.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "py" / "helpers"
sys.path.insert(0, str(HELPERS))

import titan_assets  # noqa: E402

from stepguard.launch import FailureSpec, LaunchConfig, Launcher  # noqa: E402

SYNC_STEPS = 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["hsdp", "diloco"], default="hsdp")
    ap.add_argument("--nproc", type=int, default=2, help="ranks per replica group")
    ap.add_argument("--kill-after", type=int, default=5,
                    help="group 1's steps committed with group 0 before the kill")
    ap.add_argument("--steps-after-rejoin", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("titan-out"))
    ap.add_argument("--limit", type=float, default=600.0, help="give up after this many s")
    args = ap.parse_args()

    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    (out / "logs").mkdir(parents=True)
    tok, data = titan_assets.make_assets(out / "assets")
    cmd = [
        sys.executable, str(HELPERS / "titan_train.py"), str(out / "params"),
        "--module", "titan_config", "--config", "llama3_ft_cpu",
        "--hf_assets_path", str(tok), "--dataloader.dataset_path", str(data),
        "--dump_folder", str(out / "dump"),
    ]
    if args.mode == "diloco":
        cmd += ["--fault_tolerance.semi_sync_method", "diloco",
                "--fault_tolerance.sync_steps", str(SYNC_STEPS)]
    cfg = LaunchConfig(
        cmd=cmd, groups=2, nproc_per_group=args.nproc, min_replicas=1,
        join_timeout_ms=2000, omp_threads=1,
        timeline=str(out / "timeline.jsonl"), log_dir=str(out / "logs"),
        stop_file=str(out / "stop_step"),
        env={"STEPGUARD_TORCHFT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True",
             # datasets' cache in the output folder; nothing from the hub
             "HF_HOME": str(out / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    lock = threading.Lock()
    seen: list[dict] = []
    state = {"killed": False, "finished": False, "last_print": 0.0}

    def on_event(rec: dict) -> None:
        with lock:
            seen.append(rec)

    def on_tick(launcher: Launcher) -> None:
        with lock:
            commits = [r for r in seen if r["event"] == "commit" and r.get("rank") == 0]
        together = [r for r in commits if r["group"] == 1 and r["incarnation"] == 0
                    and r.get("participants") == 2]
        rejoined = [r for r in commits if r["group"] == 1 and r["incarnation"] >= 1]
        if launcher.elapsed() > args.limit:
            print(f"giving up after {args.limit:.0f} s")
            launcher.stop()
            return
        if commits and launcher.elapsed() - state["last_print"] >= 5:
            state["last_print"] = launcher.elapsed()
            last = {g: max((r["step"] for r in commits if r["group"] == g), default=0)
                    for g in (0, 1)}
            print(f"[{launcher.elapsed():6.1f}s] step: group 0 at {last[0]}, group 1 at {last[1]}")
        if not state["killed"] and len(together) >= args.kill_after:
            state["killed"] = True
            launcher.inject(FailureSpec(kind="kill", group=1, rank=args.nproc - 1))
        if not state["finished"] and len(rejoined) >= args.steps_after_rejoin:
            state["finished"] = True
            stop = max(r["step"] for r in commits) + 2
            if args.mode == "diloco":
                stop = -(-stop // SYNC_STEPS) * SYNC_STEPS
            launcher.finish(step=stop)

    t0 = time.monotonic()
    rc = Launcher(cfg, on_event=on_event, on_tick=on_tick).run()
    wall = time.monotonic() - t0
    for r in seen:
        if r["event"] == "recovery":
            print(f"recovery ({r['kind']}): group {r['group']} at step {r.get('step')}, "
                  f"{r['duration_s']:.1f} s")
    identical = True
    for rank in range(args.nproc):
        files = [out / "params" / f"params_g{g}_r{rank}.json" for g in (0, 1)]
        if not all(f.exists() for f in files):
            print(f"group rank {rank}: a replica wrote no parameters (see {out / 'logs'})")
            identical = False
            continue
        a, b = (json.loads(f.read_text()) for f in files)
        same = a["params"] == b["params"]
        identical = identical and same
        print(f"group rank {rank}: step {a['step']} / {b['step']}, parameters "
              f"{'identical' if same else 'DIFFER'}")
    print(f"{args.mode}, {args.nproc} rank(s) per group: {wall:.1f} s, launcher exit {rc}, "
          f"replicas identical: {'yes' if identical else 'NO'}")
    return 0 if rc == 0 and identical and state["finished"] else 1


if __name__ == "__main__":
    sys.exit(main())
