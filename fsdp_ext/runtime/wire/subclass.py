"""Tensor-subclass parameters: FSDP2's all-gather extension (`fsdp_pre_all_gather` /
`fsdp_post_all_gather`), honoured as torch's fully_shard honours it.

A parameter whose tensor is a subclass with its own dispatch (torchao's int8 and float8 training
weights, NF4) cannot be a view of a flat shard: its data is several tensors of other dtypes.
Such parameters form buckets of their own per (dtype, requires_grad), with this wire format:

    sharded:   each parameter chunked along dim 0 as torch does (`torch.chunk` of the subclass
               itself, padded to the first chunk's rows with `new_zeros`); the local tensor of
               its DTensor parameter is that subclass, and the optimizer steps on it
    gather:    the pre-hook returns the tensors to gather (any number, any dtypes) and metadata;
               this rank's are copied as bytes into its slot of one staging buffer, one
               all-gather of bytes per bucket, then split rank-major into per-input outputs
    unshard:   the post-hook rebuilds the parameter from those outputs; later gathers refill the
               same outputs and call it with `out=` (torch's reuse path), so what it returned
               keeps aliasing them
    gradients: the unsharded parameter's gradient is a plain tensor of its full shape: the
               bucket reduces it by the rows layout exactly as a plain bucket (grads.py), into a
               plain gradient shard, published as a DTensor `.grad` (FSDP2 does the same)

A subclass without the hooks is gathered as itself: its one local tensor, copied into the bytes
(the subclass's own `copy_` into a plain tensor), and the unsharded parameter is that plain data,
as torch's default path gives. None of this goes through the fused kernels, which take plain
floating-point tensors: the copies here are torch's own ops, exact, and only for these buckets.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from ..placement import dtensor_params
from ..core import streams
from ..placement.dtensor_params import dispatches_itself
from .exact import ExactWire, GatherBuffers

_ALIGN_BYTES = 16  # each input's bytes start aligned in the staging buffer


def is_extension_tensor(tensor: torch.Tensor) -> bool:
    """A tensor subclass with dispatch of its own, or any tensor with FSDP2's hooks."""
    return (hasattr(tensor, "fsdp_pre_all_gather")
            or dispatches_itself(tensor))


def check_hooks(tensor: torch.Tensor, where: str) -> None:
    """Both hooks or neither (torch's rule); a pre-hook taking (mesh) or the five arguments."""
    pre = getattr(tensor, "fsdp_pre_all_gather", None)
    post = getattr(tensor, "fsdp_post_all_gather", None)
    if (pre is None) != (post is None):
        raise TypeError(f"{where}: its {type(tensor).__name__} defines only one of "
                        "fsdp_pre_all_gather / fsdp_post_all_gather; FSDP needs both or neither")
    if pre is not None and len(inspect.signature(pre).parameters) not in (1, 5):
        raise TypeError(f"{where}: {type(tensor).__name__}.fsdp_pre_all_gather"
                        f"{inspect.signature(pre)} must take (mesh) or (mesh, outer_size, "
                        "outer_stride, module, mp_policy)")


