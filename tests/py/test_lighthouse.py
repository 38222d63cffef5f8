"""The lighthouse: torchft's quorum semantics, our improvements, HTTP, CLI.

Real servers on port 0; every wait is bounded.  Speed properties are
checked with loose upper bounds against a slow path made impossibly slow
(ticks of an hour, heartbeat timeouts of a minute).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lighthouse_util import (
    LOAD_TORCHFT_CODE,
    NATIVE_LIGHTHOUSE,
    OURS_CODE,
    LogProc,
    free_port,
    http_get,
    http_post,
    load_torchft,
    spawn_logged,
    start_ours,
    status,
    td,
    wait_until,
)
from stepguard.coordination import LighthouseClient, LighthouseServer


@contextmanager
def server(min_replicas: int = 1, **kw):
    s = LighthouseServer("127.0.0.1:0", min_replicas, **kw)
    try:
        yield s
    finally:
        s.shutdown()


def addr(s: LighthouseServer) -> str:
    return f"http://127.0.0.1:{s.port()}"


def client(s: LighthouseServer, **kw) -> LighthouseClient:
    kw.setdefault("auth_token", "")
    return LighthouseClient(addr(s), td(5), **kw)


def ids(q) -> list[str]:
    return [m.replica_id for m in q.participants]


def pending(s: LighthouseServer) -> int:
    return status(s.port())["pending"]


@pytest.fixture
def pool():
    ex = ThreadPoolExecutor(max_workers=8)
    try:
        yield ex
    finally:
        ex.shutdown(wait=True)  # every call in it has its own timeout


# ---- basics ------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
def test_quorum_of_n_replicas(n, pool):
    with server(min_replicas=n, join_timeout_ms=60000) as s:
        names = [f"r{i}" for i in range(n)]
        clients = {r: client(s) for r in names}
        futs = {
            r: pool.submit(clients[r].quorum, r, td(20), address=f"addr-{r}",
                           store_address=f"store-{r}", step=10 + i, world_size=i + 1)
            for i, r in enumerate(names)
        }
        qs = {r: f.result(timeout=30) for r, f in futs.items()}
        first = qs[names[0]]
        for r, q in qs.items():
            assert q.quorum_id == first.quorum_id
            assert ids(q) == sorted(names)
        for i, m in enumerate(first.participants):
            assert m.address == f"addr-{m.replica_id}"
            assert m.store_address == f"store-{m.replica_id}"
            assert m.step == 10 + i and m.world_size == i + 1
            assert m.shrink_only is False


def test_member_fields_and_data_round_trip():
    data = {"rank": 3, "nested": {"l": [1, 2.5, None, "x"]}, "u": "é✓"}
    with server() as s:
        t0 = time.time()
        q = client(s).quorum("solo:uuid", td(10), address="http://h:1",
                             store_address="h:2", step=42, world_size=8,
                             shrink_only=False, data=data)
        (m,) = q.participants
        assert (m.replica_id, m.address, m.store_address, m.step, m.world_size) == (
            "solo:uuid", "http://h:1", "h:2", 42, 8)
        assert m.data == data
        assert m.commit_failures == 0
        assert abs(q.created.seconds + q.created.nanos / 1e9 - t0) < 60
        # without data: None
        q2 = client(s).quorum("solo:uuid", td(10))
        assert q2.participants[0].data is None


def test_quorum_id_rules(pool):
    """Same membership keeps the id; a change or commit failures bump it by 1."""
    with server(join_timeout_ms=60000) as s:
        a, b = client(s), client(s)
        id1 = a.quorum("a", td(10)).quorum_id
        assert a.quorum("a", td(10)).quorum_id == id1
        q3 = a.quorum("a", td(10), commit_failures=2)
        assert q3.quorum_id == id1 + 1
        assert q3.participants[0].commit_failures == 2
        assert a.quorum("a", td(10)).quorum_id == id1 + 1
        # b joins: it waits (a heartbeats but is not requesting: split brain)
        fb = pool.submit(b.quorum, "b", td(20))
        wait_until(lambda: pending(s) == 1, 10, "b pending")
        qa = a.quorum("a", td(10))  # every previous member back: fast quorum
        qb = fb.result(timeout=20)
        assert ids(qa) == ids(qb) == ["a", "b"]
        assert qa.quorum_id == qb.quorum_id == id1 + 2
        # b goes away (closes its connection): a alone again, id bumps
        b.close()
        q = a.quorum("a", td(20))
        assert ids(q) == ["a"] and q.quorum_id == id1 + 3


def test_shrink_only_excludes_new_joiner(pool):
    with server(join_timeout_ms=60000) as s:
        a, b, c = client(s), client(s), client(s)
        a.heartbeat("a")
        b.heartbeat("b")
        fa, fb = pool.submit(a.quorum, "a", td(20)), pool.submit(b.quorum, "b", td(20))
        q1 = fa.result(timeout=30)
        assert ids(q1) == ids(fb.result(timeout=30)) == ["a", "b"]
        fc = pool.submit(c.quorum, "c", td(30))
        wait_until(lambda: pending(s) == 1, 10, "c pending")
        fa = pool.submit(a.quorum, "a", td(20), shrink_only=True)
        qb = b.quorum("b", td(20), shrink_only=True)
        qa = fa.result(timeout=30)
        assert ids(qa) == ids(qb) == ["a", "b"]
        assert all(m.shrink_only for m in qb.participants)
        assert qb.quorum_id == q1.quorum_id  # same membership
        assert not fc.done()
        assert pending(s) == 1  # c still waits for the next quorum
        fa = pool.submit(a.quorum, "a", td(20))
        qb = b.quorum("b", td(20))
        qc = fc.result(timeout=30)
        assert ids(qb) == ids(qc) == ids(fa.result(timeout=30)) == ["a", "b", "c"]
        assert qc.quorum_id == q1.quorum_id + 1


def test_heartbeat_is_recorded():
    with server() as s:
        client(s).heartbeat("hb-1", td(5))
        hb = {h["replica_id"]: h for h in status(s.port())["heartbeats"]}
        assert "hb-1" in hb and hb["hb-1"]["expired"] is False
        assert hb["hb-1"]["age_ms"] < 60000


def test_quorum_that_cannot_form_times_out():
    with server(min_replicas=2) as s:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            client(s).quorum("lonely", td(0.5))
        assert time.monotonic() - t0 < 10


def test_connect_failure_is_runtime_error():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        c = LighthouseClient(f"http://127.0.0.1:{port}", td(0.3), auth_token="")
        c.heartbeat("x", td(1))
    assert time.monotonic() - t0 < 10


def test_min_replicas_blocks(pool):
    with server(min_replicas=3, join_timeout_ms=100) as s:
        futs = [pool.submit(client(s).quorum, r, td(1.5)) for r in ("a", "b")]
        wait_until(lambda: pending(s) == 2, 10, "two pending")
        reason = status(s.port())["reason"]
        assert "only have 2 participants, need min_replicas 3" in reason
        for f in futs:
            with pytest.raises(TimeoutError):
                f.result(timeout=30)


def test_split_brain_waits_for_a_strict_majority(pool):
    """3 heartbeating, 1 requesting: waits (1 <= 3/2); a second joins: quorum.
    The one heartbeat each keeps all three healthy for the whole test."""
    with server(min_replicas=1, join_timeout_ms=300, heartbeat_timeout_ms=60000) as s:
        cs = {r: client(s) for r in "abc"}
        for r, c in cs.items():
            c.heartbeat(r)
        fa = pool.submit(cs["a"].quorum, "a", td(20))
        wait_until(lambda: pending(s) == 1, 10, "a pending")
        assert "need at least half of 3 healthy workers" in status(s.port())["reason"]
        time.sleep(0.6)  # > join timeout: still not a quorum of 1 of 3
        assert not fa.done()
        qb = cs["b"].quorum("b", td(20))
        assert ids(qb) == ids(fa.result(timeout=20)) == ["a", "b"]


# ---- event-driven decisions -------------------------------------------


def test_event_driven_quorum_without_ticks(pool):
    with server(min_replicas=2, join_timeout_ms=60000, quorum_tick_ms=3600000) as s:
        t0 = time.monotonic()
        fa = pool.submit(client(s).quorum, "a", td(30))
        qb = client(s).quorum("b", td(30))
        assert ids(qb) == ids(fa.result(timeout=30)) == ["a", "b"]
        assert time.monotonic() - t0 < 10


def test_join_timeout_expiry_issues_quorum_without_a_tick(pool):
    """A, B, C heartbeat; A and B request: the quorum {A, B} comes when the
    join timeout expires, not at the next (hourly) tick.  (With only A and B
    heartbeating and A requesting, 1 <= 2/2 is a split brain and no quorum
    is due, in torchft too.)"""
    with server(min_replicas=1, join_timeout_ms=500, quorum_tick_ms=3600000) as s:
        cs = {r: client(s) for r in "ABC"}
        for r, c in cs.items():
            c.heartbeat(r)
        t0 = time.monotonic()
        fa = pool.submit(cs["A"].quorum, "A", td(30))
        qb = cs["B"].quorum("B", td(30))
        dt = time.monotonic() - t0
        assert ids(qb) == ids(fa.result(timeout=30)) == ["A", "B"]
        assert 0.45 <= dt < 10, dt  # waited for the straggler, then no tick


# ---- connection liveness ------------------------------------------------

REPLICA_B = """
import sys, threading, time
from datetime import timedelta
from stepguard.coordination import LighthouseClient
c = LighthouseClient(sys.argv[1], timedelta(seconds=10), auth_token="")
def beat():
    while True:
        c.heartbeat("B", timedelta(seconds=5))
        time.sleep(0.1)
