"""LocalSGD and (Streaming) DiLoCo: argument checks, the same numbers as
torchft's implementation step by step (in process, on a scripted Manager),
and real training over three replica groups (tests/py/helpers/local_sgd_worker.py,
driven by train_harness.Job) where a replica is SIGKILLed between syncs,
restarts, heals and ends bit-identical; finally the same seeded run on
torchft (its DiLoCo, Manager and lighthouse) and on stepguard, compared
bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import pytest
import torch
from torch.distributed import ReduceOp

from train_harness import Job, Zygote, job_factory, wait_for  # noqa: F401

from stepguard import local_sgd
from stepguard.work import _DummyWork

WORKER = str(Path(__file__).parent / "helpers" / "local_sgd_worker.py")


def _torchft_local_sgd() -> Any:
    try:
        import torchft.local_sgd as theirs
    except ImportError as e:
        pytest.skip(f"torchft is not installed ({e}): no oracle to compare with")
    return theirs


# ---- a scripted Manager --------------------------------------------------


class ScriptedManager:
    """The part of the Manager LocalSGD and DiLoCo use, with a scripted
    allreduce (a fixed affine map, as a peer's contribution would be) and
    scripted commit votes; it records every call."""

    def __init__(self, use_async_quorum: bool = False, fail_votes: tuple[int, ...] = ()) -> None:
        self._use_async_quorum = use_async_quorum
        self.calls: list[str] = []
        self.quantize: list[bool] = []
        self.registered: dict[str, tuple[Callable, Callable]] = {}
        self._step = 0
        self._votes = 0
        self._fail_votes = fail_votes
        self._reads_allowed = True

    def register_state_dict_fn(self, key: str, load: Callable, save: Callable) -> None:
        assert key not in self.registered
        self.registered[key] = (load, save)

    def current_step(self) -> int:
        return self._step

    def start_quorum(self, *args: Any, **kw: Any) -> None:
        self.calls.append("start_quorum")

    def allreduce(self, t: torch.Tensor, should_quantize: bool = False,
                  reduce_op: ReduceOp = ReduceOp.AVG) -> Any:
        self.calls.append("allreduce")
        self.quantize.append(should_quantize)
        t.mul_(0.75).add_(0.01)
        return _DummyWork(t)

    def should_commit(self, *args: Any, **kw: Any) -> bool:
        self.calls.append("should_commit")
        self._votes += 1
        if self._votes in self._fail_votes:
            return False
        self._step += 1
        return True

    def disallow_state_dict_read(self) -> None:
        assert self._reads_allowed, "disallowed twice"
        self._reads_allowed = False
        self.calls.append("disallow")

    def allow_state_dict_read(self) -> None:
        self._reads_allowed = True
        self.calls.append("allow")


def _train(mod: Any, algo: str, steps: int, **kw: Any) -> tuple[list[torch.Tensor], ScriptedManager, Any]:
    """A seeded run of ``mod``'s LocalSGD or DiLoCo on a ScriptedManager;
    returns the model parameters and the global state after ``steps``
    inner steps."""
    fail_votes = kw.pop("fail_votes", ())
    manager = ScriptedManager(use_async_quorum=algo == "localsgd", fail_votes=fail_votes)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    if algo == "localsgd":
        wrapper = mod.LocalSGD(manager, model, inner, sync_every=kw.pop("sync_every", 3))
    else:
        n = kw.pop("fragments", 1)
        frags = [model[0:2], model[2:]] if n == 2 else [model]
        outers = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
                  for f in frags]
        wrapper = mod.DiLoCo(manager, frags, inner, outers if n > 1 else outers[0], **kw)
    gen = torch.Generator().manual_seed(1)
    with wrapper:
        for _ in range(steps):
            inner.zero_grad()
            x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
            torch.nn.functional.mse_loss(model(x), y).backward()
            inner.step()
    out = [p.detach().clone() for p in model.parameters()]
    if algo == "diloco":
        for frag in wrapper._fragments:
            out += [t.clone() for t in frag.original_parameters.values()]
            out += [v.clone() for s in frag._outer_optimizer.state_dict()["state"].values()
                    for v in s.values() if isinstance(v, torch.Tensor)]
    return out, manager, wrapper


CONFIGS = {
    "localsgd": ("localsgd", dict(sync_every=3)),
    "localsgd-failed-vote": ("localsgd", dict(sync_every=2, fail_votes=(2,))),
    "diloco": ("diloco", dict(sync_every=3)),
    "streaming": ("diloco", dict(fragments=2, sync_every=4, fragment_sync_delay=1,
                                 fragment_update_alpha=0.5)),
    "streaming-alpha1": ("diloco", dict(fragments=2, sync_every=4, fragment_update_alpha=1.0)),
    "streaming-failed-votes": ("diloco", dict(fragments=2, sync_every=6, fragment_sync_delay=2,
                                              fragment_update_alpha=0.5, fail_votes=(2, 3))),
    "bucketized": ("diloco", dict(fragments=2, sync_every=2, use_bucketization=True,
                                  bucket_cap_mb=1, should_quantize=True)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_numbers_and_calls_as_torchft(name: str) -> None:
    """Step for step on the same scripted Manager, ours and torchft's give
    the same bits, make the same Manager calls in the same order and
    register the same state."""
    theirs = _torchft_local_sgd()
    algo, kw = CONFIGS[name]
    ours_out, ours_mgr, _ = _train(local_sgd, algo, 13, **dict(kw))
    their_out, their_mgr, _ = _train(theirs, algo, 13, **dict(kw))
    assert ours_mgr.calls == their_mgr.calls
    assert ours_mgr.calls.count("should_commit") >= 3
    assert ours_mgr.quantize == their_mgr.quantize
    assert len(ours_out) == len(their_out)
    for i, (a, b) in enumerate(zip(ours_out, their_out)):
        assert torch.equal(a, b), f"{name}: tensor {i} differs from torchft's"
    assert sorted(ours_mgr.registered) == sorted(their_mgr.registered)
    for key in ours_mgr.registered:
        mine, other = ours_mgr.registered[key][1](), their_mgr.registered[key][1]()
        assert sorted(mine) == sorted(other) == ["original_parameters", "outer_optimizer"]
        assert sorted(mine["original_parameters"]) == sorted(other["original_parameters"])
        for n, t in mine["original_parameters"].items():
            assert torch.equal(t, other["original_parameters"][n])


def test_streaming_schedule_and_quantize_flag() -> None:
    """2 fragments, sync_every 4, delay 1: a quorum and one fragment's
    allreduce at inner step 1 (mod 2), its commit one step later; the
    fragment follows the committed step; should_quantize reaches the
    Manager."""
    _, mgr, wrapper = _train(local_sgd, "diloco", 6, fragments=2, sync_every=4,
                             fragment_sync_delay=1, should_quantize=True)
    per_step = " ".join(mgr.calls).replace("disallow allow", "|").split("|")
    assert [s.strip() for s in per_step if s.strip()] == [
        "start_quorum allreduce allreduce", "should_commit",
    ] * 3
    assert mgr.quantize == [True] * 6
    assert mgr.current_step() == 3


def test_buckets_split_and_oversized_tensors_are_averaged() -> None:
    """With a bucket cap of 100 bytes every pseudo-gradient is averaged
    (one larger than the cap in a bucket of its own; torchft would leave it
    out), and the result is the per-parameter one."""
    kw = dict(fragments=2, sync_every=2)
    per_param, mgr, _ = _train(local_sgd, "diloco", 6, **kw)
    bucketed, bmgr, wrapper = _train(local_sgd, "diloco", 6, use_bucketization=True,
                                     bucket_cap_mb=100 / (1024 * 1024), **kw)
    assert wrapper._fragments[0].bucket_cap_mb == 100
    # six syncs, alternating fragments.  Fragment 0: weight 7x5 (140 B,
    # alone), bias 7 (28 B): two buckets; fragment 1: weight 3x7 (84 B) and
    # bias 3 (12 B) share one
    assert mgr.calls.count("allreduce") == 3 * 2 + 3 * 2
    assert bmgr.calls.count("allreduce") == 3 * 2 + 3 * 1
    for a, b in zip(per_param, bucketed):
        assert torch.equal(a, b)


def test_failed_sync_rolls_back_to_global() -> None:
    """A failed vote puts the model back on the global parameters and
    keeps them; the same fragment is synced next time."""
    _, mgr, wrapper = _train(local_sgd, "diloco", 3, sync_every=3, fail_votes=(1,))
    frag = wrapper._fragments[0]
    assert mgr.current_step() == 0
    for (name, p) in frag._model_fragment.named_parameters():
        assert torch.equal(p.detach(), frag.original_parameters[name])


def test_heal_state_round_trip() -> None:
    """The registered state carries the global parameters and outer
    optimizer state; loading it into a fresh DiLoCo reproduces them (what
    a healing replica receives)."""
    _, mgr, _ = _train(local_sgd, "diloco", 8, fragments=2, sync_every=4)
    _, other, wrapper = _train(local_sgd, "diloco", 1, fragments=2, sync_every=4)
    for key, (_, save) in mgr.registered.items():
        other.registered[key][0](save())
    for i, frag in enumerate(wrapper._fragments):
        sent = mgr.registered[f"StreamingDiLoCoFragment_{i}"][1]()
        for name, t in frag.original_parameters.items():
            assert torch.equal(t, sent["original_parameters"][name])
        assert str(frag._outer_optimizer.state_dict()) == str(sent["outer_optimizer"])


def test_hooks_removed_on_exit() -> None:
    mgr = ScriptedManager(use_async_quorum=True)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lsgd = local_sgd.LocalSGD(mgr, model, opt, sync_every=1)
    with lsgd as entered:
        assert entered is lsgd
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert mgr.calls == ["disallow", "allow", "start_quorum", "allreduce", "allreduce",
                         "should_commit"]
    opt.step()
    assert len(mgr.calls) == 6, "a hook outlived the context"


# ---- argument checks -----------------------------------------------------


def _ctor_error(mod: Any, algo: str, **kw: Any) -> type[BaseException] | None:
    mgr = ScriptedManager(use_async_quorum=kw.pop("async_quorum", False))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        if algo == "localsgd":
            mod.LocalSGD(mgr, model, inner, **kw)
        else:
            n = kw.pop("fragments", 1)
            frags = [model[0:1], model[1:]][:n] if n <= 2 else [model] * n
            n_outer = kw.pop("outers", n)
            outers = [torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(n_outer)]
            mod.DiLoCo(mgr, frags, inner, outers, **kw)
    except (ValueError, AssertionError) as e:
        assert str(e), "an error without a message"
        return type(e)
    return None


BAD = {
    "localsgd sync_every=0": ("localsgd", dict(sync_every=0)),
    "localsgd sync_every=-3": ("localsgd", dict(sync_every=-3)),
    "diloco async quorum": ("diloco", dict(sync_every=2, async_quorum=True)),
    "diloco sync_every=0": ("diloco", dict(sync_every=0)),
    "sync_every < fragments": ("diloco", dict(fragments=2, sync_every=1)),
    "sync_every not a multiple": ("diloco", dict(fragments=2, sync_every=3)),
    "delay == interval": ("diloco", dict(fragments=2, sync_every=4, fragment_sync_delay=2)),
    "delay > interval": ("diloco", dict(sync_every=2, fragment_sync_delay=5)),
    "alpha > 1": ("diloco", dict(sync_every=2, fragment_update_alpha=1.5)),
    "alpha < 0": ("diloco", dict(sync_every=2, fragment_update_alpha=-0.1)),
    "outer optimizer count": ("diloco", dict(fragments=2, sync_every=2, outers=1)),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_raise_as_torchft(case: str) -> None:
    """Each bad argument raises; the error is caught by whatever
    ``except`` catches torchft's for the same arguments (ours raise
    ValueError, and AssertionError where torchft asserts)."""
    algo, kw = BAD[case]
    ours = _ctor_error(local_sgd, algo, **dict(kw))
    assert ours is not None, f"{case}: accepted"
    assert issubclass(ours, ValueError)
    theirs = _ctor_error(_torchft_local_sgd(), algo, **dict(kw))
    if theirs is not None:
        assert issubclass(ours, theirs), f"{case}: ours {ours}, torchft {theirs}"


def test_good_arguments_accepted() -> None:
    assert _ctor_error(local_sgd, "localsgd", sync_every=1) is None
    assert _ctor_error(local_sgd, "diloco", fragments=2, sync_every=4,
                       fragment_sync_delay=1, fragment_update_alpha=1.0) is None
    assert _ctor_error(local_sgd, "diloco", sync_every=1, fragment_update_alpha=0.0) is None


def test_quantized_collectives_refuse_other_ops_and_pad_as_torchft() -> None:
    from stepguard import collectives

    t = [torch.ones(4)]
    with pytest.raises(NotImplementedError, match="only AVG and SUM"):
        collectives.allreduce_quantized(t, ReduceOp.MAX, None)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="only AVG and SUM"):
        collectives.reduce_scatter_quantized(torch.ones(2), t, ReduceOp.PRODUCT, None)  # type: ignore[arg-type]
    fmt, why = collectives.quantized_format(object())
    assert fmt is None and "object has no quantized collectives" in why
    ins = [torch.zeros(5), torch.zeros(3, 4), torch.zeros(2, 2, 3)]
    assert collectives.get_padded_sizes(ins, 2) == [
        torch.Size((6, 1)), torch.Size((4, 4)), torch.Size((2, 2, 3))]
    out, sizes = collectives.allocate_reduce_scatter_output(ins, 2)
    assert out.shape == (3 + 8 + 6,) and out.dtype == torch.float32
    assert sizes == collectives.get_padded_sizes(ins, 2)
    with pytest.raises(AssertionError, match="same dtype"):
        collectives.allocate_reduce_scatter_output([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], 2)


# ---- real processes ------------------------------------------------------


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    """The fork server, forking local_sgd_worker.py."""
    z = Zygote("stepguard", script=WORKER)
    try:
        yield z
    finally:
        z.close()


ALGOS = {
    "localsgd": ("--algo", "localsgd", "--sync-every", "3"),
    "diloco": ("--algo", "diloco", "--sync-every", "3"),
    "streaming": ("--algo", "diloco", "--fragments", "2", "--sync-every", "4",
                  "--delay", "1", "--alpha", "0.5"),
}


def _done_hashes(job: Job) -> dict[str, tuple[int, str]]:
    out = {}
    for rid, g in job.groups.items():
        done = job.events(rid, inc=g.incarnation, ev="done")
        assert done, f"{rid} did not finish\n{job.summary()}"
        out[rid] = (done[-1]["step"], done[-1]["hash"])
    return out


@pytest.mark.parametrize("pg", ["gloo", "tcp"])
@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_kill_heal_identical(job_factory, algo: str, pg: str) -> None:
    """Three replica groups; train_1 is SIGKILLed between two syncs (while
    it holds after its second), the other two go on, train_1 restarts,
    heals from them and ends bit-identical.  After every sync all replicas
    hold the same synchronised state."""
    # quorums wait up to 5 s for a live replica that has not asked yet: with
    # 200 ms a busy host could leave train_1 out of sync 2 (it heals past
    # it and never holds there); killed, it is dropped at once
    job = job_factory(hard_timeout=90, min_replicas=2, join_timeout_ms=5000)
    args = (*ALGOS[algo], "--pg", pg, "--steps", "1000", "--step-sleep", "0.01",
            "--min-replica-size", "2", "--timeout", "10")
    for i in range(3):
        hold = ("--hold-at", "2", "--hold-sleep", "60") if i == 1 else ()
        job.start_group(f"train_{i}", 1, *args, *hold)
    wait_for(lambda: job.events("train_1", ev="hold"), 40, "train_1 to hold after sync 2", job)
    job.kill_group("train_1")
    killed_at = job.committed("train_1")
    assert killed_at == 2
    survivors = ["train_0", "train_2"]
    wait_for(lambda: job.all_committed(killed_at + 2, survivors), 30,
             "the survivors to commit 2 syncs without train_1", job)
    job.restart_group("train_1")
    wait_for(lambda: job.committed("train_1") >= 0 and
             job.committed("train_1") > job.committed("train_1", inc=0) + 1, 40,
             "the restarted train_1 to heal and commit", job)
    stop = max(job.committed(r) for r in job.groups) + 2
    job.stop_at(stop)
    for rid in job.groups:
        assert job.wait_exit(rid, 30) == [0], job.summary()

    loaded = job.events("train_1", inc=1, ev="loaded")
    assert loaded and loaded[0]["step"] > 0, f"train_1 did not heal\n{job.summary()}"
    first = [e for e in job.steps("train_1", inc=1) if e["ok"]][0]
    assert first["step"] > killed_at, "the restarted replica did not catch up"
    compared = job.assert_identical(min_compared=6)
    # the restarted replica is compared with the others after its heal
    assert job.assert_identical(min_compared=2, rids=["train_1", "train_0"],
                                from_step=first["step"]) >= 2
    assert compared >= 6
    done = _done_hashes(job)
    assert len(set(done.values())) == 1, f"final states differ: {done}"
    assert min(s for s, _ in done.values()) >= stop


@pytest.mark.skipif(not Path(sys.executable).with_name("torchft_lighthouse").exists(),
                    reason="torchft (its lighthouse) is not installed: no oracle")
def test_oracle_torchft_streaming_diloco(job_factory) -> None:
    """The same seeded three-replica Streaming DiLoCo run (2 fragments,
    sync delay 1, alpha 0.5, Gloo) with torchft's DiLoCo + Manager +
    lighthouse and with ours: every synchronised state and the final
    parameters are bitwise equal."""
    _torchft_local_sgd()
    args = ("--algo", "diloco", "--fragments", "2", "--sync-every", "4", "--delay", "1",
            "--alpha", "0.5", "--pg", "gloo", "--steps", "8", "--same-init",
            "--no-init-sync", "--min-replica-size", "3")
    runs: dict[str, Job] = {}
    theirs_zygote = Zygote("torchft", script=WORKER)
    try:
        for impl in ("torchft", "stepguard"):
            job = job_factory(hard_timeout=150, min_replicas=3, impl=impl,
                              lighthouse="torchft" if impl == "torchft" else "ours",
                              **({"zygote": theirs_zygote} if impl == "torchft" else {}))
            runs[impl] = job
            for i in range(3):
                job.start_group(f"train_{i}", 1, *args)
            for rid in job.groups:
                assert job.wait_exit(rid, 60) == [0], job.summary()
            job.close()
    finally:
        theirs_zygote.close()

    def synced(job: Job) -> dict[tuple[str, int], tuple[str, str]]:
        return {(e["rid"], e["step"]): (e["hash"], e["model"]) for e in job.steps() if e["ok"]}

    theirs, ours = synced(runs["torchft"]), synced(runs["stepguard"])
    assert len(theirs) == 3 * 8, runs["torchft"].summary()
    assert ours == theirs
    assert _done_hashes(runs["stepguard"]) == _done_hashes(runs["torchft"])
    # the replicas really trained differently between syncs
    assert len({h[1] for h in ours.values()}) > 8


DTENSOR_PROBE = r'''
import sys, torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
import test_local_sgd as t
from stepguard import local_sgd
import torchft.local_sgd as theirs

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
plain = torch.nn.Sequential


class Distributed(plain):
    """A Sequential whose parameters are DTensors (inputs converted)."""

    def __init__(self, *args):
        super().__init__(*args)
        distribute_module(
            self, mesh,
            input_fn=lambda m, ins, dm: tuple(DTensor.from_local(i, dm, [Replicate()]) for i in ins),
            output_fn=lambda m, out, dm: out.to_local() if isinstance(out, DTensor) else out)


def run(mod):
    torch.nn.Sequential = Distributed
    try:
        out, mgr, w = t._train(mod, "diloco", 9, fragments=2, sync_every=4,
                               fragment_sync_delay=1, fragment_update_alpha=0.5)
    finally:
        torch.nn.Sequential = plain
    assert isinstance(next(w._fragments[0]._model_fragment.parameters()), DTensor)
    return [o.to_local() if isinstance(o, DTensor) else o for o in out], mgr


ours, ours_mgr = run(local_sgd)
other, other_mgr = run(theirs)
assert ours_mgr.calls == other_mgr.calls, "different Manager calls"
assert len(ours) == len(other) == 12
for i, (a, b) in enumerate(zip(ours, other)):
    assert torch.equal(a, b), f"tensor {i} differs"
dist.destroy_process_group()
print("dtensor ok")
'''


def test_dtensor_parameters_match_torchft() -> None:
    """Streaming DiLoCo over a model whose parameters are DTensors (a
    one-rank CPU mesh, in a child process for its process group): the same
    bits and calls as torchft's."""
    _torchft_local_sgd()
    import os
    import subprocess

    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(here), str(here / "helpers"), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", DTENSOR_PROBE], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0 and "dtensor ok" in p.stdout, p.stderr[-3000:]


