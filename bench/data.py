"""Benchmark: what a committed data position costs per training step.

Two kinds of data feeding, in the same replica processes (one rank per
replica group, stepguard's Manager and DDP over Gloo, a small MLP on CPU):

- ``plain``: torch's DataLoader over the (torchft-compatible, lossy)
  ``DistributedSampler``, the batch taken before ``zero_grad`` as torchft's
  examples do: the quorum runs during the forward pass;
- ``managed``: ``stepguard.data.ManagedDataLoader``, the batch taken after
  ``zero_grad`` (it waits for the step's quorum to know the split), with
  its per-sample seeding of the random generators and without
  (``-unseeded``), to tell the two costs apart.

Each with ``--workers`` loader worker processes (0: read in the trainer).
The kinds run in turn in blocks of ``--block`` steps, the order rotated
every round, so they see the same machine within a fraction of a second;
replica 0 times every step.  The ratio managed/plain is taken per pair of
blocks of one round and reported as the median with its quartiles.
Results go to ``bench/results/data.json``.

    .venv/bin/python bench/data.py [--replicas 2] [--workers 0 2] [--rounds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def replica(a: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import stepguard as ft
    from stepguard.data import DistributedSampler, ManagedDataLoader

    torch.set_num_threads(1)
    n = 1 << 20  # never the end of an epoch

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int):
            return torch.randn(64), torch.randn(8)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8))
    inner = torch.optim.SGD(model.parameters(), lr=0.001)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = ft.Manager(
        pg=ft.ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=lambda sd: model.load_state_dict(sd),
        state_dict=lambda: model.state_dict(),
        min_replica_size=1, rank=0, world_size=1, store_addr="127.0.0.1",
        store_port=store.port, lighthouse_addr=a.lighthouse,
        replica_id=f"bench_data_{a.replica}", port=0, hostname="127.0.0.1",
        timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=60))
    ddp = ft.DistributedDataParallel(manager, model)
    opt = ft.Optimizer(manager, inner)
    ds = Samples()
    loaders = {}
    for w in a.workers:
        sampler = DistributedSampler(ds, replica_rank=a.replica, num_replica_groups=a.replicas,
                                     group_rank=0, num_replicas=1, shuffle=True)
        loaders[f"plain-w{w}"] = iter(torch.utils.data.DataLoader(
            ds, batch_size=a.batch, sampler=sampler, num_workers=w,
            persistent_workers=w > 0))
        for seeded in (True, False):
            loaders[f"managed-w{w}" + ("" if seeded else "-unseeded")] = ManagedDataLoader(
                manager, ds, a.batch, sampler=DistributedSampler(
                    ds, 0, 1, group_rank=0, num_replicas=1, shuffle=True),
                num_workers=w, seeded=seeded)
    kinds = sorted(loaders)

    def step(kind: str) -> float:
        t = time.perf_counter()
        it = loaders[kind]
        if kind.startswith("plain"):
            x, y = next(it)
            opt.zero_grad()
        else:
            opt.zero_grad()
            x, y = next(it)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        return time.perf_counter() - t

    times: dict[str, list[list[float]]] = {k: [] for k in kinds}
    for k in kinds:  # warm-up (workers start, buckets fixed)
        for _ in range(a.block):
            step(k)
    for r in range(a.rounds):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        for k in order:
            times[k].append([step(k) for _ in range(a.block)])
    if a.replica == 0:
        with open(a.out, "w") as f:
            f.write(json.dumps(times))
    manager.shutdown(wait=False)
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=50)
    # a replica process (internal)
    ap.add_argument("--replica", type=int, default=-1)
    ap.add_argument("--lighthouse", default="")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.replica >= 0:
        return replica(a)

    os.environ.setdefault("STEPGUARD_LOG", "warn")  # the lighthouse's per-quorum lines
    from stepguard.coordination import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=a.replicas, join_timeout_ms=60000)
    procs: list[subprocess.Popen] = []
    try:
        with tempfile.TemporaryDirectory(prefix="sg-data-") as d:
            out = os.path.join(d, "times.json")
            for i in range(a.replicas):
                cmd = [sys.executable, __file__, "--replica", str(i), "--replicas",
                       str(a.replicas), "--lighthouse", lh.address(), "--out", out,
                       "--batch", str(a.batch), "--rounds", str(a.rounds),
                       "--block", str(a.block), "--workers", *map(str, a.workers)]
                procs.append(subprocess.Popen(cmd))
            for p in procs:
                if p.wait(timeout=1200) != 0:
                    raise RuntimeError(f"a replica failed: {p.returncode}")
            with open(out) as f:
                times = json.load(f)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lh.shutdown()
    result = {"replicas": a.replicas, "batch": a.batch, "rounds": a.rounds, "block": a.block,
              "host": platform.node(), "cpus": os.cpu_count(), "kinds": {}, "ratios": {}}
    print(f"{a.replicas} replicas, batch {a.batch}, {a.rounds} rounds of {a.block} steps; "
          "step time of replica 0 (ms): q1 / median / q3")
    for k, blocks in sorted(times.items()):
        flat = [t * 1e3 for b in blocks for t in b]
        q = quartiles(flat)
        result["kinds"][k] = {"q1_ms": q[0], "median_ms": q[1], "q3_ms": q[2]}
        print(f"  {k:12s} {q[0]:7.3f} / {q[1]:7.3f} / {q[2]:7.3f}")
    for w in a.workers:
        for name in (f"managed-w{w}", f"managed-w{w}-unseeded"):
            m, p = times[name], times[f"plain-w{w}"]
            ratios = [statistics.median(x) / statistics.median(y) for x, y in zip(m, p)]
            q = quartiles(ratios)
            result["ratios"][f"{name}/plain-w{w}"] = {"q1": q[0], "median": q[1], "q3": q[2],
                                                     "per_round": ratios}
            print(f"  {name}/plain-w{w}: {q[1]:.3f} ({q[0]:.3f}-{q[2]:.3f}) "
                  f"over {len(ratios)} rounds")
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    with open(ROOT / "bench" / "results" / "data.json", "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
