"""DistributedDataParallel for fault-tolerant training.

torch's DDP with its gradient allreduce routed through the Manager: the
allreduce averages over the replicas taking part in the step, and a failure
marks the step failed instead of breaking ``backward()``.  The initial
parameter broadcast is left to the Manager (it heals replicas at step 0).

Buckets.  The bucket allreduces of one step meet across replicas, so every
replica must cut its gradients into the same buckets, in the same order, at
every step.  torch's DDP rebuilds its buckets once, after its first
backward, in the order the gradients arrived: a replica that joins later
would use its first-step buckets while the others use rebuilt ones.
torchft keeps DDP from rebuilding with ``find_unused_parameters=True``,
which also makes DDP search the autograd graph after every forward and
pass the outputs through an extra autograd function (0.2-0.4 ms per step
of a small MLP on CPU), and leaves it with its first-step buckets, which
are filled from the first parameter: the bucket reduced after backward
ends is then the largest one it can be.  Here the buckets are fixed at
construction instead, by rebuilding once, right away, from a backward of
zeros that marks the parameters ready bucket after bucket.  No graph
search per step.  The buckets are torchft's, so that torchft replicas can
share the job; ``STEPGUARD_DDP_BUCKETS=rebuilt`` gives the ones DDP's own
rebuild makes when gradients become ready from the last parameter to the
first (a smaller last bucket; not measurably faster on the bench MLP over
loopback, where the allreduce is CPU-bound and overlaps little anyway).

A model that leaves a parameter without a gradient cannot finish the
step's reduction without that search.  Before the commit vote (and before
the next forward) such a step is found: the buckets it did not reduce are
allreduced from the gradients there are (zeros where a parameter got
none, as the search would have made them), so that the other replicas
are not left waiting and get the average they would have got; this
replica reports the step failed, does not commit it and heals at the next
quorum; and this DDP switches for good to
``find_unused_parameters=True``, with the same buckets.
``find_unused_parameters=True`` or ``STEPGUARD_DDP_FIND_UNUSED=1`` starts
there, with torchft's construction and buckets, as do the arguments whose
buckets cannot be fixed this way (``static_graph``,
``bucket_cap_mb_list``, mixed precision, delayed allreduce, sparse
gradients, parameters of several dtypes or devices), and parameters that
already carry gradient hooks (they would see the backward of zeros).  All
replicas of a job must make the same choice.
"""

# No `from __future__ import annotations` here: torch checks the comm
# hook's `bucket` annotation at run time against dist.GradBucket.

import itertools
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllreduceOptions, Work
from torch.nn import parallel

from stepguard import config
from stepguard import futures as _futures
from stepguard.futures import _call_later
from stepguard.manager import Manager, _average, _ManagedFuture
from stepguard.process_group import ProcessGroupDummy

__all__ = ["DistributedDataParallel", "PureDistributedDataParallel"]

# DDP arguments whose buckets the fixed layout does not reproduce: with any
# of them DDP is built as torchft builds it.
_TORCHFT_BUCKETS = frozenset(
    {
        "static_graph",
        "bucket_cap_mb_list",
        "delay_all_reduce_named_params",
        "param_to_hook_all_reduce",
        "mixed_precision",
        "skip_all_reduce_unused_params",
    }
)


class _HookState:
    """What the comm hook is registered with: the manager, its bucket
    path (None: the public ``allreduce``), the index after the last bucket
    handed to it this step, and (where the buckets' completion is left to
    the end of backward) what completes them."""

    __slots__ = ("manager", "buckets", "next_bucket", "defer", "finishers")

    def __init__(self, manager: "Manager") -> None:
        self.manager = manager
        self.buckets = _bucket_path(manager)
        self.next_bucket = 0
        # complete the buckets on backward's thread (only where DDP waits
        # for them in its own end-of-backward callback, queued after ours)
        self.defer = False
        self.finishers: List[Callable[[], None]] = []

    def finish(self) -> None:
        """Queued on the autograd engine at the first bucket of a
        backward, so it runs before DDP's end-of-backward callback (queued
        at the last bucket) waits for the buckets' futures."""
        finishers, self.finishers = self.finishers, []
        for finish in finishers:
            finish()