def _diloco_run(job_factory, *extra: str, advertise: dict[int, str] | None = None) -> dict:
    """Two replica groups of seeded DiLoCo over ProcessGroupTCP for 20
    outer steps (3 inner steps each) on a linear task; each group's done
    event."""
    job = job_factory(hard_timeout=120, min_replicas=2)
    args = ("--algo", "diloco", "--sync-every", "3", "--pg", "tcp", "--steps", "20",
            "--same-init", "--task", "linear", "--min-replica-size", "2",
            "--timeout", "10", "--outer-momentum", "0.5", *extra)
    for i in range(2):
        adv = ("--advertise", advertise[i]) if advertise and i in advertise else ()
        job.start_group(f"train_{i}", 1, *args, *adv)
    for rid in job.groups:
        assert job.wait_exit(rid, 100) == [0], job.summary()
    done = {rid: job.events(rid, ev="done")[-1] for rid in job.groups}
    job.close()
    for d in done.values():
        assert d["step"] >= 20
    return done


def test_diloco_quantized_loss_and_agreement(job_factory) -> None:
    """The same seeded DiLoCo run in full precision, with should_quantize
    (the group agrees on fp8), and with should_quantize where one replica
    advertises no quantized format: the quantized run's final loss is
    within 2% of full precision, and it really quantized (counted
    quantized allreduces, other bits); the mixed run falls back to full
    precision on both replicas and gives full precision's bits."""
    full = _diloco_run(job_factory)
    quant = _diloco_run(job_factory, "--quantize")
    mixed = _diloco_run(job_factory, "--quantize", advertise={1: ""})
    for d in full.values():
        assert d["qcalls"] == 0 and d["qfmt"] == "fp8"
    for d in quant.values():
        assert d["qcalls"] >= 20 and d["qfmt"] == "fp8"
    for d in mixed.values():
        assert d["qcalls"] == 0 and d["qfmt"] is None
    # every replica ends with the same global state
    for run in (full, quant, mixed):
        assert len({d["hash"] for d in run.values()}) == 1, run
    assert quant["train_0"]["hash"] != full["train_0"]["hash"]
    assert mixed["train_0"]["hash"] == full["train_0"]["hash"]
    lf = sum(d["loss"] for d in full.values()) / 2
    lq = sum(d["loss"] for d in quant.values()) / 2
    first = full["train_0"]
    assert lf < 0.2 * first["loss0"], f"the task did not train: {first}"
    print(f"final loss: full precision {lf:.5f}, fp8 {lq:.5f} (from {first['loss0']:.4f})")
    assert abs(lq - lf) <= 0.02 * lf, (lf, lq)
