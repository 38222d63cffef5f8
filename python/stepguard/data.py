"""Data for fault-tolerant training: a sampler, and a loader whose position
in the data is committed state.

``DistributedSampler`` is torchft's: a static shard per (replica group,
group rank); the shards of replica groups that are down are skipped, so
training on a changing set of replicas is lossy.  It can save and resume its
own position (``state_dict``), but knows nothing of commits.

``ManagedDataLoader`` reads one stream of samples (the epochs' orders, one
after the other) with a cursor that advances only with committed steps: each
committed step consumes the next global batch, cut into one slice per
participating replica (in the order of their replica ranks among the
participants) and, inside a replica group, per group rank.  The cursor is
derived from the Manager's committed batch count, which every replica holds
alike and a healing replica receives with the parameters, so a replacement
reads on where its predecessor would have, a discarded step's batch is served
again, and a change in the number of participants re-splits the rest of the
data without losing or repeating a sample.  ``docs/data.md`` states the rule
and its limits.
"""

from __future__ import annotations

import collections
import random
import sys
from typing import Any, Callable, Deque, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils import data

__all__ = ["DistributedSampler", "ManagedDataLoader", "StepSlice", "step_slice"]


class DistributedSampler(data.distributed.DistributedSampler):
    """torch's DistributedSampler over ``num_replicas * num_replica_groups``
    shards; this rank reads shard ``group_rank + num_replicas * replica_rank``.

    Its position can be saved and restored: ``state_dict()`` holds the epoch,
    the seed and ``offset``, the number of this shard's indices already
    consumed, which the caller advances (``advance``) as steps commit;
    iteration starts at ``offset``.  ``set_epoch`` to another epoch starts
    that epoch at offset 0.  For a position that survives a change in the
    number of replicas, use :class:`ManagedDataLoader`.

    Args:
        dataset: the dataset.
        replica_rank: this replica group's index.
        num_replica_groups: the maximum number of replica groups.
        group_rank: rank inside the group (default: ``dist.get_rank()``).
        num_replicas: ranks per group (default: ``dist.get_world_size()``).
        **kwargs: passed to torch's DistributedSampler (shuffle, seed, ...).
    """

    def __init__(
        self,
        dataset: data.Dataset,
        replica_rank: int,
        num_replica_groups: int,
        group_rank: Optional[int] = None,
        num_replicas: Optional[int] = None,
        **kwargs: object,
    ) -> None:
        if group_rank is None:
            group_rank = dist.get_rank()
        if num_replicas is None:
            num_replicas = dist.get_world_size()
        self.replica_rank: int = replica_rank
        self.num_replica_groups: int = num_replica_groups
        self.group_rank: int = group_rank
        self.group_world_size: int = num_replicas
        self.global_rank: int = group_rank + num_replicas * replica_rank
        self.global_world_size: int = num_replicas * num_replica_groups
        self.offset: int = 0
        super().__init__(
            dataset,
            rank=self.global_rank,
            num_replicas=self.global_world_size,
            **kwargs,  # type: ignore[arg-type]
        )

    def __iter__(self) -> Iterator[int]:
        it = super().__iter__()
        for _ in range(min(self.offset, self.num_samples)):
            next(it)
        return it

    def __len__(self) -> int:
        return max(0, self.num_samples - self.offset)

    def set_epoch(self, epoch: int) -> None:
        """Starts ``epoch`` (at offset 0 unless it is the current one)."""
        if epoch != self.epoch:
            self.offset = 0
        super().set_epoch(epoch)

    def advance(self, n: int) -> None:
        """Counts ``n`` more of this shard's indices as consumed."""
        if n < 0:
            raise ValueError(f"advance: n must be >= 0, got {n}")
        self.offset += n

    def order(self, epoch: int) -> List[int]:
        """Every index of the dataset in ``epoch``'s order (the permutation
        torch's sampler shards, without its padding): a shuffle seeded with
        ``seed + epoch``, or ``0..len-1``."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=g).tolist()

    def state_dict(self) -> Dict[str, int]:
        """The position: ``{"epoch", "seed", "offset"}``."""
        return {"epoch": int(self.epoch), "seed": int(self.seed), "offset": int(self.offset)}

    def load_state_dict(self, state_dict: Dict[str, int]) -> None:
        """Restores a position saved by ``state_dict``.

        Raises:
            ValueError: a field is missing or negative.
        """
        try:
            epoch, seed, offset = (int(state_dict[k]) for k in ("epoch", "seed", "offset"))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a sampler state: {state_dict!r} ({e})") from None
        if epoch < 0 or offset < 0:
            raise ValueError(f"not a sampler state (negative field): {state_dict!r}")
        self.epoch = epoch
        self.seed = seed
        self.offset = offset


def step_slice(
    position: int,
    batch_size: int,
    participants: int,
    participant_rank: int,
    group_world_size: int = 1,
    group_rank: int = 0,
) -> Tuple[int, int]:
    """The stream positions ``[start, stop)`` one rank reads in a step.

    A step that begins at stream ``position`` consumes
    ``participants * group_world_size * batch_size`` positions: replica
    group ``participant_rank`` (its rank among the participants) takes the
    ``participant_rank``-th run of ``group_world_size * batch_size``, and
    group rank ``group_rank`` the ``group_rank``-th ``batch_size`` of that.

    Raises:
        ValueError: an argument out of range.
    """
    if batch_size <= 0 or participants <= 0 or group_world_size <= 0 or position < 0:
        raise ValueError(
            f"step_slice: position={position} batch_size={batch_size} "
            f"participants={participants} group_world_size={group_world_size}"
        )
    if not 0 <= participant_rank < participants or not 0 <= group_rank < group_world_size:
        raise ValueError(
            f"step_slice: participant_rank={participant_rank} of {participants}, "
            f"group_rank={group_rank} of {group_world_size}"
        )
    start = position + (participant_rank * group_world_size + group_rank) * batch_size
    return start, start + batch_size


class StepSlice(NamedTuple):
    """What ``ManagedDataLoader`` served for one step."""

    position: int  # the committed stream position the step begins at
    participants: int  # replica groups that take part (1 for a non-participant)
    participant_rank: Optional[int]  # None: not a participant (healing, spare)
    start: int  # this rank's stream positions [start, stop)
    stop: int
    keys: List[Tuple[int, int]]  # (epoch, dataset index) per sample


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 over them)."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) + 0x9E3779B97F4A7C15
        x &= 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


class _SeededDataset(data.Dataset):
    """Reads ``(epoch, index)`` keys from the dataset with torch's, Python's
    and (if loaded) numpy's generators seeded from ``(seed, epoch, index)``,
    so a sample's random transforms are the same whoever reads it, after any
    restart or re-split.  In the trainer's own process (no loader workers)
    the generators' states are restored after each batch."""

    def __init__(self, dataset: data.Dataset, seed: int, seeded: bool = True) -> None:
        self.dataset = dataset
        self.seed = seed
        self.seeded = seeded

    def _one(self, key: Tuple[int, int]) -> Any:
        epoch, index = key
        s = _mix(self.seed, epoch, index)
        torch.default_generator.manual_seed(s)
        random.seed(s)
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed(s % (1 << 32))
        return self.dataset[index]

    def __getitem__(self, key: Tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: List[Tuple[int, int]]) -> List[Any]:
        if not self.seeded:
            return [self.dataset[index] for _, index in keys]
        if data.get_worker_info() is not None:
            return [self._one(k) for k in keys]
        np = sys.modules.get("numpy")
        saved = (
            torch.default_generator.get_state(),
            random.getstate(),
            np.random.get_state() if np is not None else None,
        )
        try:
            return [self._one(k) for k in keys]
        finally:
            torch.default_generator.set_state(saved[0])
            random.setstate(saved[1])
            if np is not None and saved[2] is not None:
                np.random.set_state(saved[2])

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]


