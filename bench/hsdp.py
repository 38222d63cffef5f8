"""FT-HSDP benchmark: stepguard against torchft and plain torch HSDP, same run.

Two replica groups of two ranks each, FSDP2 ``fully_shard`` inside every
group over Gloo on CPU (``tests/py/helpers/hsdp_worker.py``, the trainer the
FT-HSDP tests run, with the same model, batch and seed everywhere):

(a) steady-state step time: stepguard (its lighthouse, the Manager across
    groups), torchft (its lighthouse and Manager, torchft's wiring:
    ``ManagedProcessGroup(...).register`` and ``set_all_reduce_hook``), and
    plain torch HSDP (``fully_shard`` on a 2 x 2 mesh, replicate x shard,
    one Gloo world of four ranks, no fault tolerance);
(b) the cost of a kill, for stepguard and torchft: SIGKILL of one group ->
    the survivors' next committed step, and the replacement's start -> its
    first committed step (it heals its shards from the survivor).

torchft reads the survivor's state on its quorum thread; with FSDP2 that can
crash the survivor when the heal overlaps its forward pass ("mixed
torch.Tensor and DTensor"). A survivor that dies is a result of the run,
counted as such (heals that worked, of kills tried); the bench restarts it
and goes on.

    .venv/bin/python bench/hsdp.py [--kills 3] [--width 256] [--layers 4]

Medians go to stdout and ``bench/results/hsdp.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "py" / "helpers"
sys.path.insert(0, str(HELPERS))

from train_harness import Job, Zygote, _kill  # noqa: E402


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---- plain torch HSDP ------------------------------------------------------


def _plain_rank(rank: int, world: int, port: int, a: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hsdp_worker import Model

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = Model.build(torch, a.width, a.layers)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    times = []
    for step in range(a.warmup + a.steps):
        gen = torch.Generator().manual_seed(rank * 100003 + step)
        x = torch.randn(a.batch, 8, generator=gen)
        y = torch.randn(a.batch, 4, generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        dist.barrier()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text("\n".join(f"{t:.6f}" for t in times))
    dist.destroy_process_group()


def plain_hsdp(a: argparse.Namespace) -> list[float]:
    import torch.multiprocessing as mp
    from lighthouse_util import free_port

    out = tempfile.mktemp(prefix="hsdp-plain-")
    mp.start_processes(_plain_rank, args=(4, free_port(), a, out), nprocs=4,
                       start_method="spawn", join=True)
    times = [float(x) for x in Path(out).read_text().split()]
    os.unlink(out)
    return times


# ---- fault-tolerant runs ---------------------------------------------------


def step_times(job: Job, rid: str, lo: int, hi: int) -> list[float]:
    """Intervals between consecutive commits of group rank 0 of ``rid``
    between steps lo and hi (one incarnation, all participants present)."""
    evs = [e for e in job.steps(rid, g=0, inc=job.groups[rid].incarnation)
           if e["ok"] and lo <= e["step"] <= hi]
    return [b["t"] - a["t"] for a, b in zip(evs, evs[1:]) if b["step"] == a["step"] + 1]


def wait(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def ft_run(impl: str, a: argparse.Namespace, tmp: Path) -> dict:
    zyg = Zygote(impl)
    job = Job(tmp / impl, zygote=zyg, impl=impl, worker="hsdp_worker",
              lighthouse="ours" if impl == "stepguard" else "torchft",
              heartbeat_timeout_ms=2000, join_timeout_ms=1000)
    args = ("--steps", "1000000", "--width", str(a.width), "--layers", str(a.layers),
            "--batch", str(a.batch), "--no-hash", "--timeout", "20")
    res: dict = {"impl": impl, "steps": [], "survivor": [], "replacement": [],
                 "after_ready": [], "heals": 0, "kills": 0, "survivor_crashes": 0}
    try:
        for rid in ("hsdp_0", "hsdp_1"):
            job.start_group(rid, 2, *args)
        if not wait(lambda: job.all_committed(a.warmup + a.steps), 300):
            raise RuntimeError(f"{impl}: no steady state\n{job.summary()}")
        res["steps"] = step_times(job, "hsdp_0", a.warmup, a.warmup + a.steps)
        for _ in range(a.kills):
            res["kills"] += 1
            t_kill = time.time()
            job.kill_group("hsdp_1")
            ok = wait(lambda: any(e["ok"] and e["t"] > t_kill for e in job.steps(
                "hsdp_0", g=0, inc=job.groups["hsdp_0"].incarnation)), 120)
            if ok:
                res["survivor"].append(min(
                    e["t"] for e in job.steps("hsdp_0", g=0, inc=job.groups["hsdp_0"].incarnation)
                    if e["ok"] and e["t"] > t_kill) - t_kill)
            t_start = time.time()
            job.restart_group("hsdp_1")
            inc = job.groups["hsdp_1"].incarnation

            def first_commit() -> float | None:
                ts = [min((e["t"] for e in job.steps("hsdp_1", g=r, inc=inc) if e["ok"]),
                          default=None) for r in range(2)]
                return None if None in ts else max(ts)

            healed = wait(lambda: first_commit() is not None
                          or not job.alive("hsdp_0"), 120)
            if not job.alive("hsdp_0"):
                # the survivor died while the replacement healed from it
                res["survivor_crashes"] += 1
                job.kill_group("hsdp_0")
                job.kill_group("hsdp_1")
                job.restart_group("hsdp_0")
                job.restart_group("hsdp_1")
                wait(lambda: job.all_committed(3), 300)
                continue
            if healed:
                res["heals"] += 1
                t1 = first_commit()
                assert t1 is not None
                res["replacement"].append(t1 - t_start)
                ready = max(e["t"] for e in job.events("hsdp_1", inc=inc, ev="ready"))
                res["after_ready"].append(t1 - ready)
            top = max(job.committed("hsdp_0", r) for r in range(2))
            wait(lambda: job.all_committed(top + 3), 120)
    finally:
        job.close()
        zyg.close()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--configs", default="plain,stepguard,torchft")
    a = ap.parse_args()
    configs = a.configs.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="bench-hsdp-"))
    results: dict[str, dict] = {}
    if "plain" in configs:
        results["plain"] = {"steps": plain_hsdp(a)}
    for impl in ("stepguard", "torchft"):
        if impl in configs:
            results[impl] = ft_run(impl, a, tmp)

    plain = median(results.get("plain", {}).get("steps", []))
    lines = [
        f"# bench/hsdp.py ({platform.node()}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"2 groups x 2 ranks, FSDP2 over Gloo (CPU), MLP width {a.width}, "
        f"{a.layers} hidden layers, batch {a.batch}; medians.",
        "",
        "| config | step (ms) | vs plain HSDP | kill -> survivors' next commit (s) "
        "| replacement start -> first commit (s) | after its ready (s) | heals / kills "
        "| survivor crashes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        step = median(r["steps"]) * 1e3
        row = [name, f"{step:.1f}", f"{step / (plain * 1e3):.2f}x" if plain == plain else "-"]
        if name == "plain":
            row += ["-", "-", "-", "-", "-"]
        else:
            row += [f"{median(r['survivor']):.2f}", f"{median(r['replacement']):.2f}",
                    f"{median(r['after_ready']):.2f}", f"{r['heals']} / {r['kills']}",
                    str(r["survivor_crashes"])]
        lines.append("| " + " | ".join(row) + " |")
    if "stepguard" in results and "torchft" in results:
        s, t = results["stepguard"], results["torchft"]
        lines += ["", "torchft / stepguard: step "
                  f"{median(t['steps']) / median(s['steps']):.2f}x, survivors' next commit "
                  f"{median(t['survivor']) / median(s['survivor']):.2f}x, replacement's first "
                  f"commit {median(t['replacement']) / median(s['replacement']):.2f}x"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "hsdp.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
