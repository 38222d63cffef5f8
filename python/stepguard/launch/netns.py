"""Network namespaces for ``partition`` injection and ``--netns``.

:func:`netns_unavailable` says whether this host can run them; one
:class:`_Netns` creates, cuts, heals and removes the namespaces of one
launch.  Needs root and the ``ip`` and ``unshare`` commands.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["netns_unavailable"]

# Layout for a launch with tag T = "sgln<launcher pid>":
#
#   root namespace          hub namespace "Tx"              group namespace "Tg<G>"
#   lighthouse, launcher    bridge br0 (no addresses)       the group's ranks and its
#   Tr 198.18.N.1/24 <----> up0 -+- br0 -+- g<G> <-------> eth0 198.18.N.<10+G>/24
#
# The bridge sits in a namespace of its own, so neither the host's iptables
# (br_netfilter sends bridged frames through them) nor IP forwarding is
# involved.  A partition sets g<G> down in the hub: the group keeps its
# loopback (its ranks and its store still talk) and loses everything else.
# Each group also gets its own UTS namespace, hostname "T-g<G>", and an
# /etc/netns/Tg<G>/hosts (which `ip netns exec` mounts over /etc/hosts)
# naming every group, so code that advertises socket.gethostname() (torch's
# Gloo, torchft) is reachable too.  198.18.0.0/15 is the block reserved for
# network tests (RFC 2544); the /24 is one no route on the host uses yet.

_NS_PREFIX = "sgln"
_NS_NAME_RE = re.compile(r"^sgln(\d+)(?:x|g\d+)$")
_NS_ROOT_IF_RE = re.compile(r"^\d+:\s+(sgln(\d+)r)[@:]")
_NS_LOCK = "/run/stepguard-launch.lock"
_NS_MAX_GROUPS = 240  # addresses .10 to .249 of the /24
_CLONE_NEWNET = 0x40000000
_IP_TIMEOUT = 30.0  # seconds for one `ip` command


def netns_unavailable() -> str | None:
    """Why the launcher cannot run groups in network namespaces here.

    Returns:
        None when it can (Linux, root, ``ip`` and ``unshare`` installed),
        else the reason, in words.
    """
    if not sys.platform.startswith("linux"):
        return "network namespaces are a Linux feature"
    if os.geteuid() != 0:
        return "network namespaces need root (the launcher runs as uid %d)" % os.geteuid()
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"network namespaces need the {tool!r} command ({package})"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(["ip", *args], capture_output=True, text=True,
                           timeout=_IP_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"ip {' '.join(args)}: no answer in {_IP_TIMEOUT:.0f} s") from None
    if check and p.returncode != 0:
        why = p.stderr.strip() or f"exit status {p.returncode}"
        raise RuntimeError(f"ip {' '.join(args)}: {why}")
    return p


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _host_lock(path: str, timeout: float = 30.0) -> Any:
    """An exclusive flock shared by every launcher on this host, so two
    launches never pick the same subnet or sweep each other's setup."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{path} stayed locked for {timeout:.0f} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


