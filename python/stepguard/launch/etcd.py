"""A one-member etcd for ``stepguard-launch --lighthouses N``.

The launcher's replicated lighthouses elect their leader in etcd; when no
``--etcd`` is given it starts this one: Debian's ``etcd`` binary, free
ports on the lighthouses' host address, data on tmpfs (``/dev/shm`` when
there is one), ``--heartbeat-interval 50 --election-timeout 500`` (etcd
3.4's lease TTL floor is then 1 s, under the lighthouses' 2 s).  It is one
member, so it is a single point of failure of its own: for a real
deployment run a 3-member etcd on separate hosts (docs/lighthouse.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable


def _free_port(host: str) -> int:
    s = socket.socket()
    s.bind((host, 0))
    port = s.getsockname()[1]
    s.close()
    return port


class LocalEtcd:
    """Starts etcd; ``endpoint`` for ``--etcd``; ``stop()`` kills it by pid
    and removes its data directory."""

    def __init__(self, host: str = "127.0.0.1", log: Path | None = None,
                 preexec_fn: Callable[[], None] | None = None) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            raise RuntimeError("--lighthouses needs etcd (Debian: apt-get install "
                               "etcd-server) or --etcd ENDPOINTS of a running one")
        client, peer = _free_port(host), _free_port(host)
        self.endpoint = f"http://{host}:{client}"
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.data = Path(tempfile.mkdtemp(prefix="stepguard-etcd-", dir=base))
        cmd = [
            exe, "--name", "launch", "--data-dir", str(self.data),
            "--listen-client-urls", self.endpoint,
            "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", f"http://{host}:{peer}",
            "--initial-advertise-peer-urls", f"http://{host}:{peer}",
            "--initial-cluster", f"launch=http://{host}:{peer}",
            "--heartbeat-interval", "50", "--election-timeout", "500",
        ]
        out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.popen = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True, preexec_fn=preexec_fn)
        finally:
            if log:
                out.close()  # type: ignore[union-attr]

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"etcd exited with status {self.popen.returncode}")
            with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
                with urllib.request.urlopen(self.endpoint + "/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd at {self.endpoint} not healthy within {timeout} s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        shutil.rmtree(self.data, ignore_errors=True)
