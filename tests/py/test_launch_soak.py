"""The launcher's soak fault kinds against a fake worker: a kill of every
rank of a group, a fault struck at an armed point (hook_point), and a
lighthouse SIGKILLed and restarted on the same port (with and without its
quorum id file)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from stepguard.launch import LaunchConfig, Launcher, parse_failure_spec

WORKER = r'''
import os, sys, time
from stepguard.launch import report, stop_step
from stepguard.launch.worker import hook_point

report("ready")
step = 0
while True:
    stop = stop_step()
    if stop is not None and step >= stop:
        sys.exit(0)
    time.sleep(0.2 if os.environ.get("FAKE_SLOW_GROUP") == os.environ["REPLICA_GROUP_ID"]
               else 0.05)
    if os.environ.get("FAKE_HOOK") and step >= 3 and os.environ.get(
            "FAKE_HOOK_GROUP", os.environ["REPLICA_GROUP_ID"]) == os.environ["REPLICA_GROUP_ID"]:
        hook_point(os.environ["FAKE_HOOK"], wait_s=20, step=step)
    report("step", step=step, committed=True, quorum_id=1, participants=1)
    step += 1
'''


def _config(tmp_path: Path, **kw) -> LaunchConfig:
    p = tmp_path / "worker.py"
    p.write_text(WORKER)
    kw.setdefault("lighthouse", "http://127.0.0.1:9")  # never contacted
    kw.setdefault("duration", 60.0)  # a hard bound; every test ends sooner
    return LaunchConfig(cmd=[sys.executable, str(p)], timeline=str(tmp_path / "tl.jsonl"),
                        log_dir=str(tmp_path / "logs"), stop_file=str(tmp_path / "stop"),
                        quiet=True, **kw)


def _timeline(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _of(tl: list[dict], event: str, **match) -> list[dict]:
    return [r for r in tl if r["event"] == event
            and all(r.get(k) == v for k, v in match.items())]


def test_kill_every_rank_of_a_group(tmp_path: Path) -> None:
    def on_event(rec: dict) -> None:
        if rec["event"] == "commit" and rec["group"] == 0 and rec["step"] == 5 \
                and rec["incarnation"] == 0 and rec["rank"] == 0:
            launcher.inject(parse_failure_spec("kill:start=0s,rank=all,group=0"))
        if rec["event"] == "restart" and not launcher._finishing:
            launcher.finish(step=0)

    launcher = Launcher(_config(tmp_path, groups=2, nproc_per_group=2), on_event=on_event)
    assert launcher.run() == 0
    tl = _timeline(tmp_path / "tl.jsonl")
    inj = _of(tl, "inject", kind="kill")
    assert len(inj) == 1 and inj[0]["rank"] == "all" and len(inj[0]["pids"]) == 2
    for pid in inj[0]["pids"]:
        ex = _of(tl, "exit", pid=pid)
        assert len(ex) == 1 and ex[0]["signal"] == "SIGKILL", ex


@pytest.mark.parametrize("kind,point", [("kill_source", "serve"),
                                        ("kill_after_heal", "after_heal")])
def test_an_armed_point_is_struck_where_it_is_reached(tmp_path: Path, kind, point) -> None:
    """The launcher arms the point (and kills a group so a heal comes);
    the first rank to reach it reports, waits, and its group is SIGKILLed
    there, with the step it was at."""
    hooks = tmp_path / "hooks"
    state = {"armed": False}
    commits: dict[int, int] = {}

    def on_event(rec: dict) -> None:
        if rec["event"] == "commit":
            commits[rec["group"]] = commits.get(rec["group"], 0) + 1
        # every group has committed (the launcher marks a group after its
        # first commit's record): none is starting, so a trigger kill comes
        if len(commits) == 3 and min(commits.values()) >= 2 and not state["armed"]:
            state["armed"] = True
            spec = parse_failure_spec(f"{kind}:start=0s,duration=30s")
            spec.tag = "mine"
            launcher.inject(spec)
        if rec["event"] == "inject" and rec["kind"] == kind and not launcher._finishing:
            launcher.finish(step=0)

    cfg = _config(tmp_path, groups=3, hook_dir=str(hooks), env={"FAKE_HOOK": point})
    launcher = Launcher(cfg, on_event=on_event)
    assert launcher.run() == 0
    tl = _timeline(tmp_path / "tl.jsonl")
    arm = _of(tl, "arm", kind=kind)
    assert len(arm) == 1 and arm[0]["point"] == point and arm[0]["tag"] == "mine"
    trigger = _of(tl, "inject", kind="kill", tag="mine:heal_trigger")
    assert len(trigger) == 1, "no group was restarting, so one is killed first"
    hook = _of(tl, "hook", point=point)
    struck = _of(tl, "inject", kind=kind)
    assert len(hook) == 1 and len(struck) == 1, (hook, struck)
    s = struck[0]
    assert s["tag"] == "mine" and s["point"] == point
    assert (s["group"], s["incarnation"], s["step"]) == \
        (hook[0]["group"], hook[0]["incarnation"], hook[0]["step"])
    ex = _of(tl, "exit", pid=hook[0]["pid"])
    assert len(ex) == 1 and ex[0]["signal"] == "SIGKILL", ex
    assert not (hooks / point).exists()  # claimed, not left armed
    assert not _of(tl, "hook_timeout")


def test_an_armed_point_nobody_reaches_is_disarmed(tmp_path: Path) -> None:
    hooks = tmp_path / "hooks"

    def on_tick(la: Launcher) -> None:
        if la.elapsed() > 1.0 and not la.injectors:
            la.inject(parse_failure_spec("kill_source:start=0s,duration=1s"))

    def on_event(rec: dict) -> None:
        if rec["event"] == "inject_skipped" and not launcher._finishing:
            launcher.finish(step=0)

    cfg = _config(tmp_path, groups=2, hook_dir=str(hooks))  # the worker never calls it
    launcher = Launcher(cfg, on_tick=on_tick, on_event=on_event)
    assert launcher.run() == 0
    tl = _timeline(tmp_path / "tl.jsonl")
    sk = _of(tl, "inject_skipped", kind="kill_source")
    assert len(sk) == 1 and "serve" in sk[0]["reason"]
    assert not (hooks / "serve").exists()
    assert not _of(tl, "inject", kind="kill_source")


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


@pytest.mark.parametrize("id_file", [True, False])
def test_lighthouse_killed_and_restarted_on_its_port(tmp_path: Path, id_file) -> None:
    qid = tmp_path / "qid"
    seen: dict[str, object] = {}

    def on_event(rec: dict) -> None:
        if rec["event"] == "commit" and rec["step"] == 3 and "asked" not in seen:
            seen["asked"] = True
            seen["argv0"] = _cmdline(launcher.lighthouse_pids()[0])
            launcher.inject(parse_failure_spec(
                f"lighthouse:start=0s,duration=0.5s,id_file={'yes' if id_file else 'no'}"))
        if rec["event"] == "lighthouse_restart" and not launcher._finishing:
            seen["pids"] = launcher.lighthouse_pids()
            seen["argv"] = _cmdline(seen["pids"][0])
            launcher.finish(step=0)

    cfg = _config(tmp_path, groups=1, lighthouse=None, quorum_id_file=str(qid))
    launcher = Launcher(cfg, on_event=on_event)
    assert launcher.run() == 0
    tl = _timeline(tmp_path / "tl.jsonl")
    first = _of(tl, "lighthouse")
    assert len(first) == 2 and first[0]["address"] == first[1]["address"]
    assert seen["argv0"][seen["argv0"].index("--quorum_id_file") + 1] == str(qid)
    inj = _of(tl, "inject", kind="lighthouse")
    assert len(inj) == 1 and inj[0]["pid"] == first[0]["pid"] and inj[0]["id_file"] is id_file
    rs = _of(tl, "lighthouse_restart")
    assert len(rs) == 1 and rs[0]["down_s"] >= 0.5 and rs[0]["address"] == first[0]["address"]
    assert seen["pids"] == [first[1]["pid"]]
    assert ("--quorum_id_file" in seen["argv"]) is id_file
    assert not os.path.exists(f"/proc/{first[0]['pid']}/cmdline") or \
        Path(f"/proc/{first[0]['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"



def test_the_last_group_holding_the_state_is_spared(tmp_path: Path) -> None:
    """With spare_last_holder, a kill that could only hit the one group
    holding the state is skipped, and a rank of that group reaching an
    armed point is let go (and the point armed again) instead of killed."""
    state = {"asked": False}

    def on_event(rec: dict) -> None:
        if rec["event"] == "commit" and rec["step"] >= 5 and not state["asked"]:
            state["asked"] = True
            launcher.inject(parse_failure_spec("kill:start=0s,rank=all"))
            launcher.inject(parse_failure_spec("kill_source:start=0s,duration=30s"))
        if rec["event"] == "hook" and not launcher._finishing and \
                len(_of(_timeline(tmp_path / "tl.jsonl"), "hook")) >= 2:
            launcher.finish(step=0)

    cfg = _config(tmp_path, groups=1, hook_dir=str(tmp_path / "hooks"),
                  spare_last_holder=True, env={"FAKE_HOOK": "serve"})
    launcher = Launcher(cfg, on_event=on_event)
    assert launcher.run() == 0
    tl = _timeline(tmp_path / "tl.jsonl")
    assert not _of(tl, "inject")
    skipped = _of(tl, "inject_skipped", kind="kill")
    # the kill asked for, and the heal trigger of kill_source
    assert len(skipped) == 2 and all("holding the state" in s["reason"] for s in skipped)
    hooks = _of(tl, "hook", point="serve")
    assert len(hooks) >= 2 and len({h["step"] for h in hooks}) >= 2  # it went on
    assert not _of(tl, "hook_timeout") and not _of(tl, "exit", returncode=-9)


def test_a_group_behind_does_not_hold_the_state_for_the_last_holder(tmp_path: Path) -> None:
    """A group that has not committed the steps another has (here a slow
    one, restarted from step 0; in the soak, one that discarded the step the
    source committed, then healed from it) cannot give that state back: a
    recovery source reaching its armed point is let go while the only other
    group is behind it, and no kill hits it.  (Seed 1's short soak: the
    heal trigger killed one holder, the other discarded that step and
    healed from the third, and the strike at that source left no replica
    holding the job's state: the job started over.)"""
    seen = {"killed": False, "armed": False, "hooks_after": 0}
    behind_commits: list[int] = []

    def on_event(rec: dict) -> None:
        if rec["event"] == "commit" and rec["group"] == 0 and rec["step"] >= 20 \
                and not seen["killed"]:
            seen["killed"] = True
            launcher.inject(parse_failure_spec("kill:start=0s,rank=all,group=1"))
        if rec["event"] == "restart" and rec["group"] == 1 and not seen["armed"]:
            seen["armed"] = True  # a group is starting: no heal trigger
            launcher.inject(parse_failure_spec("kill_source:start=0s,duration=30s"))
        if rec["event"] == "commit" and rec["group"] == 1 and rec["incarnation"] == 1:
            behind_commits.append(rec["step"])
        if rec["event"] == "hook" and len(behind_commits) >= 3:
            seen["hooks_after"] += 1
            if seen["hooks_after"] >= 3 and not launcher._finishing:
                launcher.finish(step=0)
        if rec["event"] == "inject" and rec["kind"] == "kill_source" \
                and not launcher._finishing:
            launcher.finish(step=0)

    cfg = _config(tmp_path, groups=2, hook_dir=str(tmp_path / "hooks"),
                  spare_last_holder=True,
                  env={"FAKE_HOOK": "serve", "FAKE_HOOK_GROUP": "0", "FAKE_SLOW_GROUP": "1"})
    launcher = Launcher(cfg, on_event=on_event)
    assert launcher.run() == 0
    tl = _timeline(tmp_path / "tl.jsonl")
    assert not _of(tl, "inject", kind="kill_source"), "struck the last holder"
    assert not _of(tl, "inject_skipped", kind="kill")  # the group kill was not spared
    assert seen["hooks_after"] >= 3  # the source reached the point, behind_commits later
    assert len(_of(tl, "exit", group=0, returncode=-9)) == 0
    assert not _of(tl, "hook_timeout")


def test_a_group_back_from_a_hang_holds_the_state_again(tmp_path: Path) -> None:
    """A group hung and resumed that commits steps again (since the vote
    cutoff a hang no longer ends a group) counts as a holder once more, and
    only a group at the other's step does.  (A group once hung used to
    count as no holder for the rest of its incarnation, so the soak skipped
    faults and let struck sources go.)  The launcher's rule, fed commits."""
    launcher = Launcher(_config(tmp_path, groups=2, spare_last_holder=True))
    g0, g1 = launcher.groups
    for g in (g0, g1):
        g.state, g.first_commit_seen, g.incarnation, g.last_step = "running", True, 0, 10

    def commit(g, step: int) -> None:
        launcher._worker_event({"event": "step", "group": g.gid, "rank": 0,
                                "incarnation": 0, "step": step, "committed": True})

    assert not launcher._last_holder(g0)
    g1.hung, g1.stopped = True, True  # SIGSTOPped
    assert launcher._last_holder(g0)
    g1.stopped = False  # SIGCONT
    for step in (11, 12):
        commit(g0, step)
        commit(g1, step)
        assert launcher._last_holder(g0), step
    commit(g0, 13)
    commit(g1, 13)  # its third since SIGCONT
    assert not g1.hung and not launcher._last_holder(g0)
    commit(g0, 14)  # g1 has not committed step 14 yet
    assert launcher._last_holder(g0) and not launcher._last_holder(g1)


def test_an_armed_point_reached_after_injections_stopped_is_let_go(tmp_path: Path) -> None:
    state = {"armed": False}

    def on_event(rec: dict) -> None:
        if rec["event"] == "arm":
            launcher.stop_injecting()  # before any rank can reach the point
        if rec["event"] == "commit" and rec["step"] >= 5 and not state["armed"]:
            state["armed"] = True
            launcher.inject(parse_failure_spec("kill_after_heal:start=0s,duration=30s"))
        if rec["event"] == "inject_skipped" and rec.get("kind") == "kill_after_heal" \
                and not launcher._finishing:
            launcher.finish(step=0)

    cfg = _config(tmp_path, groups=3, hook_dir=str(tmp_path / "hooks"),
                  env={"FAKE_HOOK": "after_heal"})
    launcher = Launcher(cfg, on_event=on_event)
    assert launcher.run() == 0
    tl = _timeline(tmp_path / "tl.jsonl")
    assert len(_of(tl, "hook", point="after_heal")) == 1
    assert not _of(tl, "inject", kind="kill_after_heal")
    sk = _of(tl, "inject_skipped", kind="kill_after_heal")
    assert len(sk) == 1 and "stopped" in sk[0]["reason"]
    assert not _of(tl, "hook_timeout")
