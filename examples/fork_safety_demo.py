"""What libstepguard guarantees today, shown with real processes.

A "trainer" process opens a connection to this script, forks a
"DataLoader worker" that lives on, and is then SIGKILLed.  A peer that must
notice the trainer's death (the lighthouse, a collective peer) watches the
connection.  With a socket opened through libstepguard the connection closes
as soon as the trainer dies; with a plain socket the worker keeps it open
and the peer would wait for a heartbeat timeout.

Run with: make demo
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time

import stepguard
from stepguard import _C

TRAINER = r"""
import os, socket, sys, time
from stepguard import _C
port, mode = int(sys.argv[1]), sys.argv[2]
if mode == "stepguard":
    _C.tcp_connect("127.0.0.1", port, 10.0)
else:
    keep = socket.create_connection(("127.0.0.1", port))
pid = os.fork()
if pid == 0:
    time.sleep(60)
    os._exit(0)
print(pid, flush=True)
time.sleep(60)
"""


def watch(mode: str, wait_s: float) -> float | None:
    """Returns seconds from SIGKILL to EOF, or None if none came in wait_s."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(port), mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = -1
    try:
        listener.settimeout(30)
        conn, _ = listener.accept()
        worker = int(trainer.stdout.readline())
        t0 = time.monotonic()
        trainer.kill()
        trainer.wait(timeout=30)
        deadline = t0 + wait_s
        while time.monotonic() < deadline:
            r, _, _ = select.select([conn], [], [], deadline - time.monotonic())
            if r and conn.recv(1) == b"":
                return time.monotonic() - t0
        return None
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        if worker > 0:
            os.kill(worker, signal.SIGKILL)
        listener.close()


def main() -> int:
    print(f"stepguard {stepguard.__version__} (libstepguard {_C.version()})")
    print(f"  error codes: {_C.err_name(_C.ETIMEDOUT)} = {_C.ETIMEDOUT}: "
          f"{_C.strerror(_C.ETIMEDOUT)}")
    print("trainer with a forked DataLoader-style worker, trainer SIGKILLed:")
    ok = True
    got = watch("stepguard", 10.0)
    if got is None:
        print("  libstepguard socket: connection still open after 10 s  (BUG)")
        ok = False
    else:
        print(f"  libstepguard socket: peer saw the close after {got * 1000:.1f} ms")
    got = watch("plain", 2.0)
    if got is None:
        print("  plain Python socket: still open after 2 s, held by the worker "
              "(a peer would wait for a heartbeat timeout)")
    else:
        print(f"  plain Python socket: closed after {got * 1000:.1f} ms")
    print("demo: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
