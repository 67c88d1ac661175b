"""Training scripts written for torch's fully_shard (FSDP2), run twice: once with torch's and once
with fsdp_ext's, only the `fully_shard` (and policy classes) swapped. tests/api/test_fsdp2_interop.py
compares what they produce; everything else in a script is torch's own API (clip_grad_norm_, the
torch.distributed.checkpoint state-dict helpers, DCP, DTensor)."""
from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp_ext
from examples.models import GPT, GPTConfig

from .dist import local_slice

# Shapes that divide by no world size of the tests (67 rows, 24 columns: uneven chunks).
CFG = GPTConfig(vocab_size=67, block_size=8, n_layer=2, n_head=2, d_model=24)
GLOBAL_BATCH = 12  # divides by 2, 3 and 4


def torch_fsdp():
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)
    return types.SimpleNamespace(name="torch", fully_shard=fully_shard,
                                 MixedPrecisionPolicy=MixedPrecisionPolicy,
                                 CPUOffloadPolicy=CPUOffloadPolicy, OffloadPolicy=OffloadPolicy)


def ours():
    return types.SimpleNamespace(name="fsdp_ext", fully_shard=fsdp_ext.fully_shard,
                                 MixedPrecisionPolicy=fsdp_ext.MixedPrecisionPolicy,
                                 CPUOffloadPolicy=fsdp_ext.CPUOffloadPolicy,
                                 OffloadPolicy=fsdp_ext.OffloadPolicy)


def build(seed: int = 0, cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def shard(fsdp, model: GPT, **kwargs) -> GPT:
    for block in model.blocks:
        fsdp.fully_shard(block, **kwargs)
    fsdp.fully_shard(model, **kwargs)
    return model


def batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    idx = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.block_size),
                        generator=torch.Generator().manual_seed(100 + step))
    return local_slice(idx, rank, world_size)


def full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def train(model: nn.Module, opt, steps: int, rank: int, world_size: int, first_step: int = 0,
          clip: float | None = 0.5) -> list[tuple[float, float | None]]:
    """(global mean loss, total grad norm) per step. Even steps clip with torch's clip_grad_norm_,
    odd steps with its two halves, get_total_norm and clip_grads_with_norm_."""
    out = []
    for step in range(first_step, first_step + steps):
        idx = batch(step, rank, world_size)
        loss = model(idx, idx)
        loss.backward()
        norm = None
        if clip is not None and step % 2 == 0:
            norm = float(full(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        elif clip is not None:
            params = [p for p in model.parameters() if p.grad is not None]
            total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
            torch.nn.utils.clip_grads_with_norm_(params, clip, total)
            norm = float(full(total))
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out.append((float(mean) / world_size, norm))
    return out


def adamw(model: nn.Module, lr: float = 1e-2):
    return torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-6, weight_decay=0.1)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()) for n, p in model.named_parameters()}
