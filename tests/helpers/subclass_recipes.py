"""Models whose parameters are tensor subclasses with FSDP2's all-gather hooks, as the recipes that
ride on FSDP2 build them (torchao's int8 weight-only and int8 mixed-precision training, float8
training with float8 all-gather, NF4 base weights under LoRA adapters), plus `HiLo`, this suite's
own subclass: two inner tensors of different dtypes and metadata through the hooks."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

RECIPES = ("int8_weight_only", "int8_mixed_precision", "float8", "nf4_lora", "hilo")
DIM = 64


# ---- this suite's own subclass ------------------------------------------------------------------
class HiLoNoHooks(torch.Tensor):
    """An fp32 value stored as a bf16 high part and an fp16 residual. Out-of-place ops see the
    value; in-place ops (the optimizer's) update the value and split it again; view ops act on
    both parts. Without FSDP's hooks: gathered as its values."""

    _VIEW_OPS = {torch.ops.aten.split.Tensor, torch.ops.aten.slice.Tensor,
                 torch.ops.aten.detach.default, torch.ops.aten.alias.default,
                 torch.ops.aten.clone.default, torch.ops.aten.view.default,
                 torch.ops.aten._to_copy.default}

    @staticmethod
    def __new__(cls, hi: torch.Tensor, lo: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, hi.shape, dtype=torch.float32,
                                                   device=hi.device)

    def __init__(self, hi: torch.Tensor, lo: torch.Tensor):
        self.hi, self.lo = hi, lo

    def __tensor_flatten__(self):
        return ["hi", "lo"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(inner["hi"], inner["lo"])

    @staticmethod
    def split_value(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hi = value.to(torch.bfloat16)
        return hi, (value - hi.float()).to(torch.float16)

    @classmethod
    def from_float(cls, value: torch.Tensor) -> "HiLoNoHooks":
        return cls(*cls.split_value(value.detach()))

    def value(self) -> torch.Tensor:
        return self.hi.float() + self.lo.float()

    def __repr__(self):
        return f"{type(self).__name__}({self.value()})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0]
        if func in cls._VIEW_OPS:
            if func is torch.ops.aten._to_copy.default:
                kwargs = {k: v for k, v in kwargs.items() if k != "dtype"}
            his = func(first.hi, *args[1:], **kwargs)
            los = func(first.lo, *args[1:], **kwargs)
            if isinstance(his, (list, tuple)):
                return [cls(h, lo) for h, lo in zip(his, los)]
            return cls(his, los)
        if func is torch.ops.aten.new_zeros.default:
            size = args[1]
            return cls(first.hi.new_zeros(size), first.lo.new_zeros(size))
        if func is torch.ops.aten.new_empty.default:
            size = args[1]
            return cls(first.hi.new_empty(size), first.lo.new_empty(size))
        unwrapped = tree_map_only(HiLoNoHooks, lambda t: t.value(), (args, kwargs))
        if func._schema.name.endswith("_") or func is torch.ops.aten.copy_.default:
            target = first
            result = func(*unwrapped[0], **unwrapped[1])
            if isinstance(target, HiLoNoHooks):
                hi, lo = cls.split_value(result)
                target.hi.copy_(hi)
                target.lo.copy_(lo)
            return target
        return func(*unwrapped[0], **unwrapped[1])


class HiLo(HiLoNoHooks):
    """HiLoNoHooks with FSDP's hooks: both parts travel (two dtypes, gathered as bytes) with a
    metadata tuple; the post-hook rebuilds a plain tensor, in place (`out=`) after the first
    gather."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.hi, self.lo), ("hilo", tuple(outer_size))

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        hi, lo = outputs
        tag, shape = metadata
        assert tag == "hilo" and hi.dtype == torch.bfloat16 and lo.dtype == torch.float16
        value = (hi.float() + lo.float()).view(shape).to(param_dtype)
        if out is not None:  # a refill of the gathered value, not an edit autograd must see
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(value)
            return None
        return value, (hi, lo)


class HiLoPreHookOnly(HiLoNoHooks):
    """A subclass that forgot its post-hook."""

    def fsdp_pre_all_gather(self, mesh):
        return (self.hi, self.lo), None


# ---- LoRA over a frozen NF4 base weight --------------------------------------------------------
class LoRALinear(nn.Module):
    def __init__(self, weight: torch.Tensor, rank: int = 8):
        super().__init__()
        from torchao.quantization import to_nf4
        self.weight = nn.Parameter(to_nf4(weight), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, weight.shape[1]) * 0.02)
        self.lora_b = nn.Parameter(torch.zeros(weight.shape[0], rank))

    def forward(self, x):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4
        return linear_nf4(x, self.weight) + x @ self.lora_a.t() @ self.lora_b.t()


def build(recipe: str, seed: int = 0, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    if recipe == "nf4_lora":
        return nn.Sequential(LoRALinear(torch.randn(4 * DIM, 4 * DIM, device=device) / 16),
                             nn.ReLU(),
                             LoRALinear(torch.randn(4 * DIM, 4 * DIM, device=device) / 16)
                             ).to(device)
    model = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM), nn.ReLU(),
                          nn.Linear(DIM, DIM // 2)).to(device)
    if recipe == "int8_weight_only":
        from torchao import quantize_
        from torchao.prototype.quantized_training import int8_weight_only_quantized_training
        quantize_(model, int8_weight_only_quantized_training())
    elif recipe == "int8_mixed_precision":
        from torchao import quantize_
        from torchao.prototype.quantized_training import int8_mixed_precision_training
        quantize_(model, int8_mixed_precision_training())
    elif recipe == "float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(
            model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    elif recipe == "hilo":
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.weight = nn.Parameter(HiLo.from_float(layer.weight))
    return model


def shard(model: nn.Module, fully_shard, **kwargs) -> nn.Module:
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def inputs(recipe: str, step: int, rank: int, world: int,
           device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch for `rank` (its rows of one global batch)."""
    g = torch.Generator().manual_seed(1000 + step)
    dim = 4 * DIM if recipe == "nf4_lora" else DIM
    out = 4 * DIM if recipe == "nf4_lora" else DIM // 2
    x, y = torch.randn(4 * world, dim, generator=g), torch.randn(4 * world, out, generator=g)
    return x[4 * rank:4 * (rank + 1)].to(device), y[4 * rank:4 * (rank + 1)].to(device)


def train(recipe: str, model: nn.Module, steps: int, rank: int, world: int,
          device: str = "cpu") -> list[float]:
    """AdamW steps on `rank`'s share of each batch; the mean loss over ranks per step. The RNG is
    seeded alike before training (int8 weight-only updates round stochastically)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    torch.manual_seed(7 + rank)
    losses = []
    for step in range(steps):
        x, y = inputs(recipe, step, rank, world, device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if recipe == "float8":
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
            precompute_float8_dynamic_scale_for_fsdp(model)
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    return losses


def unwrapped_losses(recipe: str, model: nn.Module, steps: int, world: int) -> list[float]:
    """train()'s steps on one process: the whole global batch at once."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(steps):
        batches = [inputs(recipe, step, r, world) for r in range(world)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def check_close_to_unwrapped(recipe: str, rank: int, world: int, steps: int) -> None:
    """fsdp_ext's fully_shard trains `recipe` as the unwrapped model does (the gradients' sum
    over ranks rounds differently: close, not equal)."""
    from fsdp_ext import fully_shard
    sharded = train(recipe, shard(build(recipe), fully_shard), steps, rank, world)
    single = unwrapped_losses(recipe, build(recipe), steps, world)
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(single), rtol=1e-4, atol=1e-5,
                               msg=f"{recipe}: {sharded} vs {single}")


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """The values a (local) subclass tensor stands for, as a plain tensor."""
    tensor = getattr(tensor, "_local_tensor", tensor)
    if isinstance(tensor, HiLoNoHooks):
        return tensor.value()
    kind = type(tensor).__name__
    if kind == "NF4Tensor":
        return tensor.get_original_weight()
    if kind == "Int8QuantizedTrainingLinearWeight":
        return tensor.dequantize()
    if kind == "Int8MixedPrecisionTrainingLinearWeight":  # fp32 master weight
        return tensor._data
    if kind == "WeightWithDynamicFloat8CastTensor":  # likewise
        return tensor._tensor
    assert type(tensor) in (torch.Tensor, nn.Parameter), kind
    return tensor.detach()
