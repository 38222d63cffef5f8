"""Warm spares: the takeover handoff, the launcher's pool, and real trainers.

- the takeover message: a spare learns its identity from it; garbage, a
  truncated or oversized message, a closed channel and no message at all
  each fail the spare with the reason (one process waits on many pipes);
- the launcher with a light fake trainer: spares start, report ready, take a
  killed group's identity (group, incarnation, store), a new spare starts,
  and every process is gone at the end;
- the small Llama (``examples/train_llama.py``) with ``spares=1``: the
  lighthouse never counts the waiting spare (every quorum before the
  takeover has the running groups only), a kill is followed by a takeover,
  a heal and a committed step, the parameters of every group are identical
  at the same step, and a new spare comes up; a two-rank group (long);
- the same with its data read through ``ManagedDataLoader`` (``--data
  loader``): across the kill and the takeover, the committed steps read
  every sample of every whole epoch exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from stepguard.launch import FailureSpec, LaunchConfig, Launcher
from stepguard.spares import MAX_MESSAGE, can_renice, takeover_message

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = [str(ROOT / "examples" / "train_llama.py"), "--dim", "32", "--layers", "1",
              "--heads", "2", "--hidden", "64", "--seq-len", "32", "--batch-size", "4",
              "--pg", "tcp", "--step-sleep", "0.05"]

GOOD_ENV = {"REPLICA_GROUP_ID": "3", "RANK": "1", "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4567", "TORCHFT_LIGHTHOUSE": "x"}

# Waits on each descriptor in argv in turn, as a spare would, and prints
# one JSON line per wait: the identity, or the error's type and text.
WAITER = r'''
import json, os, sys
from stepguard.spares import wait_for_takeover
for fd in sys.argv[1:]:
    os.environ["STEPGUARD_SPARE_FD"] = fd
    try:
        t = wait_for_takeover(timeout=float(os.environ["WAIT"]))
        out = {"ok": True, "group": t.replica_group, "rank": t.rank, "world": t.world_size,
               "port": t.store_port, "spare": t.spare,
               "env_group": os.environ.get("REPLICA_GROUP_ID"),
               "fd_var": os.environ.get("STEPGUARD_SPARE_FD")}
    except Exception as e:
        out = {"ok": False, "type": type(e).__name__, "msg": str(e)}
    print(json.dumps(out), flush=True)
'''


def _cases() -> list[tuple[str, bytes | None, str]]:
    """(name, bytes written then the pipe closed (None: left open), expected)."""
    good = takeover_message(GOOD_ENV)
    return [
        ("good", good, "ok"),
        ("not json", b"hello spare\n", "is not JSON"),
        ("binary", b"\xff\xfe\x00\n", "is not JSON"),
        ("other json", b'{"env": {}}\n', "is not a stepguard takeover"),
        ("env not a map", b'{"stepguard_takeover": 1, "env": [1]}\n', "env is not a map"),
        ("env values", b'{"stepguard_takeover": 1, "env": {"RANK": 1}}\n',
         "env is not a map"),
        ("missing", json.dumps({"stepguard_takeover": 1, "env": {"RANK": "0"}}).encode()
         + b"\n", "lacks REPLICA_GROUP_ID"),
        ("bad int", takeover_message({**GOOD_ENV, "MASTER_PORT": "http"}),
         "MASTER_PORT='http' is not a non-negative integer"),
        ("rank", takeover_message({**GOOD_ENV, "RANK": "2"}), "RANK=2 is not below"),
        ("truncated", good[:20], "closed before a whole message arrived (20 bytes)"),
        ("empty", b"", "closed before a whole message arrived (0 bytes)"),
        ("oversized", b"x" * (MAX_MESSAGE + 10), f"longer than {MAX_MESSAGE} bytes"),
        ("silent", None, "no takeover message within"),
    ]


def test_takeover_message_and_every_bad_one() -> None:
    cases = _cases()
    pipes = [os.pipe() for _ in cases]
    env = dict(os.environ, WAIT="1.0")
    env.pop("STEPGUARD_EVENTS_FD", None)
    p = subprocess.Popen([sys.executable, "-c", WAITER, *[str(r) for r, _ in pipes]],
                         pass_fds=[r for r, _ in pipes], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        writers = []
        for (r, w), (_, data, _) in zip(pipes, cases):
            os.close(r)
            if data is None:
                writers.append(w)  # never written: the deadline must end it
                continue
            import threading

            def feed(w: int = w, data: bytes = data) -> None:
                try:
                    os.write(w, data)  # the oversized one blocks until read
                except OSError:
                    pass
                finally:
                    os.close(w)

            t = threading.Thread(target=feed, daemon=True)
            t.start()
            writers.append(t)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for w in writers:
            if isinstance(w, int):
                os.close(w)
    lines = [json.loads(x) for x in out.splitlines()]
    assert len(lines) == len(cases), (out, err)
    for (name, _, want), got in zip(cases, lines):
        if want == "ok":
            assert got == {"ok": True, "group": 3, "rank": 1, "world": 2, "port": 4567,
                           "spare": True, "env_group": "3", "fd_var": None}, name
        else:
            assert got["ok"] is False and got["type"] == "TakeoverError", (name, got)
            assert want in got["msg"], (name, got["msg"])


def test_not_a_spare_returns_the_environment_at_once() -> None:
    code = ("import json; from stepguard.spares import wait_for_takeover, is_spare; "
            "t = wait_for_takeover(); print(json.dumps([is_spare(), t.spare, "
            "t.replica_group, t.rank, t.store_port]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPGUARD_SPARE")}
    env.update(REPLICA_GROUP_ID="5", RANK="0", WORLD_SIZE="1", MASTER_ADDR="h",
               MASTER_PORT="9")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert json.loads(out) == [False, False, 5, 0, 9]


def test_a_trainer_spare_given_garbage_exits_with_the_reason() -> None:
    r, w = os.pipe()
    env = dict(os.environ, STEPGUARD_SPARE_FD=str(r), WORLD_SIZE="1", RANK="0",
               OMP_NUM_THREADS="1")
    env.pop("REPLICA_GROUP_ID", None)
    p = subprocess.Popen([sys.executable, *TINY_LLAMA, "--steps", "1"], pass_fds=[r],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    os.close(r)
    try:
        os.write(w, b'{"stepguard_takeover": 1, "env": {"RANK": "zero"}}\n')
        os.close(w)
        out, _ = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0
    assert "TakeoverError: the takeover message lacks REPLICA_GROUP_ID" in out, out[-2000:]


# -- the launcher's pool, with a light fake trainer --

FAKE_SPARE = r'''
import os, sys, threading, time
from stepguard.launch import report, stop_step
from stepguard.spares import wait_for_takeover
if os.environ.get("FAKE_SPARE_CRASH") and os.environ.get("STEPGUARD_SPARE_FD"):
    sys.exit(7)
worker = threading.Thread(target=lambda: time.sleep(3600), daemon=True)  # a setup's thread
worker.start()
def nice():  # the main thread's, the other thread's, the session's autogroup's
    try:
        with open("/proc/self/autogroup") as f:
            group = int(f.read().split()[-1])
    except (OSError, ValueError):
        group = None
    return [os.getpriority(os.PRIO_PROCESS, t) for t in (threading.get_native_id(),
                                                         worker.native_id)] + [group]
if os.environ.get("STEPGUARD_SPARE_FD"):
    report("set_up", nice=nice())
t = wait_for_takeover()
report("hello", spare=t.spare, nice=nice(), env={k: os.environ.get(k) for k in (
    "REPLICA_GROUP_ID", "RANK", "WORLD_SIZE", "MASTER_PORT", "STEPGUARD_INCARNATION",
    "TORCHELASTIC_RESTART_COUNT", "TORCHFT_LIGHTHOUSE")})
step = 0
while True:
    stop = stop_step()
    if stop is not None and step >= stop:
        sys.exit(0)
    time.sleep(0.05)
    report("step", step=step, committed=True, quorum_id=1, participants=1)
    step += 1
'''


def _autogroups() -> bool:
    """The kernel groups each session for the scheduler."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1" \
            and Path("/proc/self/autogroup").exists()
    except OSError:
        return False


