"""The smallest fault-tolerant DDP training loop, on CPU.

A torchft script: by default it runs on ``import stepguard as torchft``;
``--impl torchft`` runs the same code on the installed torchft.  Start a few
replica groups with the launcher and kill one now and then::

    python -m stepguard.launch --groups 2 --inject kill:every=15s \\
        examples/train_ddp.py --steps 300

The model is a small MLP fitting a fixed random linear map; every replica
reads its own synthetic batches.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from datetime import timedelta

import torch
from torch import nn

from stepguard.launch import report, stop_step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="minimal fault-tolerant DDP")
    p.add_argument("--impl", choices=("stepguard", "torchft"), default="stepguard")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    torchft = importlib.import_module(args.impl)
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))

    torch.manual_seed(0)  # the same initial weights in every replica
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    target = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def load_state(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def save_state() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=load_state,
        state_dict=save_state,
        replica_id=f"train_ddp_{group}",
        timeout=timedelta(seconds=30),
    )
    ddp = torchft.DistributedDataParallel(manager, model)
    optim = torchft.Optimizer(manager, inner)

    while True:
        step = manager.current_step()
        stop = stop_step()
        if step >= args.steps or (stop is not None and step >= stop):
            break
        gen = torch.Generator().manual_seed(1000 * group + step)
        x = torch.randn(args.batch_size, 32, generator=gen)
        optim.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), x @ target)
        loss.backward()
        before = manager.current_step()
        optim.step()
        report("step", step=before, committed=manager.current_step() == before + 1,
               loss=round(loss.item(), 6), quorum_id=getattr(manager, "_quorum_id", None),
               participants=manager.num_participants())
        if step % 10 == 0:
            logging.info("group %d step %d loss %.4f participants %d", group, step,
                         loss.item(), manager.num_participants())
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
