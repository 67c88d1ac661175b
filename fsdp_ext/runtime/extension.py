"""Tensor-subclass parameters: FSDP2's all-gather extension (`fsdp_pre_all_gather` /
`fsdp_post_all_gather`), honoured as torch's fully_shard honours it.

A parameter whose tensor is a subclass with its own dispatch (torchao's int8 and float8 training
weights, NF4) cannot be a view of a flat shard: its data is several tensors of other dtypes.
Such parameters form an `ExtensionBucket` of their own per (dtype, requires_grad):

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

import torch

from . import streams
from .bucket import Bucket
from .dtensor_params import dispatches_itself

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


class ExtensionBucket(Bucket):
    """The subclass parameters of a unit sharing (dtype, requires_grad); see the module docstring.

    Per parameter i, while gathered: `outputs[i]` (one flat tensor per pre-hook input, all ranks'
    data), `unsharded[i]` (what the post-hook built, shaped as the parameter) and `inner[i]` (the
    tensors the post-hook said it holds: freed with the outputs, refilled before `out=` reuse).
    """

    extension = True

    def __init__(self, dtype, requires_grad, slots, layout, spec_of=None):
        super().__init__(dtype, requires_grad, slots, layout, spec_of)
        n = len(slots)
        self.mesh = None                  # the shard mesh the pre-hooks are given
        self.mp_policy = None             # torch's MixedPrecisionPolicy, passed to the pre-hooks
        self.param_dtype: torch.dtype | None = None
        self.outputs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.input_sizes: list[list[torch.Size]] = [[] for _ in range(n)]
        self.input_dtypes: list[list[torch.dtype]] = [[] for _ in range(n)]
        self.metadata: list = [None] * n
        self.unsharded: list[torch.Tensor | None] = [None] * n
        self.inner: list[list[torch.Tensor]] = [[] for _ in range(n)]

    def bind(self, mesh, mp_policy, param_dtype) -> None:
        self.mesh, self.mp_policy, self.param_dtype = mesh, mp_policy, param_dtype
        # per parameter: its pre-hook's arguments (1: mesh; 5: torch's full signature), or 0
        self.arity = [len(inspect.signature(v.fsdp_pre_all_gather).parameters)
                      if hasattr(v, "fsdp_pre_all_gather") else 0 for v in self.shard_views]

    # ---- sharded state ------------------------------------------------------------------------
    def init_locals(self, world: int, rank: int) -> None:
        """Each parameter's chunk, kept as its own subclass (`shard_views`): no flat shard."""
        with torch.no_grad():
            self.shard_views = [shard_rows(slot.param.detach(), world, rank)
                                for slot in self.slots]

    @property
    def device(self) -> torch.device:
        return self.shard_views[0].device

    def new_grad_shard(self) -> torch.Tensor:
        """Plain, in the parameters' dtype: what their gradients reduce into."""
        return torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)

    def sharded_bytes(self) -> int:
        return sum(_nbytes(t) for t in self.shard_views)

    # ---- gather ---------------------------------------------------------------------------------
    def pre_all_gather(self) -> list[list[torch.Tensor]]:
        """Per parameter, what its pre-hook gives to gather (metadata kept for the post-hook)."""
        out = []
        for i, (slot, local) in enumerate(zip(self.slots, self.shard_views)):
            if not self.arity[i]:
                inputs, self.metadata[i] = (local,), None
            elif self.arity[i] == 1:
                inputs, self.metadata[i] = local.fsdp_pre_all_gather(self.mesh)
            else:
                shape = torch.Size(slot.shape)
                inputs, self.metadata[i] = local.fsdp_pre_all_gather(
                    self.mesh, shape, torch._prims_common.make_contiguous_strides_for(shape),
                    slot.locations[0][0], self.mp_policy)
            padded_rows = self.layout.slots[i].chunk_rows
            if local.size(0) != padded_rows and any(t.size(0) != padded_rows for t in inputs):
                raise RuntimeError(
                    f"parameter '{slot.fqn}' ({type(local).__name__}) is sharded unevenly "
                    f"({slot.shape[0]} rows over {self.layout.world_size} ranks): its "
                    f"fsdp_pre_all_gather must return tensors of the padded {padded_rows} rows, "
                    f"got {[list(t.shape) for t in inputs]}")
            self.input_sizes[i] = [t.size() for t in inputs]
            self.input_dtypes[i] = [t.dtype for t in inputs]
            out.append(list(inputs))
        return out

    def staging_offsets(self) -> tuple[list[list[int]], int]:
        """Per parameter and input, its byte offset in a rank's slot; the slot's bytes (Q)."""
        offsets, q = [], 0
        for sizes, dtypes in zip(self.input_sizes, self.input_dtypes):
            offsets.append([])
            for size, dtype in zip(sizes, dtypes):
                offsets[-1].append(q)
                q = _round_up(q + size.numel() * dtype.itemsize, _ALIGN_BYTES)
        return offsets, q

    def fill_staging(self, slot: int, world: int, device: torch.device) -> torch.Tensor:
        """Run the pre-hooks and copy this rank's bytes into slot `slot` of a new [W * Q] byte
        buffer (the all-gather's output)."""
        inputs = self.pre_all_gather()
        offsets, q = self.staging_offsets()
        staging = torch.empty(world * q, dtype=torch.uint8, device=device)
        with torch.no_grad():
            for ts, offs in zip(inputs, offsets):
                for t, off in zip(ts, offs):
                    nbytes = t.numel() * t.dtype.itemsize
                    dst = staging.narrow(0, slot * q + off, nbytes).view(t.dtype).view(t.shape)
                    dst.copy_(t)  # a subclass's own copy_ where the input is one (no hooks)
        return staging

    def unpack(self, staging: torch.Tensor) -> None:
        """Split the gathered bytes rank-major into each input's output, then rebuild each
        parameter with its post-hook (`out=` once it was built)."""
        offsets, q = self.staging_offsets()
        world = staging.numel() // q if q else 0
        by_rank = staging.view(world, q) if q else staging
        for i, (sizes, dtypes, offs) in enumerate(zip(self.input_sizes, self.input_dtypes, offsets)):
            if not self.outputs[i]:
                self.outputs[i] = [torch.empty(world * s.numel(), dtype=d, device=staging.device)
                                   for s, d in zip(sizes, dtypes)]
            for out, size, dtype, off in zip(self.outputs[i], sizes, dtypes, offs):
                if out.untyped_storage().nbytes() == 0:
                    streams.alloc_storage(out)
                nbytes = size.numel() * dtype.itemsize
                # A refill, not an edit: what autograd saved of the last use is not stale (the
                # version counter stays, as torch's copy-out keeps it).
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.view(torch.uint8).view(world, nbytes).copy_(by_rank[:, off:off + nbytes])
            self._post_all_gather(i)

    def _post_all_gather(self, i: int) -> None:
        slot, local = self.slots[i], self.shard_views[i]
        views = tuple(o.view(-1, *s[1:]) for o, s in zip(self.outputs[i], self.input_sizes[i]))
        hook = getattr(local, "fsdp_post_all_gather", None)
        param_dtype = self.param_dtype or self.dtype
        if hook is None:
            built = views[0]
        elif self.unsharded[i] is not None:  # refilled in place: the hook updates what it built
            for t in self.inner[i]:
                if t.untyped_storage().nbytes() == 0:
                    streams.alloc_storage(t)
            hook(views, self.metadata[i], param_dtype, out=self.unsharded[i])
            self.metadata[i] = None
            return
        else:
            built, inner = hook(views, self.metadata[i], param_dtype)
            self.inner[i] = list(inner)
        self.metadata[i] = None
        shape = torch.Size(slot.shape)
        self.unsharded[i] = torch.as_strided(
            built, shape, torch._prims_common.make_contiguous_strides_for(shape), 0)

    def release(self) -> None:
        """Free the outputs and what the post-hooks hold (their objects stay for `out=`)."""
        for tensors in (*self.outputs, *self.inner):
            for t in tensors:
                if t.untyped_storage().nbytes():
                    streams.free_storage(t)

    def holds_memory(self) -> bool:
        return any(t.untyped_storage().nbytes() for ts in self.outputs for t in ts)

    def full_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """The unsharded parameters (new aliases: autograd gives each forward's its own history;
        `full` is only the bucket's anchor in the unit's autograd function)."""
        return [u.detach() for u in self.unsharded]


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a (possibly subclass) tensor: the sum over its inner plain tensors."""
    if not dispatches_itself(tensor):
        return tensor.numel() * tensor.element_size()
    names, _ = tensor.__tensor_flatten__() if hasattr(tensor, "__tensor_flatten__") else ([], None)
    return sum(_nbytes(getattr(tensor, n)) for n in names)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def bind(buckets: list[Bucket], mesh, mp_policy, offload, post_forward_size: int,
         unit_type: str) -> None:
    """Give a unit's subclass buckets what their hooks are called with (the shard mesh, torch's
    MixedPrecisionPolicy); refuse, at the call, what they cannot do here."""
    for bucket in buckets:
        if not bucket.extension:
            continue
        first = bucket.slots[0]
        where = (f"parameter '{first.fqn}' of {unit_type}, a "
                 f"{type(bucket.shard_views[0]).__name__} (a tensor subclass)")
        if offload is not None:
            raise NotImplementedError(f"{where}: CPU offload of tensor-subclass parameters is "
                                      "not supported; shard this module without offload_policy")
        if post_forward_size > 1:
            raise NotImplementedError(
                f"{where}: reshard_after_forward=int regathers from post-forward chunks, which "
                "FSDP's all-gather hooks cannot give (torch's fully_shard refuses it too); use "
                "True or False for this module")
        shard_mesh = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[-1]]
        bucket.bind(shard_mesh, mp_policy, mp_policy.param_dtype)
