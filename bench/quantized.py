"""Quantized allreduce: ProcessGroupTCP in full precision, int8 and fp8
against torch's Gloo (float32), in the same run, on the same 64 MiB
float32 buffer, 4 ranks; plus the quantization kernels against memcpy.

Two networks:

- ``shaped``: every rank in its own network namespace, linked to a bridge
  by a veth pair whose rank side is shaped with ``tc tbf`` at 1 Gbit/s (a
  host's uplink); the bytes each rank sends are read from its interface
  counters (``/sys/class/net/*/statistics/tx_bytes``: payload and TCP/IP
  headers).  Needs root and iproute2; skipped with the reason otherwise.
- ``loopback``: plain TCP over loopback (``STEPGUARD_SAME_HOST=0``), no
  shaping: where the CPU, not the link, is the limit.

Kernels: one core, 64 MiB of float32 in: quantize (int8, fp8), dequantize,
and a plain memcpy of the same 64 MiB (torch's copy_ on one thread); GB/s
are float32 bytes in (quantize) or out (dequantize) per second.

    python bench/quantized.py [--iters 5] [--mib 64] [--skip-shaped] [--skip-loopback]

A mode's time is the slowest rank's, per iteration: the median over the
iterations, and the best one (the least disturbed by other work on the
machine).  Per mode also the CPU time of a rank's process during the operation (every
thread), and two lower bounds on its time: the link's (bytes sent / rate)
and the CPU's (every rank's CPU time spread over the machine's cores); the
load average at the start and the end says how much other work shared them.

Results: bench/results/quantized.json and bench/results/quantized.md.
Prints medians and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "quantized.json"
TABLE = HERE / "results" / "quantized.md"
MODES = ("full", "int8", "fp8", "gloo")
WORLD = 4

WORKER = r"""
import json, os, statistics, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions, PrefixStore, ReduceOp, TCPStore
torch.set_num_threads(1)
store_host, port, rank, world, mib, iters, iface, host, out = sys.argv[1:10]
port, rank, world, mib, iters = int(port), int(rank), int(world), int(mib), int(iters)
os.environ["STEPGUARD_SAME_HOST"] = "0"
os.environ["STEPGUARD_COMM_HOST"] = host
from stepguard import collectives
from stepguard.process_group import ProcessGroupTCP
T = timedelta(seconds=300)
pgs = {}
for fmt in ("int8", "fp8"):
    os.environ["STEPGUARD_QUANTIZE"] = fmt
    pg = ProcessGroupTCP(timeout=T)
    pg.configure(f"{store_host}:{port}/q{fmt}", "bench", rank, world, quorum_id=1)
    assert pg.quantized_format()[0] == fmt, pg.quantized_format()
    pgs[fmt] = pg
pgs["full"] = pgs["fp8"]
store = TCPStore(store_host, port, is_master=False, wait_for_workers=False, timeout=T)
pgs["gloo"] = dist.ProcessGroupGloo(PrefixStore("gloo", store), rank, world, T)
x = torch.randn(mib << 18, generator=torch.Generator().manual_seed(rank))
buf = x.clone()
def tx():
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return -1
def barrier():
    o = AllreduceOptions(); o.reduceOp = ReduceOp.SUM
    pgs["fp8"].allreduce([torch.zeros(1)], o).wait()
res = {m: {"t": [], "tx": [], "cpu": []} for m in sys.argv[10].split(",")}
for it in range(iters + 1):
    for mode in res:
        buf.copy_(x)
        barrier()
        b0, c0, t0 = tx(), time.process_time(), time.perf_counter()
        if mode in ("int8", "fp8"):
            collectives.allreduce_quantized([buf], ReduceOp.SUM, pgs[mode]).wait()
        else:
            o = AllreduceOptions(); o.reduceOp = ReduceOp.SUM
            pgs[mode].allreduce([buf], o).wait()
        t1, c1, b1 = time.perf_counter(), time.process_time(), tx()
        if it:  # the first round warms up
            res[mode]["t"].append(t1 - t0)
            res[mode]["tx"].append(b1 - b0)
            res[mode]["cpu"].append(c1 - c0)
for fmt in ("int8", "fp8"):
    pgs[fmt].shutdown()
with open(out, "w") as f:
    json.dump(res, f)
"""


def rate_bits(rate: str) -> float:
    """tc's rate ("1gbit", "500mbit") in bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f
    return float(rate)


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


