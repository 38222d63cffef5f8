"""Harness for the training-API scenarios: a lighthouse, N replica groups of
M ranks (each group with its own TCPStore), kills and restarts by pid, and
the per-step JSON events the workers (tests/py/helpers/train_worker.py) write.

The implementation under test is ``$STEPGUARD_TRAIN_IMPL`` (``stepguard``,
the default, or ``torchft``, which runs the same scenarios against the
real torchft to prove they are right); the lighthouse is ours unless
``$STEPGUARD_TRAIN_LIGHTHOUSE=torchft``.  ``$STEPGUARD_TEST_DEVICE=cuda``
puts train_worker.py's models and batches on the GPU (scripts/gpu-check);
the modules that call require_api() then skip where torch sees no CUDA
device.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

from lighthouse_util import LISTEN_RE, OURS_CODE, TORCHFT_LIGHTHOUSE_SCRIPT
from train_worker import replica_index

WORKER = str(Path(__file__).with_name("train_worker.py"))
ZYGOTE = str(Path(__file__).with_name("train_zygote.py"))
IMPL = os.environ.get("STEPGUARD_TRAIN_IMPL", "stepguard")
LIGHTHOUSE = os.environ.get("STEPGUARD_TRAIN_LIGHTHOUSE", "ours")
DEVICE = os.environ.get("STEPGUARD_TEST_DEVICE", "cpu")
_cuda_missing: list[str] = []


def cuda_missing() -> str:
    """Why torch cannot use a CUDA device here ("" where it can), asked once
    in a child process, as the test process never imports torch."""
    if not _cuda_missing:
        code = ("import torch\n"
                "print('' if torch.cuda.is_available() else\n"
                "      f'torch {torch.__version__} sees no CUDA device')\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            err = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            _cuda_missing.append(f"torch failed: {err}")
        else:
            _cuda_missing.append((r.stdout.strip().splitlines() or [""])[-1])
    return _cuda_missing[0]


def require_cuda(what: str, allow_module_level: bool = False) -> None:
    """Skips, the reason printed, where no CUDA device exists."""
    why = cuda_missing()
    if why:
        reason = f"no CUDA device: {what} ({why})"
        print(f"SKIP: {reason}")
        pytest.skip(reason, allow_module_level=allow_module_level)


def impl_missing(*attr_paths: str) -> list[str]:
    """The ``IMPL.attr_path`` names (``Manager``,
    ``process_group.ProcessGroupTCP``) that do not exist, checked in a child
    process so that the test process never imports torch.  A module that
    fails to import for another reason than being absent raises, after one
    retry (the editable build may be rebuilding)."""
    checks = []
    for path in attr_paths:
        mod, _, attr = path.rpartition(".")
        checks.append((f"{IMPL}.{mod}" if mod else IMPL, attr))
    code = ("import importlib,json\n"
            "missing = []\n"
            f"for m, a in {checks!r}:\n"
            "    try:\n"
            "        mod = importlib.import_module(m)\n"
            "    except ModuleNotFoundError as e:\n"
            "        if e.name is None or not m.startswith(e.name):\n"
            "            raise\n"
            "        mod = None\n"
            "    if not hasattr(mod, a): missing.append(m + '.' + a)\n"
            "print(json.dumps(missing))\n")
    err = ""
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300)
        if r.returncode == 0:
            return json.loads(r.stdout.strip().splitlines()[-1])
        err = r.stderr[-3000:]
        time.sleep(5)
    raise RuntimeError(f"importing {IMPL} failed:\n{err}")


def impl_has(*attr_paths: str) -> bool:
    return not impl_missing(*attr_paths)


# what train_worker.py uses from the implementation
API = ("Manager", "DistributedDataParallel", "Optimizer", "ProcessGroupGloo",
       "manager.WorldSizeMode", "process_group.FakeProcessGroupWrapper")


def require_api() -> None:
    """Skips the calling test module (with the reason) if IMPL lacks the API."""
    missing = impl_missing(*API)
    if missing:
        pytest.skip(f"{IMPL} does not have the training API yet: no {', '.join(missing)}",
                    allow_module_level=True)
    if DEVICE == "cuda":
        require_cuda("STEPGUARD_TEST_DEVICE=cuda", allow_module_level=True)


def wait_for(pred: Callable[[], object], timeout: float, what: str,
             job: Job | None = None, interval: float = 0.05) -> object:
    """Polls pred() until truthy; on timeout fails with the workers' state."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            detail = job.summary() if job is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{detail}")
        time.sleep(interval)


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # the zygote forks the trainers after importing torch and stepguard, which
    # ask torch.cuda.is_available(): asked through NVML, that does not
    # initialise CUDA in the zygote, which would break it in every fork
    env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    helpers_dir = str(Path(__file__).parent)  # the workers import each other
    env["PYTHONPATH"] = helpers_dir + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Zygote:
    """A train_zygote.py process that forks trainers with torch already
    imported (see that file); one per test module."""

    def __init__(self, impl: str = IMPL, script: str = ZYGOTE) -> None:
        self.impl = impl
        self.popen = subprocess.Popen([sys.executable, script, impl], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=worker_env())
        self._cv = threading.Condition()
        self._pids: list[int] = []
        self.rcs: dict[int, int] = {}
        self._ready = False
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()
        with self._cv:
            if not self._cv.wait_for(lambda: self._ready or self._eof, 120) or not self._ready:
                self.close()
                raise AssertionError("train_zygote.py did not start")

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            msg = json.loads(line)
            with self._cv:
                if "ready" in msg:
                    self._ready = True
                elif "pid" in msg:
                    self._pids.append(msg["pid"])
                elif "exit" in msg:
                    self.rcs[msg["exit"]] = msg["rc"]
                self._cv.notify_all()
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def spawn(self, argv: list[str], log: Path, lighthouse: bool = False,
              worker: str = "train_worker") -> ZChild:
        assert self.popen.stdin is not None
        req = {"argv": argv, "log": str(log), "lighthouse": lighthouse, "worker": worker}
        with self._cv:
            n = len(self._pids)
            self.popen.stdin.write((json.dumps(req) + "\n").encode())
            self.popen.stdin.flush()
            if not self._cv.wait_for(lambda: len(self._pids) > n or self._eof, 30) \
                    or len(self._pids) <= n:
                raise AssertionError("train_zygote.py did not fork")
            return ZChild(self, self._pids[n])

    def wait_rc(self, pid: int, timeout: float | None) -> int | None:
        with self._cv:
            self._cv.wait_for(lambda: pid in self.rcs or self._eof, timeout)
            return self.rcs.get(pid)

    def close(self) -> None:
        """Closes its stdin (it kills its own children) and then kills it."""
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.close()
            self.popen.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=30)


