"""One trainer process (one group rank of one replica group) for the
training-API scenarios, written against torchft's API so that the same
script runs on torchft and on stepguard (``import stepguard as torchft``).

    python train_worker.py --impl stepguard|torchft --lighthouse ADDR \
        --replica-id train_0 --dir DIR [options]

Every event is one JSON line appended to
``DIR/events/{replica_id}.g{group_rank}.i{incarnation}.jsonl`` (files, not
stdout, so ranks launched by torchrun never interleave).  The main event is
``step``: the step number before and after ``optimizer.step()``, whether it
committed, the number of participants and a hash of the parameters after
the step.  Replicas at the same committed step must log the same hash.

Without torchrun, group rank 0 hosts the replica group's TCPStore on port 0
and publishes its port in ``DIR/stores/{replica_id}.i{incarnation}``; under
torchrun the agent's store (MASTER_ADDR/MASTER_PORT) is used.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import sys
import time
from datetime import timedelta
from typing import Any


class Log:
    """Appends one JSON object per line to this rank's event file."""

    def __init__(self, path: str, **common: Any) -> None:
        self._f = open(path, "a", buffering=1)
        self._common = common

    def __call__(self, ev: str, **kw: Any) -> None:
        rec = {"ev": ev, **self._common, "t": time.time(), **kw}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()


def replica_index(replica_id: str) -> int:
    m = re.search(r"(\d+)$", replica_id)
    return int(m.group(1)) if m else 0


def param_hash(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def wait_file(path: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.01)
    with open(path) as f:
        return f.read().strip()


def publish(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


def group_store(a: argparse.Namespace, group_rank: int):
    """This replica group's TCPStore without torchrun: group rank 0 hosts it
    on port 0 and publishes the port in ``DIR/stores/{replica_id}.i{inc}``,
    the other ranks wait for that file.  Returns the store (None where this
    rank does not host it; keep it while the Manager runs) and its port."""
    import torch

    store_file = os.path.join(a.dir, "stores", f"{a.replica_id}.i{a.incarnation}")
    if group_rank != 0:
        return None, int(wait_file(store_file, 60))
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                       wait_for_workers=False)
    publish(store_file, str(store.port))
    return store, store.port


def make_model(a: argparse.Namespace):
    """The model every replica group trains (the same initial weights in
    every group with --same-init) and its inner optimizer."""
    import torch

    torch.manual_seed(0 if a.same_init else 1000 + replica_index(a.replica_id))
    # (other workers share this model and may lack the options)
    buckets = getattr(a, "buckets", False)
    width = 96 if buckets else 16
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, 4)) if buckets else \
        torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(),
                            torch.nn.Linear(width, 4))
    if getattr(a, "unused_param", False):
        # a parameter that never gets a gradient
        model.register_module("unused", torch.nn.Linear(3, 3))
        model.unused.forward = lambda x: x  # type: ignore[method-assign]
    model.to(getattr(a, "device", "cpu"))
    inner_opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, inner_opt