def shard_rows(tensor: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's dim-0 chunk of `tensor` (a subclass: its own split/new_zeros/copy_ do the
    work), allocated at the first chunk's rows and narrowed, as torch's fully_shard pads it."""
    chunks = list(torch.chunk(tensor, world, dim=0))
    while len(chunks) < world:
        chunks.append(chunks[0].new_empty(0))
    mine = chunks[rank]
    padded = tensor.new_zeros(chunks[0].size())
    rows = mine.size(0) if mine.numel() > 0 else 0
    if rows:
        padded.narrow(0, 0, rows).copy_(mine)
    return padded.narrow(0, 0, rows)


@dataclass(eq=False)
class _SubclassParam:
    """One subclass parameter's gather state. While gathered: `outputs` (one flat tensor per
    pre-hook input, all ranks' data), `unsharded` (what the post-hook built, shaped as the
    parameter) and `inner` (the tensors the post-hook said it holds: freed with the outputs,
    refilled before `out=` reuse)."""

    arity: int = 0                    # its pre-hook's arguments (1: mesh; 5: torch's), or 0
    outputs: list[torch.Tensor] = field(default_factory=list)
    input_sizes: list[torch.Size] = field(default_factory=list)
    input_dtypes: list[torch.dtype] = field(default_factory=list)
    metadata: object = None
    unsharded: torch.Tensor | None = None
    inner: list[torch.Tensor] = field(default_factory=list)


class SubclassWire(ExactWire):
    """The subclass parameters of a bucket: see the module docstring. Gradients are plain
    tensors of the parameters' shapes: reduced as an exact bucket's."""

    kind = "subclass"
    caches_views = False     # a post-hook's `out=` may give the unsharded tensor new attributes
    takes_comm_policy = False  # its hooks decide the bytes: gathered exactly

    def __init__(self):
        self.mesh = None                  # the shard mesh the pre-hooks are given
        self.mp_policy = None             # torch's MixedPrecisionPolicy, passed to the pre-hooks
        self.param_dtype: torch.dtype | None = None
        self.params: list[_SubclassParam] = []

    def describe(self, bucket) -> str:
        kinds = sorted({type(v).__name__ for v in bucket.shard_views})
        return f"tensor subclass {'/'.join(kinds)}, gathered through its hooks as bytes"

    def bind_unit(self, bucket, mesh, mp_policy, offload, post_forward_size: int,
                  unit_type: str) -> None:
        """What the hooks are called with (the shard mesh, torch's MixedPrecisionPolicy);
        refused, at the call, what they cannot do here."""
        where = (f"parameter '{bucket.slots[0].fqn}' of {unit_type}, a "
                 f"{type(bucket.shard_views[0]).__name__} (a tensor subclass)")
        if offload is not None:
            raise NotImplementedError(f"{where}: CPU offload of tensor-subclass parameters is "
                                      "not supported; shard this module without offload_policy")
        if post_forward_size > 1:
            raise NotImplementedError(
                f"{where}: reshard_after_forward=int regathers from post-forward chunks, which "
                "FSDP's all-gather hooks cannot give (torch's fully_shard refuses it too); use "
                "True or False for this module")
        self.mesh = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[-1]]
        self.mp_policy, self.param_dtype = mp_policy, mp_policy.param_dtype
        self.params = [_SubclassParam(len(inspect.signature(v.fsdp_pre_all_gather).parameters)
                                      if hasattr(v, "fsdp_pre_all_gather") else 0)
                       for v in bucket.shard_views]

    # ---- sharded state ------------------------------------------------------------------------
    def init_shard(self, bucket, device: torch.device, offload) -> None:
        """Each parameter's chunk, kept as its own subclass: no flat shard. (nn.Parameter
        detaches a subclass: the parameter's local tensor is an alias of the chunk.)"""
        world, rank = bucket.layout.world_size, bucket.layout.rank
        with torch.no_grad():
            chunks = [shard_rows(slot.param.detach(), world, rank) for slot in bucket.slots]
        bucket.become_dtensors(chunks)
        bucket.init_subclass_shard([dtensor_params.local_of(s.param) for s in bucket.slots])

    def gathered_numel(self, bucket) -> int:
        return 0

    def new_grad_shard(self, bucket) -> torch.Tensor:
        """Plain, in the parameters' dtype: what their gradients reduce into."""
        return torch.zeros(bucket.shard_numel, dtype=bucket.dtype,
                           device=bucket.shard_views[0].device)

    def sharded_bytes(self, bucket) -> int:
        return sum(_nbytes(t) for t in bucket.shard_views)

    def on_meta(self, bucket) -> bool:
        return False  # refused at fully_shard (param_buckets.py)

    def adopt(self, bucket, locals_: list[torch.Tensor]) -> None:
        bucket.init_subclass_shard(locals_)  # the new chunks are the shard

    def local_moved(self, local: torch.Tensor, view: torch.Tensor) -> bool:
        return local is not view  # the local tensor is the chunk itself

    def load_value(self, bucket, index: int, value, key: str, local_part) -> None:
        """This rank's rows of the full `value` into parameter `index`'s subclass chunk, with the
        subclass's own copy_ (torchao's int8 weights quantize what they are given); nothing for
        the caller to pack."""
        slot, layout = bucket.slots[index], bucket.layout
        if not isinstance(value, torch.Tensor) or isinstance(value, ShardedTensor):
            raise ValueError(f"{key}: a tensor-subclass parameter loads from a full tensor or a "
                             f"DTensor, not from a {type(value).__name__}")
        if value.shape != slot.shape:
            raise ValueError(f"size mismatch for {key}: copying a param with shape "
                             f"{list(value.shape)} from checkpoint, the shape in current model "
                             f"is {list(slot.shape)}")
        local = slot.shard_view
        # chunked as at fully_shard (a subclass value, e.g. a full_tensor() of one, splits itself)
        local.copy_(shard_rows(value.to(local.device), layout.world_size, layout.rank))
        return None

    # ---- gather ---------------------------------------------------------------------------------
    def _pre_all_gather(self, bucket) -> list[list[torch.Tensor]]:
        """Per parameter, what its pre-hook gives to gather (metadata kept for the post-hook)."""
        out = []
        for i, (slot, record) in enumerate(zip(bucket.slots, self.params)):
            local = slot.shard_view
            if not record.arity:
                inputs, record.metadata = (local,), None
            elif record.arity == 1:
                inputs, record.metadata = local.fsdp_pre_all_gather(self.mesh)
            else:
                shape = torch.Size(slot.shape)
                inputs, record.metadata = local.fsdp_pre_all_gather(
                    self.mesh, shape, torch._prims_common.make_contiguous_strides_for(shape),
                    slot.locations[0][0], self.mp_policy)
            padded_rows = bucket.layout.slots[i].chunk_rows
            if local.size(0) != padded_rows and any(t.size(0) != padded_rows for t in inputs):
                raise RuntimeError(
                    f"parameter '{slot.fqn}' ({type(local).__name__}) is sharded unevenly "
                    f"({slot.shape[0]} rows over {bucket.layout.world_size} ranks): its "
                    f"fsdp_pre_all_gather must return tensors of the padded {padded_rows} rows, "
                    f"got {[list(t.shape) for t in inputs]}")
            record.input_sizes = [t.size() for t in inputs]
            record.input_dtypes = [t.dtype for t in inputs]
            out.append(list(inputs))
        return out

    def _staging_offsets(self) -> tuple[list[list[int]], int]:
        """Per parameter and input, its byte offset in a rank's slot; the slot's bytes (Q)."""
        offsets, q = [], 0
        for record in self.params:
            offsets.append([])
            for size, dtype in zip(record.input_sizes, record.input_dtypes):
                offsets[-1].append(q)
                q = _round_up(q + size.numel() * dtype.itemsize, _ALIGN_BYTES)
        return offsets, q

    def gather_buffers(self, bucket, full, chunks, slot, world, group, shard) -> GatherBuffers:
        """Run the pre-hooks and copy this rank's bytes into slot `slot` of a new [W * Q] byte
        buffer (the all-gather's output, filled in place for this rank)."""
        inputs = self._pre_all_gather(bucket)
        offsets, q = self._staging_offsets()
        staging = torch.empty(world * q, dtype=torch.uint8, device=full.device)
        with torch.no_grad():
            for ts, offs in zip(inputs, offsets):
                for t, off in zip(ts, offs):
                    nbytes = t.numel() * t.dtype.itemsize
                    dst = staging.narrow(0, slot * q + off, nbytes).view(t.dtype).view(t.shape)
                    dst.copy_(t)  # a subclass's own copy_ where the input is one (no hooks)
        return GatherBuffers([staging], [staging.narrow(0, slot * q, q)], staging)

    def finish_gather(self, bucket, full, staging: torch.Tensor) -> None:
        """Split the gathered bytes rank-major into each input's output, then rebuild each
        parameter with its post-hook (`out=` once it was built)."""
        offsets, q = self._staging_offsets()
        world = staging.numel() // q if q else 0
        by_rank = staging.view(world, q) if q else staging
        for i, (record, offs) in enumerate(zip(self.params, offsets)):
            if not record.outputs:
                record.outputs = [torch.empty(world * s.numel(), dtype=d, device=staging.device)
                                  for s, d in zip(record.input_sizes, record.input_dtypes)]
            for out, size, dtype, off in zip(record.outputs, record.input_sizes,
                                             record.input_dtypes, offs):
                if out.untyped_storage().nbytes() == 0:
                    streams.alloc_storage(out)
                nbytes = size.numel() * dtype.itemsize
                # A refill, not an edit: what autograd saved of the last use is not stale (the
                # version counter stays, as torch's copy-out keeps it).
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.view(torch.uint8).view(world, nbytes).copy_(by_rank[:, off:off + nbytes])
            self._post_all_gather(bucket, i)

    def _post_all_gather(self, bucket, i: int) -> None:
        slot, record = bucket.slots[i], self.params[i]
        views = tuple(o.view(-1, *s[1:]) for o, s in zip(record.outputs, record.input_sizes))
        hook = getattr(slot.shard_view, "fsdp_post_all_gather", None)
        param_dtype = self.param_dtype or bucket.dtype
        if hook is None:
            built = views[0]
        elif record.unsharded is not None:  # refilled in place: the hook updates what it built
            for t in record.inner:
                if t.untyped_storage().nbytes() == 0:
                    streams.alloc_storage(t)
            hook(views, record.metadata, param_dtype, out=record.unsharded)
            record.metadata = None
            return
        else:
            built, inner = hook(views, record.metadata, param_dtype)
            record.inner = list(inner)
        record.metadata = None
        shape = torch.Size(slot.shape)
        record.unsharded = torch.as_strided(
            built, shape, torch._prims_common.make_contiguous_strides_for(shape), 0)

    def release(self, bucket) -> None:
        """Free the outputs and what the post-hooks hold (their objects stay for `out=`)."""
        for record in self.params:
            for t in (*record.outputs, *record.inner):
                if t.untyped_storage().nbytes():
                    streams.free_storage(t)

    def holds_memory(self, bucket) -> bool:
        return any(t.untyped_storage().nbytes() for r in self.params for t in r.outputs)

    def full_views(self, bucket, full: torch.Tensor) -> list[torch.Tensor]:
        """The unsharded parameters (new aliases: autograd gives each forward's its own history;
        `full` is only the bucket's anchor in the unit's autograd function)."""
        return [r.unsharded.detach() for r in self.params]

    def gather_full(self, bucket, groups, local, parameters: bool = False) -> list[torch.Tensor]:
        """The parameters: each DTensor's `full_tensor()`, the subclass's own gather (as torch's
        state-dict helpers do); a plain shard-shaped tensor (the gradients) as an exact bucket
        gathers it."""
        if parameters:
            return [slot.param.full_tensor() for slot in bucket.slots]
        return super().gather_full(bucket, groups, local)


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a (possibly subclass) tensor: the sum over its inner plain tensors."""
    if not dispatches_itself(tensor):
        return tensor.numel() * tensor.element_size()
    names, _ = tensor.__tensor_flatten__() if hasattr(tensor, "__tensor_flatten__") else ([], None)
    return sum(_nbytes(getattr(tensor, n)) for n in names)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
