"""Interop with the real peer (torchft-nightly) both ways, and differential
tests: the same request sequences against torchft's lighthouse and ours.

torchft's bindings are loaded without importing torch (see load_torchft).
Quorum ids are compared as deltas from a scenario's first quorum: ours
start from a wall-clock floor, torchft's from 1.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from lighthouse_util import (
    LOAD_TORCHFT_CODE,
    LogProc,
    load_torchft,
    spawn_logged,
    start_torchft,
    status,
    td,
    torchft_reason,
    wait_until,
)
from stepguard.coordination import LighthouseClient, LighthouseServer

tf = load_torchft()


def ids(q) -> list[str]:
    return [m.replica_id for m in q.participants]


@pytest.fixture
def pool():
    ex = ThreadPoolExecutor(max_workers=8)
    try:
        yield ex
    finally:
        ex.shutdown(wait=True)


class Impl:
    """One lighthouse implementation, started in this process."""

    def __init__(self, name: str) -> None:
        self.name = name

    @contextmanager
    def start(self, min_replicas: int = 1, join_timeout_ms: int = 60000,
              quorum_tick_ms: int = 100, heartbeat_timeout_ms: int = 5000):
        if self.name == "ours":
            s = LighthouseServer("127.0.0.1:0", min_replicas, join_timeout_ms,
                                 quorum_tick_ms, heartbeat_timeout_ms)
            port = s.port()
        else:
            s = tf.LighthouseServer("127.0.0.1:0", min_replicas, join_timeout_ms,
                                    quorum_tick_ms, heartbeat_timeout_ms)
            port = int(s.address().rsplit(":", 1)[1])
        try:
            yield port
        finally:
            s.shutdown()

    def reason(self, port: int) -> str:
        if self.name == "ours":
            return status(port)["reason"]
        return torchft_reason(port)


IMPLS = [Impl("ours"), Impl("torchft")]


@contextmanager
def ours(min_replicas: int = 1, **kw):
    s = LighthouseServer("127.0.0.1:0", min_replicas, **kw)
    try:
        yield s
    finally:
        s.shutdown()


# ---- torchft's clients against our lighthouse ---------------------------


def test_torchft_lighthouse_client_against_ours(pool):
    with ours(min_replicas=2, join_timeout_ms=60000) as s:
        a = f"http://127.0.0.1:{s.port()}"
        c1, c2 = tf.LighthouseClient(a, td(5)), tf.LighthouseClient(a, td(5))
        c1.heartbeat("t1")
        data = {"k": [1, 2], "s": "v"}
        f = pool.submit(c1.quorum, "t1", td(20), address="addr1", store_address="st1",
                        step=4, world_size=2, shrink_only=False, data=data)
        q2 = c2.quorum("t2", td(20), step=4, world_size=3)
        q1 = f.result(timeout=30)
        assert q1.quorum_id == q2.quorum_id == status(s.port())["quorum_id"]
        assert [m.replica_id for m in q1.participants] == ["t1", "t2"]
        m1 = q1.participants[0]
        assert (m1.address, m1.store_address, m1.step, m1.world_size, m1.shrink_only) == (
            "addr1", "st1", 4, 2, False)
        assert m1.data == data
        assert q1.participants[1].world_size == 3
        assert q1.created.seconds > 0
        hb = {h["replica_id"] for h in status(s.port())["heartbeats"]}
        assert {"t1", "t2"} <= hb


@pytest.fixture
def managers():
    made = []
    yield made
    for m in made:
        m.shutdown()


def test_torchft_manager_against_ours(pool, managers):
    with ours(min_replicas=2, join_timeout_ms=60000) as s:
        la = f"http://127.0.0.1:{s.port()}"
        for rid, store in (("r0", "s0:1"), ("r1", "s1:1")):
            managers.append(tf.ManagerServer(rid, la, "localhost", "[::]:0", store, 1,
                                             td(0.1), td(10), 0))
        addrs = [m.address() for m in managers]
        clients = [tf.ManagerClient(a, td(10)) for a in addrs]
        futs = [
            pool.submit(c._quorum, group_rank=0, step=step, checkpoint_metadata=f"meta{i}",
                        shrink_only=False, init_sync=True, commit_failures=0,
                        timeout=td(20), reconfigure_handle="")
            for i, (c, step) in enumerate(zip(clients, (5, 3)))
        ]
        r0, r1 = (f.result(timeout=30) for f in futs)
        qid = status(s.port())["quorum_id"]
        for r in (r0, r1):
            assert r.quorum_id == qid
            assert list(r.replica_ids) == ["r0", "r1"]
            assert r.replica_world_size == 2
            assert r.max_step == 5 and r.max_world_size == 1
            assert r.store_address == "s0:1"  # the up-to-date primary's store
        assert (r0.replica_rank, r1.replica_rank) == (0, 1)
        assert r0.heal is False and list(r0.recover_dst_replica_ranks) == [1]
        assert r1.heal is True and r1.recover_src_replica_rank == 0
        assert r1.recover_src_manager_address == addrs[0]
        assert r0.max_replica_rank == 0 and r1.max_replica_rank is None
        # the recovering replica reads the source's checkpoint metadata
        assert clients[0]._checkpoint_metadata(0, td(5)) == "meta0"


def _manager_round(port: int, managers: list, handle: str):
    m = tf.ManagerServer("r0", f"http://127.0.0.1:{port}", "localhost", "[::]:0",
                         "x:1", 1, td(0.1), td(10), 0)
    managers.append(m)
    mc = tf.ManagerClient(m.address(), td(10))
    return mc._quorum(group_rank=0, step=2, checkpoint_metadata="", shrink_only=False,
                      init_sync=True, commit_failures=0, timeout=td(10),
                      reconfigure_handle=handle)


def test_reconfigure_handles_round_trip_like_torchft(managers):
    """The pinned nightly's QuorumMember has `repeated string
    reconfigure_handles = 9`; torchft's lighthouse forwards it, so managers
    get every member's handle back.  Ours must not drop the field."""
    got = {}
    for impl in IMPLS:
        with impl.start() as port:
            got[impl.name] = list(_manager_round(port, managers, "handle-r0")
                                  .reconfigure_handles)
    assert got["torchft"] == ["handle-r0"]
    assert got["ours"] == got["torchft"], got


# ---- our client against torchft's lighthouse ----------------------------


def test_our_client_against_torchft_server():
    s = tf.LighthouseServer("127.0.0.1:0", 1)
    try:
        port = int(s.address().rsplit(":", 1)[1])
        c = LighthouseClient(f"http://127.0.0.1:{port}", td(5), auth_token="")
        c.heartbeat("ours")
        data = {"x": {"y": [True, None]}}
        q = c.quorum("ours", td(10), address="ad", store_address="st", step=9,
                     world_size=4, data=data)
        assert q.quorum_id == 1  # torchft counts from 1
        (m,) = q.participants
        assert (m.replica_id, m.address, m.store_address, m.step, m.world_size) == (
            "ours", "ad", "st", 9, 4)
        assert m.data == data
        assert c.quorum("ours", td(10)).quorum_id == 1
        q = c.quorum("ours", td(10), commit_failures=1)
        assert q.quorum_id == 2 and q.participants[0].commit_failures == 1
    finally:
        s.shutdown()


def test_our_client_against_torchft_cli(procs):
    lh = start_torchft(procs, "--min_replicas", "1", "--join_timeout_ms", "100")
    c = LighthouseClient(lh.addr, td(10), auth_token="")
    c.heartbeat("ours")
    q = c.quorum("ours", td(10), step=3)
    assert q.quorum_id == 1 and ids(q) == ["ours"] and q.participants[0].step == 3
    with pytest.raises(TimeoutError):
        LighthouseClient(lh.addr, td(10), auth_token="").quorum("late", td(0.5))
    lh.popen.terminate()
    lh.wait_exit(10)


# ---- differential scenarios ---------------------------------------------


def _cl(port: int) -> LighthouseClient:
    return LighthouseClient(f"http://127.0.0.1:{port}", td(5), auth_token="")


def _outcome(q) -> tuple:
    return (q.quorum_id, tuple((m.replica_id, m.step, m.commit_failures)
                               for m in q.participants))


def _normalize(results: list) -> list:
    """Quorum ids become deltas from the first id seen."""
    base = next(r[0] for r in results if isinstance(r, tuple))
    return [(r[0] - base, r[1]) if isinstance(r, tuple) else r for r in results]


def _together(pool, cs: dict, reqs: dict, timeout: float = 20) -> list:
    """Every replica in reqs requests at once; all must get the same quorum."""
    futs = {r: pool.submit(cs[r].quorum, r, td(timeout), **kw) for r, kw in reqs.items()}
    outs = [_outcome(f.result(timeout=timeout + 10)) for f in futs.values()]
    assert all(o == outs[0] for o in outs), outs
    return [outs[0]]


def _wait_reason(impl: Impl, port: int, *needles: str) -> str:
    def check():
        r = impl.reason(port)
        return r if all(n in r for n in needles) else None

    return wait_until(check, 10, f"{impl.name} reason containing {needles!r}")


def scenario_three_join_together(impl, port, pool):
    cs = {r: _cl(port) for r in "abc"}
    for r, c in cs.items():
        c.heartbeat(r)
    res = _together(pool, cs, {r: {"step": i} for i, r in enumerate("abc")})
    res += _together(pool, cs, {r: {"step": i + 1} for i, r in enumerate("abc")})
    return res


def _beat(c: LighthouseClient, replica_id: str, stop: threading.Event) -> None:
    while not stop.wait(0.1):
        c.heartbeat(replica_id, td(5))


def scenario_one_leaves(impl, port, pool):
    cs = {r: _cl(port) for r in "abc"}
    for r, c in cs.items():
        c.heartbeat(r)
    res = _together(pool, cs, {r: {} for r in "abc"})
    stop = threading.Event()
    beat = pool.submit(_beat, cs["c"], "c", stop)
    try:
        # c heartbeats but does not request: a and b wait for the join timeout
        res += _together(pool, cs, {"a": {"step": 1}, "b": {"step": 1}})
        # then only a requests: 1 of 3 heartbeating is no majority
        f = pool.submit(cs["a"].quorum, "a", td(1.5))
        res.append(_wait_reason(impl, port, "need at least half", "[1/1 participants"))
        try:
            f.result(timeout=20)
            res.append("quorum")
        except TimeoutError:
            res.append("timeout")
    finally:
        stop.set()
        beat.result(timeout=10)
    return res


def scenario_shrink_only(impl, port, pool):
    cs = {r: _cl(port) for r in "abd"}
    cs["a"].heartbeat("a")
    cs["b"].heartbeat("b")
    res = _together(pool, cs, {"a": {}, "b": {}})
    fd = pool.submit(cs["d"].quorum, "d", td(30), step=7)
    res.append(_wait_reason(impl, port, "[1/1 participants healthy][3 heartbeating]"))
    res += _together(pool, cs, {"a": {"shrink_only": True, "step": 1},
                                "b": {"shrink_only": True, "step": 1}})
    assert not fd.done()
    # d is still waiting (torchft re-inserts it on the broadcast)
    res.append(_wait_reason(impl, port, "[1/1 participants healthy]"))
    res += _together(pool, cs, {"a": {"step": 2}, "b": {"step": 2}})
    res.append(_outcome(fd.result(timeout=30)))
    return res


def scenario_commit_failures(impl, port, pool):
    cs = {r: _cl(port) for r in "ab"}
    cs["a"].heartbeat("a")
    cs["b"].heartbeat("b")
    res = _together(pool, cs, {"a": {}, "b": {}})
    res += _together(pool, cs, {"a": {"commit_failures": 1}, "b": {}})
    res += _together(pool, cs, {"a": {}, "b": {}})
    res += _together(pool, cs, {"a": {"commit_failures": 2}, "b": {"commit_failures": 1}})
    return res


def scenario_fast_quorum_extra_joiner(impl, port, pool):
    cs = {r: _cl(port) for r in "abe"}
    cs["a"].heartbeat("a")
    cs["b"].heartbeat("b")
    res = _together(pool, cs, {"a": {}, "b": {}})
    fe = pool.submit(cs["e"].quorum, "e", td(30), step=1)
    res.append(_wait_reason(impl, port, "[1/1 participants healthy][3 heartbeating]"))
    fa = pool.submit(cs["a"].quorum, "a", td(30), step=1)
    res.append(_wait_reason(impl, port, "[2/2 participants healthy][3 heartbeating]"))
    qb = cs["b"].quorum("b", td(30), step=1)
    res += [_outcome(qb), _outcome(fa.result(timeout=30)), _outcome(fe.result(timeout=30))]
    return res


def scenario_min_replicas(impl, port, pool):
    cs = {r: _cl(port) for r in "ab"}
    res = _together(pool, cs, {"a": {}, "b": {}})
    # b stops requesting: a alone is below min_replicas, even though b is
    # a previous member that still heartbeats (no fast quorum without it)
    f = pool.submit(cs["a"].quorum, "a", td(1))
    res.append(_wait_reason(impl, port, "need min_replicas 2", "[1/1 participants"))
    try:
        f.result(timeout=20)
        res.append("quorum")
    except TimeoutError:
        res.append("timeout")
    return res


SCENARIOS = {
    "three_join_together": (scenario_three_join_together, {}),
    "one_leaves": (scenario_one_leaves, {"join_timeout_ms": 1000}),
    "shrink_only": (scenario_shrink_only, {}),
    "commit_failures": (scenario_commit_failures, {}),
    "fast_quorum_extra_joiner": (scenario_fast_quorum_extra_joiner, {}),
    "min_replicas": (scenario_min_replicas, {"min_replicas": 2}),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_differential(name, pool):
    fn, opts = SCENARIOS[name]
    got = {}
    for impl in IMPLS:
        with impl.start(**opts) as port:
            got[impl.name] = _normalize(fn(impl, port, pool))
    assert got["ours"] == got["torchft"], got


def test_differential_sanity_scenarios_are_not_trivial():
    """Guard the harness: the scenarios see id changes and exclusions."""
    with ThreadPoolExecutor(8) as pool, IMPLS[0].start() as port:
        res = _normalize(scenario_shrink_only(IMPLS[0], port, pool))
    quorums = [r for r in res if isinstance(r, tuple)]
    assert [q[0] for q in quorums] == [0, 0, 1, 1]
    assert [m[0] for m in quorums[1][1]] == ["a", "b"]
    assert [m[0] for m in quorums[-1][1]] == ["a", "b", "d"]


# RUST_LOG=warn: torchft's info lines share the pipe and could split ours
MANAGER_CHILD = "import os\nos.environ['RUST_LOG'] = 'warn'\n" + LOAD_TORCHFT_CODE + """
import time
from datetime import timedelta
m = torchft_c.ManagerServer(sys.argv[2], sys.argv[1], "localhost", "[::]:0", "x:1", 1,
                            timedelta(milliseconds=100), timedelta(seconds=10), 0)
print("MANAGER", m.address(), flush=True)
time.sleep(600)
"""


def test_sigkilled_torchft_manager_is_excluded_quickly(procs, pool):
    """Our connection-liveness improvement with torchft's ManagerServer as
    the replica: its process dies, the lighthouse drops it well before the
    (one-minute) heartbeat timeout."""
    with ours(min_replicas=1, heartbeat_timeout_ms=60000, join_timeout_ms=600000,
              quorum_tick_ms=3600000) as s:
        la = f"http://127.0.0.1:{s.port()}"
        a = LighthouseClient(la, td(5), auth_token="")
        a.heartbeat("A")
        child = LogProc(spawn_logged(procs, MANAGER_CHILD, la, "r0"))
        maddr = child.wait_line(r"MANAGER (\S+)", 30).group(1)
        mc = tf.ManagerClient(maddr, td(10))
        fm = pool.submit(mc._quorum, group_rank=0, step=3, checkpoint_metadata="",
                         shrink_only=False, init_sync=True, commit_failures=0,
                         timeout=td(20), reconfigure_handle="")
        wait_until(lambda: status(s.port())["pending"] == 1, 20, "r0 pending")
        # A is at r0's step: when r0 dies, A holds the job's state
        q1 = a.quorum("A", td(20), step=3)
        assert ids(q1) == ["A", "r0"]
        assert fm.result(timeout=30).quorum_id == q1.quorum_id
        fa = pool.submit(a.quorum, "A", td(30), step=3)
        wait_until(lambda: status(s.port())["pending"] == 1, 10, "A pending")
        assert not fa.done()
        t0 = time.monotonic()
        os.kill(child.popen.pid, signal.SIGKILL)
        q2 = fa.result(timeout=30)
        assert time.monotonic() - t0 < 10
        assert ids(q2) == ["A"] and q2.quorum_id == q1.quorum_id + 1