def manager_kwargs(a: argparse.Namespace, group_rank: int, group_ws: int,
                   store_addr: str, store_port: int) -> dict[str, Any]:
    """The Manager arguments every worker passes alike (all but the process
    group, the state dict functions and use_async_quorum)."""
    return dict(
        min_replica_size=a.min_replica_size,
        init_sync=not a.no_init_sync,
        timeout=timedelta(seconds=a.timeout),
        quorum_timeout=timedelta(seconds=a.quorum_timeout),
        connect_timeout=timedelta(seconds=30),
        rank=group_rank,
        world_size=group_ws,
        store_addr=store_addr,
        store_port=store_port,
        lighthouse_addr=a.lighthouse,
        replica_id=a.replica_id,
        port=0,
        hostname="127.0.0.1",
        heartbeat_interval=timedelta(milliseconds=100),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", required=True,
                    help="the package that provides the API: stepguard or torchft")
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica-id", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--group-rank", type=int, default=None,
                    help="default: $RANK (torchrun)")
    ap.add_argument("--group-world-size", type=int, default=None,
                    help="default: $WORLD_SIZE (torchrun)")
    ap.add_argument("--incarnation", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20,
                    help="exit after this many committed steps, or at the "
                    "step written in DIR/stop_at, whichever comes first")
    ap.add_argument("--min-replica-size", type=int, default=1)
    ap.add_argument("--sync-quorum", action="store_true")
    ap.add_argument("--no-init-sync", action="store_true")
    ap.add_argument("--fixed-with-spares", action="store_true")
    ap.add_argument("--pg", choices=("gloo", "tcp"), default="gloo")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--progress-timeout", type=float, default=None,
                    help="--pg tcp: its peer progress deadline in seconds "
                    "(0: off; default: the group's own)")
    ap.add_argument("--quorum-timeout", type=float, default=30.0)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--device", default=os.environ.get("STEPGUARD_TEST_DEVICE", "cpu"),
                    help="where the model and batches live (default: "
                    "$STEPGUARD_TEST_DEVICE, else cpu; scripts/gpu-check runs "
                    "scenarios with cuda)")
    ap.add_argument("--same-init", action="store_true",
                    help="same initial weights in every replica group")
    ap.add_argument("--buckets", action="store_true",
                    help="a wider model whose gradients DDP cuts into several "
                    "buckets (bucket_cap_mb=0.02)")
    ap.add_argument("--unused-param", action="store_true",
                    help="the model has a parameter that never gets a gradient")
    # fault injection
    ap.add_argument("--mid-at", type=int, default=-1,
                    help="at this step (or the first one after it that this "
                    "replica takes part in), after the quorum and the forward "
                    "pass, log 'mid' and sleep --mid-sleep before the backward pass")
    ap.add_argument("--mid-sleep", type=float, default=0.0)
    ap.add_argument("--late-vote-at", type=int, default=-1,
                    help="group rank --late-vote-rank, at the first step at or "
                    "after this one: log 'late_vote' and sleep --late-vote-sleep "
                    "after the backward pass, before the commit vote")
    ap.add_argument("--late-vote-sleep", type=float, default=0.0)
    ap.add_argument("--late-vote-rank", type=int, default=1)
    ap.add_argument("--fail-allreduce-at", type=int, default=-1,
                    help="make the allreduce future of this step fail "
                    "(see --fail-mode)")
    ap.add_argument("--fail-mode", choices=("future", "work"), default="future",
                    help="future: FakeProcessGroupWrapper.report_future_error; "
                    "work: the allreduce runs but its work fails")
    ap.add_argument("--report-error-at", type=int, default=-1,
                    help="call manager.report_error() at this step")
    ap.add_argument("--slow-send", type=float, default=0.0,
                    help="the first time after step 0 that this rank's state "
                    "is read for a recovering peer, log 'send_state' and sleep "
                    "this long")
    ap.add_argument("--slow-send-gate", default=None,
                    help="with --slow-send: end that sleep as soon as this "
                    "file exists (a test opens the gate once it has acted on "
                    "'send_state')")
    # checkpoints and data
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--data-workers", type=int, default=0,
                    help="feed batches through a DataLoader with this many "
                    "live worker processes")
    ap.add_argument("--loader-watchdog", type=float, default=0.0,
                    help="how often DataLoader workers check that the trainer "
                    "lives (torch's default is 5 s)")
    return ap.parse_args(argv)


def load_impl(name: str):
    ft = importlib.import_module(name)
    pg_mod = importlib.import_module(name + ".process_group")
    mgr_mod = importlib.import_module(name + ".manager")
    return ft, pg_mod, mgr_mod


