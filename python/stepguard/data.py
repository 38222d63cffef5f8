"""A data sampler that shards over every rank of every replica group.

Each (replica group, group rank) pair reads its own shard; the shards of
replica groups that are down are skipped, so training on a changing set of
replicas is lossy.  For exact data order, checkpoint a stateful data loader
per replica instead.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch.utils import data

__all__ = ["DistributedSampler"]


class DistributedSampler(data.distributed.DistributedSampler):
    """torch's DistributedSampler over ``num_replicas * num_replica_groups``
    shards; this rank reads shard ``group_rank + num_replicas * replica_rank``.

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
        self.global_rank: int = group_rank + num_replicas * replica_rank
        self.global_world_size: int = num_replicas * num_replica_groups
        super().__init__(
            dataset,
            rank=self.global_rank,
            num_replicas=self.global_world_size,
            **kwargs,  # type: ignore[arg-type]
        )
