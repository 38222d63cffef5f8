"""stepguard-slurm against a real single-node Slurm (tests/py/helpers/slurm_util.py).

Replica groups train a small model (tests/py/helpers/train_worker.py), each
group its own Slurm job; the supervisor cancels jobs with scancel and
relaunches them, the relaunched groups heal from their peers, and the
replicas end identical.  A slurmctld killed and started again stops
nothing.  The first tests need no Slurm: Slurm commands that hang or print
garbage are errors within the call's deadline, and bad failure specs are
refused with the reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

import slurm_util
from stepguard.launch.slurm import (
    SlurmClient,
    SlurmConfig,
    SlurmError,
    SlurmSupervisor,
    parse_slurm_failure,
)

HELPERS = Path(__file__).parent / "helpers"
TRAIN = str(HELPERS / "train_worker.py")


# -- without Slurm ------------------------------------------------------------


def _fake_bin(tmp: Path, **scripts: str) -> Path:
    d = tmp / "bin"
    d.mkdir(exist_ok=True)
    for name, body in scripts.items():
        p = d / name
        p.write_text("#!/bin/sh\n" + body + "\n")
        p.chmod(0o755)
    return d


def test_a_hung_slurm_command_fails_within_its_deadline(tmp_path):
    d = _fake_bin(tmp_path, squeue="sleep 600", sbatch="echo 'Submitted batch job 12'",
                  scancel="echo 'scancel: error: Kill job error on job id 7' >&2; exit 1")
    client = SlurmClient(timeout=1.0, bin_dir=str(d))
    t0 = time.monotonic()
    with pytest.raises(SlurmError, match="did not answer within 1s"):
        client.jobs(["x-g0-i0"])
    assert time.monotonic() - t0 < 10  # the hung squeue was not waited out
    # sbatch --parsable prints a bare id; anything else is not taken as one
    with pytest.raises(SlurmError, match="not a job id"):
        client.submit("/dev/null", "x", [])
    with pytest.raises(SlurmError, match="exit status 1: scancel: error: Kill job error"):
        client.cancel(["7"])
    missing = SlurmClient(timeout=1.0, bin_dir=str(tmp_path / "nowhere"))
    with pytest.raises(SlurmError, match="squeue"):
        missing.jobs(["x"])


def test_an_unreachable_controller_relaunches_nothing(tmp_path):
    """squeue failing is not a job ending: no group is submitted again."""
    count = tmp_path / "sbatch.count"
    d = _fake_bin(tmp_path, squeue="echo 'slurm_load_jobs error: Unable to contact "
                  "slurm controller (connect failure)' >&2; exit 1",
                  sbatch=f"echo x >> {count}; echo $(wc -l < {count})",
                  scancel="exit 0")
    cfg = SlurmConfig(cmd=["true"], groups=2, lighthouse="http://127.0.0.1:9",
                      work_dir=str(tmp_path / "sup"), poll_interval=0.05,
                      call_timeout=5, stop_timeout=0.5, duration=1.5, quiet=True)
    events: list[dict] = []
    sup = SlurmSupervisor(cfg, client=SlurmClient(5, str(d)), on_event=events.append)
    assert sup.run() == 1  # the jobs could not be seen ending
    kinds = [e["event"] for e in events]
    assert kinds.count("submit") == 2 and "relaunch" not in kinds, kinds
    assert kinds.count("slurm_unreachable") == 1, kinds
    assert len(count.read_text().splitlines()) == 2
    assert events[-1]["event"] == "stop"


def test_jobs_that_keep_failing_are_resubmitted_ever_more_slowly(tmp_path):
    """A command that fails at once (every job FAILED) is not resubmitted
    in a tight loop: the delays double, and max_restarts ends it."""
    count = tmp_path / "sbatch.count"
    d = _fake_bin(tmp_path, sbatch=f"echo x >> {count}; echo $(wc -l < {count})",
                  squeue=f"n=$(wc -l < {count}); i=1; while [ $i -le $n ]; do "
                  "echo \"$i|$(echo \"$@\" | sed 's/.*--name=//')|FAILED\"; i=$((i+1)); done",
                  scancel="exit 0")
    cfg = SlurmConfig(cmd=["false"], groups=1, lighthouse="http://127.0.0.1:9",
                      work_dir=str(tmp_path / "sup"), poll_interval=0.05, call_timeout=5,
                      max_restarts=4, quiet=True)
    events: list[dict] = []
    sup = SlurmSupervisor(cfg, client=SlurmClient(5, str(d)), on_event=events.append)
    assert sup.run() == 1  # gave up
    delays = [e["delay_s"] for e in events if e["event"] == "relaunch"]
    assert delays == [0.0, 0.5, 1.0, 2.0], delays
    assert [e["event"] for e in events if e["event"] == "give_up"] == ["give_up"]


def test_bad_failure_specs_are_refused_with_the_reason():
    f = parse_slurm_failure("signal:sig=usr1,start=3s,group=1")
    assert (f.action, f.sig, f.spec.start, f.spec.group) == ("signal", "USR1", 3.0, 1)
    assert parse_slurm_failure("kill:every=30s").action == "cancel"
    assert parse_slurm_failure("hang:start=1s,duration=2s,then=kill").spec.then == "kill"
    for text, why in (("signal:start=1s", "give sig=NAME"),
                      ("signal:sig=NOPE,start=1s", "not a signal name"),
                      ("slow:cpu=0.5", "unknown failure kind"),
                      ("kill:rank=1,every=1s", "rank= has no meaning"),
                      ("kill:group=1", "give every= or start="),
                      ("kill:sig=TERM,start=1s", "sig= goes with signal")):
        with pytest.raises(ValueError, match=why):
            parse_slurm_failure(text)


def test_multi_rank_groups_run_torchrun_under_srun(tmp_path):
    cfg = SlurmConfig(cmd=[sys.executable, "train.py", "--x", "a b"], groups=2,
                      nproc_per_group=8, nodes_per_group=2, lighthouse="http://h:1",
                      work_dir=str(tmp_path), rdzv_port=29777)
    sup = SlurmSupervisor(cfg)
    (tmp_path / "scripts").mkdir()
    g = sup.groups[1]
    sup._new_incarnation(g)
    text = sup._script(g).read_text()
    assert "export REPLICA_GROUP_ID=1\n" in text and "export TORCHFT_LIGHTHOUSE=http://h:1" in text
    assert "export STEPGUARD_INCARNATION=0" in text
    run = text.splitlines()[-1]
    assert run.startswith("exec srun --nodes=2 --ntasks-per-node=1 "), run
    assert "-m torch.distributed.run --no-python --nnodes=2 --nproc-per-node=4" in run
    assert "--rdzv-endpoint=$head:29777" in run and "'a b'" in run
    with pytest.raises(ValueError, match="no commas"):
        SlurmSupervisor(SlurmConfig(cmd=["x"], job_name="a,b"))
    with pytest.raises(ValueError, match="not a multiple"):
        SlurmSupervisor(SlurmConfig(cmd=["x"], nproc_per_group=3, nodes_per_group=2))


# -- against a real Slurm -----------------------------------------------------


class HardTimeout(BaseException):
    pass


@pytest.fixture
def cluster(tmp_path):
    why = slurm_util.unavailable()
    if why is not None:
        pytest.skip(f"no real Slurm: {why}")
    try:
        c = slurm_util.SlurmCluster(tmp_path / "slurm")
    except slurm_util.SlurmError as e:
        pytest.skip(f"the Slurm daemons did not start on this machine: {e}")
    try:
        yield c
    finally:
        c.close()
        left = c.our_pids()
        assert not left, f"processes of the test Slurm left: {left}"


@pytest.fixture
def hard_timeout():
    def on_alarm(signum, frame):
        raise HardTimeout("the scenario exceeded its hard timeout")

    old = signal.signal(signal.SIGALRM, on_alarm)
    yield lambda s: signal.alarm(s)
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def worker_cmd(run_dir: Path, *extra: str, torchrun: bool = False) -> list[str]:
    """Every rank runs train_worker.py as replica train_<group>, its
    incarnation from the supervisor's environment (its group rank and size
    from torchrun's, under torchrun)."""
    rank = "" if torchrun else "--group-rank 0 --group-world-size 1 "
    script = ('train="$1"; shift; exec "$0" "$train" --impl stepguard '
              '--lighthouse "$TORCHFT_LIGHTHOUSE" --replica-id "train_$REPLICA_GROUP_ID" '
              f'--incarnation "$STEPGUARD_INCARNATION" {rank}"$@"')
    return ["/bin/sh", "-c", script, sys.executable, TRAIN, "--dir", str(run_dir),
            "--steps", "100000", "--step-sleep", "0.05", "--quorum-timeout", "60", *extra]


