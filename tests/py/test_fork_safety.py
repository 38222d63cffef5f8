"""A DataLoader-style fork must not keep the trainer's connections open.

The trainer process opens a connection through libstepguard, then forks a
worker with os.fork() (what a DataLoader does) that sleeps.  When the
trainer is SIGKILLed, the listening test must see the connection close
although the worker lives on.  The control opens the same connection with
Python's own socket module and shows the worker then holds it open.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time

import pytest

TRAINER = r"""
import os, socket, sys, time
from stepguard import _C
port, mode = int(sys.argv[1]), sys.argv[2]
if mode == "stepguard":
    fd = _C.tcp_connect("127.0.0.1", port, 10.0)
else:
    s = socket.create_connection(("127.0.0.1", port))
pid = os.fork()
if pid == 0:
    time.sleep(120)
    os._exit(0)
print(pid, _C.fork_count(), flush=True)
time.sleep(120)
"""


def _eof_within(conn: socket.socket, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        r, _, _ = select.select([conn], [], [], max(0.0, deadline - time.monotonic()))
        if r:
            try:
                if conn.recv(1) == b"":
                    return True
            except ConnectionResetError:
                return True
    return False


def _run(procs, mode: str, window_s: float) -> bool:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    trainer = procs.spawn(TRAINER, str(port), mode, stdout=subprocess.PIPE, text=True)
    listener.settimeout(30)
    conn, _ = listener.accept()
    line = trainer.stdout.readline().split()
    assert line, "trainer did not report its worker"
    worker = int(line[0])
    procs.track(worker)
    assert int(line[1]) == 0  # the trainer itself is the original process
    trainer.kill()
    trainer.wait(timeout=30)
    try:
        return _eof_within(conn, window_s)
    finally:
        os.kill(worker, signal.SIGKILL)
        conn.close()
        listener.close()


def test_trainer_death_closes_connection_despite_forked_worker(procs) -> None:
    # Loose bound: the property is "closes at all while the worker lives".
    assert _run(procs, "stepguard", 10.0)


def test_control_plain_socket_is_held_open_by_worker(procs) -> None:
    assert not _run(procs, "python", 1.0)


CYCLE = r"""
import gc, os
import torch
from stepguard import _C

lh = _C.LighthouseServer("127.0.0.1:0", 1)
gc.disable()  # the cycle below stays garbage, not yet freed, at fork()


class Cycle:
    pass


c = Cycle()
c.me = c
c.srv = _C.ManagerServer("fork", lh.address(), None, "127.0.0.1:0", None, 1, 0.1, 5.0, 0)
c.lh = _C.LighthouseServer("127.0.0.1:0", 1)
del c


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        gc.collect()  # what a worker's garbage collector does sooner or later
        return i


got = sorted(int(x) for x in torch.utils.data.DataLoader(
    Data(), num_workers=2, multiprocessing_context="fork"))
print("ok" if got == list(range(8)) else f"wrong {got}", flush=True)
os._exit(0)
"""


def test_a_manager_server_freed_in_a_forked_worker_does_not_crash_it(procs) -> None:
    """A trainer's ManagerServer in a reference cycle its garbage collector
    has not freed yet when a DataLoader forks its workers: each worker's
    collector frees its copy, which must not stop the parent's threads
    (joining threads that do not exist in the child crashed both workers
    with SIGSEGV)."""
    p = procs.spawn(CYCLE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and out.strip() == "ok", (out, err[-3000:])
    # ... nor a LighthouseServer's (its loop is the parent's)
    assert "event loop closed with handles open" not in err, err[-3000:]