def make_pg(a: argparse.Namespace, ft, pg_mod):
    pg_timeout = timedelta(seconds=a.timeout)
    if a.pg == "tcp":
        kw = ({} if a.progress_timeout is None
              else {"progress_timeout": timedelta(seconds=a.progress_timeout)})
        pg = pg_mod.ProcessGroupTCP(timeout=pg_timeout, **kw)
    else:
        pg = ft.ProcessGroupGloo(timeout=pg_timeout)
    if a.fail_allreduce_at >= 0:
        pg = pg_mod.FakeProcessGroupWrapper(pg)
    return pg


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    group_rank = a.group_rank if a.group_rank is not None else int(os.environ["RANK"])
    group_ws = (a.group_world_size if a.group_world_size is not None
                else int(os.environ["WORLD_SIZE"]))
    for sub in ("events", "stores", "ckpt"):
        os.makedirs(os.path.join(a.dir, sub), exist_ok=True)
    log = Log(os.path.join(a.dir, "events",
                           f"{a.replica_id}.g{group_rank}.i{a.incarnation}.jsonl"),
              rid=a.replica_id, g=group_rank, inc=a.incarnation)
    log("start", pid=os.getpid(), ppid=os.getppid(),
        torchrun="TORCHELASTIC_RUN_ID" in os.environ)

    import torch

    torch.set_num_threads(1)
    ft, pg_mod, mgr_mod = load_impl(a.impl)

    # this replica group's TCPStore
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    store = None
    if torchrun:
        store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    else:
        store_addr = "127.0.0.1"
        store, store_port = group_store(a, group_rank)

    rindex = replica_index(a.replica_id)
    model, inner_opt = make_model(a)
    send_state = {"slow": a.slow_send}

    def state_dict() -> dict:
        if send_state["slow"] > 0 and manager.current_step() > 0:
            log("send_state", step=manager.current_step())
            until = time.monotonic() + send_state["slow"]
            gate = a.slow_send_gate
            while time.monotonic() < until and not (gate and os.path.exists(gate)):
                time.sleep(min(0.05, max(0.0, until - time.monotonic())))
            send_state["slow"] = 0.0
        return {"model": model.state_dict(), "optim": inner_opt.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner_opt.load_state_dict(sd["optim"])
        log("loaded", step=manager.current_step(), hash=param_hash(model))

    pg = make_pg(a, ft, pg_mod)
    kw: dict[str, Any] = {}
    if a.fixed_with_spares:
        kw["world_size_mode"] = mgr_mod.WorldSizeMode.FIXED_WITH_SPARES
    manager = ft.Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        use_async_quorum=not a.sync_quorum,
        **manager_kwargs(a, group_rank, group_ws, store_addr, store_port),
        **kw,
    )
    ddp = ft.DistributedDataParallel(manager, model,
                                     **({"bucket_cap_mb": 0.02} if a.buckets else {}))
    opt = ft.Optimizer(manager, inner_opt)

    ckpt_path = os.path.join(a.dir, "ckpt", f"{a.replica_id}.g{group_rank}.pt")
    if a.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        inner_opt.load_state_dict(ck["optim"])
        manager.load_state_dict(ck["manager"])
        log("resumed", step=manager.current_step(),
            batches=manager.batches_committed(), hash=param_hash(model))

    loader_it = None
    if a.data_workers:
        if a.loader_watchdog:
            import torch.utils.data._utils.worker as loader_worker

            loader_worker.MP_STATUS_CHECK_INTERVAL = a.loader_watchdog
        loader_it = iter(make_loader(torch, a.data_workers, rindex, group_rank))

    log("ready", step=manager.current_step(), hash=param_hash(model),
        pid=os.getpid(), children=child_pids(os.getpid()))
    last = manager.current_step()
    stop_file = os.path.join(a.dir, "stop_at")
    while manager.current_step() < a.steps:
        if os.path.exists(stop_file) and manager.current_step() >= int(wait_file(stop_file, 1)):
            break
        if loader_it is not None:
            x, y = next(loader_it)
        else:
            gen = torch.Generator().manual_seed(
                (rindex * 1000 + group_rank) * 100003 + manager.current_step())
            x = torch.randn(16, 8, generator=gen)
            y = torch.randn(16, 4, generator=gen)
        x, y = x.to(a.device), y.to(a.device)
        opt.zero_grad()  # starts the quorum
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if 0 <= a.mid_at <= manager.current_step():
            # the first step at or after --mid-at: a replica the quorum left
            # out of step mid_at (it came late and healed past it) stops in
            # the step it did join, and "mid" says which one that is
            manager.wait_quorum()
            log("mid", step=manager.current_step(),
                qid=getattr(manager, "_quorum_id", None))
            a.mid_at = -1
            time.sleep(a.mid_sleep)
        # (>= 0: a failed heal leaves the step at -1, the "off" value)
        if 0 <= a.fail_allreduce_at == manager.current_step():
            if a.fail_mode == "future":
                pg.report_future_error(RuntimeError("injected allreduce failure"))
            else:
                fail_next_allreduce(pg)
            a.fail_allreduce_at = -1
        loss.backward()  # allreduce (waits for the quorum, and a heal)
        if 0 <= a.report_error_at == manager.current_step():
            manager.report_error(RuntimeError("injected report_error"))
            a.report_error_at = -1
        if (0 <= a.late_vote_at <= manager.current_step()
                and group_rank == a.late_vote_rank):
            log("late_vote", step=manager.current_step())
            a.late_vote_at = -1
            time.sleep(a.late_vote_sleep)
        before = manager.current_step()
        opt.step()  # should_commit
        after = manager.current_step()
        err = manager.errored()
        log("step", before=before, step=after, ok=after == before + 1,
            healed=before != last, n=manager.num_participants(),
            prank=manager.participating_rank(),
            batches=manager.batches_committed(),
            qid=getattr(manager, "_quorum_id", None),
            hash=param_hash(model),
            err=None if err is None else str(err).splitlines()[0][:200])
        last = after
        if a.ckpt_every and after != before and after % a.ckpt_every == 0:
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.state_dict(), "optim": inner_opt.state_dict(),
                        "manager": manager.state_dict()}, tmp)
            # a kill between the rename and "saved" leaves this checkpoint on
            # disk with "saved" naming the one before: "saving" says so
            log("saving", step=after, hash=param_hash(model))
            os.rename(tmp, ckpt_path)
            log("saved", step=after, hash=param_hash(model))
        if a.step_sleep:
            time.sleep(a.step_sleep)
    log("done", step=manager.current_step(), hash=param_hash(model))
    manager.shutdown(wait=False)
    sys.stdout.flush()
    sys.stderr.flush()
    # torch and the manager leave non-daemon threads behind; exit at once
    os._exit(0)


