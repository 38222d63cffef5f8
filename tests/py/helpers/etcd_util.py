"""A real etcd for tests: Debian's etcd-server, free ports, data on tmpfs.

`Etcd.start()` runs one member; `EtcdCluster(3)` a 3-member cluster.  Both
use `--heartbeat-interval 50 --election-timeout 500`, so etcd's lease TTL
floor (etcd 3.4: ceil(1.5 x election timeout) = 1 s) is below the 2 s TTL
the lighthouse uses by default.  Every member is killed by its pid; its
data directory under /dev/shm is removed.

`Relay` is a TCP relay that can be severed: put it between one lighthouse
and etcd to cut that lighthouse alone off etcd.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from lighthouse_util import free_port

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
HEARTBEAT_MS = 50
ELECTION_MS = 500


def etcd_version() -> str:
    out = subprocess.run([ETCD, "--version"], capture_output=True, text=True,
                         timeout=30).stdout
    return out.split("\n")[0].split()[-1]


class Member:
    """One etcd process."""

    def __init__(self, name: str, client_port: int, peer_port: int,
                 initial_cluster: str, log: Path) -> None:
        self.name = name
        self.client_port = client_port
        self.peer_port = peer_port
        self.initial_cluster = initial_cluster
        self.data = Path(tempfile.mkdtemp(prefix="sg-etcd-", dir="/dev/shm"))
        self.log = log
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, new: bool = True) -> None:
        cmd = [
            ETCD, "--name", self.name, "--data-dir", str(self.data),
            "--listen-client-urls", self.endpoint,
            "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{self.peer_port}",
            "--initial-cluster", self.initial_cluster,
            "--initial-cluster-state", "new" if new else "existing",
            "--heartbeat-interval", str(HEARTBEAT_MS),
            "--election-timeout", str(ELECTION_MS),
        ]
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.data, ignore_errors=True)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint + "/health",
                                        timeout=1) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def is_leader(self) -> bool:
        try:
            req = urllib.request.Request(
                self.endpoint + "/v3/maintenance/status", data=b"{}",
                method="POST")
            with urllib.request.urlopen(req, timeout=1) as r:
                st = json.loads(r.read())
            return st.get("leader") == st.get("header", {}).get("member_id")
        except (OSError, ValueError, urllib.error.URLError):
            return False


class EtcdCluster:
    """n members on free ports; `endpoints` for --etcd."""

    def __init__(self, n: int = 1, log_dir: Path | None = None) -> None:
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="sg-etcd-log-"))
        self.n = n
        self.members = self._new_members()

    def _new_members(self) -> list[Member]:
        ports = [(free_port(), free_port()) for _ in range(self.n)]
        ic = ",".join(f"e{i}=http://127.0.0.1:{p}"
                      for i, (_, p) in enumerate(ports))
        return [Member(f"e{i}", c, p, ic, self.log_dir / f"etcd{i}.log")
                for i, (c, p) in enumerate(ports)]

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 30) -> "EtcdCluster":
        # etcd takes the ports it advertises on its command line, so they
        # are picked free here first; one taken by another process in
        # between makes a member exit at once: the cluster starts again on
        # fresh ports (a few times at most)
        for attempt in range(3):
            for m in self.members:
                m.start()
            try:
                self.wait_healthy(timeout)
                return self
            except AssertionError:
                taken = any("address already in use" in _text(m.log) for m in self.members)
                if attempt == 2 or not taken:
                    raise
                self.stop()
                for m in self.members:
                    m.log.rename(m.log.with_suffix(f".try{attempt}.log"))
                self.members = self._new_members()
        raise AssertionError("unreachable")

    def wait_healthy(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not all(m.healthy() for m in self.members if m.proc):
            for m in self.members:
                if m.proc and m.proc.poll() is not None:
                    raise AssertionError(
                        f"etcd {m.name} exited: {m.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"etcd not healthy within {timeout}s")
            time.sleep(0.05)

    def leader(self) -> Member | None:
        for m in self.members:
            if m.proc and m.is_leader():
                return m
        return None

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Relay:
    """A TCP relay 127.0.0.1:port -> target; sever() cuts every connection
    and refuses new ones until heal()."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.ls = socket.socket()
        self.ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(64)
        self.port = self.ls.getsockname()[1]
        self.cut = False
        self.socks: list[socket.socket] = []
        self.mu = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            with self.mu:
                if self.cut:
                    c.close()
                    continue
                try:
                    u = socket.create_connection(self.target, timeout=2)
                except OSError:
                    c.close()
                    continue
                self.socks += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b),
                                 daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                d = a.recv(65536)
                if not d or self.cut:
                    break
                b.sendall(d)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def sever(self) -> None:
        """Cut: a silent partition would be closer to the real thing, but a
        reset connection and refused reconnects are what the lighthouse
        sees in both cases within its call deadline."""
        with self.mu:
            self.cut = True
            for s in self.socks:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self.socks = []

    def heal(self) -> None:
        with self.mu:
            self.cut = False

    def close(self) -> None:
        self.closed = True
        self.sever()
        self.ls.close()


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
