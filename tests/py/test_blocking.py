"""The extension's worker threads (python/_C/blocking.c) and the quorum
that starts without a Python thread (ManagerClient._quorum_start /
_quorum_wait, and the Manager over them).

Worker threads are per process, so the checks that count threads or fork
run in child processes of their own; each one is killed by pid at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from lighthouse_util import td
from stepguard.coordination import LighthouseServer, ManagerClient, ManagerServer
from stepguard.manager import Manager, _Quorum, _ThreadQuorumCall
from stepguard.process_group import ProcessGroupDummy

# A group of one whose votes need nobody else: every call returns at once.
SETUP = """
import os, sys, time
from datetime import timedelta
from stepguard.coordination import LighthouseServer, ManagerClient, ManagerServer
td = lambda s: timedelta(seconds=s)
def group():
    lh = LighthouseServer("127.0.0.1:0", 1)
    m = ManagerServer("w", lh.address(), "127.0.0.1", "127.0.0.1:0", "s:1", 1,
                      td(0.1), td(5))
    return lh, m, ManagerClient(m.address(), td(5))
def tids():
    return set(os.listdir("/proc/self/task"))
"""

REUSE_CHILD = SETUP + """
lh, m, c = group()
before = tids()
assert c.should_commit(0, 0, True, td(5)) is True
after_vote = tids()
assert c._wait_lost(10**6, 0.01) is None
after_one = tids()
for i in range(40):
    assert c.should_commit(0, i + 1, True, td(5)) is True
    assert c._wait_lost(10**6, 0.01) is None
after_many = tids()
print(len(after_vote - before), len(after_one - after_vote),
      len(after_many ^ after_one), flush=True)
"""


def test_main_thread_calls_reuse_one_worker(procs) -> None:
    """A vote is a started call that no thread waits for; the first other
    blocking call from the main thread leaves one worker behind, and forty
    more of each run with no thread starting or ending."""
    p = procs.spawn(REUSE_CHILD, stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    by_vote, kept, changed = (int(x) for x in out.split())
    assert by_vote == 0, f"{by_vote} threads started by a vote"
    assert kept == 1, f"{kept} threads left by the first blocking call"
    assert changed == 0, f"{changed} threads came or went over 40 calls"


FORK_CHILD = SETUP + """
lh, m, c = group()
assert c.should_commit(0, 0, True, td(5)) is True  # the parent's pool exists
pid = os.fork()
if pid == 0:
    # no worker survived the fork: the child's first call makes its own
    lh2, m2, c2 = group()
    ok = c2.should_commit(0, 0, True, td(5))
    c2.close(); m2.shutdown(); lh2.shutdown()
    os._exit(0 if ok is True else 5)
print(pid, flush=True)
_, status = os.waitpid(pid, 0)
assert c.should_commit(0, 1, True, td(5)) is True  # the parent's still works
print(os.waitstatus_to_exitcode(status), flush=True)
"""


def test_blocking_call_in_forked_child(procs) -> None:
    p = procs.spawn(FORK_CHILD, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.strip().isdigit(), line
    procs.track(int(line))
    rest = procs.rest_of_stdout(p, timeout=60)
    assert p.returncode == 0
    assert rest.strip() == "0", "the forked child's call failed"


# A thread logs without pause (the GIL released inside, as the manager's
# threads log) while the main thread forks; each child logs one line.  A
# child forked while the thread held the log's lock used to block forever.
LOG_FORK_CHILD = """
import os, sys, threading, time
from stepguard import _C
stop = threading.Event()
def spam():
    while not stop.is_set():
        _C.log(2, "spam", "x" * 200)
