"""Where a parameter is sharded: fully_shard's `shard_placement_fn(param)` read as torch's
fully_shard reads it. `None` (and no function) is Shard(0); `Shard(dim)` any dim of the parameter
(a negative one counted from the end). A parameter sharded along a later dim keeps torch.chunk's
chunks along that dim, uneven sizes padded in the shard (layout.py).

Refused at the call, naming the parameter: a dim out of range; another placement type; a
per-parameter mesh (torch 2.14's ShardPlacementResult with a mesh of its own), which fsdp_ext
does not shard over yet; Shard(dim > 0) for a tensor-parallel or tensor-subclass parameter.
"""
from __future__ import annotations

from torch.distributed.tensor import Shard


def shard_dim(shard_placement_fn, slot, module, subclass: bool) -> int:
    """The shard dim of `slot`'s parameter (of `module`) under `shard_placement_fn`."""
    if shard_placement_fn is None:
        return 0
    where = f"fully_shard({type(module).__name__}): shard_placement_fn for parameter '{slot.fqn}'"
    placement = shard_placement_fn(slot.param)
    if type(placement).__name__ == "ShardPlacementResult":  # torch >= 2.14's (placement, mesh)
        raise NotImplementedError(
            f"{where} returned a ShardPlacementResult (a mesh of its own for this parameter): "
            "fsdp_ext shards every parameter of a unit over the unit's mesh; return Shard(dim) "
            "or None")
    if placement is None:
        return 0
    if type(placement) is not Shard:
        raise NotImplementedError(f"{where} returned {placement!r}; fsdp_ext shards with "
                                  "Shard(dim) placements (or None for Shard(0))")
    ndim = len(slot.shape)
    dim = placement.dim + ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < ndim:
        raise ValueError(f"{where} returned Shard({placement.dim}), out of range for its "
                         f"{ndim}-D shape {list(slot.shape)}")
    if dim and (slot.tp_spec is not None or subclass):
        raise NotImplementedError(
            f"{where} returned Shard({dim}): a "
            f"{'tensor-parallel' if slot.tp_spec is not None else 'tensor-subclass'} parameter "
            "is sharded along dim 0 only")
    return dim
