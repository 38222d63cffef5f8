"""The launcher's warm spares (``--spares N``): start, watch, hand over, refill.

A spare is a whole replica group's worth of ranks (``nproc_per_group``
processes) running the training command with everything of a group's
environment but its identity: no ``REPLICA_GROUP_ID``, no incarnation.
Each rank gets the read end of a pipe of its own (``STEPGUARD_SPARE_FD``)
and its spare's TCPStore as ``MASTER_ADDR``/``MASTER_PORT``, which becomes
the store of the incarnation it turns into (so a process group the spare
built inside its group before the takeover stays valid).  The trainer waits
in :func:`stepguard.spares.wait_for_takeover` and does not talk to the
lighthouse until then.

When a group's incarnation has ended and is due to restart, :meth:`take`
gives the group a spare instead of a fresh launch: it writes each rank the
takeover message (the group's identity) and closes the pipe, and the group
runs from then on as an incarnation made of the spare's processes.  A new
spare is started once the replacement has committed its first step (so its
imports do not compete for the CPU with the heal), or after
:data:`REFILL_AFTER` seconds, whichever is first.  A spare that dies while
waiting is replaced; after ``max_failed_starts`` such deaths in a row the
launcher stops keeping spares (groups restart as without them).

A spare runs ``spare_nice`` nicer than the launcher (every thread of every
process of it, and its session's scheduler autogroup:
:func:`stepguard.spares.renice`) until its takeover, when it gets the
launcher's priority back before the message is written: its setup
takes the CPU the training leaves, and the replacement trains at full
speed.  Where the launcher could not give the priority back
(:func:`stepguard.spares.can_renice`), spares run at its priority.

Timeline events: ``spare_start`` (pids), ``spare_ready`` (every rank is
waiting; ``setup_s`` from its start), ``takeover`` (group, incarnation,
spare, whether it was ready, ``idle_s`` it had waited), ``spare_exit``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepguard.launch.worker import EVENTS_FD_ENV, INCARNATION_ENV
from stepguard.launch.cgroups import _group_pids
from stepguard.spares import can_renice, renice, send_takeover, set_autogroup

if TYPE_CHECKING:
    from stepguard.launch.launcher import Launcher, _Group, _Worker

REFILL_AFTER = 5.0  # seconds after a takeover when the next spare starts at the latest


def _lower(nice: int) -> None:
    """In a spare's child between fork and exec, after it began its own
    session: its nice value, and its session's autogroup's (without the
    latter a kernel with autogroups weighs its session as any other).  A
    refused autogroup value leaves the session's as it was: the spare still
    starts, niced within its session."""
    os.setpriority(os.PRIO_PROCESS, 0, nice)
    with contextlib.suppress(PermissionError):
        set_autogroup(0, nice)


class _Spare:
    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.workers: list[_Worker] = []
        self.fds: list[int] = []  # write ends of the takeover pipes, by rank
        self.logs: list[Path | None] = []
        self.store: Any = None
        self.started = 0.0  # wall clock
        self.waiting: set[int] = set()  # ranks that reported spare_waiting
        self.ready_at: float | None = None

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


class _SparePool:
    """The warm spares of one :class:`Launcher` (its thread only)."""

    def __init__(self, launcher: Launcher) -> None:
        self.l = launcher
        self.spares: list[_Spare] = []
        self.next_id = 0
        self.failed = 0  # spares in a row that died before a takeover
        self.gave_up = False
        # (group, incarnation) taken over -> spare id, and refills due
        self.took: dict[tuple[int, int], int] = {}
        self.refills: list[tuple[float, int, int]] = []  # (monotonic due, group, inc)
        # the launcher's nice value, which a spare gets back at its takeover,
        # and the one it waits at (None: the same, not lowered)
        self.base_nice = os.getpriority(os.PRIO_PROCESS, 0)
        self.nice: int | None = None
        if launcher.cfg.spare_nice:
            if can_renice(min(self.base_nice, 0)):
                self.nice = min(19, self.base_nice + launcher.cfg.spare_nice)
            else:
                launcher._say(f"spares run at the trainers' priority: this launcher may not "
                              f"set a spare back to nice {self.base_nice} at its takeover "
                              "(that needs CAP_SYS_NICE or RLIMIT_NICE)")

    # -- starting --

    def start(self) -> None:
        for _ in range(self.l.cfg.spares):
            self._start_one()

    def _env(self, sp: _Spare) -> dict[str, str]:
        from stepguard.launch.worker import STOP_FILE_ENV

        c, l = self.l.cfg, self.l
        env = dict(os.environ)
        env.update(c.env)
        for k in ("REPLICA_GROUP_ID", INCARNATION_ENV, "TORCHELASTIC_RESTART_COUNT"):
            env.pop(k, None)  # the identity comes with the takeover
        env.update({
            "WORLD_SIZE": str(c.nproc_per_group),
            "LOCAL_WORLD_SIZE": str(c.nproc_per_group),
            "GROUP_RANK": "0",
            "MASTER_ADDR": c.master_addr,
            "MASTER_PORT": str(sp.store.port),
            "NUM_REPLICA_GROUPS": str(c.groups),
            "TORCHFT_LIGHTHOUSE": str(l.lighthouse_addr),
            "OMP_NUM_THREADS": str(l._omp),
            "TORCHELASTIC_RUN_ID": f"stepguard-{os.getpid()}",
            EVENTS_FD_ENV: str(l._pipe_w),
            "STEPGUARD_SPARE_ID": str(sp.sid),
            "PYTHONUNBUFFERED": "1",
        })
        if c.stop_file:
            env[STOP_FILE_ENV] = c.stop_file
        return env

    def _start_one(self) -> None:
        from torch.distributed import TCPStore  # deferred: torch is slow to import

        from stepguard.launch.launcher import _Worker

        c = self.l.cfg
        sp = _Spare(self.next_id)
        self.next_id += 1
        sp.store = TCPStore(c.master_addr, 0, None, True, wait_for_workers=False)
        base = self._env(sp)
        # in the child before exec, so every thread and process it starts inherits it
        lower = None if self.nice is None else functools.partial(_lower, self.nice)
        try:
            for r in range(c.nproc_per_group):
                rfd, wfd = os.pipe2(os.O_CLOEXEC)
                sp.fds.append(wfd)
                env = dict(base)
                env.update({"RANK": str(r), "LOCAL_RANK": str(r),
                            "STEPGUARD_SPARE_FD": str(rfd)})
                out: Any = None
                log = Path(c.log_dir) / f"spare{sp.sid}.rank{r}.log" if c.log_dir else None
                sp.logs.append(log)
                if log is not None:
                    out = open(log, "w")  # noqa: SIM115 - the child holds it
                try:
                    p = subprocess.Popen(
                        c.cmd, env=env, stdout=out,
                        stderr=subprocess.STDOUT if out else None,
                        stdin=subprocess.DEVNULL, start_new_session=True,
                        pass_fds=(self.l._pipe_w, rfd), preexec_fn=lower,
                    )
                finally:
                    os.close(rfd)
                    if out is not None:
                        out.close()
                sp.workers.append(_Worker(r, p))
        except BaseException:
            self._kill(sp)
            raise
        sp.started = time.time()
        self.spares.append(sp)
        self.l._record("spare_start", t=sp.started, spare=sp.sid,
                       pids=[w.pid for w in sp.workers], master_port=sp.store.port,
                       nice=self.base_nice if self.nice is None else self.nice,
                       trainer_nice=self.base_nice)
        self.l._say(f"spare {sp.sid} started (pids {[w.pid for w in sp.workers]})")

    # -- watching --

    def _kill(self, sp: _Spare) -> None:
        sp.close_fds()
        for w in sp.workers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.pid, signal.SIGKILL)
        for w in sp.workers:
            if w.returncode is None:
                w.returncode = w.popen.wait()
        sp.store = None

    def poll(self) -> None:
        for sp in list(self.spares):
            dead = [w for w in sp.workers if w.popen.poll() is not None]
            if not dead:
                continue
            w = dead[0]
            rc = w.popen.returncode
            self.spares.remove(sp)
            self._kill(sp)
            self.failed += 1
            give_up = self.failed >= self.l.cfg.max_failed_starts
            fields: dict[str, Any] = {"spare": sp.sid, "rank": w.rank, "pid": w.pid,
                                      "returncode": rc}
            if rc < 0:
                fields["signal"] = signal.Signals(-rc).name
            log = sp.logs[w.rank] if w.rank < len(sp.logs) else None
            if log is not None:
                fields["log"] = str(log)
            self.l._record("spare_exit", gave_up=give_up, **fields)
            self.l._say(f"spare {sp.sid} rank {w.rank} exited with {rc} while waiting"
                        + ("; no more spares" if give_up else "; starting another"))
            if give_up:
                self.gave_up = True
            elif not self._stopping():
                self._start_one()
        now = time.monotonic()
        due = [r for r in self.refills if r[0] <= now]
        if due:
            self.refills = [r for r in self.refills if r[0] > now]
            for _ in due:
                self._refill()

    def _stopping(self) -> bool:
        return self.l._finishing or self.l._stopping or self.gave_up

    def _refill(self) -> None:
        if not self._stopping() and len(self.spares) < self.l.cfg.spares:
            self._start_one()

    def on_waiting(self, rec: dict[str, Any], t: float) -> None:
        """A rank of a spare reported ``spare_waiting``."""
        sid, rank = rec.get("spare"), rec.get("rank")
        sp = next((s for s in self.spares if s.sid == sid), None)
        if sp is None or not isinstance(rank, int) or sp.ready_at is not None:
            return
        sp.waiting.add(rank)
        if len(sp.waiting) == len(sp.workers):
            sp.ready_at = t
            self.failed = 0
            self.l._record("spare_ready", t=t, spare=sp.sid,
                           setup_s=round(t - sp.started, 6))

    def on_first_commit(self, g: _Group) -> None:
        """The group's incarnation committed its first step: if a spare
        became it, start the next spare now."""
        if (g.gid, g.incarnation) not in self.took:
            return
        left = [r for r in self.refills if (r[1], r[2]) != (g.gid, g.incarnation)]
        if len(left) < len(self.refills):
            self.refills = left
            self._refill()

    def spare_of(self, g: _Group) -> int | None:
        return self.took.get((g.gid, g.incarnation))

    # -- takeover --

    def take(self, g: _Group) -> bool:
        """Makes a spare the group's next incarnation; False if none could."""
        if self._stopping():
            return False
        while self.spares:
            # the longest ready first, else the one started first
            ready = [s for s in self.spares if s.ready_at is not None]
            sp = min(ready, key=lambda s: s.ready_at) if ready else self.spares[0]
            self.spares.remove(sp)
            if self._hand_over(g, sp):
                return True
            self._kill(sp)
        return False

    def _hand_over(self, g: _Group, sp: _Spare) -> bool:
        c, l = self.l.cfg, self.l
        inc = g.incarnation + 1
        now = time.time()
        common = {
            "REPLICA_GROUP_ID": g.gid, "WORLD_SIZE": c.nproc_per_group,
            "LOCAL_WORLD_SIZE": c.nproc_per_group, "GROUP_RANK": 0,
            "MASTER_ADDR": c.master_addr, "MASTER_PORT": sp.store.port,
            "NUM_REPLICA_GROUPS": c.groups, "TORCHFT_LIGHTHOUSE": l.lighthouse_addr,
            "TORCHELASTIC_RESTART_COUNT": inc, INCARNATION_ENV: inc,
        }
        if self.nice is not None:
            try:
                # (the autogroup of a new session starts at 0, as a group's has)
                renice(_group_pids([w.pid for w in sp.workers]), self.base_nice, autogroup=0)
            except PermissionError as e:  # can_renice said yes; the takeover goes on
                l._say(f"spare {sp.sid} keeps nice {self.nice}: {e}")
        try:
            for w, fd in zip(sp.workers, sp.fds):
                send_takeover(fd, {**common, "RANK": w.rank, "LOCAL_RANK": w.rank})
        except OSError as e:  # a rank died just now: EPIPE
            l._record("spare_exit", spare=sp.sid, reason=f"takeover failed: {e}")
            return False
        sp.close_fds()
        g.incarnation = inc
        g.store = sp.store
        g.workers = sp.workers
        g.first_commit_seen = False
        g.ready_at = now  # join_s: from the takeover, the setup was done before
        g.injected = False
        g.last_quorum = None
        g.stopped = False
        g.state = "running"
        g.launched_at = now
        self.took[(g.gid, inc)] = sp.sid
        self.refills.append((time.monotonic() + REFILL_AFTER, g.gid, inc))
        if c.log_dir:
            # the rank logs under the names a launched incarnation's have
            for w, log in zip(sp.workers, sp.logs):
                link = Path(c.log_dir) / f"group{g.gid}.rank{w.rank}.inc{inc}.log"
                with contextlib.suppress(OSError):
                    if log is not None:
                        link.symlink_to(log.name)
        l._record("takeover", t=now, group=g.gid, incarnation=inc, spare=sp.sid,
                  pids=[w.pid for w in g.workers], master_port=sp.store.port,
                  ready=sp.ready_at is not None,
                  idle_s=round(now - sp.ready_at, 6) if sp.ready_at is not None else None)
        l._say(f"group {g.gid} taken over by spare {sp.sid} (incarnation {inc}, "
               f"pids {[w.pid for w in g.workers]})")
        if g.gid in l._slow and l._slow[g.gid]["cgroup"] and l._cpu_limit is not None:
            l._cpu_limit.add(g.gid, [w.pid for w in g.workers])
        return True

    def shutdown(self) -> None:
        for sp in self.spares:
            self._kill(sp)
        self.spares = []
