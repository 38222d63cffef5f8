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

Addresses: ``metadata()`` is ``http://host:HTTP_PORT/sgckpt=PORT/checkpoint/``:
a torchft replica's HTTPTransport uses it as it is (it fetches
``{metadata}{step}/full``, answered in torchft's format by a small HTTP
server beside the native one, see below), and ours reads the native port
from the ``sgckpt=`` segment and fetches natively from ``host:PORT``.
``recv_checkpoint`` accepts one such string, or the older
``sgckpt://host:port``, or several joined by commas, and
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
native source is given.

The HTTP side (``serve_http``, on by default) serves exactly the state the
native server serves, under the same rules: nothing before the first
``send_checkpoint``, a request that comes while nothing is served waits for
the next one (up to ``timeout``), and ``disallow_checkpoint`` stops new
requests at once and waits for those in flight (together with the native
transfers, up to ``timeout``, then cuts them).  It is built from the leaves
the native server already holds: staging costs no copy and no tree walk;
the tree is rebuilt, and pickled, only when a torchft peer asks.  With an
auth token it answers every request with 403: torchft's HTTP client cannot
send a token, so a torchft replica cannot heal from a replica that requires
one.

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
import pickle
import re
import socket
import threading
import time
import urllib.parse
import warnings
from datetime import timedelta
from typing import Any, Dict, List, Sequence, Tuple, TypeVar

import numpy
import torch
from torch.utils._pytree import (
    SUPPORTED_NODES,
    TreeSpec,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
)

from stepguard import _C, config
from stepguard.checkpointing.transport import CheckpointTransport

__all__ = ["NativeTransport"]

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")

_SCHEME = "sgckpt://"
_SEGMENT = "sgckpt="  # the native port, as a path segment of an http:// metadata
_HEADER_VERSION = 2  # 2: DTensor leaves served as their local shards ("dtensors")
_MALLOC_MIN = 1 << 20  # staging in [MIN, MAX] bytes comes from malloc
_MALLOC_MAX = 32 << 20
_STRIPE_GRACE_S = 1.0  # how long other sources may lag the first one
# a source's refusal: the step it serves (-1: none) is not the one asked for
_SERVING = re.compile(r"serving (-?\d+) but got step=")


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


def _local_shard(leaf: Any) -> torch.Tensor | None:
    """A DTensor's local tensor when it can be served as one span, else None."""
    if not isinstance(leaf, torch.Tensor) or type(leaf) in (torch.Tensor, torch.nn.Parameter):
        return None
    from torch.distributed.tensor import DTensor

    if not isinstance(leaf, DTensor):
        return None
    local = leaf._local_tensor
    return local if _plain(local) else None


def _as_dtensor(local: torch.Tensor, spec: Any, mine: Any) -> Any:
    """A received local shard as a DTensor: on the receiver's own mesh.

    ``mine``: the receiver's tensor at that place (or None).  A DTensor
    there with the same placements and global shape gives its mesh (the
    sender's names process groups of the sender's process); when the shard
    was fetched into its local tensor, ``mine`` itself is returned.  Without
    one, the DTensor is built on the sender's mesh as unpickled (as a
    pickled DTensor would be).
    """
    from torch.distributed.tensor import DTensor

    if isinstance(mine, DTensor):
        if mine.placements != spec.placements or tuple(mine.shape) != tuple(spec.shape):
            raise RuntimeError(
                f"checkpoint DTensor is {tuple(spec.shape)} as {spec.placements} on a mesh "
                f"of {spec.mesh.size()}, this replica's is {tuple(mine.shape)} as "
                f"{mine.placements} on a mesh of {mine.device_mesh.size()}: a replica "
                "group heals only from a group with the same number of ranks and sharding"
            )
        own = mine._local_tensor
        if own.data_ptr() == local.data_ptr() and own.shape == local.shape:
            return mine
        mesh = mine.device_mesh
    else:
        mesh = spec.mesh
    return DTensor.from_local(
        local.detach(), mesh, spec.placements, run_check=False,
        shape=spec.shape, stride=spec.stride,
    )


