"""A real single-node Slurm for one test, on this machine.

:class:`SlurmCluster` starts its own ``munged`` (its own key and socket),
``slurmctld`` and ``slurmd`` as root, each in the foreground as a child of
the test, with ports picked free, state, spool and log directories under
the test's directory and a ``slurm.conf`` of its own that the Slurm
commands find through ``SLURM_CONF`` (in :attr:`env`), so two suites can
run side by side.  The settings need no cgroup delegation
(``proctrack/linuxproc``, ``task/none``, no accounting) and the node claims
8 CPUs (``SlurmdParameters=config_overrides``) so that several one-CPU jobs
run at once on a 2-core machine.

:meth:`close` cancels every job, kills the daemons by pid and then every
process left whose environment names this cluster's ``slurm.conf`` (the
``slurmstepd`` daemons and the jobs' processes, which outlive ``slurmd``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")


def unavailable() -> str | None:
    """Why a real Slurm cannot be started here, or None."""
    if os.geteuid() != 0:
        return "the test Slurm's daemons run as root and this is not root"
    missing = [b for b in SLURM_BINARIES
               if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return (f"{', '.join(missing)} not installed (Debian packages slurm-wlm and munge; "
                "scripts/bootstrap installs them)")
    return None


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """See the module docstring.  ``cpus``: CPUs the node claims."""

    def __init__(self, base: Path, cpus: int = 8) -> None:
        self.dir = base
        self.dir.mkdir(parents=True, exist_ok=True)
        self.node = f"sg{os.getpid()}n{int(time.time() * 1000) % 100000}"
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        # a job must not think it runs inside the test's own allocation
        for k in list(self.env):
            if k.startswith(("SLURM_JOB", "SLURM_STEP", "SBATCH_", "SRUN_")):
                del self.env[k]
        self.ctld: subprocess.Popen | None = None
        self.slurmd: subprocess.Popen | None = None
        self.munged: subprocess.Popen | None = None
        self._logs: list = []
        try:
            self._setup(cpus)
        except BaseException:
            self.close()
            raise

    # -- start --

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.dir / "log" / f"{name}.out", "ab")  # noqa: SIM115
        self._logs.append(log)
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=self.env,
                                start_new_session=True)

    def _setup(self, cpus: int) -> None:
        d = self.dir
        for sub in ("munge", "state", "spool", "log"):
            (d / sub).mkdir(exist_ok=True)
        (d / "munge").chmod(0o700)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = d / "munge" / "socket"
        self.munged = self._spawn("munged", [
            _exe("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={key}", f"--pid-file={d / 'munge' / 'pid'}",
            f"--log-file={d / 'log' / 'munged.log'}", f"--seed-file={d / 'munge' / 'seed'}"])
        self._wait(lambda: self.munge_socket.exists(), 15, "munged's socket", self.munged)
        self.ctld_port, self.slurmd_port = _free_port(), _free_port()
        while self.slurmd_port == self.ctld_port:
            self.slurmd_port = _free_port()
        self.conf.write_text("\n".join([
            f"ClusterName=sg{os.getpid()}",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=120",
            "MinJobAge=300",
            "KillWait=2",
            "InactiveLimit=0",
            f"NodeName={self.node} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 "
            f"CPUs={cpus} RealMemory=1000 State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=YES",
        ]) + "\n")
        self.start_ctld()
        self.slurmd = self._spawn("slurmd", [_exe("slurmd"), "-D", "-N", self.node])
        self._wait(self._node_idle, 30, "the node to be idle", self.slurmd)

    def start_ctld(self) -> None:
        """Starts slurmctld (again: it recovers its jobs from its state dir)."""
        self.ctld = self._spawn("slurmctld", [_exe("slurmctld"), "-D"])
        self._wait(self._ctld_answers, 30, "slurmctld to answer", self.ctld)

    def save_state(self, job_ids, timeout: float = 30) -> None:
        """Makes slurmctld write its job state now and waits for the file.
        It saves in the background after a change, so one killed sooner
        forgets what changed since its last save: a comment on each job is
        the change that makes it save what it knows of them."""
        path = self.dir / "state" / "job_state"
        since = time.time()
        for jid in job_ids:
            self._run("scontrol", "update", f"JobId={jid}", f"Comment=saved-{since:.0f}")
        assert self.ctld is not None
        self._wait(lambda: path.exists() and path.stat().st_mtime > since, timeout,
                   "slurmctld to save its job state", self.ctld)

    def kill_ctld(self) -> None:
        """SIGKILLs slurmctld, as a crash would."""
        assert self.ctld is not None
        self.ctld.kill()
        self.ctld.wait(10)

    def _run(self, *argv: str, timeout: float = 15) -> str:
        p = subprocess.run(list(argv), capture_output=True, text=True, env=self.env,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            raise SlurmError(f"{' '.join(argv)}: {p.stderr.strip()}")
        return p.stdout

    def _ctld_answers(self) -> bool:
        try:
            self._run("squeue", "--noheader", timeout=5)
            return True
        except (SlurmError, subprocess.TimeoutExpired):
            return False

    def _node_idle(self) -> bool:
        try:
            return self._run("sinfo", "--noheader", "--format=%T", timeout=5).strip() == "idle"
        except (SlurmError, subprocess.TimeoutExpired):
            return False

    def _wait(self, pred, timeout: float, what: str, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if proc.poll() is not None:
                raise SlurmError(f"{what}: {proc.args[0]} exited with status "
                                 f"{proc.returncode}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise SlurmError(f"{what}: not within {timeout}s\n{self.logs()}")
            time.sleep(0.1)

    def logs(self, tail: int = 6) -> str:
        out = []
        for f in sorted((self.dir / "log").glob("*")):
            try:
                lines = f.read_text(errors="replace").splitlines()[-tail:]
            except OSError:
                continue
            out.append(f"-- {f.name}")
            out.extend("   " + t for t in lines)
        return "\n".join(out)

    # -- queries --

    def jobs(self) -> dict[str, tuple[str, str]]:
        """{job id: (name, state)} of the jobs the controller lists."""
        out = self._run("squeue", "--noheader", "--states=all", "--format=%i|%j|%T")
        found = {}
        for line in out.splitlines():
            jid, name, state = line.strip().split("|")
            found[jid] = (name, state)
        return found

    def active_jobs(self) -> dict[str, tuple[str, str]]:
        done = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
        return {j: ns for j, ns in self.jobs().items() if ns[1] not in done}

    def our_pids(self) -> list[int]:
        """Processes whose environment names this cluster's slurm.conf."""
        mark = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == os.getpid():
                continue
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        pids.append(int(d))
            except OSError:
                continue
        return pids

    # -- stop --

    def close(self) -> None:
        if self.ctld is not None and self.ctld.poll() is None:
            try:
                self._run("scancel", "--user=root", timeout=10)
                deadline = time.monotonic() + 15
                while self.active_jobs() and time.monotonic() < deadline:
                    time.sleep(0.2)
            except (SlurmError, subprocess.TimeoutExpired, ValueError):
                pass
        for p in (self.ctld, self.slurmd, self.munged):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        deadline = time.monotonic() + 10
        while (left := self.our_pids()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for f in self._logs:
            f.close()