def _timeline(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _of(tl: list[dict], event: str, **match) -> list[dict]:
    return [r for r in tl if r["event"] == event
            and all(r.get(k) == v for k, v in match.items())]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _pids(tl: list[dict]) -> list[int]:
    return [p for r in tl if r["event"] in ("launch", "restart", "spare_start")
            for p in r["pids"]]


def test_launcher_hands_a_killed_groups_identity_to_a_spare(tmp_path: Path) -> None:
    script = tmp_path / "fake_spare.py"
    script.write_text(FAKE_SPARE)
    state: dict = {"killed": False}

    def on_tick(la: Launcher) -> None:
        tl = state["tl"]
        if not state["killed"] and _of(tl, "spare_ready") and len(_of(tl, "commit")) > 6:
            state["killed"] = True
            la.inject(FailureSpec(kind="kill", group=1))
        if _of(tl, "spare_ready", spare=1) and _of(tl, "commit", group=1, incarnation=1):
            la.finish(step=0)

    state["tl"] = []
    cfg = LaunchConfig(cmd=[sys.executable, str(script)], groups=2, nproc_per_group=2,
                       spares=1, lighthouse="http://127.0.0.1:9", duration=60.0,
                       timeline=str(tmp_path / "tl.jsonl"), log_dir=str(tmp_path / "logs"),
                       stop_file=str(tmp_path / "stop"), quiet=True)
    la = Launcher(cfg, on_event=state["tl"].append, on_tick=on_tick)
    t0 = time.monotonic()
    rc = la.run()
    tl = _timeline(tmp_path / "tl.jsonl")
    assert rc == 0 and time.monotonic() - t0 < 60, tl[-5:]
    assert not _of(tl, "duration_reached")
    take = _of(tl, "takeover")
    assert len(take) == 1 and take[0]["group"] == 1 and take[0]["incarnation"] == 1
    assert take[0]["spare"] == 0 and take[0]["ready"] is True
    start0 = _of(tl, "spare_start", spare=0)[0]
    assert take[0]["pids"] == start0["pids"]  # the spare's processes became the group
    # no fresh launch for group 1: the spare was its restart
    assert not _of(tl, "restart")
    hello = [r for r in _of(tl, "hello") if r.get("group") == 1 and r["incarnation"] == 1]
    assert sorted(r["rank"] for r in hello) == [0, 1]
    for r in hello:
        assert r["spare"] is True
        assert r["env"]["REPLICA_GROUP_ID"] == "1" and r["env"]["STEPGUARD_INCARNATION"] == "1"
        assert r["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert r["env"]["MASTER_PORT"] == str(start0["master_port"])
        assert r["env"]["WORLD_SIZE"] == "2" and r["env"]["RANK"] == str(r["rank"])
    # a spare sets up at the lowest priority, its session's scheduler
    # autogroup too where the kernel has them, and trains at the launcher's
    base = os.getpriority(os.PRIO_PROCESS, 0)
    low = min(19, base + 19) if can_renice(min(base, 0)) else base
    group = _autogroups()
    set_up = _of(tl, "set_up")
    assert len(set_up) >= 4 and all(r["nice"][:2] == [low, low] for r in set_up), set_up
    assert start0["nice"] == low and start0["trainer_nice"] == base, start0
    assert all(r["nice"][:2] == [base, base] for r in hello), hello
    if group:
        assert all(r["nice"][2] == low for r in set_up), set_up
        assert all(r["nice"][2] == 0 for r in hello), hello
    # a spare's events before its takeover carry no group
    waiting = _of(tl, "spare_waiting")
    assert waiting and all("group" not in r and r["spare"] in (0, 1) for r in waiting)
    # the replacement spare starts after the takeover and gets ready
    assert _of(tl, "spare_start", spare=1)[0]["t"] >= take[0]["t"]
    assert _of(tl, "spare_ready", spare=1)
    full = _of(tl, "recovery", kind="full_strength")
    assert len(full) == 1 and full[0]["group"] == 1 and full[0]["spare"] == 0
    assert (tmp_path / "logs" / "group1.rank0.inc1.log").resolve() == \
        (tmp_path / "logs" / "spare0.rank0.log").resolve()
    left = [p for p in _pids(tl) if not _gone(p)]
    assert not left, f"processes left running: {left}"


def test_a_spare_that_dies_waiting_is_replaced_then_given_up(tmp_path: Path) -> None:
    script = tmp_path / "fake_spare.py"
    script.write_text(FAKE_SPARE)
    tl: list[dict] = []

    def on_tick(la: Launcher) -> None:
        if _of(tl, "spare_exit", gave_up=True) and _of(tl, "commit"):
            la.finish(step=0)

    cfg = LaunchConfig(cmd=[sys.executable, str(script)], groups=1, spares=1,
                       max_failed_starts=3, lighthouse="http://127.0.0.1:9", duration=60.0,
                       env={"FAKE_SPARE_CRASH": "1"}, stop_file=str(tmp_path / "stop"),
                       timeline=str(tmp_path / "tl.jsonl"), log_dir=str(tmp_path / "logs"),
                       quiet=True)
    assert Launcher(cfg, on_event=tl.append, on_tick=on_tick).run() == 0
    exits = _of(tl, "spare_exit")
    assert [r["returncode"] for r in exits] == [7, 7, 7]
    assert [r["gave_up"] for r in exits] == [False, False, True]
    assert exits[0]["log"].endswith("spare0.rank0.log")
    assert len(_of(tl, "spare_start")) == 3
    assert not [p for p in _pids(tl) if not _gone(p)]


def test_spares_refused_in_network_namespaces(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="network namespaces"):
        Launcher(LaunchConfig(cmd=["true"], spares=1, netns=True))
    with pytest.raises(ValueError, match="at least 0"):
        Launcher(LaunchConfig(cmd=["true"], spares=-1))


# -- real trainers --

def _run_llama(tmp_path: Path, groups: int, nproc: int, kill_rank: int | None,
               limit: float, refill: str) -> list[dict]:
    """Kills group 1 once the spare waits and every running group is in the
    quorum; finishes once the replacement committed and the next spare
    reached ``refill`` (an event name)."""
    tl: list[dict] = []
    state = {"killed": False, "stop": None}

    def on_tick(la: Launcher) -> None:
        if not state["killed"]:
            # A group slow to start (load) joins late: until then the others
            # commit without it (min_replicas=1) and the lighthouse has not
            # heard of it.  So the snapshot waits for commits that counted
            # every running group after the spare was ready: each of them
            # had joined, and a member's heartbeat record stays while it runs.
            if _full_commits_after_ready(tl, groups) >= 5:
                # what the lighthouse knows while the spare waits
                addr = _of(tl, "lighthouse")[0]["address"]
                with urllib.request.urlopen(addr + "/status", timeout=10) as resp:
                    state["status"] = json.load(resp)
                state["killed"] = True
                la.inject(FailureSpec(kind="kill", group=1, rank=kill_rank))
            return
        if state["stop"] is None and _of(tl, refill, spare=1) and \
                _of(tl, "recovery", kind="full_strength"):
            last = max(r["step"] for r in _of(tl, "commit"))
            state["stop"] = last + 3
            la.finish(step=state["stop"])

    cfg = LaunchConfig(
        cmd=[sys.executable, *TINY_LLAMA, "--save-dir", str(tmp_path / "params")],
        groups=groups, nproc_per_group=nproc, spares=1, min_replicas=1,
        omp_threads=1, duration=limit, timeline=str(tmp_path / "tl.jsonl"),
        log_dir=str(tmp_path / "logs"), stop_file=str(tmp_path / "stop"), quiet=True)
    rc = Launcher(cfg, on_event=tl.append, on_tick=on_tick).run()
    tl = _timeline(tmp_path / "tl.jsonl")
    assert rc == 0 and not _of(tl, "duration_reached"), \
        f"see {tmp_path}/logs: " + json.dumps(tl[-8:])
    # The lighthouse heard from the running groups' managers only, never
    # from the waiting spare (which has no manager).
    beats = [h["replica_id"].split(":")[0] for h in state["status"]["heartbeats"]]
    assert sorted(beats) == [f"train_llama_{g}" for g in range(groups)], beats
    return tl


def _check_llama(tmp_path: Path, tl: list[dict], groups: int, nproc: int,
                 refill: str) -> None:
    import torch

    ready = _of(tl, "spare_ready", spare=0)[0]["t"]
    take = _of(tl, "takeover")
    assert len(take) == 1 and take[0]["group"] == 1 and take[0]["ready"]
    # The lighthouse never counted the waiting spare: every quorum before
    # the takeover had the running groups only, also after it was ready.
    before = [r for r in _of(tl, "commit") if r["t"] < take[0]["t"]]
    assert before and all(r["participants"] <= groups for r in before)
    assert [r for r in before if r["t"] > ready and r["participants"] == groups]
    # the replacement healed from a peer and committed, back at full strength
    mine = _of(tl, "commit", group=1, incarnation=1, rank=0)
    assert mine and mine[0]["healed"] is True and mine[0]["step"] > 0, mine[:2]
    # (a healing replica does not count in its first step with an async quorum)
    assert [r for r in mine if r["participants"] == groups]
    healed = [r for r in _of(tl, "recovery", kind="rejoin", group=1)]
    assert healed and healed[0]["spare"] == 0
    assert _of(tl, "recovery", kind="full_strength", group=1)
    assert _of(tl, "spare_start", spare=1) and _of(tl, refill, spare=1)
    # identical parameters at the same step in every group, rank by rank
    # (group rank i averages with group rank i of the other groups only)
    for r in range(nproc):
        files = sorted((tmp_path / "params").glob(f"params_g*_r{r}.pt"))
        assert len(files) == groups, files
        saved = [torch.load(f) for f in files]
        assert len({s["step"] for s in saved}) == 1
        for s in saved[1:]:
            for k, v in saved[0]["params"].items():
                assert torch.equal(v, s["params"][k]), (r, k)
    left = [p for p in _pids(tl) if not _gone(p)]
    assert not left, f"processes left running: {left}"


def test_llama_spare_takes_over_heals_and_matches(tmp_path: Path) -> None:
    tl = _run_llama(tmp_path, groups=2, nproc=1, kill_rank=None, limit=120.0,
                    refill="spare_start")
    _check_llama(tmp_path, tl, groups=2, nproc=1, refill="spare_start")


@pytest.mark.long
def test_llama_two_rank_spare_group(tmp_path: Path) -> None:
    tl = _run_llama(tmp_path, groups=2, nproc=2, kill_rank=1, limit=240.0,
                    refill="spare_ready")
    _check_llama(tmp_path, tl, groups=2, nproc=2, refill="spare_ready")


def _full_commits_after_ready(tl: list[dict], groups: int) -> int:
    """Group 1's commits that counted all ``groups`` groups after the first
    spare was ready."""
    ready = _of(tl, "spare_ready")
    return sum(1 for r in _of(tl, "commit", group=1, rank=0)
               if ready and r["t"] > ready[0]["t"] and r["participants"] == groups)


def _committed_batches(tl: list[dict]) -> dict[int, list[dict]]:
    """{step: the batch events whose step then committed}: each rank's
    events in order, a ``batch`` followed by its ``commit``."""
    last: dict[tuple, dict] = {}
    out: dict[int, list[dict]] = defaultdict(list)
    for r in tl:
        who = (r.get("group"), r.get("rank"), r.get("incarnation"))
        if r["event"] == "batch":
            last[who] = r
        elif r["event"] in ("commit", "discard"):
            b = last.pop(who, None)
            if r["event"] == "commit":
                assert b is not None and b["step"] == r["step"], (who, r, b)
                out[r["step"]].append(b)
    return out


def test_one_epoch_after_another_through_a_warm_spares_takeover(tmp_path: Path) -> None:
    """stepguard-launch --spares 1 and train_llama.py --data loader: group 1
    is killed mid-stream and the spare takes over its identity, heals the
    loader's position with the parameters and reads on; the committed steps
    read each whole epoch's samples exactly once (a 240-sample epoch is 30
    steps at full strength, so the run crosses several)."""
    samples, batch, groups = 240, 4, 2
    tl: list[dict] = []
    state: dict = {"killed": False, "stop": None}

    def on_tick(la: Launcher) -> None:
        if not state["killed"]:
            if _full_commits_after_ready(tl, groups) >= 5:
                state["killed"] = True
                la.inject(FailureSpec(kind="kill", group=1))
        elif state["stop"] is None and _of(tl, "recovery", kind="full_strength"):
            # two more epochs at least, so the epoch of the takeover is whole
            last = max(r["step"] for r in _of(tl, "commit"))
            state["stop"] = last + 2 * samples // (groups * batch) + 2
            la.finish(step=state["stop"])

    cmd = [sys.executable, *TINY_LLAMA, "--data", "loader", "--samples", str(samples)]
    cfg = LaunchConfig(
        cmd=cmd, groups=groups, spares=1, min_replicas=1, omp_threads=1, duration=240.0,
        timeline=str(tmp_path / "tl.jsonl"), log_dir=str(tmp_path / "logs"),
        stop_file=str(tmp_path / "stop"), quiet=True)
    rc = Launcher(cfg, on_event=tl.append, on_tick=on_tick).run()
    tl = _timeline(tmp_path / "tl.jsonl")
    assert rc == 0 and not _of(tl, "duration_reached"), \
        f"see {tmp_path}/logs: " + json.dumps(tl[-8:])
    take = _of(tl, "takeover")
    assert len(take) == 1 and take[0]["group"] == 1 and take[0]["ready"], take
    # the replacement read batches from the committed position and committed them
    committed = _committed_batches(tl)
    theirs = [b for bs in committed.values() for b in bs
              if b["group"] == 1 and b["incarnation"] == 1 and b["prank"] is not None]
    assert theirs, "the spare never took part in a committed step"
    # the committed steps begin where the previous ones ended, every
    # committer of a step agreeing on its position and split
    steps = sorted(committed)
    assert steps == list(range(len(steps))), steps
    pos, seen = 0, []
    by_slice: dict[tuple, dict] = {}
    for b in _of(tl, "batch"):
        if b["prank"] is not None:  # the same slice is the same samples, whoever reads it
            prev = by_slice.setdefault((b["step"], b["pos"], b["n"], b["prank"]), b)
            assert prev["keys"] == b["keys"], (prev, b)
    for s in steps:
        views = {(b["pos"], b["n"]) for b in committed[s] if b["prank"] is not None}
        assert len(views) == 1, f"step {s}: committers disagree: {committed[s]}"
        (p, n), = views
        assert p == pos, f"step {s} began at {p}, the steps before it end at {pos}"
        for r in range(n):  # every participant's slice, by whoever read it
            b = by_slice.get((s, pos, n, r))
            assert b is not None, f"step {s}: no batch event for participant {r}"
            seen.extend(tuple(k) for k in b["keys"])
        pos += n * batch
    whole = pos // samples
    takeover_epoch = min(b["pos"] for b in theirs) // samples
    assert whole > takeover_epoch >= 0, (whole, takeover_epoch, pos)
    for e in range(whole):
        got = sorted(i for ep, i in seen if ep == e)
        assert got == list(range(samples)), (
            f"epoch {e}: {len(got)} samples, {len(set(got))} distinct, missing "
            f"{sorted(set(range(samples)) - set(got))[:10]}")
    left = [p for p in _pids(tl) if not _gone(p)]
    assert not left, f"processes left running: {left}"


def test_llama_data_loader_stops_after_its_epochs(tmp_path: Path) -> None:
    """train_llama.py --data loader --epochs 1 with a loader worker: two
    groups read a 48-sample epoch (8 samples a step) and both leave at the
    step that completes it, having committed each sample once."""
    samples, epochs = 48, 1
    cmd = [sys.executable, *TINY_LLAMA, "--data", "loader", "--samples", str(samples),
           "--epochs", str(epochs), "--data-workers", "1"]
    cfg = LaunchConfig(
        cmd=cmd, groups=2, min_replicas=2, omp_threads=1, duration=180.0,
        timeline=str(tmp_path / "tl.jsonl"), log_dir=str(tmp_path / "logs"), quiet=True)
    rc = Launcher(cfg).run()
    tl = _timeline(tmp_path / "tl.jsonl")
    assert rc == 0 and not _of(tl, "duration_reached"), \
        f"see {tmp_path}/logs: " + json.dumps(tl[-8:])
    committed = _committed_batches(tl)
    assert sorted(committed) == list(range(samples // 8)), sorted(committed)
    seen = sorted(tuple(k) for bs in committed.values() for b in bs for k in b["keys"])
    assert seen == [(0, i) for i in range(samples)], seen
    finished = _of(tl, "finished")
    assert len(finished) == 2 and {r["step"] for r in finished} == {samples // 8}, finished