class ShapedNet:
    """WORLD namespaces on one bridge; each rank's side shaped by tbf."""

    def __init__(self, rate: str) -> None:
        tag = os.getpid() % 100000
        self.bridge = f"sgqbr{tag}"
        self.names: list[str] = []
        self.hosts: list[str] = []
        self.ifaces: list[str] = []
        net = f"10.215.{os.getpid() % 200 + 20}"
        self.store_host = f"{net}.1"
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{net}.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for r in range(WORLD):
            ns, outer, inner = f"sgq{r}x{tag}", f"sgq{r}o{tag}", "sgqi"
            _run("ip", "netns", "add", ns)
            self.names.append(ns)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", outer, "master", self.bridge)
            _run("ip", "link", "set", outer, "up")
            _run("ip", "-n", ns, "addr", "add", f"{net}.{r + 2}/24", "dev", inner)
            _run("ip", "-n", ns, "link", "set", inner, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner, "root",
                 "tbf", "rate", rate, "burst", "512kb", "latency", "50ms")
            self.hosts.append(f"{net}.{r + 2}")
            self.ifaces.append(inner)

    def close(self) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def run_group(store_host: str, hosts: list[str], ifaces: list[str], prefix: list[list[str]],
              mib: int, iters: int, modes: tuple[str, ...], tmp: Path) -> dict:
    from torch.distributed import TCPStore

    store = TCPStore(store_host, 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=300))
    outs = [tmp / f"q{r}.json" for r in range(WORLD)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="")
    procs = []
    try:
        for r in range(WORLD):
            e = dict(env)
            if ifaces[r] != "-":
                e["GLOO_SOCKET_IFNAME"] = ifaces[r]
            else:
                e.pop("GLOO_SOCKET_IFNAME")
            procs.append(subprocess.Popen(
                [*prefix[r], sys.executable, "-c", WORKER, store_host, str(store.port),
                 str(r), str(WORLD), str(mib), str(iters), ifaces[r], hosts[r], str(outs[r]),
                 ",".join(modes)], env=e))
        for p in procs:
            p.wait(timeout=1800)
            if p.returncode:
                raise RuntimeError(f"a rank exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    per_rank = [json.loads(o.read_text()) for o in outs]
    out = {}
    for m in modes:
        # the operation's time: the slowest rank's, per iteration
        times = [max(pr[m]["t"][i] for pr in per_rank) for i in range(iters)]
        txs = [sum(pr[m]["tx"][i] for pr in per_rank) / WORLD for i in range(iters)]
        # CPU time of a rank's process (every thread) during the operation
        cpus = [sum(pr[m]["cpu"][i] for pr in per_rank) / WORLD for i in range(iters)]
        # (no counters: -1 per rank)
        out[m] = {"median_s": statistics.median(times), "best_s": min(times),
                  "cpu_s_per_rank": statistics.median(cpus),
                  "tx_bytes_per_rank": statistics.median(txs) if txs[0] >= 0 else None}
    return out


def kernels(mib: int, iters: int) -> dict:
    import torch

    from stepguard import _C

    torch.set_num_threads(1)
    n = mib << 18
    x = torch.randn(n)
    wire = torch.empty(_C.quant_wire_bytes(n), dtype=torch.uint8)
    y = torch.empty(n)

    def med(fn) -> float:
        ts = []
        for _ in range(iters + 1):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[1:])

    res = {"memcpy": n * 4 / med(lambda: y.copy_(x)) / 1e9}
    for name, fmt in (("int8", _C.QUANT_INT8), ("fp8", _C.QUANT_FP8)):
        res[f"quantize-{name}"] = n * 4 / med(
            lambda: _C.quant_encode(fmt, x.data_ptr(), n, wire.data_ptr())) / 1e9
        res[f"dequantize-{name}"] = n * 4 / med(
            lambda: _C.quant_decode(fmt, wire.data_ptr(), wire.numel(), n, y.data_ptr())) / 1e9
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--skip-shaped", action="store_true")
    ap.add_argument("--skip-loopback", action="store_true")
    a = ap.parse_args()
    import tempfile

    cores = len(os.sched_getaffinity(0))
    results: dict = {"mib": a.mib, "world": WORLD, "iters": a.iters, "rate": a.rate,
                     "cores": cores, "loadavg_start": os.getloadavg()[0]}
    results["kernels"] = kernels(a.mib, a.iters)
    k = results["kernels"]
    print(f"kernels, one core, GB/s of float32 (memcpy {k['memcpy']:.2f}):")
    for key, v in k.items():
        if key != "memcpy":
            print(f"  {key:16s} {v:6.2f}  ({v / k['memcpy']:.2f}x memcpy)")
    with tempfile.TemporaryDirectory() as tmp:
        # no byte counts on loopback: lo's counters carry every process's traffic
        if not a.skip_loopback:
            results["loopback"] = run_group(
                "127.0.0.1", ["127.0.0.1"] * WORLD, ["-"] * WORLD, [[]] * WORLD,
                a.mib, a.iters, MODES, Path(tmp))
        reason = None
        if a.skip_shaped:
            reason = "--skip-shaped"
        elif os.geteuid() != 0:
            reason = "needs root for network namespaces"
        elif not shutil.which("ip") or not shutil.which("tc"):
            reason = "needs iproute2 (ip, tc)"
        if reason is None:
            net = None
            try:
                net = ShapedNet(a.rate)
                results["shaped"] = run_group(
                    net.store_host, net.hosts, net.ifaces,
                    [["ip", "netns", "exec", ns] for ns in net.names],
                    a.mib, a.iters, MODES, Path(tmp))
            except (subprocess.SubprocessError, OSError) as e:
                reason = f"cannot make namespaces: {e}"
            finally:
                if net:
                    net.close()
        if reason:
            print(f"SKIP shaped link: {reason}")
            results["shaped_skipped"] = reason
    results["loadavg_end"] = os.getloadavg()[0]
    lines = [f"# Quantized allreduce: {a.mib} MiB float32, {WORLD} ranks, SUM, "
             f"medians of {a.iters}", "",
             f"{cores} cores; load average {results['loadavg_start']:.1f} at the start, "
             f"{results['loadavg_end']:.1f} at the end (other work on the machine slows "
             "the CPU-bound modes first).", ""]
    print(f"\n{lines[2]}")
    for netname in ("shaped", "loopback"):
        if netname not in results:
            continue
        r = results[netname]
        full = r["full"]
        title = f"{netname} ({a.rate} tbf per rank)" if netname == "shaped" else \
            "loopback TCP (STEPGUARD_SAME_HOST=0)"
        print(f"\n{title}:")
        lines += [f"## {title}", "", "| mode | time (s) | vs full | vs gloo | best (s) | "
                  "bytes sent per rank | data vs full | CPU per rank (s) |",
                  "|---|---|---|---|---|---|---|---|"]
        for m in MODES:
            v = r[m]
            tx = v["tx_bytes_per_rank"]
            ftx = full["tx_bytes_per_rank"]
            data = f"{ftx / tx:.2f}x less" if tx and ftx else "-"
            txs = f"{tx / 2**20:.1f} MiB" if tx else "-"
            row = (f"| {m} | {v['median_s']:.3f} | {full['median_s'] / v['median_s']:.2f}x | "
                   f"{r['gloo']['median_s'] / v['median_s']:.2f}x | {v['best_s']:.3f} | "
                   f"{txs} | {data} | "
                   f"{v['cpu_s_per_rank']:.3f} |")
            print(row)
            lines.append(row)
        # what bounds each mode: the link (bytes / rate) and the CPU (every
        # rank's CPU time spread over the cores, at best)
        limits = []
        for m in MODES:
            v = r[m]
            cpu = WORLD * v["cpu_s_per_rank"] / cores
            wire = (v["tx_bytes_per_rank"] * 8 / rate_bits(a.rate)
                    if netname == "shaped" and v["tx_bytes_per_rank"] else None)
            limits.append(f"{m}: link {wire:.3f} s, CPU {cpu:.3f} s" if wire is not None
                          else f"{m}: CPU {cpu:.3f} s")
        lim = "Lower bounds: " + "; ".join(limits) + "."
        print(lim)
        lines += ["", lim, ""]
    lines += ["## kernels (one core, GB/s of float32)", "", "| kernel | GB/s | vs memcpy |",
              "|---|---|---|"]
    for key, v in k.items():
        lines.append(f"| {key} | {v:.2f} | {v / k['memcpy']:.2f}x |")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    TABLE.write_text("\n".join(lines) + "\n")
    print(f"\nwrote {RESULTS} and {TABLE}")


if __name__ == "__main__":
    main()
