"""The soak's history checker over synthetic histories: a clean history is
clean, and each kind of violation is reported with its step, replica and
incarnation (stepguard.soak.checker; the soak itself: docs/soak.md)."""

from __future__ import annotations

import copy
import json

import pytest

from stepguard.soak import checker, goodput
from stepguard.soak.checker import Bounds, History, check
from stepguard.soak.schedule import KINDS, make_schedule

REPLICAS = ("soak_0", "soak_1", "soak_2")


def _h(step: int, rank: int) -> str:
    return f"state-{step}-{rank}"


def clean() -> History:
    """Three replicas of two ranks commit steps 0..19 in quorum 1 (steps
    0..9) and quorum 2 (10..19); soak_2 is killed at t=105, restarted at
    106, heals to step 13 from soak_0 and commits 13.. in quorum 3; one
    discarded step leaves the state alone; the run finishes and ends."""
    steps = []
    t = 100.0
    for s in range(20):
        for g, rid in enumerate(REPLICAS):
            q = 1 if s < 10 else 2
            members = list(REPLICAS)
            inc = 0
            if rid == "soak_2" and s >= 10:
                if s < 13:
                    continue  # dead and restarting
                inc, q = 1, 3
            if s >= 13:
                q = 3
            for rank in (0, 1):
                steps.append({"kind": "step", "step": s, "committed": True, "quorum_id": q,
                              "members": members, "max_step": s, "participants": 3,
                              "hash_after": _h(s, rank), "replica_id": rid, "group": g,
                              "rank": rank, "incarnation": inc, "t": t + s})
        if s == 12:
            for rank in (0, 1):
                steps.append({"kind": "heal", "step": 13, "hash": _h(12, rank),
                              "source": "soak_0", "replica_id": "soak_2", "group": 2,
                              "rank": rank, "incarnation": 1, "t": t + s + 0.5})
    # quorum 2 (steps 10..12) has two members only
    for r in steps:
        if r.get("quorum_id") == 2:
            r["members"] = ["soak_0", "soak_1"]
            r["participants"] = 2
    steps.append({"kind": "step", "step": 20, "committed": False, "quorum_id": 3,
                  "members": list(REPLICAS), "max_step": 20, "participants": None,
                  "hash_before": _h(19, 0), "hash_after": _h(19, 0), "replica_id": "soak_1",
                  "group": 1, "rank": 0, "incarnation": 0, "t": 121.0})
    tl = [
        {"event": "start", "t": 90.0},
        {"event": "launch", "t": 90.0, "group": 0, "incarnation": 0, "pids": [1, 2]},
        {"event": "inject", "t": 109.5, "failure": 1, "kind": "kill", "group": 2,
         "rank": "all", "incarnation": 0, "tag": "kill_group#0"},
        {"event": "exit", "t": 109.6, "group": 2, "rank": 0, "incarnation": 0,
         "returncode": -9},
        {"event": "recovery", "t": 110.0, "kind": "survivors", "failure": 1, "victim": 2,
         "group": 0, "duration_s": 0.5},
        {"event": "restart", "t": 109.8, "group": 2, "incarnation": 1, "pids": [7, 8]},
        {"event": "recovery", "t": 113.0, "kind": "rejoin", "group": 2, "incarnation": 1,
         "duration_s": 3.2},
        {"event": "finish", "t": 125.0, "stop_step": 21},
        {"event": "end", "t": 126.0},
    ]
    lh = [{"t": 90.0 + 5 * i, "pid": 50, "rss_kib": 20000 + (i % 3), "fds": 12}
          for i in range(30)]
    return History(tl, steps, lh, {"processes": [], "namespaces": [], "cgroups": []})


def find(h: History, **match):
    return next(r for r in h.steps if all(r.get(k) == v for k, v in match.items()))


def only(vs, rule):
    assert vs, "the violation was not reported"
    assert {v.rule for v in vs} == {rule}, [str(v) for v in vs]
    return vs


def test_a_clean_history_is_clean():
    vs = check(clean(), Bounds(min_replicas=2))
    assert vs == [], [str(v) for v in vs]
    assert checker.summarize(vs).splitlines()[0] == "violations: 0"


def test_quorum_id_going_backwards_is_reported():
    h = clean()
    r = find(h, replica_id="soak_1", rank=1, step=15)
    r["quorum_id"], r["members"] = 2, ["soak_0", "soak_1"]
    vs = check(h)
    v = next(v for v in vs if v.rule == "quorum_id_backwards")
    assert v.step == 15
    assert (v.replica, v.rank, v.incarnation) == ("soak_1", 1, 0)
    # the same step also saw members quorum 2 did not have
    h2 = clean()
    find(h2, replica_id="soak_0", rank=0, step=11)["quorum_id"] = 1
    assert "quorum_id_backwards" in {v.rule for v in check(h2)}


