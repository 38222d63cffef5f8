"""A fault-tolerant parameter server: workers come and go, the model stays.

The server holds the weights of a linear model.  Each worker process opens
a session (``ModelServer.new_session``), then loops: pull the weights,
compute a gradient on its own slice of a synthetic regression problem, push
the gradient; the server applies it (SGD) as it arrives.  Partway through,
one worker is killed with SIGKILL: only its session fails, the other
workers go on, and a replacement worker opens a new session.  At the end
the script prints the loss of the served weights before and after, and the
server's session counters.

Each operation on a session is a broadcast between its two members (the
server is rank 0, the worker rank 1); a first one-element broadcast from
the worker says which operation follows.

Run with:

    python examples/parameter_server.py [--workers 3] [--steps 200] [--backend tcp|gloo]

``--backend gloo`` uses Gloo process groups, which is what a torchft worker
(``torchft.parameter_server``) needs to join this server.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch

from stepguard.parameter_server import ParameterServer
from stepguard.process_group import ProcessGroup

DIM = 64
BYE, PULL, PUSH = 0.0, 1.0, 2.0


def problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A regression problem: features X, targets y = X @ w_true + noise."""
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(DIM, generator=g)
    x = torch.randn(4096, DIM, generator=g)
    y = x @ w_true + 0.01 * torch.randn(4096, generator=g)
    return x, y, w_true


class ModelServer(ParameterServer):
    """Serves one weight vector; applies pushed gradients with SGD."""

    session_timeout = timedelta(seconds=30)
    lr = 0.05

    def __init__(self) -> None:
        super().__init__(port=0)
        self.weights = torch.zeros(DIM)
        self.updates = 0
        self._lock = threading.Lock()

    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        while True:
            op = torch.zeros(1)
            pg.broadcast_one(op, root=1).wait()
            if op.item() == PULL:
                with self._lock:
                    w = self.weights.clone()
                pg.broadcast_one(w, root=0).wait()
            elif op.item() == PUSH:
                grad = torch.zeros(DIM)
                pg.broadcast_one(grad, root=1).wait()
                with self._lock:
                    self.weights -= self.lr * grad
                    self.updates += 1
            else:
                return


def worker(address: str, rank: int, workers: int, steps: int) -> None:
    x, y, _ = problem()
    mine = slice(rank * len(x) // workers, (rank + 1) * len(x) // workers)
    x, y = x[mine], y[mine]
    pg = ModelServer.new_session(address)
    try:
        for step in range(steps):
            pg.broadcast_one(torch.tensor([PULL]), root=1).wait()
            w = torch.zeros(DIM)
            pg.broadcast_one(w, root=0).wait()
            grad = 2 * x.T @ (x @ w - y) / len(x)
            pg.broadcast_one(torch.tensor([PUSH]), root=1).wait()
            pg.broadcast_one(grad, root=1).wait()
            print(f"step {step}", flush=True)
            time.sleep(0.005)
        pg.broadcast_one(torch.tensor([BYE]), root=1).wait()
    finally:
        pg.shutdown()


def loss(w: torch.Tensor) -> float:
    x, y, _ = problem()
    return float(((x @ w - y) ** 2).mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--backend", choices=("tcp", "gloo"), default="tcp")
    ap.add_argument("--worker", nargs=2, metavar=("ADDRESS", "RANK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    # the class attribute picks both sides' process groups
    ModelServer.backend = args.backend
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.workers, args.steps)
        return 0

    server = ModelServer()
    start = loss(server.weights)
    print(f"server at {server.address()} ({args.backend}), loss {start:.4f}", flush=True)

    def spawn(rank: int) -> subprocess.Popen:
        cmd = [sys.executable, os.path.abspath(__file__), "--workers", str(args.workers),
               "--steps", str(args.steps), "--backend", args.backend,
               "--worker", server.address(), str(rank)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    procs = [spawn(r) for r in range(args.workers)]
    try:
        victim = procs[0]
        for _ in range(args.steps // 4):  # let the victim get a quarter through
            if not victim.stdout.readline():
                break
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        print(f"killed worker 0 (pid {victim.pid})", flush=True)
        procs.append(spawn(0))  # its replacement opens a new session
        rcs = [p.wait(timeout=300) for p in procs[1:]]
        for p in procs[1:]:
            p.stdout.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    deadline = time.monotonic() + 30
    while server.sessions() and time.monotonic() < deadline:
        time.sleep(0.05)
    end = loss(server.weights)
    st = server.stats()
    server.shutdown()
    print(f"loss {start:.4f} -> {end:.4f} after {server.updates} updates")
    print(f"sessions: {st['sessions_started']} started, {st['sessions_finished']} finished, "
          f"{st['sessions_failed']} failed (the killed worker's)")
    ok = all(rc == 0 for rc in rcs) and st["sessions_failed"] == 1 and end < start / 10
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
