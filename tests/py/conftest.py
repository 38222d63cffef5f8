"""Shared fixtures: process cleanup by pid for multi-process tests, and a
hard time limit on every test.

Every test (its setup, call and teardown) has ``hard_timeout`` seconds
(an ini option, 900 by default; ``@pytest.mark.hard_timeout(S)`` for one
test): then
every thread's stack is printed and the test fails with ``TestHardTimeout``
raised in the main thread, so that its fixtures still kill what it started.
If it has not ended ``hard_timeout_grace`` (60) seconds later (a call
that does not return to Python),
the children of pytest are SIGKILLed by pid and pytest exits with status 3:
a hang fails the run rather than stalling it.

The helper modules and worker scripts the tests share live in
``tests/py/helpers/``; that directory goes on ``sys.path`` here, so test
files import them by their plain names (``from train_harness import Job``),
as the worker scripts, which run from there, import each other.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)

# imported here, not where a hung test is ended (an import there could wait
# on the import lock of the very thread that hangs); light: torch loads in
# the worker's main()
from train_worker import child_pids  # noqa: E402


class Procs:
    """Starts helper processes and kills every one of them at teardown."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.popens: list[subprocess.Popen] = []

    def spawn(self, code: str, *args: str, **kw) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", code, *args], **kw)
        self.popens.append(p)
        return p

    def track(self, pid: int) -> None:
        self.pids.append(pid)

    @staticmethod
    def rest_of_stdout(p: subprocess.Popen, timeout: float) -> str:
        """What `p` writes to its stdout pipe after what was already read,
        once it exits within `timeout`.  After a ``readline()``,
        ``communicate(timeout=...)`` would lose whatever the readline's
        buffer already took from the pipe (it reads the pipe itself).  For
        short outputs only: `p` must not fill the pipe before it exits."""
        p.wait(timeout=timeout)
        assert p.stdout is not None
        return p.stdout.read()

    def cleanup(self) -> None:
        for p in self.popens:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.cleanup()


class TestHardTimeout(BaseException):
    """Raised in the main thread when a test overruns its hard time limit
    (a BaseException, so that no ``except Exception`` in a test swallows it)."""

    __test__ = False  # not a test class


def pytest_addoption(parser) -> None:
    parser.addini("hard_timeout", "seconds a test may take in all before it is failed",
                  default="900")
    parser.addini("hard_timeout_grace", "seconds a timed-out test has to end before "
                  "pytest kills its children and exits", default="60")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "hard_timeout(seconds): this test's own hard time limit")


def _uncaptured_stderr(config) -> int:
    """The file descriptor of pytest's stderr before its output capture."""
    capman = config.pluginmanager.getplugin("capturemanager")
    try:
        fd = capman._global_capturing.err.targetfd_save
    except AttributeError:  # no fd capture (-s), or another pytest layout
        return 2
    return fd if isinstance(fd, int) else 2


def _children() -> list[int]:
    return child_pids(os.getpid())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    mark = item.get_closest_marker("hard_timeout")
    limit = float(mark.args[0]) if mark else float(item.config.getini("hard_timeout"))
    grace = float(item.config.getini("hard_timeout_grace"))
    done = threading.Event()
    fired = [False]

    def on_signal(signum, frame):
        if fired[0] and not done.is_set():
            fired[0] = False  # once
            raise TestHardTimeout(f"{item.nodeid} exceeded its {limit:.0f}s hard timeout")

    def watchdog() -> None:
        if done.wait(limit):
            return
        sys.stderr.write(f"\n{item.nodeid}: hard timeout ({limit:.0f}s); stacks:\n")
        faulthandler.dump_traceback(all_threads=True)
        fired[0] = True
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)
        if done.wait(grace):
            return
        # straight to pytest's own stderr: what the test's capture holds is
        # lost with the process
        fd = _uncaptured_stderr(item.config)
        os.write(fd, f"\n{item.nodeid}: still running {grace:.0f} s after its hard "
                 "timeout; killing its children and exiting\n".encode())
        faulthandler.dump_traceback(fd, all_threads=True)
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(3)

    old = signal.signal(signal.SIGUSR2, on_signal)
    t = threading.Thread(target=watchdog, name="hard-timeout", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        signal.signal(signal.SIGUSR2, old)