class _Netns:
    """The network namespaces, links and files of one launch (see above).

    Nothing is created before :meth:`setup`; :meth:`cleanup` removes what
    was created, and a later launch's :meth:`sweep` removes what a launcher
    that died without cleaning up left behind.
    """

    def __init__(self, groups: int) -> None:
        if groups > _NS_MAX_GROUPS:
            raise ValueError(f"at most {_NS_MAX_GROUPS} groups in network namespaces")
        self.groups = groups
        self.tag = f"{_NS_PREFIX}{os.getpid()}"
        self.hub = self.tag + "x"
        self.root_if = self.tag + "r"
        self.group_ns = [f"{self.tag}g{g}" for g in range(groups)]
        self.subnet = ""  # "198.18.N", chosen by setup
        self._made_ns: list[str] = []
        self._made_root_if = False
        self._etc_dirs: list[Path] = []
        self._libc: Any = None

    @property
    def host_ip(self) -> str:
        return f"{self.subnet}.1"

    def ip_of(self, g: int) -> str:
        return f"{self.subnet}.{10 + g}"

    def hostname_of(self, g: int) -> str:
        return f"{self.tag}-g{g}"

    @staticmethod
    def sweep() -> list[str]:
        """Removes namespaces, links and /etc/netns entries of this
        launcher's prefix whose launcher process is gone; returns their
        names."""
        removed: list[str] = []
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            m = _NS_NAME_RE.match(name)
            if m and not _pid_alive(int(m.group(1))):
                _ip("netns", "del", name, check=False)
                shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
                removed.append(name)
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
            m = _NS_ROOT_IF_RE.match(line)
            if m and not _pid_alive(int(m.group(2))):
                _ip("link", "del", m.group(1), check=False)
                removed.append(m.group(1))
        etc = Path("/etc/netns")
        if etc.is_dir():
            for d in etc.iterdir():
                m = _NS_NAME_RE.match(d.name)
                if m and not _pid_alive(int(m.group(1))) and d.name not in removed:
                    shutil.rmtree(d, ignore_errors=True)
                    removed.append(str(d))
        return removed

    def _pick_subnet(self) -> str:
        used: set[str] = set()
        for args in (("-4", "-o", "addr", "show"), ("-4", "route", "show", "table", "all")):
            for m in re.finditer(r"\b(198\.1[89]\.\d+)\.\d+", _ip(*args, check=False).stdout):
                used.add(m.group(1))
        first = os.getpid() % 512
        for i in range(512):
            n = (first + i) % 512
            subnet = f"198.{18 + n // 256}.{n % 256}"
            if subnet not in used:
                return subnet
        raise RuntimeError("every /24 of 198.18.0.0/15 is in use on this host")

    def setup(self) -> list[str]:
        """Creates the namespaces and links; returns the names of stale
        ones swept first.  Raises RuntimeError (after undoing what it did)
        when something cannot be created."""
        with _host_lock(_NS_LOCK):
            swept = self.sweep()
            try:
                self._setup()
            except BaseException:
                self.cleanup()
                raise
        return swept

    def _setup(self) -> None:
        self.subnet = self._pick_subnet()
        hub = self.hub
        _ip("netns", "add", hub)
        self._made_ns.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        _ip("link", "add", self.root_if, "type", "veth", "peer", "name", self.tag + "u")
        self._made_root_if = True
        _ip("link", "set", self.tag + "u", "netns", hub)
        _ip("-n", hub, "link", "set", self.tag + "u", "name", "up0")
        _ip("-n", hub, "link", "set", "up0", "master", "br0", "up")
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.root_if)
        _ip("link", "set", self.root_if, "up")
        hosts = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
                 f"{self.host_ip} {self.tag}-host {socket.gethostname()}"]
        hosts += [f"{self.ip_of(g)} {self.hostname_of(g)}" for g in range(self.groups)]
        for g, ns in enumerate(self.group_ns):
            _ip("netns", "add", ns)
            self._made_ns.append(ns)
            a, c = f"{self.tag}a{g}", f"{self.tag}c{g}"
            _ip("link", "add", a, "type", "veth", "peer", "name", c)
            _ip("link", "set", a, "netns", hub)
            _ip("link", "set", c, "netns", ns)
            _ip("-n", hub, "link", "set", a, "name", f"g{g}")
            _ip("-n", hub, "link", "set", f"g{g}", "master", "br0", "up")
            _ip("-n", ns, "link", "set", c, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.ip_of(g)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", self.host_ip)
            d = Path("/etc/netns") / ns
            d.mkdir(parents=True, exist_ok=True)
            self._etc_dirs.append(d)
            (d / "hosts").write_text("\n".join(hosts) + "\n")

    def wrap(self, g: int, cmd: list[str]) -> list[str]:
        """``cmd`` run in group ``g``'s network namespace, with its own
        hostname; every wrapper execs, so the pid is the command's."""
        return ["ip", "netns", "exec", self.group_ns[g], "unshare", "--uts", "--",
                "sh", "-c", 'echo "$0" > /proc/sys/kernel/hostname && exec "$@"',
                self.hostname_of(g), *cmd]

    def cut(self, g: int) -> None:
        _ip("-n", self.hub, "link", "set", f"g{g}", "down")

    def heal(self, g: int) -> None:
        _ip("-n", self.hub, "link", "set", f"g{g}", "up")

    def call_in(self, g: int, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Runs ``fn`` on a short-lived thread that entered group ``g``'s
        network namespace, so the sockets it opens (a TCPStore's) live
        there; returns its result or raises its exception."""
        if self._libc is None:
            self._libc = ctypes.CDLL(None, use_errno=True)
        out: dict[str, Any] = {}

        def body() -> None:
            try:
                fd = os.open(f"/run/netns/{self.group_ns[g]}", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if self._libc.setns(fd, _CLONE_NEWNET) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, f"setns: {os.strerror(err)}")
                finally:
                    os.close(fd)
                out["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                out["error"] = e

        t = threading.Thread(target=body, name=f"netns-g{g}", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise RuntimeError(f"no answer in {timeout:.0f} s inside {self.group_ns[g]}")
        if "error" in out:
            raise out["error"]
        return out.get("value")

    def cleanup(self) -> list[str]:
        """Removes everything setup created (idempotent); returns the
        problems met, as text."""
        problems: list[str] = []
        for ns in reversed(self._made_ns):
            p = _ip("netns", "del", ns, check=False)
            if p.returncode != 0:
                problems.append(f"ip netns del {ns}: {p.stderr.strip()}")
        self._made_ns = []
        if self._made_root_if:
            # Usually gone with the hub already; this catches a setup that
            # failed before the peer moved there.
            _ip("link", "del", self.root_if, check=False)
            self._made_root_if = False
        for d in self._etc_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._etc_dirs = []
        return problems
