"""The two example scripts in torchft's pattern (examples/torchft_ddp.py,
examples/torchft_diloco.py: torchft's import lines, PGTransport) run in
torchft mode under the launcher; one replica group is SIGKILLed, its
relaunch heals over PGTransport from the survivor, and both replicas end
with bitwise identical parameters."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

from stepguard.launch import FailureSpec, Launcher, LaunchConfig

ROOT = Path(__file__).resolve().parents[2]
HARD_LIMIT_S = 240.0  # the whole job, killed and relaunched, on a loaded machine


def _run(tmp_path: Path, script: str, *args: str) -> tuple[list[dict], Path]:
    save = tmp_path / "params"
    cfg = LaunchConfig(
        cmd=[sys.executable, str(ROOT / "examples" / script), "--steps", "100000", "--save-dir", str(save),
             *args],
        groups=2,
        min_replicas=1,
        join_timeout_ms=2000,
        omp_threads=1,
        timeline=str(tmp_path / "timeline.jsonl"),
        log_dir=str(tmp_path / "logs"),
        stop_file=str(tmp_path / "stop_step"),
        env={"STEPGUARD_TORCHFT": "1", "TORCHFT_QUORUM_TIMEOUT_SEC": "120"},
        quiet=True,
    )
    lock = threading.Lock()
    seen: list[dict] = []
    state = {"killed": False, "finished": False, "hard": False}

    def on_event(rec: dict) -> None:
        with lock:
            seen.append(rec)

    def on_tick(launcher: Launcher) -> None:
        with lock:
            commits = [r for r in seen if r["event"] == "commit"]
            kills = [r for r in seen if r["event"] == "inject"]
            first = [r for r in commits if r["group"] == 1 and r["incarnation"] == 0
                     and r.get("participants") == 2]
            relaunched = [r for r in commits if r["group"] == 1 and r["incarnation"] >= 1]
        if launcher.elapsed() > HARD_LIMIT_S:
            state["hard"] = True
            launcher.stop()
            return
        if not state["killed"] and len(first) >= 5:
            # group 1 has trained in step with group 0 (not alone, before
            # group 0 joined, nor while the two were forming their first
            # quorum): kill it; group 0 goes on alone and the relaunch
            # heals from it
            state["killed"] = True
            launcher.inject(FailureSpec(kind="kill", group=1))
        if not state["finished"] and kills and len(relaunched) >= 3:
            state["finished"] = True
            launcher.finish(step=max(r["step"] for r in commits) + 3)

    launcher = Launcher(cfg, on_event=on_event, on_tick=on_tick)
    launcher.run()
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                     for p in sorted((tmp_path / "logs").glob("*")) if p.is_file())
    assert not state["hard"], f"the job did not finish within {HARD_LIMIT_S}s\n{logs}"
    assert state["finished"], f"the job ended before the relaunch trained\n{logs}"
    return seen, save


def _check(seen: list[dict], save: Path) -> None:
    kills = [r for r in seen if r["event"] == "inject" and r.get("kind") == "kill"]
    assert len(kills) == 1 and kills[0]["group"] == 1 and kills[0]["incarnation"] == 0
    before = [r for r in seen if r["event"] == "commit" and r["group"] == 1
              and r["incarnation"] == 0 and r.get("participants") == 2]
    assert len(before) >= 5
    relaunched = [r for r in seen if r["event"] == "commit" and r["group"] == 1
                  and r["incarnation"] >= 1]
    # the relaunch healed: its first committed step is the survivor's, not 0
    assert relaunched[0]["step"] > 0, relaunched[:3]
    files = sorted(save.glob("params_g*_r0.pt"))
    assert [f.name for f in files] == ["params_g0_r0.pt", "params_g1_r0.pt"]
    a, b = (torch.load(f, weights_only=True) for f in files)
    assert a["step"] == b["step"] > relaunched[0]["step"]
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name


def test_torchft_ddp_example_heals_over_pg_transport(tmp_path):
    seen, save = _run(tmp_path, "torchft_ddp.py")
    _check(seen, save)
    # DDP steps every replica's optimizer the same way: AdamW's state matches too
    a, b = (torch.load(save / f"params_g{g}_r0.pt", weights_only=True) for g in (0, 1))
    for key, st in a["optim"]["state"].items():
        for field, value in st.items():
            assert torch.equal(value, b["optim"]["state"][key][field]), (key, field)


def test_torchft_diloco_example_heals_over_pg_transport(tmp_path):
    seen, save = _run(tmp_path, "torchft_diloco.py", "--sync-every", "2")
    _check(seen, save)
