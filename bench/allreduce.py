"""Allreduce: ProcessGroupTCP (same-host path and plain TCP) against Gloo.

Three groups live in the same rank processes and take turns on the same
buffer for every size, so the machine's load hits them alike:

- ``ours``: ProcessGroupTCP as configured by default.  Between processes of
  one host, large transfers go by the same-host path (descriptors over TCP,
  payload copied once with process_vm_readv).
- ``ours-tcp``: ProcessGroupTCP built with ``STEPGUARD_SAME_HOST=0``: every
  byte over loopback TCP.  Its ranks advertise ``--tcp-host`` (default
  127.0.0.2) and dial from 127.0.0.1, so the two ends of each connection
  have different addresses, as between hosts: the library gives a
  connection whose ends share an address (two processes of one host) a
  small send buffer, which over loopback is much faster but is not what
  ranks on different hosts get.  ``--tcp-host 127.0.0.1`` measures that
  same-host TCP fallback instead (where process_vm_readv is not allowed).
- ``gloo``: torch's ProcessGroupGloo, its default algorithm.

For 2 and 4 ranks, 4 KiB .. 256 MiB, float32 and bfloat16 (SUM), it
prints the median latency, the algorithm, the bus bandwidth (NCCL's
definition: bytes / time * 2(n-1)/n, what each ring link carries), and the
ratio Gloo / ours (> 1: ours is faster), both as a ratio of medians and as
the median of per-iteration ratios, and the ratio of CPU time per operation
(rank 0's process, all threads), which other load on the machine disturbs
less than wall time.

The ceiling is measured with the same processes-and-sockets pattern a ring
uses: n processes each streaming to their successor at once over loopback
TCP (the real limit of a TCP ring on this machine, where the streams share
the cores), and one stream alone.

    python bench/allreduce.py [--worlds 2 4] [--max-mib 256] [--quick]

Results: bench/results/allreduce.json and bench/results/allreduce.md.
This is a benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "allreduce.json"
TABLE = HERE / "results" / "allreduce.md"
GROUPS = ("ours", "ours-tcp", "gloo")
SMALL_MAX = 64 << 10  # ProcessGroupTCP's latency algorithm up to this size
PAIR_SMALL_MAX = 1 << 20  # the same for two ranks


def _iters(nbytes: int, quick: bool) -> int:
    if nbytes <= 64 << 10:
        n = 40
    elif nbytes <= 1 << 20:
        n = 20
    elif nbytes <= 16 << 20:
        n = 8
    elif nbytes <= 64 << 20:
        n = 4
    else:
        n = 3
    return max(2, n // 4) if quick else n


def _algorithm(group: str, nbytes: int, esize: int, world: int) -> str:
    if group == "gloo":
        return "gloo default"
    if nbytes <= (PAIR_SMALL_MAX if world == 2 else SMALL_MAX) or nbytes // esize < world:
        return "recursive doubling"
    return "ring, same-host" if group == "ours" else "ring, TCP"


# ---- rank processes ----------------------------------------------------------


def worker(port: int, rank: int, world: int, sizes: list[int], dtypes: list[str],
           quick: bool, out: str, tcp_host: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import AllreduceOptions, PrefixStore, ReduceOp, TCPStore

    from stepguard.process_group import ProcessGroupTCP

    timeout = timedelta(seconds=300)
    ours = ProcessGroupTCP(timeout=timeout)
    ours.configure(f"127.0.0.1:{port}/sh", "bench", rank, world, quorum_id=1)
    os.environ["STEPGUARD_SAME_HOST"] = "0"  # read when the group connects
    os.environ["STEPGUARD_COMM_HOST"] = tcp_host
    try:
        ours_tcp = ProcessGroupTCP(timeout=timeout)
        ours_tcp.configure(f"127.0.0.1:{port}/tcp", "bench", rank, world, quorum_id=1)
    finally:
        del os.environ["STEPGUARD_SAME_HOST"]
        del os.environ["STEPGUARD_COMM_HOST"]
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                     timeout=timeout)
    gloo = dist.ProcessGroupGloo(PrefixStore("gloo", store), rank, world, timeout)
    groups = {"ours": ours, "ours-tcp": ours_tcp, "gloo": gloo}
    prev = (rank - 1) % world
    paths = {
        "ours": "same-host" if ours.uses_same_host(prev) else "TCP",
        "ours-tcp": "same-host" if ours_tcp.uses_same_host(prev) else "TCP",
    }

    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM

    def once(pg, t: torch.Tensor) -> tuple[float, float]:
        """Wall time and this process's CPU time (every thread) of one op."""
        pg.barrier().wait()
        c0, t0 = time.process_time(), time.perf_counter()
        pg.allreduce([t], opts).wait()
        return time.perf_counter() - t0, time.process_time() - c0

    rows = []
    for dname in dtypes:
        dtype = getattr(torch, dname)
        esize = torch.tensor([], dtype=dtype).element_size()
        for nbytes in sizes:
            t = torch.zeros(nbytes // esize, dtype=dtype)  # zeros stay zeros
            for pg in groups.values():  # warm up
                once(pg, t)
            times: dict[str, list[float]] = {g: [] for g in GROUPS}
            cpu: dict[str, list[float]] = {g: [] for g in GROUPS}
            for _ in range(_iters(nbytes, quick)):
                for g in GROUPS:  # interleaved: each round sees the same load
                    wall, used = once(groups[g], t)
                    times[g].append(wall)
                    cpu[g].append(used)
            rows.append({"dtype": dname, "bytes": nbytes, "esize": esize, "times": times,
                         "cpu": cpu})
            del t
    ours.shutdown()
    ours_tcp.shutdown()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"paths": paths, "rows": rows}, f)


