"""stepguard-launch: run replica groups, restart them, inject failures.

A small torchrun for fault-tolerance experiments on one machine.  It starts
(or uses) a lighthouse, runs ``N`` replica groups of ``M`` ranks with the
environment torchrun would give them plus the variables torchft reads, hosts
a fresh TCPStore for every incarnation of every group, and when a rank of a
group dies it ends the whole group and starts it again, as torchrun does.

On request it injects failures on a schedule:

``kill``      SIGKILL one rank of a group (the group then restarts);
``hang``      SIGSTOP every rank of a group, then SIGCONT (``then=cont``,
              the default) or SIGKILL (``then=kill``) after ``duration``;
``slow``      limit a group to a fraction of one CPU for ``duration``:
              cgroup v2 ``cpu.max`` when a writable cgroup v2 hierarchy
              with the cpu controller exists, else cgroup v1
              ``cpu.cfs_quota_us``, else SIGSTOP/SIGCONT duty cycling (the
              timeline says which);
``partition`` cut a group off the network for ``duration``, then heal it.
              Every group then runs in its own network namespace (root and
              the ``ip`` and ``unshare`` commands are needed; see
              :class:`_Netns`), also available without partitions as
              ``--netns``.

A spec reads ``KIND:key=value,...``, e.g. ``kill:every=20s``,
``kill:every=20s,random,seed=3`` (intervals drawn uniformly from
[0.5, 1.5] x every), ``hang:every=30s,duration=10s,then=kill``,
``slow:start=10s,duration=30s,cpu=0.25,group=1``,
``partition:start=20s,duration=8s,group=2``.  Other keys: ``start``
(first injection, default ``every``), ``stop`` (no injection after this
time), ``count``, ``group``, ``rank``.

Everything that happens goes to a timeline of JSON lines (``--timeline``):
launches, exits, restarts, injections, and the workers' own events, which
they send with :func:`report` over a pipe the launcher reads; from those the
launcher derives quorum changes, commits, discards, and recoveries with
their durations (a worker that reports ``ready`` once its setup is done
also gets the time from there to its first commit, ``join_s``).  Ctrl-C
(or SIGTERM) ends every process it started, by process group id, and
removes the namespaces and cgroups it created.

Worker helpers (dependency-free, usable from any training script):
:func:`report` sends an event, :func:`stop_step` reads the step at which the
launcher asked the workers to finish.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

__all__ = [
    "FailureSpec",
    "LaunchConfig",
    "Launcher",
    "main",
    "netns_unavailable",
    "parse_failure_spec",
    "report",
    "stop_step",
]

_log = logging.getLogger("stepguard.launch")

EVENTS_FD_ENV = "STEPGUARD_EVENTS_FD"
STOP_FILE_ENV = "STEPGUARD_STOP_FILE"
INCARNATION_ENV = "STEPGUARD_INCARNATION"

_PIPE_BUF = 4096  # writes up to this size are atomic on a pipe
_LISTEN_RE = re.compile(r"Lighthouse listening on:? (http://\S+)")
_OURS_LIGHTHOUSE = (
    "import sys\n"
    "from stepguard.coordination import lighthouse_main\n"
    "sys.exit(lighthouse_main())\n"
)


# ---- worker side -----------------------------------------------------------


def report(event: str, **fields: Any) -> None:
    """Sends one event to the launcher (no-op outside the launcher).

    Adds ``t`` (wall clock), ``group``, ``rank`` and ``incarnation`` from
    the environment.  Never raises; an event too large for one atomic pipe
    write loses its extra fields.

    Args:
        event: event name, e.g. ``"step"``.
        fields: JSON-serialisable values.
    """
    fd_text = os.environ.get(EVENTS_FD_ENV)
    if not fd_text:
        return
    rec: dict[str, Any] = {
        "event": event,
        "t": time.time(),
        "group": int(os.environ.get("REPLICA_GROUP_ID", "0")),
        "rank": int(os.environ.get("RANK", "0")),
        "incarnation": int(os.environ.get(INCARNATION_ENV, "0")),
    }
    rec.update(fields)
    try:
        line = (json.dumps(rec, default=str) + "\n").encode()
        if len(line) > _PIPE_BUF:
            rec = {k: rec[k] for k in ("event", "t", "group", "rank", "incarnation")}
            rec["truncated"] = True
            line = (json.dumps(rec) + "\n").encode()
        os.write(int(fd_text), line)
    except (OSError, ValueError, TypeError):
        pass


def stop_step() -> int | None:
    """The step at which the launcher asked workers to finish, if it has.

    Workers that reach this step should exit with status 0.
    """
    path = os.environ.get(STOP_FILE_ENV)
    if not path:
        return None
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


# ---- failure specs ---------------------------------------------------------

_KINDS = ("kill", "hang", "slow", "partition")
_DURATION_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(ms|s|m)?$")


def _parse_duration(text: str, key: str) -> float:
    m = _DURATION_RE.match(text.strip())
    if not m:
        raise ValueError(f"{key}={text!r}: expected a duration like 20s, 500ms, 2m")
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]
    return float(m.group(1)) * scale


@dataclass
class FailureSpec:
    """One failure schedule (see the module docstring for the syntax)."""

    kind: str
    every: float | None = None  # seconds between injections
    start: float | None = None  # first injection (default: every)
    stop: float | None = None  # no injection after this many seconds
    count: int | None = None  # at most this many injections
    random: bool = False  # intervals uniform in [0.5, 1.5] x every
    seed: int = 0
    group: int | None = None  # victim group (default: random)
    rank: int | None = None  # victim rank for kill (default: random)
    duration: float = 10.0  # hang, slow and partition
    then: str = "cont"  # hang: "cont" or "kill" after duration
    cpu: float = 0.25  # slow: fraction of one CPU

    def first_at(self) -> float:
        if self.start is not None:
            return self.start
        return self.every if self.every is not None else 0.0


def parse_failure_spec(text: str) -> FailureSpec:
    """Parses ``KIND[:key=value,...]``; raises ValueError with the reason."""
    kind, _, rest = text.partition(":")
    kind = kind.strip()
    if kind not in _KINDS:
        raise ValueError(f"{text!r}: unknown failure kind {kind!r} (one of {', '.join(_KINDS)})")
    spec = FailureSpec(kind=kind)
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if key == "random" and not eq:
            spec.random = True
            continue
        if not eq:
            raise ValueError(f"{text!r}: {item!r} is not key=value")
        if key in ("every", "start", "stop", "duration"):
            setattr(spec, key, _parse_duration(value, key))
        elif key in ("count", "seed", "group", "rank"):
            try:
                setattr(spec, key, int(value))
            except ValueError:
                raise ValueError(f"{text!r}: {key}={value!r} is not an integer") from None
        elif key == "then":
            if value not in ("cont", "kill"):
                raise ValueError(f"{text!r}: then={value!r} (cont or kill)")
            spec.then = value
        elif key == "cpu":
            spec.cpu = float(value)
            if not 0.0 < spec.cpu < 1.0:
                raise ValueError(f"{text!r}: cpu={value} must be in (0, 1)")
        elif key == "random":
            spec.random = value.lower() in ("1", "true", "yes")
        else:
            raise ValueError(f"{text!r}: unknown key {key!r}")
    if spec.every is not None and spec.every <= 0:
        raise ValueError(f"{text!r}: every must be positive")
    if kind in ("kill", "hang", "partition") and spec.every is None and spec.start is None:
        raise ValueError(f"{text!r}: give every= or start=")
    if kind == "slow" and spec.every is None and spec.count is None:
        spec.count = 1
    return spec


# ---- network namespaces (partition, --netns) -------------------------------
#
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


# ---- CPU limits (slow) -----------------------------------------------------


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(mount point, fs type, options) from /proc/self/mounts."""
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4:
                out.append((parts[1].replace("\\040", " "), parts[2], parts[3].split(",")))
    return out


