"""Checks on what the user passes to fully_shard, run before any collective: a group this rank is
not in, or groups that contradict each other, would otherwise fail later inside a collective (or
hang) with a message that names neither the module nor the argument."""
from __future__ import annotations

import torch.distributed as dist
from torch import nn


def _members(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def check_mesh_and_groups(module: nn.Module, mesh, process_group) -> None:
    """Raise ValueError naming the module and this rank if `mesh` / `process_group` cannot work."""
    where = f"fully_shard({type(module).__name__})"
    if mesh is not None and process_group is not None:
        raise ValueError(f"{where}: pass either mesh or process_group, not both (the mesh already "
                         "defines the shard and replicate groups)")
    if not (dist.is_available() and dist.is_initialized()):
        return  # single process: there is nothing to shard over, whatever was passed
    rank = dist.get_rank()
    if mesh is not None:
        ranks = mesh.mesh.flatten().tolist()
        if rank not in ranks:
            raise ValueError(f"{where}: rank {rank} is not in the mesh (ranks {ranks}, shape "
                             f"{tuple(mesh.mesh.shape)}); every rank that shards the module must "
                             "belong to it")
        return
    groups = process_group if isinstance(process_group, tuple) else (process_group,)
    if isinstance(process_group, tuple) and len(process_group) != 2:
        raise ValueError(f"{where}: process_group as a tuple must be (shard, replicate), got "
                         f"{len(process_group)} groups")
    for kind, group in zip(("shard", "replicate"), groups):
        if group is None:
            continue
        if group == dist.GroupMember.NON_GROUP_MEMBER or rank not in _members(group):
            raise ValueError(f"{where}: rank {rank} is not a member of the {kind} process group"
                             f"{_describe(group)}; pass a group this rank belongs to")
    if len(groups) == 2 and all(g is not None for g in groups):
        common = sorted(set(_members(groups[0])) & set(_members(groups[1])))
        if common != [rank]:
            raise ValueError(
                f"{where}: on rank {rank} the shard group {_members(groups[0])} and the replicate "
                f"group {_members(groups[1])} share ranks {common}; they must meet only at this "
                "rank (rows and columns of a (replicate, shard) grid)")


def _describe(group) -> str:
    try:
        return f" (ranks {_members(group)})"
    except Exception:  # a group object of which this rank knows nothing
        return ""
