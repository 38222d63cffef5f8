"""One trainer process for the LocalSGD / DiLoCo scenarios, written against
torchft's API so that the same script runs on torchft and on stepguard.

    python local_sgd_worker.py --impl stepguard|torchft --lighthouse ADDR \
        --replica-id train_0 --dir DIR --algo localsgd|diloco [options]

It takes the arguments train_harness.py gives train_worker.py and
writes the same events (``DIR/events/{rid}.g{rank}.i{inc}.jsonl``), one
``step`` event per sync (the Manager's step), so the harness's Job drives
it unchanged.  The ``hash`` of a step event is what replicas must agree on
after a sync: the model parameters for LocalSGD, the global state for
DiLoCo (every fragment's global parameters and outer optimizer state; the
model itself may hold local progress).

``python local_sgd_worker.py IMPL`` is the fork server (train_zygote.py)
serving this script instead of train_worker.py.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import sys
import time
from datetime import timedelta
from typing import Any

import train_worker
from train_worker import (Log, group_store, make_model, manager_kwargs,
                          param_hash, replica_index, wait_file)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica-id", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--group-rank", type=int, default=0)
    ap.add_argument("--group-world-size", type=int, default=1)
    ap.add_argument("--incarnation", type=int, default=0)
    ap.add_argument("--algo", choices=("localsgd", "diloco"), required=True)
    ap.add_argument("--steps", type=int, default=10,
                    help="exit after this many committed syncs (Manager steps), "
                    "or at the step written in DIR/stop_at")
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--delay", type=int, default=0, help="fragment_sync_delay")
    ap.add_argument("--alpha", type=float, default=0.0, help="fragment_update_alpha")
    ap.add_argument("--bucket", action="store_true", help="use_bucketization")
    ap.add_argument("--min-replica-size", type=int, default=1)
    ap.add_argument("--sync-quorum", action="store_true",
                    help="LocalSGD: synchronous quorum (DiLoCo always is)")
    ap.add_argument("--no-init-sync", action="store_true")
    ap.add_argument("--same-init", action="store_true")
    ap.add_argument("--pg", choices=("gloo", "tcp"), default="gloo")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--quorum-timeout", type=float, default=30.0)
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="sleep after every inner step")
    ap.add_argument("--hold-at", type=int, default=-1,
                    help="after the sync that commits this step, log 'hold' "
                    "and sleep --hold-sleep (between two syncs)")
    ap.add_argument("--hold-sleep", type=float, default=0.0)
    ap.add_argument("--quantize", action="store_true",
                    help="DiLoCo / LocalSGD with should_quantize=True")
    ap.add_argument("--advertise", default=None,
                    help="STEPGUARD_QUANTIZE for this worker (\"\": advertise none)")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--task", choices=("noise", "linear"), default="noise",
                    help="linear: targets from a fixed linear map, and the "
                    "done event carries the loss on a fixed evaluation set")
    return ap.parse_args(argv)


def global_hash(diloco: Any) -> str:
    """Hash of DiLoCo's global state: each fragment's global parameters and
    its outer optimizer's tensors."""
    h = hashlib.sha256()
    for frag in diloco._fragments:
        for name in sorted(frag.original_parameters):
            h.update(frag.original_parameters[name].contiguous().numpy().tobytes())
        state = frag._outer_optimizer.state_dict()["state"]
        for key in sorted(state):
            for k in sorted(state[key]):
                v = state[key][k]
                if hasattr(v, "numpy"):
                    h.update(v.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    for sub in ("events", "stores"):
        os.makedirs(os.path.join(a.dir, sub), exist_ok=True)
    log = Log(os.path.join(a.dir, "events",
                           f"{a.replica_id}.g{a.group_rank}.i{a.incarnation}.jsonl"),
              rid=a.replica_id, g=a.group_rank, inc=a.incarnation)
    log("start", pid=os.getpid(), ppid=os.getppid(), torchrun=False)

    if a.advertise is not None:
        os.environ["STEPGUARD_QUANTIZE"] = a.advertise
    import torch

    torch.set_num_threads(1)
    ft = importlib.import_module(a.impl)
    local_sgd = importlib.import_module(a.impl + ".local_sgd")

    store, store_port = group_store(a, a.group_rank)

    rindex = replica_index(a.replica_id)
    model, inner_opt = make_model(a)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner_opt.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner_opt.load_state_dict(sd["optim"])
        log("loaded", step=manager.current_step())

    if a.pg == "tcp":
        pg = importlib.import_module(a.impl + ".process_group_tcp").ProcessGroupTCP(
            timeout=timedelta(seconds=a.timeout))
    else:
        pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=a.timeout))
    manager = ft.Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        use_async_quorum=a.algo == "localsgd" and not a.sync_quorum,
        **manager_kwargs(a, a.group_rank, a.group_world_size, "127.0.0.1",
                         store_port),
    )

    # the commit votes the algorithm casts (one per sync)
    votes: list[bool] = []
    vote = manager.should_commit

    def should_commit(*args: Any, **kw: Any) -> bool:
        ok = vote(*args, **kw)
        votes.append(ok)
        return ok

    manager.should_commit = should_commit

    # quantized allreduces the process group ran (stepguard's TCP group)
    qcalls = [0]
    if hasattr(pg, "allreduce_quantized"):
        run_quantized = pg.allreduce_quantized

        def counted(*args: Any, **kw: Any) -> Any:
            qcalls[0] += 1
            return run_quantized(*args, **kw)

        pg.allreduce_quantized = counted
    quant = {"should_quantize": True} if a.quantize else {}
    if a.algo == "localsgd":
        algo = local_sgd.LocalSGD(manager, model, inner_opt, sync_every=a.sync_every,
                                  **quant)

        def synced_hash() -> str:
            return param_hash(model)
    else:
        n = a.fragments
        bounds = [0, 2, 3] if n == 2 else [0, 3]
        fragments = [model[bounds[i]:bounds[i + 1]] for i in range(n)]
        outers = [torch.optim.SGD(f.parameters(), lr=a.outer_lr, momentum=a.outer_momentum,
                                  nesterov=True)
                  for f in fragments]
        algo = local_sgd.DiLoCo(manager, fragments, inner_opt,
                                outers if n > 1 else outers[0],
                                sync_every=a.sync_every, use_bucketization=a.bucket,
                                fragment_sync_delay=a.delay,
                                fragment_update_alpha=a.alpha, **quant)

        def synced_hash() -> str:
            return global_hash(algo)

    log("ready", step=manager.current_step(), hash=synced_hash(), pid=os.getpid(),
        children=[])
    target = 0.3 * torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    xe = torch.randn(512, 8, generator=torch.Generator().manual_seed(99))

    def eval_loss() -> float:
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(xe), xe @ target).item()

    loss0 = eval_loss()
    stop_file = os.path.join(a.dir, "stop_at")
    inner = 0
    last = manager.current_step()
    with algo:
        while manager.current_step() < a.steps:
            if os.path.exists(stop_file) and \
                    manager.current_step() >= int(wait_file(stop_file, 1)):
                break
            gen = torch.Generator().manual_seed(
                (rindex * 1000 + a.group_rank) * 100003 + inner)
            x = torch.randn(16, 8, generator=gen)
            y = torch.randn(16, 4, generator=gen)
            if a.task == "linear":
                y = x @ target + 0.01 * y
            inner_opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            before = manager.current_step()
            votes.clear()
            inner_opt.step()  # the hooks sync when it is time
            inner += 1
            if votes:
                after = manager.current_step()
                log("step", before=before, step=after, ok=votes[-1],
                    healed=before != last, inner=inner,
                    n=manager.num_participants(), prank=manager.participating_rank(),
                    qid=getattr(manager, "_quorum_id", None),
                    hash=synced_hash(), model=param_hash(model),
                    err=None if manager.errored() is None
                    else str(manager.errored()).splitlines()[0][:200])
                last = after
                if votes[-1] and 0 <= a.hold_at == after:  # -1 is "off"
                    log("hold", step=after)
                    time.sleep(a.hold_sleep)
            if a.step_sleep:
                time.sleep(a.step_sleep)
    extra: dict[str, Any] = {"qcalls": qcalls[0]}
    if hasattr(pg, "quantized_format"):
        extra["qfmt"] = pg.quantized_format()[0]
    if a.task == "linear":
        extra.update(loss0=loss0, loss=eval_loss())
    log("done", step=manager.current_step(), hash=synced_hash(), model=param_hash(model),
        **extra)
    manager.shutdown(wait=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _zygote(impl: str) -> int:
    """train_zygote.py's fork server, forking this script's main."""
    import train_zygote

    importlib.import_module(impl + ".local_sgd")
    sys.modules["train_worker"] = sys.modules[__name__]
    sys.argv = [sys.argv[0], impl]
    return train_zygote.main()


if __name__ == "__main__":
    if len(sys.argv) == 2 and not sys.argv[1].startswith("-"):
        sys.exit(_zygote(sys.argv[1]))
    sys.exit(main())