def _own_cgroup(pid: int | str, v1_controller: str | None) -> str | None:
    """The cgroup path of ``pid``: in the v2 hierarchy (``v1_controller``
    None) or in the v1 hierarchy that holds that controller."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if v1_controller is None and parts[0] == "0" and parts[1] == "":
            return parts[2]
        if v1_controller is not None and v1_controller in parts[1].split(","):
            return parts[2]
    return None


class _CpuLimit:
    """Per-group CPU quotas in a cgroup created for this launch.

    ``version`` 2 writes ``cpu.max`` in a cgroup v2 hierarchy whose root
    offers the cpu controller; version 1 writes ``cpu.cfs_quota_us`` in the
    v1 hierarchy with the cpu controller, under the launcher's own cgroup.
    A process leaves its group's cgroup for the one it came from when the
    slowdown ends, and the cgroup is removed.
    """

    PERIOD_US = 100000

    def __init__(self, version: int, mount: Path, base: Path) -> None:
        self.version = version
        self.mount = mount
        self.base = base  # created for this launch
        self.groups: dict[int, Path] = {}
        self.origin: dict[int, str] = {}  # pid -> cgroup path it came from

    @property
    def mechanism(self) -> str:
        return "cgroup v2 cpu.max" if self.version == 2 else "cgroup v1 cpu.cfs_quota_us"

    @classmethod
    def detect(cls) -> _CpuLimit | None:
        """A usable CPU limiter (v2 first, then v1), or None."""
        if not sys.platform.startswith("linux"):
            return None
        name = f"stepguard-launch-{os.getpid()}"
        for mnt, fstype, opts in _mounts():
            if fstype != "cgroup2":
                continue
            root = Path(mnt)
            d = root / name
            try:
                if "cpu" not in (root / "cgroup.controllers").read_text().split():
                    continue
                if "cpu" not in (root / "cgroup.subtree_control").read_text().split():
                    (root / "cgroup.subtree_control").write_text("+cpu")
                d.mkdir(exist_ok=True)
                if "cpu" not in (d / "cgroup.controllers").read_text().split():
                    d.rmdir()
                    continue
                (d / "cgroup.subtree_control").write_text("+cpu")
                return cls(2, root, d)
            except OSError:
                with contextlib.suppress(OSError):
                    d.rmdir()
        for mnt, fstype, opts in _mounts():
            if fstype != "cgroup" or "cpu" not in opts:
                continue
            root = Path(mnt)
            own = _own_cgroup("self", "cpu") or "/"
            parent = root / own.lstrip("/")
            if not (parent / "cpu.cfs_quota_us").exists():
                parent = root
            d = parent / name
            try:
                d.mkdir(exist_ok=True)
                if not (d / "cpu.cfs_quota_us").exists():
                    d.rmdir()
                    continue
                return cls(1, root, d)
            except OSError:
                with contextlib.suppress(OSError):
                    d.rmdir()
        return None

    def limit(self, gid: int, cpu: float) -> None:
        d = self.base / f"group{gid}"
        d.mkdir(exist_ok=True)
        quota = max(1000, int(self.PERIOD_US * cpu))
        if self.version == 2:
            (d / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
        else:
            (d / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (d / "cpu.cfs_quota_us").write_text(str(quota))
        self.groups[gid] = d

    def add(self, gid: int, pids: list[int]) -> int:
        """Moves processes into group ``gid``'s cgroup; returns how many
        moved (a process that is gone is skipped)."""
        d = self.groups.get(gid)
        if d is None:
            return 0
        moved = 0
        for pid in pids:
            came = _own_cgroup(pid, None if self.version == 2 else "cpu")
            try:
                (d / "cgroup.procs").write_text(str(pid))
            except OSError:
                continue
            if came is not None and pid not in self.origin:
                self.origin[pid] = came
            moved += 1
        return moved

    def throttled(self, gid: int) -> int | None:
        """Periods in which group ``gid`` was throttled so far."""
        d = self.groups.get(gid)
        if d is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            for line in (d / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "nr_throttled":
                    return int(value)
        return None

    def release(self, gid: int) -> None:
        """Lifts group ``gid``'s quota, moves its processes back, removes
        its cgroup."""
        d = self.groups.pop(gid, None)
        if d is None:
            return
        with contextlib.suppress(OSError):
            if self.version == 2:
                (d / "cpu.max").write_text(f"max {self.PERIOD_US}")
            else:
                (d / "cpu.cfs_quota_us").write_text("-1")
        deadline = time.monotonic() + 5.0
        while True:
            try:
                pids = [int(x) for x in (d / "cgroup.procs").read_text().split()]
            except (OSError, ValueError):
                pids = []
            for pid in pids:
                back = self.mount / self.origin.pop(pid, "/").lstrip("/")
                if not (back / "cgroup.procs").exists():
                    back = self.mount
                with contextlib.suppress(OSError):
                    (back / "cgroup.procs").write_text(str(pid))
            try:
                d.rmdir()
                return
            except OSError as e:
                # EBUSY while an exiting process is still listed
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    _log.warning("could not remove %s: %s", d, e)
                    return
                time.sleep(0.05)

    def close(self) -> None:
        for gid in list(self.groups):
            self.release(gid)
        with contextlib.suppress(OSError):
            self.base.rmdir()


def _group_pids(leaders: list[int]) -> list[int]:
    """Every live process whose process group one of ``leaders`` leads
    (each worker leads its own), so a worker's children move with it."""
    want = set(leaders)
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and int(fields[2]) in want and fields[0] not in ("Z", "X"):
            out.append(int(entry))
    return out