def test_one_quorum_id_with_two_member_sets_is_reported():
    h = clean()
    r = find(h, replica_id="soak_1", rank=0, step=5)
    r["members"] = ["soak_0", "soak_1"]
    v = only(check(h), "quorum_members_differ")[0]
    assert (v.step, v.replica, v.rank, v.incarnation) == (5, "soak_1", 0, 0)


def test_members_of_a_quorum_seeing_different_max_step_is_reported():
    h = clean()
    find(h, replica_id="soak_2", rank=1, step=15)["max_step"] = 14
    v = only(check(h), "quorum_max_step_differs")[0]
    assert (v.step, v.replica, v.rank, v.incarnation) == (15, "soak_2", 1, 1)


def test_a_commit_with_too_few_participants_is_reported():
    h = clean()
    find(h, replica_id="soak_0", rank=0, step=11)["participants"] = 1
    v = only(check(h, Bounds(min_replicas=2)), "too_few_participants")[0]
    assert (v.step, v.replica, v.incarnation) == (11, "soak_0", 0)


def test_divergent_state_after_a_commit_is_reported():
    h = clean()
    find(h, replica_id="soak_2", rank=1, step=17)["hash_after"] = "other"
    v = only(check(h), "divergent_state")[0]
    assert (v.step, v.replica, v.rank, v.incarnation) == (17, "soak_2", 1, 1)


def test_a_healer_loading_other_state_than_its_source_is_reported():
    h = clean()
    find(h, kind="heal", rank=0)["hash"] = "stale"
    v = only(check(h), "heal_differs_from_source")[0]
    assert (v.step, v.replica, v.rank, v.incarnation) == (13, "soak_2", 0, 1)


def test_a_discarded_step_that_changed_state_is_reported():
    h = clean()
    find(h, committed=False)["hash_after"] = "moved"
    v = only(check(h), "discard_changed_state")[0]
    assert (v.step, v.replica, v.incarnation) == (20, "soak_1", 0)


def test_a_replica_history_going_back_is_reported():
    h = clean()
    r = copy.deepcopy(find(h, replica_id="soak_0", rank=0, step=15))
    r["t"] += 10  # step 15 committed again after 19, same incarnation
    r["step"] = 15
    h.steps.append(r)
    vs = check(h)
    v = next(v for v in vs if v.rule == "history_went_back")
    assert (v.step, v.replica, v.rank, v.incarnation) == (15, "soak_0", 0, 0)


def test_a_job_that_starts_over_is_reported():
    h = clean()
    # a new quorum of fresh replicas commits from step 0 again
    for s in range(3):
        for g, rid in enumerate(REPLICAS):
            h.steps.append({"kind": "step", "step": s, "committed": True, "quorum_id": 9,
                            "members": list(REPLICAS), "max_step": s, "participants": 3,
                            "hash_after": f"fresh-{s}", "replica_id": rid, "group": g,
                            "rank": 0, "incarnation": 5, "t": 130.0 + s})
    vs = check(h)
    assert {v.rule for v in vs} >= {"job_went_back"}, [str(v) for v in vs]
    v = next(v for v in vs if v.rule == "job_went_back")
    assert v.step == 0 and v.incarnation == 5


def test_survivors_not_committing_after_a_fault_is_reported():
    h = clean()
    h.timeline = [r for r in h.timeline if r.get("kind") != "survivors"]
    h.timeline.insert(-2, {"event": "inject", "t": 10.0, "failure": 2, "kind": "hang",
                           "group": 1, "incarnation": 0})
    vs = only(check(h, Bounds(survivors_s=60)), "no_recovery")
    assert {v.incarnation for v in vs} == {0}
    assert any("hang fault 2" in v.detail for v in vs)


def test_a_slow_recovery_is_reported():
    h = clean()
    next(r for r in h.timeline if r.get("kind") == "survivors")["duration_s"] = 75.0
    v = only(check(h, Bounds(survivors_s=60)), "no_recovery")[0]
    assert "75.0 s" in v.detail


