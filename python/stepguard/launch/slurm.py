"""stepguard-slurm: replica groups as Slurm jobs, kept running by a supervisor.

The supervisor runs on the head node (any host that can reach the Slurm
controller and that the compute nodes can reach).  It

* starts a lighthouse there (or uses the one given with ``--lighthouse``);
* submits every replica group as its own Slurm job with ``sbatch``: one
  ``srun`` step inside, which runs the command directly for a one-rank group
  or ``torchrun`` (one per node, ``--nproc-per-group`` ranks in all) for a
  larger one, with the variables torchft reads (``REPLICA_GROUP_ID``,
  ``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE``) and the group's
  incarnation (``STEPGUARD_INCARNATION``);
* watches the jobs with ``squeue`` (and ``sacct`` for a job that already
  left the queue, where accounting is on) and submits a new job for every
  group whose job ended, unless that job completed on its own (exit 0: the
  group is done);
* injects failures on a schedule (``--inject``): ``kill`` cancels a group's
  job (``scancel``), ``signal:sig=NAME`` sends a signal to its steps
  (``scancel --signal``), ``hang`` stops them (SIGSTOP) for ``duration``
  and then resumes them or cancels the job (``then=kill``);
* on Ctrl-C, SIGTERM or ``--duration`` cancels every job it submitted and
  stops its lighthouse.

Every Slurm command runs with a deadline (``--call-timeout``).  A command
that fails or times out (the controller restarting, say) is not a job
failure: the supervisor records ``slurm_unreachable``, relaunches nothing
and tries again at the next poll; the jobs themselves run on without the
controller.  A submission whose answer was lost is found again by its job
name (``NAME-gG-iK``, unique per group and incarnation) before it is
retried, so a slow controller never gets two jobs for one incarnation.

The timeline (``--timeline``) has one JSON line per event: ``lighthouse``,
``submit``, ``job_state``, ``exit``, ``relaunch``, ``inject``,
``slurm_unreachable``, ``slurm_reachable``, ``cancel``, ``stop``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from stepguard.launch.cli import training_command
from stepguard.launch.launcher import _LISTEN_RE, _OURS_LIGHTHOUSE, _die_with_parent, _Injector
from stepguard.launch.spec import FailureSpec, parse_failure_spec
from stepguard.launch.worker import INCARNATION_ENV

__all__ = [
    "SlurmClient",
    "SlurmConfig",
    "SlurmError",
    "SlurmFailure",
    "SlurmSupervisor",
    "main",
    "parse_slurm_failure",
]

# Job states after which a job runs no more (squeue --states=all, sacct).
_TERMINAL = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
    "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT",
})
# Backoff of a group whose jobs fail on their own: 0.5 s from the second
# failure in a row, doubling up to this; a job that ran this long resets it.
_BACKOFF_MAX_S = 30.0
_BACKOFF_RESET_S = 60.0


class SlurmError(RuntimeError):
    """A Slurm command failed, timed out or could not run."""


class SlurmClient:
    """Slurm's commands, each run with a deadline.

    Args:
        timeout: seconds one command may take (squeue alone retries a
            controller that is down for about ten seconds before it fails).
        bin_dir: where the commands are (default: ``PATH``).
        env: their environment (default: this process's, which carries
            ``SLURM_CONF`` where one is set).
    """

    def __init__(self, timeout: float = 20.0, bin_dir: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.timeout = timeout
        self.bin_dir = bin_dir
        self.env = env

    def _exe(self, name: str) -> str:
        return str(Path(self.bin_dir) / name) if self.bin_dir else name

    def run(self, name: str, *args: str, timeout: float | None = None) -> str:
        """Runs one command; its stdout, or SlurmError with the reason."""
        argv = [self._exe(name), *args]
        try:
            p = subprocess.run(argv, capture_output=True, text=True, env=self.env,
                               timeout=self.timeout if timeout is None else timeout,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{name} did not answer within "
                             f"{self.timeout if timeout is None else timeout:g}s") from None
        except OSError as e:
            raise SlurmError(f"{name}: {e}") from None
        if p.returncode != 0:
            msg = (p.stderr or p.stdout).strip().splitlines()
            raise SlurmError(f"{name} exit status {p.returncode}: "
                             f"{msg[-1] if msg else 'no output'}")
        return p.stdout

    def submit(self, script: str, name: str, args: list[str]) -> str:
        """``sbatch``: the job id."""
        out = self.run("sbatch", "--parsable", f"--job-name={name}", *args, script)
        job_id = out.strip().split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"sbatch printed {out.strip()!r}, not a job id")
        return job_id

    def jobs(self, names: list[str]) -> dict[str, tuple[str, str]]:
        """``squeue``: {job id: (job name, state)} of the jobs with these
        names, ended ones included while the controller remembers them."""
        if not names:
            return {}
        out = self.run("squeue", "--noheader", "--states=all", "--format=%i|%j|%T",
                       f"--name={','.join(names)}")
        found: dict[str, tuple[str, str]] = {}
        for line in out.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 3 and parts[0]:
                found[parts[0]] = (parts[1], parts[2].split()[0].rstrip("+"))
        return found

    def final_state(self, job_id: str) -> str:
        """``sacct``: the state of a job that left the queue; UNKNOWN where
        accounting is off or does not know it."""
        try:
            out = self.run("sacct", "--noheader", "--parsable2", "--allocations",
                           "--format=JobID,State", f"--jobs={job_id}")
        except SlurmError:
            return "UNKNOWN"
        for line in out.splitlines():
            jid, _, state = line.partition("|")
            if jid.strip() == job_id and state:
                return state.split()[0].rstrip("+")
        return "UNKNOWN"

    def cancel(self, job_ids: list[str], sig: str | None = None) -> None:
        """``scancel``: ends the jobs, or signals their steps with ``sig``."""
        if job_ids:
            self.run("scancel", *([f"--signal={sig}"] if sig else []), *job_ids)


@dataclass
class SlurmFailure:
    """One failure schedule: ``action`` is cancel, signal or hang."""

    spec: FailureSpec
    action: str
    sig: str | None = None


def parse_slurm_failure(text: str) -> SlurmFailure:
    """Parses ``kill[:...]``, ``signal:sig=NAME[,...]`` or ``hang[:...]``
    (the keys of :func:`stepguard.launch.parse_failure_spec`); raises
    ValueError with the reason."""
    kind, _, rest = text.partition(":")
    kind = kind.strip()
    sig = None
    keep = []
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, _, value = item.partition("=")
        if key == "sig":
            sig = value.strip().upper().removeprefix("SIG")
            if not (sig.isdigit() or hasattr(signal, "SIG" + sig)):
                raise ValueError(f"{text!r}: sig={value!r} is not a signal name")
        elif key == "rank":
            raise ValueError(f"{text!r}: rank= has no meaning here: Slurm signals "
                             "every step of the job")
        else:
            keep.append(item)
    rest = ",".join(keep)
    if kind in ("kill", "cancel"):
        spec = parse_failure_spec("kill:" + rest)
        action = "cancel"
    elif kind == "signal":
        if sig is None:
            raise ValueError(f"{text!r}: give sig=NAME (e.g. sig=USR1)")
        spec = parse_failure_spec("kill:" + rest)
        action = "signal"
    elif kind == "hang":
        spec = parse_failure_spec("hang:" + rest)
        action = "hang"
    else:
        raise ValueError(f"{text!r}: unknown failure kind {kind!r} for Slurm "
                         "(kill, signal, hang)")
    if sig is not None and action != "signal":
        raise ValueError(f"{text!r}: sig= goes with signal")
    return SlurmFailure(spec=spec, action=action, sig=sig)


@dataclass
class SlurmConfig:
    """What to run and how (the CLI flags, as fields)."""

    cmd: list[str]  # the worker command line (every rank runs it)
    groups: int = 2
    nproc_per_group: int = 1  # ranks per replica group, over all its nodes
    nodes_per_group: int = 1
    lighthouse: str | None = None  # use this lighthouse; else start one
    lighthouse_host: str | None = None  # the address groups reach it at (FQDN)
    lighthouse_bind: str = "0.0.0.0"
    lighthouse_port: int = 0
    min_replicas: int = 1
    join_timeout_ms: int = 10000
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int = 5000
    job_name: str | None = None  # default stepguard-<host>-<pid>
    sbatch_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    work_dir: str | None = None  # job scripts and outputs (default: a new dir)
    poll_interval: float = 2.0
    call_timeout: float = 20.0
    slurm_bin: str | None = None
    max_restarts: int = 100
    restart_delay: float = 0.0
    duration: float | None = None
    stop_timeout: float = 60.0  # keep cancelling this long at the end
    rdzv_port: int = 29400  # torchrun's rendezvous, multi-node groups
    failures: list[SlurmFailure] = field(default_factory=list)
    timeline: str | None = None
    quiet: bool = False


class _Group:
    def __init__(self, gid: int) -> None:
        self.gid = gid
        self.incarnation = -1
        self.name = ""  # job name of the current incarnation
        self.job_id: str | None = None
        self.state = "idle"  # idle | submitting | queued | done | failed
        self.slurm_state = ""
        self.submit_at = 0.0  # next submission attempt (monotonic)
        self.submitted_at = 0.0
        self.injected = False  # a failure was injected into this job
        self.restarts = 0
        self.running_since: float | None = None  # monotonic, state RUNNING seen
        self.failed_in_row = 0  # ended on their own, not completed, run briefly
        self.stopped = False  # hang in effect


class SlurmSupervisor:
    """Runs a :class:`SlurmConfig`; see the module docstring.

    Args:
        config: what to run.
        client: the Slurm commands (default: from the config).
        on_event: called with every timeline record.
        on_tick: called after every poll with the supervisor.
    """

    def __init__(self, config: SlurmConfig, client: SlurmClient | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 on_tick: Callable[[SlurmSupervisor], None] | None = None) -> None:
        c = config
        if c.groups < 1 or c.nproc_per_group < 1 or c.nodes_per_group < 1:
            raise ValueError("groups, nproc_per_group and nodes_per_group must be at least 1")
        if c.nproc_per_group % c.nodes_per_group:
            raise ValueError(f"nproc_per_group {c.nproc_per_group} is not a multiple of "
                             f"nodes_per_group {c.nodes_per_group}")
        if not c.cmd:
            raise ValueError("no worker command")
        if c.job_name is not None and (not c.job_name or any(
                ch in c.job_name for ch in ", \t\n|")):
            raise ValueError(f"job name {c.job_name!r}: no commas, blanks or '|' "
                             "(squeue lists jobs by name)")
        if c.poll_interval <= 0 or c.call_timeout <= 0:
            raise ValueError("poll_interval and call_timeout must be positive")
        self.cfg = c
        self.client = client or SlurmClient(c.call_timeout, c.slurm_bin)
        self.on_event = on_event
        self.on_tick = on_tick
        self.t0 = time.time()
        self.groups = [_Group(g) for g in range(c.groups)]
        self.injectors = [(_Injector(f.spec, i), f) for i, f in enumerate(c.failures)]
        self.job_name = c.job_name or f"stepguard-{socket.gethostname()}-{os.getpid()}"
        self.work_dir = Path(c.work_dir or f"stepguard-slurm-{int(self.t0)}-{os.getpid()}")
        self.lighthouse_addr = c.lighthouse
        self.lighthouse_pid: int | None = None
        self.reachable = True
        self._unreachable_since = 0.0
        self._lh: subprocess.Popen | None = None
        self._lh_port = c.lighthouse_port
        self._lh_log: TextIO | None = None
        self._timeline: TextIO | None = None
        self._stopping = False
        self._finishing = False
        self._injecting = True
        self._timers: list[tuple[float, Callable[[], None]]] = []
        self._rng = random.Random(0)
        self._lock = threading.Lock()
        self._pending: list[SlurmFailure] = []

    # -- controls (any thread) --

    def stop(self) -> None:
        """Cancels every job and returns from :meth:`run`."""
        self._stopping = True

    def finish(self) -> None:
        """No more relaunches or injections; :meth:`run` returns once every
        group's job has ended."""
        self._finishing = True
        self._injecting = False

    def stop_injecting(self) -> None:
        self._injecting = False

    def inject(self, failure: SlurmFailure) -> None:
        """Injects ``failure`` at the next poll, ignoring its schedule."""
        with self._lock:
            self._pending.append(failure)

    def elapsed(self) -> float:
        return time.time() - self.t0

    def group_jobs(self) -> dict[int, str | None]:
        """{group: its current job id}."""
        return {g.gid: g.job_id for g in self.groups}

    # -- timeline --

    def _record(self, event: str, **fields: Any) -> dict[str, Any]:
        t = time.time()
        rec = {"event": event, "t": round(t, 6), "elapsed": round(t - self.t0, 6), **fields}
        if self._timeline is not None:
            self._timeline.write(json.dumps(rec, default=str) + "\n")
            self._timeline.flush()
        if self.on_event is not None:
            try:
                self.on_event(rec)
            except Exception as e:  # noqa: BLE001 - a display bug must not stop the job
                print(f"stepguard-slurm: on_event: {e!r}", file=sys.stderr)
        if not self.cfg.quiet:
            rest = " ".join(f"{k}={v}" for k, v in fields.items())
            print(f"[slurm {t - self.t0:7.1f}s] {event} {rest}", file=sys.stderr, flush=True)
        return rec

    # -- lighthouse --

    def _start_lighthouse(self) -> None:
        c = self.cfg
        argv = [sys.executable, "-c", _OURS_LIGHTHOUSE,
                "--bind", f"{c.lighthouse_bind}:{self._lh_port}",
                "--min_replicas", str(c.min_replicas),
                "--join_timeout_ms", str(c.join_timeout_ms),
                "--quorum_tick_ms", str(c.quorum_tick_ms),
                "--heartbeat_timeout_ms", str(c.heartbeat_timeout_ms)]
        host = c.lighthouse_host or socket.getfqdn()
        argv += ["--hostname", host]
        if self._lh_log is None:
            self._lh_log = open(self.work_dir / "lighthouse.log", "a")  # noqa: SIM115
        popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True, close_fds=True,
                                 preexec_fn=_die_with_parent)
        self._lh = popen
        found: queue.Queue[str | None] = queue.Queue()
        log = self._lh_log

        def drain() -> None:
            sent = False
            assert popen.stdout is not None
            for raw in popen.stdout:
                line = raw.decode("utf-8", "replace")
                with contextlib.suppress(ValueError):
                    log.write(line)
                    log.flush()
                if not sent and (m := _LISTEN_RE.search(line)):
                    found.put(m.group(1))
                    sent = True
            if not sent:
                found.put(None)

        threading.Thread(target=drain, name="lighthouse-log", daemon=True).start()
        try:
            advertised = found.get(timeout=60)
        except queue.Empty:
            advertised = None
        if advertised is None:
            self._kill_lighthouse()
            raise RuntimeError(f"the lighthouse did not start (exit status {popen.poll()}); "
                               f"see {self.work_dir / 'lighthouse.log'}")
        self._lh_port = int(advertised.rstrip("/").rsplit(":", 1)[1])
        self.lighthouse_addr = f"http://{host}:{self._lh_port}"
        self.lighthouse_pid = popen.pid
        self._record("lighthouse", address=self.lighthouse_addr, pid=popen.pid)

    def _check_lighthouse(self) -> None:
        """A lighthouse that exited is started again on its port (the
        groups keep its address)."""
        if self._lh is None or self._lh.poll() is None or self._stopping:
            return
        self._record("lighthouse_exit", pid=self._lh.pid, status=self._lh.returncode)
        try:
            self._start_lighthouse()
        except (RuntimeError, OSError) as e:
            self._record("lighthouse_restart_failed", error=str(e))

    def _kill_lighthouse(self) -> None:
        if self._lh is not None and self._lh.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._lh.pid, signal.SIGTERM)
            try:
                self._lh.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._lh.pid, signal.SIGKILL)
                self._lh.wait(5)

    # -- jobs --

    def _script(self, g: _Group) -> Path:
        """The batch script of the group's current incarnation."""
        c = self.cfg
        env = {
            "REPLICA_GROUP_ID": str(g.gid),
            "NUM_REPLICA_GROUPS": str(c.groups),
            "TORCHFT_LIGHTHOUSE": str(self.lighthouse_addr),
            INCARNATION_ENV: str(g.incarnation),
            "PYTHONUNBUFFERED": "1",
            **c.env,
        }
        lines = ["#!/bin/bash",
                 f"# stepguard-slurm: replica group {g.gid}, incarnation {g.incarnation}"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
        cmd = " ".join(shlex.quote(a) for a in c.cmd)
        srun = (f"srun --nodes={c.nodes_per_group} --ntasks-per-node=1 "
                "--kill-on-bad-exit=1")
        if c.nproc_per_group == 1:
            lines.append(f"exec {srun} {cmd}")
        else:
            per_node = c.nproc_per_group // c.nodes_per_group
            run = f"{shlex.quote(sys.executable)} -m torch.distributed.run --no-python"
            if c.nodes_per_group == 1:
                rdzv = "--standalone"
            else:
                lines.append('head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)')
                rdzv = ("--rdzv-backend=c10d --rdzv-id=$SLURM_JOB_ID "
                        f"--rdzv-endpoint=$head:{c.rdzv_port}")
            lines.append(f"exec {srun} {run} --nnodes={c.nodes_per_group} "
                         f"--nproc-per-node={per_node} --max-restarts=0 {rdzv} {cmd}")
        path = self.work_dir / "scripts" / f"{g.name}.sh"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o755)
        return path

    def _new_incarnation(self, g: _Group) -> None:
        g.incarnation += 1
        g.name = f"{self.job_name}-g{g.gid}-i{g.incarnation}"
        g.job_id = None
        g.slurm_state = ""
        g.injected = False
        g.stopped = False
        g.running_since = None
        g.state = "submitting"

    def _submit(self, g: _Group) -> None:
        c = self.cfg
        script = self._script(g)
        args = [f"--nodes={c.nodes_per_group}", "--ntasks-per-node=1", "--no-requeue",
                f"--output={self.work_dir / 'logs' / (g.name + '.%j.out')}",
                "--export=ALL", *c.sbatch_args]
        g.submitted_at = time.monotonic()
        try:
            g.job_id = self.client.submit(str(script), g.name, args)
        except SlurmError as e:
            # the answer may be lost, not the job: the next listing looks
            # for its name before submitting again
            g.submit_at = time.monotonic() + c.poll_interval
            self._record("submit_failed", group=g.gid, incarnation=g.incarnation,
                         name=g.name, error=str(e))
            return
        g.state = "queued"
        self._record("submit", group=g.gid, incarnation=g.incarnation, job=g.job_id,
                     name=g.name)

    def _poll(self) -> None:
        """One look at the queue: adopts jobs whose submission answer was
        lost, notes state changes, relaunches groups whose job ended."""
        live = [g for g in self.groups if g.state in ("submitting", "queued")]
        try:
            listing = self.client.jobs([g.name for g in live])
        except SlurmError as e:
            if self.reachable:
                self.reachable = False
                self._unreachable_since = time.monotonic()
                self._record("slurm_unreachable", error=str(e))
            return
        if not self.reachable:
            self.reachable = True
            self._record("slurm_reachable",
                         after_s=round(time.monotonic() - self._unreachable_since, 3))
        by_name: dict[str, list[tuple[str, str]]] = {}
        for jid, (name, state) in listing.items():
            by_name.setdefault(name, []).append((jid, state))
        now = time.monotonic()
        for g in live:
            if g.state == "submitting":
                mine = sorted(by_name.get(g.name, []), key=lambda js: int(js[0]))
                if mine:
                    g.job_id = mine[0][0]
                    g.state = "queued"
                    self._record("submit", group=g.gid, incarnation=g.incarnation,
                                 job=g.job_id, name=g.name, adopted=True)
                    extra = [jid for jid, _ in mine[1:]]
                    if extra:
                        with contextlib.suppress(SlurmError):
                            self.client.cancel(extra)
                        self._record("cancel", group=g.gid, jobs=extra, why="duplicate")
                elif now >= g.submit_at and not self._finishing:
                    self._submit(g)
                continue
            assert g.job_id is not None
            st = listing.get(g.job_id)
            if st is None:
                # left the queue (and the controller's memory) unseen;
                # a job just submitted may not be listed yet
                if now - g.submitted_at < 2 * self.cfg.call_timeout:
                    continue
                state = self.client.final_state(g.job_id)
            else:
                state = st[1]
            if state != g.slurm_state:
                g.slurm_state = state
                if state == "RUNNING" and g.running_since is None:
                    g.running_since = time.monotonic()
                self._record("job_state", group=g.gid, job=g.job_id, state=state)
            if st is None or state in _TERMINAL:
                self._ended(g, state)

    def _ended(self, g: _Group, state: str) -> None:
        c = self.cfg
        self._record("exit", group=g.gid, incarnation=g.incarnation, job=g.job_id,
                     state=state, injected=g.injected)
        if state == "COMPLETED" and not g.injected:
            g.state = "done"
            return
        if self._finishing or self._stopping:
            g.state = "done"
            return
        if g.restarts >= c.max_restarts:
            g.state = "failed"
            self._record("give_up", group=g.gid, restarts=g.restarts)
            return
        g.restarts += 1
        # a job that keeps failing on its own soon after it starts (a bad
        # command line, a broken node) is resubmitted ever more slowly
        ran = time.monotonic() - g.running_since if g.running_since is not None else 0.0
        if g.injected or ran >= _BACKOFF_RESET_S:
            g.failed_in_row = 0
        else:
            g.failed_in_row += 1
        delay = c.restart_delay
        if g.failed_in_row >= 2:
            delay = max(delay, min(_BACKOFF_MAX_S, 0.5 * 2 ** (g.failed_in_row - 2)))
        self._new_incarnation(g)
        g.submit_at = time.monotonic() + delay
        self._record("relaunch", group=g.gid, incarnation=g.incarnation,
                     restarts=g.restarts, delay_s=delay)
        if not delay:
            self._submit(g)

    # -- failure injection --

    def _victim(self, spec: FailureSpec) -> _Group | None:
        running = [g for g in self.groups
                   if g.state == "queued" and g.slurm_state == "RUNNING" and not g.stopped]
        if spec.group is not None:
            return next((g for g in running if g.gid == spec.group), None)
        return self._rng.choice(running) if running else None

    def _inject(self, f: SlurmFailure) -> bool:
        g = self._victim(f.spec)
        if g is None:
            return False
        assert g.job_id is not None
        job = g.job_id
        try:
            if f.action == "cancel":
                self.client.cancel([job])
            elif f.action == "signal":
                self.client.cancel([job], f.sig)
            else:
                self.client.cancel([job], "STOP")
        except SlurmError as e:
            self._record("inject_failed", kind=f.action, group=g.gid, job=job, error=str(e))
            return False
        g.injected = True
        self._record("inject", kind=f.action, group=g.gid, job=job,
                     incarnation=g.incarnation, **({"sig": f.sig} if f.sig else {}))
        if f.action == "hang":
            g.stopped = True
            then = f.spec.then

            def resume() -> None:
                if g.job_id != job:
                    return
                g.stopped = False
                with contextlib.suppress(SlurmError):
                    if then == "kill":
                        self.client.cancel([job])
                    else:
                        self.client.cancel([job], "CONT")
                self._record("resume", group=g.gid, job=job, then=then)

            self._timers.append((time.monotonic() + f.spec.duration, resume))
        return True

    def _inject_due(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if not self._injecting:
            return
        for f in pending:
            if not self._inject(f):
                with self._lock:
                    self._pending.append(f)  # no victim yet: next poll
        el = self.elapsed()
        for inj, f in self.injectors:
            if inj.next_at is None or el < inj.next_at:
                continue
            if f.spec.stop is not None and el > f.spec.stop:
                inj.next_at = None
                continue
            if self._inject(f):
                inj.advance(el)

    def _run_timers(self) -> None:
        now = time.monotonic()
        due = [t for t in self._timers if t[0] <= now]
        self._timers = [t for t in self._timers if t[0] > now]
        for _, fn in due:
            fn()

    # -- main loop --

    def _cancel_all(self) -> list[str]:
        """Cancels every job this supervisor has and waits until none runs;
        returns the ids it could not see end (the controller unreachable
        for stop_timeout)."""
        deadline = time.monotonic() + self.cfg.stop_timeout
        names = [g.name for g in self.groups if g.name]
        active = sorted({g.job_id for g in self.groups if g.job_id}, key=int)
        while True:
            try:
                listing = self.client.jobs(names)
                # a job not listed has left the queue
                active = sorted((jid for jid, (_, st) in listing.items()
                                 if st not in _TERMINAL), key=int)
                if not active:
                    return []
                self.client.cancel(active)
                self._record("cancel", jobs=active)
            except SlurmError as e:
                self._record("cancel_retry", error=str(e))
            if time.monotonic() >= deadline:
                return active
            time.sleep(min(1.0, self.cfg.poll_interval))

    def run(self) -> int:
        """Runs until every group is done, :meth:`stop`, or the duration;
        returns 0, or 1 where a group was given up or jobs could not be
        cancelled."""
        c = self.cfg
        for sub in ("scripts", "logs"):
            (self.work_dir / sub).mkdir(parents=True, exist_ok=True)
        if c.timeline:
            self._timeline = open(c.timeline, "a")  # noqa: SIM115
        status = 0
        try:
            if self.lighthouse_addr is None:
                self._start_lighthouse()
            self._record("start", groups=c.groups, nproc_per_group=c.nproc_per_group,
                         job_name=self.job_name, work_dir=str(self.work_dir),
                         lighthouse=self.lighthouse_addr)
            for g in self.groups:
                self._new_incarnation(g)
                self._submit(g)
            next_poll = time.monotonic()
            while not self._stopping:
                if c.duration is not None and self.elapsed() >= c.duration:
                    self._record("duration", seconds=c.duration)
                    break
                if time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + c.poll_interval
                    self._poll()
                    self._check_lighthouse()
                    if self.reachable:
                        self._inject_due()
                    if self.on_tick is not None:
                        self.on_tick(self)
                    if all(g.state in ("done", "failed") for g in self.groups):
                        break
                self._run_timers()
                time.sleep(0.05)
            if any(g.state == "failed" for g in self.groups):
                status = 1
        finally:
            left = self._cancel_all()
            if left:
                status = 1
                self._record("cancel_failed", jobs=left)
            self._kill_lighthouse()
            self._record("stop", status=status,
                         groups={g.gid: g.state for g in self.groups})
            if self._timeline is not None:
                self._timeline.close()
            if self._lh_log is not None:
                self._lh_log.close()
        return status


# -- command line --


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stepguard-slurm",
        description="Run replica groups as Slurm jobs with a lighthouse on this host, "
        "relaunch the groups whose job ended, and inject failures with scancel.")
    p.add_argument("--groups", "--replica-groups", type=int, default=2)
    p.add_argument("--nproc-per-group", type=int, default=1,
                   help="ranks per replica group in all (torchrun inside when > 1)")
    p.add_argument("--nodes-per-group", type=int, default=1)
    p.add_argument("--lighthouse", default=None,
                   help="address(es) of running lighthouses (default: start one here)")
    p.add_argument("--lighthouse-host", default=None,
                   help="the name or address the nodes reach this host at "
                   "(default: its FQDN)")
    p.add_argument("--lighthouse-bind", default="0.0.0.0")
    p.add_argument("--lighthouse-port", type=int, default=0)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--join-timeout-ms", type=int, default=10000)
    p.add_argument("--quorum-tick-ms", type=int, default=100)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    p.add_argument("--job-name", default=None,
                   help="jobs are named NAME-gG-iK (default stepguard-HOST-PID)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="passed to sbatch, e.g. --sbatch-arg=--partition=gpu (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--work-dir", default=None,
                   help="job scripts, job output and the lighthouse log "
                   "(default ./stepguard-slurm-TIME-PID); the nodes write job output there")
    p.add_argument("--poll", type=float, default=2.0, metavar="SECONDS")
    p.add_argument("--call-timeout", type=float, default=20.0, metavar="SECONDS",
                   help="deadline of every Slurm command (default 20)")
    p.add_argument("--slurm-bin", default=None, help="where sbatch & co. are (default PATH)")
    p.add_argument("--max-restarts", type=int, default=100)
    p.add_argument("--restart-delay", type=float, default=0.0, metavar="SECONDS")
    p.add_argument("--duration", type=float, default=None, metavar="SECONDS")
    p.add_argument("--stop-timeout", type=float, default=60.0, metavar="SECONDS")
    p.add_argument("--rdzv-port", type=int, default=29400)
    p.add_argument("--inject", action="append", default=[], metavar="SPEC",
                   help="kill:every=60s | signal:sig=USR1,start=30s,group=1 | "
                   "hang:every=90s,duration=20s (repeatable)")
    p.add_argument("--timeline", default=None, help="JSON lines output file")
    p.add_argument("--no-python", action="store_true",
                   help="run SCRIPT as an executable, not with this Python")
    p.add_argument("-m", "--module", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``stepguard-slurm``."""
    a = _parser().parse_args(argv)
    try:
        failures = [parse_slurm_failure(s) for s in a.inject]
        env = {}
        for kv in a.env:
            k, eq, v = kv.partition("=")
            if not eq or not k:
                raise ValueError(f"--env {kv!r}: expected KEY=VALUE")
            env[k] = v
    except ValueError as e:
        print(f"stepguard-slurm: {e}", file=sys.stderr)
        return 2
    cmd = training_command(a)
    cfg = SlurmConfig(
        cmd=cmd, groups=a.groups, nproc_per_group=a.nproc_per_group,
        nodes_per_group=a.nodes_per_group, lighthouse=a.lighthouse,
        lighthouse_host=a.lighthouse_host, lighthouse_bind=a.lighthouse_bind,
        lighthouse_port=a.lighthouse_port, min_replicas=a.min_replicas,
        join_timeout_ms=a.join_timeout_ms, quorum_tick_ms=a.quorum_tick_ms,
        heartbeat_timeout_ms=a.heartbeat_timeout_ms, job_name=a.job_name,
        sbatch_args=a.sbatch_arg, env=env, work_dir=a.work_dir, poll_interval=a.poll,
        call_timeout=a.call_timeout, slurm_bin=a.slurm_bin, max_restarts=a.max_restarts,
        restart_delay=a.restart_delay, duration=a.duration, stop_timeout=a.stop_timeout,
        rdzv_port=a.rdzv_port, failures=failures, timeline=a.timeline, quiet=a.quiet)
    try:
        sup = SlurmSupervisor(cfg)
    except ValueError as e:
        print(f"stepguard-slurm: {e}", file=sys.stderr)
        return 2

    def on_signal(signum: int, frame: Any) -> None:
        sup.stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        return sup.run()
    except (RuntimeError, OSError) as e:
        print(f"stepguard-slurm: {e}", file=sys.stderr)
        return 1


def _console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _console_main()
