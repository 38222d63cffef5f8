"""Parameter server: session setup, small round trips and weight pulls,
stepguard's against torchft's, in one run.

Three setups, each a server process and a client process on this host:

- ``ours-tcp``: stepguard's ParameterServer and client over ProcessGroupTCP
  (the default);
- ``ours-gloo``: stepguard's over ProcessGroupGloo (what interop with
  torchft needs);
- ``torchft``: torchft's ParameterServer and client (the installed wheel,
  imported normally) over its ProcessGroupGloo.

Every client opens ``--sessions`` sessions one after the other and, in
each, times: the setup (``new_session`` until it returns a configured
group), ``--pings`` round trips of one float (client to server and back,
two broadcasts), and ``--pulls`` pulls of ``--pull-mib`` MiB of float32
weights (one broadcast from the server).  The setups take turns for
``--rounds`` rounds, so the machine's load hits them alike.  It prints
medians and the ratio torchft / ours (> 1: ours is faster).

    python bench/parameter_server.py [--rounds 3] [--sessions 10] [--quick]

Results: bench/results/parameter_server.json and .md.  A benchmark, not a
test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "parameter_server.json"
TABLE = HERE / "results" / "parameter_server.md"
SETUPS = ("ours-tcp", "ours-gloo", "torchft")

# one script for both packages: {pkg} is stepguard or torchft
_COMMON = """
import json, sys, time, torch
from {pkg}.parameter_server import ParameterServer
from {pkg}.process_group import ProcessGroupGloo

PING, PULL, BYE = 1.0, 2.0, 0.0

class Bench(ParameterServer):
    {extra}
    def forward(self, session_id, pg):
        weights = torch.ones(int(sys.argv[2]))
        while True:
            op = torch.zeros(1)
            pg.broadcast_one(op, root=1).wait()
            if op.item() == PING:
                pg.broadcast_one(op, root=0).wait()
            elif op.item() == PULL:
                pg.broadcast_one(weights, root=0).wait()
            else:
                return
"""

_SERVER = """
ps = Bench(port=0)
print(ps.address(), flush=True)
sys.stdin.read()  # until the bench closes our stdin
"""

_CLIENT = """
addr, numel, sessions, pings, pulls = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6])
out = {"setup": [], "ping": [], "pull": []}
for i in range(sessions + 1):  # the first session warms up, unrecorded
    t0 = time.perf_counter()
    pg = Bench.new_session(addr)
    setup = time.perf_counter() - t0
    ping, pull = [], []
    one = torch.zeros(1)
    for _ in range(pings):
        t0 = time.perf_counter()
        one.fill_(PING)
        pg.broadcast_one(one, root=1).wait()
        pg.broadcast_one(one, root=0).wait()
        ping.append(time.perf_counter() - t0)
    w = torch.zeros(numel)
    for _ in range(pulls):
        t0 = time.perf_counter()
        pg.broadcast_one(torch.tensor([PULL]), root=1).wait()
        pg.broadcast_one(w, root=0).wait()
        pull.append(time.perf_counter() - t0)
    assert w[0].item() == 1.0 and w[-1].item() == 1.0
    pg.broadcast_one(torch.tensor([BYE]), root=1).wait()
    pg.shutdown()
    if i:
        out["setup"].append(setup)
        out["ping"] += ping
        out["pull"] += pull
print(json.dumps(out), flush=True)
"""

_EXTRA = {
    "ours-tcp": 'backend = "tcp"',
    "ours-gloo": 'backend = "gloo"',
    "torchft": "@classmethod\n    def new_process_group(cls):\n        return ProcessGroupGloo()",
}


def _script(setup: str, body: str) -> str:
    pkg = "torchft" if setup == "torchft" else "stepguard"
    return _COMMON.format(pkg=pkg, extra=_EXTRA[setup]) + body


def _env() -> dict:
    env = dict(os.environ)
    env.pop("STEPGUARD_TORCHFT", None)  # torchft is the real one here
    env.setdefault("STEPGUARD_LOG", "error")
    return env


def run_one(setup: str, args: argparse.Namespace) -> dict:
    numel = int(args.pull_mib * (1 << 20)) // 4
    # torchft's server logs a traceback each time a session ends (its
    # request handler flushes a connection it closed itself): its stderr
    # goes to a file, not the terminal
    log = open(os.path.join(tempfile.gettempdir(), f"ps-bench-{setup}.server.log"), "w")
    server = subprocess.Popen(
        [sys.executable, "-c", _script(setup, _SERVER), "-", str(numel)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=_env(),
    )
    log.close()
    try:
        addr = server.stdout.readline().strip()
        if not addr.startswith("http://"):
            raise RuntimeError(f"{setup}: the server did not start")
        client = subprocess.run(
            [sys.executable, "-c", _script(setup, _CLIENT), addr, str(numel),
             str(args.sessions), str(args.pings), str(args.pulls)],
            capture_output=True, text=True, env=_env(), timeout=600,
        )
        if client.returncode != 0:
            raise RuntimeError(f"{setup}: client failed\n{client.stderr[-3000:]}")
        return json.loads(client.stdout.strip().splitlines()[-1])
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--pings", type=int, default=50)
    ap.add_argument("--pulls", type=int, default=5)
    ap.add_argument("--pull-mib", type=float, default=64)
    ap.add_argument("--quick", action="store_true", help="1 round, 3 sessions, 8 MiB")
    args = ap.parse_args()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.rounds, args.sessions, args.pull_mib = 1, 3, 8
    try:
        import torchft  # noqa: F401
    except ImportError:
        print("bench/parameter_server.py: torchft is not installed; it is the competitor", file=sys.stderr)
        return 2

    samples = {s: {"setup": [], "ping": [], "pull": []} for s in SETUPS}
    for r in range(args.rounds):
        for setup in SETUPS:
            got = run_one(setup, args)
            for k, v in got.items():
                samples[setup][k] += v
            print(f"round {r + 1}/{args.rounds} {setup}: setup "
                  f"{statistics.median(got['setup']) * 1e3:.1f} ms", flush=True)

    mib = args.pull_mib
    med = {s: {k: statistics.median(v) for k, v in d.items()} for s, d in samples.items()}
    lines = [
        f"Parameter server on one host: {args.rounds} rounds x {args.sessions} sessions; "
        f"{args.pings} pings and {args.pulls} pulls of {mib:g} MiB per session; medians",
        "",
        "| setup | session setup ms | ping (round trip) us | pull ms | pull GB/s | "
        "setup: torchft/ours | ping: torchft/ours | pull: torchft/ours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ft = med["torchft"]
    for s in SETUPS:
        m = med[s]
        gbs = mib * (1 << 20) / m["pull"] / 1e9
        ratios = ("- | - | -" if s == "torchft" else
                  f"{ft['setup'] / m['setup']:.2f} | {ft['ping'] / m['ping']:.2f} | "
                  f"{ft['pull'] / m['pull']:.2f}")
        lines.append(f"| {s} | {m['setup'] * 1e3:.1f} | {m['ping'] * 1e6:.0f} | "
                     f"{m['pull'] * 1e3:.1f} | {gbs:.2f} | {ratios} |")
    table = "\n".join(lines)
    print()
    print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "medians": med, "samples": samples}, indent=1))
    TABLE.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
