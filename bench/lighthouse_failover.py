"""What a lighthouse failure costs a training job: the stall from a SIGKILL
of the lighthouse to every replica group committing two more steps.

Two configurations, alternating round by round in the same run (3 replica
groups of the tests' training worker, heartbeat timeout 2 s):

``single``   one lighthouse, SIGKILLed and started again at once on the
             same port (what an init system would do); the trainers wait
             out the outage (docs/lighthouse.md, "A lighthouse outage").
``etcd``     three lighthouses electing a leader in a one-member etcd on
             tmpfs (TTL 2 s, the default); the leader is SIGKILLed and not
             restarted.
``etcd-ttl1`` the same with ``--etcd_ttl_s 1`` (etcd 3.4's floor with the
             500 ms election timeout the helper gives etcd).

torchft is not measured: with its lighthouse gone its trainers' next
quorum fails (quorum_retries=0) and they exit; docs/lighthouse.md says so.
Two commits are needed after the kill because a step in flight may commit
without the lighthouse.  Uses the tests' Job harness
(tests/py/helpers/train_harness.py) and etcd helper.

    .venv/bin/python bench/lighthouse_failover.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "py" / "helpers"))

from etcd_util import EtcdCluster  # noqa: E402
from train_harness import Job, wait_for  # noqa: E402

RIDS = ("train_0", "train_1", "train_2")


def leader_index(addrs: list[str]) -> int | None:
    for i, a in enumerate(addrs):
        try:
            with urllib.request.urlopen(a + "/status", timeout=2) as r:
                if json.loads(r.read())["role"] == "leader":
                    return i
        except (OSError, ValueError):
            pass
    return None


def one_round(kind: str, tmp: Path) -> float:
    etcd = None
    args: tuple[str, ...] = ()
    n = 1
    if kind.startswith("etcd"):
        etcd = EtcdCluster(1, tmp).start()
        args = ("--etcd", etcd.endpoints, "--etcd_prefix",
                f"/bench/{uuid.uuid4().hex}", "--hostname", "127.0.0.1",
                "--etcd_ttl_s", "1" if kind == "etcd-ttl1" else "2")
        n = 3
    job = Job(tmp / "job", heartbeat_timeout_ms=2000, lighthouse_args=args,
              lighthouses=n)
    try:
        if etcd is not None:
            wait_for(lambda: leader_index(job.lh_addrs) is not None, 30, "a leader")
        for rid in RIDS:
            job.start_group(rid, 1, "--steps", "100000", "--step-sleep", "0.05")
        wait_for(lambda: job.all_committed(5, RIDS), 120, "5 commits", job)
        top = max(job.committed(rid) for rid in RIDS)
        t0 = time.monotonic()
        if etcd is not None:
            job.kill_lighthouse(leader_index(job.lh_addrs) or 0)
        else:
            job.kill_lighthouse()
            job.restart_lighthouse()
        wait_for(lambda: job.all_committed(top + 2, RIDS), 120,
                 "two more commits", job)
        return time.monotonic() - t0
    finally:
        job.close()
        if etcd is not None:
            etcd.stop()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--configs", default="single,etcd,etcd-ttl1")
    a = p.parse_args()
    kinds = a.configs.split(",")
    stalls: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(a.rounds):
        for kind in kinds:
            with tempfile.TemporaryDirectory(prefix="sg-failover-") as d:
                s = one_round(kind, Path(d))
            stalls[kind].append(s)
            print(f"round {r} {kind:9s} stall {s:.2f} s", flush=True)
    for kind, v in stalls.items():
        print(f"{kind:9s} median {statistics.median(v):.2f} s, "
              f"min {min(v):.2f}, max {max(v):.2f} ({len(v)} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