# ---- launcher --------------------------------------------------------------


@dataclass
class LaunchConfig:
    """What to run and how (the CLI flags, as fields)."""

    cmd: list[str]  # the worker command line
    groups: int = 2
    nproc_per_group: int = 1
    lighthouse: str | None = None  # use this lighthouse; else start one
    lighthouse_impl: str = "stepguard"  # or "torchft"
    min_replicas: int = 1
    join_timeout_ms: int = 10000
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int = 5000
    omp_threads: int | None = None
    max_restarts: int = 100
    # Give up on a group after this many incarnations in a row that failed
    # on their own (no injected failure) before their first commit.
    max_failed_starts: int = 3
    restart_delay: float = 0.0
    duration: float | None = None  # stop everything after this long
    failures: list[FailureSpec] = field(default_factory=list)
    timeline: str | None = None
    log_dir: str | None = None
    stop_file: str | None = None
    master_addr: str = "127.0.0.1"  # ignored with netns (each group's own address)
    # Each group in its own network namespace (implied by a partition).
    netns: bool = False
    env: dict[str, str] = field(default_factory=dict)
    term_grace: float = 2.0  # SIGTERM -> SIGKILL when ending a group
    quiet: bool = False


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL it when the launcher's thread dies.

    A lighthouse the launcher started serves nobody once the launcher is
    gone (even SIGKILLed); without this it would outlive it.  run() returns
    only after stopping the lighthouse, so the starting thread outlives it
    in every orderly path.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class _Worker:
    def __init__(self, rank: int, popen: subprocess.Popen) -> None:
        self.rank = rank
        self.popen = popen
        self.pid = popen.pid
        self.returncode: int | None = None


class _Group:
    def __init__(self, gid: int) -> None:
        self.gid = gid
        self.incarnation = -1
        self.workers: list[_Worker] = []
        self.store: Any = None
        self.state = "idle"  # idle | running | ending | restart_wait | done | failed
        self.end_deadline = 0.0
        self.restart_at = 0.0
        self.restarts = 0
        self.launched_at = 0.0
        self.ready_at: float | None = None  # rank 0 reported "ready"
        self.injected = False  # a failure was injected into this incarnation
        self.failed_starts = 0  # consecutive incarnations that crashed early
        self.bad_rank = 0  # the rank whose exit ended the last incarnation
        self.first_commit_seen = False
        self.last_quorum: tuple[Any, Any] | None = None
        self.stopped = False  # hang injection in effect
        self.partitioned = False  # partition injection in effect


class _Injector:
    """The schedule of one FailureSpec."""

    def __init__(self, spec: FailureSpec, index: int) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed * 1000003 + index)
        self.next_at: float | None = spec.first_at()
        self.done = 0

    def advance(self, now: float) -> None:
        """Schedules the next injection, measured from this one (``now``),
        so a late injection never brings the next one closer."""
        self.done += 1
        s = self.spec
        if (s.count is not None and self.done >= s.count) or s.every is None:
            self.next_at = None
            return
        gap = s.every * (self.rng.uniform(0.5, 1.5) if s.random else 1.0)
        self.next_at = now + gap


