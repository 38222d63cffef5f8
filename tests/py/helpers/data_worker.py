"""One trainer (one group rank of one replica group) that reads a dataset of
``--samples`` samples through stepguard's ManagedDataLoader and logs, for
each step, the samples it was served, before its forward pass (event
``take``: the step, quorum id, participants, participant rank, committed
stream position, and per sample its epoch, index and the random draw it was
read with), then whether the step committed (event ``step``, with the
committed position after it).  It trains on past the epoch until the test
says when to stop: it exits once its committed position has passed one
epoch and it has reached the step written in ``DIR/stop_at``
(``Job.stop_at``), so that a replica that fell behind (stuck in a dead
quorum's collective until its deadline) still finds peers to heal from.
Run through the training harness (tests/py/helpers/train_harness.py,
``worker="data_worker"``).

    python data_worker.py --lighthouse ADDR --replica-id data_0 --dir DIR \
        --samples 900 --batch 3 [--data-workers 2] [--discard-at 5]

With ``--spare-sock PATH`` it is a warm spare (stepguard.spares): it
connects to that Unix socket, sets up everything that does not depend on
which replica group it is (torch, stepguard, model, optimizer, dataset,
the process group object, a TCPStore for its group), logs
``waiting`` (with the store's port) to ``DIR/events/{replica_id}.waiting.jsonl``
and waits in ``wait_for_takeover()``; the takeover message on the socket
names the group (``data_{REPLICA_GROUP_ID}``, incarnation
``STEPGUARD_INCARNATION``), whose event file it then writes as any trainer.
With ``--fixed-with-spares`` the Manager runs in
``WorldSizeMode.FIXED_WITH_SPARES`` (hot spares: replicas beyond
``--min-replica-size`` take part with zero weight).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from train_worker import (Log, child_pids, group_store, make_model, manager_kwargs, param_hash,
                          wait_file)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="stepguard")
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica-id", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--group-rank", type=int, default=0)
    ap.add_argument("--group-world-size", type=int, default=1)
    ap.add_argument("--incarnation", type=int, default=0)
    ap.add_argument("--samples", type=int, required=True)
    ap.add_argument("--batch", type=int, default=3, help="samples per rank per step")
    ap.add_argument("--data-workers", type=int, default=0)
    ap.add_argument("--sync-quorum", action="store_true")
    ap.add_argument("--min-replica-size", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--quorum-timeout", type=float, default=30.0)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--discard-at", type=int, default=-1,
                    help="report an error at this step once: the step is not committed")
    ap.add_argument("--mid-at", type=int, default=-1,
                    help="at this step (or the first one after it that this replica "
                    "takes part in), after the forward pass, log 'mid' and sleep "
                    "--mid-sleep")
    ap.add_argument("--mid-sleep", type=float, default=0.0)
    ap.add_argument("--fixed-with-spares", action="store_true")
    ap.add_argument("--spare-sock", default=None,
                    help="start as a warm spare waiting on this Unix socket")
    ap.add_argument("--spare-timeout", type=float, default=300.0)
    a = ap.parse_args(argv)
    a.no_init_sync = False
    a.same_init = False
    return a


def make_dataset(torch, n: int):
    class Samples(torch.utils.data.Dataset):
        """Sample i: features derived from i, a random draw (the kind of
        thing a random transform makes), and i itself."""

        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int):
            x = torch.full((8,), i / n) + 0.1 * torch.randn(8)
            return x, torch.randn(4), torch.tensor(i)

    return Samples()


def wait_as_spare(a: argparse.Namespace):
    """The warm spare's wait: connects to the harness's socket, sets up what
    does not depend on the group, waits for the takeover message and takes
    its identity.  Returns (store, store port, log)."""
    import socket

    import torch

    from stepguard.spares import wait_for_takeover

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(a.spare_sock)
    os.environ["STEPGUARD_SPARE_FD"] = str(sock.detach())  # closed by the takeover
    # a group's store, made before the group is known (the launcher's
    # spares have one too): the takeover message hands its port back
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                       wait_for_workers=False)
    waiting = Log(os.path.join(a.dir, "events", f"{a.replica_id}.waiting.jsonl"),
                  spare=a.replica_id)
    waiting("waiting", pid=os.getpid(), store_port=store.port)
    ident = wait_for_takeover(timeout=a.spare_timeout)
    a.replica_id = f"data_{ident.replica_group}"
    a.incarnation = int(os.environ["STEPGUARD_INCARNATION"])
    a.group_rank, a.group_world_size = ident.rank, ident.world_size
    log = Log(os.path.join(a.dir, "events",
                           f"{a.replica_id}.g{a.group_rank}.i{a.incarnation}.jsonl"),
              rid=a.replica_id, g=a.group_rank, inc=a.incarnation)
    waiting("takeover", rid=a.replica_id, inc=a.incarnation, waited_s=ident.waited_s)
    log("start", pid=os.getpid(), ppid=os.getppid(), spare=True, waited_s=ident.waited_s)
    return store, ident.store_port, log


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    for sub in ("events", "stores"):
        os.makedirs(os.path.join(a.dir, sub), exist_ok=True)
    if not a.spare_sock:
        log = Log(os.path.join(a.dir, "events",
                               f"{a.replica_id}.g{a.group_rank}.i{a.incarnation}.jsonl"),
                  rid=a.replica_id, g=a.group_rank, inc=a.incarnation)
        log("start", pid=os.getpid(), ppid=os.getppid())

    import torch

    import stepguard as ft
    from stepguard.data import DistributedSampler, ManagedDataLoader
    from stepguard.manager import WorldSizeMode

    torch.set_num_threads(1)
    # everything up to the Manager is what a warm spare sets up before it
    # knows its group (a spare's initial weights do not matter: it heals)
    model, inner_opt = make_model(a)
    dataset = make_dataset(torch, a.samples)
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=a.timeout))
    if a.spare_sock:
        store, store_port, log = wait_as_spare(a)
    else:
        store, store_port = group_store(a, a.group_rank)
    g = a.group_rank
    sampler = DistributedSampler(dataset, replica_rank=0, num_replica_groups=1, group_rank=g,
                                 num_replicas=a.group_world_size, shuffle=True, seed=17)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner_opt.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner_opt.load_state_dict(sd["optim"])

    kw = {}
    if a.fixed_with_spares:
        kw["world_size_mode"] = WorldSizeMode.FIXED_WITH_SPARES
    manager = ft.Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        use_async_quorum=not a.sync_quorum,
        **manager_kwargs(a, g, a.group_world_size, "127.0.0.1", store_port),
        **kw,
    )
    loader = ManagedDataLoader(manager, dataset, a.batch, sampler=sampler,
                               num_workers=a.data_workers)
    manager.register_state_dict_fn("data", loader.load_state_dict, loader.state_dict)
    ddp = ft.DistributedDataParallel(manager, model)
    opt = ft.Optimizer(manager, inner_opt)

    last = manager.current_step()
    first = True
    stop_file = os.path.join(a.dir, "stop_at")
    while loader.position() < a.samples or not (
            os.path.exists(stop_file)
            and manager.current_step() >= int(wait_file(stop_file, 1))):
        opt.zero_grad()  # starts the quorum
        x, y, idx = next(loader)
        sl = loader.last
        if first:  # the loader's worker processes run now: the harness kills them by pid
            log("ready", step=manager.current_step(), pid=os.getpid(),
                children=child_pids(os.getpid()))
            first = False
        step = manager.current_step()
        log("take", step=step, qid=getattr(manager, "_quorum_id", None),
            n=sl.participants, prank=sl.participant_rank, pos=sl.position,
            start=sl.start, idx=idx.tolist(), epoch=[k[0] for k in sl.keys],
            keys=[list(k) for k in sl.keys],
            draw=[round(float(v), 6) for v in x.sum(dim=1)])
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if 0 <= a.mid_at <= step:
            # the first step at or after --mid-at (a replica left out of
            # step mid_at's quorum heals past it); "mid" says which one
            log("mid", step=step, qid=getattr(manager, "_quorum_id", None))
            a.mid_at = -1
            time.sleep(a.mid_sleep)
        loss.backward()
        if 0 <= a.discard_at == step:  # a failed heal leaves step -1, the "off" value
            manager.report_error(RuntimeError("injected discard"))
            a.discard_at = -1
        before = manager.current_step()
        opt.step()  # should_commit
        after = manager.current_step()
        log("step", before=before, step=after, ok=after == before + 1,
            healed=before != last, n=manager.num_participants(),
            prank=manager.participating_rank(), batches=manager.batches_committed(),
            qid=getattr(manager, "_quorum_id", None), pos=loader.position(),
            hash=param_hash(model))
        last = after
        if a.step_sleep:
            time.sleep(a.step_sleep)
    log("done", step=manager.current_step(), pos=loader.position(), hash=param_hash(model))
    loader.close()
    manager.shutdown(wait=False)
    del store
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
