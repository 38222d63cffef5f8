"""The chaos soak's trainer: a small Llama, every step logged for the checker.

Like ``train_llama.py`` (stepguard's Manager, DDP and Optimizer, or
torchft's with ``--impl torchft``), plus, for ``python -m stepguard.soak``:

- every rank writes a step log (:mod:`stepguard.soak.steplog`) to
  ``--log-dir``: after each step the hash of its parameters and optimizer
  state, the quorum it saw, and for a heal the hash of what it loaded;
- fault points the launcher arms (:func:`stepguard.launch.worker.hook_point`):
  ``serve`` (a recovery source, before it reads its state for a healer) and
  ``after_heal`` (mid-way through the first step after a heal, after the
  backward pass), reached through ``stepguard.manager.set_heal_hook``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_model import Llama, LlamaConfig, batch_at, stdlib_corpus  # noqa: E402

from stepguard.launch import report, stop_step  # noqa: E402
from stepguard.launch.worker import hook_point  # noqa: E402
from stepguard.soak.steplog import StepLog  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=("stepguard", "torchft"), default="stepguard")
    p.add_argument("--log-dir", required=True, help="step logs go here")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--min-replicas", type=int, default=2)
    p.add_argument("--timeout", type=float, default=4.0,
                   help="manager timeout in seconds (commit, recovery, collectives)")
    p.add_argument("--quorum-timeout", type=float, default=30.0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    corpus = stdlib_corpus(1 << 20)
    cfg = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      hidden_dim=args.hidden, max_seq_len=max(args.seq_len, 16))
    torch.manual_seed(0)  # every replica starts from the same weights
    model = Llama(cfg)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    report("ready")
    ft = importlib.import_module(args.impl)

    def load_state(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def save_state() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    if args.impl == "stepguard":
        from stepguard.process_group import ProcessGroupTCP

        pg = ProcessGroupTCP(timeout=timedelta(seconds=args.timeout))
    else:
        pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=args.timeout))
    replica = f"soak_{group}"
    manager = ft.Manager(
        pg=pg, min_replica_size=args.min_replicas, load_state_dict=load_state,
        state_dict=save_state, replica_id=replica,
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        connect_timeout=timedelta(seconds=30),
    )
    slog = StepLog(args.log_dir, manager, save_state, replica)
    healed = {"now": False, "last_step": False}

    def heal_hook(point: str, mgr: object) -> None:
        if point == "serve":
            hook_point("serve", step=manager.current_step())
        elif point == "loaded":
            q = manager.last_quorum()
            src = None
            if q is not None and q.recover_src_replica_rank is not None \
                    and q.recover_src_replica_rank < len(q.replica_ids):
                src = q.replica_ids[q.recover_src_replica_rank].split(":", 1)[0]
            slog.healed(src)
            healed["now"] = True

    if args.impl == "stepguard":
        import stepguard.manager

        stepguard.manager.set_heal_hook(heal_hook)
    ddp = ft.DistributedDataParallel(manager, model)
    optim = ft.Optimizer(manager, inner)
    stream = group * world + rank

    while True:
        current = manager.current_step()
        stop = stop_step()
        if stop is not None and current >= stop:
            break
        t0 = time.time()
        optim.zero_grad()
        current = manager.current_step()
        inputs, targets = batch_at(corpus, current, stream, args.batch_size, args.seq_len, 0)
        logits = ddp(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        if healed["last_step"]:
            healed["last_step"] = False
            hook_point("after_heal", step=current)
        slog.before_commit()
        before = manager.current_step()
        optim.step()
        committed = manager.current_step() == before + 1
        slog.after_commit(committed)
        healed["last_step"], healed["now"] = healed["now"], False
        report("step", step=manager.current_step() - 1 if committed else before,
               committed=committed, loss=round(loss.item(), 5), healed=before != current,
               quorum_id=getattr(manager, "_quorum_id", None),
               participants=manager.num_participants(),
               step_time=round(time.time() - t0, 6))
        if args.step_sleep > 0:
            time.sleep(args.step_sleep)
    report("finished", step=manager.current_step())
    slog.close()
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
