"""One trainer process (one group rank of one replica group) for the FT-HSDP
scenarios: FSDP2 ``fully_shard`` over the ranks of the group (Gloo, CPU),
the Manager across groups, as a user writes it with stepguard's API.

    python hsdp_worker.py --impl stepguard --lighthouse ADDR \
        --replica-id hsdp_0 --dir DIR --group-rank R --group-world-size W

Events are JSON lines as train_worker.py writes them (same file names, read
by the same harness).  The ``step`` event's ``hash`` is over the full,
unsharded parameters and optimizer state (gathered over the group after the
step), so groups of any size compare equal when their states are.

Fault hooks (``stepguard.manager.set_heal_hook``): ``--pause-at POINT``
makes this rank write ``DIR/paused.{rid}.g{rank}`` when it reaches POINT of
a heal and wait until ``DIR/resume`` exists, so a test can kill a process
at exactly that moment.  ``--forward-sleep S`` sleeps inside the forward
pass of every step after the first (while FSDP's parameters are
unsharded), so a peer's heal overlaps this rank's forward.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from train_worker import Log, group_store, manager_kwargs, replica_index, wait_file


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="stepguard")
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica-id", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--group-rank", type=int, required=True)
    ap.add_argument("--group-world-size", type=int, required=True)
    ap.add_argument("--incarnation", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--min-replica-size", type=int, default=1)
    ap.add_argument("--sync-quorum", action="store_true")
    ap.add_argument("--no-init-sync", action="store_true")
    ap.add_argument("--pg", choices=("gloo", "tcp"), default="gloo")
    ap.add_argument("--transport", choices=("native", "http"), default="native")
    ap.add_argument("--wiring", choices=("helper", "torchft"), default="helper",
                    help="helper: stepguard.hsdp.replicate; torchft: "
                    "ManagedProcessGroup.register + set_all_reduce_hook by hand")
    ap.add_argument("--mixed-precision", action="store_true",
                    help="bf16 parameters, fp32 reduction")
    ap.add_argument("--algo", choices=("hsdp", "diloco", "localsgd"), default="hsdp")
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--quorum-timeout", type=float, default=30.0)
    ap.add_argument("--pause-at", default="",
                    help="a heal hook point: fetch, fetched, serve, loaded")
    ap.add_argument("--forward-sleep", type=float, default=0.0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the model, its shards and the batches on the GPU, "
                    "NCCL inside the group (one rank per group on one GPU)")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--no-hash", action="store_true",
                    help="log no state hash (a collective per step: the bench leaves it out)")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--read-state-anywhere", action="store_true",
                    help="let the Manager read the state on its quorum thread "
                    "(the negative control of the safe-point test)")
    return ap.parse_args(argv)


class Model:
    """A small stack of layers, each its own FSDP unit."""

    @staticmethod
    def build(torch, width: int = 32, layers: int = 1):
        torch.manual_seed(0)
        mods = [torch.nn.Linear(8, width), torch.nn.Tanh()]
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
        return torch.nn.Sequential(*mods, torch.nn.Linear(width, 4))


def full_hash(torch, model, opt) -> str:
    """sha256 over the full parameters and optimizer state (a collective
    over the group: every rank calls it at the same point)."""
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(full(p.detach()).float().cpu().contiguous().numpy().tobytes())
    state = opt.state_dict()["state"]
    for idx in sorted(state):
        for key in sorted(state[idx]):
            v = state[idx][key]
            if isinstance(v, torch.Tensor):
                h.update(full(v).float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    rank, ws = a.group_rank, a.group_world_size
    for sub in ("events", "stores"):
        os.makedirs(os.path.join(a.dir, sub), exist_ok=True)
    log = Log(os.path.join(a.dir, "events", f"{a.replica_id}.g{rank}.i{a.incarnation}.jsonl"),
              rid=a.replica_id, g=rank, inc=a.incarnation)
    log("start", pid=os.getpid(), ppid=os.getppid(), torchrun=False)

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    ft = importlib.import_module(a.impl)  # stepguard, or torchft (bench/hsdp.py)
    mgr_mod = importlib.import_module(f"{a.impl}.manager")
    HTTPTransport = importlib.import_module(f"{a.impl}.checkpointing").HTTPTransport
    ManagedProcessGroup = importlib.import_module(f"{a.impl}.process_group").ManagedProcessGroup
    if a.impl != "stepguard":
        a.wiring = "torchft"  # torchft has no stepguard.hsdp

    torch.set_num_threads(1)
    store, port = group_store(a, rank)
    # the group's own default process group, for FSDP inside the group
    client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    if a.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl" if a.device == "cuda" else "gloo",
                            store=dist.PrefixStore(f"fsdp/{a.incarnation}", client),
                            rank=rank, world_size=ws,
                            # longer than a cross-group operation can keep a
                            # group mate away (its timeout, and a quorum)
                            timeout=timedelta(seconds=3 * a.timeout + 30))
    mesh = init_device_mesh(a.device, (ws,))

    model = Model.build(torch, a.width, a.layers).to(a.device)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if a.mixed_precision else MixedPrecisionPolicy())
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    if a.algo != "hsdp":
        inner = torch.optim.SGD(model.parameters(), lr=0.05)

    if a.pause_at:
        paused = os.path.join(a.dir, f"paused.{a.replica_id}.g{rank}")

        def hook(point: str, manager: Any) -> None:
            if point == a.pause_at and not os.path.exists(paused):
                log("paused", point=point, step=manager.current_step())
                with open(paused, "w") as f:
                    f.write(point)
                wait_file(os.path.join(a.dir, "resume"), 120)

        mgr_mod.set_heal_hook(hook)

    # set from the forward pass's start until the backward pass returns: the
    # state must never be read then (FSDP's parameters may be unsharded)
    in_compute = threading.Event()

    loaded = [-1]  # the step of the last state loaded (a heal)

    def state_dict() -> dict:
        if in_compute.is_set():
            log("unsafe_read", thread=threading.current_thread().name,
                step=manager.current_step())
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        loaded[0] = manager.current_step()
        log("loaded", step=loaded[0])

    timeout = timedelta(seconds=a.timeout)
    if a.pg == "tcp":
        from stepguard.process_group import ProcessGroupTCP

        pg = ProcessGroupTCP(timeout=timeout)
    else:
        pg = ft.ProcessGroupGloo(timeout=timeout)
    kw: dict[str, Any] = {}
    if a.transport == "http":
        kw["checkpoint_transport"] = HTTPTransport(timeout=timeout, num_chunks=0)
    manager = ft.Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
                         use_async_quorum=not (a.sync_quorum or a.algo == "diloco"),
                         **manager_kwargs(a, rank, ws, "127.0.0.1", port), **kw)

    replicate = None
    if a.algo != "hsdp":
        # LocalSGD/DiLoCo average parameters (or pseudo-gradients) at their
        # syncs, not gradients at every step: no all-reduce hook
        pass
    elif a.wiring == "helper":
        replicate = ft.hsdp.replicate(model, manager)
    else:
        replicate = ManagedProcessGroup(manager).register("dp_replicate")

        def all_reduce_hook(grad: torch.Tensor) -> None:
            dist.all_reduce(grad, group=replicate, op=dist.ReduceOp.AVG)

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_all_reduce_hook(all_reduce_hook)

    if a.read_state_anywhere:
        # the negative control: reads wherever the quorum runs (torchft's way)
        manager._read_state_on_training_thread = False
    model.register_forward_pre_hook(lambda m, args: in_compute.set())

    outer = None
    if a.algo == "hsdp":
        opt = ft.Optimizer(manager, inner)
    elif a.algo == "diloco":
        outer_opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        outer = ft.local_sgd.DiLoCo(manager, [model], inner, outer_opt, sync_every=2)
        opt = inner
    else:
        outer = ft.local_sgd.LocalSGD(manager, model, inner, sync_every=2)
        opt = inner
    if outer is not None:
        outer.__enter__()

    if a.forward_sleep:
        def slow_forward(module: Any, args: Any) -> None:
            if manager.current_step() > 0:
                time.sleep(a.forward_sleep)

        model[2].register_forward_pre_hook(slow_forward)

    rindex = replica_index(a.replica_id)
    log("ready", step=manager.current_step(), pid=os.getpid(), children=[])
    stop_file = os.path.join(a.dir, "stop_at")
    last = manager.current_step()
    local = 0
    while manager.current_step() < a.steps:
        if os.path.exists(stop_file) and manager.current_step() >= int(wait_file(stop_file, 1)):
            break
        gen = torch.Generator().manual_seed((rindex * 1000 + rank) * 100003
                                            + manager.current_step() * 7 + local)
        x = torch.randn(a.batch, 8, generator=gen)
        y = torch.randn(a.batch, 4, generator=gen)
        x, y = x.to(a.device), y.to(a.device)
        opt.zero_grad()  # the quorum starts (hsdp)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()  # reduce-scatter in the group, allreduce across
        in_compute.clear()
        before = manager.current_step()
        extra: dict[str, Any] = {}
        if a.algo == "hsdp":
            # a loss averaged over the replicas, as torchtitan reduces it
            total = funcol.all_reduce(torch.tensor([float(rindex + 1)]), "sum", replicate)
            top = funcol.all_reduce(torch.tensor([float(rindex + 1)]), "max", replicate)
            extra = dict(sum=float(total[0]), max=float(top[0]),
                         healing=not manager.is_participating())
        opt.step()  # should_commit (hsdp), or a local step (+ a sync every 2)
        local += 1
        after = manager.current_step()
        if a.algo != "hsdp" and after == before:
            continue  # a local step: nothing to compare
        err = manager.errored()
        # (``before`` is read before should_commit, which loads a heal: then
        # the step to commit is the one loaded)
        base = loaded[0] if loaded[0] >= 0 else before
        loaded[0] = -1
        log("step", before=before, step=after, ok=after == base + 1,
            healed=before != last or base != before,
            n=manager.num_participants(),
            qid=getattr(manager, "_quorum_id", None),
            hash="" if a.no_hash else full_hash(torch, model, inner),
            err=None if err is None else str(err).splitlines()[0][:200], **extra)
        last = after
        if a.step_sleep:
            time.sleep(a.step_sleep)
    log("done", step=manager.current_step())
    if outer is not None:
        outer.__exit__(None, None, None)
    manager.shutdown(wait=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
