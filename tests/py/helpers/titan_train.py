"""One rank of a torchtitan replica group, run under stepguard-launch.

``python titan_train.py DUMP_DIR [torchtitan flags...]`` runs torchtitan's
own entry point (``torchtitan.train.main``) with the flags, after
:mod:`titan_shim` made torchtitan runnable on CPU, and adds the launcher's
worker side around torchtitan's FT trainer, from outside it:

- after every train step that asked the Manager to commit, one ``step``
  event (``stepguard.launch.worker.report``): torchtitan's step, the
  Manager's step, whether it committed, the quorum's id and participants;
  and ``ready`` when training starts;
- training ends after the step the launcher's stop file names (the run's
  ``--training.steps`` is out of reach);
- ``--fault_tolerance.replica_id`` and ``--fault_tolerance.group_size``
  from the launcher's environment, when the command line lacks them;
- at the end, ``DUMP_DIR/params_g<group>_r<rank>.json``: torchtitan's and
  the Manager's step, the learning rates, a SHA-256 of this rank's shard
  of every parameter and optimizer-state tensor, so a test compares
  replicas bit for bit, group rank by group rank, and the optimizer-state
  DTensors that are not on their parameter's mesh.

The ``torchft`` name must already be stepguard's (``STEPGUARD_TORCHFT=1``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import titan_shim  # noqa: E402

titan_shim.install()

import torch  # noqa: E402

from stepguard.launch.worker import report, stop_step  # noqa: E402


def _digest(t: torch.Tensor) -> str:
    if hasattr(t, "to_local"):  # a DTensor sharded by FSDP: this rank's shard
        t = t.to_local()
    t = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def _optim_digests(trainer) -> tuple[dict[str, str], list[str]]:
    """Digests of the optimizer state, and the state tensors that are
    DTensors on another mesh than their parameter's (healed with the
    sender's mesh, whose process groups do not exist in this process)."""
    out: dict[str, str] = {}
    foreign: list[str] = []
    names = {id(p): n for m in trainer.model_parts for n, p in m.named_parameters()}
    for i, opt in enumerate(trainer.optimizers.optimizers):
        for p, st in opt.state.items():
            for k, v in sorted(st.items()):
                if isinstance(v, torch.Tensor):
                    key = f"{i}.{names.get(id(p), '?')}.{k}"
                    out[key] = _digest(v)
                    mesh = getattr(v, "device_mesh", None)
                    if mesh is not None and mesh is not getattr(p, "device_mesh", None):
                        foreign.append(key)
    return out, foreign


def _dump(trainer, out_dir: Path) -> None:
    """This rank's shard of every parameter and optimizer-state tensor, hashed.

    No collective: FSDP shards each parameter the same way in every group, so
    group rank r of one group holds the same slice as group rank r of
    another, and comparing the files rank by rank compares the full tensors.
    """
    manager = trainer.ft_manager.manager if trainer.ft_manager.enabled else None
    optim, foreign = _optim_digests(trainer)
    rec = {
        "step": trainer.step,
        "manager_step": manager.current_step() if manager is not None else None,
        "params": {
            n: _digest(p) for m in trainer.model_parts for n, p in m.named_parameters()
        },
        "optim": optim,
        "optim_foreign_mesh": foreign,
        "lr": [g["lr"] for opt in trainer.optimizers.optimizers for g in opt.param_groups],
    }
    group = os.environ.get("REPLICA_GROUP_ID", "0")
    rank = os.environ.get("RANK", "0")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"params_g{group}_r{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=0, sort_keys=True))
    os.replace(tmp, path)


def _hook(out_dir: Path) -> None:
    from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer

    base_train = FaultTolerantTrainer.train
    base_step = FaultTolerantTrainer.train_step
    base_continue = FaultTolerantTrainer.should_continue_training

    def manager_of(self):
        return self.ft_manager.manager if self.ft_manager.enabled else None

    def watch_commits(self) -> dict:
        # the last should_commit() answer of this rank's Manager, per step
        if getattr(self, "_sg_votes", None) is None:
            self._sg_votes = {"vote": None}
            manager = manager_of(self)
            if manager is not None:
                inner = manager.should_commit

                def should_commit(*args, **kwargs):
                    ok = inner(*args, **kwargs)
                    self._sg_votes["vote"] = bool(ok)
                    return ok

                manager.should_commit = should_commit
        return self._sg_votes

    def train(self):
        watch_commits(self)
        report("ready", step=self.step)
        base_train(self)
        _dump(self, out_dir)

    def train_step(self, data_iterator):
        votes = watch_commits(self)
        votes["vote"] = None
        base_step(self, data_iterator)
        if votes["vote"] is None:
            return  # a DiLoCo inner step: no quorum, nothing to commit
        manager = manager_of(self)
        report(
            "step",
            step=self.step,
            manager_step=manager.current_step(),
            committed=votes["vote"],
            participants=manager.num_participants(),
            quorum_id=getattr(manager, "_quorum_id", None),
        )

    def should_continue_training(self) -> bool:
        stop = stop_step()
        if stop is not None and self.step >= stop:
            return False
        return base_continue(self)

    FaultTolerantTrainer.train = train
    FaultTolerantTrainer.train_step = train_step
    FaultTolerantTrainer.should_continue_training = should_continue_training


def _ft_flags(args: list[str]) -> list[str]:
    """torchtitan's FT identity flags from the launcher's environment.

    Every group runs the same command line; the replica id
    (``REPLICA_GROUP_ID``) and the number of groups
    (``NUM_REPLICA_GROUPS``, torchtitan's ``group_size``, which it uses to
    split the data) are added unless the command line has them.
    """
    extra = []
    if not any(a.startswith("--fault_tolerance.replica_id") for a in args):
        extra += ["--fault_tolerance.replica_id", os.environ.get("REPLICA_GROUP_ID", "0")]
    if not any(a.startswith("--fault_tolerance.group_size") for a in args):
        extra += ["--fault_tolerance.group_size", os.environ.get("NUM_REPLICA_GROUPS", "1")]
    return args + extra


def main() -> None:
    out_dir = Path(sys.argv[1])
    sys.argv = [sys.argv[0], *_ft_flags(sys.argv[2:])]
    _hook(out_dir)
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    main()
