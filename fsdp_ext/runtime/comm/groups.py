"""Who a unit's (or a bucket's) collectives talk to: the process groups it shards and replicates
over, made from a DeviceMesh or given as process groups."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Groups:
    """Who a unit shards over and who it replicates over.

    shard: ranks that each hold 1/shard_size of the unit (None: one rank, nothing to gather).
    replicate: ranks holding the same shard; gradients are all-reduced over them (HSDP, NO_SHARD).
    post_forward: for `reshard_after_forward=k`, the k ranks whose chunks rebuild the unit in backward
        (made at the root's first forward: process_groups.make_first_forward_groups).
    """

    device: torch.device
    shard: dist.ProcessGroup | None = None
    replicate: dist.ProcessGroup | None = None
    post_forward: dist.ProcessGroup | None = None
    post_forward_size: int = 1
    # The int the user gave reshard_after_forward (1 for a bool): post_forward_size is 1 where k
    # equals the shard size (the same as True here), but an own mesh must still be divisible by it
    requested_post_forward: int = 1
    # set_separate_reduce_scatter_group: a second group over the shard ranks for the gradient
    # reductions, so they do not queue behind all-gathers on one communicator
    separate_reduce_scatter: dist.ProcessGroup | None = None
    # No process group existed and no launcher started this process: one process, nothing sharded
    # (api/default_group.py). Said by describe() and at the root's first forward.
    single_process: bool = False

    @classmethod
    def over(cls, device: torch.device, shard, replicate, **others) -> "Groups":
        """The groups of `shard` and `replicate` ranks; a group of one rank is none (nothing to
        gather from, or to reduce with)."""
        def several(group):
            return group if group is not None and dist.get_world_size(group) > 1 else None
        return cls(device=device, shard=several(shard), replicate=several(replicate), **others)

    @classmethod
    def of_mesh(cls, mesh, device: torch.device) -> "Groups":
        """A 1-D mesh's ranks shard; a 2-D mesh's first dim replicates, its second shards (HSDP)."""
        if mesh.ndim not in (1, 2):
            raise ValueError(f"mesh must be 1-D (shard) or 2-D (replicate, shard); got "
                             f"{mesh.ndim}-D")
        return cls.over(device, mesh.get_group(mesh.ndim - 1),
                        mesh.get_group(0) if mesh.ndim == 2 else None)

    def set_post_forward(self, group: dist.ProcessGroup | None) -> None:
        self.post_forward = group

    def set_separate_reduce_scatter(self, group: dist.ProcessGroup | None) -> None:
        self.separate_reduce_scatter = group

    @property
    def reduce_scatter(self) -> dist.ProcessGroup | None:
        return self.separate_reduce_scatter or self.shard

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard) if self.shard is not None else 1

    @property
    def shard_rank(self) -> int:
        return dist.get_rank(self.shard) if self.shard is not None else 0

    @property
    def replicate_size(self) -> int:
        return dist.get_world_size(self.replicate) if self.replicate is not None else 1

    @property
    def data_parallel_size(self) -> int:
        return self.shard_size * self.replicate_size

    @property
    def post_forward_rank(self) -> int:
        return dist.get_rank(self.post_forward) if self.post_forward is not None else 0
