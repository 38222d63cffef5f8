"""Warm spares: trainers that wait, set up, to take a lost replica group's place.

A warm spare is a trainer process that has done everything a trainer does
before its first quorum (imports, model, optimizer, data pipeline objects,
process group objects) and then waits in :func:`wait_for_takeover`.  It has
no Manager yet, so it neither heartbeats nor asks for quorums: the
lighthouse does not know it exists.  When a replica group dies, whoever runs
the job (``stepguard-launch --spares N``, or any other launcher) writes a
*takeover message* to the spare: the identity of the group it replaces
(replica group id, rank, world size, the group's store, the lighthouse, ...)
as environment variables.  :func:`wait_for_takeover` puts them into
``os.environ`` and returns; the trainer then builds its Manager, which
reads them as usual, joins the next quorum, heals from a peer and trains.

The trainer's side (one call, placed just before the Manager is built)::

    model, optimizer, loader, pg = setup()           # the slow part
    ident = stepguard.spares.wait_for_takeover()     # returns at once if not a spare
    manager = Manager(pg=pg, replica_id=f"train_{ident.replica_group}", ...)

A process is a spare when ``STEPGUARD_SPARE_FD`` names a file descriptor
(a pipe's read end, or a connected socket) on which the takeover message
will arrive; otherwise :func:`wait_for_takeover` returns the identity the
environment already holds.

The launcher's side: :func:`takeover_message` encodes the message and
:func:`send_takeover` writes it.  The message is one line of JSON::

    {"stepguard_takeover": 1, "env": {"REPLICA_GROUP_ID": "2", "RANK": "0", ...}}

``env`` maps variable names to string values; :data:`REQUIRED` must be
among them.  A message longer than :data:`MAX_MESSAGE` bytes, one that is
not that JSON, a channel closed before a whole line, or no message within
the deadline (``STEPGUARD_SPARE_TIMEOUT_SEC``) raise :class:`TakeoverError`
with the reason: a spare that cannot learn its identity must fail, not
train as somebody else.

A spare's setup competes with the training for the CPUs.  A launcher should
start it at a low priority and give it the group's priority back at the
takeover: :func:`renice` sets the nice value of every thread of the given
processes (and of their sessions' scheduler autogroups, which decide
between sessions where the kernel uses them), and :func:`can_renice` says
whether this process may lower it again (root, ``CAP_SYS_NICE``, or a high
enough ``RLIMIT_NICE``); when it may not, leave the spare at the group's
priority.  See ``docs/spares.md``.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import select
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, Mapping, Optional

from stepguard import config

__all__ = [
    "MAX_MESSAGE",
    "REQUIRED",
    "Takeover",
    "TakeoverError",
    "can_renice",
    "is_spare",
    "renice",
    "set_autogroup",
    "send_takeover",
    "takeover_message",
    "wait_for_takeover",
]

MAX_MESSAGE = 65536
"""The longest takeover message accepted, in bytes (its newline included)."""

REQUIRED = ("REPLICA_GROUP_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Variables every takeover message must set."""

_INTS = ("REPLICA_GROUP_ID", "RANK", "WORLD_SIZE", "MASTER_PORT")
_VERSION = 1


class TakeoverError(RuntimeError):
    """The takeover message did not arrive, or was not one."""


@dataclass(frozen=True)
class Takeover:
    """Who this process is from now on.

    Attributes:
        replica_group: the replica group it replaces (``REPLICA_GROUP_ID``).
        rank: its rank inside the group (``RANK``).
        world_size: the group's size (``WORLD_SIZE``).
        store_addr: the group's TCPStore host (``MASTER_ADDR``).
        store_port: its port (``MASTER_PORT``).
        spare: True if it waited as a spare; False if the environment
            already held its identity.
        waited_s: seconds spent waiting for the message.
        env: every variable the message set (empty when not a spare).
    """

    replica_group: int
    rank: int
    world_size: int
    store_addr: str
    store_port: int
    spare: bool
    waited_s: float = 0.0
    env: Dict[str, str] = field(default_factory=dict)