# ---- the loopback TCP ceiling ---------------------------------------------------


def _stream_proc(i: int, n: int, ring: bool, listeners: list, total: int, chunk: int,
                 barrier, results) -> None:
    """Process i of n: send `total` bytes to i+1 (ring: every process; else
    only process 0) while receiving from i-1."""
    send_to = (i + 1) % n if (ring or i == 0) else None
    recv_from = (i - 1) % n if (ring or i == 1) else None
    out_sock = in_sock = None
    if send_to is not None:
        out_sock = socket.create_connection(listeners[send_to].getsockname())
    if recv_from is not None:
        in_sock, _ = listeners[i].accept()
    barrier.wait()
    t0 = time.perf_counter()

    def send() -> None:
        data = memoryview(bytearray(chunk))
        sent = 0
        while sent < total:
            out_sock.sendall(data)
            sent += chunk

    th = None
    if out_sock is not None:
        th = threading.Thread(target=send)
        th.start()
    if in_sock is not None:
        buf = memoryview(bytearray(chunk))
        got = 0
        while got < total:
            m = in_sock.recv_into(buf)
            if m == 0:
                break
            got += m
    if th is not None:
        th.join()
    results[i] = time.perf_counter() - t0
    for s in (out_sock, in_sock):
        if s is not None:
            s.close()


def tcp_streams(n: int, ring: bool, total: int = 512 << 20, chunk: int = 1 << 20) -> float:
    """GB/s per stream (1e9 bytes/s) when `n` processes each stream `total`
    bytes to their successor at once (ring), or one process streams to
    another (not ring).  The slowest process sets the rate, as in a ring."""
    ctx = mp.get_context("fork")
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    barrier = ctx.Barrier(n)
    results = ctx.Array("d", n)
    procs = [ctx.Process(target=_stream_proc,
                         args=(i, n, ring, listeners, total, chunk, barrier, results))
             for i in range(n)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=300)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for s in listeners:
            s.close()
    if any(p.exitcode for p in procs):
        raise SystemExit("a loopback stream process failed")
    return total / max(results[:]) / 1e9


# ---- report -----------------------------------------------------------------


