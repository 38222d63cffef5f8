"""stepguard.coordination's ManagerServer, ManagerClient and QuorumResult,
in this process against the C lighthouse: fields, votes, errors, Kill and
Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from lighthouse_util import td
from stepguard import _C
from stepguard.coordination import (
    LighthouseServer,
    ManagerClient,
    ManagerServer,
    QuorumResult,
)


def start_group(lh: LighthouseServer, rid: str, world: int, **kw) -> ManagerServer:
    return ManagerServer(rid, lh.address(), "127.0.0.1", "127.0.0.1:0",
                         f"store-{rid}:1", world, td(0.05), td(5), **kw)


def run_parallel(fns):
    """Runs every fn on its own thread; returns their results or raises."""
    out: list = [None] * len(fns)
    errs: list = []

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
        assert not t.is_alive(), "a call did not return within 60 s"
    if errs:
        raise errs[0]
    return out


@pytest.fixture
def two_groups():
    lh = LighthouseServer("127.0.0.1:0", 2, join_timeout_ms=100)
    groups = [start_group(lh, r, 2) for r in ("a", "b")]
    clients = [[ManagerClient(g.address(), td(5)) for _ in range(2)]
               for g in groups]
    yield lh, groups, clients
    for cs in clients:
        for c in cs:
            c.close()
    for g in groups:
        g.shutdown()
    lh.shutdown()


def _thread_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return names


def test_library_threads_are_named(two_groups):
    """`top -H`, perf and py-spy tell the library's threads apart from the
    Python threads they would otherwise be named after."""
    names = _thread_names()
    for want in ("sg-lighthouse", "sg-mgr-loop", "sg-mgr-quorum", "sg-mgr-hbeat",
                 "sg-rpc-client"):
        assert want in names, names


def test_quorum_result_defaults_match_torchft():
    r = QuorumResult()
    assert (r.quorum_id, r.replica_rank, r.replica_world_size) == (0, 0, 1)
    assert r.recover_src_manager_address == "" and r.store_address == ""
    assert r.recover_src_replica_rank is None and r.max_replica_rank is None
    assert r.recover_dst_replica_ranks == [] and r.replica_ids == []
    assert (r.max_step, r.max_world_size, r.heal, r.commit_failures) == (0, 1, False, 0)
    r.heal = True  # fields are settable, as torchft's
    assert r.heal


def test_quorum_fields_heal_handles_metadata_and_votes(two_groups):
    _, groups, clients = two_groups
    steps = {"a": 7, "b": 3}

    def q(gi, rank):
        rid = "ab"[gi]
        return clients[gi][rank]._quorum(
            group_rank=rank, step=steps[rid],
            checkpoint_metadata=f"md-{rid}{rank}", shrink_only=False,
            init_sync=True, commit_failures=gi, timeout=td(30),
            reconfigure_handle=f"h-{rid}{rank}")

    res = run_parallel([lambda g=g, r=r: q(g, r) for g in range(2) for r in range(2)])
    a0, a1, b0, b1 = res
    assert len({r.quorum_id for r in res}) == 1
    for r in res:
        assert r.replica_ids == ["a", "b"]
        assert r.max_step == 7 and r.max_world_size == 1
        assert r.replica_world_size == 2
        assert r.commit_failures == 1  # the maximum over the quorum
        assert r.up_to_date_manager_addresses == [groups[0].address()]
    assert [a0.replica_rank, b0.replica_rank] == [0, 1]
    assert not a0.heal and a0.recover_dst_replica_ranks == [1]
    assert b0.heal and b1.heal
    assert b0.recover_src_manager_address == groups[0].address()
    assert b0.recover_src_replica_rank == 0 and b0.max_replica_rank is None
    assert a1.max_replica_rank == 0
    assert a0.reconfigure_handles == ["h-a0", "h-b0"]
    assert b1.reconfigure_handles == ["h-a1", "h-b1"]
    # the healer asks its source for the same group rank's metadata
    assert clients[0][1]._checkpoint_metadata(1, td(5)) == "md-a1"
    # one no vote makes its group refuse; the other group is unaffected
    votes = run_parallel([
        lambda: clients[0][0].should_commit(0, 7, True, td(10)),
        lambda: clients[0][1].should_commit(1, 7, False, td(10)),
        lambda: clients[1][0].should_commit(0, 7, True, td(10)),
        lambda: clients[1][1].should_commit(1, 7, True, td(10)),
    ])
    assert votes == [False, False, True, True]


def test_positional_order_matches_torchft(two_groups):
    _, _, clients = two_groups
    # (group_rank, step, checkpoint_metadata, shrink_only, init_sync,
    #  commit_failures, timeout): a lone group cannot form a quorum of 2
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        clients[0][0]._quorum(0, 1, "md", False, True, 0, td(0.5))
    assert time.monotonic() - t0 < 20


def test_errors_are_runtime_errors(two_groups):
    _, _, clients = two_groups
    with pytest.raises(RuntimeError, match="out of range"):
        clients[0][0]._quorum(5, 0, "", False, True, 0, td(5))
    with pytest.raises(RuntimeError, match="rank not found|not found"):
        clients[1][0]._checkpoint_metadata(1, td(5))
    with pytest.raises(RuntimeError):
        ManagerClient("http://127.0.0.1:1", td(0.3))
    with pytest.raises((TypeError, ValueError)):
        clients[0][0]._quorum(0, 0, "", False, True, 0, td(-1))


def test_unreachable_lighthouse_fails_construction_within_connect_timeout():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        ManagerServer("x", "http://127.0.0.1:1", "127.0.0.1", "127.0.0.1:0",
                      "s:1", 1, td(0.1), td(0.5))
    assert time.monotonic() - t0 < 20


def test_kill_handler_receives_the_message():
    lh = LighthouseServer("127.0.0.1:0", 1)
    got = threading.Event()
    msgs: list[str] = []

    def handler(msg):
        msgs.append(msg)
        got.set()

    m = start_group(lh, "k", 1, kill_handler=handler)
    c = ManagerClient(m.address(), td(5))
    c.kill("stop now")
    assert got.wait(10), "kill handler not called within 10 s"
    assert msgs == ["stop now"]
    c.close()
    m.shutdown()
    lh.shutdown()


KILL_CHILD = """
import sys, time
from datetime import timedelta
from stepguard.coordination import LighthouseServer, ManagerServer
lh = LighthouseServer("127.0.0.1:0", 1)
m = ManagerServer("k", lh.address(), "127.0.0.1", "127.0.0.1:0", "s:1", 1,
                  timedelta(seconds=0.1), timedelta(seconds=5))
