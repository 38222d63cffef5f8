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

* ``stepguard``  NativeTransport, one source, ``--streams`` streams: the
  source is a process of this host, so the healer copies the tensors out of
  its memory (process_vm_readv) after one request;
* ``stepguard-tcp`` the same with ``STEPGUARD_SAME_HOST=0`` in the healer:
  DATA responses over loopback TCP, as from another host;
* destination ``fresh``: every tensor is received into memory allocated by
  the call (what torchft's transports always do); ``in place``
  (``stepguard-inplace``, ``stepguard-tcp-inplace``): into the healer's own
  state, built and touched before the first heal as a restarted replica
  builds its model and optimizer, passed as ``into=`` as the Manager does
  with its default transport (``NativeTransport``, ``in_place=True``; the
  same source processes as the fresh rows);
* ``torchft-http`` HTTPTransport(num_chunks=0), the Manager's default;
* ``torchft-pg``  PGTransport over torchft's ProcessGroupGloo (two ranks);
* ``loopback``   the limit of loopback TCP with as many streams as stepguard
  uses: a child sends the state's bytes (one contiguous, pre-touched buffer,
  an equal share per stream, one thread each) with 4 MiB ``send`` calls and
  this process receives each share with 4 MiB ``recv_into`` calls (threads;
  the GIL is released) into a destination allocated and touched once and
  reused by every repetition, so neither page faults nor allocation count:
  two kernel copies and the TCP stack, nothing else;
* ``memcpy``     one thread copying the same bytes between two pre-touched
  buffers of this process (numpy): the memory-bandwidth ceiling of a copy.

Prints medians (for stepguard also of each part of a heal,
``NativeTransport.last_recv_times``) and the ratios the goals are stated in (each stepguard path
against loopback, goal >= 0.7, and against torchft-http, goal >= 2); the
data goes to ``bench/results/recovery.json``.  Run
``.venv/bin/python bench/recovery.py`` (64 MiB states, a minute or two) or
add ``--big`` for 1 GiB states too (``--big-reps`` repetitions each, 3 by
default; about 9 GiB of memory at peak).

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
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = str(ROOT / "bench/results/recovery.json")
STEP = 3
TIMEOUT = timedelta(seconds=300)
LOOP_SLICE = 4 << 20  # bytes per send/recv of the loopback limit
# where each row's healer puts the tensors it receives
DEST = {
    "stepguard": "fresh",
    "stepguard-tcp": "fresh",
    "stepguard-2src": "fresh",
    "stepguard-inplace": "in place",
    "stepguard-tcp-inplace": "in place",
    "torchft-http": "fresh",
    "torchft-pg": "fresh",
    "loopback": "touched, reused",
    "memcpy": "touched, reused",
}


def share(total: int, parts: int, i: int) -> tuple:
    """Stream i's contiguous byte range of `total` cut into `parts`."""
    return total * i // parts, total * (i + 1) // parts


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
        del sd
        view = memoryview(blob.numpy()).cast("B")
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(4)
        print(f"127.0.0.1:{ls.getsockname()[1]}", flush=True)
        streams = int(arg or "1")

        def send_share(c: socket.socket) -> None:
            i = c.recv(1)[0]  # which share this connection carries
            lo, hi = share(len(view), streams, i)
            for off in range(lo, hi, LOOP_SLICE):
                c.sendall(view[off : min(off + LOOP_SLICE, hi)])
            c.close()

        for _ in range(reps):
            conns = [ls.accept()[0] for _ in range(streams)]
            ths = [threading.Thread(target=send_share, args=(c,)) for c in conns]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
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
        self,
        total: int,
        n: int,
        reps: int,
        streams: int,
        where: list,
        same_host: bool = True,
        in_place_of: "Stepguard | None" = None,
    ) -> None:
        super().__init__(total, n, reps)
        self.streams = streams
        self.where = where
        self.same_host = same_host
        self.in_place_of = in_place_of  # in place, from that one's sources
        self.into = None
        self.ps: list = []
        self.parts: list = []  # last_recv_times of each heal

    def start(self) -> None:
        from stepguard.checkpointing.native_transport import NativeTransport

        self.metas = []
        if self.in_place_of is not None:
            self.metas = self.in_place_of.metas
            # the replica's own state: built (and so touched) before it heals
            self.into = make_state(self.total, self.n)
            for v in self.into["user"]["model"].values():
                v.zero_()
        for ns, host in self.where if self.in_place_of is None else []:
            p, meta = spawn("stepguard", self.total, self.n, self.reps, host, ns)
            self.ps.append(p)
            self.metas.append(meta)
        self.t = NativeTransport(
            TIMEOUT,
            hostname="127.0.0.1",
            streams_per_source=self.streams,
            in_place=self.into is not None,
        )

    def one(self) -> float:
        old = os.environ.get("STEPGUARD_SAME_HOST")
        if not self.same_host:
            os.environ["STEPGUARD_SAME_HOST"] = "0"
        try:
            t0 = time.perf_counter()
            sd = self.t.recv_checkpoint_striped(
                self.metas, STEP, TIMEOUT, into=self.into
            )
            dt = time.perf_counter() - t0
        finally:
            if old is None:
                os.environ.pop("STEPGUARD_SAME_HOST", None)
            else:
                os.environ["STEPGUARD_SAME_HOST"] = old
        check(sd, self.total, self.n)
        self.parts.append(dict(self.t.last_recv_times))
        moved = self.t.last_recv_stats
        key = "same_host_bytes" if self.same_host else "tcp_bytes"
        if self.where[0][0] is None and moved.get(key) != self.total:
            raise RuntimeError(f"expected every byte as {key}, got {moved}")
        if moved.get("in_place_bytes") != (self.total if self.into else 0):
            raise RuntimeError(f"destination not as asked: {moved}")
        return dt

    def stop(self) -> None:
        self.into = None
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
    def __init__(self, total: int, n: int, reps: int, streams: int) -> None:
        super().__init__(total, n, reps)
        self.streams = streams

    def start(self) -> None:
        import numpy

        self.p, addr = spawn(
            "loopback", self.total, self.n, self.reps, str(self.streams)
        )
        host, port = addr.rsplit(":", 1)
        self.addr = (host, int(port))
        self.dst = numpy.ones(self.total, dtype=numpy.uint8)  # touched once

    def one(self) -> float:
        view = memoryview(self.dst)
        conns = [socket.create_connection(self.addr) for _ in range(self.streams)]
        short: list = []

        def receive(i: int) -> None:
            lo, hi = share(self.total, self.streams, i)
            c = conns[i]
            c.sendall(bytes([i]))
            while lo < hi:
                k = c.recv_into(view[lo : min(lo + LOOP_SLICE, hi)])
                if k == 0:
                    short.append(i)
                    return
                lo += k

        ths = [threading.Thread(target=receive, args=(i,)) for i in range(self.streams)]
        t0 = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        dt = time.perf_counter() - t0
        for c in conns:
            c.close()
        if short:
            raise RuntimeError(f"loopback streams {short} closed early")
        return dt

    def stop(self) -> None:
        self.dst = None
        super().stop()