def child_pids(pid: int) -> list[int]:
    """Direct children of pid (DataLoader workers), from /proc."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def fail_next_allreduce(pg) -> None:
    """Makes the next allreduce on pg run for real (the collective stays
    matched across replicas) but hand back a work whose wait() and future
    fail, as a collective that broke locally would."""
    import torch
    import torch.distributed as dist

    class FailedWork(dist.Work):
        def __init__(self, inner) -> None:
            super().__init__()
            self._inner = inner
            self._fut: torch.futures.Future = torch.futures.Future()
            inner.get_future().add_done_callback(
                lambda _: self._fut.set_exception(
                    RuntimeError("injected allreduce failure (in the work)")))

        def wait(self, timeout=None) -> bool:
            self._inner.wait()
            self._fut.wait()  # raises
            return False

        def get_future(self) -> torch.futures.Future:
            return self._fut

    def failing(*args: Any, **kw: Any):
        del pg.allreduce  # once: the class's method again
        return FailedWork(type(pg).allreduce(pg, *args, **kw))

    pg.allreduce = failing


def make_loader(torch, workers: int, rindex: int, group_rank: int):
    """An endless DataLoader whose worker processes stay alive."""

    class Batches(torch.utils.data.IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            wid = info.id if info is not None else 0
            gen = torch.Generator().manual_seed(rindex * 1000 + group_rank * 10 + wid)
            while True:
                yield torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)

    return torch.utils.data.DataLoader(Batches(), batch_size=None,
                                       num_workers=workers, persistent_workers=True)


if __name__ == "__main__":
    sys.exit(main())
