"""Benchmark: live recovery bandwidth, stepguard's NativeTransport against
torchft's HTTPTransport and PGTransport (the installed torchft-nightly) and
the raw loopback limit, in the same run.

For each state dict shape (few large tensors, many small ones) a child
process serves the state and this process heals from it: the time is the
healer's ``recv_checkpoint`` call, start to finish (allocation included),
over ``--reps`` repetitions; GB/s are decimal (1e9 bytes per second).
The first repetition is also shown alone: a replacement replica heals once,
in a fresh process, into memory the allocator has never handed out, while
later repetitions may get recycled memory.

* ``stepguard``  NativeTransport, one source, ``--streams`` connections;
* ``torchft-http`` HTTPTransport(num_chunks=0), the Manager's default;
* ``torchft-pg``  PGTransport over torchft's ProcessGroupGloo (two ranks);
* ``loopback``   one TCP stream moving the same bytes from a tensor into a
  fresh tensor with sendall/recv_into: what one connection can carry.

Prints medians and the ratios the goals are stated in (stepguard against
loopback and against torchft-http); the data goes to
``bench/results/recovery.json``.  Run ``.venv/bin/python bench/recovery.py``
(64 MiB states, a minute or two) or add ``--big`` for 1 GiB states.

``--shaped 1gbit`` (root) runs the sources in two network namespaces behind
links shaped with tc tbf instead: stepguard from one source, striped over
both, and torchft-http from one, to ``bench/results/recovery_shaped.json``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = str(ROOT / "bench/results/recovery.json")
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

        host = arg or "127.0.0.1"
        t = NativeTransport(TIMEOUT, hostname=host, bind=f"{host}:0")
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


def spawn(
    kind: str, total: int, n: int, reps: int, arg: str = "", ns: str | None = None
) -> tuple:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    p = subprocess.Popen(
        prefix + [sys.executable, __file__, "--serve", kind, "--total", str(total),
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


class Runner:
    """One competitor: start() its serving child, one() heal once, stop()."""

    def __init__(self, total: int, n: int, reps: int) -> None:
        self.total, self.n, self.reps = total, n, reps
        self.p: subprocess.Popen | None = None

    def stop(self) -> None:
        if self.p is not None:
            finish(self.p)
            self.p = None


class Stepguard(Runner):
    """NativeTransport striped over one source per entry of `where`
    ((namespace, host) pairs; (None, "127.0.0.1") is plain loopback)."""

    def __init__(
        self, total: int, n: int, reps: int, streams: int, where: list
    ) -> None:
        super().__init__(total, n, reps)
        self.streams = streams
        self.where = where
        self.ps: list = []

    def start(self) -> None:
        from stepguard.checkpointing.native_transport import NativeTransport

        self.metas = []
        for ns, host in self.where:
            p, meta = spawn("stepguard", self.total, self.n, self.reps, host, ns)
            self.ps.append(p)
            self.metas.append(meta)
        self.t = NativeTransport(
            TIMEOUT, hostname="127.0.0.1", streams_per_source=self.streams
        )

    def one(self) -> float:
        t0 = time.perf_counter()
        sd = self.t.recv_checkpoint_striped(self.metas, STEP, TIMEOUT)
        dt = time.perf_counter() - t0
        check(sd, self.total, self.n)
        return dt

    def stop(self) -> None:
        self.t.shutdown()
        for p in self.ps:
            finish(p)
        self.ps = []


class Http(Runner):
    def __init__(self, total: int, n: int, reps: int, where=(None, None)) -> None:
        super().__init__(total, n, reps)
        self.ns, self.host = where

    def start(self) -> None:
        from torchft.checkpointing.http_transport import HTTPTransport

        self.p, self.meta = spawn(
            "torchft-http", self.total, self.n, self.reps, ns=self.ns
        )
        if self.host:  # it advertises the host name; reach it by address
            self.meta = re.sub(r"//[^/]+:(\d+)/", rf"//{self.host}:\1/", self.meta)
        self.t = HTTPTransport(TIMEOUT, num_chunks=0)

    def one(self) -> float:
        t0 = time.perf_counter()
        sd = self.t.recv_checkpoint(0, self.meta, STEP, TIMEOUT)
        dt = time.perf_counter() - t0
        check(sd, self.total, self.n)
        return dt

    def stop(self) -> None:
        self.t.shutdown()
        super().stop()


class Pg(Runner):
    seq = 0

    def start(self) -> None:
        import torch
        import torch.distributed as dist
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.process_group import ProcessGroupGloo, reconfigure_with_store

        Pg.seq += 1
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False
        )
        addr = f"127.0.0.1:{self.store.port}/bench/{Pg.seq}"
        self.p = subprocess.Popen(
            [sys.executable, __file__, "--serve", "torchft-pg", "--total",
             str(self.total), "--tensors", str(self.n), "--reps",
             str(self.reps), "--arg", addr],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.pg = ProcessGroupGloo(timeout=TIMEOUT)
        reconfigure_with_store(self.pg, addr, 1, 2)
        assert self.p.stdout is not None
        assert self.p.stdout.readline().strip() == "ready"
        self.t = PGTransport(self.pg, TIMEOUT, torch.device("cpu"))

    def one(self) -> float:
        t0 = time.perf_counter()
        sd = self.t.recv_checkpoint(0, "<n/a>", STEP, TIMEOUT)
        dt = time.perf_counter() - t0
        check(sd, self.total, self.n)
        return dt


class Loopback(Runner):
    def start(self) -> None:
        self.p, addr = spawn("loopback", self.total, self.n, self.reps)
        host, port = addr.rsplit(":", 1)
        self.addr = (host, int(port))

    def one(self) -> float:
        import torch

        t0 = time.perf_counter()
        dst = torch.empty(self.total, dtype=torch.uint8)
        view = memoryview(dst.numpy())
        s = socket.create_connection(self.addr)
        s.sendall(b"g")
        got = 0
        while got < self.total:
            k = s.recv_into(view[got:])
            if k == 0:
                raise RuntimeError("loopback source closed early")
            got += k
        s.close()
        return time.perf_counter() - t0


class Net:
    """Namespaces each linked to this one by a veth shaped with tc tbf
    (what a source sends is limited to `rate`)."""

    def __init__(self, count: int, rate: str) -> None:
        self.names: list[str] = []
        self.links: list[str] = []
        self.where: list[tuple[str, str]] = []
        base = (os.getpid() % 100) * 2 + 20
        try:
            for i in range(count):
                ns, outer = f"sgbench{i}_{os.getpid()}", f"sgb{i}o{os.getpid() % 100000}"
                net = f"10.214.{base + i}"
                self._ip("netns", "add", ns)
                self.names.append(ns)
                self._ip("link", "add", outer, "type", "veth", "peer", "name", "sgbi")
                self.links.append(outer)
                self._ip("link", "set", "sgbi", "netns", ns)
                self._ip("addr", "add", f"{net}.1/24", "dev", outer)
                self._ip("link", "set", outer, "up")
                self._ip("-n", ns, "addr", "add", f"{net}.2/24", "dev", "sgbi")
                self._ip("-n", ns, "link", "set", "sgbi", "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
                subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "sgbi",
                     "root", "tbf", "rate", rate, "burst", "512kb", "latency", "100ms"],
                    check=True, capture_output=True,
                )  # fmt: skip
                self.where.append((ns, f"{net}.2"))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def close(self) -> None:
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


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
    ap.add_argument(
        "--shaped",
        metavar="RATE",
        help="instead: sources in network namespaces behind links shaped to "
        "RATE (tc tbf, e.g. 1gbit; needs root): stepguard from one and from "
        "two sources against torchft-http",
    )
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.total, args.tensors, args.reps, args.arg)
        return

    shapes = [("64MiB x4", 64 << 20, 4), ("64MiB x4096", 64 << 20, 4096)]
    if args.big:
        shapes += [("1GiB x16", 1 << 30, 16), ("1GiB x16384", 1 << 30, 16384)]
    skip = set(filter(None, args.skip.split(",")))
    net = Net(2, args.shaped) if args.shaped else None
    if net:
        atexit.register(net.close)
        if args.out == DEFAULT_OUT:
            args.out = str(ROOT / "bench/results/recovery_shaped.json")
    results = []
    for label, total, n in shapes:
        row: dict = {"shape": label, "bytes": total, "tensors": n}
        reps = args.reps
        local = [(None, "127.0.0.1")]
        if net:
            runners = {
                "stepguard": Stepguard(total, n, reps, args.streams, net.where[:1]),
                "stepguard-2src": Stepguard(total, n, reps, args.streams, net.where),
                "torchft-http": Http(total, n, reps, net.where[0]),
            }
        else:
            runners = {
                "loopback": Loopback(total, n, reps),
                "stepguard": Stepguard(total, n, reps, args.streams, local),
                "stepguard-1stream": Stepguard(total, n, reps, 1, local),
                "torchft-http": Http(total, n, reps),
                "torchft-pg": Pg(total, n, reps),
            }
        runners = {k: r for k, r in runners.items() if k not in skip}
        times: dict = {k: [] for k in runners}
        live = {}
        try:
            for kind, r in runners.items():
                try:
                    r.start()
                    live[kind] = r
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"{label:14s} {kind:18s} failed to start: {e}")
            # interleaved, so that load on the machine hits all alike
            for _ in range(reps):
                for kind, r in live.items():
                    times[kind].append(r.one())
        finally:
            for r in live.values():
                r.stop()
        for kind, ts in times.items():
            if not ts:
                continue
            med = statistics.median(ts)
            row[kind] = {"median_s": med, "gbps": total / med / 1e9, "times": ts}
            print(
                f"{label:14s} {kind:18s} median {med * 1e3:8.1f} ms "
                f"{total / med / 1e9:6.2f} GB/s  (first {ts[0] * 1e3:7.1f} ms)",
                flush=True,
            )
        ours = row.get("stepguard", {}).get("gbps")
        for other in ["loopback", "torchft-http", "torchft-pg"]:
            if net and "stepguard-2src" in row and other in row:
                ratio = row["stepguard-2src"]["gbps"] / row[other]["gbps"]
                row[f"stepguard-2src/{other}"] = ratio
                print(f"{label:14s} stepguard-2src / {other:8s} {ratio:6.2f}x")
            if ours and other in row:
                ratio = ours / row[other]["gbps"]
                row[f"stepguard/{other}"] = ratio
                print(f"{label:14s} stepguard / {other:13s} {ratio:6.2f}x")
        results.append(row)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"reps": args.reps, "streams": args.streams, "cpus": os.cpu_count(),
             "shaped": args.shaped, "results": results},
            f, indent=1,
        )  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