class Memcpy(Runner):
    def start(self) -> None:
        import numpy

        self.src = numpy.ones(self.total, dtype=numpy.uint8)
        self.dst = numpy.zeros(self.total, dtype=numpy.uint8)

    def one(self) -> float:
        import numpy

        t0 = time.perf_counter()
        numpy.copyto(self.dst, self.src)
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.src = self.dst = None


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
    ap.add_argument("--big-reps", type=int, default=3, help="reps for 1 GiB")
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
        reps = args.reps if total < (1 << 30) else args.big_reps
        local = [(None, "127.0.0.1")]
        if net:
            # the namespaces share this host's pid namespace: TCP, so that
            # the shaped links are what is measured
            runners = {
                "stepguard": Stepguard(
                    total, n, reps, args.streams, net.where[:1], same_host=False
                ),
                "stepguard-2src": Stepguard(
                    total, n, reps, args.streams, net.where, same_host=False
                ),
                "torchft-http": Http(total, n, reps, net.where[0]),
            }
        else:
            sg = Stepguard(total, n, reps, args.streams, local)
            sgt = Stepguard(total, n, reps, args.streams, local, same_host=False)
            runners = {
                "memcpy": Memcpy(total, n, reps),
                "loopback": Loopback(total, n, reps, args.streams),
                "stepguard": sg,
                "stepguard-tcp": sgt,
                "stepguard-inplace": Stepguard(
                    total, n, reps, args.streams, local, in_place_of=sg
                ),
                "stepguard-tcp-inplace": Stepguard(
                    total, n, reps, args.streams, local, same_host=False,
                    in_place_of=sgt,
                ),  # fmt: skip
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
            dest = DEST.get(kind, "")
            row[kind]["dest"] = dest
            print(
                f"{label:14s} {kind:22s} median {med * 1e3:8.1f} ms "
                f"{total / med / 1e9:6.2f} GB/s  (first {ts[0] * 1e3:7.1f} ms)"
                f"{'  dest: ' + dest if dest else ''}",
                flush=True,
            )
            parts = getattr(runners[kind], "parts", None)
            if parts:  # NativeTransport.last_recv_times, medians
                row[kind]["parts_ms"] = {
                    k: statistics.median(p[k] for p in parts) * 1e3 for k in parts[0]
                }
                print(
                    f"{'':14s} {'':22s} parts (ms): "
                    + " ".join(f"{k} {v:.1f}" for k, v in row[kind]["parts_ms"].items())
                )
        goals = {"loopback": 0.7, "torchft-http": 2.0}
        row["goals"] = {}
        for path in [
            "stepguard", "stepguard-tcp", "stepguard-inplace",
            "stepguard-tcp-inplace", "stepguard-2src",
        ]:  # fmt: skip
            if path not in row:
                continue
            for other in ["memcpy", "loopback", "torchft-http", "torchft-pg"]:
                if other not in row:
                    continue
                ratio = row[path]["gbps"] / row[other]["gbps"]
                row[f"{path}/{other}"] = ratio
                verdict = ""
                if other in goals:
                    met = ratio >= goals[other]
                    row["goals"][f"{path}/{other}"] = met
                    verdict = f"  goal >= {goals[other]}: {'met' if met else 'MISSED'}"
                print(f"{label:14s} {path:21s} / {other:13s} {ratio:6.2f}x{verdict}")
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
