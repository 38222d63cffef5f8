"""Replicated lighthouses with leadership in etcd (real processes: a real
etcd from Debian on tmpfs, lighthouses, trainers; docs/lighthouse.md,
"Replicated lighthouses").

- the leader is SIGKILLed during training with 3 replica groups: a
  follower takes over, training goes on (the stall is printed), no trainer
  exits, ids never go back, replicas end identical;
- etcd unreachable at start: a clear error and exit, no hang;
- etcd lost mid-run: the leader stops deciding, trainers wait, training
  resumes when etcd is back;
- the leader alone cut off etcd (a TCP relay severed): it stops answering
  before another is elected, and no quorum id is answered with two
  different member sets.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from datetime import timedelta

import pytest

from etcd_util import EtcdCluster, Relay, etcd_version
from lighthouse_util import LISTEN_RE, NATIVE_LIGHTHOUSE, LogProc, free_port
from train_harness import Job, job_factory, require_api, zygote, wait_for  # noqa: F401

RIDS = ("train_0", "train_1", "train_2")
# etcd 3.4 raises a TTL below ceil(1.5 x election timeout) = 1 s; 2 s is
# the lighthouse's default
TTL_S = 2


def status(addr: str) -> dict | None:
    try:
        with urllib.request.urlopen(addr.split(",")[0] + "/status",
                                    timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError, urllib.error.URLError):
        return None


def leader_index(addrs: list[str]) -> int | None:
    for i, a in enumerate(addrs):
        st = status(a)
        if st and st["role"] == "leader":
            return i
    return None


@pytest.fixture
def etcd(tmp_path, request):
    assert etcd_version().startswith("3."), etcd_version()
    c = EtcdCluster(getattr(request, "param", 1), tmp_path).start()
    try:
        yield c
    finally:
        c.stop()


def etcd_job(job_factory, etcd: EtcdCluster, n: int = 3,
             hard_timeout: int = 240) -> Job:
    prefix = f"/test/{uuid.uuid4().hex}"
    # min_replicas 3: no trainer trains alone while the others start (its
    # steps would then be held by one replica, and finish() compares them)
    job = job_factory(hard_timeout=hard_timeout, lighthouses=n,
                      heartbeat_timeout_ms=2000, min_replicas=len(RIDS),
                      lighthouse_args=("--etcd", etcd.endpoints,
                                       "--etcd_prefix", prefix,
                                       "--hostname", "127.0.0.1"))
    wait_for(lambda: leader_index(job.lh_addrs) is not None, 30,
             "a lighthouse to win the election", job)
    return job


def start_groups(job: Job) -> None:
    for rid in RIDS:
        job.start_group(rid, 1, "--steps", "100000", "--step-sleep", "0.05")
    wait_for(lambda: job.all_committed(5, RIDS), 120,
             "every group to commit 5 steps", job)


def finish(job: Job, reached: dict[str, int], slack: int = 0) -> None:
    """See ``Job.assert_went_on``."""
    job.assert_went_on(RIDS, reached, slack)


@pytest.mark.parametrize("etcd", [1, 3], indirect=True,
                         ids=["etcd1", "etcd3-kill-its-leader-too"])
def test_leader_kill_training_goes_on(job_factory, etcd):
    job = etcd_job(job_factory, etcd)
    start_groups(job)
    lead = leader_index(job.lh_addrs)
    assert lead is not None
    etcd_lead = etcd.leader() if len(etcd.members) > 1 else None
    assert etcd_lead is not None or len(etcd.members) == 1
    reached = {rid: job.committed(rid) for rid in RIDS}
    t0 = time.monotonic()
    job.kill_lighthouse(lead)
    if etcd_lead is not None:  # and the etcd leader at the same moment
        etcd_lead.kill()
    # a step in flight may still commit (votes do not involve the
    # lighthouse); two more need a quorum from the new leader
    top = max(reached.values())
    wait_for(lambda: job.all_committed(top + 2, RIDS), 60,
             "every group to commit after the leader's death", job)
    stall = time.monotonic() - t0
    others = [a for i, a in enumerate(job.lh_addrs) if i != lead]
    new = leader_index(others)
    assert new is not None, [status(a) for a in others]
    st = status(others[new])
    print(f"\nleader killed{' with the etcd leader' if etcd_lead else ''}: "
          f"every group committed 2 more steps after {stall:.2f} s (lease "
          f"TTL {st['lease_ttl_s']} s, term {st['term']})")
    # the bound is loose on purpose (sanitizers, a loaded machine): the
    # TTL, a campaign poll and the hold for the last quorum's members
    assert stall < 45, stall
    assert st["elections_won"] == 1 and st["term"] > 0
    wait_for(lambda: job.all_committed(top + 6, RIDS), 60,
             "4 more steps under the new leader", job)
    finish(job, reached)


def test_etcd_unreachable_at_start_is_a_clear_error(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    p = subprocess.run([str(NATIVE_LIGHTHOUSE), "--min_replicas", "1",
                        "--bind", "127.0.0.1:0", "--etcd", dead],
                       capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert "etcd unreachable at start" in p.stderr, p.stderr[-2000:]
    assert dead in p.stderr
    assert "listening" not in p.stderr + p.stdout
    # it tries for 5 s, each call bounded by 1 s
    assert took < 30, took


def test_etcd_lost_mid_run_then_back(job_factory, etcd):
    job = etcd_job(job_factory, etcd, n=2)
    start_groups(job)
    etcd.members[0].kill()
    # the leader's lease runs out locally (TTL - margin after its last
    # acknowledged keepalive): it stops deciding and answering
    wait_for(lambda: leader_index(job.lh_addrs) is None, 30,
             "the leader to step down without etcd", job)
    stopped = {rid: job.committed(rid) for rid in RIDS}
    time.sleep(4)
    for rid in RIDS:
        assert job.alive(rid), job.summary()
        # a step in flight may still commit (and the event of the one
        # before it may land after the snapshot), none after those
        assert job.committed(rid) <= stopped[rid] + 2, (
            rid, stopped[rid], job.committed(rid), job.summary())
    for a in job.lh_addrs:
        st = status(a)
        assert st and st["role"] != "leader" and st["etcd_errors"] > 0, st
    etcd.members[0].start(new=False)  # the same data directory
    etcd.wait_healthy()
    top = max(stopped.values())
    wait_for(lambda: job.all_committed(top + 5, RIDS), 90,
             "training to resume once etcd is back", job)
    assert leader_index(job.lh_addrs) is not None
    # a group whose quorum call was still on its way when the others met
    # again may heal from them, skipping steps: fine, and compared less
    finish(job, {rid: stopped[rid] for rid in RIDS}, slack=5)


def _start_lh(etcd_endpoint: str, prefix: str) -> tuple[LogProc, str]:
    # port 0: a port picked here and bound by the child later may be taken
    # in between by anything else running on the machine
    p = subprocess.Popen(
        [str(NATIVE_LIGHTHOUSE), "--min_replicas", "2", "--bind",
         "127.0.0.1:0", "--hostname", "127.0.0.1", "--join_timeout_ms",
         "100", "--heartbeat_timeout_ms", "1000", "--etcd", etcd_endpoint,
         "--etcd_prefix", prefix],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lp = LogProc(p)
    try:
        m = lp.wait_line(LISTEN_RE, 60)
    except BaseException:
        p.kill()
        p.wait(timeout=30)
        raise
    port = int(m.group(1).rsplit(":", 1)[1].rstrip("/"))
    return lp, f"http://127.0.0.1:{port}"


def _log_ts(lines: list[str], pattern: str) -> float | None:
    """The wall time (s) of the first log line matching pattern."""
    for line in lines:
        if re.search(pattern, line):
            ts = line.split()[0]  # 2026-12-06T04:13:09.271Z
            return time.mktime(time.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S")) + \
                float("0" + ts[19:-1])
    return None


def test_leader_cut_from_etcd_stops_before_a_new_one_wins(etcd):
    from stepguard.coordination import LighthouseClient

    prefix = f"/test/{uuid.uuid4().hex}"
    relay = Relay(etcd.members[0].client_port)
    procs: list[LogProc] = []
    clients: list[LighthouseClient] = []
    stop = threading.Event()
    answers: list[tuple[int, tuple[str, ...], str]] = []
    errors: list[str] = []
    try:
        a, addr_a = _start_lh(relay.endpoint, prefix)
        procs.append(a)
        wait_for(lambda: (status(addr_a) or {}).get("role") == "leader", 30,
                 "the relayed lighthouse to lead")
        b, addr_b = _start_lh(etcd.endpoints, prefix)
        procs.append(b)
        wait_for(lambda: (status(addr_b) or {}).get("role") == "follower", 30,
                 "the second lighthouse to follow")
        addrs = f"{addr_a},{addr_b}"

        def member(rid: str) -> None:
            c = LighthouseClient(addrs, timedelta(seconds=5))
            clients.append(c)
            step = 0
            while not stop.is_set():
                try:
                    q = c.quorum(rid, timedelta(seconds=3), step=step)
                except Exception as e:  # noqa: BLE001 - retried, counted
                    errors.append(str(e)[:200])
                    time.sleep(0.05)
                    continue
                answers.append((q.quorum_id,
                                tuple(sorted(m.replica_id for m in q.participants)),
                                rid))
                step += 1
                time.sleep(0.02)

        threads = [threading.Thread(target=member, args=(f"r{i}",), daemon=True)
                   for i in range(3)]
        for t in threads:
            t.start()
        wait_for(lambda: len(answers) >= 30, 60, "quorums from the first leader")
        n_before = len(answers)
        relay.sever()
        wait_for(lambda: (status(addr_b) or {}).get("role") == "leader", 30,
                 "the second lighthouse to win")
        wait_for(lambda: len(answers) >= n_before + 30, 60,
                 "quorums from the second leader")
        stop.set()
        for t in threads:
            t.join(timeout=10)
        # the cut leader stopped before the other one won: both log on the
        # same host's wall clock
        for p in procs:
            p.popen.kill()
            p.popen.wait(timeout=30)
        la, lb = a.lines, b.lines
        t_stop = _log_ts(la, r"no longer the leader")
        t_won = _log_ts(lb, r"won the election")
        assert t_stop is not None, "\n".join(la[-20:])
        assert t_won is not None, "\n".join(lb[-20:])
        print(f"\ncut leader stopped {1000 * (t_won - t_stop):.0f} ms before "
              f"the other won")
        assert t_stop < t_won, (t_stop, t_won)
        # no quorum id was answered with two different member sets
        by_id: dict[int, set[tuple[str, ...]]] = {}
        for qid, members, _ in answers:
            by_id.setdefault(qid, set()).add(members)
        assert all(len(v) == 1 for v in by_id.values()), by_id
        ids = sorted(by_id)
        assert len(ids) >= 2, ids
    finally:
        stop.set()
        for c in clients:
            c.close()
        for p in procs:
            if p.popen.poll() is None:
                p.popen.kill()
                p.popen.wait(timeout=30)
        relay.close()


def test_follower_forwards_torchft_single_address_client(etcd):
    """torchft's own LighthouseClient, given one follower's address, gets
    its quorums through it (forwarded to the leader), also after the leader
    is SIGKILLed and another lighthouse leads: no Quorum call fails (the
    follower holds it until a leader answers), so torchft's trainer with
    quorum_retries=0 would not exit.  Heartbeats may fail meanwhile
    (torchft only logs that)."""
    from lighthouse_util import load_torchft

    tf = load_torchft()
    prefix = f"/test/{uuid.uuid4().hex}"
    procs: list[LogProc] = []
    stop = threading.Event()
    answers: list[tuple[float, int, tuple[str, ...]]] = []
    errors: list[str] = []
    hb_errors: list[str] = []
    try:
        a, addr_a = _start_lh(etcd.endpoints, prefix)
        procs.append(a)
        wait_for(lambda: (status(addr_a) or {}).get("role") == "leader", 30,
                 "the first lighthouse to lead")
        b, addr_b = _start_lh(etcd.endpoints, prefix)
        c, addr_c = _start_lh(etcd.endpoints, prefix)
        procs += [b, c]
        for addr in (addr_b, addr_c):
            wait_for(lambda addr=addr: (status(addr) or {}).get("role") ==
                     "follower", 30, "the others to follow")
        target = addr_c  # the client knows this one address only

        def member(rid: str) -> None:
            c = tf.LighthouseClient(target, timedelta(seconds=5))
            step = 0
            while not stop.is_set():
                try:
                    c.heartbeat(rid)
                except Exception as e:  # noqa: BLE001 - counted
                    hb_errors.append(str(e)[:200])
                try:
                    q = c.quorum(rid, timedelta(seconds=20), step=step)
                except Exception as e:  # noqa: BLE001 - counted
                    errors.append(str(e)[:200])
                    time.sleep(0.1)
                    continue
                answers.append((time.monotonic(), q.quorum_id,
                                tuple(sorted(m.replica_id for m in q.participants))))
                step += 1
                time.sleep(0.02)

        threads = [threading.Thread(target=member, args=(f"r{i}",), daemon=True)
                   for i in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: len(answers) >= 20, 60, "quorums through the follower")
        st = status(target)
        assert st["role"] == "follower" and st["proxied_total"] > 0, st
        assert st["leader"] == addr_a, st
        procs[0].popen.kill()  # SIGKILL the leader
        procs[0].popen.wait(timeout=30)
        t_kill = time.monotonic()
        n = len(answers)
        wait_for(lambda: len(answers) >= n + 20, 60,
                 "quorums through the follower after the leader's death")
        after = [t for t, _, _ in answers[n:]]
        print(f"\nforwarded quorums resumed {after[0] - t_kill:.2f} s after the "
              f"leader's SIGKILL ({len(errors)} quorum and {len(hb_errors)} "
              f"heartbeat calls failed meanwhile)")
        assert errors == [], errors[:5]
        new = leader_index([addr_b, addr_c])
        assert new is not None
        by_id: dict[int, set[tuple[str, ...]]] = {}
        for _, qid, members in answers:
            by_id.setdefault(qid, set()).add(members)
        assert all(len(v) == 1 for v in by_id.values()), by_id
        ids = [qid for _, qid, _ in answers]
        assert ids[-1] > ids[0]
    finally:
        stop.set()
        for p in procs:
            if p.popen.poll() is None:
                p.popen.kill()
                p.popen.wait(timeout=30)

