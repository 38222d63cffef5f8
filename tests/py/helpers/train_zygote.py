"""A fork server for train_worker.py: imports torch and the implementation
once, then forks one trainer process per request, so that a scenario's
processes start in milliseconds instead of seconds each on a loaded machine.

    python train_zygote.py IMPL

Reads one JSON request per line on stdin, ``{"argv": [...], "log": PATH}``
(``"lighthouse": true`` runs stepguard's lighthouse CLI with argv instead
of a trainer; ``"worker": MODULE`` runs that helper module's ``main``
instead of train_worker's), and writes one JSON line per event on stdout: ``{"pid": P}`` for each fork
(in request order) and ``{"exit": P, "rc": RC}`` when a child ends (RC is
negative for a signal, like Popen.returncode).  It stays single-threaded so
that forking is safe.  When stdin closes (the harness is done or died) it
SIGKILLs every child of its own that still runs, by pid, and exits.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import sys
import traceback


def child(argv: list[str], log: str, lighthouse: bool = False,
          worker: str = "train_worker") -> None:
    """Runs in the forked child: never returns."""
    rc = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(0)
        if lighthouse:
            from stepguard.coordination import lighthouse_main

            rc = lighthouse_main(["stepguard-lighthouse", *argv])
        else:
            sys.argv = [f"{worker}.py", *argv]
            rc = importlib.import_module(worker).main(argv) or 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def reap(out, children: set[int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        out.write(json.dumps({"exit": pid, "rc": rc}) + "\n")
        out.flush()


def main() -> int:
    impl = sys.argv[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed  # noqa: F401
    import torch._dynamo  # noqa: F401  (DDP's first construction imports it: ~3 s)
    import torch.nn.parallel  # noqa: F401
    import torch.utils.data  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401  (hsdp_worker's trainers)

    torch.set_num_threads(1)
    for mod in (impl, f"{impl}.manager", f"{impl}.process_group"):
        importlib.import_module(mod)
    import train_worker  # noqa: F401

    out = sys.stdout
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    stdin = sys.stdin.buffer
    buf = b""
    children: set[int] = set()
    while True:
        r, _, _ = select.select([stdin], [], [], 0.05)
        reap(out, children)
        if not r:
            continue
        chunk = os.read(stdin.fileno(), 65536)
        if not chunk:
            for pid in children:  # not reaped yet, so the pid is still theirs
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return 0
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                child(req["argv"], req["log"], req.get("lighthouse", False),
                      req.get("worker", "train_worker"))
            children.add(pid)
            out.write(json.dumps({"pid": pid}) + "\n")
            out.flush()


if __name__ == "__main__":
    sys.exit(main())
