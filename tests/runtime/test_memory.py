"""fsdp_ext.diagnostics.memory.memory_report against counts made without the runtime's buckets.

The independent counts come from what a user can see: the unwrapped model's parameter sizes, the
storages behind the sharded parameters and their .grad, and AdamW's documented state (two tensors
the size of each parameter plus a scalar step).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fsdp_ext
from fsdp_ext.diagnostics.memory import memory_report
from fsdp_ext.runtime.bucket.layout import ALIGN
from examples.models import GPT, GPTConfig

from ..helpers.dist import run_distributed

CFG = GPTConfig(vocab_size=50, block_size=8, n_layer=3, n_head=2, d_model=24)


def _local(t):
    """A DTensor's local tensor (what this rank stores), else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def _storages(tensors) -> int:
    return sum({_local(t).untyped_storage().data_ptr(): _local(t).untyped_storage().nbytes()
                for t in tensors if t is not None}.values())


def _padding_bound(params, world_size: int) -> int:
    """Most elements padding can add to these parameters' sharded size over all ranks: each is
    cut into world_size chunks of whole rows (at most world_size - 1 rows of padding) and every
    rank aligns its chunk."""
    return sum((world_size - 1) * (p[0].numel() if p.dim() else 1) + world_size * ALIGN
               for p in params) + world_size * ALIGN


def _sum_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def _full_bytes(params, itemsize: int) -> int:
    return sum(p.numel() for p in params) * itemsize


def check_report(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    reference = GPT(CFG)
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fsdp_ext.fully_shard(block)
    fsdp_ext.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size),
                        generator=torch.Generator().manual_seed(rank))

    # Sharded parameters: the storages behind the user's parameters, and over all ranks the whole
    # model plus at most the padding.
    report = memory_report(model, opt)
    assert report["params"] == _storages(p for p in model.parameters()), report
    total = _full_bytes(reference.parameters(), 4)
    summed = _sum_over_ranks(report["params"])
    assert total <= summed <= total + 4 * _padding_bound(reference.parameters(), world_size)
    assert report["grads"] == report["optimizer"] == report["unsharded"] == 0, report
    assert report["units"] == CFG.n_layer + 1

    # Between forward and backward the root stays gathered (backward needs it first), in full and
    # in the parameters' dtype; from the second step on, when the order is known, so does the
    # last block.
    root_params = [p for n, p in reference.named_parameters() if not n.startswith("blocks.")]
    root = _full_bytes(root_params, 4)
    root_slack = 4 * _padding_bound(root_params, world_size)
    last = _full_bytes(reference.blocks[-1].parameters(), 4)
    last_slack = 4 * _padding_bound(list(reference.blocks[-1].parameters()), world_size)
    loss = model(idx, idx)
    report = memory_report(model, opt)
    assert root <= report["unsharded"] <= root + root_slack, (report, root)
    assert report["unsharded_unit_max"] >= _full_bytes(reference.blocks[0].parameters(), 4)

    # After backward and a step: gradient shards as the parameters' .grad storages, AdamW's
    # exp_avg and exp_avg_sq the size of each local parameter plus a 4-byte step each.
    loss.backward()
    opt.step()
    report = memory_report(model, opt)
    params = list(model.parameters())
    assert report["unsharded"] == 0, report
    assert report["grads"] == _storages(p.grad for p in params) == report["params"], report
    adamw = sum(2 * _local(p).numel() * 4 + 4 for p in params)
    assert report["optimizer"] == adamw, (report["optimizer"], adamw)
    assert report["total"] == sum(report[k] for k in ("params", "grads", "optimizer", "unsharded"))

    # zero_grad(set_to_none=True) lets the next forward drop the gradient shards.
    opt.zero_grad(set_to_none=True)
    loss = model(idx, idx)
    report = memory_report(model, opt)
    assert report["grads"] == 0, report
    kept = root + last
    assert kept <= report["unsharded"] <= kept + root_slack + last_slack, (report, kept)
    loss.backward()
    assert memory_report(model, opt)["grads"] == report["params"]

    # bf16 compute: the gathered root is half the size, the sharded state stays fp32.
    model = copy.deepcopy(reference)
    policy = fsdp_ext.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fsdp_ext.fully_shard(block, mp_policy=policy)
    fsdp_ext.fully_shard(model, mp_policy=policy)
    model(idx, idx)
    bf16 = memory_report(model)
    assert root // 2 <= bf16["unsharded"] <= (root + root_slack) // 2, (bf16, root)
    assert bf16["params"] == _storages(p for p in model.parameters())


def test_memory_report_two_ranks():
    run_distributed(check_report, 2)
