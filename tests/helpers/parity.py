"""Parity harness: train a model wrapped by fsdp_ext and an unwrapped single-process copy on the
concatenated batch, step by step, and compare losses and every gathered parameter.

Tolerances. fp32: the sharded run sums per-rank gradient means where the reference takes one mean
over the whole batch, so gradients differ by float rounding (~1e-7 relative); AdamW divides by
sqrt(v), which can enlarge that for near-zero gradients, hence atol 1e-5 / rtol 1e-4 on parameters
after a few steps. The optimizer uses eps=1e-6: the attention key bias has a gradient that is exactly
zero in exact arithmetic (softmax ignores a shift shared by all keys), so both runs see pure rounding
noise there, which AdamW with a tiny eps would blow up into full, uncorrelated lr-sized steps.
bf16 compute: parameters are rounded to bf16 (8 bits of mantissa) before each
forward, so losses and parameters match the fp32 reference to about 1e-2.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

import fsdp_ext
from examples.models import GPT, MLP, Block, GPTConfig

from .dist import global_mean, local_slice


class MixedDtypeBlock(nn.Module):
    """A unit with an fp32 weight, a bf16 weight and a frozen fp32 weight (three buckets)."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, dim).to(torch.bfloat16))
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(torch.tanh(self.lin(x)) * self.gain.float())


class MixedModel(nn.Module):
    def __init__(self, dim: int = 11):
        super().__init__()
        self.blocks = nn.ModuleList(MixedDtypeBlock(dim) for _ in range(2))
        self.head = nn.Linear(dim, 3)
        self.head.bias.requires_grad_(False)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build_model(name: str) -> nn.Module:
    torch.manual_seed(1234)
    if name == "mlp":
        return MLP()
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=67, block_size=16, n_layer=2, n_head=2, d_model=24))
    if name == "mixed":
        return MixedModel()
    raise ValueError(name)


def unit_classes(name: str) -> tuple[type, ...]:
    return {"mlp": (nn.Sequential,), "gpt": (Block,), "mixed": (MixedDtypeBlock,)}[name]


def make_batch(name: str, step: int, global_batch: int):
    g = torch.Generator().manual_seed(1000 + step)
    if name == "gpt":
        idx = torch.randint(0, 67, (global_batch, 16), generator=g)
        return idx, torch.roll(idx, -1, dims=1)
    dim, out = (13, 5) if name == "mlp" else (11, 3)
    return torch.randn(global_batch, dim, generator=g), torch.randn(global_batch, out, generator=g)


def compute_loss(name: str, model: nn.Module, inputs, targets) -> torch.Tensor:
    if name == "gpt":
        return model(inputs, targets)
    return ((model(inputs).float() - targets) ** 2).mean()


@dataclass
class Case:
    model: str
    api: str                      # "fully_shard" | "fsdp1"
    strategy: str                 # FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD | RESHARD_2
    bf16: bool = False
    steps: int = 3
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.model}/{self.api}/{self.strategy}{'/bf16' if self.bf16 else ''}"


def _hsdp_mesh(world_size: int, device_type: str = "cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device_type, (2, world_size // 2), mesh_dim_names=("replicate", "shard"))


def wrap(case: Case, model: nn.Module, world_size: int) -> nn.Module:
    device_type = next(model.parameters()).device.type
    classes = unit_classes(case.model)
    if case.api == "fsdp1":
        strategy = getattr(fsdp_ext.ShardingStrategy, case.strategy)
        mp = fsdp_ext.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                     cast_forward_inputs=True) if case.bf16 else None
        mesh = _hsdp_mesh(world_size, device_type) if case.strategy == "HYBRID_SHARD" else None
        return fsdp_ext.FullyShardedDataParallel(
            model, auto_wrap_policy=fsdp_ext.ModuleWrapPolicy(classes), sharding_strategy=strategy,
            mixed_precision=mp, device_mesh=mesh, **case.extra)
    kwargs = {}
    if case.bf16:
        kwargs["mp_policy"] = fsdp_ext.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32)
    if case.strategy == "HYBRID_SHARD":
        kwargs["mesh"] = _hsdp_mesh(world_size, device_type)
    reshard = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True,
               "RESHARD_2": 2}[case.strategy]
    for module in model.modules():
        if isinstance(module, classes) and module is not model:
            fsdp_ext.fully_shard(module, reshard_after_forward=reshard, **kwargs, **case.extra)
    fsdp_ext.fully_shard(model, **kwargs, **case.extra)
    return model


