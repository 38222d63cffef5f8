"""The launcher: replica groups, restarts, failure injection, the timeline.

:class:`Launcher` runs a :class:`LaunchConfig`: it starts (or uses) a
lighthouse, hosts a TCPStore per incarnation of each group, starts and
restarts the groups' ranks, injects the configured failures, and reads the
workers' events off a pipe into the timeline.  Its chapters: timeline,
lighthouse, groups, worker events, failure injection, main loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from stepguard.launch.cgroups import _CpuLimit, _group_pids
from stepguard.launch.links import _LinkShaper, links_unavailable
from stepguard.launch.netns import _Netns, netns_unavailable
from stepguard.launch.spare_pool import _SparePool
from stepguard.launch.spec import FailureSpec
from stepguard.launch.worker import EVENTS_FD_ENV, HOOK_DIR_ENV, INCARNATION_ENV, STOP_FILE_ENV

__all__ = ["LaunchConfig", "Launcher"]

_log = logging.getLogger("stepguard.launch")

_LISTEN_RE = re.compile(r"Lighthouse listening on:? (http://\S+)")
_OURS_LIGHTHOUSE = (
    "import sys\n"
    "from stepguard.coordination import lighthouse_main\n"
    "sys.exit(lighthouse_main())\n"
)


@dataclass
class LaunchConfig:
    """What to run and how (the CLI flags, as fields)."""

    cmd: list[str]  # the worker command line
    groups: int = 2
    nproc_per_group: int = 1
    lighthouse: str | None = None  # use this lighthouse; else start one
    lighthouse_impl: str = "stepguard"  # or "torchft"
    # Replicated lighthouses: start this many, electing a leader in etcd
    # (stepguard's only); the groups get every address.
    lighthouses: int = 1
    etcd: str | None = None  # with lighthouses > 1: this etcd; else start one
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
    # Each group in its own network namespace (implied by a partition, a
    # link window and a static link shape).
    netns: bool = False
    # Static link shapes for the whole run (kind "link", from
    # parse_link_spec; group None = every group).
    links: list[FailureSpec] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    term_grace: float = 2.0  # SIGTERM -> SIGKILL when ending a group
    quiet: bool = False
    # Warm spares: this many idle groups' worth of trainers, set up and
    # waiting; a lost group's restart takes one over (spare_pool.py).
    spares: int = 0
    # How much nicer than the trainers a spare runs until its takeover, so
    # that its setup takes CPU the training leaves (0: the same priority).
    spare_nice: int = 19
    # The lighthouse it starts keeps its quorum ids here (stepguard's).
    quorum_id_file: str | None = None
    # Its --state_loss_wait_ms (stepguard's; None: the lighthouse's 60 s).
    state_loss_wait_ms: int | None = None
    # Where kill_source / kill_after_heal arm fault points (hook_point).
    hook_dir: str | None = None
    # Never inject into the last group holding the job's state (running,
    # committed in this incarnation, not hung (or back from its hang: 3
    # steps committed after SIGCONT), not just hit, and no other
    # such group has committed its last committed step): a fault load that
    # kills every replica of the state is not one to survive.
    spare_last_holder: bool = False


_PR_SET_PDEATHSIG = 1
# steps a group hung and resumed (SIGCONT) commits before it counts as a
# holder of the state again (spare_last_holder)
_BACK_AFTER_HANG = 3


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
        self.last_step = -1  # rank 0's last committed step in this incarnation
        self.last_quorum: tuple[Any, Any] | None = None
        self.stopped = False  # hang injection in effect
        self.partitioned = False  # partition injection in effect
        self.link_window = False  # link injection in effect
        self.hit_at = -1e9  # monotonic time of the last injection picking it
        # hung in this incarnation, and not yet back: until it has committed
        # _BACK_AFTER_HANG steps after SIGCONT it may not outlive the hang
        self.hung = False
        self.commits_since_cont = 0


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
        if config.lighthouses < 1 or (config.lighthouses > 1 and (
                config.lighthouse_impl != "stepguard" or config.lighthouse)):
            raise ValueError("lighthouses must be at least 1; several are "
                             "stepguard's, started by the launcher")
        if not config.cmd:
            raise ValueError("no worker command")
        if config.spares < 0:
            raise ValueError("spares must be at least 0")
        if not 0 <= config.spare_nice <= 39:
            raise ValueError("spare_nice must be 0 to 39")
        if config.spares and (config.netns or any(s.kind == "partition"
                                                  for s in config.failures)):
            raise ValueError("warm spares cannot run in network namespaces (a spare "
                             "cannot move into the namespace of the group it replaces)")
        self.cfg = config
        self.on_event = on_event
        self.on_tick = on_tick
        self.t0 = time.time()
        self.groups = [_Group(g) for g in range(config.groups)]
        self.injectors = [_Injector(s, i) for i, s in enumerate(config.failures)]
        self.lighthouse_addr = config.lighthouse
        self._lh_popens: list[subprocess.Popen] = []
        self._lh_logs: list[TextIO] = []
        self._etcd: Any = None  # a LocalEtcd the launcher started
        self._timeline: TextIO | None = None
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._pipe_r = -1
        self._pipe_w = -1
        self._reader: threading.Thread | None = None
        self._injecting = True
        self._finishing = False
        self._stopping = False
        self._pending_kills: list[dict[str, Any]] = []  # awaiting survivors' commit
        # kills awaiting the victim's replacement's first commit
        self._pending_full: list[dict[str, Any]] = []
        self._spares: _SparePool | None = _SparePool(self) if config.spares else None
        self._timers: list[tuple[float, Callable[[], None]]] = []
        self._slow: dict[int, dict[str, Any]] = {}  # group -> duty cycle state
        self._failure_seq = 0
        self._omp = config.omp_threads or max(
            1, (os.cpu_count() or 1) // (config.groups * config.nproc_per_group)
        )
        self._cpu_limit: _CpuLimit | None = None
        self._cpu_limit_probed = False
        # partitions and link windows awaiting a commit
        self._pending_heals: list[dict[str, Any]] = []
        self.bad_events = 0  # worker event lines dropped as malformed
        self._lh_flags: list[str] = []
        self._lh_host = ""
        self._lh_port = 0
        self._lh_down = False  # a lighthouse injection is in effect
        self._armed: dict[str, dict[str, Any]] = {}  # fault point -> arming
        self._tag: str | None = None  # the tag of the spec being injected
        self.net: _Netns | None = None
        self.links: _LinkShaper | None = None
        kinds = {s.kind for s in config.failures}
        for s in config.links + [s for s in config.failures if s.kind == "link"]:
            if s.kind != "link" or not s.shapes_link():
                raise ValueError(f"{s!r} is not a link shape")
            if s.group is not None and not 0 <= s.group < config.groups:
                raise ValueError(f"link shape for group {s.group}, but there are "
                                 f"{config.groups} groups")
        if config.netns or config.links or kinds & {"partition", "link"}:
            why = netns_unavailable()
            for s in config.links + [s for s in config.failures if s.kind == "link"]:
                why = why or links_unavailable(s)
            if why is not None:
                what = ("partition injection" if "partition" in kinds else
                        "link injection" if "link" in kinds else
                        "link shaping" if config.links else "--netns")
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
        if spec.kind == "link" and not spec.shapes_link():
            raise ValueError(f"{spec!r}: a link spec needs one of rate, delay, jitter, "
                             "loss, reset")
        if spec.kind in ("link", "partition") and self.net is None:
            raise ValueError(f"{spec.kind} injection needs the groups in network "
                             "namespaces: start the launcher with netns=True")
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
        if self._tag is not None and event in ("inject", "inject_skipped", "arm"):
            rec["tag"] = self._tag
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
        """Starts the lighthouse, or (lighthouses > 1) an etcd unless one
        was given and that many lighthouses electing a leader in it."""
        c = self.cfg
        host = self.net.host_ip if self.net is not None else "127.0.0.1"
        flags = [
            "--bind", f"{host}:0",
            "--min_replicas", str(c.min_replicas),
            "--join_timeout_ms", str(c.join_timeout_ms),
            "--quorum_tick_ms", str(c.quorum_tick_ms),
            "--heartbeat_timeout_ms", str(c.heartbeat_timeout_ms),
        ]
        if c.lighthouses > 1:
            endpoints = c.etcd
            if endpoints is None:
                from stepguard.launch.etcd import LocalEtcd

                log = Path(c.log_dir) / "etcd.log" if c.log_dir else None
                self._etcd = LocalEtcd(host, log, preexec_fn=_die_with_parent)
                self._etcd.wait_healthy()
                endpoints = self._etcd.endpoint
                self._record("etcd", address=endpoints, pid=self._etcd.popen.pid)
                self._say(f"etcd at {endpoints}")
            flags += ["--etcd", endpoints, "--etcd_prefix",
                      f"/stepguard/launch/{os.getpid()}-{int(self.t0)}",
                      "--hostname", host]
        if c.quorum_id_file and c.lighthouse_impl == "stepguard" and c.lighthouses == 1:
            flags += ["--quorum_id_file", c.quorum_id_file]
        if c.state_loss_wait_ms is not None and c.lighthouse_impl == "stepguard":
            flags += ["--state_loss_wait_ms", str(c.state_loss_wait_ms)]
        self._lh_flags, self._lh_host = flags, host
        addrs = [self._start_one_lighthouse(i, host, flags)
                 for i in range(c.lighthouses)]
        self.lighthouse_addr = ",".join(addrs)
        self._lh_port = int(addrs[0].rsplit(":", 1)[1])

    def lighthouse_pids(self) -> list[int]:
        """The pids of the lighthouses this launcher runs now."""
        return [p.pid for p in self._lh_popens if p.poll() is None]

    def _start_one_lighthouse(self, i: int, host: str, flags: list[str],
                              name: str | None = None) -> str:
        c = self.cfg
        if c.lighthouse_impl == "stepguard":
            argv = [sys.executable, "-c", _OURS_LIGHTHOUSE, *flags]
        elif c.lighthouse_impl == "torchft":
            exe = Path(sys.executable).parent / "torchft_lighthouse"
            argv = [str(exe) if exe.exists() else "torchft_lighthouse", *flags]
        else:
            raise ValueError(f"unknown lighthouse implementation {c.lighthouse_impl!r}")
        popen = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True, preexec_fn=_die_with_parent,
        )
        self._lh_popens.append(popen)
        assert popen.stdout is not None
        found: queue.Queue[str | None] = queue.Queue()
        name = name or ("lighthouse.log" if i == 0 else f"lighthouse{i}.log")
        log_path = Path(c.log_dir) / name if c.log_dir else None
        lh_log = open(log_path, "w") if log_path else None  # noqa: SIM115
        if lh_log is not None:
            self._lh_logs.append(lh_log)

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
            target=drain, args=(popen.stdout, lh_log),
            name="lighthouse-log", daemon=True,
        ).start()
        try:
            advertised = found.get(timeout=60)
        except queue.Empty:
            advertised = None
        if advertised is None:
            raise RuntimeError(
                f"the {c.lighthouse_impl} lighthouse did not start "
                f"(exit status {popen.poll()})"
            )
        port = int(advertised.rstrip("/").rsplit(":", 1)[1])
        addr = f"http://{host}:{port}"
        self._record("lighthouse", impl=c.lighthouse_impl, address=addr,
                     pid=popen.pid, index=i)
        self._say(f"{c.lighthouse_impl} lighthouse at {addr}")
        return addr

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
        g.last_step = -1
        g.ready_at = None
        # An incarnation started inside a partition cannot reach the others:
        # its failure is the injection's, not its own.
        g.injected = g.partitioned
        g.last_quorum = None
        g.stopped = False
        g.hung = False
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
        if c.hook_dir:
            base[HOOK_DIR_ENV] = c.hook_dir
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
            if self._spares is None or not self._spares.take(g):
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
            if ev == "spare_waiting" and self._spares is not None:
                self._spares.on_waiting(rec, t)
            self._record(ev, t=t, source="worker", **rec)
            if ev == "hook" and g is not None:
                self._strike(g, current, str(rec.get("point")), rec)
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
        if isinstance(rec.get("step"), int):
            g.last_step = rec["step"]
        if g.hung and not g.stopped:
            g.commits_since_cont += 1
            if g.commits_since_cont >= _BACK_AFTER_HANG:
                g.hung = False  # it survived the hang: a holder again
        for h in [h for h in self._pending_heals if h["group"] == gid and t > h["t"]]:
            self._pending_heals.remove(h)
            self._record("recovery", t=t, kind=h.get("kind", "partition_heal"),
                         failure=h["failure"],
                         group=gid, incarnation=g.incarnation,
                         relaunched=g.incarnation != h["incarnation"], step=rec.get("step"),
                         healed=rec.get("healed"), participants=rec.get("participants"),
                         duration_s=round(t - h["t"], 6))
        if not g.first_commit_seen:
            g.first_commit_seen = True
            spare = self._spares.spare_of(g) if self._spares is not None else None
            for k in [k for k in self._pending_full
                      if k["group"] == gid and k["incarnation"] < g.incarnation]:
                # kill -> the job is back at full strength
                self._pending_full.remove(k)
                self._record("recovery", t=t, kind="full_strength", failure=k["failure"],
                             group=gid, incarnation=g.incarnation, step=rec.get("step"),
                             spare=spare, duration_s=round(t - k["t"], 6))
            if spare is not None:
                self._spares.on_first_commit(g)
            if g.incarnation > 0:
                extra: dict[str, Any] = {} if spare is None else {"spare": spare}
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
                   and not (s.kind == "partition" and g.partitioned)
                   and not (s.kind == "link" and g.link_window)]
        if s.group is not None:
            cands = [g for g in running if g.gid == s.group]
        else:
            # Prefer groups that have committed since their last start, so a
            # failure hits a working replica rather than one still starting.
            cands = [g for g in running if g.first_commit_seen] or running
            # two faults at once hit two groups, when there are two
            now = time.monotonic()
            cands = [g for g in cands if now - g.hit_at > 1.0] or cands
        if self.cfg.spare_last_holder:
            cands = [g for g in cands if not self._last_holder(g)]
        return inj.rng.choice(cands) if cands else None

    def _last_holder(self, g: _Group) -> bool:
        """Whether ``g`` holds the state and no other group holds as much:
        another holds it only if it has committed ``g``'s last committed
        step too.  A group behind (one that discarded the step ``g``
        committed, or a healer: the peer a recovery source serves) cannot
        give the state back."""
        now = time.monotonic()

        def holds(h: _Group) -> bool:
            # a group hung in this incarnation may not outlive it (a hang
            # longer than its timeouts ends it after SIGCONT)
            return (h.state == "running" and h.first_commit_seen and not h.stopped
                    and not h.hung and now - h.hit_at > 1.0)

        return holds(g) and not any(holds(h) and h.last_step >= g.last_step
                                    for h in self.groups if h is not g)

    def _inject(self, inj: _Injector) -> None:
        outer, self._tag = self._tag, inj.spec.tag
        try:
            self._inject_one(inj)
        finally:
            self._tag = outer

    def _inject_one(self, inj: _Injector) -> None:
        s = inj.spec
        if s.kind == "lighthouse":
            self._kill_lighthouse(s)
            return
        if s.kind in ("kill_source", "kill_after_heal"):
            self._arm(inj)
            return
        g = self._pick_group(inj)
        if g is not None:
            g.hit_at = time.monotonic()
        if g is None:
            self._record("inject_skipped", kind=s.kind, reason="no running group to hit"
                         + (" but the last one holding the state"
                            if self.cfg.spare_last_holder else ""))
            return
        self._failure_seq += 1
        fid = self._failure_seq
        now = time.time()
        g.injected = True
        if s.kind == "kill":
            alive = [w for w in g.workers if w.returncode is None]
            if s.rank is not None and s.rank >= 0:
                alive = [w for w in alive if w.rank == s.rank]
            if not alive:
                self._record("inject_skipped", kind=s.kind, group=g.gid,
                             reason=f"no live rank {s.rank} in the group")
                return
            if s.rank == -1:  # the whole group at once
                self._signal_group(g, signal.SIGKILL)
                self._record("inject", t=now, failure=fid, kind="kill", group=g.gid,
                             rank="all", pids=[w.pid for w in alive],
                             incarnation=g.incarnation)
                self._say(f"injected kill #{fid}: group {g.gid}, every rank")
                self._pending_kills.append({"t": now, "group": g.gid, "failure": fid})
                return
            w = inj.rng.choice(alive)
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGKILL)
            self._record("inject", t=now, failure=fid, kind="kill", group=g.gid, rank=w.rank,
                         pid=w.pid, incarnation=g.incarnation)
            self._say(f"injected kill #{fid}: group {g.gid} rank {w.rank} (pid {w.pid})")
            self._pending_kills.append({"t": now, "group": g.gid, "failure": fid})
            self._pending_full.append({"t": now, "group": g.gid, "failure": fid,
                                       "incarnation": g.incarnation})
        elif s.kind == "hang":
            self._signal_group(g, signal.SIGSTOP)
            g.stopped = True
            g.hung = True
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
                    g.commits_since_cont = 0
                    self._signal_group(g, signal.SIGCONT)
                    self._record("hang_end", failure=fid, group=g.gid, action="cont")

            self._timers.append((time.monotonic() + s.duration, resume))
        elif s.kind == "slow":
            self._start_slow(g, s, fid)
        elif s.kind == "partition":
            self._start_partition(g, s, fid)
        elif s.kind == "link":
            self._start_link(g, s, fid, inj.rng.randrange(1 << 31))

    # lighthouse: SIGKILL, then a new one on the same port

    def _kill_lighthouse(self, s: FailureSpec) -> None:
        c = self.cfg
        if (not self._lh_popens or c.lighthouses != 1 or self._lh_down
                or self._lh_popens[-1].poll() is not None):
            self._record("inject_skipped", kind="lighthouse",
                         reason="no single lighthouse of ours running")
            return
        self._failure_seq += 1
        fid = self._failure_seq
        popen = self._lh_popens[-1]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()
        self._lh_down = True
        now = time.time()
        id_file = bool(s.id_file and c.quorum_id_file and c.lighthouse_impl == "stepguard")
        self._record("inject", t=now, failure=fid, kind="lighthouse", pid=popen.pid,
                     duration_s=s.duration, id_file=id_file)
        self._say(f"injected lighthouse #{fid}: killed, back in {s.duration}s"
                  + (" with its quorum id file" if id_file else ""))

        def restart() -> None:
            flags = [f for f in self._lh_flags]
            i = flags.index("--bind")
            flags[i + 1] = f"{self._lh_host}:{self._lh_port}"
            if "--quorum_id_file" in flags and not id_file:
                j = flags.index("--quorum_id_file")
                del flags[j:j + 2]
            n = len(self._lh_popens)
            try:
                addr = self._start_one_lighthouse(0, self._lh_host, flags,
                                                  name=f"lighthouse.r{n}.log")
            except RuntimeError as e:  # e.g. the port is not free yet: again soon
                self._record("lighthouse_restart_failed", failure=fid, error=str(e))
                self._timers.append((time.monotonic() + 1.0, restart))
                return
            self._lh_down = False
            t = time.time()
            self._record("lighthouse_restart", t=t, failure=fid, address=addr,
                         id_file=id_file, down_s=round(t - now, 6))
            # the survivors' next commit: every group counts
            self._pending_kills.append({"t": t, "group": -1, "failure": fid})

        self._timers.append((time.monotonic() + s.duration, restart))

    # kill_source / kill_after_heal: arm a fault point, strike who reaches it

    def _arm(self, inj: _Injector) -> None:
        s = inj.spec
        point = "serve" if s.kind == "kill_source" else "after_heal"
        if not self.cfg.hook_dir or point in self._armed:
            self._record("inject_skipped", kind=s.kind,
                         reason="no hook_dir" if not self.cfg.hook_dir else "already armed")
            return
        self._record("arm", kind=s.kind, point=point)
        # A heal needs a replica behind the others: unless one is starting
        # now, kill one (a kill of its own, counted as such), before the
        # point is armed, so its victim cannot be the one to reach it.
        if not any(g.state in ("restart_wait", "ending") or
                   (g.state == "running" and not g.first_commit_seen) for g in self.groups):
            trigger = FailureSpec(kind="kill", rank=-1, seed=inj.rng.randrange(1 << 30),
                                  tag=f"{s.tag or s.kind}:heal_trigger")
            self._inject(_Injector(trigger, 0))
        Path(self.cfg.hook_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.cfg.hook_dir) / point).write_text(s.kind)
        self._armed[point] = {"kind": s.kind, "t": time.time(), "tag": s.tag}

        def disarm() -> None:
            if self._armed.get(point) is not None and self._armed[point]["t"] == arming_t:
                del self._armed[point]
                with contextlib.suppress(FileNotFoundError):
                    (Path(self.cfg.hook_dir or ".") / point).unlink()
                outer, self._tag = self._tag, s.tag
                self._record("inject_skipped", kind=s.kind,
                             reason=f"nobody reached the {point} point in {s.duration}s")
                self._tag = outer

        arming_t = self._armed[point]["t"]
        self._timers.append((time.monotonic() + s.duration, disarm))

    def _strike(self, g: _Group, current: bool, point: str, rec: dict[str, Any]) -> None:
        arming = self._armed.get(point)
        if arming is None:
            return
        if not self._injecting:  # armed before stop_injecting or finish
            del self._armed[point]
            assert self.cfg.hook_dir is not None
            with contextlib.suppress(OSError, ValueError, TypeError):
                (Path(self.cfg.hook_dir) / f"{point}.release.{int(rec['pid'])}").write_text("")
            outer, self._tag = self._tag, arming["tag"]
            self._record("inject_skipped", kind=arming["kind"],
                         reason="reached after injections stopped")
            self._tag = outer
            return
        if not current or g.state != "running" or (
                self.cfg.spare_last_holder and self._last_holder(g)):
            # claimed by a rank on its way out, or by the last replica of
            # the state: let it go on, and armed again
            assert self.cfg.hook_dir is not None
            with contextlib.suppress(OSError, ValueError, TypeError):
                (Path(self.cfg.hook_dir) / f"{point}.release.{int(rec['pid'])}").write_text("")
            (Path(self.cfg.hook_dir) / point).write_text(arming["kind"])
            return
        del self._armed[point]
        self._failure_seq += 1
        fid = self._failure_seq
        now = time.time()
        g.injected = True
        g.hit_at = time.monotonic()
        self._signal_group(g, signal.SIGKILL)
        outer, self._tag = self._tag, arming["tag"]
        self._record("inject", t=now, failure=fid, kind=arming["kind"], group=g.gid,
                     rank="all", point=point, incarnation=g.incarnation,
                     step=rec.get("step"), armed_s=round(now - arming["t"], 6))
        self._tag = outer
        self._say(f"injected {arming['kind']} #{fid}: group {g.gid} at its {point} point")
        self._pending_kills.append({"t": now, "group": g.gid, "failure": fid})

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

    # link: tbf and/or the packet relay on the group's link, then restored

    def _static_link(self, gid: int) -> FailureSpec | None:
        """The --link shape of group ``gid`` (a group's own beats every
        group's)."""
        mine = [s for s in self.cfg.links if s.group == gid]
        every = [s for s in self.cfg.links if s.group is None]
        return (mine or every or [None])[-1]

    def _apply_static_links(self) -> None:
        assert self.links is not None
        for g in self.groups:
            s = self._static_link(g.gid)
            if s is None:
                continue
            self.links.apply(g.gid, s, seed=s.seed * 1000003 + g.gid)
            self._record("link", group=g.gid, **_link_fields(s),
                         mechanism=self.links.mechanism(s),
                         relay_pid=self.links.relay_pid(g.gid))
            self._say(f"group {g.gid}: link {_link_text(s)}")

    def _start_link(self, g: _Group, s: FailureSpec, fid: int, seed: int) -> None:
        assert self.net is not None and self.links is not None
        now = time.time()
        try:
            self.links.apply(g.gid, s, seed=seed)
        except (RuntimeError, OSError, ValueError) as e:
            self._record("inject_skipped", kind="link", group=g.gid, reason=str(e))
            self._say(f"link #{fid} on group {g.gid} not made: {e}")
            return
        g.link_window = True
        self._record("inject", t=now, failure=fid, kind="link", group=g.gid,
                     incarnation=g.incarnation, duration_s=s.duration,
                     address=self.net.ip_of(g.gid), **_link_fields(s),
                     mechanism=self.links.mechanism(s),
                     relay_pid=self.links.relay_pid(g.gid))
        self._say(f"injected link #{fid}: group {g.gid} {_link_text(s)} for {s.duration}s")
        # the others' next commit, as after any fault (whether the group
        # itself keeps up is its link_end recovery)
        self._pending_kills.append({"t": now, "group": g.gid, "failure": fid})
        inc = g.incarnation

        def end() -> None:
            assert self.links is not None
            fields: dict[str, Any] = {}
            try:
                fields["relay"] = self.links.clear(g.gid)
                static = self._static_link(g.gid)
                if static is not None:
                    self.links.apply(g.gid, static, seed=static.seed * 1000003 + g.gid)
                    fields["static"] = _link_text(static)
            except (RuntimeError, OSError, ValueError) as e:
                fields["problem"] = str(e)
                _log.warning("link #%d: %s", fid, e)
            g.link_window = False
            t = time.time()
            self._record("link_end", t=t, failure=fid, group=g.gid,
                         incarnation=g.incarnation, duration_s=round(t - now, 6), **fields)
            self._say(f"link #{fid} restored: group {g.gid}")
            self._pending_heals.append({"t": t, "group": g.gid, "failure": fid,
                                        "incarnation": inc, "kind": "link_end"})

        self._timers.append((time.monotonic() + s.duration, end))

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
                self.links = _LinkShaper(self.net)
                self._apply_static_links()
            if self.lighthouse_addr is None:
                self._start_lighthouse()
            for g in self.groups:
                self._launch(g)
            if self._spares is not None:
                self._spares.start()
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
        if self._spares is not None:
            self._spares.poll()
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
                if self._spares is not None:
                    self._spares.shutdown()
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
                for popen in self._lh_popens:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(popen.pid, signal.SIGKILL)
                    popen.wait()
                if self._etcd is not None:
                    self._etcd.stop()
            finally:
                for g in self.groups:
                    g.store = None  # a store's sockets keep its namespace alive
                if self._cpu_limit is not None:
                    try:
                        self._cpu_limit.close()
                    except OSError as e:
                        cleanup_problems.append(f"cgroup: {e}")
                if self.links is not None:
                    cleanup_problems += self.links.cleanup()
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
            for log in self._lh_logs:
                log.close()
            self._lh_logs = []
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
    "link", "link_end", "netns", "finish", "arm", "lighthouse_restart",
    "lighthouse_restart_failed",
    "duration_reached", "interrupted", "end", "commit", "discard", "quorum_change",
    "recovery", "spare_start", "spare_ready", "spare_exit", "takeover",
})


def _link_fields(s: FailureSpec) -> dict[str, Any]:
    """A link shape's fields for the timeline (units in the names)."""
    return {"rate_bit_s": s.rate, "delay_s": s.delay, "jitter_s": s.jitter,
            "loss": s.loss, "reset": s.reset}


def _link_text(s: FailureSpec) -> str:
    parts = []
    if s.rate is not None:
        parts.append(f"rate {s.rate / 1e6:g} Mbit/s")
    if s.delay or s.jitter:
        parts.append(f"delay {s.delay * 1000:g} ms +- {s.jitter * 1000:g} ms")
    if s.loss:
        parts.append(f"loss {s.loss:.2%}")
    if s.reset:
        parts.append(f"reset {s.reset:.2%}")
    return ", ".join(parts)


def _is_loopback_url(url: str) -> bool:
    host = re.sub(r"^[a-z]+://", "", url).rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_int_or_float(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and v == v and abs(v) != float("inf"))