print(m.address(), flush=True)
time.sleep(600)
"""


def test_default_kill_handler_logs_and_exits_1(procs):
    p = procs.spawn(KILL_CHILD, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True)
    addr = p.stdout.readline().strip()
    assert addr.startswith("http://127.0.0.1:"), addr
    c = ManagerClient(addr, td(5))
    c.kill("operator says bye")
    rc = p.wait(timeout=20)
    assert rc == 1
    assert "got kill request: operator says bye" in p.stderr.read()


# "waiting" comes once the lighthouse holds the manager's request, so the
# SIGINT lands in the call, never before its try (a traceback then).
QUORUM_CHILD = """
import json, sys, threading, time, urllib.request
from datetime import timedelta
from stepguard.coordination import LighthouseServer, ManagerClient, ManagerServer
lh = LighthouseServer("127.0.0.1:0", 2)  # never reached by one group
m = ManagerServer("w", lh.address(), "127.0.0.1", "127.0.0.1:0", "s:1", 1,
                  timedelta(seconds=0.1), timedelta(seconds=5))
c = ManagerClient(m.address(), timedelta(seconds=5))


def announce():
    url = "http://127.0.0.1:%d/status" % lh.port()
    while json.load(urllib.request.urlopen(url, timeout=5))["pending"] < 1:
        time.sleep(0.01)
    print("waiting", flush=True)


