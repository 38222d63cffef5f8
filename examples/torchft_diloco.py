"""Fault-tolerant DiLoCo written against torchft's API, run on stepguard.

The imports are torchft's: in torchft mode (``STEPGUARD_TORCHFT=1``, or
``stepguard-torchft``) they are stepguard.  Each replica takes
``--sync-every`` local AdamW steps, then the pseudo-gradients are averaged
across the replicas and applied by an outer Nesterov SGD; a restarted
replica heals over a :class:`PGTransport`, model, inner optimizer and the
outer state (DiLoCo registers its own)::

    stepguard-torchft stepguard-launch --groups 2 --inject kill:every=20s \\
        examples/torchft_diloco.py --steps 40

``--steps`` counts outer steps (syncs).  A replica stops only right after a
sync, so every replica that took part in the last one holds the same
parameters; ``--save-dir`` writes them to ``SAVE_DIR/params_g{group}_r{rank}.pt``.
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

from torchft import Manager, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport
from torchft.local_sgd import DiLoCo

from stepguard.launch import report, stop_step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="fault-tolerant DiLoCo in torchft's pattern")
    p.add_argument("--steps", type=int, default=20, help="outer steps")
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--save-dir", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    rank = int(os.environ.get("RANK", "0"))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    target = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    def load_state_dict(state_dict: dict) -> None:
        model.load_state_dict(state_dict["model"])
        inner.load_state_dict(state_dict["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    timeout = timedelta(seconds=30)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))  # also the transport's
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"torchft_diloco_{group}",
        timeout=timeout,
        use_async_quorum=False,
        checkpoint_transport=PGTransport(pg, timeout=timeout, device="cpu"),
    )
    report("ready", step=manager.current_step())

    local = 0
    with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every):
        while True:
            if local % args.sync_every == 0:  # right after a sync (or at the start)
                step = manager.current_step()
                stop = stop_step()
                if step >= args.steps or (stop is not None and step >= stop):
                    break
            before = manager.current_step()
            gen = torch.Generator().manual_seed(100003 * group + 7 * before + local)
            x = torch.randn(args.batch_size, 16, generator=gen)
            inner.zero_grad()
            loss = nn.functional.mse_loss(model(x), x @ target)
            loss.backward()
            inner.step()  # DiLoCo syncs on every sync_every-th step
            local += 1
            if local % args.sync_every == 0:
                report("step", step=before, committed=manager.current_step() == before + 1,
                       loss=round(loss.item(), 6),
                       participants=manager.num_participants())

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
