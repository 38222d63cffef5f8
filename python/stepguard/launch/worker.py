"""The worker side of stepguard-launch: what a training script calls.

Standard library only, so any training script can use it.  :func:`report`
sends an event to the launcher over the pipe named by ``EVENTS_FD_ENV``;
:func:`stop_step` reads the step at which the launcher asked the workers to
finish, from the file named by ``STOP_FILE_ENV``.  The launcher
(:mod:`stepguard.launch.launcher`) sets these variables for every rank.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from stepguard import config
from typing import Any

__all__ = ["hook_point", "report", "stop_step"]

EVENTS_FD_ENV = "STEPGUARD_EVENTS_FD"
HOOK_DIR_ENV = "STEPGUARD_HOOK_DIR"
STOP_FILE_ENV = "STEPGUARD_STOP_FILE"
INCARNATION_ENV = "STEPGUARD_INCARNATION"

_PIPE_BUF = 4096  # writes up to this size are atomic on a pipe


def report(event: str, **fields: Any) -> None:
    """Sends one event to the launcher (no-op outside the launcher).

    Adds ``t`` (wall clock), ``group``, ``rank`` and ``incarnation`` from
    the environment.  Never raises; an event too large for one atomic pipe
    write loses its extra fields.

    Args:
        event: event name, e.g. ``"step"``.
        fields: JSON-serialisable values.
    """
    fd_text = config.get("STEPGUARD_EVENTS_FD")
    if not fd_text:
        return
    rec: dict[str, Any] = {
        "event": event,
        "t": time.time(),
        # a warm spare has no group until it takes one over
        "group": config.get("REPLICA_GROUP_ID", None),
        "rank": config.get("RANK", 0),
        "incarnation": config.get("STEPGUARD_INCARNATION"),
    }
    spare = config.get("STEPGUARD_SPARE_ID")
    if spare is not None:
        rec["spare"] = spare
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
    path = config.get("STEPGUARD_STOP_FILE")
    if not path:
        return None
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def hook_point(point: str, wait_s: float = 30.0, **fields: Any) -> bool:
    """A fault point the launcher can strike at (no-op unless armed).

    The launcher arms ``point`` by writing a file of that name in the
    folder named by ``HOOK_DIR_ENV``.  The first rank to reach an armed
    point claims it (an atomic rename, so only one does), reports a
    ``hook`` event and waits here up to ``wait_s`` for the launcher to
    end its group; if nothing happens, it goes on.  So a fault lands
    exactly at that point of the run, not by luck.  The launcher may also
    let it go (a ``<point>.release.<pid>`` file) and arm the point again.

    Returns:
        True when this call claimed the point and the launcher neither
        acted nor let it go within ``wait_s``.
    """
    folder = config.get("STEPGUARD_HOOK_DIR")
    if not folder:
        return False
    armed = Path(folder) / point
    if not armed.exists():
        return False
    claimed = Path(folder) / f"{point}.claimed.{os.getpid()}"
    try:
        os.rename(armed, claimed)  # atomic: one claimer
    except OSError:
        return False
    report("hook", point=point, pid=os.getpid(), **fields)
    release = Path(folder) / f"{point}.release.{os.getpid()}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if release.exists():  # the launcher let this one go
            return False
        time.sleep(0.05)
    report("hook_timeout", point=point, pid=os.getpid())
    return True