threading.Thread(target=beat, daemon=True).start()
q = c.quorum("B", timedelta(seconds=60))
print("QUORUM", q.quorum_id, ",".join(m.replica_id for m in q.participants), flush=True)
time.sleep(600)
"""


def test_sigkilled_replica_is_excluded_quickly(procs, pool):
    with server(min_replicas=1, heartbeat_timeout_ms=60000, join_timeout_ms=600000,
                quorum_tick_ms=3600000) as s:
        a = client(s)
        a.heartbeat("A")
        b = LogProc(spawn_logged(procs, REPLICA_B, addr(s)))
        wait_until(lambda: pending(s) == 1, 20, "B pending")
        q1 = a.quorum("A", td(20))
        assert ids(q1) == ["A", "B"]
        m = b.wait_line(r"QUORUM (\d+) (\S+)", 20)
        assert int(m.group(1)) == q1.quorum_id and m.group(2) == "A,B"
        fa = pool.submit(a.quorum, "A", td(30))
        wait_until(lambda: pending(s) == 1, 10, "A pending")
        assert not fa.done()  # B heartbeats and is a previous member
        t0 = time.monotonic()
        os.kill(b.popen.pid, signal.SIGKILL)
        q2 = fa.result(timeout=30)
        assert time.monotonic() - t0 < 10
        assert ids(q2) == ["A"] and q2.quorum_id == q1.quorum_id + 1


def test_closed_client_is_excluded_after_grace(pool):
    with server(heartbeat_timeout_ms=60000, join_timeout_ms=600000,
                quorum_tick_ms=3600000) as s:
        a, b = client(s), client(s)
        a.heartbeat("a")
        b.heartbeat("b")
        fb = pool.submit(b.quorum, "b", td(20))
        assert ids(a.quorum("a", td(20))) == ids(fb.result(timeout=20)) == ["a", "b"]
        fa = pool.submit(a.quorum, "a", td(30))
        wait_until(lambda: pending(s) == 1, 10, "a pending")
        t0 = time.monotonic()
        b.close()
        assert ids(fa.result(timeout=30)) == ["a"]
        assert time.monotonic() - t0 < 10


def test_open_connection_does_not_extend_liveness(pool):
    """b keeps its client (and connection) but stops heartbeating: it is dead
    after the heartbeat timeout, and a gets a quorum without it."""
    with server(heartbeat_timeout_ms=2000, join_timeout_ms=600000,
                quorum_tick_ms=3600000) as s:
        a, b = client(s), client(s)
        a.heartbeat("a")
        fb = pool.submit(b.quorum, "b", td(20))
        wait_until(lambda: pending(s) == 1, 10, "b pending")
        assert ids(a.quorum("a", td(20))) == ids(fb.result(timeout=20)) == ["a", "b"]
        stop = threading.Event()
        beat = pool.submit(_beat, client(s), "a", stop)  # a waits, alive
        try:
            fa = pool.submit(a.quorum, "a", td(30))
            wait_until(lambda: pending(s) == 1, 10, "a pending")
            hb = {h["replica_id"]: h for h in status(s.port())["heartbeats"]}
            assert hb["b"]["connected"] is True
            q = fa.result(timeout=30)
            assert ids(q) == ["a"]
        finally:
            stop.set()
            beat.result(timeout=10)
        b.heartbeat("b")  # still usable: the connection was open all along


def _beat(c: LighthouseClient, replica_id: str, stop: threading.Event) -> None:
    while not stop.wait(0.1):
        c.heartbeat(replica_id, td(5))


def test_cancelled_quorum_call_leaves_at_once(pool):
    with server(min_replicas=2, heartbeat_timeout_ms=60000, join_timeout_ms=300) as s:
        a = client(s)
        with pytest.raises(TimeoutError):
            a.quorum("a", td(0.5))
        wait_until(lambda: pending(s) == 0, 5, "cancelled call to leave")
        # a still heartbeats (healthy) but is no participant: the next quorum
        # is b and c after the join timeout, without the stale request.
        fb = pool.submit(client(s).quorum, "b", td(20))
        qc = client(s).quorum("c", td(20))
        assert ids(qc) == ids(fb.result(timeout=20)) == ["b", "c"]


def test_heartbeat_pruning_visible_in_status():
    with server(prune_after_ms=300) as s:
        c = client(s)
        c.quorum("member", td(10))
        c.heartbeat("old")
        wait_until(lambda: status(s.port())["pruned_heartbeats_total"] >= 1, 10,
                   "pruning")
        st = status(s.port())
        names = [h["replica_id"] for h in st["heartbeats"]]
        assert "old" not in names
        assert "member" in names  # a member of the last quorum is kept
        _, _, body = http_get(s.port(), "/metrics")
        assert re.search(rb"^stepguard_lighthouse_pruned_heartbeats_total [1-9]",
                         body, re.M)


# ---- quorum ids across restarts -----------------------------------------


def test_quorum_id_file_survives_restart(tmp_path):
    f = tmp_path / "qid"
    with server(quorum_id_file=str(f)) as s:
        id1 = client(s).quorum("a", td(10)).quorum_id
        id2 = client(s).quorum("a", td(10), commit_failures=1).quorum_id
        assert id2 == id1 + 1
    assert str(id2) in f.read_text()
    with server(quorum_id_file=str(f)) as s:
        id3 = client(s).quorum("a", td(10)).quorum_id
    assert id3 > id2
    # the file, not the clock, is the floor: a value far above the clock
    big = 10**15
    f.write_text(f"{big}\n")
    with server(quorum_id_file=str(f)) as s:
        assert client(s).quorum("a", td(10)).quorum_id > big


def test_quorum_ids_grow_across_restart_without_file():
    t0_ms = int(time.time() * 1000)
    with server() as s:
        id1 = client(s).quorum("a", td(10)).quorum_id
    assert id1 >= t0_ms - 1000  # a wall-clock floor, not 1
    with server() as s:
        id2 = client(s).quorum("a", td(10)).quorum_id
    assert id2 > id1


# ---- the step floor --------------------------------------------------------


def _held(port: int) -> bool:
    return status(port)["reason"].startswith("Holding a quorum at step 0: "
                                             "the job reached step 10")


@contextmanager
def _beating(address: str, replica_id: str):
    """Heartbeats for `replica_id` every 100 ms while the block runs."""
    stop = threading.Event()
    t = threading.Thread(target=_beat, daemon=True, args=(
        LighthouseClient(address, td(10), auth_token=""), replica_id, stop))
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=10)


def test_a_quorum_that_would_start_the_job_over_waits_for_its_state(tmp_path, pool):
    """Every replica holding step 10 is gone; a fresh one at step 0 would
    start the job over.  It waits, also across a restart (the id file keeps
    the step), until a replica that holds the step is back."""
    f = tmp_path / "qid"
    kw = dict(quorum_id_file=str(f), heartbeat_timeout_ms=300, join_timeout_ms=50,
              state_loss_wait_ms=-1)
    with server(**kw) as s:
        assert ids(client(s).quorum("a", td(10), step=10)) == ["a"]
        assert status(s.port())["step_floor"] == 10
        with _beating(addr(s), "b"):
            fb = pool.submit(client(s).quorum, "b", td(30), step=0)
            wait_until(lambda: _held(s.port()), 10, "the hold")
            time.sleep(1.0)  # far past the heartbeat and join timeouts
            assert not fb.done() and _held(s.port())
    with pytest.raises(RuntimeError):
        fb.result(timeout=30)  # the shutdown ended its call
    first = f.read_text().splitlines()[0].split()
    assert first[1] == "10", f.read_text()
    with server(**kw) as s:
        st = status(s.port())
        assert st["step_floor"] == 10 and st["step_regressions"] == 0
        with _beating(addr(s), "b"):
            fb = pool.submit(client(s).quorum, "b", td(30), step=0)
            wait_until(lambda: _held(s.port()), 10, "the hold after a restart")
            q = client(s).quorum("c", td(30), step=10)
            assert ids(q) == ids(fb.result(timeout=30)) == ["b", "c"]
        assert status(s.port())["step_regressions"] == 0


def test_a_held_call_is_answered_before_its_deadline_as_an_outage():
    """A hold can outlast a caller's deadline; the call is answered
    UNAVAILABLE before it, which a manager waits through as an outage,
    instead of expiring (an attempt against quorum_retries)."""
    kw = dict(heartbeat_timeout_ms=300, join_timeout_ms=50, state_loss_wait_ms=-1)
    with server(**kw) as s:
        assert ids(client(s).quorum("a", td(10), step=10)) == ["a"]
        with _beating(addr(s), "b"):
            # a 3 s call is answered at 2.25 s: a reply after its deadline
            # would be DEADLINE_EXCEEDED and fail the match
            for _ in range(2):  # asking again is held again
                with pytest.raises(RuntimeError, match="UNAVAILABLE.*holds the quorum, "
                                   "ask again: Holding a quorum at step 0"):
                    client(s).quorum("b", td(seconds=3), step=0)
        assert status(s.port())["step_regressions"] == 0


def test_a_bounded_wait_starts_the_job_over_loudly(procs):
    flags = ("--min_replicas", "1", "--heartbeat_timeout_ms", "300",
             "--join_timeout_ms", "50")
    lh = start_ours(procs, *flags, "--state_loss_wait_ms", "1500")
    # a's connection stays open (c is kept): it is silent, not seen to die
    c = LighthouseClient(lh.addr, td(10), auth_token="")
    assert ids(c.quorum("a", td(10), step=10)) == ["a"]
    with _beating(lh.addr, "b"):
        q = LighthouseClient(lh.addr, td(10), auth_token="").quorum("b", td(60),
                                                                     step=0)
    assert ids(q) == ["b"]
    lh.wait_line(r"WARN.*Quorum status: Holding a quorum at step 0: the job "
                 r"reached step 10", 10)
    lh.wait_line(r"ERROR.*takes the job back from step 10 to step 0, the job "
                 r"starts over: .*state_loss_wait_ms 1500", 10)
    st = status(lh.port)
    assert st["step_floor"] == 0 and st["step_regressions"] == 1
    assert st["last_step_regression"] == {"from": 10, "to": 0}
    _, _, body = http_get(lh.port, "/metrics")
    assert re.search(rb"^stepguard_lighthouse_step_regressions_total 1$", body, re.M)
    # torchft's behaviour on request: no hold at all
    lh0 = start_ours(procs, *flags, "--state_loss_wait_ms", "0")
    c0 = LighthouseClient(lh0.addr, td(10), auth_token="")
    c0.quorum("a", td(10), step=10)
    with _beating(lh0.addr, "b"):
        q = LighthouseClient(lh0.addr, td(10), auth_token="").quorum("b", td(30),
                                                                      step=0)
    assert ids(q) == ["b"]
    assert status(lh0.port)["step_regressions"] == 1
    assert "Holding" not in lh0.output()
    c.close()
    c0.close()


# ---- HTTP ---------------------------------------------------------------


def test_dashboard_is_self_contained_html():
    with server() as s:
        code, hdrs, body = http_get(s.port(), "/")
        assert code == 200
        assert hdrs["content-type"].startswith("text/html")
        page = body.decode()
        assert "<html" in page.lower() and "/status" in page
        assert not re.search(r"https?://", page), "external URL in dashboard"
        for ref in re.findall(r"""(?:src|href|action)\s*=\s*["']?([^"'\s>]*)""", page):
            assert not ref.startswith("//"), ref
        assert not re.search(r"<script[^>]+src", page, re.I)


def test_status_json(pool):
    with server(join_timeout_ms=60000) as s:
        a, b = client(s), client(s)
        a.heartbeat("a")
        fb = pool.submit(b.quorum, "b", td(20), step=7, address="addr-b")
        # b must wait before a asks: a alone would be a valid quorum
        wait_until(lambda: status(s.port())["pending"] == 1, 10, "b pending")
        q = a.quorum("a", td(20), step=7)
        fb.result(timeout=20)
        client(s).heartbeat("watcher")
        st = status(s.port())
        assert st["quorum_id"] == q.quorum_id
        assert isinstance(st["reason"], str) and "heartbeating" in st["reason"]
        pq = st["prev_quorum"]
        assert pq["quorum_id"] == q.quorum_id and pq["num_participants"] == 2
        assert [m["replica_id"] for m in pq["members"]] == ["a", "b"]
        assert pq["members"][1]["address"] == "addr-b"
        assert pq["max_step"] == 7
        assert {"a", "b", "watcher"} <= {h["replica_id"] for h in st["heartbeats"]}
        assert st["pending"] == 0


def _metrics(port: int) -> dict[str, float]:
    code, hdrs, body = http_get(port, "/metrics")
    assert code == 200 and hdrs["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for smp in fam.samples:
            if not smp.labels:
                out[smp.name] = smp.value
    return out


def test_metrics_parse_and_counters_move():
    with server() as s:
        m0 = _metrics(s.port())
        for k in ("stepguard_lighthouse_quorums_issued_total",
                  "stepguard_lighthouse_heartbeats_total",
                  "stepguard_lighthouse_quorum_requests_total",
                  "stepguard_lighthouse_quorum_id"):
            assert k in m0, sorted(m0)
        c = client(s)
        c.heartbeat("x")
        c.heartbeat("x")
        q = c.quorum("x", td(10))
        m1 = _metrics(s.port())
        assert m1["stepguard_lighthouse_heartbeats_total"] == m0[
            "stepguard_lighthouse_heartbeats_total"] + 2
        assert m1["stepguard_lighthouse_quorum_requests_total"] == m0[
            "stepguard_lighthouse_quorum_requests_total"] + 1
        assert m1["stepguard_lighthouse_quorums_issued_total"] == m0[
            "stepguard_lighthouse_quorums_issued_total"] + 1
        assert m1["stepguard_lighthouse_quorum_id"] == q.quorum_id
        assert m1["stepguard_lighthouse_quorum_request_duration_seconds_count"] >= 1
        # one decision time per quorum, on the server's clock
        dec = "stepguard_lighthouse_decision_seconds"
        assert m1[dec + "_count"] == m0[dec + "_count"] + 1
        assert 0 < m1[dec + "_sum"] - m0[dec + "_sum"] < 10
        st = status(s.port())
        assert st["decisions_total"] == m1[dec + "_count"]
        assert 0 < st["last_decision_us"] < 10e6
        _, _, body = http_get(s.port(), "/metrics")
        fam = [f for f in text_string_to_metric_families(body.decode())
               if f.name == dec]
        assert len(fam) == 1 and fam[0].type == "histogram"
        buckets = [(float(x.labels["le"]), x.value) for x in fam[0].samples
                   if x.name == dec + "_bucket"]
        bounds = [b for b, _ in buckets]
        assert bounds[0] <= 50e-6 and 1.0 in bounds and bounds[-1] == float("inf")
        assert bounds == sorted(bounds)
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and counts[-1] == m1[dec + "_count"]
        q2 = c.quorum("x", td(10))
        m2 = _metrics(s.port())
        assert m2[dec + "_count"] == m1[dec + "_count"] + 1
        assert q2.quorum_id == q.quorum_id


# RUST_LOG=warn: torchft's info lines go to the same pipe and could split
# the MANAGER line.
MANAGER_CHILD = "import os\nos.environ['RUST_LOG'] = 'warn'\n" + LOAD_TORCHFT_CODE + """
import time
from datetime import timedelta
m = torchft_c.ManagerServer("r0", sys.argv[1], "localhost", "[::]:0", "x:1", 1,
                            timedelta(milliseconds=100), timedelta(seconds=10), 0)
print("MANAGER", m.address(), flush=True)
time.sleep(600)
"""


def test_dashboard_kill_reaches_the_manager(procs):
    tf = load_torchft()
    with server() as s:
        mgr = LogProc(spawn_logged(procs, MANAGER_CHILD, addr(s)))
        maddr = mgr.wait_line(r"MANAGER (\S+)", 30).group(1)
        mc = tf.ManagerClient(maddr, td(10))
        r = mc._quorum(group_rank=0, step=1, checkpoint_metadata="", shrink_only=False,
                       init_sync=True, commit_failures=0, timeout=td(10),
                       reconfigure_handle="")
        assert list(r.replica_ids) == ["r0"]
        assert [m["replica_id"] for m in status(s.port())["prev_quorum"]["members"]] == ["r0"]
        code, _, body = http_post(s.port(), "/replica/r0/kill")
        assert code == 200, body
        assert mgr.wait_exit(10) == 1  # torchft's Kill: process::exit(1)
        code, _, _ = http_post(s.port(), "/replica/nobody/kill")
        assert code == 404


def test_kill_unknown_replica_is_404():
    with server() as s:
        assert http_post(s.port(), "/replica/ghost/kill")[0] == 404  # no quorum yet
        client(s).quorum("real", td(10))
        code, _, body = http_post(s.port(), "/replica/ghost/kill")
        assert code == 404 and b"ghost" in body
        assert http_get(s.port(), "/replica/real/kill")[0] == 405
        assert http_get(s.port(), "/nope")[0] == 404


# ---- auth ---------------------------------------------------------------


def test_auth_token_on_grpc():
    tf = load_torchft()
    with server(auth_token="s3cret") as s:
        anon = client(s)
        with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
            anon.heartbeat("a")
        with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
            anon.quorum("a", td(5))
        with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
            client(s, auth_token="wrong").heartbeat("a")
        with pytest.raises(RuntimeError, match="(?i)unauthenticated"):
            tf.LighthouseClient(addr(s), td(5)).heartbeat("t")
        good = client(s, auth_token="s3cret")
        good.heartbeat("a")
        assert ids(good.quorum("a", td(10))) == ["a"]
        names = {h["replica_id"] for h in status(s.port())["heartbeats"]}
        assert "t" not in names  # rejected calls leave no trace


def test_auth_token_on_http():
    with server(auth_token="s3cret") as s:
        client(s, auth_token="s3cret").quorum("r", td(10))
        code, hdrs, _ = http_post(s.port(), "/replica/r/kill")
        assert code == 401 and "bearer" in hdrs.get("www-authenticate", "").lower()
        assert http_post(s.port(), "/replica/r/kill",
                         headers={"Authorization": "Bearer nope"})[0] == 401
        assert http_post(s.port(), "/replica/ghost/kill",
                         headers={"Authorization": "Bearer s3cret"})[0] == 404
        assert http_get(s.port(), "/status")[0] == 200
        assert http_get(s.port(), "/metrics")[0] == 200
        assert http_get(s.port(), "/")[0] == 200


# ---- CLI ----------------------------------------------------------------

TORCHFT_FLAGS = ("--bind", "--min_replicas", "--join_timeout_ms", "--quorum_tick_ms",
                 "--heartbeat_timeout_ms")


def _run_cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", OURS_CODE, *args], capture_output=True,
                          text=True, timeout=30, env=env)


def test_cli_help_lists_torchft_flags():
    r = _run_cli("--help")
    assert r.returncode == 0
    for flag in TORCHFT_FLAGS:
        assert flag in r.stdout, flag


def test_native_binary_help():
    if not NATIVE_LIGHTHOUSE.exists():
        pytest.skip(f"{NATIVE_LIGHTHOUSE} not built (run `make build`)")
    r = subprocess.run([str(NATIVE_LIGHTHOUSE), "--help"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0 and "--min_replicas" in r.stdout


def test_cli_requires_min_replicas():
    r = _run_cli("--bind", "127.0.0.1:0")
    assert r.returncode != 0
    assert "min_replicas" in r.stderr


def test_cli_rejects_bad_values():
    r = _run_cli("--min_replicas", "one")
    assert r.returncode != 0 and "min_replicas" in r.stderr
    r = _run_cli("--min_replicas", "1", "--no_such_flag", "1")
    assert r.returncode != 0 and "no_such_flag" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_stops_cleanly_on_signal(procs, sig):
    lh = start_ours(procs, "--min_replicas", "1")
    c = LighthouseClient(lh.addr, td(5), auth_token="")
    assert ids(c.quorum("a", td(10))) == ["a"]
    c.close()
    t0 = time.monotonic()
    lh.popen.send_signal(sig)
    assert lh.wait_exit(10) == 0, lh.output()
    assert time.monotonic() - t0 < 10


def test_cli_auth_token_file(procs, tmp_path):
    tok = tmp_path / "token"
    tok.write_text("file-token\n")
    env = dict(os.environ)
    env.pop("STEPGUARD_AUTH_TOKEN", None)
    lh = start_ours(procs, "--min_replicas", "1", "--auth_token_file", str(tok), env=env)
    with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
        LighthouseClient(lh.addr, td(5), auth_token="").heartbeat("a")
    LighthouseClient(lh.addr, td(5), auth_token="file-token").heartbeat("a")


def test_cli_status_burst_logs_latest_reason(procs):
    """A burst of changes logs at most one status line per 100 ms, and the
    latest reason still comes out without any tick (the wake timer)."""
    lh = start_ours(procs, "--min_replicas", "50", "--quorum_tick_ms", "3600000")
    c = LighthouseClient(lh.addr, td(5), auth_token="")
    t0 = time.monotonic()
    for i in range(20):
        c.heartbeat(f"r{i}")
    burst_s = time.monotonic() - t0
    lh.wait_line(r"Quorum status: .*\[20 heartbeating\]", 5)
    lines = [ln for ln in list(lh.lines) if "Quorum status:" in ln]
    # the first line at start, then at most one per 100 ms of the burst
    # (the last held-back change adds one)
    assert len(lines) <= 3 + burst_s / 0.1, (burst_s, lines)


def test_cli_logs_quorum_status_only_on_change(procs):
    lh = start_ours(procs, "--min_replicas", "1", "--quorum_tick_ms", "100")
    c = LighthouseClient(lh.addr, td(5), auth_token="")
    q1 = c.quorum("a", td(10))
    lh.wait_line(r"Quorum! id %d" % q1.quorum_id, 10)
    time.sleep(1.2)  # about 12 ticks while idle

    def count(rx: str) -> int:
        return sum(1 for line in lh.lines if re.search(rx, line))

    status_lines = [ln.split("Quorum status:", 1)[1] for ln in list(lh.lines)
                    if "Quorum status:" in ln]
    assert 1 <= len(status_lines) <= 4, status_lines
    for prev, cur in zip(status_lines, status_lines[1:]):
        assert prev != cur, "same reason logged twice in a row"
    n_status = len(status_lines)
    q2 = c.quorum("a", td(10))  # same membership: same id
    assert q2.quorum_id == q1.quorum_id
    wait_until(lambda: count(r"Quorum! id %d" % q2.quorum_id) == 2, 10,
               "second Quorum! line")
    time.sleep(1.2)
    assert count(r"Quorum!") == 2
    assert count(r"Detected quorum change") == 1
    # the reason cycles to "valid" and back; idle ticks add nothing
    assert count(r"Quorum status:") <= n_status + 2
    final = count(r"Quorum status:")
    time.sleep(0.5)
    assert count(r"Quorum status:") == final


def test_output_nobody_reads_does_not_stop_the_lighthouse(procs):
    """A launcher that keeps the lighthouse's output in a pipe and stops
    reading it (here after the address line) must not stop the lighthouse
    once the pipe is full: the lines that do not fit are dropped and
    counted, not waited for.  At debug level each quorum logs a line of
    ~130 bytes, so 1500 quorums overflow a 64 KiB pipe twice over; before,
    the lighthouse blocked in write(2) a few hundred quorums in."""
    import fcntl

    from lighthouse_util import LISTEN_RE

    env = dict(os.environ, STEPGUARD_LOG="debug")
    p = procs.spawn(OURS_CODE, "--bind", "127.0.0.1:0", "--min_replicas", "1",
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    fd = p.stdout.fileno()
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)

    def read_some() -> bytes:
        try:
            return os.read(fd, 65536)
        except BlockingIOError:
            return b""

    out = [b""]

    def listening():
        out[0] += read_some()
        return LISTEN_RE.search(out[0].decode(errors="replace"))

    m = wait_until(listening, 30, "the address line")
    port = int(m.group(1).rsplit(":", 1)[1].rstrip("/"))
    c = LighthouseClient(f"http://127.0.0.1:{port}", td(10), auth_token="")
    try:
        t0 = time.monotonic()
        for _ in range(1500):
            c.quorum("r0", td(10))  # a blocked lighthouse fails this in 10 s
        assert time.monotonic() - t0 < 60
        # drain; the next line says how many were lost
        while read_some():
            pass
        c.quorum("r0", td(10))
        tail = b""
        deadline = time.monotonic() + 10
        while b"dropped" not in tail and time.monotonic() < deadline:
            tail += read_some()
            time.sleep(0.01)
    finally:
        c.close()
    text = tail.decode(errors="replace")
    m = re.search(r"\[stepguard\] (\d+) log line\(s\) dropped: stderr was full", text)
    assert m is not None, text[-2000:]
    assert int(m.group(1)) > 0
    assert p.poll() is None