class ZChild:
    """A forked trainer, with the parts of Popen's interface the Job uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self.zygote.rcs.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        rc = self.zygote.wait_rc(self.pid, timeout)
        if rc is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return rc

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Group:
    """One replica group: its rank processes (or one torchrun) of one incarnation."""

    def __init__(self, rid: str, ranks: int, args: tuple[str, ...], torchrun: bool,
                 impl: str) -> None:
        self.rid = rid
        self.impl = impl
        self.ranks = ranks
        self.args = args
        self.torchrun = torchrun
        self.incarnation = -1
        self.popens: list[subprocess.Popen] = []


class Spare:
    """A warm spare the Job started: its process and takeover channel."""

    def __init__(self, name: str, popen, conn) -> None:
        self.name = name
        self.popen = popen
        self.conn = conn


class Job:
    """A lighthouse and replica groups; every process it starts is killed by
    pid in ``close()`` (worker pids under torchrun are read from their
    ``start`` events)."""

    def __init__(self, tmp: Path, *, min_replicas: int = 1,
                 join_timeout_ms: int = 200, heartbeat_timeout_ms: int | None = None,
                 impl: str = IMPL, lighthouse: str = LIGHTHOUSE,
                 zygote: Zygote | None = None,
                 lighthouse_args: Iterable[str] = (),
                 worker: str = "train_worker",
                 lighthouses: int = 1) -> None:
        self.dir = tmp
        self.worker = worker  # the helper module every trainer runs
        self.zygote = zygote
        self.impl = impl
        (tmp / "events").mkdir(parents=True, exist_ok=True)
        (tmp / "logs").mkdir(exist_ok=True)
        if heartbeat_timeout_ms is None:
            # ours sees a closed connection at once, so a heartbeat timeout
            # that would make a test slow proves that; torchft's needs it
            heartbeat_timeout_ms = 60000 if lighthouse == "ours" else 2000
        self.groups: dict[str, Group] = {}
        self._popens: list[subprocess.Popen] = []
        self._cache: dict[Path, tuple[int, list[dict]]] = {}
        self._orphans: set[int] = set()  # children of killed trainers
        flags = ["--bind", "127.0.0.1:0", "--min_replicas", str(min_replicas),
                 "--join_timeout_ms", str(join_timeout_ms),
                 "--heartbeat_timeout_ms", str(heartbeat_timeout_ms),
                 "--quorum_tick_ms", "20", *lighthouse_args]
        # several lighthouses (replicated, --etcd in lighthouse_args): logs
        # lighthouse.log, lighthouse1.log, ...; addr lists them all
        self.lighthouse_logs = [tmp / "logs" / ("lighthouse.log" if i == 0 else
                                                f"lighthouse{i}.log")
                                for i in range(lighthouses)]
        self.lighthouse_log = self.lighthouse_logs[0]
        self._lh_kind = lighthouse
        self._lh_flags = flags
        self._lhs = [self._start_lighthouse(flags, log)
                     for log in self.lighthouse_logs]
        self._lh = self._lhs[0]
        self.lh_addrs: list[str] = []
        try:
            for log in self.lighthouse_logs:
                m = wait_for(lambda: LISTEN_RE.search(_read_text(log)),
                             60, "the lighthouse to listen")
                port = m.group(1).rsplit(':', 1)[1].rstrip('/')
                self.lh_addrs.append(f"http://127.0.0.1:{port}")
        except BaseException:
            self.close()
            raise
        self.addr = ",".join(self.lh_addrs)

    def _start_lighthouse(self, flags: list[str], log_path: Path | None = None):
        zygote = self.zygote
        lighthouse = self._lh_kind
        log_path = log_path or self.lighthouse_log
        if lighthouse == "ours" and zygote is not None:
            # forked with stepguard already imported: no torch import to wait for
            p = zygote.spawn(flags, log_path, lighthouse=True)
        else:
            cmd = ([str(TORCHFT_LIGHTHOUSE_SCRIPT)] if lighthouse == "torchft"
                   else [sys.executable, "-c", OURS_CODE]) + flags
            with open(log_path, "ab") as log:
                p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self._popens.append(p)
        return p

    def kill_lighthouse(self, i: int = 0) -> None:
        """SIGKILLs the lighthouse (the i-th of several)."""
        p = self._lhs[i]
        p.kill()
        p.wait(timeout=30)

    def restart_lighthouse(self) -> None:
        """Starts the lighthouse again, same flags, on the same port."""
        port = self.addr.rsplit(":", 1)[1]
        flags = list(self._lh_flags)
        flags[flags.index("--bind") + 1] = f"127.0.0.1:{port}"
        before = _read_text(self.lighthouse_log).count("listening on")
        self._lh = self._lhs[0] = self._start_lighthouse(flags)
        wait_for(lambda: _read_text(self.lighthouse_log).count("listening on") > before,
                 60, "the restarted lighthouse to listen")

    # ---- processes --------------------------------------------------

    def start_group(self, rid: str, ranks: int = 1, *args: str,
                    torchrun: bool = False, impl: str | None = None) -> Group:
        """Starts a replica group; ``impl`` (default: the job's) is the
        package its trainers use, so one job can mix torchft and stepguard."""
        g = Group(rid, ranks, tuple(args), torchrun, impl or self.impl)
        self.groups[rid] = g
        self._launch(g)
        return g

    def _launch(self, g: Group, extra: Iterable[str] = ()) -> None:
        g.incarnation += 1
        g.popens = []
        common = ["--impl", g.impl, "--lighthouse", self.addr,
                  "--replica-id", g.rid, "--dir", str(self.dir),
                  "--incarnation", str(g.incarnation), *g.args, *extra]
        log = open(self.dir / "logs" / f"{g.rid}.i{g.incarnation}.log", "ab")
        try:
            if g.torchrun:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={g.ranks}", "--monitor-interval=0.1",
                       WORKER, *common]
                g.popens.append(subprocess.Popen(cmd, stdout=log, stderr=log,
                                                 env=worker_env()))
            elif self.zygote is not None and g.impl == self.zygote.impl:
                for r in range(g.ranks):
                    g.popens.append(self.zygote.spawn(
                        [*common, "--group-rank", str(r), "--group-world-size", str(g.ranks)],
                        self.dir / "logs" / f"{g.rid}.i{g.incarnation}.log",
                        worker=self.worker))
            else:
                script = str(Path(WORKER).with_name(f"{self.worker}.py"))
                for r in range(g.ranks):
                    cmd = [sys.executable, script, *common, "--group-rank", str(r),
                           "--group-world-size", str(g.ranks)]
                    g.popens.append(subprocess.Popen(cmd, stdout=log, stderr=log,
                                                     env=worker_env()))
        finally:
            log.close()
        self._popens.extend(g.popens)

    def child_pids(self, rid: str) -> set[int]:
        """Children the current incarnation's trainers reported (DataLoader
        workers), so that they too are killed by pid at the end."""
        g = self.groups[rid]
        return {c for e in self.events(rid, inc=g.incarnation, ev="ready")
                for c in e.get("children", [])}

    def worker_pids(self, rid: str) -> list[int]:
        """Pids of the current incarnation's trainer processes (from events)."""
        g = self.groups[rid]
        return [e["pid"] for e in self.events(rid, inc=g.incarnation, ev="start")]

    def kill_group(self, rid: str) -> None:
        """SIGKILLs every process of the group's current incarnation."""
        g = self.groups[rid]
        self._orphans |= self.child_pids(rid)
        for p in g.popens:
            p.kill()
        for pid in self.worker_pids(rid):
            _kill(pid)
        for p in g.popens:
            p.wait(timeout=30)

    def restart_group(self, rid: str, *extra: str) -> None:
        self._launch(self.groups[rid], extra)

    # ---- warm spares (stepguard.spares), one-rank groups -------------

    def start_spare(self, name: str, *args: str) -> Spare:
        """Starts a warm spare of the job's worker (``--spare-sock``): it
        connects to a Unix socket of ours, which is its takeover channel,
        sets up and waits (its ``waiting`` event, :meth:`spare_waiting`)."""
        import socket

        path = str(self.dir / f"{name}.sock")
        if len(path) > 100:  # a Unix socket's path has at most 107 bytes
            import tempfile

            path = os.path.join(tempfile.mkdtemp(prefix="sg-spare-"), "s")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        srv.settimeout(60)
        log = self.dir / "logs" / f"{name}.log"
        argv = ["--impl", self.impl, "--lighthouse", self.addr, "--replica-id", name,
                "--dir", str(self.dir), "--spare-sock", path, *args]
        try:
            if self.zygote is not None and self.impl == self.zygote.impl:
                p = self.zygote.spawn(argv, log, worker=self.worker)
            else:
                script = str(Path(WORKER).with_name(f"{self.worker}.py"))
                with open(log, "ab") as f:
                    p = subprocess.Popen([sys.executable, script, *argv], stdout=f,
                                         stderr=f, env=worker_env())
            self._popens.append(p)
            conn, _ = srv.accept()
        finally:
            srv.close()
        return Spare(name, p, conn)

    def spare_waiting(self, spare: Spare) -> dict | None:
        """The spare's ``waiting`` event (pid, its store's port), or None."""
        path = self.dir / "events" / f"{spare.name}.waiting.jsonl"
        if not path.exists():
            return None
        return next((e for e in self._read(path) if e["ev"] == "waiting"), None)

    def take_over(self, rid: str, spare: Spare) -> None:
        """Makes the waiting spare the next incarnation of one-rank group
        ``rid``: writes it the takeover message (the group's identity, the
        spare's own store, this job's lighthouse) and closes the channel."""
        from stepguard.spares import send_takeover

        g = self.groups[rid]
        assert g.ranks == 1 and not g.torchrun, "spares here replace one-rank groups"
        waiting = self.spare_waiting(spare)
        assert waiting is not None, f"spare {spare.name} is not waiting yet"
        g.incarnation += 1
        g.popens = [spare.popen]
        env = {"REPLICA_GROUP_ID": str(replica_index(rid)), "RANK": "0", "WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(waiting["store_port"]),
               "TORCHFT_LIGHTHOUSE": self.addr, "STEPGUARD_INCARNATION": str(g.incarnation)}
        try:
            send_takeover(spare.conn.fileno(), env)
        finally:
            spare.conn.close()

    def wait_exit(self, rid: str, timeout: float) -> list[int]:
        g = self.groups[rid]
        deadline = time.monotonic() + timeout
        rcs = []
        for p in g.popens:
            try:
                rcs.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{rid} did not exit within {timeout}s\n"
                                     + self.summary()) from None
        return rcs

    def stop_at(self, step: int) -> None:
        """Makes every worker exit once it has reached `step`."""
        tmp = self.dir / "stop_at.tmp"
        tmp.write_text(str(step))
        os.rename(tmp, self.dir / "stop_at")

    def alive(self, rid: str) -> bool:
        return all(p.poll() is None for p in self.groups[rid].popens)

    def close(self) -> None:
        pids: set[int] = set()
        for rid in self.groups:
            try:
                pids |= {e["pid"] for e in self.events(rid, ev="start")}
            except OSError:
                pass
        for p in self._popens:
            if p.poll() is None:
                p.kill()
        for rid in self.groups:
            pids |= self.child_pids(rid)
        for pid in pids | self._orphans:
            _kill(pid)
        for p in self._popens:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    # ---- events -----------------------------------------------------

    def _read(self, path: Path) -> list[dict]:
        size = path.stat().st_size
        cached = self._cache.get(path)
        if cached is not None and cached[0] == size:
            return cached[1]
        out = []
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):
                    out.append(json.loads(line))
        self._cache[path] = (size, out)
        return out

    def events(self, rid: str | None = None, *, g: int | None = None,
               inc: int | None = None, ev: str | None = None) -> list[dict]:
        """Events, filtered, in file order per rank (files in name order)."""
        out: list[dict] = []
        pattern = f"{rid or '*'}.g{'*' if g is None else g}.i{'*' if inc is None else inc}.jsonl"
        for path in sorted((self.dir / "events").glob(pattern)):
            for e in self._read(path):
                if ev is None or e["ev"] == ev:
                    out.append(e)
        return out

    def steps(self, rid: str | None = None, **kw) -> list[dict]:
        return self.events(rid, ev="step", **kw)

    def committed(self, rid: str, g: int = 0, inc: int | None = None) -> int:
        """The highest step this rank has committed up to (-1 if none)."""
        g_ = self.groups[rid]
        inc = g_.incarnation if inc is None else inc
        return max((e["step"] for e in self.steps(rid, g=g, inc=inc) if e["ok"]),
                   default=-1)

    def all_committed(self, step: int, rids: Iterable[str] | None = None) -> bool:
        rids = list(self.groups) if rids is None else list(rids)
        return all(self.committed(rid, g) >= step
                   for rid in rids for g in range(self.groups[rid].ranks))

    def hashes(self) -> dict[tuple[int, int], dict[str, str]]:
        """{(group_rank, committed step): {replica_id: hash}}, every incarnation.

        Also asserts that one rank never logs two hashes for one step."""
        out: dict[tuple[int, int], dict[str, str]] = defaultdict(dict)
        for e in self.steps():
            if not e["ok"]:
                continue
            key = (e["g"], e["step"])
            prev = out[key].get(e["rid"])
            assert prev is None or prev == e["hash"], (
                f"{e['rid']} g{e['g']} logged two hashes for step {e['step']}")
            out[key][e["rid"]] = e["hash"]
        return out

    def assert_identical(self, min_compared: int, rids: Iterable[str] | None = None,
                         from_step: int = 0) -> int:
        """Asserts that replicas at the same committed step hold identical
        parameters; returns how many (group rank, step) pairs held at least
        two replicas, and asserts that number and that parameters changed."""
        want = set(self.groups) if rids is None else set(rids)
        compared = 0
        distinct: dict[int, set[str]] = defaultdict(set)
        for (g, step), by_rid in sorted(self.hashes().items()):
            if step < from_step:
                continue
            sel = {r: h for r, h in by_rid.items() if r in want}
            if len(sel) >= 2:
                assert len(set(sel.values())) == 1, (
                    f"group rank {g} step {step}: replicas differ: {sel}")
                compared += 1
            distinct[g] |= set(sel.values())
        assert compared >= min_compared, (
            f"only {compared} (group rank, step) pairs compared, want {min_compared}")
        for g, hs in distinct.items():
            assert len(hs) >= min(compared, 3), f"parameters of group rank {g} never change"
        return compared

    def assert_went_on(self, rids: Iterable[str], reached: dict[str, int],
                       slack: int = 0) -> None:
        """After a lighthouse fault: every trainer is still its first
        incarnation, steps and quorum ids never went back, nothing committed
        was lost (each group went on from the step in ``reached``, or
        healed), and the replicas end identical (every step held by two
        replicas or more compared; ``slack``: steps a group may have skipped
        by healing from a peer).  Stops the trainers."""
        rids = list(rids)
        for rid in rids:
            assert self.alive(rid), self.summary()
            ok = [e for e in self.steps(rid, inc=0) if e["ok"]]
            steps = [e["step"] for e in ok]
            assert steps == sorted(set(steps)), f"{rid} went back: {steps}"
            after = [s for s in steps if s > reached[rid]]
            assert after and after[0] == reached[rid] + 1 or any(
                e["healed"] for e in self.steps(rid, inc=0)), (
                f"{rid} lost committed steps: reached {reached[rid]}, "
                f"then {after[:5]}")
            qids = [e["qid"] for e in ok]
            assert qids == sorted(qids), f"{rid} saw quorum ids go back: {qids}"
        target = max(self.committed(rid) for rid in rids) + 3
        self.stop_at(target)
        for rid in rids:
            assert self.wait_exit(rid, 60) == [0], self.summary()
        self.assert_identical(target - 1 - slack)

    def summary(self, tail: int = 4) -> str:
        lines = [f"impl={self.impl} dir={self.dir}"]
        for rid, g in self.groups.items():
            for r in range(g.ranks):
                evs = self.events(rid, g=r)
                lines.append(f"-- {rid} g{r} (incarnation {g.incarnation}, "
                             f"alive={self.alive(rid)}): {len(evs)} events")
                lines.extend("   " + json.dumps(e) for e in evs[-tail:])
            logf = self.dir / "logs" / f"{rid}.i{g.incarnation}.log"
            if logf.exists():
                text = logf.read_text(errors="replace").splitlines()[-8:]
                lines.extend("   | " + t for t in text)
        lh = _read_text(self.lighthouse_log).splitlines()
        lines.append("-- lighthouse: " + " / ".join(lh[-4:]))
        return "\n".join(lines)