def is_spare() -> bool:
    """True in a process started as a warm spare (``STEPGUARD_SPARE_FD`` set)."""
    return bool(config.get("STEPGUARD_SPARE_FD"))


def takeover_message(env: Mapping[str, object]) -> bytes:
    """Encodes a takeover message (for launchers).

    Args:
        env: the variables the spare takes; values are turned into strings.

    Raises:
        ValueError: a required variable is missing, a name is not a
            string, or the message would be too long.
    """
    out = {str(k): str(v) for k, v in env.items()}
    missing = [k for k in REQUIRED if k not in out]
    if missing:
        raise ValueError(f"takeover message lacks {', '.join(missing)}")
    data = (json.dumps({"stepguard_takeover": _VERSION, "env": out}) + "\n").encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"takeover message of {len(data)} bytes (at most {MAX_MESSAGE})")
    return data


def send_takeover(fd: int, env: Mapping[str, object]) -> None:
    """Writes a takeover message to ``fd`` (a pipe's write end or a socket).

    The launcher should close its end afterwards: the spare reads only the
    first line.  Raises OSError if the spare is gone (EPIPE), ValueError
    as :func:`takeover_message`.
    """
    data = takeover_message(env)
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


_CAP_SYS_NICE = 23
_RENICE_ROUNDS = 4


