"""Benchmark: live recovery bandwidth, stepguard's NativeTransport against
torchft's HTTPTransport and PGTransport (the installed torchft-nightly) and
the raw loopback limit, in the same run.

For each state dict shape (few large tensors, many small ones) a child
process serves the state and this process heals from it: the time is the
healer's ``recv_checkpoint`` call, start to finish (allocation included),
over ``--reps`` repetitions; GB/s are decimal (1e9 bytes per second).

* ``stepguard``  NativeTransport, one source, ``--streams`` connections;
* ``torchft-http`` HTTPTransport(num_chunks=0), the Manager's default;
* ``torchft-pg``  PGTransport over torchft's ProcessGroupGloo (two ranks);
* ``loopback``   one TCP stream moving the same bytes from a tensor into a
  fresh tensor with sendall/recv_into: what one connection can carry.

Prints medians and the ratios the goals are stated in (stepguard against
loopback and against torchft-http); the data goes to
``bench/results/recovery.json``.  Run ``.venv/bin/python bench/recovery.py``
(64 MiB states, a minute or two) or add ``--big`` for 1 GiB states.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = 3
TIMEOUT = timedelta(seconds=300)


def make_state(total: int, n: int) -> dict:
    import torch

    per = total // n // 4
    g = torch.Generator().manual_seed(0)
    return {
        "user": {"model": {f"p{i}": torch.randn(per, generator=g) for i in range(n)}},
        "torchft": {"step": STEP, "batches_committed": 0},
    }


# ---- the serving child ----------------------------------------------------


def serve(kind: str, total: int, n: int, reps: int, arg: str) -> None:
    """Child side: serve the state with `kind` until stdin closes."""
    import torch

    sd = make_state(total, n)
    if kind == "stepguard":
        from stepguard.checkpointing.native_transport import NativeTransport

        t = NativeTransport(TIMEOUT, hostname="127.0.0.1")
        t.send_checkpoint([1], STEP, sd, TIMEOUT)
        print(t.metadata(), flush=True)
        sys.stdin.read()
        t.shutdown()
    elif kind == "torchft-http":
        from torchft.checkpointing.http_transport import HTTPTransport

        t = HTTPTransport(TIMEOUT, num_chunks=0)
        t.send_checkpoint([1], STEP, sd, TIMEOUT)
        print(t.metadata(), flush=True)
        sys.stdin.read()
        t.shutdown()
    elif kind == "torchft-pg":
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.process_group import ProcessGroupGloo, reconfigure_with_store

        pg = ProcessGroupGloo(timeout=TIMEOUT)
        reconfigure_with_store(pg, arg, 0, 2)
        t = PGTransport(pg, TIMEOUT, torch.device("cpu"))
        print("ready", flush=True)
        for _ in range(reps):
            t.send_checkpoint([1], STEP, sd, TIMEOUT)
        sys.stdin.read()
        pg.shutdown() if hasattr(pg, "shutdown") else None
    elif kind == "loopback":
        blob = torch.cat([v.reshape(-1) for v in sd["user"]["model"].values()])
        view = memoryview(blob.numpy()).cast("B")
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(4)
        print(f"127.0.0.1:{ls.getsockname()[1]}", flush=True)
        for _ in range(reps):
            c, _ = ls.accept()
            c.recv(1)
            c.sendall(view)
            c.close()
        sys.stdin.read()
    else:
        raise SystemExit(f"unknown kind {kind}")


# ---- the healing side -----------------------------------------------------


def spawn(kind: str, total: int, n: int, reps: int, arg: str = "") -> tuple:
    p = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, "--total", str(total),
         "--tensors", str(n), "--reps", str(reps), "--arg", arg],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "STEPGUARD_LOG": "warn"},
    )  # fmt: skip
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    if not line:
        p.kill()
        p.wait()
        raise RuntimeError(f"{kind} server did not start")
    return p, line


def finish(p: subprocess.Popen) -> None:
    if p.stdin:
        p.stdin.close()
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def check(sd: dict, total: int, n: int) -> None:
    got = sd["user"]["model"]
    assert len(got) == n and sum(v.numel() * 4 for v in got.values()) == total


def run_stepguard(total: int, n: int, reps: int, streams: int) -> list[float]:
    from stepguard.checkpointing.native_transport import NativeTransport

    p, meta = spawn("stepguard", total, n, reps)
    t = NativeTransport(TIMEOUT, hostname="127.0.0.1", streams_per_source=streams)
    times = []
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            sd = t.recv_checkpoint(0, meta, STEP, TIMEOUT)
            times.append(time.perf_counter() - t0)
            check(sd, total, n)
            del sd
    finally:
        t.shutdown()
        finish(p)
    return times


def run_http(total: int, n: int, reps: int) -> list[float]:
    from torchft.checkpointing.http_transport import HTTPTransport

    p, meta = spawn("torchft-http", total, n, reps)
    t = HTTPTransport(TIMEOUT, num_chunks=0)
    times = []
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            sd = t.recv_checkpoint(0, meta, STEP, TIMEOUT)
            times.append(time.perf_counter() - t0)
            check(sd, total, n)
            del sd
    finally:
        t.shutdown()
        finish(p)
    return times


def run_pg(total: int, n: int, reps: int, seq: int) -> list[float]:
    import torch
    import torch.distributed as dist
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo, reconfigure_with_store

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{store.port}/bench/{seq}"
    p = subprocess.Popen(
        [sys.executable, __file__, "--serve", "torchft-pg", "--total", str(total),
         "--tensors", str(n), "--reps", str(reps), "--arg", addr],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    times = []
    try:
        reconfigure_with_store(pg, addr, 1, 2)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        t = PGTransport(pg, TIMEOUT, torch.device("cpu"))
        for _ in range(reps):
            t0 = time.perf_counter()
            sd = t.recv_checkpoint(0, "<n/a>", STEP, TIMEOUT)
            times.append(time.perf_counter() - t0)
            check(sd, total, n)
            del sd
    finally:
        finish(p)
    return times


def run_loopback(total: int, n: int, reps: int) -> list[float]:
    import torch

    p, addr = spawn("loopback", total, n, reps)
    host, port = addr.rsplit(":", 1)
    times = []
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            dst = torch.empty(total, dtype=torch.uint8)
            view = memoryview(dst.numpy())
            s = socket.create_connection((host, int(port)))
            s.sendall(b"g")
            got = 0
            while got < total:
                k = s.recv_into(view[got:])
                if k == 0:
                    raise RuntimeError("loopback source closed early")
                got += k
            s.close()
            times.append(time.perf_counter() - t0)
            del dst
    finally:
        finish(p)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--total", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--tensors", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--arg", default="", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--streams", type=int, default=2, help="stepguard streams")
    ap.add_argument("--big", action="store_true", help="also 1 GiB states")
    ap.add_argument("--skip", default="", help="comma list of kinds to skip")
    ap.add_argument("--out", default=str(ROOT / "bench/results/recovery.json"))
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.total, args.tensors, args.reps, args.arg)
        return

    shapes = [("64MiB x4", 64 << 20, 4), ("64MiB x4096", 64 << 20, 4096)]
    if args.big:
        shapes += [("1GiB x16", 1 << 30, 16), ("1GiB x16384", 1 << 30, 16384)]
    skip = set(filter(None, args.skip.split(",")))
    results = []
    seq = 0
    for label, total, n in shapes:
        row: dict = {"shape": label, "bytes": total, "tensors": n}
        runners = {
            "loopback": lambda: run_loopback(total, n, args.reps),
            "stepguard": lambda: run_stepguard(total, n, args.reps, args.streams),
            "stepguard-1stream": lambda: run_stepguard(total, n, args.reps, 1),
            "torchft-http": lambda: run_http(total, n, args.reps),
            "torchft-pg": lambda: run_pg(total, n, args.reps, seq),
        }
        for kind, fn in runners.items():
            if kind in skip:
                continue
            seq += 1
            try:
                times = fn()
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{label:14s} {kind:18s} failed: {e}", flush=True)
                continue
            med = statistics.median(times)
            row[kind] = {"median_s": med, "gbps": total / med / 1e9, "times": times}
            print(
                f"{label:14s} {kind:18s} median {med * 1e3:8.1f} ms "
                f"{total / med / 1e9:6.2f} GB/s",
                flush=True,
            )
        ours = row.get("stepguard", {}).get("gbps")
        for other in ["loopback", "torchft-http", "torchft-pg"]:
            if ours and other in row:
                ratio = ours / row[other]["gbps"]
                row[f"stepguard/{other}"] = ratio
                print(f"{label:14s} stepguard / {other:13s} {ratio:6.2f}x")
        results.append(row)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"reps": args.reps, "streams": args.streams, "cpus": os.cpu_count(),
             "results": results},
            f, indent=1,
        )  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