class Launcher:
    """Runs replica groups and injects failures; see the module docstring.

    Args:
        config: what to run.
        on_event: called (on the launcher's thread) with every timeline
            record as it is written.
        on_tick: called about every 50 ms with the launcher, so a driver
            can decide to stop injecting or finish.
    """

    def __init__(
        self,
        config: LaunchConfig,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        on_tick: Callable[[Launcher], None] | None = None,
    ) -> None:
        if config.groups < 1 or config.nproc_per_group < 1:
            raise ValueError("groups and nproc_per_group must be at least 1")
        if not config.cmd:
            raise ValueError("no worker command")
        self.cfg = config
        self.on_event = on_event
        self.on_tick = on_tick
        self.t0 = time.time()
        self.groups = [_Group(g) for g in range(config.groups)]
        self.injectors = [_Injector(s, i) for i, s in enumerate(config.failures)]
        self.lighthouse_addr = config.lighthouse
        self._lh_popen: subprocess.Popen | None = None
        self._lh_log: TextIO | None = None
        self._timeline: TextIO | None = None
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._pipe_r = -1
        self._pipe_w = -1
        self._reader: threading.Thread | None = None
        self._injecting = True
        self._finishing = False
        self._stopping = False
        self._pending_kills: list[dict[str, Any]] = []  # awaiting survivors' commit
        self._timers: list[tuple[float, Callable[[], None]]] = []
        self._slow: dict[int, dict[str, Any]] = {}  # group -> duty cycle state
        self._failure_seq = 0
        self._omp = config.omp_threads or max(
            1, (os.cpu_count() or 1) // (config.groups * config.nproc_per_group)
        )
        self._cpu_limit: _CpuLimit | None = None
        self._cpu_limit_probed = False
        self._pending_heals: list[dict[str, Any]] = []  # partitions awaiting a commit
        self.bad_events = 0  # worker event lines dropped as malformed
        self.net: _Netns | None = None
        if config.netns or any(s.kind == "partition" for s in config.failures):
            why = netns_unavailable()
            if why is not None:
                what = ("partition injection" if any(s.kind == "partition"
                                                     for s in config.failures) else "--netns")
                raise RuntimeError(f"{what} runs each group in a network namespace, "
                                   f"and {why}")
            if config.lighthouse is not None and _is_loopback_url(config.lighthouse):
                raise ValueError(f"lighthouse {config.lighthouse} is a loopback address, "
                                 "which the groups' network namespaces cannot reach; "
                                 "give a routable address or let the launcher start one")
            self.net = _Netns(config.groups)

    # -- public controls (call from on_tick or another thread) --

    def stop_injecting(self) -> None:
        """No further failure injections (hung groups are still resumed)."""
        self._injecting = False

    def inject(self, spec: FailureSpec) -> None:
        """Injects ``spec`` once, at the next tick, ignoring its schedule
        fields (``every``, ``start``, ``stop``, ``count``): for a failure a
        driver times to a point of the run (a group has trained, a heal has
        begun) rather than to the clock.  Like scheduled ones, it is not
        injected once :meth:`stop_injecting` or :meth:`finish` was called."""
        one = FailureSpec(**{**spec.__dict__, "every": None, "start": 0.0, "stop": None,
                             "count": 1})
        self.injectors.append(_Injector(one, len(self.injectors)))

    def finish(self, step: int | None = None) -> None:
        """No more restarts; :meth:`run` returns once every group exits.

        Args:
            step: if given, written to the stop file so workers end there.
        """
        if step is not None and self.cfg.stop_file:
            tmp = self.cfg.stop_file + ".tmp"
            Path(tmp).write_text(f"{step}\n")
            os.replace(tmp, self.cfg.stop_file)
        self._injecting = False
        self._finishing = True
        self._record("finish", stop_step=step)

    def stop(self) -> None:
        """Ends every process now; :meth:`run` returns."""
        self._stopping = True

    def elapsed(self) -> float:
        return time.time() - self.t0

    # -- timeline --

    def _record(self, event: str, t: float | None = None, **fields: Any) -> dict[str, Any]:
        t = time.time() if t is None else t
        rec = {"event": event, "t": round(t, 6), "elapsed": round(t - self.t0, 6)}
        for k, v in fields.items():
            rec.setdefault(k, v)  # a worker's fields never override these
        if self._timeline is not None:
            self._timeline.write(json.dumps(rec, default=str) + "\n")
            self._timeline.flush()
        if self.on_event is not None:
            try:
                self.on_event(rec)
            except Exception:  # noqa: BLE001 - a display bug must not stop the job
                _log.exception("on_event callback failed")
        return rec

    def _say(self, msg: str) -> None:
        if not self.cfg.quiet:
            print(f"[launch {self.elapsed():7.1f}s] {msg}", file=sys.stderr, flush=True)

    # -- lighthouse --

    def _start_lighthouse(self) -> None:
        c = self.cfg
        host = self.net.host_ip if self.net is not None else "127.0.0.1"
        flags = [
            "--bind", f"{host}:0",
            "--min_replicas", str(c.min_replicas),
            "--join_timeout_ms", str(c.join_timeout_ms),
            "--quorum_tick_ms", str(c.quorum_tick_ms),
            "--heartbeat_timeout_ms", str(c.heartbeat_timeout_ms),
        ]
        if c.lighthouse_impl == "stepguard":
            argv = [sys.executable, "-c", _OURS_LIGHTHOUSE, *flags]
        elif c.lighthouse_impl == "torchft":
            exe = Path(sys.executable).parent / "torchft_lighthouse"
            argv = [str(exe) if exe.exists() else "torchft_lighthouse", *flags]
        else:
            raise ValueError(f"unknown lighthouse implementation {c.lighthouse_impl!r}")
        self._lh_popen = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True, preexec_fn=_die_with_parent,
        )
        assert self._lh_popen.stdout is not None
        found: queue.Queue[str | None] = queue.Queue()
        log_path = Path(c.log_dir) / "lighthouse.log" if c.log_dir else None
        self._lh_log = open(log_path, "w") if log_path else None  # noqa: SIM115

        def drain(stream: Any, log: TextIO | None) -> None:
            sent = False
            for raw in stream:
                line = raw.decode("utf-8", "replace")
                if log is not None:
                    with contextlib.suppress(ValueError):
                        log.write(line)
                        log.flush()
                if not sent:
                    m = _LISTEN_RE.search(line)
                    if m:
                        found.put(m.group(1))
                        sent = True
            if not sent:
                found.put(None)

        threading.Thread(
            target=drain, args=(self._lh_popen.stdout, self._lh_log),
            name="lighthouse-log", daemon=True,
        ).start()
        try:
            advertised = found.get(timeout=60)
        except queue.Empty:
            advertised = None
        if advertised is None:
            raise RuntimeError(
                f"the {c.lighthouse_impl} lighthouse did not start "
                f"(exit status {self._lh_popen.poll()})"
            )
        port = int(advertised.rstrip("/").rsplit(":", 1)[1])
        self.lighthouse_addr = f"http://{host}:{port}"
        self._record("lighthouse", impl=c.lighthouse_impl, address=self.lighthouse_addr,
                     pid=self._lh_popen.pid)
        self._say(f"{c.lighthouse_impl} lighthouse at {self.lighthouse_addr}")

    # -- groups --

    def _master_addr(self, g: _Group) -> str:
        return self.net.ip_of(g.gid) if self.net is not None else self.cfg.master_addr

    def _new_store(self, g: _Group) -> Any:
        from torch.distributed import TCPStore  # deferred: torch is slow to import

        addr = self._master_addr(g)
        if self.net is None:
            return TCPStore(addr, 0, None, True, wait_for_workers=False)
        # Hosted inside the group's namespace, as torchrun's store lives on
        # the group's own machine: a partition cuts the group off from the
        # others, not from its store.
        return self.net.call_in(
            g.gid, lambda: TCPStore(addr, 0, None, True, wait_for_workers=False))

    def _launch(self, g: _Group) -> None:
        c = self.cfg
        g.incarnation += 1
        g.store = None  # the previous incarnation's store goes away
        g.store = self._new_store(g)
        g.workers = []
        g.first_commit_seen = False
        g.ready_at = None
        # An incarnation started inside a partition cannot reach the others:
        # its failure is the injection's, not its own.
        g.injected = g.partitioned
        g.last_quorum = None
        g.stopped = False
        base = dict(os.environ)
        base.update(c.env)
        base.update({
            "WORLD_SIZE": str(c.nproc_per_group),
            "LOCAL_WORLD_SIZE": str(c.nproc_per_group),
            "GROUP_RANK": "0",
            "MASTER_ADDR": self._master_addr(g),
            "MASTER_PORT": str(g.store.port),
            "REPLICA_GROUP_ID": str(g.gid),
            "NUM_REPLICA_GROUPS": str(c.groups),
            "TORCHFT_LIGHTHOUSE": str(self.lighthouse_addr),
            "OMP_NUM_THREADS": str(self._omp),
            "TORCHELASTIC_RESTART_COUNT": str(g.incarnation),
            "TORCHELASTIC_RUN_ID": f"stepguard-{os.getpid()}",
            INCARNATION_ENV: str(g.incarnation),
            EVENTS_FD_ENV: str(self._pipe_w),
            "PYTHONUNBUFFERED": "1",
        })
        if c.stop_file:
            base[STOP_FILE_ENV] = c.stop_file
        cmd = c.cmd
        if self.net is not None:
            base["STEPGUARD_ADVERTISE_HOST"] = self.net.ip_of(g.gid)
            cmd = self.net.wrap(g.gid, c.cmd)
        for r in range(c.nproc_per_group):
            env = dict(base)
            env.update({"RANK": str(r), "LOCAL_RANK": str(r)})
            out: Any = None
            if c.log_dir:
                out = open(  # noqa: SIM115 - the child holds it; closed below
                    Path(c.log_dir) / f"group{g.gid}.rank{r}.inc{g.incarnation}.log", "w"
                )
            try:
                p = subprocess.Popen(
                    cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                    pass_fds=(self._pipe_w,),
                )
            finally:
                if out is not None:
                    out.close()
            g.workers.append(_Worker(r, p))
        g.state = "running"
        g.launched_at = time.time()
        kind = "launch" if g.incarnation == 0 else "restart"
        self._record(kind, t=g.launched_at, group=g.gid, incarnation=g.incarnation,
                     pids=[w.pid for w in g.workers], master_port=g.store.port)
        self._say(f"group {g.gid} {kind}ed (incarnation {g.incarnation}, "
                  f"pids {[w.pid for w in g.workers]})")
        if g.gid in self._slow and self._slow[g.gid]["cgroup"]:
            assert self._cpu_limit is not None
            self._cpu_limit.add(g.gid, [w.pid for w in g.workers])

    def _signal_group(self, g: _Group, sig: int) -> None:
        for w in g.workers:
            # Each worker leads its own process group (start_new_session), so
            # this reaches its children too; the pgid stays reserved while any
            # member lives, and ESRCH means nothing is left.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.pid, sig)

    def _end_group(self, g: _Group, reason: str) -> None:
        if g.state != "running":
            return
        self._record("group_end", group=g.gid, incarnation=g.incarnation, reason=reason)
        self._signal_group(g, signal.SIGCONT)
        self._signal_group(g, signal.SIGTERM)
        g.state = "ending"
        g.end_deadline = time.monotonic() + self.cfg.term_grace

    def _poll_group(self, g: _Group) -> None:
        now = time.monotonic()
        for w in g.workers:
            if w.returncode is None:
                rc = w.popen.poll()
                if rc is not None:
                    w.returncode = rc
                    fields: dict[str, Any] = {"group": g.gid, "rank": w.rank,
                                              "incarnation": g.incarnation, "pid": w.pid,
                                              "returncode": rc}
                    if rc < 0:
                        fields["signal"] = signal.Signals(-rc).name
                    self._record("exit", **fields)
        if g.state == "running":
            codes = [w.returncode for w in g.workers]
            if any(rc not in (None, 0) for rc in codes):
                bad = next(w for w in g.workers if w.returncode not in (None, 0))
                g.bad_rank = bad.rank
                if g.first_commit_seen or g.injected:
                    g.failed_starts = 0
                else:
                    g.failed_starts += 1
                self._say(f"group {g.gid} rank {bad.rank} exited with {bad.returncode}; "
                          "ending the group")
                self._end_group(g, f"rank {bad.rank} exited with {bad.returncode}")
            elif all(rc == 0 for rc in codes):
                # Leftover children of the workers go with them.
                self._signal_group(g, signal.SIGKILL)
                g.state = "done"
                self._record("group_done", group=g.gid, incarnation=g.incarnation)
                self._say(f"group {g.gid} finished")
        if g.state == "ending":
            alive = [w for w in g.workers if w.returncode is None]
            if alive and now >= g.end_deadline:
                self._signal_group(g, signal.SIGKILL)
                g.end_deadline = now + 3600  # SIGKILL cannot be ignored
            if not alive:
                self._signal_group(g, signal.SIGKILL)  # stray descendants
                if self._finishing or self._stopping:
                    g.state = "done"
                elif g.restarts >= self.cfg.max_restarts:
                    g.state = "failed"
                    self._record("give_up", group=g.gid, restarts=g.restarts,
                                 reason="out of restarts", **self._log_tail(g))
                    self._say(f"group {g.gid}: {g.restarts} restarts, giving up")
                elif g.failed_starts >= self.cfg.max_failed_starts:
                    g.state = "failed"
                    tail = self._log_tail(g)
                    self._record("give_up", group=g.gid, restarts=g.restarts,
                                 reason=f"{g.failed_starts} incarnations in a row failed "
                                 "before their first commit", **tail)
                    self._say(f"group {g.gid}: {g.failed_starts} incarnations in a row "
                              "failed before committing anything; giving up"
                              + (f"; the end of {tail['log']}:\n{tail['tail']}"
                                 if tail else ""))
                else:
                    g.restarts += 1
                    g.state = "restart_wait"
                    g.restart_at = now + self.cfg.restart_delay
        if g.state == "restart_wait" and self._finishing:
            g.state = "done"
        if g.state == "restart_wait" and now >= g.restart_at:
            self._launch(g)

    def _log_tail(self, g: _Group, limit: int = 3000) -> dict[str, str]:
        """The end of the output of the rank that ended the group, if logged."""
        if not self.cfg.log_dir:
            return {}
        path = Path(self.cfg.log_dir) / f"group{g.gid}.rank{g.bad_rank}.inc{g.incarnation}.log"
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - limit))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return {}
        return {"log": str(path), "tail": text}

    # -- worker events --

    def _read_events(self) -> None:
        """Reads worker events off the pipe (reader thread).

        Anything that is not one JSON object with a string ``event`` per
        line, or a line longer than _MAX_EVENT, is counted and dropped.
        """
        buf = b""
        skipping = False  # inside an over-long line: drop up to its newline
        while True:
            try:
                chunk = os.read(self._pipe_r, 65536)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if skipping:
                    skipping = False
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    rec = None
                if (isinstance(rec, dict) and isinstance(rec.get("event"), str)
                        and len(line) <= _MAX_EVENT):
                    self._events.put(rec)
                elif line.strip():
                    self.bad_events += 1
            if len(buf) > _MAX_EVENT:
                self.bad_events += 1
                buf = b""
                skipping = True

    def _handle_worker_event(self, rec: dict[str, Any]) -> None:
        try:
            self._worker_event(rec)
        except Exception:  # noqa: BLE001 - a bad event must not stop the job
            self.bad_events += 1
            _log.debug("bad worker event %r", rec, exc_info=True)

    def _worker_event(self, rec: dict[str, Any]) -> None:
        ev = str(rec.pop("event"))
        now = time.time()
        t = rec.pop("t", now)
        if not _is_int_or_float(t) or abs(t - now) > 86400:
            t = now  # not a plausible wall-clock time: use the arrival time
        t = float(t)
        if ev in _LAUNCHER_EVENTS:
            ev = "worker_" + ev
        for key in ("group", "rank", "incarnation"):
            if not _is_int(rec.get(key)):
                rec.pop(key, None)
        gid = rec.get("group")
        g = self.groups[gid] if gid is not None and 0 <= gid < len(self.groups) else None
        current = g is not None and rec.get("incarnation") == g.incarnation
        if ev != "step":
            if ev == "ready" and current and g is not None and rec.get("rank", 0) == 0:
                g.ready_at = t
            self._record(ev, t=t, source="worker", **rec)
            return
        committed = rec.get("committed") is True
        self._record("commit" if committed else "discard", t=t, **rec)
        if g is None or not current or rec.get("rank", 0) != 0:
            return
        q = (rec.get("quorum_id"), rec.get("participants"))
        if q != g.last_quorum and q != (None, None):
            g.last_quorum = q
            self._record("quorum_change", t=t, group=gid, quorum_id=q[0], participants=q[1],
                         step=rec.get("step"))
        if not committed:
            return
        for h in [h for h in self._pending_heals if h["group"] == gid and t > h["t"]]:
            self._pending_heals.remove(h)
            self._record("recovery", t=t, kind="partition_heal", failure=h["failure"],
                         group=gid, incarnation=g.incarnation,
                         relaunched=g.incarnation != h["incarnation"], step=rec.get("step"),
                         healed=rec.get("healed"), participants=rec.get("participants"),
                         duration_s=round(t - h["t"], 6))
        if not g.first_commit_seen:
            g.first_commit_seen = True
            if g.incarnation > 0:
                extra = {}
                if g.ready_at is not None:
                    # The part after the worker said it was ready: joining,
                    # healing and one step, without imports and model setup.
                    extra["join_s"] = round(t - g.ready_at, 6)
                self._record("recovery", t=t, kind="rejoin", group=gid,
                             incarnation=g.incarnation, step=rec.get("step"),
                             duration_s=round(t - g.launched_at, 6), **extra)
        still: list[dict[str, Any]] = []
        for k in self._pending_kills:
            if gid != k["group"] and t > k["t"]:
                self._record("recovery", t=t, kind="survivors", failure=k["failure"],
                             victim=k["group"], group=gid, step=rec.get("step"),
                             duration_s=round(t - k["t"], 6))
            else:
                still.append(k)
        self._pending_kills = still

    # -- failure injection --

    def _pick_group(self, inj: _Injector) -> _Group | None:
        s = inj.spec
        running = [g for g in self.groups if g.state == "running" and not g.stopped
                   and not (s.kind == "slow" and g.gid in self._slow)
                   and not (s.kind == "partition" and g.partitioned)]
        if s.group is not None:
            cands = [g for g in running if g.gid == s.group]
        else:
            # Prefer groups that have committed since their last start, so a
            # failure hits a working replica rather than one still starting.
            cands = [g for g in running if g.first_commit_seen] or running
        return inj.rng.choice(cands) if cands else None

    def _inject(self, inj: _Injector) -> None:
        s = inj.spec
        g = self._pick_group(inj)
        if g is None:
            self._record("inject_skipped", kind=s.kind, reason="no running group to hit")
            return
        self._failure_seq += 1
        fid = self._failure_seq
        now = time.time()
        g.injected = True
        if s.kind == "kill":
            alive = [w for w in g.workers if w.returncode is None]
            if s.rank is not None:
                alive = [w for w in alive if w.rank == s.rank]
            if not alive:
                return
            w = inj.rng.choice(alive)
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGKILL)
            self._record("inject", t=now, failure=fid, kind="kill", group=g.gid, rank=w.rank,
                         pid=w.pid, incarnation=g.incarnation)
            self._say(f"injected kill #{fid}: group {g.gid} rank {w.rank} (pid {w.pid})")
            self._pending_kills.append({"t": now, "group": g.gid, "failure": fid})
        elif s.kind == "hang":
            self._signal_group(g, signal.SIGSTOP)
            g.stopped = True
            self._record("inject", t=now, failure=fid, kind="hang", group=g.gid,
                         incarnation=g.incarnation, duration_s=s.duration, then=s.then)
            self._say(f"injected hang #{fid}: group {g.gid} stopped for {s.duration}s")
            self._pending_kills.append({"t": now, "group": g.gid, "failure": fid})
            inc = g.incarnation

            def resume() -> None:
                if g.incarnation != inc or g.state != "running":
                    return
                g.stopped = False
                if s.then == "kill":
                    self._signal_group(g, signal.SIGKILL)
                    self._record("hang_end", failure=fid, group=g.gid, action="kill")
                else:
                    self._signal_group(g, signal.SIGCONT)
                    self._record("hang_end", failure=fid, group=g.gid, action="cont")

            self._timers.append((time.monotonic() + s.duration, resume))
        elif s.kind == "slow":
            self._start_slow(g, s, fid)
        elif s.kind == "partition":
            self._start_partition(g, s, fid)

    # slow: cgroup v2 cpu.max, else cgroup v1 cfs quota, else duty cycling

    def _start_slow(self, g: _Group, s: FailureSpec, fid: int) -> None:
        now = time.time()
        if not self._cpu_limit_probed:
            self._cpu_limit_probed = True
            self._cpu_limit = _CpuLimit.detect()
        st: dict[str, Any] = {"failure": fid, "cpu": s.cpu, "cgroup": False}
        mechanism = "duty-cycle SIGSTOP/SIGCONT (100 ms period)"
        extra: dict[str, Any] = {}
        lim = self._cpu_limit
        if lim is not None:
            try:
                lim.limit(g.gid, s.cpu)
                moved = lim.add(g.gid, _group_pids([w.pid for w in g.workers]))
                st["cgroup"] = True
                mechanism = lim.mechanism
                extra = {"cgroup": str(lim.groups[g.gid]), "processes": moved}
            except OSError as e:
                _log.warning("cgroup CPU limit failed (%s); duty cycling instead", e)
                with contextlib.suppress(OSError):
                    lim.release(g.gid)
        if not st["cgroup"]:
            st["phase_until"] = time.monotonic()
            st["running"] = True
        self._slow[g.gid] = st
        self._record("inject", t=now, failure=fid, kind="slow", group=g.gid, cpu=s.cpu,
                     duration_s=s.duration, mechanism=mechanism, **extra)
        self._say(f"injected slow #{fid}: group {g.gid} at {s.cpu:.0%} CPU via {mechanism}")

        def end() -> None:
            st2 = self._slow.pop(g.gid, None)
            if st2 is None:
                return
            fields: dict[str, Any] = {}
            if st2["cgroup"] and self._cpu_limit is not None:
                fields["throttled_periods"] = self._cpu_limit.throttled(g.gid)
                self._cpu_limit.release(g.gid)
            else:
                self._signal_group(g, signal.SIGCONT)
            self._record("slow_end", failure=fid, group=g.gid, **fields)

        self._timers.append((time.monotonic() + s.duration, end))

    # partition: the group's link in the hub namespace goes down, then up

    def _start_partition(self, g: _Group, s: FailureSpec, fid: int) -> None:
        assert self.net is not None
        now = time.time()
        self.net.cut(g.gid)
        g.partitioned = True
        self._record("inject", t=now, failure=fid, kind="partition", group=g.gid,
                     incarnation=g.incarnation, duration_s=s.duration,
                     address=self.net.ip_of(g.gid),
                     mechanism="veth link down in the hub namespace")
        self._say(f"injected partition #{fid}: group {g.gid} ({self.net.ip_of(g.gid)}) "
                  f"cut off for {s.duration}s")
        self._pending_kills.append({"t": now, "group": g.gid, "failure": fid})
        inc = g.incarnation

        def heal() -> None:
            assert self.net is not None
            self.net.heal(g.gid)
            g.partitioned = False
            t = time.time()
            self._record("partition_end", t=t, failure=fid, group=g.gid,
                         incarnation=g.incarnation, duration_s=round(t - now, 6))
            self._say(f"partition #{fid} healed: group {g.gid} is reachable again")
            self._pending_heals.append({"t": t, "group": g.gid, "failure": fid,
                                        "incarnation": inc})

        self._timers.append((time.monotonic() + s.duration, heal))

    def _duty_cycle(self) -> None:
        now = time.monotonic()
        period = 0.1
        for gid, st in self._slow.items():
            if st["cgroup"] or now < st["phase_until"]:
                continue
            g = self.groups[gid]
            if g.state != "running" or g.stopped:
                continue
            if st["running"]:
                self._signal_group(g, signal.SIGSTOP)
                st["running"] = False
                st["phase_until"] = now + period * (1.0 - st["cpu"])
            else:
                self._signal_group(g, signal.SIGCONT)
                st["running"] = True
                st["phase_until"] = now + period * st["cpu"]

    # -- main loop --

    def run(self) -> int:
        """Runs until every group is done, the duration ends, or Ctrl-C.

        Returns:
            0 when all groups finished or the duration ended, 1 when a group
            was given up (out of restarts, or crash-looping), 130 on SIGINT,
            143 on SIGTERM.
        """
        c = self.cfg
        rc = 0
        old_term = signal.getsignal(signal.SIGTERM)
        in_main = threading.current_thread() is threading.main_thread()

        def on_term(signum: int, frame: object) -> None:
            raise _Terminated()

        if c.log_dir:
            Path(c.log_dir).mkdir(parents=True, exist_ok=True)
        if c.timeline:
            Path(c.timeline).parent.mkdir(parents=True, exist_ok=True)
            self._timeline = open(c.timeline, "w")  # noqa: SIM115 - closed in finally
        if c.stop_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(c.stop_file)
        try:
            if in_main:
                signal.signal(signal.SIGTERM, on_term)
            self._pipe_r, self._pipe_w = os.pipe2(os.O_CLOEXEC)
            self._reader = threading.Thread(target=self._read_events, name="events",
                                            daemon=True)
            self._reader.start()
            self._record("start", groups=c.groups, nproc_per_group=c.nproc_per_group,
                         cmd=c.cmd, omp_threads=self._omp,
                         failures=[vars(s) for s in c.failures])
            if self.net is not None:
                swept = self.net.setup()
                self._record("netns", subnet=f"{self.net.subnet}.0/24",
                             host=self.net.host_ip, hub=self.net.hub,
                             namespaces=self.net.group_ns,
                             addresses=[self.net.ip_of(g.gid) for g in self.groups],
                             hostnames=[self.net.hostname_of(g.gid) for g in self.groups],
                             swept=swept)
                self._say(f"groups in network namespaces {self.net.tag}g*, "
                          f"{self.net.subnet}.0/24" +
                          (f" (removed stale {', '.join(swept)})" if swept else ""))
            if self.lighthouse_addr is None:
                self._start_lighthouse()
            for g in self.groups:
                self._launch(g)
            deadline = None if c.duration is None else time.monotonic() + c.duration
            while not self._stopping:
                self._step_loop()
                if all(g.state in ("done", "failed") for g in self.groups):
                    rc = 1 if any(g.state == "failed" for g in self.groups) else 0
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    self._record("duration_reached")
                    rc = 1 if any(g.state == "failed" for g in self.groups) else 0
                    break
                time.sleep(0.05)
        except KeyboardInterrupt:
            rc = 130
            self._record("interrupted", signal="SIGINT")
            self._say("interrupted: stopping everything")
        except _Terminated:
            rc = 143
            self._record("interrupted", signal="SIGTERM")
            self._say("terminated: stopping everything")
        finally:
            self._shutdown()
            if in_main:
                signal.signal(signal.SIGTERM, old_term)
        return rc

    def _step_loop(self) -> None:
        while True:
            try:
                rec = self._events.get_nowait()
            except queue.Empty:
                break
            self._handle_worker_event(rec)
        for g in self.groups:
            self._poll_group(g)
        now = time.monotonic()
        due = [cb for at, cb in self._timers if at <= now]
        self._timers = [(at, cb) for at, cb in self._timers if at > now]
        for cb in due:
            cb()
        self._duty_cycle()
        el = self.elapsed()
        for inj in self.injectors:
            if inj.next_at is None or el < inj.next_at:
                continue
            if inj.spec.stop is not None and el > inj.spec.stop:
                inj.next_at = None
                continue
            if self._injecting:
                self._inject(inj)
            inj.advance(el)
        if self.on_tick is not None:
            self.on_tick(self)

    def _shutdown(self) -> None:
        """Ends everything this launcher started, by pid and process group."""
        # Ignore a second Ctrl-C while cleaning up, so nothing is left behind.
        in_main = threading.current_thread() is threading.main_thread()
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main else None
        cleanup_problems: list[str] = []
        try:
            try:
                live = [g for g in self.groups if any(w.returncode is None for w in g.workers)]
                for g in live:
                    self._signal_group(g, signal.SIGCONT)
                    self._signal_group(g, signal.SIGTERM)
                end = time.monotonic() + self.cfg.term_grace
                for g in live:
                    for w in g.workers:
                        if w.returncode is None:
                            left = max(0.0, end - time.monotonic())
                            try:
                                w.returncode = w.popen.wait(timeout=left)
                            except subprocess.TimeoutExpired:
                                pass
                for g in self.groups:
                    self._signal_group(g, signal.SIGKILL)
                    for w in g.workers:
                        if w.returncode is None:
                            w.returncode = w.popen.wait()
                if self._lh_popen is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self._lh_popen.pid, signal.SIGKILL)
                    self._lh_popen.wait()
            finally:
                for g in self.groups:
                    g.store = None  # a store's sockets keep its namespace alive
                if self._cpu_limit is not None:
                    try:
                        self._cpu_limit.close()
                    except OSError as e:
                        cleanup_problems.append(f"cgroup: {e}")
                if self.net is not None:
                    cleanup_problems += self.net.cleanup()
                for problem in cleanup_problems:
                    _log.warning("cleanup: %s", problem)
        finally:
            # Every writer is gone now, so closing our write end lets the
            # reader see end-of-file after the last event.
            if self._pipe_w >= 0:
                os.close(self._pipe_w)
                self._pipe_w = -1
            if self._reader is not None:
                self._reader.join(timeout=5)
            if self._pipe_r >= 0:
                os.close(self._pipe_r)
                self._pipe_r = -1
            while True:
                try:
                    self._handle_worker_event(self._events.get_nowait())
                except queue.Empty:
                    break
            self._record("end", restarts=sum(g.restarts for g in self.groups),
                         bad_events=self.bad_events, cleanup_problems=cleanup_problems)
            for g in self.groups:
                g.store = None
            if self._timeline is not None:
                self._timeline.close()
                self._timeline = None
            if self._lh_log is not None:
                self._lh_log.close()
                self._lh_log = None
            if in_main and old_int is not None:
                signal.signal(signal.SIGINT, old_int)


