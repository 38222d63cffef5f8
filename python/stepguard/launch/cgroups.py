"""CPU limits for ``slow`` injection, in a cgroup created per launch.

:meth:`_CpuLimit.detect` finds a writable cgroup v2 hierarchy with the cpu
controller, else a v1 one; without either the launcher falls back to
SIGSTOP/SIGCONT duty cycling.  :func:`_group_pids` lists a group's
processes, children included, to move them in.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import time
from pathlib import Path

__all__: list[str] = []

_log = logging.getLogger("stepguard.launch")

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