def _span_elems(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last addressed element, inclusive."""
    n = t.numel()
    if n == 0 or t.is_contiguous():
        return n
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _is_leaf_spec(spec: Any) -> bool:
    return spec.num_nodes == 1 and spec.num_leaves == 1


def _leaf_children(spec: Any, n: int) -> bool:
    """Whether all ``n`` children of node ``spec`` are leaves (one node and
    one leaf each: every child has at least one node, and a childless node
    has no leaf)."""
    return spec.num_nodes == n + 1 and spec.num_leaves == n


def _fast_spec(spec: Any) -> bool:
    """Whether ``spec`` is torch's Python TreeSpec (its children and context
    readable), whose walk below is ``_along``'s and ``_build``'s."""
    return isinstance(spec, TreeSpec) and hasattr(spec, "_children")


def _along(spec: Any, node: Any, out: List[Any]) -> bool:
    return _fast_spec(spec) and _walk(spec, node, out)


def _walk(spec: Any, node: Any, out: List[Any]) -> bool:
    """Append to ``out`` the subtrees of ``node`` at ``spec``'s leaves, in
    leaf order; False where ``node``'s structure differs from ``spec``'s
    above a leaf (another node type, other keys or another number of
    children).  A run of leaves under one node costs one ``extend``, not a
    call per leaf as ``tree_flatten`` does."""
    if _is_leaf_spec(spec):
        out.append(node)
        return True
    typ = spec.type
    entry = SUPPORTED_NODES.get(typ)
    if type(node) is not typ or entry is None:
        return False  # includes namedtuples, whose spec type is not the class
    kids, context = entry.flatten_fn(node)
    subs = spec._children
    if len(kids) != len(subs) or context != spec._context:
        return False
    if _leaf_children(spec, len(subs)):
        out.extend(kids)
        return True
    return all(_walk(sub, kid, out) for sub, kid in zip(subs, kids))


def _build(spec: Any, leaves: List[Any], start: int) -> Any:
    if _is_leaf_spec(spec):
        return leaves[start]
    subs = spec._children
    if _leaf_children(spec, len(subs)):
        kids = leaves[start : start + len(subs)]
    else:
        kids = []
        for sub in subs:
            kids.append(_build(sub, leaves, start))
            start += sub.num_leaves
    return SUPPORTED_NODES[spec.type].unflatten_fn(kids, spec._context)


def _unflatten(leaves: List[Any], spec: Any) -> Any:
    """``tree_unflatten``, with a run of leaves under one node taken as one
    slice (the same node functions build every node)."""
    if not _fast_spec(spec) or spec.num_leaves != len(leaves):
        return tree_unflatten(leaves, spec)
    return _build(spec, leaves, 0)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def native_address(item: str) -> str | None:
    """The native ``host:port`` that one metadata string names, or None
    for an ``http://`` URL without a ``sgckpt=`` segment (an HTTPTransport
    peer, e.g. a torchft replica).

    Accepts ``sgckpt://host:port``, a bare ``host:port`` and
    ``http://host:p/sgckpt=PORT/...`` (this transport's :meth:`metadata`;
    the native server listens on the URL's host).  Raises ValueError for a
    malformed ``sgckpt=`` segment.
    """
    item = item.strip()
    if item.startswith(_SCHEME):
        return item[len(_SCHEME) :].rstrip("/")
    if not item.startswith(("http://", "https://")):
        return item.rstrip("/")
    url = urllib.parse.urlsplit(item)
    first = url.path.lstrip("/").split("/", 1)[0]
    if not first.startswith(_SEGMENT):
        return None
    port = first[len(_SEGMENT) :]
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
        raise ValueError(f"bad native port in checkpoint metadata {item!r}")
    if not url.hostname:
        raise ValueError(f"no host in checkpoint metadata {item!r}")
    return f"{_bracket(url.hostname)}:{int(port)}"


def parse_sources(metadata: str | Sequence[str]) -> List[str]:
    """Native ``host:port`` addresses from metadata strings (comma-joined or
    a list); ``http://`` sources without a native address are left out."""
    items = [metadata] if isinstance(metadata, str) else list(metadata)
    out: List[str] = []
    for item in items:
        for part in item.split(","):
            if not part.strip():
                continue
            addr = native_address(part)
            if addr and addr not in out:
                out.append(addr)
    if not out:
        raise ValueError(f"no native checkpoint source in {metadata!r}")
    return out