threading.Thread(target=announce, daemon=True).start()
try:
    c._quorum(0, 0, "", False, True, 0, timedelta(seconds=600))
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
"""


def _interrupt_waiting_child(p) -> None:
    """``p`` printed "waiting" and blocks in a call: Ctrl-C (SIGINT) ends it
    within 10 s, having printed "interrupted" and exiting with 3."""
    assert p.stdout.readline().strip() == "waiting"
    time.sleep(0.3)
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGINT)
    assert p.wait(timeout=10) == 3
    assert time.monotonic() - t0 < 10
    assert "interrupted" in p.stdout.read()


def test_ctrl_c_stops_a_waiting_quorum(procs):
    p = procs.spawn(QUORUM_CHILD, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, text=True)
    _interrupt_waiting_child(p)


def test_advertise_host_env_overrides_hostname(monkeypatch):
    lh = LighthouseServer("127.0.0.1:0", 1)
    monkeypatch.setenv("STEPGUARD_ADVERTISE_HOST", "lo")
    m = ManagerServer("adv", lh.address(), "some-slow-name.invalid",
                      "127.0.0.1:0", "s:1", 1, td(0.1), td(5))
    try:
        assert m.address() == f"http://127.0.0.1:{m.port()}"
    finally:
        m.shutdown()
        lh.shutdown()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


# ---- in-process calls (ManagerClient(server=...)) ---------------------------


def test_in_process_rank_shares_rounds_with_a_wire_rank():
    """Group rank 0 in-process and rank 1 over the connection: one quorum,
    each rank's own view, metadata for both, votes ANDed across paths."""
    lh = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    g = start_group(lh, "a", 2)
    local = ManagerClient(g.address(), td(5), server=g)
    remote = ManagerClient(g.address(), td(5))
    try:
        for step in (4, 5):
            r0, r1 = run_parallel([
                lambda: local._quorum(0, step, "md-0", False, True, 0, td(30)),
                lambda: remote._quorum(1, step, "md-1", False, True, 0, td(30)),
            ])
            assert isinstance(r0, QuorumResult)
            assert r0.quorum_id == r1.quorum_id
            assert r0.max_step == r1.max_step == step
            assert r0.replica_ids == r1.replica_ids == ["a"]
            assert r0.up_to_date_manager_addresses == [g.address()]
        assert remote._checkpoint_metadata(0, td(5)) == "md-0"
        assert local._checkpoint_metadata(1, td(5)) == "md-1"
        for vote in (False, True):
            votes = run_parallel([
                lambda: local.should_commit(0, 5, True, td(10)),
                lambda: remote.should_commit(1, 5, vote, td(10)),
            ])
            assert votes == [vote, vote]
    finally:
        local.close()
        remote.close()
        g.shutdown()
        lh.shutdown()


def test_in_process_errors_match_the_wire():
    lh = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    g = start_group(lh, "e", 1)
    local = ManagerClient(g.address(), td(5), server=g)
    remote = ManagerClient(g.address(), td(5))
    try:
        errs = []
        for c in (local, remote):
            with pytest.raises(RuntimeError, match="out of range") as e:
                c._quorum(3, 0, "", False, True, 0, td(5))
            errs.append((type(e.value), str(e.value)))
        assert errs[0] == errs[1]
        with pytest.raises(TypeError):
            _C.ManagerClient(g.address(), 5.0, server=object())
        local.abort()
        with pytest.raises(RuntimeError, match="aborted"):
            local.should_commit(0, 0, True, td(5))
    finally:
        local.close()
        remote.close()
        g.shutdown()
        lh.shutdown()


def test_in_process_call_fails_when_the_server_stops():
    lh = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    g = start_group(lh, "s", 2)  # rank 1 never votes: rank 0 waits
    local = ManagerClient(g.address(), td(5), server=g)
    try:
        threading.Timer(0.3, g.shutdown).start()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="UNAVAILABLE"):
            local.should_commit(0, 0, True, td(30))
        assert time.monotonic() - t0 < 10
        with pytest.raises(RuntimeError, match="UNAVAILABLE"):
            local._quorum(0, 0, "", False, True, 0, td(5))
    finally:
        local.close()
        g.shutdown()
        lh.shutdown()


IN_PROCESS_CHILD = """
import os, signal, sys, threading
from datetime import timedelta
from stepguard.coordination import LighthouseServer, ManagerClient, ManagerServer
td = lambda s: timedelta(seconds=s)
lh = LighthouseServer("127.0.0.1:0", 1)
m = ManagerServer("w", lh.address(), "127.0.0.1", "127.0.0.1:0", "s:1", 1,
                  td(0.1), td(5))
c = ManagerClient(m.address(), td(5), server=m)
tids = lambda: set(os.listdir("/proc/self/task"))
before = tids()
for i in range(40):
    assert c.should_commit(0, i, i % 2 == 0, td(5)) is (i % 2 == 0)
    c._quorum_start(0, i, "", False, True, 0, td(5))
    assert c._quorum_wait().max_step == i
print(len(tids() ^ before), flush=True)
# a vote nobody completes (world 2), stopped by Ctrl-C
m2 = ManagerServer("x", lh.address(), "127.0.0.1", "127.0.0.1:0", "s:1", 2,
                   td(0.1), td(5))
c2 = ManagerClient(m2.address(), td(5), server=m2)
try:  # a SIGINT right after the line below still lands in here
    print("waiting", flush=True)
    c2.should_commit(0, 0, True, td(600))
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
"""


