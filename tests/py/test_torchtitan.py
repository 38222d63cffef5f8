"""torchtitan 0.3.0's fault-tolerance path, on CPU, against stepguard.

Two replica groups run torchtitan's own entry point (``torchtitan.train``)
with ``--fault_tolerance.enable`` and its llama3 debug model, in torchft
mode (the name ``torchft`` is stepguard), under stepguard's launcher and
lighthouse; the harness (tests/py/helpers/titan_*.py, docs/torchtitan.md)
makes torchtitan's tokenizer and data and the few CPU patches it needs.
Once group 1 has trained in step with group 0, one of its ranks is
SIGKILLed; the launcher ends and restarts the group, which heals from
group 0 (its step jumps to group 0's) and trains on with it.  Then both
stop at the same step and every group rank's shard of every parameter (and,
in FT-HSDP, optimizer state) must be bit-identical across the groups.

``make test`` runs two combinations (FT-HSDP with 2 ranks per group, DiLoCo
with 1); the other two are marked ``long`` (``make test-long``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (scripts/bootstrap installs it)")

from stepguard.launch import FailureSpec, LaunchConfig, Launcher  # noqa: E402

HELPERS = Path(__file__).resolve().parent / "helpers"
sys.path.insert(0, str(HELPERS))
import titan_assets  # noqa: E402

HARD_LIMIT_S = 300.0  # the whole job, killed and relaunched, on a loaded 2-core machine
SYNC_STEPS = 4  # titan_config's DiLoCo sync interval


def _run(tmp_path: Path, *, nproc: int, mode: str, kill_rank: int) -> tuple[list[dict], Path, float]:
    tok, data = titan_assets.make_assets(tmp_path / "assets")
    params = tmp_path / "params"
    cmd = [
        sys.executable, str(HELPERS / "titan_train.py"), str(params),
        "--module", "titan_config", "--config", "llama3_ft_cpu",
        "--hf_assets_path", str(tok),
        "--dataloader.dataset_path", str(data),
        "--dump_folder", str(tmp_path / "dump"),
    ]
    if mode == "diloco":
        cmd += ["--fault_tolerance.semi_sync_method", "diloco",
                "--fault_tolerance.sync_steps", str(SYNC_STEPS)]
    cfg = LaunchConfig(
        cmd=cmd,
        groups=2,
        nproc_per_group=nproc,
        min_replicas=1,
        join_timeout_ms=2000,
        omp_threads=1,
        timeline=str(tmp_path / "timeline.jsonl"),
        log_dir=str(tmp_path / "logs"),
        stop_file=str(tmp_path / "stop_step"),
        env={
            "STEPGUARD_TORCHFT": "1",
            # torch's env:// rendezvous joins the TCPStore the launcher hosts
            # for each group, as under torchrun
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHFT_QUORUM_TIMEOUT_SEC": "120",
            # datasets' cache in the run's folder; nothing from the hub
            "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        },
        quiet=True,
    )
    (tmp_path / "logs").mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    seen: list[dict] = []
    state = {"killed": False, "finished": False, "hard": False}

    def on_event(rec: dict) -> None:
        with lock:
            seen.append(rec)

    def on_tick(launcher: Launcher) -> None:
        with lock:
            commits = [r for r in seen if r["event"] == "commit" and r.get("rank") == 0]
            together = [r for r in commits if r["group"] == 1 and r["incarnation"] == 0
                        and r.get("participants") == 2]
            relaunched = [r for r in commits if r["group"] == 1 and r["incarnation"] >= 1]
        if launcher.elapsed() > HARD_LIMIT_S:
            state["hard"] = True
            launcher.stop()
            return
        if not state["killed"] and len(together) >= 3:
            state["killed"] = True
            launcher.inject(FailureSpec(kind="kill", group=1, rank=kill_rank))
        if not state["finished"] and state["killed"] and len(relaunched) >= 2:
            state["finished"] = True
            stop = max(r["step"] for r in commits) + 2
            if mode == "diloco":  # end on a sync, where the replicas agree
                stop = -(-stop // SYNC_STEPS) * SYNC_STEPS
            launcher.finish(step=stop)

    t0 = time.monotonic()
    launcher = Launcher(cfg, on_event=on_event, on_tick=on_tick)
    rc = launcher.run()
    wall = time.monotonic() - t0
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                     for p in sorted((tmp_path / "logs").glob("*.log")))
    assert not state["hard"], f"the job did not finish within {HARD_LIMIT_S}s\n{logs}"
    assert state["finished"], f"the job ended before the relaunch trained\n{logs}"
    assert rc == 0, f"launcher exit status {rc}\n{logs}"
    return seen, params, wall


def _check(seen: list[dict], params: Path, *, nproc: int, mode: str, kill_rank: int,
           wall: float) -> None:
    kills = [r for r in seen if r["event"] == "inject" and r.get("kind") == "kill"]
    assert len(kills) == 1 and kills[0]["group"] == 1 and kills[0]["rank"] == kill_rank
    assert kills[0]["incarnation"] == 0
    commits = [r for r in seen if r["event"] == "commit" and r.get("rank") == 0]
    before = [r for r in commits if r["group"] == 1 and r["incarnation"] == 0]
    assert len([r for r in before if r.get("participants") == 2]) >= 3
    relaunched = [r for r in commits if r["group"] == 1 and r["incarnation"] >= 1]
    assert relaunched, "the relaunched group never committed"
    first = relaunched[0]
    # group 0 trained on alone while group 1 was down ...
    alone = [r for r in commits if r["group"] == 0 and kills[0]["t"] < r["t"] < first["t"]]
    assert alone, "group 0 committed nothing between the kill and the rejoin"
    # ... and the relaunch healed: its first committed step is group 0's, far
    # past where a fresh start would be (step 1), past where it was killed
    assert first["step"] > before[-1]["step"], (first, before[-1])
    assert first["step"] >= max(r["step"] for r in alone), (first, alone[-1])
    rejoin = [r for r in seen if r["event"] == "recovery" and r.get("kind") == "rejoin"]
    assert len(rejoin) == 1 and rejoin[0]["group"] == 1

    stop = max(r["step"] for r in commits)
    for rank in range(nproc):
        a, b = (json.loads((params / f"params_g{g}_r{rank}.json").read_text()) for g in (0, 1))
        assert a["step"] == b["step"] == stop, (rank, a["step"], b["step"], stop)
        assert a["manager_step"] == b["manager_step"] > 0
        assert a["params"].keys() == b["params"].keys() and len(a["params"]) > 0
        differ = [n for n in a["params"] if a["params"][n] != b["params"][n]]
        assert not differ, f"group rank {rank}: parameters differ: {differ[:5]}"
        # healed optimizer state lives on the healer's own mesh (torchtitan
        # keeps the received DTensors as its optimizer state)
        for g, rec in enumerate((a, b)):
            assert not rec["optim_foreign_mesh"], (g, rank, rec["optim_foreign_mesh"][:3])
        if mode == "hsdp":
            # every step's update is the same averaged gradient: AdamW's
            # state and the learning rate match too (DiLoCo's inner
            # optimizers see their own data and keep their own state)
            assert a["lr"] == b["lr"]
            assert a["optim"].keys() == b["optim"].keys() and len(a["optim"]) > 0
            differ = [n for n in a["optim"] if a["optim"][n] != b["optim"][n]]
            assert not differ, f"group rank {rank}: optimizer state differs: {differ[:5]}"
    print(f"\ntorchtitan {mode}, {nproc} rank(s)/group: {wall:.1f} s, kill at group 1's "
          f"step {before[-1]['step']}, relaunch's first commit at step {first['step']} "
          f"({rejoin[0]['duration_s']:.1f} s after the restart, "
          f"{rejoin[0].get('join_s', float('nan')):.1f} s after it was ready), stop at {stop}")


@pytest.mark.parametrize(
    "mode,nproc,kill_rank",
    [
        ("hsdp", 2, 1),
        ("diloco", 1, 0),
        pytest.param("hsdp", 1, 0, marks=pytest.mark.long),
        pytest.param("diloco", 2, 1, marks=pytest.mark.long),
    ],
    ids=["ft_hsdp-2ranks", "diloco-1rank", "ft_hsdp-1rank", "diloco-2ranks"],
)
def test_torchtitan_group_killed_heals(tmp_path, mode, nproc, kill_rank):
    seen, params, wall = _run(tmp_path, nproc=nproc, mode=mode, kill_rank=kill_rank)
    _check(seen, params, nproc=nproc, mode=mode, kill_rank=kill_rank, wall=wall)


_FLEX_CHECK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import titan_shim
titan_shim.install()
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
from torchtitan.models.common.attention import FlexAttention

g = torch.Generator().manual_seed(0)
B, N, L, H = 2, 4, 48, 16
q, k, v = (torch.randn(B, N, L, H, generator=g) for _ in range(3))
doc = torch.randint(0, 3, (B, L), generator=g).sort(dim=1).values

def mask_mod(b, h, qi, ki):  # block-causal over documents, as torchtitan's
    return (ki <= qi) & (doc[b, qi] == doc[b, ki])

bm = create_block_mask(mask_mod, B, None, L, L, device="cpu")
ref, ref_aux = flex_attention(q, k, v, block_mask=bm, return_aux=AuxRequest(lse=True))
kw = dict(score_mod=None, block_mask=bm, scale=None, enable_gqa=False, kernel_options={})
out, aux = FlexAttention._compiled_flex_attn(q, k, v, return_aux=AuxRequest(lse=True), **kw)
qg = q.clone().requires_grad_(True)
FlexAttention._compiled_flex_attn(qg, k, v, return_aux=AuxRequest(), **kw)[0].sum().backward()
print((out - ref).abs().max().item(), (aux.lse - ref_aux.lse).abs().max().item(),
      bool(torch.isfinite(qg.grad).all()))
"""


def test_shim_flex_attention_is_torchs_on_cpu():
    """The shim's stand-in for FlexAttention computes what torch's
    flex_attention computes (its forward runs on CPU without gradients),
    and has a backward.  In a child: the shim patches torchtitan modules."""
    r = subprocess.run([sys.executable, "-c", _FLEX_CHECK, str(HELPERS)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out_diff, lse_diff, grad_ok = r.stdout.split()
    assert float(out_diff) <= 1e-5 and float(lse_diff) <= 1e-5, r.stdout
    assert grad_ok == "True"
