"""Newton-Schulz for many matrices at once: what Muon runs on every matrix a rank orthogonalises
in one step (its own whole matrices, blocks and experts, or the split matrices it owns).

Each tensor handed in is a matrix `[R, C]`, a stack of matrices `[E, R, C]` (experts), or, under
the group's `block_rows=R`, a `[M * R, C]` matrix of M blocks `[R, C]`; the result has its shape
and bfloat16, as torch.optim.Muon's iteration returns.

Two ways, chosen per parameter group:

    batch_same_shape=False   each matrix through torch's own iteration, one at a time: torch's
      (the default)          Muon's bits, on every device
    batch_same_shape=True    the matrices of one shape stacked and iterated together: one
                             batched matrix product per iteration step for all of them (on the
                             GPU, one kernel where there were as many as matrices: heads,
                             experts, and the blocks' same-shape layers). Batched and single
                             matrix products may round bf16 differently (on CPU too: baddbmm
                             and addmm of the same operands differ in the last bit at times),
                             so results agree with torch's to bf16 rounding, not bit for bit,
                             as torchtitan's DistMuon, which batches its blocks the same way.

A batch holds at most BATCH_ELEMENTS elements, so that its bf16 copy and Gram matrices stay a
bounded working set however many layers share a shape.
"""
from __future__ import annotations

from collections import defaultdict

import torch
# torch's own iteration (the unbatched way; tests/optim/test_muon.py holds its bits)
from torch.optim._muon import _zeropower_via_newtonschulz

BATCH_ELEMENTS = 1 << 26  # 128 MiB of bf16 input per batch


def orthogonalised(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Each tensor's matrices orthogonalised, as `group` (a Muon parameter group) says."""
    args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
    if args[1] >= 100 or len(args[0]) != 3:  # torch's iteration refuses these; so does ours
        raise ValueError(f"Muon: ns_steps must be below 100 and ns_coefficients 3 values, "
                         f"got {args[1]} and {args[0]}")
    stacks = [_as_stack(t, group["block_rows"]) for t in tensors]
    if group["batch_same_shape"]:
        results = _batched_by_shape(stacks, args)
    else:
        results = [_one_by_one(s, args) for s in stacks]
    return [r.reshape(t.shape) for r, t in zip(results, tensors)]


def _as_stack(tensor: torch.Tensor, rows: int | None) -> torch.Tensor:
    """`tensor` as a stack of matrices [N, R, C]."""
    if rows:
        return tensor.reshape(-1, rows, tensor.shape[-1])
    return tensor.unsqueeze(0) if tensor.ndim == 2 else tensor


def _one_by_one(stack: torch.Tensor, args) -> torch.Tensor:
    if stack.shape[0] == 0:  # a rank holding none of a stack's experts
        return stack.to(torch.bfloat16)
    return torch.stack([_zeropower_via_newtonschulz(m, *args) for m in stack.unbind(0)])


def _batched_by_shape(stacks: list[torch.Tensor], args) -> list[torch.Tensor]:
    """The stacks' matrices grouped by shape, device and dtype, each group iterated in batches."""
    by_shape = defaultdict(list)
    for index, stack in enumerate(stacks):
        by_shape[(tuple(stack.shape[1:]), stack.device, stack.dtype)].append(index)
    results: list[torch.Tensor | None] = [None] * len(stacks)
    for (shape, _, _), indices in by_shape.items():
        per_batch = max(1, BATCH_ELEMENTS // max(1, shape[0] * shape[1]))
        matrices = [m for i in indices for m in stacks[i].unbind(0)]
        done = []
        for first in range(0, len(matrices), per_batch):
            batch = matrices[first:first + per_batch]
            if len(batch) == 1:  # one matrix: torch's own iteration, its bits
                done.append(_zeropower_via_newtonschulz(batch[0], *args).unsqueeze(0))
            else:
                done.append(_newton_schulz_batch(torch.stack(batch), *args))
        flat = torch.cat(done) if done else None
        first = 0
        for i in indices:
            count = stacks[i].shape[0]
            results[i] = (flat[first:first + count] if count else
                          stacks[i].to(torch.bfloat16))
            first += count
    return results


def _newton_schulz_batch(matrices: torch.Tensor, coefficients, steps: int,
                         eps: float) -> torch.Tensor:
    """torch.optim.Muon's iteration (bf16, a matrix with more rows than columns transposed, the
    Frobenius norm scaled to at most 1, then `steps` quintic steps), on a stack [N, R, C] of
    matrices at once."""
    a, b, c = coefficients
    x = matrices.to(torch.bfloat16)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x
