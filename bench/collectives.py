"""Allreduce latency and bandwidth: ProcessGroupTCP against torch's Gloo.

Both groups run in the same rank processes, on the same buffers, one after
the other for every size, so the machine's load hits both alike.  For each
world size (default 2 and 3) and message size (4 KiB .. 64 MiB of float32)
it reports the median time per allreduce, the algorithm bandwidth
(bytes / time), the bus bandwidth (x 2(n-1)/n, what a ring moves per link),
and the ratio Gloo / ours (> 1: ours is faster), both as a ratio of medians and as the median of
per-iteration ratios (ours and Gloo alternate every iteration, so each pair
sees the same machine load).  It also measures the raw
loopback TCP limit (one stream, large writes) as the ceiling.

    python bench/collectives.py [--worlds 2 3] [--max-mib 64] [--quick]

Results go to bench/results/collectives.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "collectives.json"


def _iters(nbytes: int, quick: bool) -> int:
    base = 200 if nbytes <= 64 << 10 else 40 if nbytes <= 1 << 20 else 10 if nbytes <= 16 << 20 else 5
    return max(3, base // 4) if quick else base


def worker(port: int, rank: int, world: int, sizes: list[int], quick: bool, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import AllreduceOptions, PrefixStore, ReduceOp, TCPStore

    from stepguard.process_group import ProcessGroupTCP

    timeout = timedelta(seconds=120)
    ours = ProcessGroupTCP(timeout=timeout)
    ours.configure(f"127.0.0.1:{port}/bench", "bench", rank, world, quorum_id=1)
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timeout)
    gloo = dist.ProcessGroupGloo(PrefixStore("gloo", store), rank, world, timeout)

    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM

    def run(pg, t: torch.Tensor, n: int) -> list[float]:
        times = []
        for _ in range(n):
            pg.barrier().wait()
            t0 = time.perf_counter()
            pg.allreduce([t], opts).wait()
            times.append(time.perf_counter() - t0)
        return times

    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        n = _iters(nbytes, quick)
        run(ours, t, 2)  # warm up both
        run(gloo, t, 2)
        # alternate every iteration: each pair of samples sees the same load
        t_ours, t_gloo = [], []
        for _ in range(n):
            t_ours += run(ours, t, 1)
            t_gloo += run(gloo, t, 1)
        rows.append({"bytes": nbytes, "ours_s": t_ours, "gloo_s": t_gloo})
    ours.shutdown()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def raw_tcp_gbps(total: int = 1 << 30, chunk: int = 1 << 20) -> float:
    """One loopback TCP stream with large writes: the ceiling for a ring
    step.  Returns GB/s (1e9 bytes/s)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    got = [0]

    def sink() -> None:
        conn, _ = srv.accept()
        buf = bytearray(chunk)
        view = memoryview(buf)
        while True:
            n = conn.recv_into(view)
            if n == 0:
                break
            got[0] += n
        conn.close()

    th = threading.Thread(target=sink)
    th.start()
    c = socket.create_connection(("127.0.0.1", port))
    data = b"\0" * chunk
    t0 = time.perf_counter()
    sent = 0
    while sent < total:
        c.sendall(data)
        sent += chunk
    c.close()
    th.join()
    dt = time.perf_counter() - t0
    srv.close()
    return got[0] / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = []
    s = 4 << 10
    while s <= args.max_mib << 20:
        sizes.append(s)
        s *= 4
    if args.worker:
        port, rank, world, quick, out = args.worker
        worker(int(port), int(rank), int(world), sizes, quick == "1", out)
        return

    from torch.distributed import TCPStore

    raw = statistics.median(raw_tcp_gbps() for _ in range(3))
    print(f"raw loopback TCP, one stream: {raw:.2f} GB/s")
    report = {"raw_tcp_GBps": raw, "sizes": sizes, "worlds": {}}
    for world in args.worlds:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        out = f"/tmp/stepguard-bench-{os.getpid()}-{world}.json"
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--max-mib", str(args.max_mib), "--worker",
                 str(store.port), str(r), str(world), "1" if args.quick else "0", out]
            )
            for r in range(world)
        ]
        try:
            for p in procs:
                p.wait(timeout=1800)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise SystemExit(f"a rank failed at world {world}")
        rows = json.loads(Path(out).read_text())
        os.unlink(out)
        print(f"\nworld {world}: median per allreduce, float32 SUM")
        print(f"{'bytes':>10} {'ours us':>10} {'gloo us':>10} {'gloo/ours':>9} {'paired':>7} "
              f"{'ours busbw GB/s':>16} {'gloo busbw GB/s':>16}")
        table = []
        for row in rows:
            mo, mg = statistics.median(row["ours_s"]), statistics.median(row["gloo_s"])
            paired = statistics.median(g / o for o, g in zip(row["ours_s"], row["gloo_s"]))
            factor = 2 * (world - 1) / world
            bo, bg = row["bytes"] / mo * factor / 1e9, row["bytes"] / mg * factor / 1e9
            print(f"{row['bytes']:>10} {mo * 1e6:>10.1f} {mg * 1e6:>10.1f} {mg / mo:>9.2f} {paired:>7.2f} "
                  f"{bo:>16.3f} {bg:>16.3f}")
            table.append({"bytes": row["bytes"], "ours_median_s": mo, "gloo_median_s": mg,
                          "ratio_gloo_over_ours": mg / mo,
                          "median_paired_ratio": paired, "ours_busbw_GBps": bo,
                          "gloo_busbw_GBps": bg, "iterations": len(row["ours_s"])})
        report["worlds"][str(world)] = table
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