def test_in_process_calls_start_no_thread_and_ctrl_c_stops_them(procs):
    """Votes and quorums in-process run on no thread of the extension's (no
    worker is made or woken), and Ctrl-C still stops a waiting one."""
    p = procs.spawn(IN_PROCESS_CHILD, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, text=True)
    changed = p.stdout.readline().strip()
    assert changed == "0", f"{changed} threads came or went over 80 calls"
    _interrupt_waiting_child(p)


# ---- the per-step hot path's helpers --------------------------------------


def test_bucket_deadlines_fire_each_at_its_own_time_and_not_when_removed() -> None:
    """The bucket allreduces' shared timer: a deadline fires once, never
    before its own timeout, a removed one never; the timer is re-armed for
    deadlines later than the one it was armed for."""
    from stepguard.ddp import _BucketDeadlines

    d = _BucketDeadlines()
    fired: dict[str, float] = {}
    done = threading.Event()

    def mark(name: str):
        def cb() -> None:
            fired[name] = time.monotonic()
            if name == "late":
                done.set()
        return cb

    t0 = time.monotonic()
    d.add(0.05, mark("early"))
    gone = d.add(0.1, mark("removed"))
    d.add(0.3, mark("late"))
    d.remove(gone)
    assert done.wait(10), f"the late deadline never fired: {fired}"
    time.sleep(0.2)  # anything still armed would fire now
    assert set(fired) == {"early", "late"}, fired
    assert fired["early"] - t0 >= 0.05 and fired["late"] - t0 >= 0.3, fired
    # an earlier deadline added while a later one is armed still fires first
    done.clear()
    fired.clear()
    t1 = time.monotonic()
    d.add(5.0, mark("never"))
    d.add(0.05, mark("late"))
    assert done.wait(10), "a deadline earlier than the armed one never fired"
    assert "never" not in fired and fired["late"] - t1 >= 0.05


def test_wrapper_allreduce_goes_straight_to_the_group_only_without_hooks() -> None:
    """ProcessGroupGloo's allreduce is one call into the c10d group; a
    subclass that overrides a hook still gets it called."""
    import torch
    from torch.distributed import AllreduceOptions, ReduceOp

    from stepguard.process_group import ProcessGroupGloo, ProcessGroupNCCL, ProcessGroupWrapper

    assert ProcessGroupGloo._plain_hooks and not ProcessGroupNCCL._plain_hooks

    calls: list = []

    class Inner:
        def allreduce(self, tensors, opts):
            calls.append(("inner", opts))
            return "work"

    class Hooked(ProcessGroupGloo):
        def _wrap_work(self, work, opts):
            calls.append(("wrap", work))
            return "wrapped"

    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    plain = ProcessGroupGloo()
    with pytest.raises(AssertionError, match="not initialized"):
        plain.allreduce([torch.zeros(1)], opts)
    plain._pg = Inner()
    assert plain.allreduce([torch.zeros(1)], opts) == "work"
    assert calls == [("inner", opts)]
    calls.clear()
    hooked = Hooked()
    assert not Hooked._plain_hooks and ProcessGroupWrapper._plain_hooks
    hooked._pg = Inner()
    assert hooked.allreduce([torch.zeros(1)], opts) == "wrapped"
    assert calls == [("inner", opts), ("wrap", "work")]


def test_bucket_deadlines_rearm_in_a_forked_child() -> None:
    """A child forked while a deadline is armed has no timer thread; a
    later deadline of its own still fires (the child re-arms on its own
    timer instead of counting on the parent's)."""
    from stepguard.ddp import _BucketDeadlines

    d = _BucketDeadlines()
    d.add(0.3, lambda: None)  # armed in the parent
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report whether its deadline fired, then _exit
        try:
            os.close(r)
            fired = threading.Event()
            d.add(0.6, fired.set)  # later than the armed one
            os.write(w, b"1" if fired.wait(10) else b"0")
        finally:
            os._exit(0)
    os.close(w)
    try:
        got = os.read(r, 1)  # the child writes within 10 s or exits
        assert got == b"1", f"the child's deadline never fired ({got!r})"
    finally:
        os.close(r)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