class HardTimeout(BaseException):
    """Raised by SIGALRM when a scenario overruns its hard time limit."""


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    """One fork server per test module (import it next to job_factory)."""
    z = Zygote()
    try:
        yield z
    finally:
        z.close()


@pytest.fixture
def job_factory(tmp_path, zygote):
    """Makes Jobs under tmp_path and closes them all at teardown.  The first
    ``make(hard_timeout=S, ...)`` arms SIGALRM: the scenario fails after S
    seconds (default 120) whatever it is waiting for."""
    jobs: list[Job] = []
    limit = [0]

    def on_alarm(signum, frame):
        raise HardTimeout(f"scenario exceeded its {limit[0]}s hard timeout\n"
                          + "\n".join(j.summary() for j in jobs))

    def make(hard_timeout: int = 120, **kw) -> Job:
        if not limit[0]:
            limit[0] = hard_timeout
            signal.alarm(hard_timeout)
        kw.setdefault("zygote", zygote)
        j = Job(tmp_path / f"job{len(jobs)}", **kw)
        jobs.append(j)
        return j

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        yield make
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        for j in jobs:
            j.close()


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _kill(pid: int) -> None:
    """SIGKILLs pid if it still is a trainer (a pid read from an event file
    may have exited and been reused since); forked ones show the zygote's
    command line."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
            if b"train_worker.py" not in cmdline and b"train_zygote.py" not in cmdline:
                return
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, FileNotFoundError):
        pass