t = threading.Thread(target=spam)
t.start()
hung = 0
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        _C.log(2, "child", "one line")
        os._exit(0)
    deadline = time.monotonic() + 20
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            hung += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.005)
stop.set()
t.join()
print(hung, flush=True)
"""


def test_child_forked_while_another_thread_logs_can_log(procs) -> None:
    """Before the log's fork handlers, about one fork in thirty hung here;
    the forked-child test above hit the same hang when a server thread's
    line was being written at its fork()."""
    p = procs.spawn(LOG_FORK_CHILD, "150", stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, text=True)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert out.strip() == "0", f"{out.strip()} of 150 children hung on their first log line"


FORK_PENDING_CHILD = """
import os, sys
from datetime import timedelta
from stepguard.coordination import LighthouseServer, ManagerClient, ManagerServer
lh = LighthouseServer("127.0.0.1:0", 2)  # never reached by one group
m = ManagerServer("w", lh.address(), "127.0.0.1", "127.0.0.1:0", "s:1", 1,
                  timedelta(seconds=0.1), timedelta(seconds=5))
c = ManagerClient(m.address(), timedelta(seconds=5))
c._client._quorum_start(0, 0, "", False, True, 0, 600.0)
pid = os.fork()
if pid == 0:
    try:
        c._client._quorum_wait()
    except RuntimeError as e:
        os._exit(0 if "before fork" in str(e) else 6)
    os._exit(7)
print(pid, flush=True)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), flush=True)
os._exit(0)
"""


def test_quorum_started_before_fork_fails_in_the_child(procs) -> None:
    """A forked child cannot finish its parent's call (the worker stayed
    behind): waiting for it fails at once instead of hanging."""
    p = procs.spawn(FORK_PENDING_CHILD, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.strip().isdigit(), line
    procs.track(int(line))
    rest = procs.rest_of_stdout(p, timeout=60)
    assert p.returncode == 0
    assert rest.strip() == "0", f"child exit {rest.strip()}"


QUORUM_WAIT_CHILD = """
import sys
from datetime import timedelta
from stepguard.coordination import LighthouseServer, ManagerClient, ManagerServer
lh = LighthouseServer("127.0.0.1:0", 2)  # never reached by one group
m = ManagerServer("w", lh.address(), "127.0.0.1", "127.0.0.1:0", "s:1", 1,
                  timedelta(seconds=0.1), timedelta(seconds=5))
c = ManagerClient(m.address(), timedelta(seconds=5))
c._client._quorum_start(0, 0, "", False, True, 0, 600.0)
try:  # a SIGINT right after the line below still lands in here
    print("waiting", flush=True)
    c._client._quorum_wait()
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
"""


def test_ctrl_c_stops_a_started_quorum(procs) -> None:
    p = procs.spawn(QUORUM_WAIT_CHILD, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, text=True)
    assert p.stdout.readline().strip() == "waiting"
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGINT)
    assert p.wait(timeout=20) == 3
    assert "interrupted" in p.stdout.read()


@pytest.fixture
def one_group():
    lh = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    m = ManagerServer("g", lh.address(), "127.0.0.1", "127.0.0.1:0", "s:1", 1,
                      td(0.05), td(5))
    c = ManagerClient(m.address(), td(5))
    yield lh, m, c
    c.close()
    m.shutdown()
    lh.shutdown()


def test_started_quorum_matches_a_blocking_one(one_group) -> None:
    _, _, c = one_group
    native = c._client
    native._quorum_start(0, 0, "meta-a", False, True, 0, 10.0)
    with pytest.raises(RuntimeError, match="already started"):
        native._quorum_start(0, 0, "meta-b", False, True, 0, 10.0)
    started = native._quorum_wait()
    with pytest.raises(RuntimeError, match="no quorum was started"):
        native._quorum_wait()
    blocking = c._quorum(0, 0, "meta-a", False, True, 0, td(10))
    assert started["quorum_id"] == blocking.quorum_id
    assert started["replica_world_size"] == 1 == blocking.replica_world_size
    assert started["max_step"] == 0 and started["heal"] is False
    # the metadata was copied: the group's manager hands it back
    assert c._checkpoint_metadata(0, td(5)) == "meta-a"


def test_started_quorum_raises_its_error() -> None:
    lh = LighthouseServer("127.0.0.1:0", 2)  # a quorum of one never forms
    m = ManagerServer("t", lh.address(), "127.0.0.1", "127.0.0.1:0", "s:1", 1,
                      td(0.05), td(5))
    c = ManagerClient(m.address(), td(5))
    try:
        c._client._quorum_start(0, 0, "", False, True, 0, 0.3)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            c._client._quorum_wait()
        assert time.monotonic() - t0 < 10
        c._client._quorum_start(0, 0, "", False, True, 0, 30.0)
        with pytest.raises(RuntimeError, match="while a call is running"):
            c.close()  # the started call uses the connection
        c._client.abort()
        with pytest.raises(RuntimeError):
            c._client._quorum_wait()  # aborted: fails promptly
    finally:
        c.close()
        m.shutdown()
        lh.shutdown()


DEALLOC_CHILD = """
import time
from datetime import timedelta
from stepguard.coordination import LighthouseServer, ManagerClient, ManagerServer
lh = LighthouseServer("127.0.0.1:0", 2)
m = ManagerServer("w", lh.address(), "127.0.0.1", "127.0.0.1:0", "s:1", 1,
                  timedelta(seconds=0.1), timedelta(seconds=5))
