"""The manager in real processes: a lighthouse and replica groups of two
group ranks, each rank its own process (tests/py/helpers/manager_worker.py).

Speed-dependent properties are proven with the slow path made impossibly
slow (join timeout 600 s, heartbeat timeout 60 s) and a loose bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lighthouse_util import (
    OURS_CODE,
    LighthouseProc,
    LogProc,
    spawn_logged,
    wait_until,
)

WORKER = str(Path(__file__).parent / "helpers" / "manager_worker.py")
SLOW = ("--join_timeout_ms", "600000", "--heartbeat_timeout_ms", "60000")


class Rank(LogProc):
    def events(self, kind: str | None = None) -> list[dict]:
        out = []
        for line in list(self.lines):
            if line.startswith("{"):
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if kind is None or e.get("event") == kind:
                    out.append(e)
        return out

    def committed(self) -> int:
        steps = [e["step"] for e in self.events("commit") if e["ok"]]
        return max(steps, default=-1)


def start_group(procs, lh_addr: str, rid: str, tmp: Path, *extra: str) -> list[Rank]:
    ranks = []
    for g in range(2):
        # logs apart from the JSON lines, so the two never interleave
        with open(tmp / f"{rid}{g}.log", "ab") as log:
            p = subprocess.Popen(
                [sys.executable, WORKER, lh_addr, rid, str(g), "2", str(tmp),
                 *(extra if g == 1 else ())],
                stdout=subprocess.PIPE, stderr=log)
        procs.popens.append(p)
        ranks.append(Rank(p))
    return ranks


def start_lighthouse(procs, port: int = 0, *flags: str,
                     min_replicas: int = 2) -> LighthouseProc:
    return LighthouseProc(spawn_logged(
        procs, OURS_CODE, "--bind", f"127.0.0.1:{port}", "--min_replicas",
        str(min_replicas), *flags))


def all_committed(groups: dict[str, list[Rank]], step: int) -> bool:
    return all(r.committed() >= step for rs in groups.values() for r in rs)


def test_three_groups_many_steps_and_a_no_vote(procs, tmp_path):
    # every quorum holds all three groups: with fewer, a group that starts
    # or steps late is left out of a quorum (and heals past it), and step 5
    # would not be the one b refuses beside a and c
    lh = start_lighthouse(procs, 0, "--join_timeout_ms", "200", min_replicas=3)
    groups = {rid: start_group(procs, lh.addr, rid, tmp_path,
                               *(["--vote-no-at", "5"] if rid == "b" else []))
              for rid in ("a", "b", "c")}
    wait_until(lambda: all_committed(groups, 12), 90, "12 committed steps")
    for rid, ranks in groups.items():
        for r in ranks:
            first5 = [e for e in r.events("commit") if e["step"] == 5][0]
            # the no vote of b's rank 1 refuses the step in both of b's
            # ranks and nowhere else
            assert first5["ok"] == (rid != "b"), (rid, first5)
    # within a group both ranks saw the same quorums
    for ranks in groups.values():
        ids = [[e["quorum_id"] for e in r.events("quorum")][:10] for r in ranks]
        assert ids[0] == ids[1]


@pytest.mark.parametrize("victim_rank", [0, 1])
def test_sigkill_of_a_group_rank_excludes_its_group(procs, tmp_path, victim_rank):
    lh = start_lighthouse(procs, 0, *SLOW)
    groups = {rid: start_group(procs, lh.addr, rid, tmp_path)
              for rid in ("a", "b", "c")}
    a0 = groups["a"][0]
    wait_until(lambda: any(e["replica_ids"] == ["a", "b", "c"]
                           for e in a0.events("quorum")), 90,
               "a quorum of all three groups")
    wait_until(lambda: all_committed(groups, 3), 90, "3 committed steps")
    victim = groups["c"][victim_rank]
    before = len(a0.events("quorum"))
    t0 = time.monotonic()
    os.kill(victim.popen.pid, signal.SIGKILL)

    def survivors_moved_on():
        return any(e["replica_ids"] == ["a", "b"]
                   for e in a0.events("quorum")[before:])

    wait_until(survivors_moved_on, 10,
               "a quorum without group c within 10 s (join timeout 600 s)")
    assert time.monotonic() - t0 < 10
    # and the survivors keep committing
    done = a0.committed()
    wait_until(lambda: a0.committed() >= done + 3, 30,
               "survivors commit again")


def test_lighthouse_restart_mid_run(procs, tmp_path):
    lh = start_lighthouse(procs, 0, "--join_timeout_ms", "200")
    port = lh.port  # bound by the lighthouse itself: nothing can take it first
    groups = {rid: start_group(procs, lh.addr, rid, tmp_path) for rid in ("a", "b")}
    wait_until(lambda: all_committed(groups, 3), 90, "3 committed steps")
    ids_before = max(e["quorum_id"] for e in groups["a"][0].events("quorum"))
    lh.popen.kill()
    lh.wait_exit(10)
    stalled = groups["a"][0].committed()
    time.sleep(1.0)
    lh2 = wait_until(lambda: _try_start(procs, port), 30, "lighthouse restart")
    assert lh2.port == port
    wait_until(lambda: all_committed(groups, stalled + 3), 60,
               "commits resume after the restart")
    ids_after = max(e["quorum_id"] for e in groups["a"][0].events("quorum"))
    assert ids_after > ids_before


def _try_start(procs, port):
    try:
        return start_lighthouse(procs, port, "--join_timeout_ms", "200")
    except AssertionError:
        return None
