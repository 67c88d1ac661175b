"""Who a unit's (or a bucket's) collectives talk to: the process groups it shards and replicates
over, made from a DeviceMesh or given as process groups."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


# Process groups made after the Groups that use them, each once per rank set, by
# process_groups.py: the post-forward groups at the root's first forward, the reductions' own group
# when set_separate_reduce_scatter_group asks for it. (purpose, base group, size) -> group: a
# Groups looks them up (it stays as built); nothing on a step's path makes one.
_MADE_LATER: dict[tuple, dist.ProcessGroup] = {}


def record_made_later(purpose: str, base: dist.ProcessGroup, size: int,
                      group: dist.ProcessGroup | None) -> None:
    _MADE_LATER[(purpose, base, size)] = group


@dataclass(frozen=True)
class Groups:
    """Who a unit shards over and who it replicates over; fixed when the unit is built.

    shard: ranks that each hold 1/shard_size of the unit (None: one rank, nothing to gather).
    replicate: ranks holding the same shard; gradients are all-reduced over them (HSDP, NO_SHARD).
    post_forward_size: for `reshard_after_forward=k`, the k ranks whose chunks rebuild the unit in
        backward (their group, `post_forward`, is made at the root's first forward:
        process_groups.make_first_forward_groups).
    """

    device: torch.device
    shard: dist.ProcessGroup | None = None
    replicate: dist.ProcessGroup | None = None
    post_forward_size: int = 1
    # The int the user gave reshard_after_forward (1 for a bool): post_forward_size is 1 where k
    # equals the shard size (the same as True here), but an own mesh must still be divisible by it
    requested_post_forward: int = 1
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

    @property
    def post_forward(self) -> dist.ProcessGroup | None:
        """The group that regathers the unit in backward after `reshard_after_forward=k`, as
        recorded (None before it is: the root's first forward makes it)."""
        return _MADE_LATER.get(("post_forward", self.shard, self.post_forward_size))

    def reduce_scatter_over(self, separate: bool) -> dist.ProcessGroup | None:
        """The group the gradient reductions run on: the shard group, or (separate: the unit's
        setting) its own group over the same ranks, where one was made."""
        found = _MADE_LATER.get(("reduce_scatter", self.shard, 0)) if separate else None
        return found if found is not None else self.shard

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