def test_a_restarted_group_that_never_rejoins_is_reported():
    h = clean()
    h.timeline = [r for r in h.timeline if r.get("kind") != "rejoin"]
    h.timeline[-2]["t"] = 300.0  # the finish comes long after the restart
    v = only(check(h, Bounds(rejoin_s=120)), "no_rejoin")[0]
    assert (v.replica, v.incarnation) == ("group 2", 1)


def test_a_trainer_exiting_on_its_own_is_reported():
    h = clean()
    h.timeline.insert(-2, {"event": "exit", "t": 115.0, "group": 0, "rank": 1,
                           "incarnation": 0, "returncode": 1})
    v = only(check(h), "unplanned_exit")[0]
    assert (v.replica, v.rank, v.incarnation) == ("group 0", 1, 0)


def test_a_growing_lighthouse_is_reported():
    h = clean()
    for i, s in enumerate(h.lighthouse):
        s["fds"] = 12 + 3 * i
    vs = only(check(h), "lighthouse_grows")
    assert "fds" in vs[0].detail
    h = clean()
    for i, s in enumerate(h.lighthouse):
        s["rss_kib"] = 20000 + 4096 * i
    assert "rss_kib" in only(check(h), "lighthouse_grows")[0].detail


def test_leftovers_and_a_run_that_did_not_end_are_reported():
    h = clean()
    h.leftovers = {"processes": [4242], "namespaces": ["sgln1g0"], "cgroups": []}
    vs = only(check(h), "left_behind")
    assert {v.detail for v in vs} == {"processes: 4242", "namespaces: sgln1g0"}
    h = clean()
    h.timeline = [r for r in h.timeline if r["event"] not in ("end", "finish")]
    vs = only(check(h), "run_did_not_end")
    assert len(vs) == 2


def test_load_reads_a_soak_folder(tmp_path):
    h = clean()
    (tmp_path / "steps").mkdir()
    with open(tmp_path / "timeline.jsonl", "w") as f:
        for r in h.timeline:
            f.write(json.dumps(r) + "\n")
    with open(tmp_path / "steps" / "all.jsonl", "w") as f:
        for r in h.steps:
            f.write(json.dumps(r) + "\n")
        f.write('{"kind": "step", "cut by a SIGK')  # a torn last line is skipped
    with open(tmp_path / "lighthouse.jsonl", "w") as f:
        for r in h.lighthouse:
            f.write(json.dumps(r) + "\n")
    (tmp_path / "leftovers.json").write_text(json.dumps({"processes": [99]}))
    vs = check(checker.load(tmp_path))
    assert [v.rule for v in vs] == ["left_behind"]
    assert checker.main([str(tmp_path)]) == 1


def test_the_schedule_replays_from_its_seed_and_has_every_kind():
    a = make_schedule(7, 300, 13)
    b = make_schedule(7, 300, 13)
    assert [(e.at, e.kind, [vars(s) for s in e.specs]) for e in a] == \
        [(e.at, e.kind, [vars(s) for s in e.specs]) for e in b]
    assert {e.kind for e in a} == set(KINDS)
    assert len(a) >= 20
    c = make_schedule(8, 300, 13)
    assert [e.kind for e in a] != [e.kind for e in c]
    doubles = [e for e in a if e.kind == "double"]
    assert all(len(e.specs) == 2 for e in doubles)
    with pytest.raises(ValueError, match="unknown soak fault kinds"):
        make_schedule(1, 60, 10, kinds=["nope"])


def test_goodput_definition():
    assert goodput.goodput(300, 3, 2.0, 100.0) == pytest.approx(0.5)
    assert goodput.goodput(10, 3, 0.0, 100.0) is None
    tl = [{"event": "commit", "rank": 0, "t": 10.0 + i * 0.5, "group": i % 3}
          for i in range(60)] + [{"event": "commit", "rank": 1, "t": 11.0}]
    assert goodput.committed_replica_steps(tl, 10.0, 20.0) == 20
    assert goodput.fault_free_rate(tl, 10.0, 20.0, 3) == pytest.approx(20 / 3 / 10)
    assert goodput.rate_from_step_times([0.5, 0.25, 1.0]) == pytest.approx(2.0)
    assert goodput.rate_from_step_times([]) is None


def test_goodput_counts_participants_only():
    # four groups commit every step, three take part (a hot spare): three count
    tl = [{"event": "commit", "rank": 0, "t": 1.0 + s, "group": g, "step": s,
           "participants": 3} for s in range(10) for g in range(4)]
    assert goodput.committed_replica_steps(tl) == 30
    assert goodput.committed_replica_steps(tl, 1.0, 6.0) == 15
    kills = [{"event": "inject", "kind": "kill", "t": t} for t in (5.0, 25.0, 45.0)]
    assert goodput.kill_window(kills + tl, 20.0) == (5.0, 65.0)
    assert goodput.kill_window(kills, 20.0, 180.0) == (5.0, 185.0)
    assert goodput.kill_window(tl, 20.0) is None