class _Terminated(Exception):
    pass


_MAX_EVENT = 65536  # longest accepted worker event line, in bytes
# Names the launcher writes itself; a worker event of the same name is
# recorded as "worker_<name>" so it cannot be mistaken for one.
_LAUNCHER_EVENTS = frozenset({
    "start", "lighthouse", "launch", "restart", "exit", "group_end", "group_done",
    "give_up", "inject", "inject_skipped", "hang_end", "slow_end", "partition_end",
    "netns", "finish",
    "duration_reached", "interrupted", "end", "commit", "discard", "quorum_change",
    "recovery",
})


def _is_loopback_url(url: str) -> bool:
    host = re.sub(r"^[a-z]+://", "", url).rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_int_or_float(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and v == v and abs(v) != float("inf"))


# ---- CLI -------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stepguard-launch",
        description="Run replica groups of a training script with a lighthouse, "
        "restart groups that lose a rank, and inject failures.",
    )
    p.add_argument("--groups", "--replica-groups", type=int, default=2,
                   help="number of replica groups (default 2)")
    p.add_argument("--nproc-per-group", "--nproc_per_node", type=int, default=1,
                   help="ranks per replica group (default 1)")
    p.add_argument("--lighthouse", default=None,
                   help="address of a running lighthouse (default: start one)")
    p.add_argument("--lighthouse-impl", choices=("stepguard", "torchft"),
                   default="stepguard", help="which lighthouse to start")
    p.add_argument("--min-replicas", "--min_replicas", type=int, default=1)
    p.add_argument("--join-timeout-ms", "--join_timeout_ms", type=int, default=10000)
    p.add_argument("--quorum-tick-ms", "--quorum_tick_ms", type=int, default=100)
    p.add_argument("--heartbeat-timeout-ms", "--heartbeat_timeout_ms", type=int,
                   default=5000)
    p.add_argument("--omp-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for every rank (default: CPUs / ranks)")
    p.add_argument("--max-restarts", type=int, default=100,
                   help="restarts per group before giving up (default 100)")
    p.add_argument("--max-failed-starts", type=int, default=3,
                   help="give up on a group after this many incarnations in a row "
                   "fail on their own before their first commit (default 3)")
    p.add_argument("--restart-delay", type=float, default=0.0, metavar="SECONDS")
    p.add_argument("--term-grace", type=float, default=2.0, metavar="SECONDS",
                   help="SIGTERM to SIGKILL when ending a group (default 2)")
    p.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="stop everything after this long")
    p.add_argument("--inject", action="append", default=[], metavar="SPEC",
                   help="failure schedule, e.g. kill:every=20s (repeatable)")
    p.add_argument("--timeline", default=None, help="JSON lines output file")
    p.add_argument("--log-dir", default=None,
                   help="write each rank's output to LOG_DIR/groupG.rankR.incK.log")
    p.add_argument("--stop-file", default=None,
                   help="file through which finish(step) tells workers where to stop")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--netns", action="store_true",
                   help="run each group in its own network namespace (root; implied by "
                   "partition injection)")
    p.add_argument("--no-python", action="store_true",
                   help="run SCRIPT as an executable, not with this Python")
    p.add_argument("-m", "--module", action="store_true",
                   help="run SCRIPT as a module (python -m)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``stepguard-launch`` and ``python -m stepguard.launch``."""
    args = _parser().parse_args(argv)
    try:
        failures = [parse_failure_spec(s) for s in args.inject]
    except ValueError as e:
        print(f"stepguard-launch: {e}", file=sys.stderr)
        return 2
    if args.no_python:
        cmd = [args.script, *args.script_args]
    elif args.module:
        cmd = [sys.executable, "-m", args.script, *args.script_args]
    else:
        cmd = [sys.executable, args.script, *args.script_args]
    cfg = LaunchConfig(
        cmd=cmd, groups=args.groups, nproc_per_group=args.nproc_per_group,
        lighthouse=args.lighthouse, lighthouse_impl=args.lighthouse_impl,
        min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        omp_threads=args.omp_threads, max_restarts=args.max_restarts,
        max_failed_starts=args.max_failed_starts,
        restart_delay=args.restart_delay, duration=args.duration, failures=failures,
        timeline=args.timeline, log_dir=args.log_dir, stop_file=args.stop_file,
        master_addr=args.master_addr, quiet=args.quiet, term_grace=args.term_grace,
        netns=args.netns,
    )
    if cfg.netns or any(f.kind == "partition" for f in failures):
        why = netns_unavailable()
        if why is not None:
            print("stepguard-launch: partition injection and --netns run each group in "
                  f"a network namespace, and {why}", file=sys.stderr)
            return 2
    try:
        return Launcher(cfg).run()
    except (RuntimeError, ValueError, OSError) as e:
        print(f"stepguard-launch: {e}", file=sys.stderr)
        return 1


def _console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