class DistributedDataParallel(parallel.DistributedDataParallel):
    """torch DDP whose buckets are allreduced by the Manager.

    No parameter shape checks are done across replicas.

    Args:
        manager: the stepguard Manager.
        module: the model.
        **kwargs: passed to torch's DistributedDataParallel;
            ``find_unused_parameters=True`` searches the autograd graph
            after every forward, as torchft's DDP always does (default:
            only once a step has left a parameter without a gradient).
    """

    def __init__(self, manager: "Manager", module: nn.Module, **kwargs: Any) -> None:
        find_unused = kwargs.pop("find_unused_parameters", None)
        if find_unused is None:
            find_unused = config.get("STEPGUARD_DDP_FIND_UNUSED")
        torchft_buckets = config.get("STEPGUARD_DDP_BUCKETS") != "rebuilt"
        checks = getattr(manager, "_commit_checks", None)
        fixed = not find_unused and checks is not None and not (kwargs.keys() & _TORCHFT_BUCKETS)
        super().__init__(
            module,
            # A world of one takes DDP's construction broadcast; the
            # replicas are synchronized by the Manager instead.
            process_group=ProcessGroupDummy(0, 1),
            find_unused_parameters=not fixed,
            **kwargs,
        )
        self._hook_state = _HookState(manager)
        # static_graph and the delayed allreduces reduce the buckets inside
        # DDP's own end-of-backward callback, after ours ran
        self._hook_state.defer = (
            config.get("STEPGUARD_DDP_COMPLETION") != "thread"
            and not (kwargs.keys() & _TORCHFT_BUCKETS)
            and not getattr(self, "_use_python_reducer", True)
        )
        # the fixed buckets (indices into the reducer's parameters, in the
        # order they are reduced), kept if the reducer is rebuilt
        self._buckets: Optional[List[List[int]]] = None
        if fixed:
            fixed = self._fix_buckets(torchft_buckets)
        self.register_comm_hook(self._hook_state, self._comm_hook)
        if fixed:
            assert checks is not None
            checks.append(weakref.WeakMethod(self._settle))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.find_unused_parameters:
            self._settle()
        return super().forward(*inputs, **kwargs)

    def _fix_buckets(self, torchft: bool) -> bool:
        """Gives the reducer its buckets for good (torchft's with
        ``torchft``): True, or False where that cannot be done here (the
        reducer then searches for unused parameters, as torchft's does)."""
        params, sparse = self._build_params_for_reducer()
        kinds = {(p.dtype, p.device) for p in params}
        # a gradient hook already on a parameter would see the backward of
        # zeros (an optimizer in backward would step)
        hooked = any(p._post_accumulate_grad_hooks or p._backward_hooks for p in params)
        if any(sparse) or len(kinds) != 1 or hooked or self._use_python_reducer:
            return self._find_unused(None, register_hook=False)
        try:
            buckets = self._layout(params, sparse, torchft)
            # A rebuild fills buckets in the order the parameters become
            # ready, each up to its cap: with each bucket's own size as its
            # cap, marking the parameters ready bucket after bucket rebuilds
            # exactly the layout.
            self._init_reducer(params, sparse, _sizes(params, buckets))
            order = [i for b in buckets for i in b]
            if _mark_ready(self.reducer, params, order) != order:
                return self._find_unused(None, register_hook=False)
            rebuilt = self.reducer._rebuild_buckets()
        except (AttributeError, TypeError, RuntimeError):  # another torch's DDP
            return self._find_unused(None, register_hook=False)
        if not rebuilt or _layout_of(self.reducer, params) != buckets:
            return self._find_unused(None, register_hook=False)
        self._has_rebuilt_buckets = True
        self._buckets = buckets
        return True

    def _layout(
        self, params: List[torch.Tensor], sparse: List[bool], torchft: bool
    ) -> List[List[int]]:
        """Buckets (indices into ``params``, ascending) in the order they
        are reduced, cut with this DDP's bucket size limits."""
        limits, _ = self._bucket_config.compute_bucket_size_limits(
            static_graph=False, find_unused_parameters=True
        )
        if torchft:
            # DDP's first buckets when it searches for unused parameters
            # (it never rebuilds them): filled from the first parameter,
            # the last bucket reduced first
            assignment, _ = dist._compute_bucket_assignment_by_size(params, limits, sparse)
            return [list(b) for b in reversed(assignment)]
        # what DDP's own rebuild makes when gradients become ready from the
        # last parameter to the first: the first, small bucket starts its
        # allreduce early in backward and the last one is not larger than
        # it has to be
        rev = list(range(len(params) - 1, -1, -1))
        buckets, _ = dist._compute_bucket_assignment_by_size(
            [params[i] for i in rev], limits, [sparse[i] for i in rev], rev
        )
        return [sorted(b) for b in buckets]

    def _init_reducer(
        self, params: List[torch.Tensor], sparse: List[bool], caps: Optional[List[int]]
    ) -> None:
        """(Re)builds the reducer with DDP's own helper; ``caps`` are the
        buckets' size limits in the order DDP fills them."""
        old = self.reducer
        names = self._build_debug_param_to_name_mapping(params)
        if caps is None:
            self._ddp_init_helper(params, sparse, names, self.static_graph)
        else:
            config = self._bucket_config
            self._bucket_config = type(config)(
                bucket_bytes_cap=config.bucket_bytes_cap,
                per_bucket_bytes_caps=tuple(caps),
                first_bucket_bytes_cap=config.first_bucket_bytes_cap,
            )
            try:
                self._ddp_init_helper(params, sparse, names, self.static_graph)
            finally:
                self._bucket_config = config
        old._remove_autograd_hooks()

    def _find_unused(self, buckets: Optional[List[List[int]]], register_hook: bool) -> bool:
        """Rebuilds the reducer to search for unused parameters after every
        forward, as torchft's DDP does, keeping ``buckets`` (default:
        torchft's)."""
        self.find_unused_parameters = True
        params, sparse = self._build_params_for_reducer()
        # such a reducer keeps the buckets it starts with, which DDP fills
        # from the first parameter and reduces last bucket first
        caps = None if buckets is None else list(reversed(_sizes(params, buckets)))
        self._init_reducer(params, sparse, caps)
        if buckets is not None and _layout_of(self.reducer, params) != buckets:
            raise RuntimeError("DistributedDataParallel: the buckets changed; report this as a bug")
        self._buckets = None
        if register_hook:
            self.logger._set_comm_hook_name(self._comm_hook.__qualname__)
            dist._register_comm_hook(self.reducer, self._hook_state, self._comm_hook)
        return False

    def _settle(self) -> None:
        """Called before the commit vote and before each forward: if the
        last backward left a bucket unreduced (a parameter got no
        gradient), allreduces the buckets this replica owes, fails the
        step here and switches to searching for unused parameters."""
        state = self._hook_state
        if self.find_unused_parameters:
            return
        try:
            self.reducer._check_reducer_finalized()
        except RuntimeError:
            pass
        else:
            state.next_bucket = 0
            return
        # a backward that raised before its end left its buckets pending
        state.finish()
        missing = self.reducer._get_zeros_like_grad_buckets()[state.next_bucket :]
        for bucket in missing:
            _fill(bucket)
            self._comm_hook(state, bucket).wait()
        state.next_bucket = 0
        self._find_unused(self._buckets, register_hook=True)
        state.manager.report_error(
            RuntimeError(
                "DistributedDataParallel: a parameter received no gradient in this step, "
                f"so {len(missing)} bucket(s) were not reduced; this replica does not commit "
                "the step (it heals at the next quorum) and DDP now searches for unused "
                "parameters after every forward (find_unused_parameters=True)"
            )
        )

    @staticmethod
    def _comm_hook(
        state: _HookState, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        state.next_bucket = bucket.index() + 1
        manager = state.manager
        buffer = bucket.buffer()
        buckets = state.buckets
        if buckets is not None and not torch.accelerator.is_available():
            # Nothing to order on a stream: one future that DDP waits for
            # at the end of backward, so this bucket's allreduce overlaps
            # the gradients of the next buckets.
            if state.defer:
                if bucket.index() == 0:
                    # a backward that raised midway left its finishers:
                    # its futures are dropped with its graph
                    state.finishers = []
                    try:
                        Variable._execution_engine.queue_callback(state.finish)
                    except RuntimeError:  # not inside backward (DDP's join)
                        return buckets.allreduce(buffer)
                elif not state.finishers:
                    return buckets.allreduce(buffer)
                return buckets.allreduce_deferred(buffer, state.finishers)
            return buckets.allreduce(buffer)
        work = manager.allreduce(buffer)
        if not work.wait():
            # The step already failed (the manager knows): hand DDP the
            # bucket unchanged rather than failing backward().
            return _completed(buffer)
        fut = work.get_future()
        if not isinstance(fut, _ManagedFuture):
            return cast(torch.futures.Future[torch.Tensor], fut)
        # DDP needs the real torch future, not the lazy chain's handle.
        assert fut._fut is not None, "wait() succeeded but the chain was not built"
        if not isinstance(fut._fut, torch.futures.Future):
            # a manager whose wrap_future is not a real one (a mock): the
            # chain has run, so the bucket holds its result in place
            return _completed(buffer)
        return cast(torch.futures.Future[torch.Tensor], fut._fut)


# ---- the bucket allreduces of the comm hook ---------------------------------


def _bucket_path(manager: object) -> Optional["_Buckets"]:
    """The one-future-per-bucket path for ``manager``'s buckets, or None
    where the comm hook must go through ``manager.allreduce``.  The path
    stands for the ``allreduce`` of stepguard's :class:`Manager` only: a
    manager whose ``allreduce`` is that method, not overridden by a
    subclass nor replaced on the instance.  Anything else (a subclass that
    overrides ``allreduce``, an instance whose ``allreduce`` was replaced,
    a mock: ``create_autospec(Manager)`` answers every method with a mock)
    gets the public path, as torchft's DDP does."""
    if "allreduce" in getattr(manager, "__dict__", {}):
        return None
    for klass in type(manager).__mro__:
        if "allreduce" in vars(klass):
            return _Buckets(cast(Manager, manager)) if klass is Manager else None
    return None


class _Buckets:
    """What ``manager.allreduce(tensor)`` followed by waiting on its future
    gives, as one future per bucket, for DDP's comm hook without an
    accelerator stream: ``tensor`` averaged over the participants in
    place, within the manager's deadline, a failure swallowed (the step is
    marked failed and the future still yields ``tensor``).

    Args:
        manager: the Manager whose process group, quorum, timeout and
            error state the buckets use.
    """

    __slots__ = ("_manager", "_sum_opts", "_avg_opts", "_deadlines")

    def __init__(self, manager: "Manager") -> None:
        self._manager = manager
        # the allreduce's options (read by c10d at each call)
        self._sum_opts = AllreduceOptions()
        self._sum_opts.reduceOp = ReduceOp.SUM
        self._avg_opts = AllreduceOptions()
        self._avg_opts.reduceOp = ReduceOp.AVG
        self._deadlines = _BucketDeadlines()

    def _start(
        self, tensor: torch.Tensor, deferred: bool
    ) -> Optional[Tuple[Any, int, bool]]:
        """Starts the allreduce of a DDP bucket (zeros from a replica that
        does not participate).  Returns what completes it, what to divide
        the result by (0: the group averaged it itself) and whether the
        first is the work (asked for with ``deferred``, and only when its
        ``wait(timeout)`` is known to give up at the timeout) or its
        future; None when the step already failed or the collective did
        not start (recorded as the step's error)."""
        m = self._manager
        if m._errored is not None:
            return None
        m.wait_quorum()
        num_participants = m.num_participants()
        if not m.is_participating():
            tensor.zero_()
        if not torch.is_floating_point(tensor):
            raise ValueError("average reduce op is only supported for floating point tensors")
        opts, divisor = self._sum_opts, num_participants
        pg = m._pg
        if getattr(pg, "_avg_is_sum_then_divide", False) and pg.size() == num_participants:
            # every member takes part: the group's own AVG gives the same
            # bits and divides as it reduces (no pass over the bucket after)
            opts, divisor = self._avg_opts, 0
        try:
            work = pg.allreduce([tensor], opts)
            if deferred and _waits_with_deadline(work):
                return work, divisor, True
            return work.get_future(), divisor, False
        except Exception as e:  # noqa: BLE001 - a failed step, not a crash
            m._logger.exception(f"got exception in all reduce -- skipping remaining: {e}")
            m.report_error(e)
            return None

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """The bucket's future, completed on the process group's thread.

        One callback runs when the collective completes, on the process
        group's thread; ``allreduce``'s lazy chain runs four there (the
        deadline, the error swallowing, the average and DDP's), each taking
        the GIL from backward.  The deadlines of all buckets share one
        timer (``_BucketDeadlines``).
        """
        started = self._start(tensor, deferred=False)
        if started is None:
            return _completed(tensor)
        return self._complete_on_thread(started[0], tensor, started[1])

    def _complete_on_thread(
        self, fut: torch.futures.Future[object], tensor: torch.Tensor, divisor: int
    ) -> torch.futures.Future[torch.Tensor]:
        """The future of ``allreduce`` for a started collective's future
        ``fut``: completed by one callback on the thread that completes
        ``fut``, or by the shared timer at the deadline."""
        out: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        lock = threading.Lock()
        settled = [False]

        def settle(err: Optional[Exception]) -> None:
            with lock:
                if settled[0]:
                    return
                settled[0] = True
            self._done(err, tensor, divisor, out)

        timeout = self._manager._timeout

        def on_timeout() -> None:
            settle(TimeoutError(f"future did not complete within {timeout}"))

        deadlines = self._deadlines
        key = deadlines.add(timeout.total_seconds(), on_timeout)

        def on_done(f: torch.futures.Future[object]) -> None:
            deadlines.remove(key)
            try:
                f.value()
            except Exception as e:  # noqa: BLE001 - swallowed on purpose
                settle(e)
                return
            settle(None)

        fut.add_done_callback(on_done)
        return out

    def allreduce_deferred(
        self, tensor: torch.Tensor, finishers: List[Callable[[], None]]
    ) -> torch.futures.Future[torch.Tensor]:
        """``allreduce`` whose completion is left to the caller: the
        collective is started, and a finisher appended to ``finishers``
        waits for it (within the manager's deadline, counted from now),
        swallows a failure into ``report_error``, divides by the
        participants and completes the returned future.

        DDP's comm hook runs the finishers on backward's own thread at the
        end of backward, before DDP waits for the futures: the process
        group's thread then runs no Python at all, so it never takes the
        GIL from backward (each bucket's completion did, and a thread that
        Python does not know builds and frees a thread state each time).
        The division costs the same on either thread.
        """
        started = self._start(tensor, deferred=True)
        if started is None:
            return _completed(tensor)
        work, divisor, deferred = started
        if not deferred:
            # a work whose wait may not give up at a timeout (a wrapper's):
            # its future and the shared timer keep the deadline instead
            return self._complete_on_thread(work, tensor, divisor)
        out: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        timeout = self._manager._timeout
        deadline = time.monotonic() + timeout.total_seconds()

        def finish() -> None:
            err: Optional[Exception] = None
            left = deadline - time.monotonic()
            try:
                if left <= 0 or not work.wait(timedelta(seconds=left)):
                    err = TimeoutError(f"future did not complete within {timeout}")
            except Exception as e:  # noqa: BLE001 - swallowed on purpose
                err = (
                    TimeoutError(f"future did not complete within {timeout}: {e}")
                    if time.monotonic() >= deadline
                    else e
                )
            self._done(err, tensor, divisor, out)

        finishers.append(finish)
        return out

    def _done(
        self,
        err: Optional[Exception],
        tensor: torch.Tensor,
        divisor: int,
        out: torch.futures.Future[torch.Tensor],
    ) -> None:
        """Ends a DDP bucket: its failure (if any) fails the step, the
        result is divided (as ``allreduce``'s chain: whatever the tensor
        holds, failed or not; 0 when the group averaged) and ``out`` gets
        the tensor."""
        if err is not None:
            m = self._manager
            m._logger.exception(f"got exception in future -- skipping remaining: {err}")
            m.report_error(err)
        if divisor > 0:
            _average(tensor, divisor)
        out.set_result(tensor)


def _waits_with_deadline(work: object) -> bool:
    """Whether ``work.wait(timeout)`` is known to give up at the timeout:
    c10d's own works (Gloo's, NCCL's) and works that say so
    (``ProcessGroupTCP``'s).  A Python work may wait without one."""
    return type(work).wait is Work.wait or getattr(work, "_wait_honours_timeout", False)



class _BucketDeadlines:
    """The deadlines of the bucket allreduces in flight, served by one
    timer: arming a timer per bucket cost a heap push under the timer's
    lock on backward's thread, and kept every bucket's callbacks alive for
    the whole timeout after it completed.  A deadline fires exactly when
    its own timeout has passed; the timer is re-armed at the earliest one
    still pending."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: Dict[int, Tuple[float, Callable[[], None]]] = {}
        self._seq = itertools.count()
        self._armed: Optional[float] = None  # when the armed timer fires
        # the process's timer when armed: a forked child gets a new one,
        # with nothing armed (compared instead of getpid(), a system call)
        self._timer: object = None

    def add(self, timeout_s: float, on_timeout: Callable[[], None]) -> int:
        """Calls ``on_timeout`` (on a timer thread) in ``timeout_s``
        seconds unless ``remove`` is called first; returns the key."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        with self._lock:
            if self._timer is not _futures._TIMER:
                self._armed = None
            key = next(self._seq)
            self._pending[key] = (deadline, on_timeout)
            if self._armed is None or deadline < self._armed:
                self._arm(deadline)
        return key

    def remove(self, key: int) -> None:
        """Cancels the deadline ``key`` (no effect once it fired)."""
        with self._lock:
            self._pending.pop(key, None)

    def _arm(self, deadline: float) -> None:
        self._armed = deadline
        self._timer = _futures._TIMER
        _call_later(timedelta(seconds=max(deadline - time.monotonic(), 0.0)), self._fire)

    def _fire(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._armed = None
            due = [k for k, (d, _) in self._pending.items() if d <= now]
            callbacks = [self._pending.pop(k)[1] for k in due]
            if self._pending:
                self._arm(min(d for d, _ in self._pending.values()))
        for cb in callbacks:
            cb()


def _mark_ready(reducer: Any, params: List[torch.Tensor], order: List[int]) -> List[int]:
    """Runs one backward of zeros through ``reducer`` (before any comm
    hook: its world-of-one group reduces them in place) in which the
    parameters become ready in ``order``; restores their gradients and
    returns the order they actually became ready in."""
    fired: List[int] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda _p, i=i: fired.append(i))
        for i, p in enumerate(params)
    ]
    grads: List[Optional[torch.Tensor]] = [p.grad for p in params]
    try:
        reducer.prepare_for_backward([])
        with torch.enable_grad():
            # The engine runs independent branches latest-built first:
            # build them in reverse.
            terms = [(params[i].reshape(-1)[:1] * 0).sum() for i in reversed(order)]
            torch.autograd.backward(torch.stack(terms).sum())
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, grads):
            p.grad = g
    return fired