def test_state_hash_is_order_free_and_bit_exact():
    import torch

    from stepguard.soak.steplog import state_hash

    a = {"model": {"w": torch.ones(3), "b": torch.tensor(0.5)}, "optim": {"step": 4}}
    b = {"optim": {"step": 4}, "model": {"b": torch.tensor(0.5), "w": torch.ones(3)}}
    assert state_hash(a) == state_hash(b)
    c = copy.deepcopy(a)
    c["model"]["w"][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert state_hash(c) != state_hash(a)
    assert state_hash({"w": torch.ones(3)}) != state_hash({"w": torch.ones(3, dtype=torch.float64)})
    assert state_hash({"w": torch.ones(3)}) != state_hash({"w": torch.ones(1, 3)})


class _FakeQuorum:
    quorum_id = 7
    replica_ids = ["soak_1:abc", "soak_0:def"]
    max_step = 4
    recover_src_replica_rank = None


class _FakeManager:
    def __init__(self) -> None:
        self.step = 4

    def current_step(self) -> int:
        return self.step

    def last_quorum(self):
        return _FakeQuorum()

    def num_participants(self) -> int:
        return 2


def test_step_log_lines_feed_the_checker(tmp_path, monkeypatch):
    import torch

    from stepguard.soak.steplog import StepLog

    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("STEPGUARD_INCARNATION", "2")
    w = torch.zeros(4)
    m = _FakeManager()
    log = StepLog(tmp_path, m, lambda: {"w": w}, "soak_1")
    log.before_commit()
    w += 1  # the optimizer step
    m.step = 5
    log.after_commit(True)
    log.before_commit()
    log.after_commit(False)  # discarded: nothing moved
    log.before_commit()
    w += 1  # a discarded step that changed the state
    log.after_commit(False)
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "g1.r1.inc2.jsonl").read_text().splitlines()]
    assert [x["committed"] for x in lines] == [True, False, False]
    c = lines[0]
    assert (c["step"], c["quorum_id"], c["members"], c["max_step"], c["participants"]) == \
        (4, 7, ["soak_0", "soak_1"], 4, 2)
    assert (c["replica_id"], c["group"], c["rank"], c["incarnation"]) == ("soak_1", 1, 1, 2)
    assert lines[1]["hash_before"] == lines[1]["hash_after"] == c["hash_after"]
    m._healing = True  # healed in the vote, no heal hook (torchft): unknown
    log = StepLog(tmp_path, m, lambda: {"w": w}, "soak_1")
    log.before_commit()
    w += 1
    log.after_commit(False)
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "g1.r1.inc2.jsonl").read_text().splitlines()]
    assert lines[-1]["hash_before"] is None
    vs = check(History([], lines), Bounds())
    assert [(v.rule, v.step, v.replica, v.rank, v.incarnation) for v in vs
            if v.rule == "discard_changed_state"] == [("discard_changed_state", 5, "soak_1", 1, 2)]


def test_side_by_side_lists_both_runs_on_the_kinds_they_share():
    from stepguard.soak.runner import side_by_side

    def summary(impl, faults, surv):
        return {"impl": impl, "faults": faults, "survived": faults, "violations": [],
                "fault_free_rate": 7.0, "goodput": 0.3,
                "survivors_s": surv, "rejoin_s": {"kill_group": [20.0, 30.0]}}

    text = side_by_side(summary("stepguard", 27, {"kill_group": [1.0, 2.0, 9.0],
                                                  "lighthouse": [0.1]}),
                        summary("torchft", 20, {"kill_group": [4.0]}))
    lines = text.splitlines()
    assert lines[0].split() == ["stepguard", "torchft"]
    assert any(line.split()[-4:] == ["2.0", "s", "4.0", "s"] and "kill_group" in line
               for line in lines), text
    assert not any("lighthouse" in line for line in lines)  # torchft has no such fault
    assert any(line.startswith("faults injected") and line.split()[-2:] == ["27", "20"]
               for line in lines)


