"""NativeTransport: zero-copy checkpoint serving and striped parallel fetch.

Every replica that is up to date serves its state dict straight from the
memory it lives in, through libstepguard's checkpoint server (a C thread);
a healing replica pulls it over parallel TCP streams into freshly allocated
tensors, striped across every source it is given.

What goes over the wire for one step:

* a small *header*, built here: the pytree spec, and per leaf either the
  tensor's dtype, shape, stride and byte span, or (non-tensor leaves, and
  tensors that are not plain strided ones) the pickled value;
* the tensors' bytes, one *region* per tensor, sent by the server with
  ``sendmsg`` from the tensor's own memory (no pickling, no copy).

The state must not change while it is served: ``disallow_checkpoint`` waits
for transfers in flight (up to ``timeout``, then cuts them) before it returns,
as torchft's HTTPTransport does with its reader-writer lock.  CUDA tensors
are copied to host memory at ``send_checkpoint``.

Addresses: ``metadata()`` is ``sgckpt://host:port``.  ``recv_checkpoint``
accepts one such string or several joined by commas, and
``recv_checkpoint_striped`` takes a list; with several sources the fetch
is striped across all of them (a source that fails mid-transfer is dropped
and its share taken by the others).  Nothing half-loaded is ever returned.
Given ``into`` (the replica's current state dict), tensors whose
counterpart there has the same dtype, shape and strides are fetched straight
into the replica's own memory, which it has already touched: no allocation
and no page faults (``in_place``, the default; ``fetches_in_place``: the Manager
then passes its state and reports step -1 until the fetch completes, since a
failed fetch leaves those tensors partly overwritten).  A source whose metadata is an ``http://`` URL (an HTTPTransport peer, e.g.
a torchft replica) is fetched from with the HTTP transport's format when no
``sgckpt://`` source is given.

The header is unpickled on the receiving side, so a source is trusted as
with torchft's transports; set ``auth_token`` (or ``STEPGUARD_AUTH_TOKEN``)
so that only the job's replicas can fetch.
"""

from __future__ import annotations

import array
import contextlib
import gc
import logging
import math
import os
import pickle
import socket
import threading
import time
import warnings
from datetime import timedelta
from typing import Any, Dict, List, Sequence, Tuple, TypeVar

import numpy
import torch
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_unflatten

from stepguard import _C
from stepguard.checkpointing.transport import CheckpointTransport

__all__ = ["NativeTransport"]

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")

_SCHEME = "sgckpt://"
_HEADER_VERSION = 1
_MALLOC_MIN = 1 << 20  # staging in [MIN, MAX] bytes comes from malloc
_MALLOC_MAX = 32 << 20
_STRIPE_GRACE_S = 1.0  # how long other sources may lag the first one


@contextlib.contextmanager
def _gc_paused() -> Any:
    """No cyclic garbage collection inside: building thousands of tensors
    otherwise triggers full collections of the whole process (measured: one
    of 169 ms inside a 40 ms fetch of 4096 tensors, in a process that holds
    a few such states).  The counts carry over; the collection runs after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _seconds(t: timedelta | float | int) -> float:
    return t.total_seconds() if isinstance(t, timedelta) else float(t)


def _env_token(token: str | None) -> str | None:
    if token is not None:
        return token or None
    return os.environ.get("STEPGUARD_AUTH_TOKEN") or None


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be served from its memory as one span."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_nested
        and t.dtype.itemsize > 0
        and t.device.type != "meta"
    )


def _span_elems(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last addressed element, inclusive."""
    n = t.numel()
    if n == 0 or t.is_contiguous():
        return n
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def parse_sources(metadata: str | Sequence[str]) -> List[str]:
    """``host:port`` addresses from metadata strings (comma-joined or a list)."""
    items = [metadata] if isinstance(metadata, str) else list(metadata)
    out: List[str] = []
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            if part.startswith(_SCHEME):
                part = part[len(_SCHEME) :]
            part = part.rstrip("/")
            if part not in out:
                out.append(part)
    if not out:
        raise ValueError(f"no checkpoint source in {metadata!r}")
    return out


