"""One group rank of a replica group, as a real process, for the manager
tests: joins a quorum every step, votes, and prints one JSON line per event.

    python manager_worker.py LIGHTHOUSE REPLICA_ID GROUP_RANK WORLD_SIZE DIR
        [--vote-no-at STEP] [--step-sleep S]

Group rank 0 starts the ManagerServer and writes its address to
DIR/REPLICA_ID.addr; the other ranks wait for that file.  Errors are
printed and the step is retried, so the process survives a lighthouse
restart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

from stepguard.coordination import ManagerClient, ManagerServer


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("lighthouse")
    ap.add_argument("replica_id")
    ap.add_argument("group_rank", type=int)
    ap.add_argument("world_size", type=int)
    ap.add_argument("dir")
    ap.add_argument("--vote-no-at", type=int, default=-1)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    a = ap.parse_args()
    addr_file = os.path.join(a.dir, a.replica_id + ".addr")
    server = None
    if a.group_rank == 0:
        server = ManagerServer(a.replica_id, a.lighthouse, "127.0.0.1",
                               "127.0.0.1:0", f"store-{a.replica_id}:1",
                               a.world_size, timedelta(milliseconds=50),
                               timedelta(seconds=10))
        tmp = addr_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(server.address())
        os.rename(tmp, addr_file)
    deadline = time.monotonic() + 60
    while not os.path.exists(addr_file):
        if time.monotonic() > deadline:
            emit(event="fatal", error="no manager address")
            return 2
        time.sleep(0.01)
    with open(addr_file) as f:
        addr = f.read()
    client = ManagerClient(addr, timedelta(seconds=10))
    emit(event="ready", pid=os.getpid())
    step = 0
    while True:
        try:
            q = client._quorum(a.group_rank, step, f"md-{a.replica_id}",
                               False, True, 0, timedelta(seconds=30))
        except (RuntimeError, TimeoutError) as e:
            emit(event="quorum_error", step=step, error=str(e)[:200])
            time.sleep(0.1)
            continue
        emit(event="quorum", step=step, quorum_id=q.quorum_id,
             replica_ids=q.replica_ids, heal=q.heal, max_step=q.max_step)
        if q.heal:
            step = q.max_step
        vote = step != a.vote_no_at
        if not vote:
            a.vote_no_at = -1  # once
        try:
            ok = client.should_commit(a.group_rank, step, vote,
                                      timedelta(seconds=30))
        except (RuntimeError, TimeoutError) as e:
            emit(event="commit_error", step=step, error=str(e)[:200])
            continue
        emit(event="commit", step=step, ok=ok, t=time.monotonic())
        if ok:
            step += 1
        time.sleep(a.step_sleep)


if __name__ == "__main__":
    sys.exit(main())
