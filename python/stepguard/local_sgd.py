"""LocalSGD and (Streaming) DiLoCo: replicas train alone for a few steps and
synchronise every ``sync_every`` optimizer steps, under a Manager.

Both are context managers that hook the inner optimizer's ``step``:

* :class:`LocalSGD` averages the model parameters themselves every
  ``sync_every`` steps (one quorum, one commit vote per sync).
* :class:`DiLoCo` keeps a backup of the last globally agreed parameters
  (the *global* parameters), averages the *pseudo-gradient* ``global -
  local`` across replicas and applies it to the global parameters with an
  outer optimizer.  The model may be split into fragments that synchronise
  in turn (Streaming DiLoCo): every ``sync_every / n_fragments`` steps one
  fragment is averaged, its allreduce started ``fragment_sync_delay`` steps
  before the outer step so that it overlaps training, and the new global
  fragment may be mixed with the local one (``fragment_update_alpha``).

Each fragment registers its global parameters and its outer optimizer's
state with the Manager (``StreamingDiLoCoFragment_{i}``), so a healing
replica receives them with the user state.  A failed commit puts the model
back on the global parameters (the fragment's local progress is dropped);
the manager's step, which picks the fragment, does not advance, so the same
fragment is tried again next time on every replica.

Constructors, defaults, state-dict keys, hook order and the environment
variable ``TORCHFT_USE_BUCKETIZATION`` (alias ``STEPGUARD_USE_BUCKETIZATION``)
are torchft's.  Deliberate differences: a pseudo-gradient larger than a
bucket gets a bucket of its own (torchft leaves it out of the average), and
buckets never mix dtypes or devices.  On an accelerator the allreduce is
issued on the current stream, not a side stream.
"""

from __future__ import annotations

import logging
import math
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Type, TypeVar, Union

import torch
from torch import nn, optim
from torch.distributed.distributed_c10d import Work
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from stepguard import config

if TYPE_CHECKING:
    from stepguard.manager import Manager

__all__ = ["DiLoCo", "LocalSGD", "extract_local_tensor"]

logger: logging.Logger = logging.getLogger(__name__)

USE_BUCKETIZATION_ENV: str = "TORCHFT_USE_BUCKETIZATION"


class _ArgumentError(ValueError, AssertionError):
    """A bad constructor argument where torchft asserts: catchable as the
    AssertionError torchft raises and as a ValueError, and raised under
    ``python -O`` too."""


def extract_local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A copy of the part of ``t`` this rank holds: the local shard of a
    DTensor, else the whole tensor."""
    if isinstance(t, DTensor):
        return t.to_local().clone()
    return t.clone()


def _local_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (the local shard of a DTensor), without a
    copy."""
    return t.to_local() if isinstance(t, DTensor) else t


