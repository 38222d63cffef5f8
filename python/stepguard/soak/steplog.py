"""Per-step state logs: what a replica's rank writes for the checker.

One JSON object per line, in ``<dir>/g<group>.r<rank>.inc<incarnation>.jsonl``,
flushed per line (a SIGKILL loses at most the line being written):

- ``{"kind": "step", "step": S, "committed": true, "hash_after": H, ...}``
  after a committed step S: the hash of this rank's parameters and
  optimizer state once step S is applied;
- ``{"kind": "step", "committed": false, "hash_before": H0,
  "hash_after": H1, ...}`` for a discarded step (they must be equal;
  ``hash_before`` is null when a heal loaded in that step without the
  heal hook telling, as on torchft);
- ``{"kind": "heal", "step": S, "hash": H, "source": R}`` when this rank
  loaded a peer's state for step S (from replica R).

Every ``step`` line also carries what the quorum said: ``quorum_id``,
``members`` (replica names without their per-start suffix), ``max_step``,
``participants``, and ``replica_id``, ``group``, ``rank``, ``incarnation``
and ``t`` (wall clock).  For a sharded group each rank hashes its own
shards, so the checker compares rank r of every replica with each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from stepguard import config

__all__ = ["StepLog", "state_hash"]


def _feed(h: Any, obj: Any) -> None:
    """Feeds ``obj`` into hash ``h`` in a fixed order (dict keys sorted by
    their text, sequences in order, a tensor by dtype, shape and bytes; a
    DTensor by its local shard)."""
    if hasattr(obj, "to_local") and callable(obj.to_local):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=str):
            h.update(f"{k!s}=".encode())
            _feed(h, obj[k])
            h.update(b",")
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _feed(h, v)
            h.update(b",")
        h.update(b"]")
    else:
        h.update(repr(obj).encode())


def state_hash(state: Any) -> str:
    """A hex digest (BLAKE2b, 16 bytes) of ``state`` in a fixed order."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, state)
    return h.hexdigest()


def _base_name(replica_id: str) -> str:
    """``train_0:uuid`` -> ``train_0``: the replica, not its start."""
    return replica_id.split(":", 1)[0]


class StepLog:
    """Writes one rank's step log (see the module docstring).

    Args:
        folder: where the log files go.
        manager: the rank's Manager (stepguard's; torchft's works too,
            without members and max_step).
        state: returns what to hash (the same state the Manager sends a
            healer: parameters and optimizer state).
        replica_id: the replica's name (without a suffix).
    """

    def __init__(self, folder: str | os.PathLike[str], manager: Any,
                 state: Callable[[], Any], replica_id: str) -> None:
        self.group = config.get("REPLICA_GROUP_ID")
        self.rank = config.get("RANK", 0)
        self.incarnation = config.get("STEPGUARD_INCARNATION")
        self.manager = manager
        self.state = state
        self.replica_id = replica_id
        Path(folder).mkdir(parents=True, exist_ok=True)
        name = f"g{self.group}.r{self.rank}.inc{self.incarnation}.jsonl"
        self._f = open(Path(folder) / name, "a", buffering=1)  # noqa: SIM115
        self._before: str | None = None
        self._healed_hash: str | None = None

    def _write(self, rec: dict[str, Any]) -> None:
        rec.update(t=round(time.time(), 6), replica_id=self.replica_id, group=self.group,
                   rank=self.rank, incarnation=self.incarnation)
        self._f.write(json.dumps(rec, sort_keys=True) + "\n")

    def healed(self, source: str | None = None) -> None:
        """Call when the rank has loaded a peer's state (the Manager's
        ``loaded`` heal point): logs the hash of what it loaded."""
        h = state_hash(self.state())
        self._healed_hash = h
        self._write({"kind": "heal", "step": self.manager.current_step(), "hash": h,
                     "source": source})

    def before_commit(self) -> None:
        """Call after the backward pass, before the optimizer step."""
        self._healed_hash = None
        self._before = state_hash(self.state())

    def after_commit(self, committed: bool) -> None:
        """Call after the optimizer step, with whether it committed."""
        m = self.manager
        q = None
        last = getattr(m, "last_quorum", None)
        if last is not None:
            try:
                q = last()
            except Exception:  # noqa: BLE001 - a failed quorum: logged without it
                q = None
        step = m.current_step() - 1 if committed else m.current_step()
        rec: dict[str, Any] = {
            "kind": "step", "step": step, "committed": committed,
            "quorum_id": getattr(q, "quorum_id", getattr(m, "_quorum_id", None)),
            "members": sorted(_base_name(r) for r in q.replica_ids) if q is not None
            else None,
            "max_step": q.max_step if q is not None else None,
            "participants": m.num_participants() if committed else None,
        }
        after = state_hash(self.state())
        rec["hash_after"] = after
        if not committed:
            # a heal loaded in this step's vote is the state it starts from;
            # unknown when it healed without the heal hook (torchft)
            unhooked = self._healed_hash is None and bool(getattr(m, "_healing", False))
            rec["hash_before"] = None if unhooked else (self._healed_hash or self._before)
        self._healed_hash = None
        self._write(rec)

    def close(self) -> None:
        self._f.close()
