"""Train a small Llama-style model with per-step fault tolerance.

Written against torchft's API.  ``--impl stepguard`` (the default) runs it on
``import stepguard as torchft``; ``--impl torchft`` on the installed torchft,
for side-by-side numbers; ``--plain`` on plain ``torch.distributed`` DDP (no
fault tolerance) as the step-time baseline.

Run it under the launcher, one replica group per process group of ranks::

    python -m stepguard.launch --groups 3 --inject kill:every=20s \\
        examples/train_llama.py --steps 500

Under ``--spares N`` the launcher also starts warm spares: trainers that
do all the setup below up to the Manager, then wait in
``stepguard.spares.wait_for_takeover`` until they are told which replica
group to become (see ``docs/spares.md``).

Its data: by default each step's batch is drawn from (step, replica group),
so a replacement reads the stream of the group it replaces.  With ``--data
loader`` (stepguard only) the corpus is a dataset of windows read through
``stepguard.data.ManagedDataLoader``, whose position is committed state: one
epoch's committed steps read every window exactly once, whatever dies, heals
or takes over (``docs/data.md``); each rank reports the samples of every
batch it reads (event ``batch``: step, stream position, participants, its
participant rank, the (epoch, index) of each sample) before its forward pass.

Each rank reports every step (committed or discarded, loss, quorum,
participants, time) to the launcher's timeline, stops at ``--steps``,
``--epochs`` or at the step the launcher asks for, and with ``--save-dir``
writes its final parameters there for a bit-for-bit comparison across
replicas.
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
from llama_model import (CorpusWindows, Llama, LlamaConfig, batch_at,  # noqa: E402
                         num_parameters, stdlib_corpus)

from stepguard.launch import report, stop_step  # noqa: E402
from stepguard.spares import is_spare, wait_for_takeover  # noqa: E402

log = logging.getLogger("train_llama")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=("stepguard", "torchft"), default="stepguard")
    p.add_argument("--plain", action="store_true",
                   help="plain torch DDP over all ranks (no fault tolerance)")
    p.add_argument("--steps", type=int, default=0, help="stop at this step (0: never)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--world-size-mode", choices=("dynamic", "fixed_with_spares"),
                   default="dynamic",
                   help="fixed_with_spares: at most --min-replicas replicas take part, the "
                   "others are hot spares that train along with zero weight")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="manager timeout in seconds (commit, recovery, collectives)")
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument("--pg-timeout", type=float, default=10.0)
    p.add_argument("--pg", choices=("gloo", "tcp"), default="gloo",
                   help="cross-replica process group: gloo (torchft's "
                   "ProcessGroupGloo), or tcp (stepguard's native ProcessGroupTCP, "
                   "which notices a dead peer at once; stepguard only)")
    p.add_argument("--fsdp", action="store_true",
                   help="FT-HSDP: FSDP2 over the ranks of this replica group (Gloo), "
                   "stepguard's Manager across groups (stepguard.hsdp)")
    p.add_argument("--step-sleep", type=float, default=0.0, metavar="SECONDS",
                   help="sleep this long after each step (paces tiny models in tests)")
    p.add_argument("--data", choices=("keyed", "loader"), default="keyed",
                   help="keyed: each step's batch drawn from (step, group); loader: "
                   "stepguard.data.ManagedDataLoader over the corpus's windows, its position "
                   "committed state (stepguard only)")
    p.add_argument("--samples", type=int, default=0,
                   help="--data loader: the dataset's length (0: every window of the corpus)")
    p.add_argument("--data-workers", type=int, default=0,
                   help="--data loader: the loader's worker processes")
    p.add_argument("--epochs", type=int, default=0,
                   help="--data loader: stop once the committed steps have read this many "
                   "epochs (0: never)")
    p.add_argument("--save-dir", default=None,
                   help="write the final parameters to SAVE_DIR/params_g{group}_r{rank}.pt")
    args = p.parse_args(argv)
    if args.data == "loader" and (args.plain or args.impl != "stepguard"):
        p.error("--data loader needs stepguard's Manager (--impl stepguard, not --plain)")
    return args


def load_impl(name: str):
    """The torchft-API module: stepguard (as torchft) or torchft itself."""
    ft = importlib.import_module(name)
    missing = [n for n in ("Manager", "DistributedDataParallel", "Optimizer",
                           "ProcessGroupGloo") if not hasattr(ft, n)]
    if missing:
        raise SystemExit(f"{name} does not provide {', '.join(missing)} yet; "
                         "run with --impl torchft")
    return ft


def shard_in_group(model: torch.nn.Module, manager, world: int, rank: int,
                   args: argparse.Namespace) -> torch.nn.Module:
    """FSDP2 over this replica group's ranks (its own Gloo group on the
    group's store), gradients averaged across groups by the Manager."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import stepguard

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world, False, timedelta(seconds=60))
    # longer than a cross-group operation can hold a group mate away
    dist.init_process_group("gloo", store=dist.PrefixStore("fsdp", store), rank=rank,
                            world_size=world,
                            timeout=timedelta(seconds=3 * args.timeout + 30))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    stepguard.hsdp.replicate(model, manager)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor is gathered over the group)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda \
        else torch.device("cpu")

    corpus = stdlib_corpus()
    cfg = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      hidden_dim=args.hidden, max_seq_len=max(args.seq_len, 16))
    torch.manual_seed(args.seed)  # every replica starts from the same weights
    model = Llama(cfg).to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if rank == 0:
        log.info("%s: %.2f M parameters, %d corpus bytes, device %s",
                 "warm spare" if is_spare() else f"group {group}",
                 num_parameters(model) / 1e6, corpus.numel(), device)

    if is_spare():
        # A warm spare also runs one forward and backward pass (gradients
        # dropped, weights untouched: the heal replaces them anyway), so
        # that the first step after its takeover runs at full speed.
        inputs, targets = batch_at(corpus, 0, 0, args.batch_size, args.seq_len, args.seed)
        logits = model(inputs.to(device))
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.to(device).reshape(-1)
                        ).backward()
        model.zero_grad(set_to_none=True)
    report("ready")  # imports, corpus and model are done
    manager = loader = None
    if args.plain:
        import torch.distributed as dist

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              world, False, timedelta(seconds=60))
        dist.init_process_group("nccl" if use_cuda else "gloo", store=store,
                                rank=rank, world_size=world)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optim = inner
        stream = rank
    else:
        ft = load_impl(args.impl)

        def load_state(sd: dict) -> None:
            model.load_state_dict(sd["model"])
            inner.load_state_dict(sd["optim"])

        def save_state() -> dict:
            return {"model": model.state_dict(), "optim": inner.state_dict()}

        # the cross-replica process group object (configured per quorum)
        if args.pg == "tcp":
            if args.impl != "stepguard":
                raise SystemExit("--pg tcp needs --impl stepguard")
            from stepguard.process_group import ProcessGroupTCP

            pg = ProcessGroupTCP(timeout=timedelta(seconds=args.pg_timeout))
        elif use_cuda:
            pg = ft.ProcessGroupNCCL(timeout=timedelta(seconds=args.pg_timeout))
        else:
            pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout))
        # A warm spare waits here, set up but unknown to the lighthouse,
        # until it takes over a lost group's identity; others go on at once.
        ident = wait_for_takeover()
        group, rank, world = ident.replica_group, ident.rank, ident.world_size
        modes = importlib.import_module(f"{args.impl}.manager").WorldSizeMode
        mode = modes.FIXED_WITH_SPARES if args.world_size_mode == "fixed_with_spares" \
            else modes.DYNAMIC
        manager = ft.Manager(
            pg=pg,
            min_replica_size=args.min_replicas,
            world_size_mode=mode,
            load_state_dict=load_state,
            state_dict=save_state,
            replica_id=f"train_llama_{group}",
            timeout=timedelta(seconds=args.timeout),
            quorum_timeout=timedelta(seconds=args.quorum_timeout),
            connect_timeout=timedelta(seconds=30),
        )
        if args.fsdp:
            ddp = shard_in_group(model, manager, world, rank, args)
        else:
            ddp = ft.DistributedDataParallel(manager, model)
        optim = ft.Optimizer(manager, inner)
        stream = group * world + rank
        if args.data == "loader":
            from stepguard.data import DistributedSampler, ManagedDataLoader

            dataset = CorpusWindows(corpus, args.seq_len, args.samples)
            # the order and this rank's place in its group; the quorum
            # decides the rest (docs/data.md)
            sampler = DistributedSampler(dataset, replica_rank=0, num_replica_groups=1,
                                         group_rank=rank, num_replicas=world, shuffle=True,
                                         seed=args.seed)
            loader = ManagedDataLoader(manager, dataset, args.batch_size, sampler=sampler,
                                       num_workers=args.data_workers)
            # a healer receives the position with the parameters
            manager.register_state_dict_fn("data", loader.load_state_dict, loader.state_dict)

    step = 0
    while True:
        current = manager.current_step() if manager is not None else step
        stop = stop_step()
        if (args.steps and current >= args.steps) or (stop is not None and current >= stop) \
                or (loader is not None and args.epochs and loader.epoch >= args.epochs):
            break
        t0 = time.time()
        optim.zero_grad()  # starts the quorum under fault tolerance
        if loader is not None:
            # this rank's slice of the step's global batch, from the
            # committed position (waits for the quorum)
            inputs, targets = next(loader)
            current, sl = manager.current_step(), loader.last
            report("batch", step=current, pos=sl.position, n=sl.participants,
                   prank=sl.participant_rank, keys=[list(k) for k in sl.keys])
        else:
            if manager is not None:
                # The batch depends on the step the quorum settles on, so a
                # healed replica continues the same data stream as the others.
                current = manager.current_step()
            inputs, targets = batch_at(corpus, current, stream, args.batch_size,
                                       args.seq_len, args.seed)
        inputs, targets = inputs.to(device), targets.to(device)
        logits = ddp(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        if manager is None:
            optim.step()
            committed, healed, quorum_id, participants = True, False, None, world
            step += 1
        else:
            before = manager.current_step()
            healed = before != current
            optim.step()  # commits only if every replica agreed
            committed = manager.current_step() == before + 1
            quorum_id = getattr(manager, "_quorum_id", None)
            participants = manager.num_participants()
        report("step", step=before if manager is not None else step - 1,
               committed=committed, loss=round(loss.item(), 5), healed=healed,
               quorum_id=quorum_id, participants=participants,
               step_time=round(time.time() - t0, 6))
        if args.step_sleep > 0:
            time.sleep(args.step_sleep)

    final = manager.current_step() if manager is not None else step
    if args.save_dir:
        out = Path(args.save_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".params_g{group}_r{rank}.pt.tmp"
        torch.save({"step": final, "params": {k: full(v).detach().cpu() for k, v in
                                              model.state_dict().items()}}, tmp)
        os.replace(tmp, out / f"params_g{group}_r{rank}.pt")
    report("finished", step=final)
    if loader is not None:
        loader.close()
    if manager is not None:
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