class _Plan:
    """The batch sampler of the inner DataLoader: the slices of the steps
    after ``start``, one ``stride`` apart, assuming each commits with the
    same participants.  Each slice it hands out is noted in ``planned`` (the
    inner loader returns batches in that order)."""

    def __init__(self, loader: "ManagedDataLoader") -> None:
        self._loader = loader
        self.start = 0
        self.stride = 0
        self.planned: Deque[int] = collections.deque()

    def __iter__(self) -> Iterator[List[Tuple[int, int]]]:
        start, stride, planned = self.start, self.stride, self.planned
        loader = self._loader
        k = 0
        while True:
            s = start + k * stride
            planned.append(s)
            yield loader._keys(s, s + loader.batch_size)
            k += 1


class ManagedDataLoader:
    """A data loader whose position is committed with the training steps.

    Take each step's batch after the step's quorum has started
    (``optimizer.zero_grad()``, which calls ``manager.start_quorum()``)::

        loader = ManagedDataLoader(manager, dataset, batch_size=32,
                                   sampler=sampler, num_workers=2)
        manager.register_state_dict_fn("data", loader.load_state_dict,
                                       loader.state_dict)
        while ...:
            optimizer.zero_grad()
            x, y = next(loader)
            ...
            optimizer.step()

    The batch is this rank's slice (:func:`step_slice`) of the global batch
    that begins at the committed stream position, read with the quorum's
    participants: the position is ``batches_committed`` of the Manager
    (participants summed over committed steps) times the samples each
    replica group reads per step, counted from the position last loaded.
    The stream is the epochs' orders one after the other (the sampler's
    shuffle with ``seed + epoch``); a step may span two epochs.  Each sample
    is read with the random generators seeded from ``(seed, epoch, index)``.

    With ``num_workers > 0`` the next ``prefetch_steps`` steps are read
    ahead by persistent worker processes, on the guess that steps commit
    with the same participants; when a step is discarded or the
    participants change, what was read ahead is dropped and the right slice
    read.

    Args:
        manager: the :class:`~stepguard.manager.Manager`.
        dataset: a map-style dataset (``len`` and ``[index]``).
        batch_size: samples per rank per step.
        sampler: gives the order (``shuffle``, ``seed``) and the group rank
            and group size; default: no shuffle, the Manager's group.
        num_workers: worker processes (0: read in this process).
        collate_fn: builds a batch from a list of samples (default torch's).
        prefetch_steps: steps read ahead per worker (``num_workers > 0``).
        pin_memory: as torch's DataLoader.
        timeout: seconds to wait for a batch from the workers (0: forever,
            as torch's DataLoader).
        multiprocessing_context: as torch's DataLoader.
        worker_init_fn: as torch's DataLoader.
        seeded: seed the random generators per sample (see above); False
            reads samples with whatever state the generators have (cheaper:
            about 9 us per sample here, but a sample's random transforms
            then depend on who reads it and when).
    """

    def __init__(
        self,
        manager: Any,
        dataset: data.Dataset,
        batch_size: int,
        sampler: Optional[DistributedSampler] = None,
        num_workers: int = 0,
        collate_fn: Optional[Callable[[List[Any]], Any]] = None,
        prefetch_steps: int = 2,
        pin_memory: bool = False,
        timeout: float = 0,
        multiprocessing_context: Any = None,
        worker_init_fn: Optional[Callable[[int], None]] = None,
        seeded: bool = True,
    ) -> None:
        if isinstance(dataset, data.IterableDataset):
            raise TypeError("ManagedDataLoader needs a map-style dataset (len and [index])")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if num_workers < 0 or prefetch_steps <= 0:
            raise ValueError(
                f"num_workers must be >= 0 and prefetch_steps > 0 "
                f"(got {num_workers}, {prefetch_steps})"
            )
        self._manager = manager
        self.dataset = dataset
        self.batch_size = batch_size
        if sampler is None:
            sampler = DistributedSampler(
                dataset,
                replica_rank=0,
                num_replica_groups=1,
                group_rank=manager._group_rank,
                num_replicas=manager._group_world_size,
                shuffle=False,
            )
        self.sampler = sampler
        self._len = len(dataset)  # type: ignore[arg-type]
        if self._len == 0:
            raise ValueError("ManagedDataLoader: the dataset is empty")
        self.collate_fn = collate_fn or data.default_collate
        self._seeded = _SeededDataset(dataset, sampler.seed, seeded)
        self._orders: Dict[int, List[int]] = {}
        # (stream position, batches_committed) read together: the position
        # is this plus batch_size * group size per committed batch after it
        self._anchor: Tuple[int, int] = (0, 0)
        self._last_quorum: object = None
        self.last: Optional[StepSlice] = None
        self._plan: Optional[_Plan] = None
        self._inner: Optional[data.DataLoader] = None
        self._inner_it: Optional[Iterator[Any]] = None
        self._inner_kwargs: Dict[str, Any] = dict(
            num_workers=num_workers,
            collate_fn=self.collate_fn,
            pin_memory=pin_memory,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            prefetch_factor=prefetch_steps,
            persistent_workers=True,
        )
        if num_workers > 0:
            self._plan = _Plan(self)
            self._make_inner()

    def _make_inner(self) -> None:
        """The torch DataLoader whose persistent workers read ahead (they
        hold a copy of the seeded dataset: a new seed needs new workers)."""
        assert self._plan is not None
        self._inner_it = None
        self._inner = data.DataLoader(
            self._seeded,
            batch_sampler=self._plan,  # type: ignore[arg-type]
            # iterators are started often (a reset per misguess): an own
            # generator, so the trainer's global one is not drawn from
            generator=torch.Generator(),
            **self._inner_kwargs,
        )

    # -- position -------------------------------------------------------------

    @property
    def samples_per_group(self) -> int:
        """Samples one replica group reads per step."""
        return self.batch_size * self.sampler.group_world_size

    def position(self) -> int:
        """The committed stream position: where the next step begins."""
        pos, batches = self._anchor
        now = int(self._manager.batches_committed())
        if now < batches:
            raise RuntimeError(
                f"the Manager's committed batch count ({now}) is behind the data "
                f"position's ({batches}): load the Manager's state with the loader's"
            )
        return pos + (now - batches) * self.samples_per_group

    @property
    def epoch(self) -> int:
        """The epoch of the committed position."""
        return self.position() // self._len

    def state_dict(self) -> Dict[str, int]:
        """The committed position (read it with the Manager's state, between
        steps: the Manager reads both together for a healing replica)."""
        pos, batches = self._anchor
        now = int(self._manager.batches_committed())
        position = pos + (now - batches) * self.samples_per_group
        return {
            "position": position,
            "batches_committed": now,
            "epoch": position // self._len,
            "offset": position % self._len,
            "seed": int(self.sampler.seed),
            "shuffle": int(bool(self.sampler.shuffle)),
            "dataset_len": self._len,
        }

    def load_state_dict(self, state_dict: Dict[str, int]) -> None:
        """Restores a position saved by ``state_dict`` (load the Manager's
        state with it: the position counts on from its committed batches).

        Raises:
            ValueError: not a loader state, or one of another dataset.
        """
        try:
            position = int(state_dict["position"])
            batches = int(state_dict["batches_committed"])
            seed = int(state_dict["seed"])
            shuffle = bool(state_dict["shuffle"])
            length = int(state_dict["dataset_len"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a ManagedDataLoader state: {state_dict!r} ({e})") from None
        if position < 0 or batches < 0:
            raise ValueError(f"not a ManagedDataLoader state (negative): {state_dict!r}")
        if length != self._len:
            raise ValueError(
                f"the state is of a dataset of {length} samples, this one has {self._len}"
            )
        if seed != self.sampler.seed or shuffle != bool(self.sampler.shuffle):
            self.sampler.seed = seed
            self.sampler.shuffle = shuffle
            self._seeded.seed = seed
            self._orders.clear()
            if self._plan is not None:
                self._make_inner()
        self._anchor = (position, batches)
        self.sampler.set_epoch(position // self._len)

    # -- reading --------------------------------------------------------------

    def _order(self, epoch: int) -> List[int]:
        order = self._orders.get(epoch)
        if order is None:
            if len(self._orders) >= 2:
                for e in sorted(self._orders)[:-1]:
                    del self._orders[e]
            order = self._orders[epoch] = self.sampler.order(epoch)
        return order

    def _keys(self, start: int, stop: int) -> List[Tuple[int, int]]:
        out = []
        for p in range(start, stop):
            epoch, off = divmod(p, self._len)
            out.append((epoch, self._order(epoch)[off]))
        return out

    def __iter__(self) -> "ManagedDataLoader":
        return self

    def __next__(self) -> Any:
        """This rank's batch of the step whose quorum was started last.

        Raises:
            RuntimeError: no quorum was started since the last batch.
        """
        manager = self._manager
        fut = getattr(manager, "_quorum_future", None)
        if fut is None or fut is self._last_quorum:
            raise RuntimeError(
                "take a step's batch after its quorum has started "
                "(optimizer.zero_grad() / manager.start_quorum()), once per step"
            )
        self._last_quorum = fut
        participants = manager.num_participants()  # waits for the quorum
        rank = manager.participating_rank()
        if rank is None or participants <= 0:
            # not a participant: its batch counts for nothing (its gradients
            # are zeros to the others); read as if alone
            participants, rank, counted = 1, 0, False
        else:
            counted = True
        position = self.position()
        start, stop = step_slice(
            position,
            self.batch_size,
            participants,
            rank,
            self.sampler.group_world_size,
            self.sampler.group_rank,
        )
        stride = participants * self.samples_per_group
        keys = self._keys(start, stop)
        self.last = StepSlice(position, participants, rank if counted else None, start, stop, keys)
        if self._inner is None:
            return self.collate_fn(self._seeded.__getitems__(keys))
        return self._read_ahead(start, stride)

    def _read_ahead(self, start: int, stride: int) -> Any:
        plan = self._plan
        assert plan is not None and self._inner is not None
        if self._inner_it is None or not plan.planned or plan.planned[0] != start:
            # a discarded step, other participants, a heal: drop what was
            # read ahead and read on from here
            plan.start, plan.stride = start, stride
            plan.planned = collections.deque()
            self._inner_it = iter(self._inner)
        batch = next(self._inner_it)
        got = plan.planned.popleft()
        assert got == start, f"read-ahead out of order: {got} != {start}"
        return batch

    def close(self) -> None:
        """Stops the worker processes."""
        self._inner_it = None
        self._inner = None
