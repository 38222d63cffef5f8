"""Fault-tolerant DDP written against torchft's API, run on stepguard.

Nothing here names stepguard's training API: the imports are torchft's.
Run it in torchft mode (``STEPGUARD_TORCHFT=1``, or ``stepguard-torchft``)
and those imports are stepguard; without it they are the installed torchft.
Live recovery goes over a :class:`PGTransport` (the state is sent through a
second process group), as torchft's own DDP example does::

    stepguard-torchft stepguard-launch --groups 2 --inject kill:every=15s \\
        examples/torchft_ddp.py --steps 200

Synthetic data: each replica fits a fixed random linear map on its own
seeded batches.  With ``--save-dir`` each replica writes its final
parameters to ``SAVE_DIR/params_g{group}_r{rank}.pt``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport

from stepguard.launch import report, stop_step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="fault-tolerant DDP in torchft's pattern")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--save-dir", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    rank = int(os.environ.get("RANK", "0"))

    torch.manual_seed(0)  # the same initial weights in every replica
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    target = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    # AdamW: its state holds CPU scalars ("step") the transport must carry
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def load_state_dict(state_dict: dict) -> None:
        model.load_state_dict(state_dict["model"])
        inner.load_state_dict(state_dict["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    timeout = timedelta(seconds=30)
    # one process group: the Manager reconfigures it every quorum, and the
    # transport sends the state over it
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    transport = PGTransport(pg, timeout=timeout, device="cpu")
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"torchft_ddp_{group}",
        timeout=timeout,
        checkpoint_transport=transport,
    )
    ddp = DistributedDataParallel(manager, model)
    optim = Optimizer(manager, inner)
    report("ready", step=manager.current_step())

    while True:
        step = manager.current_step()
        stop = stop_step()
        if step >= args.steps or (stop is not None and step >= stop):
            break
        gen = torch.Generator().manual_seed(1000 * group + step)
        x = torch.randn(args.batch_size, 16, generator=gen)
        optim.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), x @ target)
        loss.backward()
        optim.step()
        report("step", step=step, committed=manager.current_step() == step + 1,
               loss=round(loss.item(), 6), participants=manager.num_participants())

    if args.save_dir:
        out = Path(args.save_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".params_g{group}_r{rank}.pt.tmp"
        torch.save({"step": manager.current_step(),
                    "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "optim": inner.state_dict()}, tmp)
        os.replace(tmp, out / f"params_g{group}_r{rank}.pt")
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
