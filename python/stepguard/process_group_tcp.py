"""ProcessGroupTCP: stepguard's native TCP collectives as a process group.

A :class:`stepguard.process_group.ProcessGroup` (torchft's interface) over
libstepguard's communicator (``include/stepguard/comm.h``): every collective
is asynchronous with a deadline (the group's ``timeout``), gives identical
bits on every rank, and fails with the failing peer's rank in the message
when a peer dies.  ``abort()`` from any thread fails everything in flight at
once.  Each ``configure()`` builds a new communicator for the new quorum;
the old one is torn down.

Rendezvous goes through the store address that ``configure`` receives
(``host:port/prefix``): every rank listens on an ephemeral port and
publishes ``host:port`` under its rank; the quorum id is the communicator's
generation and the prefix its job name, so a peer of another quorum or job
is refused at the handshake.  The advertised host is the local address that
routes to the store (``STEPGUARD_COMM_HOST`` overrides it); the token in
``STEPGUARD_AUTH_TOKEN``, when set, must match on every rank.

Liveness: besides the operation deadline, an operation that waits on a peer
from which nothing at all (no data, no keepalive) came for the progress
timeout (2 s by default, ``STEPGUARD_COMM_PROGRESS_TIMEOUT_SEC``, 0 = off)
fails naming the peer, so a hung or cut-off peer costs seconds, not the
operation timeout.  Live peers send keepalives even while they compute.

Tensors: CPU tensors that are contiguous are used in place.  Tensors on an
accelerator are staged through a contiguous host copy: the copy is made
when the operation is issued (which synchronises with the tensor's stream)
and written back before the work completes.  Non-contiguous tensors are
refused with a ``ValueError`` by the operations where torch's Gloo refuses
them or silently computes the wrong result (allreduce, reduce_scatter's
output, alltoall_base, send, recv) and staged like accelerator tensors by
those where Gloo handles them correctly (broadcast, allgather,
reduce_scatter's inputs, alltoall), so a script that works with Gloo works
here (docs/internals/comm.md).

It is also a torch.distributed backend: ``init_process_group(backend=
"stepguard_tcp", ...)`` builds one over the default store.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
import zlib
from datetime import timedelta
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp, Store
from torch.futures import Future

from stepguard import _C, config
from stepguard.process_group import (
    ProcessGroup,
    _split_store_addr,
    create_store_client,
)

__all__ = ["ProcessGroupTCP", "BACKEND_NAME"]

logger: logging.Logger = logging.getLogger(__name__)

#: The name under which the group is registered with torch.distributed.
BACKEND_NAME = "stepguard_tcp"

_DTYPES = {
    torch.float32: _C.COMM_F32,
    torch.float64: _C.COMM_F64,
    torch.float16: _C.COMM_F16,
    torch.bfloat16: _C.COMM_BF16,
    torch.int8: _C.COMM_I8,
    torch.uint8: _C.COMM_U8,
    torch.int32: _C.COMM_I32,
    torch.int64: _C.COMM_I64,
}

_OPS = (
    (ReduceOp.SUM, _C.COMM_SUM),
    (ReduceOp.AVG, _C.COMM_AVG),
    (ReduceOp.MIN, _C.COMM_MIN),
    (ReduceOp.MAX, _C.COMM_MAX),
    (ReduceOp.PRODUCT, _C.COMM_PRODUCT),
)


def _quant_redop(op: object) -> int:
    op = getattr(op, "reduceOp", op)
    if op == ReduceOp.SUM:
        return _C.COMM_SUM
    if op == ReduceOp.AVG:
        return _C.COMM_AVG
    raise NotImplementedError(
        f"quantized collectives support ReduceOp.AVG and ReduceOp.SUM only, got {op}"
    )


def _redop(opts: object) -> int:
    op = getattr(opts, "reduceOp", opts)
    for torch_op, ours in _OPS:
        if op == torch_op:
            return ours
    raise ValueError(f"ProcessGroupTCP does not support reduce op {op}")


def _dtype(t: torch.Tensor) -> int:
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise TypeError(
            f"ProcessGroupTCP cannot reduce {t.dtype}; supported: "
            + ", ".join(str(d) for d in _DTYPES)
        ) from None


def _check_tag(tag: int) -> None:
    if tag != 0:
        raise ValueError(
            f"ProcessGroupTCP matches send/recv in order per pair of ranks and "
            f"does not match by tag; tag must be 0, got {tag}"
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _advertise_host(store_host: Optional[str]) -> str:
    """The local address that peers can reach: ``STEPGUARD_COMM_HOST`` (the
    collectives' own override, used as given), else by the rule every
    stepguard server follows: ``STEPGUARD_ADVERTISE_HOST`` (an interface
    name there becomes its address), else the local address that routes to
    the store."""
    own = config.get("STEPGUARD_COMM_HOST")
    if own:
        return own
    fallback = None
    target = store_host or config.get("MASTER_ADDR")
    if target:
        try:
            family = socket.AF_INET6 if ":" in target else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))  # no packet is sent
                fallback = s.getsockname()[0]
        except OSError:
            pass
    if fallback is None:
        fallback = socket.gethostbyname(socket.gethostname())
    return _C.advertised_host(fallback=fallback)


class _Staged:
    """The contiguous host buffers of one operation and their write-backs."""

    def __init__(self) -> None:
        self.keep: List[torch.Tensor] = []
        self.writebacks: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def buf(self, t: torch.Tensor, write: bool, refuse: Optional[str] = None) -> torch.Tensor:
        """A contiguous CPU tensor with t's bytes; written back to t at
        completion when ``write``.

        Args:
            refuse: the operation's name where a non-contiguous ``t`` is
                refused rather than staged (the module docstring says which).
        """
        if refuse is not None and not t.is_contiguous():
            raise ValueError(
                f"{refuse}: non-contiguous tensor (shape {tuple(t.shape)}, "
                f"stride {t.stride()}) refused; pass tensor.contiguous() and "
                "copy the result back"
            )
        if t.device.type == "cpu" and t.is_contiguous():
            b = t
        else:
            b = t.detach().to("cpu", memory_format=torch.contiguous_format)
            b = b.contiguous()
            if write:
                self.writebacks.append((t, b))
        self.keep.append(b)
        return b

    def write_back(self) -> None:
        for dst, src in self.writebacks:
            dst.copy_(src)


# How long wait() gives an operation past its own deadline before it gives
# up on the progress thread's answer.
_WAIT_MARGIN = timedelta(seconds=10)

_DEFAULT_PROGRESS_TIMEOUT = timedelta(seconds=2)


def _progress_timeout_ms(progress_timeout: Optional[timedelta]) -> int:
    """The C option ``progress_timeout_ms``: the environment variable, else
    the argument, else 2 s (the environment wins, as with the Manager's
    timeouts); a zero timeout turns the check off (-1 in C, where 0 means
    the default)."""
    env = config.get("STEPGUARD_COMM_PROGRESS_TIMEOUT_SEC", default=None)
    if env is not None:
        progress_timeout = timedelta(seconds=env)
    elif progress_timeout is None:
        progress_timeout = _DEFAULT_PROGRESS_TIMEOUT
    ms = int(progress_timeout.total_seconds() * 1000)
    return ms if ms > 0 else -1


class _TCPWork(dist._Work):
    """The work of one call: completes when its C operations have.

    ``wait()`` raises the operation's error (``TimeoutError`` for a
    deadline, ``RuntimeError`` naming the failed peer otherwise); the
    future resolves to ``result`` or fails with the same exception.
    """

    def __init__(
        self, pg: "ProcessGroupTCP", result: object, staged: _Staged, nops: int
    ) -> None:
        super().__init__()
        self._pg = pg
        self._result = result
        self._staged = staged
        self._left = nops
        self._exc: Optional[BaseException] = None
        self._event = threading.Event()
        self._future: Optional[Future[object]] = None  # made on request
        self._settled = False
        self._lock = threading.Lock()

    # -- runs on the communicator's progress thread, with the GIL --
    def _on_done(self, rc: int, msg: str) -> None:
        with self._lock:
            if rc and self._exc is None:
                self._exc = _exception(rc, msg)
            self._left -= 1
            last = self._left == 0
        if not last:
            return
        if self._staged.writebacks:
            self._pg._completions.put(self)  # copy back off this thread
            return
        self._release()  # nothing to copy: wake waiters now
        with self._lock:
            wanted = self._future is not None
        if wanted:
            self._pg._completions.put(self)

    def _release(self) -> None:
        if self._exc is not None and not getattr(self._exc, "data_error", False):
            self._pg._record_error(self._exc)
        self._event.set()

    # -- runs on the group's completion thread: futures' callbacks run
    # there (or in the thread asking for a finished work's future), never
    # on the progress thread --
    def _finish(self) -> None:
        if not self._event.is_set():
            if self._exc is None:
                try:
                    self._staged.write_back()
                except Exception as e:  # noqa: BLE001 - reported to the waiter
                    self._exc = e
            self._release()
        self._settle()

    def _settle(self) -> None:
        with self._lock:
            fut = self._future
            if fut is None or self._settled:
                return
            self._settled = True
        if self._exc is not None:
            fut.set_exception(self._exc)
        else:
            fut.set_result(self._result)

    # wait(timeout) gives up at the timeout (the Manager relies on it)
    _wait_honours_timeout = True

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Blocks until the operation is done and raises its error.

        Without ``timeout`` it relies on the operation's own deadline (the
        group's timeout, enforced in C, which names the peer it waited
        for), with a safety margin.  When ``timeout`` (or the margin)
        expires first, the group is aborted: the members are out of step.
        """
        if timeout is not None and timeout <= timedelta(0):
            # c10d's kNoTimeout (what its C++ callers pass by default)
            timeout = None
        limit = timeout if timeout is not None else self._pg._timeout + _WAIT_MARGIN
        if not self._event.wait(max(limit.total_seconds(), 0.0)):
            exc = TimeoutError(f"work did not complete within {limit}")
            self._pg._record_error(exc)
            self._pg.abort()
            raise exc
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._exc is None

    def exception(self) -> Optional[BaseException]:  # type: ignore[override]
        return self._exc

    def get_future(self) -> Future[object]:
        """A future of the result; made on first request (so works that are
        only waited on cost no future)."""
        with self._lock:
            if self._future is None:
                self._future = Future()
            fut = self._future
        if self._event.is_set():
            self._settle()
        return fut