def _fmt_bytes(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def summarise(world: int, data: dict, limit: float) -> list[dict]:
    table = []
    factor = 2 * (world - 1) / world
    for row in data["rows"]:
        med = {g: statistics.median(row["times"][g]) for g in GROUPS}
        entry = {"world": world, "dtype": row["dtype"], "bytes": row["bytes"],
                 "iterations": len(row["times"]["gloo"])}
        for g in GROUPS:
            bus = row["bytes"] / med[g] * factor / 1e9
            entry[g] = {
                "median_s": med[g],
                "cpu_median_s": statistics.median(row["cpu"][g]),
                "algorithm": _algorithm(g, row["bytes"], row["esize"], world),
                "busbw_GBps": bus,
                "of_tcp_limit": bus / limit,
            }
            if g != "gloo":
                entry[g]["gloo_over_ours"] = med["gloo"] / med[g]
                entry[g]["cpu_gloo_over_ours"] = (
                    statistics.median(row["cpu"]["gloo"]) / max(entry[g]["cpu_median_s"], 1e-9))
                entry[g]["paired_gloo_over_ours"] = statistics.median(
                    gl / o for o, gl in zip(row["times"][g], row["times"]["gloo"]))
        table.append(entry)
    return table


def goals(table: list[dict], large: int) -> dict:
    """Per path: the issue's three goals, met or not, with the worst case."""
    out = {}
    for g in ("ours", "ours-tcp"):
        every = min(table, key=lambda e: e[g]["gloo_over_ours"])
        from_1m = [e for e in table if e["bytes"] >= 1 << 20]
        worst_1m = min(from_1m, key=lambda e: e[g]["gloo_over_ours"]) if from_1m else None
        big = [e for e in table if e["bytes"] >= large]
        worst_big = min(big, key=lambda e: e[g]["of_tcp_limit"]) if big else None

        def where(e):
            return f"{e['world']} ranks, {e['dtype']}, {_fmt_bytes(e['bytes'])}"

        out[g] = {
            ">= gloo at every size": {
                "met": every[g]["gloo_over_ours"] >= 1.0,
                "worst": f"{every[g]['gloo_over_ours']:.2f}x at {where(every)}"},
            ">= 1.5x gloo from 1 MiB": {
                "met": bool(worst_1m) and worst_1m[g]["gloo_over_ours"] >= 1.5,
                "worst": (f"{worst_1m[g]['gloo_over_ours']:.2f}x at {where(worst_1m)}"
                          if worst_1m else "no size")},
            f">= 70% of the TCP ring limit from {_fmt_bytes(large)}": {
                "met": bool(worst_big) and worst_big[g]["of_tcp_limit"] >= 0.7,
                "worst": (f"{worst_big[g]['of_tcp_limit'] * 100:.0f}% at {where(worst_big)}"
                          if worst_big else "no size")},
        }
    return out


def markdown(report: dict) -> str:
    lines = ["# Allreduce: ProcessGroupTCP vs Gloo", "",
             f"Generated by `bench/allreduce.py` on {report['when']} "
             f"({report['cpus']} CPUs, load average {report['load']}).", "",
             f"TCP group advertising {report['tcp_host']} (127.0.0.1: the same-host "
             "TCP fallback; another address: connections as between hosts).", "",
             f"Loopback TCP, one stream alone: {report['tcp_one_stream_GBps']:.2f} GB/s.  "
             "Ring pattern (each process streaming to its successor at once), "
             "per stream: " + ", ".join(
                 f"{w} processes {v:.2f} GB/s" for w, v in report["tcp_ring_GBps"].items()) + ".",
             "",
             "Median latency; bus bandwidth = bytes / t * 2(n-1)/n; x Gloo = Gloo time / "
             "ours (> 1: ours faster); % limit = bus bandwidth / the ring-pattern TCP limit; "
             "CPU x Gloo = Gloo's CPU time per operation / ours (rank 0's process, every "
             "thread; less sensitive to other load than wall time).",
             "",
             "| ranks | dtype | size | ours (same-host) | ours (TCP) | Gloo | x Gloo same-host | "
             "x Gloo TCP | busbw GB/s same-host / TCP / Gloo | % limit same-host / TCP | "
             "CPU x Gloo same-host / TCP |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in report["table"]:
        def t(g):
            s = e[g]["median_s"]
            return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"
        lines.append(
            f"| {e['world']} | {e['dtype']} | {_fmt_bytes(e['bytes'])} | {t('ours')} | "
            f"{t('ours-tcp')} | {t('gloo')} | {e['ours']['gloo_over_ours']:.2f} | "
            f"{e['ours-tcp']['gloo_over_ours']:.2f} | "
            f"{e['ours']['busbw_GBps']:.2f} / {e['ours-tcp']['busbw_GBps']:.2f} / "
            f"{e['gloo']['busbw_GBps']:.2f} | {e['ours']['of_tcp_limit'] * 100:.0f}% / "
            f"{e['ours-tcp']['of_tcp_limit'] * 100:.0f}% | "
            f"{e['ours']['cpu_gloo_over_ours']:.2f} / {e['ours-tcp']['cpu_gloo_over_ours']:.2f} |")
    lines += ["", "Goals:", ""]
    for g, gs in report["goals"].items():
        name = "same-host path" if g == "ours" else "TCP path"
        for goal, v in gs.items():
            lines.append(f"- {name}: {goal}: {'met' if v['met'] else 'NOT met'} (worst {v['worst']})")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--min-kib", type=int, default=4)
    ap.add_argument("--max-mib", type=int, default=256)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--large-mib", type=int, default=64,
                    help="sizes from here count as large for the 70%% goal")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--tcp-host", default="127.0.0.2",
                    help="address the TCP group's ranks advertise (see above)")
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = []
    s = args.min_kib << 10
    while s <= args.max_mib << 20:
        sizes.append(s)
        s *= 4
    if args.worker:
        port, rank, world, quick, out = args.worker
        worker(int(port), int(rank), int(world), sizes, args.dtypes, quick == "1", out,
               args.tcp_host)
        return

    one = statistics.median(tcp_streams(2, ring=False) for _ in range(3))
    ring = {w: statistics.median(tcp_streams(w, ring=True) for _ in range(3))
            for w in args.worlds}
    print(f"loopback TCP: one stream {one:.2f} GB/s; ring pattern per stream: "
          + ", ".join(f"{w} processes {v:.2f} GB/s" for w, v in ring.items()))

    from torch.distributed import TCPStore

    table: list[dict] = []
    paths = {}
    for world in args.worlds:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        out = f"/tmp/stepguard-allreduce-{os.getpid()}-{world}.json"
        cmd = [sys.executable, __file__, "--min-kib", str(args.min_kib), "--max-mib",
               str(args.max_mib), "--dtypes", *args.dtypes, "--tcp-host", args.tcp_host]
        procs = [subprocess.Popen(cmd + ["--worker", str(store.port), str(r), str(world),
                                         "1" if args.quick else "0", out])
                 for r in range(world)]
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
        data = json.loads(Path(out).read_text())
        os.unlink(out)
        paths[world] = data["paths"]
        rows = summarise(world, data, ring[world])
        table += rows
        print(f"\n{world} ranks (ours: {data['paths']['ours']} between neighbours; "
              f"ours-tcp: {data['paths']['ours-tcp']}); TCP ring limit "
              f"{ring[world]:.2f} GB/s per link")
        print(f"{'dtype':>8} {'bytes':>9} {'ours us':>10} {'tcp us':>10} {'gloo us':>10} "
              f"{'xGloo':>6} {'xGloo':>6} {'paired':>6} {'busbw':>6} {'busbw':>6} {'busbw':>6} "
              f"{'%lim':>5} {'%lim':>5} {'cpuX':>5} {'cpuX':>5}  algorithm (ours)")
        print(f"{'':>8} {'':>9} {'':>10} {'':>10} {'':>10} {'sh':>6} {'tcp':>6} {'sh':>6} "
              f"{'sh':>6} {'tcp':>6} {'gloo':>6} {'sh':>5} {'tcp':>5} {'sh':>5} {'tcp':>5}")
        for e in rows:
            o, t, g = e["ours"], e["ours-tcp"], e["gloo"]
            print(f"{e['dtype']:>8} {e['bytes']:>9} {o['median_s'] * 1e6:>10.0f} "
                  f"{t['median_s'] * 1e6:>10.0f} {g['median_s'] * 1e6:>10.0f} "
                  f"{o['gloo_over_ours']:>6.2f} {t['gloo_over_ours']:>6.2f} "
                  f"{o['paired_gloo_over_ours']:>6.2f} {o['busbw_GBps']:>6.2f} "
                  f"{t['busbw_GBps']:>6.2f} {g['busbw_GBps']:>6.2f} "
                  f"{o['of_tcp_limit'] * 100:>4.0f}% {t['of_tcp_limit'] * 100:>4.0f}% "
                  f"{o['cpu_gloo_over_ours']:>5.2f} {t['cpu_gloo_over_ours']:>5.2f}  "
                  f"{o['algorithm']}")
    report = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "tcp_host": args.tcp_host,
        "tcp_one_stream_GBps": one,
        "tcp_ring_GBps": {str(w): v for w, v in ring.items()},
        "paths": {str(w): p for w, p in paths.items()},
        "table": table,
        "goals": goals(table, args.large_mib << 20),
    }
    print("\ngoals:")
    for g, gs in report["goals"].items():
        for goal, v in gs.items():
            print(f"  {g}: {goal}: {'met' if v['met'] else 'NOT met'} (worst {v['worst']})")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    TABLE.write_text(markdown(report))
    print(f"\nwrote {RESULTS} and {TABLE}")


if __name__ == "__main__":
    main()
