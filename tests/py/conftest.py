"""Shared fixtures: process cleanup by pid for multi-process tests.

The helper modules and worker scripts the tests share live in
``tests/py/helpers/``; that directory goes on ``sys.path`` here, so test
files import them by their plain names (``from train_harness import Job``),
as the worker scripts, which run from there, import each other.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)


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