def run_case(case: Case, rank: int, world_size: int, device: str = "cpu") -> None:
    reference = build_model(case.model).to(device)
    model = wrap(case, copy.deepcopy(reference), world_size)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    loss_tol = dict(atol=3e-2, rtol=3e-2) if case.bf16 else dict(atol=1e-6, rtol=1e-5)
    param_tol = dict(atol=3e-2, rtol=3e-2) if case.bf16 else dict(atol=1e-5, rtol=1e-4)
    if case.model == "mixed":
        # Its bf16 weight gets a bf16 gradient, rounded on each rank before the sum (as the
        # reference rounds the whole-batch sum once), so a one-ulp difference in that weight is
        # expected and then feeds into the fp32 weights' gradients of later steps.
        loss_tol = param_tol = dict(atol=1e-3, rtol=1e-2)
    for step in range(case.steps):
        inputs, targets = (t.to(device) for t in make_batch(case.model, step, 2 * world_size))
        loss = compute_loss(case.model, model, local_slice(inputs, rank, world_size),
                            local_slice(targets, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = compute_loss(case.model, reference, inputs, targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(global_mean(loss.float()), ref_loss.detach(), **loss_tol,
                                   msg=lambda m: f"{case.name} step {step} loss: {m}")
    full = fsdp_ext.full_state_dict(model)
    expected = reference.state_dict()
    assert list(full) == list(expected), f"{case.name}: keys {list(full)} != {list(expected)}"
    for key, value in expected.items():
        # A bf16 parameter is stored in bf16: one rounding flip is one bf16 ulp (torch's default).
        tol = dict(atol=1e-5, rtol=1.6e-2) if value.dtype == torch.bfloat16 else param_tol
        torch.testing.assert_close(full[key], value, **tol,
                                   msg=lambda m: f"{case.name} parameter {key}: {m}")
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in reference.named_parameters()], f"{case.name}: names differ"


def cases_for(world_size: int) -> list[Case]:
    cases = []
    for model in ("mlp", "gpt", "mixed"):
        for api in ("fully_shard", "fsdp1"):
            cases.append(Case(model, api, "FULL_SHARD"))
        cases.append(Case(model, "fsdp1", "SHARD_GRAD_OP"))
    cases.append(Case("mlp", "fully_shard", "SHARD_GRAD_OP"))
    cases.append(Case("gpt", "fsdp1", "NO_SHARD"))
    cases.append(Case("gpt", "fully_shard", "FULL_SHARD", bf16=True))
    cases.append(Case("mlp", "fsdp1", "FULL_SHARD", bf16=True))
    if world_size % 2 == 0 and world_size >= 4:
        cases.append(Case("gpt", "fully_shard", "HYBRID_SHARD"))
        cases.append(Case("mlp", "fsdp1", "HYBRID_SHARD"))
        cases.append(Case("gpt", "fully_shard", "RESHARD_2"))
    return cases


def parity_worker(rank: int, world_size: int, device: str = "cpu") -> None:
    failures = []
    for case in cases_for(world_size):
        try:
            run_case(case, rank, world_size, device)
        except AssertionError as exc:  # keep going: one run reports every failing case
            failures.append(f"{case.name}: {exc}")
    if failures:
        raise AssertionError(f"rank {rank}, world {world_size}:\n" + "\n".join(failures))
    dist.barrier()