def _like_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` shaped as ``p``: rewrapped as a DTensor when ``p`` is one."""
    if isinstance(p, DTensor):
        return DTensor.from_local(
            local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )
    return local


_Hooked = TypeVar("_Hooked", bound="_OptimizerHooks")


class _OptimizerHooks:
    """The context manager LocalSGD and DiLoCo share: while entered, every
    step of ``optimizer`` calls ``_step_pre_hook`` (a replica healing from
    us must not read half-updated weights) and the subclass's
    ``_step_post_hook``; leaving removes both hooks."""

    def __init__(self, manager: Manager, optimizer: optim.Optimizer) -> None:
        self._manager = manager
        self._hooked_optimizer = optimizer
        self._local_step = 0
        self._hooks: List[RemovableHandle] = []

    def __enter__(self: _Hooked) -> _Hooked:
        self._hooks.append(
            self._hooked_optimizer.register_step_pre_hook(self._step_pre_hook)
        )
        self._hooks.append(
            self._hooked_optimizer.register_step_post_hook(self._step_post_hook)
        )
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc_value: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> bool:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return False

    def _step_pre_hook(self, _optim: optim.Optimizer, _args: object, _kwargs: object) -> None:
        self._manager.disallow_state_dict_read()

    def _step_post_hook(self, _optim: optim.Optimizer, _args: object, _kwargs: object) -> None:
        raise NotImplementedError


class LocalSGD(_OptimizerHooks):
    """Averages the model parameters across replicas every ``sync_every``
    optimizer steps (https://arxiv.org/abs/1805.09767).

    Use as a context manager around the training loop; inside it each
    ``optimizer.step()`` counts, and the step that reaches ``sync_every``
    starts a quorum, averages every parameter over the participating
    replicas and, if the commit vote passes, copies the averages into the
    model.  A failed sync leaves the parameters as they are (no rollback).
    Only the model is kept consistent across replicas, not the optimizer
    state.  With an async quorum a joining replica heals at the first sync
    and its first ``sync_every`` steps are wasted.

    Args:
        manager: the Manager of this replica group rank.
        model: the model whose parameters are averaged.
        optimizer: the (local) optimizer whose steps are counted.
        sync_every: optimizer steps between syncs (>= 1).
    """

    def __init__(
        self,
        manager: Manager,
        model: nn.Module,
        optimizer: optim.Optimizer,
        sync_every: int,
    ) -> None:
        if sync_every < 1:
            raise _ArgumentError(f"sync_every must be at least 1, got {sync_every}")
        super().__init__(manager, optimizer)
        self._model = model
        self._sync_every = sync_every

    def _step_post_hook(self, _optim: optim.Optimizer, _args: object, _kwargs: object) -> None:
        self._manager.allow_state_dict_read()
        self._local_step += 1
        if self._local_step >= self._sync_every:
            self.sync()

    def sync(self) -> None:
        """Starts a quorum and averages the parameters across replicas now."""
        self._manager.start_quorum()
        self._perform_sync()
        self._local_step = 0

    def _perform_sync(self) -> None:
        """Averages every parameter; commits the averages if the vote
        passes."""
        averaged = self._average()
        if self._manager.should_commit():
            with torch.no_grad():
                for p, avg in zip(self._model.parameters(), averaged):
                    _local_view(p).copy_(avg)

    def _average(self) -> List[torch.Tensor]:
        """Copies of the parameters, averaged over the participants."""
        works: List[Work] = []
        averaged: List[torch.Tensor] = []
        with torch.no_grad():
            for p in self._model.parameters():
                t = extract_local_tensor(p.data)
                averaged.append(t)
                works.append(self._manager.allreduce(t))
        for work in works:
            work.wait()
        return averaged


class _Bucket:
    """Pseudo-gradients packed into one flat buffer for one allreduce.

    The averages are copied back into the pseudo-gradients once: by a
    callback on the allreduce's future (as torchft's buckets are, so that
    a work whose future is already done, or a managed work once waited,
    leaves them unpacked), or by ``wait`` where that callback could not be
    attached or has not run yet."""

    def __init__(self, names: List[str], grads: List[torch.Tensor]) -> None:
        self._lock = threading.Lock()
        self._unpacked = False
        self.names = names
        numel = sum(g.numel() for g in grads)
        self.buffer = torch.zeros(numel, dtype=grads[0].dtype, device=grads[0].device)
        self.spans: List[Tuple[int, int]] = []
        offset = 0
        for g in grads:
            self.buffer[offset : offset + g.numel()].copy_(g.reshape(-1))
            self.spans.append((offset, g.numel()))
            offset += g.numel()

    def unpack(self, grads: Dict[str, torch.Tensor]) -> None:
        """Copies the buffer into ``grads`` (the first call only)."""
        with self._lock:
            if self._unpacked:
                return
            self._unpacked = True
            with torch.no_grad():
                for name, (offset, numel) in zip(self.names, self.spans):
                    grads[name].copy_(self.buffer[offset : offset + numel].view_as(grads[name]))

    def unpack_when_done(self, work: Work, grads: Dict[str, torch.Tensor]) -> None:
        """Unpacks into ``grads`` when ``work``'s future completes."""

        def done(_fut: object) -> List[torch.Tensor]:
            self.unpack(grads)
            return []

        try:
            work.get_future().then(done)
        except (RuntimeError, NotImplementedError, AttributeError):
            pass  # a work without a future: wait() unpacks


class _StreamingDiLoCoFragment:
    """One fragment of a DiLoCo model: its global parameters (backup), its
    outer optimizer, and the two halves of its sync."""

    bucket_cap_mb: int = 1024 * 1024 * 1024  # bytes, despite the name (as torchft)
    use_bucketization: bool = False

    def __init__(
        self,
        manager: Manager,
        model_fragment: nn.Module,
        fragment_id: int,
        fragment_sync_offset: int,
        inner_optimizer: optim.Optimizer,
        outer_optimizer: optim.Optimizer,
        sync_every: int,
        backup_device: Optional[torch.device] = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: Optional[int] = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        if fragment_sync_offset > sync_every:
            raise ValueError(
                f"fragment {fragment_id}: sync offset {fragment_sync_offset} is past "
                f"sync_every={sync_every}"
            )
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(
                f"fragment_update_alpha must be in [0, 1], got {fragment_update_alpha}"
            )
        self._manager = manager
        self._model_fragment = model_fragment
        self._fragment_id = fragment_id
        # (inner_optimizer and fragment_sync_delay are torchft's signature:
        # DiLoCo counts the steps and picks when each half of a sync runs)
        self._outer_optimizer = outer_optimizer
        self.should_quantize = should_quantize
        self._fragment_update_alpha = fragment_update_alpha

        if bucket_cap_mb is not None:
            self.bucket_cap_mb = int(bucket_cap_mb * 1024 * 1024)
        self.use_bucketization = use_bucketization or config.get("TORCHFT_USE_BUCKETIZATION")

        self._grads: Dict[str, torch.Tensor] = {}
        self._local_parameters: Dict[str, torch.Tensor] = {}
        self._allreduce_work: List[Work] = []
        self._buckets: List[_Bucket] = []

        pin = (
            pin_memory
            and (backup_device is None or torch.device(backup_device).type == "cpu")
            and torch.cuda.is_available()
        )
        self.original_parameters: Dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                local = _local_view(p.data)
                backup = torch.empty_like(local, device=backup_device or "cpu")
                if pin:
                    backup = backup.pin_memory()
                self.original_parameters[name] = backup
        self.save_parameters()

    # -- state ----------------------------------------------------------------

    def register_state_dict_fn(self) -> None:
        """Registers the global parameters and the outer optimizer state
        with the Manager, for replicas that heal from this one."""

        def load_fn(state: Dict[str, object]) -> None:
            received = state["original_parameters"]
            assert isinstance(received, dict)
            with torch.no_grad():
                for name, t in received.items():
                    self.original_parameters[name].copy_(t)
            self._outer_optimizer.load_state_dict(state["outer_optimizer"])  # type: ignore[arg-type]

        def save_fn() -> Dict[str, object]:
            return {
                "outer_optimizer": self._outer_optimizer.state_dict(),
                "original_parameters": {
                    name: t.clone() for name, t in self.original_parameters.items()
                },
            }

        self._manager.register_state_dict_fn(
            f"StreamingDiLoCoFragment_{self._fragment_id}", load_fn, save_fn
        )

    def save_parameters(self) -> None:
        """The fragment's current parameters become its global parameters."""
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                self.original_parameters[name].copy_(_local_view(p.data), non_blocking=True)

    def _save_local_parameters(self) -> None:
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                self._local_parameters[name] = extract_local_tensor(p.data)

    def restore_parameters(self) -> None:
        """Puts the global parameters back into the fragment."""
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                local = _local_view(p.data)
                local.copy_(self.original_parameters[name].to(local.device), non_blocking=False)

    def _save_grads(self) -> None:
        """Pseudo-gradients: global minus local parameters."""
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                local = _local_view(p.data)
                self._grads[name] = self.original_parameters[name].to(local.device) - local

    def _set_grads(self) -> None:
        for name, p in self._model_fragment.named_parameters():
            p.grad = _like_param(p, self._grads[name])

    def _clear_local_parameters(self) -> None:
        self._local_parameters = {}

    def _merge_parameters(self) -> None:
        """Mixes the new global parameters with the local ones:
        ``global + alpha * (local - global)``."""
        alpha = self._fragment_update_alpha
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                _local_view(p.data).lerp_(self._local_parameters[name], alpha)

    # -- sync -----------------------------------------------------------------

    def prepare_sync(self) -> None:
        """Computes the pseudo-gradients and starts averaging them."""
        self._save_grads()
        assert not self._allreduce_work, "the previous sync of this fragment is unfinished"
        self._average_grads()

    def wait(self) -> None:
        """Waits for the pseudo-gradient averages (a failure is swallowed
        by the Manager and fails the commit)."""
        for work in self._allreduce_work:
            work.wait()
        for bucket in self._buckets:
            bucket.unpack(self._grads)
        self._allreduce_work = []
        self._buckets = []

    def perform_sync(self) -> bool:
        """Finishes the sync: back to the global parameters, the commit
        vote, and on success the outer step and the merge.

        Returns:
            The commit decision.
        """
        self.wait()
        self._save_local_parameters()
        self.restore_parameters()
        should_commit = self._manager.should_commit()
        if should_commit:
            self._set_grads()
            self._outer_optimizer.step()
            self.save_parameters()
            self._merge_parameters()
        self._outer_optimizer.zero_grad()
        self._clear_local_parameters()
        self._grads = {}
        return should_commit

    def _average_grads(self) -> None:
        if self.use_bucketization:
            self._allreduce_bucketized()
        else:
            self._allreduce_per_param()

    def _allreduce_per_param(self) -> None:
        for name in self._grads:
            self._allreduce_work.append(
                self._manager.allreduce(self._grads[name], should_quantize=self.should_quantize)
            )

    def _bucketize(self) -> List[_Bucket]:
        """Packs whole pseudo-gradients, in order, into buckets of at most
        ``bucket_cap_mb`` bytes; one of the same dtype and device each.  A
        pseudo-gradient larger than the cap gets a bucket of its own."""
        buckets: List[_Bucket] = []
        names: List[str] = []
        grads: List[torch.Tensor] = []
        size = 0
        for name, g in self._grads.items():
            nbytes = g.numel() * g.element_size()
            if grads and (
                size + nbytes > self.bucket_cap_mb
                or g.dtype != grads[0].dtype
                or g.device != grads[0].device
            ):
                buckets.append(_Bucket(names, grads))
                names, grads, size = [], [], 0
            names.append(name)
            grads.append(g)
            size += nbytes
        if grads:
            buckets.append(_Bucket(names, grads))
        return buckets

    def _allreduce_bucketized(self) -> None:
        self._buckets = self._bucketize()
        for bucket in self._buckets:
            work = self._manager.allreduce(bucket.buffer, should_quantize=self.should_quantize)
            bucket.unpack_when_done(work, self._grads)
            self._allreduce_work.append(work)

    # torchft's name for the bucketized path
    _bucketize_and_allreduce = _allreduce_bucketized


class DiLoCo(_OptimizerHooks):
    """DiLoCo (https://arxiv.org/abs/2311.08105) and Streaming DiLoCo
    (https://arxiv.org/abs/2501.18512) over a Manager.

    Every inner optimizer step trains locally.  Every ``sync_every /
    len(model_fragments)`` steps one fragment is synchronised: its
    pseudo-gradient (global minus local parameters) is averaged over the
    replicas, the model is put back on the fragment's global parameters,
    and if the commit vote passes the outer optimizer applies the average,
    the result becomes the new global parameters, and it is mixed with the
    local ones by ``fragment_update_alpha``.  If anything fails the
    fragment stays on its last global parameters.  The global parameters
    are kept on ``backup_device`` (CPU by default).

    Use as a context manager around the training loop.  The Manager must
    use a synchronous quorum, and its ``quorum_timeout`` must cover the
    steps between two syncs.

    Args:
        manager: the Manager (``use_async_quorum=False``).
        model_fragments: the model's parts, synchronised in turn.
        inner_optimizer: the local optimizer, stepped every step.
        outer_optimizer: one per fragment (or one, for one fragment); it
            steps the global parameters with the averaged pseudo-gradient.
        sync_every: inner steps between two syncs of the same fragment
            (a multiple of the number of fragments).
        backup_device: where the global parameters live (default CPU).
        pin_memory: pin a CPU backup when CUDA is available.
        use_bucketization: average the pseudo-gradients in flat buckets
            (also ``TORCHFT_USE_BUCKETIZATION=True``).
        bucket_cap_mb: bucket size in MiB (default 1 GiB).
        should_quantize: passed to ``Manager.allreduce``.
        fragment_sync_delay: inner steps between starting a fragment's
            average and applying it (less than ``sync_every /
            len(model_fragments)``).
        fragment_update_alpha: 0 keeps the new global parameters, 1 the
            local ones, in between a linear mix.

    Raises:
        ValueError: an async-quorum Manager or an invalid fragment
            configuration.
        AssertionError: (also a ValueError) the number of outer optimizers
            differs from the number of fragments.
    """

    def __init__(
        self,
        manager: Manager,
        model_fragments: List[nn.Module],
        inner_optimizer: optim.Optimizer,
        outer_optimizer: Union[optim.Optimizer, list[optim.Optimizer]],
        sync_every: int,
        backup_device: Optional[torch.device] = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: Optional[int] = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        n = len(model_fragments)
        if isinstance(outer_optimizer, optim.Optimizer):
            # one outer optimizer for one fragment (torchft's older form)
            outer_optimizers = [outer_optimizer]
        else:
            outer_optimizers = list(outer_optimizer)
        if len(outer_optimizers) != n:
            raise _ArgumentError(
                f"got {len(outer_optimizers)} outer optimizers for {n} model fragments: "
                "give one per fragment"
            )
        if n < 1:
            raise ValueError("DiLoCo needs at least one model fragment")
        if manager._use_async_quorum:
            raise ValueError(
                "DiLoCo needs a synchronous quorum: create the Manager with "
                "use_async_quorum=False"
            )
        if sync_every < n:
            raise ValueError(
                f"sync_every={sync_every} is less than the number of fragments ({n}): "
                "at most one fragment can be synchronised per step"
            )
        if sync_every % n != 0:
            raise ValueError(
                f"sync_every={sync_every} must be a multiple of the number of "
                f"fragments ({n})"
            )

        if not 0 <= fragment_sync_delay < sync_every // n:
            raise ValueError(
                f"fragment_sync_delay={fragment_sync_delay} must be in [0, "
                f"{sync_every // n}), the steps between two fragment syncs: a "
                "fragment's sync must finish before the next one starts"
            )

        super().__init__(manager, inner_optimizer)
        self._outer_optimizers = outer_optimizers
        self._sync_every = sync_every // n
        self._fragment_sync_delay = fragment_sync_delay

        self._fragments: List[_StreamingDiLoCoFragment] = [
            _StreamingDiLoCoFragment(
                manager,
                fragment,
                i,
                math.floor((sync_every / n) * (i + 1)),
                inner_optimizer,
                outer_optimizers[i],
                sync_every,
                backup_device,
                pin_memory,
                use_bucketization,
                bucket_cap_mb,
                should_quantize,
                fragment_sync_delay,
                fragment_update_alpha,
            )
            for i, fragment in enumerate(model_fragments)
        ]
        self._register_state_dict_fn()

    def _register_state_dict_fn(self) -> None:
        for fragment in self._fragments:
            fragment.register_state_dict_fn()

    def _current_fragment(self) -> int:
        """The fragment to sync: chosen by the committed step, so that every
        replica syncs the same one and a failed sync is retried."""
        return self._manager.current_step() % len(self._fragments)

    def _step_post_hook(self, _optim: optim.Optimizer, _args: object, _kwargs: object) -> None:
        self._manager.allow_state_dict_read()
        self._local_step += 1
        if self._local_step == self._sync_every - self._fragment_sync_delay:
            # (a healing replica gets its step, and so the fragment, here)
            self._manager.start_quorum()
            self._fragments[self._current_fragment()].prepare_sync()
        if self._local_step == self._sync_every:
            self._fragments[self._current_fragment()].perform_sync()
            self._local_step = 0