class NativeTransport(CheckpointTransport[T]):
    """Serves and fetches state dicts with libstepguard's checkpoint server.

    Args:
        timeout: default deadline for disallowing (waiting for transfers in
            flight) when the caller gives none.
        hostname: the host peers reach this replica at; default
            ``socket.gethostname()``; ``STEPGUARD_ADVERTISE_HOST`` wins over
            both (an interface name there becomes its address), the rule
            every stepguard server follows.
        bind: ``host:port`` to listen on; default all interfaces, port 0.
        auth_token: required from fetching peers; default
            ``STEPGUARD_AUTH_TOKEN``.
        streams_per_source: parallel connections to each source.
        max_conns: connections the server holds at once (0: 256).
        serve_http: also serve the state in torchft's HTTP format, and make
            :meth:`metadata` an ``http://`` URL a torchft healer can use
            (else ``sgckpt://host:port``, which only stepguard reads).
        http_chunks: the number of chunks the HTTP side splits the state
            into, for torchft healers whose ``HTTPTransport`` has
            ``num_chunks`` > 0 (it must be theirs; their default, 0, fetches
            the whole state, which is always served).
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
        serve_http: bool = True,
        http_chunks: int = 0,
        in_place: bool = True,
    ) -> None:
        if http_chunks < 0:
            raise ValueError(f"http_chunks must be >= 0, got {http_chunks}")
        self._timeout = timeout
        # read by the Manager: pass the replica's state as ``into``
        self.fetches_in_place = bool(in_place)
        # serves from a C thread until disallowed (the Manager keeps a copy
        # served where a healer may ask late)
        self.serves_in_background = True
        self._token = config.auth_token(auth_token)
        self._streams = int(streams_per_source)
        if not 1 <= self._streams <= 64:
            raise ValueError("streams_per_source must be in [1, 64]")
        t = max(config.seconds(timeout), 1.0)
        self._server = _C.CkptServer(
            bind=bind,
            auth_token=self._token,
            max_conns=max_conns,
            request_timeout_s=t,
            stall_timeout_s=t,
        )
        self._host = _C.advertised_host(hostname)
        # the HTTP side: started by the first metadata() (no one can reach
        # it before), staged under _http_lock, never under _lock, so that
        # metadata() (the quorum thread) never waits for a disallow
        self._http_on = bool(serve_http)
        self._http_chunks = int(http_chunks)
        self._http_host = ""
        if bind:
            self._http_host = bind.rsplit(":", 1)[0].strip("[]")
        self._http: Any = None
        self._http_lock = threading.Lock()
        self._http_staged: Any = None
        self._http_closed = False
        self._metadata: str | None = None
        self._lock = threading.Lock()
        self._serving_step = -1
        self._held: List[Any] = []  # keeps served memory alive
        self.last_recv_bytes: List[int] = []  # bytes from each source
        # how the last fetch moved them: same_host_bytes (copied from the
        # sources' memory), tcp_bytes, same_host_sources
        self.last_recv_stats: dict = {}
        # seconds in each part of the last fetch: info, unpickle, match (the
        # candidates in ``into``), plan (destinations), data, build (tree)
        self.last_recv_times: dict = {}

    # ---- serving ---------------------------------------------------------

    def metadata(self) -> str:
        """What healing peers pass to recv:
        ``http://host:HTTP_PORT/sgckpt=PORT/checkpoint/`` (torchft's
        HTTPTransport appends ``{step}/{key}``), or ``sgckpt://host:PORT``
        with ``serve_http=False`` or when the HTTP server cannot start."""
        meta = self._metadata
        if meta is not None:
            return meta
        host = _bracket(self._host)
        port = self._server.port()
        http = self._http_server()
        if http is None:
            meta = f"{_SCHEME}{host}:{port}"
        else:
            meta = f"http://{host}:{http.port()}/{_SEGMENT}{port}/checkpoint/"
        self._metadata = meta
        return meta

    def _http_server(self) -> Any:
        """The HTTP side, started on first use; None when off or failed."""
        with self._http_lock:
            if self._http is None and self._http_on and not self._http_closed:
                from stepguard.checkpointing.http_transport import _StateServer

                refuse = None
                if self._token:
                    refuse = (
                        "this replica's checkpoints require an auth token "
                        "(STEPGUARD_AUTH_TOKEN), which torchft's HTTP transport "
                        "cannot send: a torchft replica must heal from a torchft "
                        "replica, or the job must run without a token"
                    )
                try:
                    self._http = _StateServer(
                        max(config.seconds(self._timeout), 1.0),
                        host=self._http_host,
                        prefix=f"/{_SEGMENT}{self._server.port()}",
                        refuse=refuse,
                    )
                except OSError as e:
                    logger.warning(
                        "no HTTP checkpoint server (torchft peers cannot heal from us): %s", e
                    )
                    self._http_on = False
                    return None
                if self._http_staged is not None:
                    self._http.serve(self._http_staged)
            return self._http

    def _stage_http(self, staged: Any) -> None:
        with self._http_lock:
            self._http_staged = staged
            if self._http is not None:
                if staged is None:
                    self._http.close_gate()
                else:
                    self._http.serve(staged)

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
        copies: Dict[int, Any] = {}  # host copies of device tensors, by leaf
        # one string object per dtype and device: pickled once, memoized after
        names: Dict[Any, str] = {}
        records: Dict[Tuple[Any, ...], Tuple[Any, ...]] = {}
        ptrs = array.array("Q")
        lens = array.array("Q")
        # DTensor leaves (FSDP shards): their local shard is served like any
        # tensor; the header keeps each one's DTensor spec by leaf index
        dtensors: Dict[int, Any] = {}
        for i, leaf in enumerate(leaves):
            local = _local_shard(leaf)
            if local is not None:
                dtensors[i] = leaf._spec
                leaf = local
            if isinstance(leaf, torch.Tensor) and _plain(leaf):
                t = leaf.detach()
                if t.device.type != "cpu":
                    t = t.to("cpu")  # served from a host copy
                    copies[i] = t
                span = _span_elems(t)
                nbytes = span * t.element_size()
                held.append(t)
                ptrs.append(t.data_ptr() if nbytes else 0)
                lens.append(nbytes)
                rec = (
                    "t",
                    names.get(t.dtype)
                    or names.setdefault(t.dtype, str(t.dtype).removeprefix("torch.")),
                    tuple(t.shape),
                    tuple(t.stride()),
                    span,
                    leaf.requires_grad,
                    isinstance(leaf, torch.nn.Parameter),
                    names.get(leaf.device)
                    or names.setdefault(leaf.device, str(leaf.device)),
                )
                # equal records are one object: pickled once, the rest are
                # memo references that unpickle to that same object
                metas.append(records.setdefault(rec, rec))
            else:
                metas.append(("v", leaf))
        header = pickle.dumps(
            {
                "version": _HEADER_VERSION,
                "step": step,
                "spec": spec,
                "leaves": metas,
                "dtensors": dtensors,
            },
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        with self._lock:
            if self._serving_step >= 0:
                self._disallow_locked(config.seconds(self._timeout))
            self._server.serve(step, header, ptrs, lens)
            self._held = [header, held]
            self._serving_step = step
            if self._http_on:
                from stepguard.checkpointing.http_transport import _Staged

                self._stage_http(_Staged(step, leaves, spec, copies, self._http_chunks))

    def _disallow_locked(self, timeout_s: float) -> None:
        if self._serving_step < 0:
            return
        # no new HTTP reader from here; those in flight and the native
        # transfers share the deadline
        self._stage_http(None)
        t0 = time.monotonic()
        clean = self._server.disallow(timeout_s)
        http = self._http
        if http is not None:
            left = max(timeout_s - (time.monotonic() - t0), 0.0)
            clean = http.wait_idle(left) and clean
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
            self._disallow_locked(config.seconds(self._timeout))

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
        items = [m.strip() for s in sources for m in s.split(",") if m.strip()]
        native: List[str] = []
        http: List[str] = []
        for m in items:
            addr = native_address(m)
            if addr is None:
                http.append(m)
            elif addr not in native:
                native.append(addr)
        if not native and http:
            # an HTTPTransport peer (torchft's or ours): its wire format
            from stepguard.checkpointing.http_transport import HTTPTransport

            self.last_recv_bytes = []
            self.last_recv_stats = {}
            return HTTPTransport._load_from_address(f"{http[0]}{step}/full", timeout)
        if not native:
            raise ValueError(f"no checkpoint source in {list(sources)!r}")
        addrs = native
        deadline = time.monotonic() + config.seconds(timeout)
        fetch = _C.CkptFetch()
        t0 = time.perf_counter()
        header, lens, layout, addrs = self._wait_for_sources(fetch, addrs, step, deadline)
        t1 = time.perf_counter()
        with warnings.catch_warnings(), _gc_paused():
            # a pickled TreeSpec (custom node types) warns on load in torch 2.13
            warnings.simplefilter("ignore", FutureWarning)
            meta = pickle.loads(header)
        if meta.get("version") != _HEADER_VERSION or meta.get("step") != step:
            raise RuntimeError(
                f"checkpoint header is for step {meta.get('step')}, wanted {step}"
            )
        t2 = time.perf_counter()
        with _gc_paused():  # thousands of tensors: no collection mid-heal
            theirs = meta["leaves"]
            spec = meta["spec"]
            if not isinstance(theirs, list):
                raise RuntimeError("bad checkpoint header: leaves")
            mine = self._in_place_candidates(into, spec, len(theirs))
            dtensors = meta.get("dtensors") or {}
            dt_mine: Dict[int, Any] = {}
            if dtensors and mine is not None:
                # a DTensor is fetched into its local shard
                for i in dtensors:
                    if 0 <= i < len(mine):
                        dt_mine[i] = mine[i]
                        local = _local_shard(mine[i])
                        mine[i] = local
            t3 = time.perf_counter()
            dtypes: Dict[str, Tuple[torch.dtype, int]] = {}
            lens_q = array.array("Q", lens)  # for plan() and data()
            # one pass in C: header against region table, in-place matches
            leaves, ptr_bytes, mapped, rest, in_place_bytes = fetch.plan(
                theirs, mine, lens_q, torch, dtypes,
                torch.dtype, torch.strided, torch.Tensor, torch.nn.Parameter,
            )  # fmt: skip
            ptrs = memoryview(ptr_bytes).cast("Q")
            # (leaf index, buffer, whether it is the replica's own tensor)
            todo: List[Tuple[int, torch.Tensor, bool]] = []
            for i, r, own in rest:
                if own is not None:  # in place, grad or Parameter-ness differ
                    todo.append((i, own, True))
                    continue
                _, name, shape, stride, span, requires_grad, is_param, _ = theirs[i]
                dtype = dtypes[name][0]
                nbytes = lens[r]
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
                ptrs[r] = buf.data_ptr() if span else 0
        t4 = time.perf_counter()
        self.last_recv_bytes = fetch.data(
            addrs,
            self._token,
            step,
            layout,
            ptrs,
            lens_q,
            self._streams,
            max(deadline - time.monotonic(), 0.0),
            mapped=bytes(mapped) if in_place_bytes else None,
        )
        t5 = time.perf_counter()
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
            for i, dspec in dtensors.items():
                leaves[i] = _as_dtensor(leaves[i], dspec, dt_mine.get(i))
            out = _unflatten(leaves, spec)
        t6 = time.perf_counter()
        # seconds in each part of the last fetch (profiling many small tensors)
        self.last_recv_times = {
            "info": t1 - t0,
            "unpickle": t2 - t1,
            "match": t3 - t2,
            "plan": t4 - t3,
            "data": t5 - t4,
            "build": t6 - t5,
        }
        return out

    def _in_place_candidates(
        self, into: Any, spec: Any, nleaves: int
    ) -> List[Any] | None:
        """For each received leaf, what sits at its place in ``into`` (or
        None): the candidates :meth:`CkptFetch.plan` checks.

        By position when ``into`` has the received tree's structure down to
        its leaves, else by key path (a replica whose optimizer has no state
        yet still receives its weights in place).  None when nothing may be
        fetched in place: no ``into``, ``in_place=False``, or while this
        transport serves a state (served memory must not change).

        :meth:`CkptFetch.plan` then takes a received tensor leaf in place when
        its counterpart is a plain CPU tensor with the same dtype, shape and
        strides, dense (the served span has no gaps, so every byte written
        belongs to the tensor), and its memory overlaps no other target (tied
        weights are fetched once in place, the alias into fresh memory).
        """
        if into is None or not self.fetches_in_place or self._serving_step >= 0:
            return None
        out: List[Any] = []
        if _along(spec, into, out) and len(out) == nleaves:
            return out
        by_path = dict(tree_flatten_with_path(into)[0])
        slots, _ = tree_flatten_with_path(tree_unflatten(list(range(nleaves)), spec))
        mine: List[Any] = [None] * nleaves
        for path, i in slots:
            mine[i] = by_path.get(path)
        return mine

    def _wait_for_sources(
        self, fetch: Any, addrs: List[str], step: int, deadline: float
    ) -> Tuple[bytes, List[int], int, List[str]]:
        """The header from the first source, and the sources that serve
        ``step``.

        A source whose quorum returned at the same moment as ours may not
        have started serving yet ("serving -1"), or still serve the step
        before (a source that serves at a safe point of its step, see the
        Manager): like torchft's HTTP server,
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
                    served = _SERVING.search(str(e))
                    if served is not None and int(served.group(1)) < step:
                        # not serving yet, or still an earlier step: a
                        # source serves at a safe point of its step
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
        """Stop serving and close the servers (idempotent)."""
        with self._lock:
            try:
                self._disallow_locked(config.seconds(self._timeout) if wait else 0.0)
            except RuntimeError:
                pass  # already shut down
            self._server.shutdown()
        self._close_http(wait)

    def _close_http(self, wait: bool) -> None:
        with self._http_lock:
            http, self._http = self._http, None
            self._http_closed = True
            self._http_staged = None
        if http is not None:
            http.close(wait)

    def __del__(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            try:
                server.shutdown()
            except Exception:  # noqa: BLE001 - interpreter teardown
                pass
        if getattr(self, "_http", None) is not None:
            try:
                self._close_http(False)
            except Exception:  # noqa: BLE001 - interpreter teardown
                pass