def _fill(bucket: dist.GradBucket) -> None:
    """Writes this replica's gradients into a zeroed copy of ``bucket``,
    zeros where a parameter has none: what the search for unused
    parameters would have handed the allreduce, so that the other
    replicas' average is exact."""
    buffer = bucket.buffer()
    params = bucket.parameters()
    if sum(p.numel() for p in params) != buffer.numel():
        return  # laid out with gaps: leave it zero
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is not None:
            buffer[offset : offset + n].copy_(p.grad.reshape(-1))
        offset += n


def _sizes(params: List[torch.Tensor], buckets: List[List[int]]) -> List[int]:
    return [sum(params[i].numel() * params[i].element_size() for i in b) for b in buckets]


def _layout_of(reducer: Any, params: List[torch.Tensor]) -> List[List[int]]:
    """The reducer's buckets, in the order it reduces them, as indices
    into ``params``."""
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in b.parameters()] for b in reducer._get_zeros_like_grad_buckets()]


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut
class PureDistributedDataParallel(nn.Module):
    """A model wrapper that allreduces each gradient as soon as it is
    accumulated (one allreduce per parameter; slow for large models).

    Args:
        manager: the stepguard Manager.
        module: the model.
    """

    def __init__(self, manager: "Manager", module: nn.Module) -> None:
        super().__init__()
        self.module = module

        def post_grad_hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                # torchft does not wait here, so the averaging callback of
                # the lazy work never runs and gradients stay summed; waiting
                # makes the gradient the average before the optimizer reads it.
                manager.allreduce(p.grad).wait()

        for p in module.parameters():
            p.register_post_accumulate_grad_hook(post_grad_hook)

    def forward(self, *args: object) -> object:
        return self.module(*args)
