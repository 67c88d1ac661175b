"""Scripts for tests/runtime/test_placements.py: a small model with MoE-like expert weights
(`[num_experts, in, out]`), sharded with a shard_placement_fn and trained a few AdamW steps,
written once against torch's FSDP2 API and run with either implementation (`fsdp`: the module
holding `fully_shard`: torch.distributed.fsdp or fsdp_ext)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard


class Experts(nn.Module):
    """Grouped expert weights, as torchtitan's GroupedExperts holds them: [experts, in, out]."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.1)
        self.bias = nn.Parameter(torch.zeros(experts, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = [(x @ self.w1[e]).relu() @ self.w2[e] + self.bias[e] for e in range(self.w1.size(0))]
        return torch.stack(out).mean(0)


class Block(nn.Module):
    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.experts = Experts(experts, dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts(self.norm(x))


class Model(nn.Module):
    def __init__(self, experts: int = 2, dim: int = 8, hidden: int = 12, blocks: int = 2):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(experts, dim, hidden) for _ in range(blocks))
        self.out = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def experts_on(dim: int):
    """torchtitan's choice for routed experts: Shard(dim) for 3-D weights, Shard(0) otherwise."""
    return lambda param: Shard(dim) if param.dim() == 3 else None


def build(seed: int = 0, **sizes) -> Model:
    torch.manual_seed(seed)
    return Model(**sizes)


def shard(fsdp, model: Model, placement_fn, **kwargs) -> Model:
    for block in model.blocks:
        fsdp.fully_shard(block, shard_placement_fn=placement_fn, **kwargs)
    fsdp.fully_shard(model, **kwargs)
    return model


def batch(step: int, rank: int, dim: int = 8) -> torch.Tensor:
    return torch.randn(8, dim, generator=torch.Generator().manual_seed(100 * step + rank))


def train(fsdp, rank: int, world: int, placement_fn=experts_on(1), steps: int = 3,
          clip: float | None = None, sizes: dict | None = None, **kwargs) -> dict:
    """Losses, each parameter's gradient (full) after the last backward, placements, local shapes
    and the trained parameters (full)."""
    sizes = sizes or {}
    model = shard(fsdp, build(**sizes), placement_fn, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(batch(step, rank, sizes.get("dim", 8))).square().mean()
        loss.backward()
        if clip is not None:
            losses.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).full_tensor())
        losses.append(loss.detach())
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
    return trained(model, losses, grads)


def trained(model: nn.Module, losses: list, grads: dict) -> dict:
    """What a training script returns: its losses and last gradients, and each parameter's full
    value, placements and local shape."""
    return dict(losses=losses, grads=grads,
                params={n: p.full_tensor() for n, p in model.named_parameters()},
                placements={n: str(p.placements) for n, p in model.named_parameters()},
                local_shapes={n: tuple(p.to_local().shape) for n, p in model.named_parameters()})


def unwrapped(world: int, steps: int = 3, **sizes) -> dict:
    """The same training on one process: each rank's batch, the loss averaged over ranks (as the
    data-parallel gradient is)."""
    model = build(**sizes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        opt.zero_grad()
        loss = sum(model(batch(step, r, sizes.get("dim", 8))).square().mean()
                   for r in range(world)) / world
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def state_dict_roundtrip(ours, theirs, rank: int, world: int, placement_fn) -> dict:
    """Each implementation's DTensor state dict loaded into the other's model: the full values
    after the load, both ways."""
    a = shard(ours, build(seed=1), placement_fn)
    b = shard(theirs, build(seed=2), placement_fn)
    a.load_state_dict(b.state_dict())
    into_ours = {k: v.full_tensor() for k, v in a.state_dict().items()}
    c = shard(theirs, build(seed=3), placement_fn)
    c.load_state_dict(shard(ours, build(seed=4), placement_fn).state_dict())
    into_theirs = {k: v.full_tensor() for k, v in c.state_dict().items()}
    dist.barrier()
    return dict(into_ours=into_ours, into_theirs=into_theirs)
