"""The suite's own hard time limit (tests/py/conftest.py): a test that hangs
fails, its processes are killed by pid, and a hang that never returns to
Python ends pytest instead of stalling the run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

HANGS = '''
import os, signal, subprocess, sys, time
import pytest

@pytest.mark.hard_timeout(2)
def test_hangs(procs, tmp_path):
    p = procs.spawn("import time; time.sleep(600)")
    with open(os.environ["CHILD_PID_FILE"], "w") as f:
        f.write(str(p.pid))
    time.sleep(600)

@pytest.mark.hard_timeout(2)
def test_hangs_where_python_never_runs():
    # the handler cannot run in this thread: only the last resort ends it
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["CHILD_PID_FILE"] + ".2", "w") as f:
        f.write(str(child.pid))
    time.sleep(600)

def test_quick():
    assert True
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _run(tmp_path: Path, *select: str) -> tuple[subprocess.CompletedProcess, float]:
    (tmp_path / "test_hangs.py").write_text(HANGS)
    env = dict(os.environ, CHILD_PID_FILE=str(tmp_path / "child"),
               PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-p", "no:cacheprovider",
         "-o", "hard_timeout_grace=2", "--rootdir", str(tmp_path),
         "--basetemp", str(tmp_path / "bt"), *select],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return r, time.monotonic() - t0


def test_a_hung_test_fails_and_its_processes_are_killed(tmp_path):
    r, took = _run(tmp_path, "test_hangs.py::test_hangs", "test_hangs.py::test_quick")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "TestHardTimeout" in out and "exceeded its 2s hard timeout" in out, out[-3000:]
    assert "1 failed, 1 passed" in out, out[-3000:]
    assert took < 60, took  # not the test's 600 s sleep
    pid = int((tmp_path / "child").read_text())
    assert not _alive(pid), "the hung test's child outlived it"


def test_a_hang_outside_python_ends_pytest(tmp_path):
    r, took = _run(tmp_path, "test_hangs.py::test_hangs_where_python_never_runs")
    out = r.stdout + r.stderr
    assert r.returncode == 3, out[-3000:]
    assert "killing its children and exiting" in out, out[-3000:]
    assert took < 60, took
    pid = int((tmp_path / "child.2").read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "pytest's child outlived it"