def can_renice(nice: int) -> bool:
    """True if this process may set another of its user's processes to
    ``nice`` from any higher value: it has ``CAP_SYS_NICE`` (root has), or
    its ``RLIMIT_NICE`` lets it go as low as ``nice``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:") and int(line.split()[1], 16) >> _CAP_SYS_NICE & 1:
                return True
    except (OSError, ValueError, IndexError):
        pass
    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    return soft == resource.RLIM_INFINITY or 20 - soft <= nice


def renice(pids: Iterable[int], nice: int, autogroup: Optional[int] = None) -> int:
    """Sets the nice value of every thread of each process in ``pids``
    (Linux keeps one per thread; a thread inherits its creator's).

    With ``autogroup``, also sets the autogroup nice value of each of them
    that leads its own session.  Where the kernel groups each session's
    processes for the scheduler (``/proc/sys/kernel/sched_autogroup_enabled``),
    a thread's nice value only weighs it against its own session, and the
    session's autogroup value weighs the session against the others: a
    process started in a session of its own needs both.

    Processes or threads that are gone are skipped.  Returns how many
    threads were set.  A thread started while they are being set may have
    taken its creator's old value: the threads are listed again until no
    new one appears (a few rounds at most).  Raises PermissionError if not
    allowed (:func:`can_renice`).
    """
    done = 0
    for pid in pids:
        seen: set[int] = set()
        for _ in range(_RENICE_ROUNDS):
            try:
                tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")} - seen
            except (FileNotFoundError, ProcessLookupError):
                break
            if not tids:
                break
            for tid in tids:
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
                    done += 1
                except ProcessLookupError:
                    continue
            seen |= tids
        if autogroup is not None:
            try:
                if os.getsid(pid) == pid:
                    set_autogroup(pid, autogroup)
            except ProcessLookupError:
                continue
    return done


def set_autogroup(pid: int, nice: int) -> bool:
    """Sets the autogroup nice value of ``pid``'s session (``0`` for
    ``pid``: this process's).  False where the kernel has no autogroups or
    the process is gone; PermissionError if not allowed."""
    path = f"/proc/{pid or 'self'}/autogroup"
    try:
        with open(path, "w") as f:
            f.write(str(nice))
        return True
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError as e:
        if e.errno == errno.EPERM or e.errno == errno.EACCES:
            raise PermissionError(e.errno, f"{path}: {e.strerror}") from None
        return False  # EINVAL: autogroups compiled in but not in use


def _parse(line: bytes) -> Dict[str, str]:
    try:
        msg = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise TakeoverError(f"the takeover message is not JSON ({e}): {line[:80]!r}") from None
    if not isinstance(msg, dict) or msg.get("stepguard_takeover") != _VERSION:
        raise TakeoverError("the takeover message is not a stepguard takeover "
                            f"(version {_VERSION}): {line[:80]!r}")
    env = msg.get("env")
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k
            and "\0" not in v for k, v in env.items()):
        raise TakeoverError("the takeover message's env is not a map of variable names "
                            "to strings")
    missing = [k for k in REQUIRED if k not in env]
    if missing:
        raise TakeoverError(f"the takeover message lacks {', '.join(missing)}")
    for k in _INTS:
        try:
            if int(env[k]) < 0:
                raise ValueError
        except ValueError:
            raise TakeoverError(f"the takeover message's {k}={env[k]!r} is not a "
                                "non-negative integer") from None
    if int(env["RANK"]) >= int(env["WORLD_SIZE"]):
        raise TakeoverError(f"the takeover message's RANK={env['RANK']} is not below "
                            f"WORLD_SIZE={env['WORLD_SIZE']}")
    return env


def _read_line(fd: int, deadline: float) -> bytes:
    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TakeoverError("no takeover message within the spare's deadline "
                                "(STEPGUARD_SPARE_TIMEOUT_SEC)")
        try:
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        except InterruptedError:  # pragma: no cover - PEP 475 retries select
            continue
        if not ready:
            continue
        try:
            chunk = os.read(fd, MAX_MESSAGE + 1 - len(buf))
        except BlockingIOError:
            continue
        if not chunk:
            raise TakeoverError("the takeover channel closed before a whole message "
                                f"arrived ({len(buf)} bytes): the launcher is gone or "
                                "gave up on this spare")
        buf += chunk
        nl = buf.find(b"\n")
        if nl >= 0:
            return buf[:nl]
        if len(buf) > MAX_MESSAGE:
            raise TakeoverError(f"the takeover message is longer than {MAX_MESSAGE} bytes")


def _from_env(spare: bool, waited: float, env: Dict[str, str]) -> Takeover:
    return Takeover(
        replica_group=int(config.get("REPLICA_GROUP_ID")),
        rank=int(config.get("RANK", 0) or 0),
        world_size=int(config.get("WORLD_SIZE", 1) or 1),
        store_addr=str(config.get("MASTER_ADDR") or ""),
        store_port=int(config.get("MASTER_PORT", 0) or 0),
        spare=spare, waited_s=waited, env=env,
    )


def wait_for_takeover(timeout: Optional[float] = None) -> Takeover:
    """Waits, as a warm spare, until told which replica group to become.

    In a process that is not a spare, returns the identity in the
    environment at once.  In a spare, reports ``spare_waiting`` to the
    launcher (``stepguard.launch.report``), blocks until the takeover
    message arrives on ``STEPGUARD_SPARE_FD``, sets its variables in
    ``os.environ`` (where the Manager, the process groups and
    ``stepguard.launch.report`` read them), closes the descriptor, and
    returns.  Call it once, from the main thread, before the Manager.

    Args:
        timeout: seconds to wait (default ``STEPGUARD_SPARE_TIMEOUT_SEC``).

    Raises:
        TakeoverError: no message within the deadline, the channel closed
            first, or the message is malformed (the reason is in the text).
    """
    fd_text = config.get("STEPGUARD_SPARE_FD")
    if not fd_text:
        return _from_env(False, 0.0, {})
    try:
        fd = int(fd_text)
        os.fstat(fd)
    except (ValueError, OSError) as e:
        raise TakeoverError(f"STEPGUARD_SPARE_FD={fd_text!r} is not an open file "
                            f"descriptor ({e})") from None
    wait = config.get("STEPGUARD_SPARE_TIMEOUT_SEC") if timeout is None else timeout
    from stepguard.launch.worker import report

    t0 = time.monotonic()
    report("spare_waiting", pid=os.getpid())
    try:
        env = _parse(_read_line(fd, t0 + float(wait)))
    finally:
        os.close(fd)
        os.environ.pop("STEPGUARD_SPARE_FD", None)
    os.environ.update(env)
    waited = time.monotonic() - t0
    report("spare_takeover", pid=os.getpid(), waited_s=round(waited, 6))
    return _from_env(True, waited, env)