c = ManagerClient(m.address(), timedelta(seconds=5))
c._client._quorum_start(0, 0, "", False, True, 0, 600.0)
t0 = time.monotonic()
del c  # nobody collects the call: it is aborted and waited for
print(round(time.monotonic() - t0, 3), flush=True)
m.shutdown(); lh.shutdown()
"""


def test_dropping_a_client_ends_its_started_quorum(procs) -> None:
    p = procs.spawn(DEALLOC_CHILD, stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    assert float(out.strip()) < 30, "the quorum ran on to its deadline"


class _StandIn:
    """A client that is not the extension's: the one quorum road starts its
    blocking call on a thread of its own."""

    def __init__(self, real: ManagerClient) -> None:
        self._real = real

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


@pytest.mark.parametrize("stand_in", [False, True])
def test_manager_steps_with_and_without_the_native_quorum(stand_in: bool) -> None:
    lh = LighthouseServer("127.0.0.1:0", 1, join_timeout_ms=50)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    w = torch.zeros(4)
    m = Manager(ProcessGroupDummy(0, 1), lambda sd: w.copy_(sd["w"]), lambda: {"w": w},
                min_replica_size=1, rank=0, world_size=1, store_addr="127.0.0.1",
                store_port=store.port, lighthouse_addr=lh.address(), replica_id="n",
                timeout=td(10), quorum_timeout=td(10), connect_timeout=td(10),
                hostname="127.0.0.1")
    try:
        if stand_in:
            m._client = _StandIn(m._client)  # type: ignore[assignment]
        for i in range(4):
            m.start_quorum()
            assert isinstance(m._quorum_future, _Quorum)
            assert isinstance(m._quorum_future._call, _ThreadQuorumCall) == stand_in
            g = torch.full((4,), float(i + 1))
            assert m.allreduce(g).wait()
            assert m.should_commit()
            w.add_(g)
        assert m.current_step() == 4
        assert m.num_participants() == 1
        assert w[0].item() == 10.0
    finally:
        m.shutdown(wait=False)
        lh.shutdown()


def test_manager_native_quorum_error_raises_at_every_wait() -> None:
    lh = LighthouseServer("127.0.0.1:0", 2)  # never reached: quorum times out
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    m = Manager(ProcessGroupDummy(0, 1), None, None, min_replica_size=1, rank=0,
                world_size=1, store_addr="127.0.0.1", store_port=store.port,
                lighthouse_addr=lh.address(), replica_id="e", timeout=td(10),
                quorum_timeout=timedelta(milliseconds=300), connect_timeout=td(10),
                hostname="127.0.0.1")
    try:
        m.start_quorum()
        for _ in range(2):
            with pytest.raises(TimeoutError):
                m.wait_quorum()
        with pytest.raises(TimeoutError):
            m.start_quorum()  # the previous quorum's failure, as torchft
    finally:
        m.shutdown(wait=False)
        lh.shutdown()