class Events:
    """The trainers' event files (train_worker.py)."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "events"

    def read(self, rid: str = "*", inc: str | int = "*", g: str | int = 0) -> list[dict]:
        out = []
        for p in sorted(self.dir.glob(f"{rid}.g{g}.i{inc}.jsonl")):
            with open(p) as f:
                out += [json.loads(line) for line in f if line.endswith("\n")]
        return out

    def committed(self, rid: str, inc: int | None = None) -> int:
        return max((e["step"] for e in self.read(rid, "*" if inc is None else inc)
                    if e["ev"] == "step" and e["ok"]), default=-1)

    def healed(self, rid: str, inc: int) -> list[dict]:
        return [e for e in self.read(rid, inc) if e["ev"] == "step" and e["healed"]]

    def pids(self) -> list[int]:
        return [e["pid"] for e in self.read(g="*") if e["ev"] == "start"]

    def assert_identical(self, min_compared: int) -> None:
        by_step: dict[tuple, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        for e in self.read(g="*"):
            if e["ev"] == "step" and e["ok"]:
                by_step[(e["g"], e["step"])][e["rid"]].add(e["hash"])
        compared = 0
        for step, by_rid in sorted(by_step.items()):
            for rid, hs in by_rid.items():
                assert len(hs) == 1, f"{rid} logged two hashes for step {step}: {hs}"
            if len(by_rid) >= 2:
                hashes = {next(iter(h)) for h in by_rid.values()}
                assert len(hashes) == 1, f"step {step}: replicas differ: {dict(by_rid)}"
                compared += 1
        assert compared >= min_compared, f"only {compared} steps held by 2+ replicas"
        assert len({next(iter(h)) for by_rid in by_step.values() for h in by_rid.values()}) > 3

    def summary(self) -> str:
        lines = []
        for p in sorted(self.dir.glob("*.jsonl")):
            evs = [json.loads(x) for x in p.read_text().splitlines() if x.endswith("}")]
            lines.append(f"-- {p.name}: {len(evs)} events; last {evs[-1:] if evs else None}")
        return "\n".join(lines)


def wait_for(pred, timeout: float, what: str, info=lambda: ""):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{info()}")
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_scancelled_groups_are_relaunched_and_heal(cluster, tmp_path, hard_timeout):
    """3 groups as 3 Slurm jobs; one job cancelled (scancel), another
    killed through scancel --signal=KILL; each is relaunched as a new job,
    heals from the others, and every replica ends with the same parameters."""
    hard_timeout(150)
    run = tmp_path / "run"
    ev = Events(run)
    timeline: list[dict] = []
    cfg = SlurmConfig(cmd=worker_cmd(run), groups=3, lighthouse_host="127.0.0.1",
                      lighthouse_bind="127.0.0.1", join_timeout_ms=1000, quorum_tick_ms=20,
                      heartbeat_timeout_ms=5000, work_dir=str(tmp_path / "sup"),
                      poll_interval=0.3, call_timeout=15, quiet=True)
    sup = SlurmSupervisor(cfg, client=SlurmClient(15, env=cluster.env),
                          on_event=timeline.append)
    result: list[int] = []
    th = threading.Thread(target=lambda: result.append(sup.run()), daemon=True)
    th.start()

    def info() -> str:
        return (ev.summary() + "\n" + "\n".join(json.dumps(e) for e in timeline[-12:])
                + "\n" + cluster.logs())

    try:
        rids = [f"train_{g}" for g in range(3)]
        wait_for(lambda: all(ev.committed(r) >= 3 for r in rids), 90,
                 "3 groups to commit 3 steps", info)
        for victim, spec in ((1, "kill:start=0,group=1"),
                             (2, "signal:sig=KILL,start=0,group=2")):
            old_job = sup.group_jobs()[victim]
            sup.inject(parse_slurm_failure(spec))
            wait_for(lambda: any(e["event"] == "relaunch" and e["group"] == victim
                                 for e in timeline), 30, f"group {victim} relaunched", info)
            new_job = wait_for(lambda: sup.groups[victim].slurm_state == "RUNNING"
                               and sup.group_jobs()[victim], 30,
                               f"group {victim}'s new job to run", info)
            assert new_job != old_job
            assert cluster.jobs()[old_job][1] in ("CANCELLED", "FAILED"), cluster.jobs()
            rid = f"train_{victim}"
            healed = wait_for(lambda: ev.healed(rid, 1), 60, f"{rid} to heal", info)[0]
            assert healed["before"] > 0, healed
            wait_for(lambda: ev.committed(rid, 1) >= healed["step"] + 2, 30,
                     f"{rid} to commit after healing", info)
        inj = [e for e in timeline if e["event"] == "inject"]
        assert [(e["kind"], e["group"]) for e in inj] == [("cancel", 1), ("signal", 2)], inj
        # finish: every trainer stops at one step and exits 0; the jobs
        # complete and the supervisor returns
        target = max(ev.committed(r) for r in rids) + 3
        (run / "stop_at").write_text(f"{target}\n")
        th.join(60)
        assert not th.is_alive(), info()
        assert result == [0], info()
    finally:
        sup.stop()
        th.join(60)
    exits = {(e["group"], e["incarnation"]): e["state"] for e in timeline if e["event"] == "exit"}
    assert exits == {(0, 0): "COMPLETED", (1, 0): "CANCELLED", (1, 1): "COMPLETED",
                     (2, 0): exits.get((2, 0)), (2, 1): "COMPLETED"}, exits
    assert exits[(2, 0)] in ("CANCELLED", "FAILED"), exits
    for r in rids:
        assert ev.committed(r) == target, info()
    ev.assert_identical(10)
    assert not cluster.active_jobs()
    assert not [p for p in ev.pids() if alive(p)]
    assert sup.lighthouse_pid is not None and not alive(sup.lighthouse_pid)


def test_a_controller_restart_does_not_stop_training(cluster, tmp_path, hard_timeout):
    """stepguard-slurm (the command) with 2 groups; slurmctld SIGKILLed:
    the supervisor sees the controller gone and relaunches nothing, the
    groups commit steps all the while, and once slurmctld is back the same
    jobs still run.  SIGTERM then cancels every job."""
    hard_timeout(150)
    run = tmp_path / "run"
    ev = Events(run)
    tl = tmp_path / "timeline.jsonl"
    argv = [sys.executable, "-m", "stepguard.launch.slurm", "--groups", "2",
            "--lighthouse-host", "127.0.0.1", "--lighthouse-bind", "127.0.0.1",
            "--join-timeout-ms", "1000", "--quorum-tick-ms", "20",
            "--work-dir", str(tmp_path / "sup"), "--poll", "0.3", "--call-timeout", "4",
            "--timeline", str(tl), "--quiet", "--no-python", *worker_cmd(run)]
    log = open(tmp_path / "supervisor.log", "wb")  # noqa: SIM115
    sup = subprocess.Popen(argv, env=cluster.env, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)

    def timeline() -> list[dict]:
        if not tl.exists():
            return []
        return [json.loads(x) for x in tl.read_text().splitlines() if x.endswith("}")]

    def info() -> str:
        return (ev.summary() + "\n" + "\n".join(json.dumps(e) for e in timeline()[-12:])
                + "\n" + (tmp_path / "supervisor.log").read_text(errors="replace")[-2000:]
                + "\n" + cluster.logs())

    try:
        rids = ["train_0", "train_1"]
        wait_for(lambda: all(ev.committed(r) >= 3 for r in rids), 90,
                 "2 groups to commit 3 steps", info)
        jobs = dict(cluster.active_jobs())
        assert len(jobs) == 2 and all(s == "RUNNING" for _, s in jobs.values()), jobs
        # killed once it has saved the running jobs (what it had not saved
        # a restarted controller does not know)
        cluster.save_state(jobs)
        cluster.kill_ctld()
        wait_for(lambda: any(e["event"] == "slurm_unreachable" for e in timeline()), 30,
                 "the supervisor to see the controller gone", info)
        # training goes on without the controller
        at_kill = {r: ev.committed(r) for r in rids}
        wait_for(lambda: all(ev.committed(r) >= at_kill[r] + 20 for r in rids), 60,
                 "20 more commits with the controller down", info)
        assert sup.poll() is None, info()
        cluster.start_ctld()
        wait_for(lambda: any(e["event"] == "slurm_reachable" for e in timeline()), 30,
                 "the supervisor to reach the controller again", info)
        back = {r: ev.committed(r) for r in rids}
        wait_for(lambda: all(ev.committed(r) >= back[r] + 3 for r in rids), 60,
                 "3 more commits after the restart", info)
        assert cluster.active_jobs() == jobs  # the same jobs, still running
        kinds = [e["event"] for e in timeline()]
        assert "relaunch" not in kinds and "exit" not in kinds, kinds
        assert all(e.get("inc", 0) == 0 for e in ev.read()), "a trainer restarted"
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(60) == 0, info()
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.wait(10)
        log.close()
    kinds = [e["event"] for e in timeline()]
    assert "cancel" in kinds and kinds[-1] == "stop", kinds
    assert not cluster.active_jobs(), cluster.jobs()
    assert not [p for p in ev.pids() if alive(p)]
    ev.assert_identical(8)


def test_multi_rank_groups_run_torchrun_inside_their_job(cluster, tmp_path, hard_timeout):
    """2 groups of 2 ranks: each job's srun step runs torchrun, whose ranks
    train together; the jobs complete and the replicas agree rank by rank."""
    hard_timeout(150)
    run = tmp_path / "run"
    ev = Events(run)
    timeline: list[dict] = []
    cfg = SlurmConfig(cmd=worker_cmd(run, torchrun=True), groups=2, nproc_per_group=2,
                      lighthouse_host="127.0.0.1", lighthouse_bind="127.0.0.1",
                      join_timeout_ms=1000, quorum_tick_ms=20, min_replicas=2,
                      work_dir=str(tmp_path / "sup"), poll_interval=0.3, call_timeout=15,
                      max_restarts=0, quiet=True)
    sup = SlurmSupervisor(cfg, client=SlurmClient(15, env=cluster.env),
                          on_event=timeline.append)
    result: list[int] = []
    th = threading.Thread(target=lambda: result.append(sup.run()), daemon=True)
    th.start()
    try:
        (run).mkdir(parents=True, exist_ok=True)
        (run / "stop_at").write_text("8\n")
        th.join(120)
        assert not th.is_alive(), ev.summary() + "\n" + cluster.logs()
    finally:
        sup.stop()
        th.join(60)
    assert result == [0], timeline
    starts = [e for e in ev.read(g="*") if e["ev"] == "start"]
    assert sorted((e["rid"], e["g"]) for e in starts) == [
        ("train_0", 0), ("train_0", 1), ("train_1", 0), ("train_1", 1)], starts
    assert all(e["torchrun"] for e in starts), starts
    exits = [e["state"] for e in timeline if e["event"] == "exit"]
    assert exits == ["COMPLETED", "COMPLETED"], timeline
    ev.assert_identical(12)  # 2 group ranks x 8 steps, less the first