class NativeTransport(CheckpointTransport[T]):
    """Serves and fetches state dicts with libstepguard's checkpoint server.

    Args:
        timeout: default deadline for disallowing (waiting for transfers in
            flight) when the caller gives none.
        hostname: the host peers reach this replica at; default
            ``STEPGUARD_ADVERTISE_HOST``, else ``socket.gethostname()``.
        bind: ``host:port`` to listen on; default all interfaces, port 0.
        auth_token: required from fetching peers; default
            ``STEPGUARD_AUTH_TOKEN``.
        streams_per_source: parallel connections to each source.
        max_conns: connections the server holds at once (0: 256).
        in_place: whether ``recv_checkpoint(..., into=state)`` may fetch into
            ``state``'s tensors (else ``into`` is ignored and every tensor
            is fetched into fresh memory).  On by default: no allocation and
            no page faults on a heal.  The tensors the Manager then hands to
            the load functions are the replica's own (as with torchft's
            PGTransport given ``state_dict``), so a load function that keeps
            what it is given, rather than copying from it, sees it change
            later; pass ``in_place=False`` for fresh tensors.
    """

    def __init__(
        self,
        timeout: timedelta = timedelta(seconds=60),
        *,
        hostname: str | None = None,
        bind: str | None = None,
        auth_token: str | None = None,
        streams_per_source: int = 2,
        max_conns: int = 0,
        in_place: bool = True,
    ) -> None:
        self._timeout = timeout
        # read by the Manager: pass the replica's state as ``into``
        self.fetches_in_place = bool(in_place)
        self._token = _env_token(auth_token)
        self._streams = int(streams_per_source)
        if not 1 <= self._streams <= 64:
            raise ValueError("streams_per_source must be in [1, 64]")
        t = max(_seconds(timeout), 1.0)
        self._server = _C.CkptServer(
            bind=bind,
            auth_token=self._token,
            max_conns=max_conns,
            request_timeout_s=t,
            stall_timeout_s=t,
        )
        host = hostname or os.environ.get("STEPGUARD_ADVERTISE_HOST")
        self._host = host or socket.gethostname()
        self._lock = threading.Lock()
        self._serving_step = -1
        self._held: List[Any] = []  # keeps served memory alive
        self.last_recv_bytes: List[int] = []  # bytes from each source
        # how the last fetch moved them: same_host_bytes (copied from the
        # sources' memory), tcp_bytes, same_host_sources
        self.last_recv_stats: dict = {}

    # ---- serving ---------------------------------------------------------

    def metadata(self) -> str:
        """``sgckpt://host:port``; what healing peers pass to recv."""
        host = self._host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{_SCHEME}{host}:{self._server.port()}"

    def address(self) -> str:
        """Same as :meth:`metadata`."""
        return self.metadata()

    def send_checkpoint(
        self, dst_ranks: List[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Serve ``state_dict`` at ``step`` to whoever asks until disallowed.

        Returns at once; tensor memory is served in place and must not
        change until :meth:`disallow_checkpoint` returns.  ``dst_ranks`` is
        unused: any peer with the token may fetch the announced step.
        """
        leaves, spec = tree_flatten(state_dict)
        metas: List[Tuple[Any, ...]] = []
        held: List[Any] = []
        ptrs = array.array("Q")
        lens = array.array("Q")
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and _plain(leaf):
                t = leaf.detach()
                if t.device.type != "cpu":
                    t = t.to("cpu")  # served from a host copy
                span = _span_elems(t)
                nbytes = span * t.element_size()
                held.append(t)
                ptrs.append(t.data_ptr() if nbytes else 0)
                lens.append(nbytes)
                metas.append(
                    (
                        "t",
                        str(t.dtype).removeprefix("torch."),
                        tuple(t.shape),
                        tuple(t.stride()),
                        span,
                        leaf.requires_grad,
                        isinstance(leaf, torch.nn.Parameter),
                        str(leaf.device),
                    )
                )
            else:
                metas.append(("v", leaf))
        header = pickle.dumps(
            {
                "version": _HEADER_VERSION,
                "step": step,
                "spec": spec,
                "leaves": metas,
            },
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        with self._lock:
            if self._serving_step >= 0:
                self._disallow_locked(_seconds(self._timeout))
            self._server.serve(step, header, ptrs, lens)
            self._held = [header, held]
            self._serving_step = step

    def _disallow_locked(self, timeout_s: float) -> None:
        if self._serving_step < 0:
            return
        clean = self._server.disallow(timeout_s)
        if not clean:
            logger.warning(
                "checkpoint step %d: transfers still running after %.1fs were cut",
                self._serving_step,
                timeout_s,
            )
        self._held = []
        self._serving_step = -1

    def disallow_checkpoint(self) -> None:
        """Stop serving; waits for transfers in flight (up to ``timeout``)."""
        with self._lock:
            self._disallow_locked(_seconds(self._timeout))

    def stats(self) -> dict:
        """The server's counters (bytes_sent, requests, refused, ...)."""
        return self._server.stats()

    # ---- fetching --------------------------------------------------------

    def recv_checkpoint(
        self,
        src_rank: int,
        metadata: str,
        step: int,
        timeout: timedelta,
        *,
        into: Any = None,
    ) -> T:
        """Fetch ``step`` from the source(s) named by ``metadata``.

        ``metadata`` is one source's ``metadata()`` or several joined with
        commas; with several the fetch is striped across them.  ``into``:
        see :meth:`recv_checkpoint_striped`.
        """
        return self.recv_checkpoint_striped([metadata], step, timeout, into=into)

    def recv_checkpoint_striped(
        self,
        sources: Sequence[str],
        step: int,
        timeout: timedelta,
        *,
        into: Any = None,
    ) -> T:
        """Fetch ``step`` striped across ``sources`` (metadata strings).

        Every byte range goes to one source; a faster source takes more, a
        failing one is dropped and its ranges go to the others.  Raises
        :class:`TimeoutError` past ``timeout`` and :class:`RuntimeError`
        when every source fails or none serves ``step``; never returns a
        partly received state.  ``last_recv_bytes`` then holds the bytes
        taken from each source, and ``last_recv_stats`` how many of them were
        copied straight from a same-host source's memory and how many landed
        in place.

        ``into``: the replica's current state (a tree like the one served).
        A received tensor whose counterpart in ``into`` (the same position
        in an identical tree, else the same key path) is a CPU tensor with
        the same dtype, shape and strides and no gaps, sharing memory with no
        other destination, is fetched into that tensor's memory and returned
        as a view of it; the others get fresh memory.  If the fetch fails,
        those tensors hold partial data: the caller must treat its state as
        lost until a later fetch succeeds.
        """
        items = [m for s in sources for m in s.split(",") if m.strip()]
        is_http = [m.strip().startswith(("http://", "https://")) for m in items]
        http = [m.strip() for m, h in zip(items, is_http) if h]
        native = [m for m, h in zip(items, is_http) if not h]
        if not native and http:
            # an HTTPTransport peer (torchft's or ours): its wire format
            from stepguard.checkpointing.http_transport import HTTPTransport

            self.last_recv_bytes = []
            self.last_recv_stats = {}
            return HTTPTransport._load_from_address(f"{http[0]}{step}/full", timeout)
        addrs = parse_sources(native)
        deadline = time.monotonic() + _seconds(timeout)
        fetch = _C.CkptFetch()
        header, lens, layout, addrs = self._wait_for_sources(fetch, addrs, step, deadline)
        with warnings.catch_warnings(), _gc_paused():
            # a pickled TreeSpec (custom node types) warns on load in torch 2.13
            warnings.simplefilter("ignore", FutureWarning)
            meta = pickle.loads(header)
        if meta.get("version") != _HEADER_VERSION or meta.get("step") != step:
            raise RuntimeError(
                f"checkpoint header is for step {meta.get('step')}, wanted {step}"
            )
        with _gc_paused():  # thousands of tensors: no collection mid-heal
            theirs = meta["leaves"]
            dtypes: Dict[str, torch.dtype] = {}
            local = self._in_place_targets(into, meta, dtypes)
            in_place_bytes = 0
            leaves: List[Any] = [None] * len(theirs)
            # (leaf index, buffer, whether it is the replica's own tensor)
            todo: List[Tuple[int, torch.Tensor, bool]] = []
            ptrs = array.array("Q")
            want = array.array("Q")
            mapped = bytearray()  # 1: the replica's own, touched memory
            for i, m in enumerate(theirs):
                if m[0] == "v":
                    leaves[i] = m[1]
                    continue
                _, dtype_name, shape, stride, span, requires_grad, is_param, _dev = m
                dtype = dtypes.get(dtype_name)
                if dtype is None:
                    dtype = dtypes[dtype_name] = getattr(torch, dtype_name)
                nbytes = span * dtype.itemsize
                hit = local.get(i)
                if hit is not None:  # the replica's own (touched) memory
                    buf, ptr = hit
                    in_place_bytes += nbytes
                    if buf.requires_grad == requires_grad and (
                        type(buf) is torch.nn.Parameter
                    ) == bool(is_param):
                        leaves[i] = buf  # as it is: the Manager loads it into itself
                    else:
                        todo.append((i, buf, True))
                    ptrs.append(ptr)
                    want.append(nbytes)
                    mapped.append(1)
                    continue
                numel = math.prod(shape)
                if _MALLOC_MIN <= nbytes <= _MALLOC_MAX:
                    # malloc'd through numpy: glibc recycles freed heap memory up
                    # to its largest mmap threshold (32 MiB), where torch's
                    # aligned allocations of that size come back as fresh mmap()
                    # pages to fault in and zero on every heal.  Larger buffers
                    # are fresh pages either way; torch's avoid numpy's
                    # huge-page advice, whose compaction stalled first heals.
                    raw = torch.from_numpy(numpy.empty(nbytes, dtype=numpy.uint8))
                    buf = raw.view(dtype)
                    if span == numel:
                        buf = buf.as_strided(shape, stride)
                elif span == numel:  # dense: allocate it in its final form
                    buf = torch.empty_strided(shape, stride, dtype=dtype)
                else:  # gaps or overlaps: the span, viewed below
                    buf = torch.empty((span,), dtype=dtype)
                if span != numel or is_param or requires_grad:
                    todo.append((i, buf, False))  # finished below
                else:
                    leaves[i] = buf
                ptrs.append(buf.data_ptr() if span else 0)
                want.append(nbytes)
                mapped.append(0)
        if want.tolist() != list(lens):
            raise RuntimeError("checkpoint header and region table disagree")
        self.last_recv_bytes = fetch.data(
            addrs,
            self._token,
            step,
            layout,
            ptrs,
            want,
            self._streams,
            max(deadline - time.monotonic(), 0.0),
            mapped=bytes(mapped) if in_place_bytes else None,
        )
        self.last_recv_stats = fetch.stats()
        self.last_recv_stats["in_place_bytes"] = in_place_bytes
        with _gc_paused():
            for i, t, own in todo:  # views of gapped spans, parameters, grads
                _, _dt, shape, stride, span, requires_grad, is_param, _dev = theirs[i]
                if own:
                    t = t.detach()
                elif span != math.prod(shape):
                    t = t.as_strided(shape, stride, 0)
                if is_param:
                    t = torch.nn.Parameter(t, requires_grad=requires_grad)
                elif requires_grad:
                    t.requires_grad_(True)
                leaves[i] = t
            return tree_unflatten(leaves, meta["spec"])

    def _in_place_targets(
        self, into: Any, meta: dict, dtypes: Dict[str, torch.dtype]
    ) -> Dict[int, Tuple[torch.Tensor, int]]:
        """Leaf index -> (the tensor of ``into`` it is fetched into, its
        address).

        A received tensor leaf qualifies when its counterpart is a plain CPU
        tensor with the same dtype, shape and strides, dense (the served span
        has no gaps, so every byte written belongs to the tensor), and its
        memory overlaps no other target (tied weights are fetched once in
        place, the alias into fresh memory).  Nothing qualifies while this
        transport serves a state: the served memory must not change.
        """
        if into is None or not self.fetches_in_place or self._serving_step >= 0:
            return {}
        mine, my_spec = tree_flatten(into)
        theirs = meta["leaves"]
        if my_spec == meta["spec"]:
            pairs: Any = enumerate(mine)
        else:  # same key paths, wherever they sit
            by_path = dict(tree_flatten_with_path(into)[0])
            slots, _ = tree_flatten_with_path(
                tree_unflatten(list(range(len(theirs))), meta["spec"])
            )
            pairs = [(i, by_path.get(path)) for path, i in slots]
        found: List[Tuple[int, int, int, torch.Tensor]] = []
        for i, t in pairs:
            if type(t) not in _PLAIN_TYPES:
                continue
            m = theirs[i]
            if m[0] != "t" or not t.is_cpu or t.is_nested or t.layout != torch.strided:
                continue
            _, dtype_name, shape, stride, span, _rg, _param, _dev = m
            dtype = dtypes.get(dtype_name)
            if dtype is None:
                dtype = dtypes[dtype_name] = getattr(torch, dtype_name)
            if (
                t.dtype != dtype
                or t.shape != shape
                or t.stride() != tuple(stride)
                or span == 0
                or span != t.numel()
            ):
                continue
            start = t.data_ptr()
            found.append((start, start + span * dtype.itemsize, i, t))
        found.sort(key=lambda f: f[0])
        out: Dict[int, Tuple[torch.Tensor, int]] = {}
        end = 0
        for start, stop, i, t in found:
            if start >= end:
                out[i] = (t, start)
            end = max(end, stop)
        return out

    def _wait_for_sources(
        self, fetch: Any, addrs: List[str], step: int, deadline: float
    ) -> Tuple[bytes, List[int], int, List[str]]:
        """The header from the first source, and the sources that serve
        ``step``.

        A source whose quorum returned at the same moment as ours may not
        have started serving yet ("serving -1"): like torchft's HTTP server,
        which holds a request until serving is allowed, we wait for it, the
        first to answer up to the deadline and the others up to
        ``_STRIPE_GRACE_S`` after it; a source that refuses
        for any other reason, or is not ready by then, is left out.
        """
        header = None
        lens: List[int] = []
        layout = 0
        ready: dict = {}
        failed: dict = {}
        grace_end = deadline
        pause = 0.005
        waiting: dict = {}  # the last "not serving yet" refusal of each
        while True:
            for addr in addrs:
                left = deadline - time.monotonic()
                if addr in ready or addr in failed or left <= 0:
                    continue
                try:
                    h, ls, lay = fetch.info(addr, self._token, step, left)
                except TimeoutError:
                    raise
                except RuntimeError as e:
                    if "serving -1 " in str(e):
                        waiting[addr] = str(e)
                    else:
                        failed[addr] = str(e)
                    continue
                ready[addr] = True
                if header is None:
                    header, lens, layout = h, ls, lay
                    grace_end = min(deadline, time.monotonic() + _STRIPE_GRACE_S)
            pending = [a for a in addrs if a not in ready and a not in failed]
            now = time.monotonic()
            if not pending or now >= grace_end:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
        if header is None:
            errors = [f"{a}: {failed.get(a) or waiting.get(a)}" for a in addrs]
            raise RuntimeError(
                f"no source serves checkpoint step {step}: " + "; ".join(errors)
            )
        for addr, why in failed.items():
            logger.warning("checkpoint source %s left out: %s", addr, why)
        return header, lens, layout, [a for a in addrs if a in ready]

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving and close the server (idempotent)."""
        with self._lock:
            try:
                self._disallow_locked(_seconds(self._timeout) if wait else 0.0)
            except RuntimeError:
                pass  # already shut down
            self._server.shutdown()

    def __del__(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            try:
                server.shutdown()
            except Exception:  # noqa: BLE001 - interpreter teardown
                pass