def _exception(rc: int, msg: str) -> Exception:
    if rc in (_C.ETIMEDOUT, _C.ECANCELED):
        return TimeoutError(msg)
    exc = _C.Error(msg)
    exc.code = rc
    # EINVAL from a running operation: its data (a NaN in a quantized
    # collective) failed it on every member alike; the group is healthy
    exc.data_error = rc == _C.EINVAL
    return exc


# Quantized formats: names, as STEPGUARD_QUANTIZE lists them, and the C
# constants.
QUANT_FORMATS = {"fp8": _C.QUANT_FP8, "int8": _C.QUANT_INT8}
# The quantized collectives' wire layout, advertised with each format
# ("fp8@2"): members whose layouts differ share no format and fall back to
# full precision together instead of failing on each other's frames.
# Version 1 (advertised without a suffix) sent each part whole; version 2
# sends it in pieces, each with its own header.
QUANT_WIRE = 2


def _advertised_formats() -> List[str]:
    """The formats this member advertises, preferred first, each tagged
    with the wire layout (``name@QUANT_WIRE``)."""
    raw = config.get("STEPGUARD_QUANTIZE") or ""
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    return [f"{n}@{QUANT_WIRE}" for n in dict.fromkeys(names) if n in QUANT_FORMATS]


def _agree(advertised: List[Optional[str]]) -> Tuple[Optional[str], str]:
    """The quantized format of a group whose member r advertised
    ``advertised[r]`` (comma-separated, or None when it said nothing): the
    first of rank 0's formats that every member lists; else None and why."""
    lists = [None if a is None else [f for f in a.split(",") if f] for a in advertised]
    silent = [r for r, l in enumerate(lists) if not l]
    if silent:
        return None, (
            f"member(s) {silent} of the quorum do not advertise quantized "
            "collectives (another version, or STEPGUARD_QUANTIZE empty)"
        )
    for f in lists[0] or []:
        name, _, wire = f.partition("@")
        if name in QUANT_FORMATS and wire == str(QUANT_WIRE) and all(f in l for l in lists):
            return name, ""
    return None, (
        f"the members advertise no common quantized format at wire version "
        f"{QUANT_WIRE} (another stepguard version?): {advertised}"
    )


