"""Three replica groups, one SIGKILL, two lighthouses: how fast do the others move on?

Each replica is a real process that heartbeats every 100 ms and asks the
lighthouse for a quorum once per "step".  After a few steps one replica is
SIGKILLed.  The survivors cannot simply continue without it: the lighthouse
must first decide that it is gone.  The same run is made against
stepguard's lighthouse and against torchft's (the pinned torchft-nightly),
with the same flags (heartbeat timeout 5 s, torchft's default), and the
time from the kill to the survivors' next quorum is printed for both.

Run with: make demo
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPLICA = r"""
import json, sys, threading, time
from datetime import timedelta
from stepguard.coordination import LighthouseClient
addr, rid = sys.argv[1], sys.argv[2]
c = LighthouseClient(addr, timedelta(seconds=10))
def beat():
    while True:
        try:
            c.heartbeat(rid, timedelta(seconds=2))
        except Exception:
            pass
        time.sleep(0.1)
threading.Thread(target=beat, daemon=True).start()
step = 0
while True:
    try:
        q = c.quorum(rid, timedelta(seconds=60), step=step)
    except TimeoutError:
        continue
    print(json.dumps({"t": time.monotonic(), "id": q.quorum_id, "step": step,
                      "members": [m.replica_id for m in q.participants]}), flush=True)
    step += 1
    time.sleep(0.05)
"""

FLAGS = ["--min_replicas", "2", "--join_timeout_ms", "60000",
         "--quorum_tick_ms", "100", "--heartbeat_timeout_ms", "5000"]


def start_lighthouse(kind: str) -> tuple[subprocess.Popen, str]:
    """Starts a lighthouse on a free port and returns (process, address)."""
    venv_bin = Path(sys.executable).parent
    if kind == "stepguard":
        cmd = [str(venv_bin / "stepguard-lighthouse"), "--bind", "127.0.0.1:0", *FLAGS]
    else:
        cmd = [str(venv_bin / "torchft_lighthouse"), "--bind", "127.0.0.1:0", *FLAGS]
    env = dict(os.environ, RUST_LOG="info")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env)
    deadline = time.monotonic() + 30
    port = None
    lines: list[str] = []
    while time.monotonic() < deadline and port is None:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"(?:listening on|Lighthouse) .*?:(\d+)\b", line)
        m = m or re.search(r"http://[^\s:]+:(\d+)", line)
        if m:
            port = int(m.group(1))
    if port is None:
        p.kill()
        raise RuntimeError(f"{kind} lighthouse did not start:\n{''.join(lines)}")
    # keep draining its log so it never blocks on a full pipe
    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
    return p, f"http://127.0.0.1:{port}"


def run(kind: str) -> dict:
    lh, addr = start_lighthouse(kind)
    replicas: dict[str, subprocess.Popen] = {}
    events: list[dict] = []
    lock = threading.Lock()

    def reader(rid: str, p: subprocess.Popen) -> None:
        for line in p.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            ev["who"] = rid
            with lock:
                events.append(ev)

    try:
        for rid in ("replica_0", "replica_1", "replica_2"):
            p = subprocess.Popen([sys.executable, "-c", REPLICA, addr, rid],
                                 stdout=subprocess.PIPE, text=True)
            replicas[rid] = p
            threading.Thread(target=reader, args=(rid, p), daemon=True).start()
        # wait for a few full quorums
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with lock:
                full = [e for e in events if len(e["members"]) == 3]
            if len(full) >= 15:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"{kind}: no full quorums formed")
        victim = replicas["replica_2"]
        t_kill = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        deadline = t_kill + 30
        recovered = None
        while time.monotonic() < deadline and recovered is None:
            with lock:
                after = [e for e in events
                         if e["t"] > t_kill and "replica_2" not in e["members"]]
            if after:
                recovered = min(e["t"] for e in after) - t_kill
            time.sleep(0.01)
        with lock:
            steps = len(events)
        return {"kind": kind, "recovery_s": recovered, "quorums_seen": steps}
    finally:
        for p in replicas.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        lh.send_signal(signal.SIGTERM)
        try:
            lh.wait(timeout=10)
        except subprocess.TimeoutExpired:
            lh.kill()
            lh.wait()


def main() -> int:
    venv_bin = Path(sys.executable).parent
    if not shutil.which("torchft_lighthouse", path=str(venv_bin)):
        print("torchft_lighthouse is not installed (run scripts/bootstrap)")
        return 1
    print("3 replica groups heartbeat every 100 ms and ask for a quorum every step;")
    print("replica_2 is SIGKILLed. Time until the survivors' next quorum without it")
    print("(same flags for both lighthouses: --heartbeat_timeout_ms 5000):")
    results = [run("stepguard"), run("torchft")]
    for r in results:
        got = "no recovery within 30 s" if r["recovery_s"] is None else (
            f"{r['recovery_s'] * 1000:8.1f} ms")
        print(f"  {r['kind']:<10} {got}")
    ours, theirs = (r["recovery_s"] for r in results)
    ok = ours is not None and theirs is not None and ours < theirs
    if ok:
        print(f"  stepguard moved on {theirs / ours:.0f}x sooner: the killed "
              "replica's connection closed, no heartbeat timeout needed")
    print("lighthouse demo: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