def test_goodput_steady_rate_skips_faults_and_setups():
    # two groups, a step every 0.5 s; group 1 relaunched at 10 s (ready at
    # 14 s, steps again from 15 s); the steps in 10..15 s are 1.0 s apart
    tl = [{"event": "launch", "t": 0.0, "group": g, "incarnation": 0} for g in (0, 1)]
    tl += [{"event": "ready", "t": 0.5, "group": g, "incarnation": 0} for g in (0, 1)]
    tl += [{"event": "restart", "t": 10.0, "group": 1, "incarnation": 1},
           {"event": "ready", "t": 14.0, "group": 1, "incarnation": 1}]
    t = 1.0
    while t < 30.0:
        slow = 10.0 <= t < 15.0
        for g in (0, 1):
            if g == 1 and slow:
                continue
            tl.append({"event": "commit", "rank": 0, "t": t, "group": g,
                       "incarnation": int(g == 1 and t >= 10.0), "step": int(t * 2),
                       "participants": 1 if slow else 2, "healed": g == 1 and t == 15.0})
        t += 1.0 if slow else 0.5
    assert goodput.setup_spans(tl) == [(0.0, 0.5), (0.0, 0.5), (10.0, 14.0)]
    assert goodput.steady_rate(tl, 2) == pytest.approx(2.0)
    assert goodput.steady_rate(tl, 2, busy=[(0.0, 30.0)]) is None
    assert goodput.steady_rate(tl, 2, busy=goodput.setup_spans(tl)) == pytest.approx(2.0)
    assert goodput.steady_rate(tl, 2, 20.0, 25.0) == pytest.approx(2.0)
    assert goodput.steady_rate(tl, 1) == pytest.approx(1.0)  # the short-handed stretch


def test_goodput_setup_spans_leave_out_low_priority_spares_unless_asked():
    # spare 0 sets up at the trainers' priority (0 to 8 s), spare 1 at nice
    # 19 from 10 s until it is taken over at 30 s, still setting up, by
    # group 1, and at the trainers' priority from then until group 1's first
    # step at 31 s; spare 3 at nice 19 from 40 s, ready at 50 s; a record
    # without trainer_nice counts the trainers at 0
    tl = [{"event": "launch", "t": 0.0, "group": 0, "incarnation": 0},
          {"event": "ready", "t": 1.0, "group": 0, "incarnation": 0},
          {"event": "spare_start", "t": 0.0, "spare": 0, "nice": 0, "trainer_nice": 0},
          {"event": "spare_ready", "t": 8.0, "spare": 0},
          {"event": "spare_start", "t": 10.0, "spare": 1, "nice": 19},
          {"event": "takeover", "t": 30.0, "spare": 1, "group": 1, "incarnation": 1},
          {"event": "commit", "rank": 0, "t": 31.0, "group": 1, "incarnation": 1, "step": 5},
          {"event": "spare_start", "t": 32.0, "spare": 2, "nice": 5, "trainer_nice": 5},
          {"event": "spare_start", "t": 40.0, "spare": 3, "nice": 19, "trainer_nice": 0},
          {"event": "spare_ready", "t": 50.0, "spare": 3},
          {"event": "takeover", "t": 60.0, "spare": 3, "group": 0, "incarnation": 1}]
    assert not goodput.lowered(tl[2]) and goodput.lowered(tl[4]) and not goodput.lowered(tl[7])
    assert goodput.setup_spans(tl) == [(0.0, 1.0), (0.0, 8.0), (30.0, 31.0), (32.0, 60.0)]
    assert goodput.setup_spans(tl, spares="lowered") == [(10.0, 30.0), (40.0, 50.0)]
    assert goodput.setup_spans(tl, spares="all") == [(0.0, 1.0), (0.0, 8.0), (10.0, 31.0),
                                                       (32.0, 60.0), (40.0, 50.0)]
    with pytest.raises(ValueError):
        goodput.setup_spans(tl, spares="some")


def test_goodput_steady_rate_within_spans():
    # one group, a step every 0.5 s from 0 to 10 s, every 1.0 s from 10 to 20 s
    tl, t = [], 0.0
    while t <= 20.0:
        tl.append({"event": "commit", "rank": 0, "t": t, "group": 0, "incarnation": 0,
                   "step": len(tl), "participants": 1})
        t += 0.5 if t < 10.0 else 1.0
    assert goodput.steady_rate(tl, 1, within=[(10.0, 20.0)]) == pytest.approx(1.0)
    assert goodput.steady_rate(tl, 1, within=[(0.0, 10.0)]) == pytest.approx(2.0)
    assert goodput.steady_rate(tl, 1, busy=[(0.0, 10.0)], within=[(0.0, 10.0)]) is None