class ProcessGroupTCP(ProcessGroup):
    """Fault-tolerant collectives over TCP, with torchft's interface.

    Args:
        timeout: the deadline of every operation and of ``configure``'s
            rendezvous (a float is seconds).
        progress_timeout: how long an operation waits on a peer that sends
            nothing at all (no data, no keepalive) before it fails naming
            that peer (a float is seconds; zero turns it off); 2 s by
            default.  ``STEPGUARD_COMM_PROGRESS_TIMEOUT_SEC``, when set,
            overrides it.  Keep it the same on every rank and well below
            ``timeout``.
    """

    def __init__(
        self,
        timeout: Union[timedelta, float] = timedelta(seconds=60),
        progress_timeout: Union[timedelta, float, None] = None,
        *,
        _rank_size: Tuple[int, int] = (0, 1),
    ) -> None:
        # c10d's view of the group (rank, size): a group of one until
        # configured, except when built as a fixed c10d backend, whose
        # size c10d's own helpers read (DDP's parameter check sizes its
        # allgather from it)
        super().__init__(*_rank_size)
        if not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=timeout)
        self._timeout = timeout
        if progress_timeout is not None and not isinstance(
            progress_timeout, timedelta
        ):
            progress_timeout = timedelta(seconds=progress_timeout)
        self._progress_timeout_ms = _progress_timeout_ms(progress_timeout)
        self._comm: Optional[_C.Comm] = None
        self._connecting: Optional[_C.Comm] = None  # being built by configure
        self._aborts = 0  # abort() calls so far: a configure watches it
        self._rank = 0
        self._world_size = 0
        self._quorum_id: Optional[int] = None
        self._errored: Optional[Exception] = None
        self._lock = threading.Lock()
        self._completions: "queue.SimpleQueue[Optional[_TCPWork]]" = queue.SimpleQueue()
        self._completer: Optional[threading.Thread] = None
        self._quant: Tuple[Optional[str], str] = (None, "the group is not configured")

    # -- configuration ----------------------------------------------------------

    # AVG sums, then divides each element by the number of members (as it
    # reduces): the bits of a SUM followed by a division, which the Manager
    # relies on to let the group average a DDP bucket itself
    _avg_is_sum_then_divide = True

    def getBackendName(self) -> str:
        return "stepguard-tcp"

    def size(self) -> int:
        return self._world_size

    def rank(self) -> int:  # type: ignore[override]
        return self._rank

    def set_timeout(self, timeout: timedelta) -> None:  # type: ignore[override]
        self._timeout = timeout

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: Optional[int] = None,
        group_rank: Optional[int] = None,
        group_world_size: Optional[int] = None,
        global_ranks: Optional[List[int]] = None,
    ) -> None:
        """Builds a new communicator for ``world_size`` members through the
        store at ``store_addr`` (``host:port/prefix``); blocks until every
        member is connected or the timeout passes.  The previous
        communicator is aborted and closed first."""
        self._replica_id = replica_id
        if group_rank is not None:
            self._group_rank = group_rank
        if group_world_size is not None:
            self._group_world_size = group_world_size
        self._drop_comm()
        host, _, prefix = _split_store_addr(store_addr)
        store = create_store_client(store_addr, timeout=self._timeout)
        generation = (
            quorum_id if quorum_id is not None else zlib.crc32(prefix.encode())
        )
        self._quorum_id = quorum_id
        self._connect(store, rank, world_size, generation, prefix, host)

    def _connect(
        self,
        store: Store,
        rank: int,
        world_size: int,
        generation: int,
        job: str,
        store_host: Optional[str],
    ) -> None:
        token = config.auth_token(None)
        comm = _C.Comm(
            rank,
            world_size,
            generation & 0xFFFFFFFFFFFFFFFF,
            job.encode()[-256:].decode(errors="ignore"),
            token,
            progress_timeout_ms=self._progress_timeout_ms,
        )
        with self._lock:
            self._connecting = comm
            aborts = self._aborts
        try:
            addr = f"{_advertise_host(store_host)}:{comm.port()}"
            keys = [f"stepguard_comm/{r}" for r in range(world_size)]
            # the quantized formats go first: a member's address in the
            # store means its formats are there too, if it has any (a
            # member of another version writes none): every member reads
            # the same answer, without waiting for a key that may not come
            qkeys = [f"stepguard_comm_quant/{r}" for r in range(world_size)]
            store.set(qkeys[rank], ",".join(_advertised_formats()))
            store.set(keys[rank], addr)
            self._wait_keys(store, keys, aborts)
            addrs = [store.get(k).decode() for k in keys]
            quant = _agree(
                [store.get(k).decode() if store.check([k]) else None for k in qkeys]
            )
            comm.connect(addrs, self._timeout.total_seconds())
        except BaseException:
            with self._lock:
                self._connecting = None
            comm.close()
            raise
        with self._lock:
            self._connecting = None
            self._comm = comm
            self._rank = rank
            self._world_size = world_size
            self._errored = None
            self._quant = quant

    def _wait_keys(self, store: Store, keys: List[str], aborts: int) -> None:
        """Waits for every key like ``store.wait``, in short slices so that
        ``abort()`` stops it."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        pause = 0.001
        while not store.check(keys):
            if self._aborts != aborts:
                raise RuntimeError("configure aborted while waiting for peers")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [k for k in keys if not store.check([k])]
                raise TimeoutError(
                    f"timed out after {self._timeout} waiting for peers to "
                    f"publish {missing}"
                )
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)

    def _drop_comm(self) -> None:
        with self._lock:
            comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()
            comm.close()

    # -- lifecycle ----------------------------------------------------------------

    def abort(self) -> None:
        """Fails every operation in flight (within 100 ms), and a
        ``configure`` in progress, and refuses new operations until the
        next ``configure``."""
        with self._lock:
            self._aborts += 1
            comms = [c for c in (self._comm, self._connecting) if c is not None]
            if self._errored is None:
                self._errored = RuntimeError("aborted")
        for comm in comms:
            comm.abort()  # a configure in progress fails at once too

    def shutdown(self) -> None:
        """Cancels queued operations and closes the communicator."""
        self._drop_comm()
        completer = self._completer
        if completer is not None:
            self._completions.put(None)
            completer.join(timeout=10)
            self._completer = None

    def errored(self) -> Optional[Exception]:
        """The error that broke the current communicator, or None."""
        return self._errored

    def _record_error(self, exc: BaseException) -> None:
        with self._lock:
            if self._errored is None and isinstance(exc, Exception):
                self._errored = exc

    def __del__(self) -> None:
        try:
            self._drop_comm()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- issuing ----------------------------------------------------------------------

    def _completion_loop(self) -> None:
        while True:
            work = self._completions.get()
            if work is None:
                return
            try:
                work._finish()
            except Exception:  # noqa: BLE001 - never lose the thread
                logger.exception("completing a ProcessGroupTCP work failed")

    def _issue(
        self,
        result: object,
        staged: _Staged,
        calls: Sequence[Callable[[Callable[[int, str], None]], None]],
    ) -> _TCPWork:
        """Runs each call with the work's completion callable."""
        with self._lock:
            comm = self._comm
            if comm is None:
                raise RuntimeError("ProcessGroupTCP is not configured")
            if self._completer is None or not self._completer.is_alive():
                self._completer = threading.Thread(
                    target=self._completion_loop,
                    name="stepguard-tcp-completion",
                    daemon=True,
                )
                self._completer.start()
        work = _TCPWork(self, result, staged, max(len(calls), 1))
        if not calls:
            work._on_done(0, "")
        issued = 0
        try:
            for call in calls:
                call(work._on_done)
                issued += 1
        except Exception as e:
            self._record_error(e)
            for _ in range(len(calls) - issued):
                work._on_done(_C.ECANCELED, str(e))
            if issued == 0:
                raise
        return work

    def _t(self) -> float:
        return self._timeout.total_seconds()

    def uses_same_host(self, peer: int) -> bool:
        """Whether payloads from rank ``peer`` of the current quorum are
        copied straight out of its memory (same-host path: both processes
        on this host, the probe worked, ``STEPGUARD_SAME_HOST`` not ``0``)
        rather than received over TCP.  False before ``configure``."""
        comm = self._comm
        return comm is not None and bool(comm.same_host(peer))

    def quantized_format(self) -> Tuple[Optional[str], str]:
        """The quantized format every member of the current quorum
        advertised (``"fp8"`` or ``"int8"``), agreed when the group was
        configured; or None and the reason (a member advertised none, no
        common format, not configured)."""
        return self._quant

    def allreduce_quantized(
        self, tensors: List[torch.Tensor], op: ReduceOp, fmt: str
    ) -> _TCPWork:
        """Quantized allreduce (SUM or AVG) of ``tensors`` in place, all in
        one operation: they are staged as one float32 buffer (other dtypes
        and devices are converted there and back).  ``fmt`` must be the
        group's :meth:`quantized_format`."""
        comm, code, s = self._require(), _quant_redop(op), _Staged()
        qfmt = QUANT_FORMATS[fmt]
        if (
            len(tensors) == 1
            and tensors[0].dtype == torch.float32
            and tensors[0].device.type == "cpu"
            and tensors[0].is_contiguous()
        ):
            flat = tensors[0]
            s.keep.append(flat)
        else:
            flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])
            s.keep.append(flat)
            off = 0
            for t in tensors:
                n = t.numel()
                s.writebacks.append((t, flat[off : off + n].view(t.shape)))
                off += n
        n = flat.numel()
        return self._issue(
            tensors,
            s,
            [
                lambda done: comm.allreduce_quantized(
                    flat.data_ptr(), n, qfmt, code, self._t(), done
                )
            ],
        )

    def reduce_scatter_quantized(
        self,
        output: torch.Tensor,
        inputs: List[torch.Tensor],
        op: ReduceOp,
        fmt: str,
    ) -> _TCPWork:
        """Quantized reduce-scatter in torchft's layout: each input, seen as
        rows (a 1-D tensor as a column), is padded with zero rows to a
        multiple of the world size; member r's ``output`` gets, input after
        input, the reduction of rows [r m / W, (r + 1) m / W) of every
        member's padded input (``collectives.allocate_reduce_scatter_output``
        allocates it)."""
        comm, code = self._require(), _quant_redop(op)
        qfmt, w = QUANT_FORMATS[fmt], self._world_size
        parts: List[List[torch.Tensor]] = [[] for _ in range(w)]
        for t in inputs:
            rows = t.detach().reshape(t.shape[0] if t.dim() else 1, -1)
            m = -(-rows.shape[0] // w) * w
            if m == 0 or rows.shape[1] == 0:
                continue  # nothing to reduce, nothing in the output
            padded = torch.zeros((m, rows.shape[1]), dtype=torch.float32)
            padded[: rows.shape[0]].copy_(rows)
            for r, chunk in enumerate(padded.chunk(w)):
                parts[r].append(chunk.reshape(-1))
        flat_in = torch.cat([torch.cat(p) if p else torch.zeros(0) for p in parts])
        count = flat_in.numel() // w if w else 0
        if output.numel() != count:
            raise ValueError(
                f"reduce_scatter_quantized: output has {output.numel()} elements, "
                f"the padded inputs give {count} per member"
            )
        s = _Staged()
        s.keep.append(flat_in)
        if output.dtype == torch.float32 and output.device.type == "cpu" and output.is_contiguous():
            out = output
        else:
            out = torch.empty(count, dtype=torch.float32)
            s.writebacks.append((output, out.view(output.shape)))
        s.keep.append(out)
        return self._issue(
            output,
            s,
            [
                lambda done: comm.reduce_scatter_quantized(
                    flat_in.data_ptr(), out.data_ptr(), count, qfmt, code, self._t(), done
                )
            ],
        )

    def _require(self) -> "_C.Comm":
        comm = self._comm
        if comm is None:
            raise RuntimeError("ProcessGroupTCP is not configured")
        return comm

    # -- collectives --------------------------------------------------------------------

    def allreduce(self, tensors: List[torch.Tensor], opts: object) -> _TCPWork:  # type: ignore[override]
        """Reduces each tensor in place across every member."""
        comm, op, s = self._require(), _redop(opts), _Staged()
        calls = []
        for t in tensors:
            b, dt = s.buf(t, True, "allreduce"), _dtype(t)
            calls.append(
                lambda done, b=b, dt=dt: comm.allreduce(
                    b.data_ptr(), b.numel(), dt, op, self._t(), done
                )
            )
        return self._issue(tensors, s, calls)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: object) -> _TCPWork:  # type: ignore[override]
        return self.allreduce(tensors, opts)

    def broadcast(self, tensor_list: List[torch.Tensor], opts: object) -> _TCPWork:  # type: ignore[override]
        """Copies member ``opts.rootRank``'s tensors to every member."""
        comm, s = self._require(), _Staged()
        root = getattr(opts, "rootRank", opts)
        if not isinstance(root, int):
            raise TypeError("broadcast needs BroadcastOptions or a root rank")
        calls = []
        for t in tensor_list:
            b = s.buf(t, True)
            calls.append(
                lambda done, b=b: comm.broadcast(
                    b.data_ptr(), _nbytes(b), root, self._t(), done
                )
            )
        return self._issue(tensor_list, s, calls)

    def allgather(  # type: ignore[override]
        self,
        output_tensors: List[List[torch.Tensor]],
        input_tensor: List[torch.Tensor],
        opts: object = None,
    ) -> _TCPWork:
        """``output_tensors[i][r]`` receives member r's ``input_tensor[i]``."""
        comm, s = self._require(), _Staged()
        calls = []
        for outs, inp in zip(output_tensors, input_tensor):
            self._check_list(outs, inp, "allgather")
            ib = s.buf(inp, False)
            obs = [s.buf(o, True) for o in outs]
            calls.append(
                lambda done, ib=ib, obs=obs: comm.allgather(
                    ib.data_ptr(),
                    _nbytes(ib),
                    [o.data_ptr() for o in obs],
                    self._t(),
                    done,
                )
            )
        return self._issue(output_tensors, s, calls)

    def allgather_into_tensor_coalesced(  # type: ignore[override]
        self,
        output_tensors: List[torch.Tensor],
        input_tensors: List[torch.Tensor],
        opts: object = None,
    ) -> _TCPWork:
        """Each flat output gets every member's input, in rank order."""
        comm, s = self._require(), _Staged()
        calls = []
        for out, inp in zip(output_tensors, input_tensors):
            if out.numel() != inp.numel() * self._world_size or out.dtype != inp.dtype:
                raise ValueError("allgather_into_tensor: output must be world_size inputs")
            ib, ob = s.buf(inp, False), s.buf(out, True)
            n = _nbytes(ib)
            calls.append(
                lambda done, ib=ib, ob=ob, n=n: comm.allgather(
                    ib.data_ptr(),
                    n,
                    [ob.data_ptr() + r * n for r in range(self._world_size)],
                    self._t(),
                    done,
                )
            )
        return self._issue(output_tensors, s, calls)

    def reduce_scatter(  # type: ignore[override]
        self,
        output_tensors: List[torch.Tensor],
        input_tensors: List[List[torch.Tensor]],
        opts: object,
    ) -> _TCPWork:
        """``output_tensors[i]`` on member r gets the reduction over members
        of their ``input_tensors[i][r]``."""
        comm, op, s = self._require(), _redop(opts), _Staged()
        calls = []
        for out, ins in zip(output_tensors, input_tensors):
            self._check_list(ins, out, "reduce_scatter")
            dt = _dtype(out)
            ob = s.buf(out, True, "reduce_scatter")
            ibs = [s.buf(i, False) for i in ins]
            calls.append(
                lambda done, ob=ob, ibs=ibs, dt=dt: comm.reduce_scatter(
                    [i.data_ptr() for i in ibs],
                    ob.data_ptr(),
                    ob.numel(),
                    dt,
                    op,
                    self._t(),
                    done,
                )
            )
        return self._issue(output_tensors, s, calls)

    def reduce_scatter_tensor_coalesced(  # type: ignore[override]
        self,
        output_tensors: List[torch.Tensor],
        input_tensors: List[torch.Tensor],
        opts: object,
    ) -> _TCPWork:
        """Reduce-scatter of flat inputs (world_size outputs long)."""
        comm, op, s = self._require(), _redop(opts), _Staged()
        calls = []
        for out, inp in zip(output_tensors, input_tensors):
            if inp.numel() != out.numel() * self._world_size or out.dtype != inp.dtype:
                raise ValueError("reduce_scatter_tensor: input must be world_size outputs")
            dt = _dtype(out)
            ob, ib = s.buf(out, True, "reduce_scatter_tensor"), s.buf(inp, False)
            n = _nbytes(ob)
            calls.append(
                lambda done, ob=ob, ib=ib, n=n, dt=dt: comm.reduce_scatter(
                    [ib.data_ptr() + r * n for r in range(self._world_size)],
                    ob.data_ptr(),
                    ob.numel(),
                    dt,
                    op,
                    self._t(),
                    done,
                )
            )
        return self._issue(output_tensors, s, calls)

    def alltoall_base(  # type: ignore[override]
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: List[int],
        input_split_sizes: List[int],
        opts: object = None,
    ) -> _TCPWork:
        """Sends dim-0 split r of the input to member r and receives member
        r's into split r of the output (even splits when none are given)."""
        comm, s = self._require(), _Staged()
        w = self._world_size
        ib = s.buf(input_buffer, False, "alltoall_base")
        ob = s.buf(output_buffer, True, "alltoall_base")

        def layout(t: torch.Tensor, splits: List[int]) -> Tuple[List[int], List[int]]:
            rows = t.shape[0] if t.dim() > 0 else t.numel()
            if not splits:
                if rows % w:
                    raise ValueError("alltoall_base: dim 0 does not split evenly")
                splits = [rows // w] * w
            if len(splits) != w or sum(splits) != rows:
                raise ValueError("alltoall_base: split sizes do not match")
            row = _nbytes(t) // rows if rows else 0
            ptrs, sizes, off = [], [], t.data_ptr()
            for n in splits:
                ptrs.append(off)
                sizes.append(n * row)
                off += n * row
            return ptrs, sizes

        ip, isz = layout(ib, list(input_split_sizes))
        op_, osz = layout(ob, list(output_split_sizes))
        return self._issue(
            output_buffer,
            s,
            [lambda done: comm.alltoall(ip, isz, op_, osz, self._t(), done)],
        )

    def barrier(self, opts: object = None) -> _TCPWork:  # type: ignore[override]
        """Completes once every member has entered the barrier."""
        comm = self._require()
        return self._issue(None, _Staged(), [lambda done: comm.barrier(self._t(), done)])

    def send(self, tensors: List[torch.Tensor], dst_rank: int, tag: int = 0) -> _TCPWork:  # type: ignore[override]
        """Sends each tensor to ``dst_rank``, matched in order per pair;
        a nonzero ``tag`` is refused (there is no matching by tag)."""
        _check_tag(tag)
        comm, s = self._require(), _Staged()
        calls = []
        for t in tensors:
            b = s.buf(t, False, "send")
            calls.append(
                lambda done, b=b: comm.send(b.data_ptr(), _nbytes(b), dst_rank, self._t(), done)
            )
        return self._issue(tensors, s, calls)

    def recv(self, tensors: List[torch.Tensor], src_rank: int, tag: int = 0) -> _TCPWork:  # type: ignore[override]
        """Receives each tensor from ``src_rank`` (matched in order; a
        nonzero ``tag`` is refused)."""
        _check_tag(tag)
        comm, s = self._require(), _Staged()
        calls = []
        for t in tensors:
            b = s.buf(t, True, "recv")
            calls.append(
                lambda done, b=b: comm.recv(b.data_ptr(), _nbytes(b), src_rank, self._t(), done)
            )
        return self._issue(tensors, s, calls)

    def _check_list(self, many: List[torch.Tensor], one: torch.Tensor, what: str) -> None:
        if len(many) != self._world_size:
            raise ValueError(f"{what}: need {self._world_size} tensors, got {len(many)}")
        for t in many:
            if t.numel() != one.numel() or t.dtype != one.dtype:
                raise ValueError(f"{what}: tensors must match in size and dtype")

    def __repr__(self) -> str:
        return (
            f"ProcessGroupTCP(rank={self._rank}, world_size={self._world_size}, "
            f"quorum_id={self._quorum_id}, timeout={self._timeout})"
        )


def _create_backend(
    store: Store, rank: int, world_size: int, timeout: timedelta
) -> ProcessGroupTCP:
    pg = ProcessGroupTCP(timeout=timeout, _rank_size=(rank, world_size))
    pg._connect(store, rank, world_size, 0, "", None)
    return pg


def _register_backend() -> None:
    if BACKEND_NAME.upper() in dist.Backend._plugins:  # type: ignore[attr-defined]
        return
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, devices=devices)


_register_backend()
