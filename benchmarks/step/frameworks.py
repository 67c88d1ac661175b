"""The benchmark model and the five ways bench_step.py trains it.

Every framework gets the same model (same seed, so the same initial weights), the same data and the
same AdamW; only the wrapping differs:
    fsdp_ext  fsdp_ext.fully_shard per block, then the root (defaults)
    ddp       torch.nn.parallel.DistributedDataParallel (defaults)
    fsdp1     torch.distributed.fsdp.FullyShardedDataParallel, ModuleWrapPolicy on the block class,
              use_orig_params=True (FULL_SHARD, BACKWARD_PRE: the defaults)
    fsdp2     torch.distributed.fsdp.fully_shard per block, then the root (defaults)
    local     no wrapping, no communication: each rank trains its own replica. The compute floor
              every framework pays; not a data-parallel training run.
and, on request (--frameworks), fsdp_ext's candidate ways to gather its DTensor parameters
(fsdp_ext/runtime/bucket/layout.py, [Note: gather groups]) and its FSDP1 layout:
    fsdp_ext-direct   every parameter gathered directly into its place (one collective each)
    fsdp_ext-copied   every parameter of a unit gathered in one collective, then copied out
    fsdp_ext-flat     fsdp_ext.FullyShardedDataParallel: the flat layout with 1-D views (FSDP1's)
    fsdp_ext-unchecked  fsdp_ext with its collective tags off after the first forward (their cost)
    fsdp_ext-sync-tags  fsdp_ext checking every tag on the host at its wait after the first forward
                        (FSDP_EXT_CHECK=sync: on GPUs, a host sync per collective)
and fsdp_ext with a CommPolicy (fewer bytes on the wire, runtime/wire/comm_policy.py):
    fsdp_ext-int8w        int8 parameter all-gathers
    fsdp_ext-int8w-int8g  int8 parameter all-gathers and int8 all-to-all gradient reduction
    fsdp_ext-fp8w-bf16g   fp8 parameter all-gathers, bf16 gradient reduction
and DDP as FSDP2's placements make it (every rank holds the whole model):
    fsdp_ext-replicate  fsdp_ext.replicate per block, then the root
    torch-replicate     torch's replicate (torch.distributed._composable.replicate_with_fsdp)
and torch.compile (inductor) variants: NAME+compile compiles the whole wrapped model (fsdp_ext,
fsdp2, local), fsdp_ext+unit-compile each block's forward.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int = 8
    d_model: int = 512
    nhead: int = 8
    ffn: int = 2048
    batch: int = 8      # sequences per rank
    seq: int = 64       # tokens per sequence

    def as_dict(self) -> dict:
        return asdict(self)


DEFAULT = ModelConfig()
# 16 x (4 d^2 + 2 d ffn) + norms/biases = 201.6M parameters: the ">= 200M" memory case.
LARGE = ModelConfig(n_layer=16, d_model=1024, nhead=16, ffn=4096, batch=2, seq=64)


class EncoderStack(nn.Module):
    """TransformerEncoderLayer blocks plus a norm and head owned by the root (so it has work)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # dropout=0 so every framework computes the same function and the losses can be compared.
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(cfg.d_model, cfg.nhead, cfg.ffn, dropout=0.0,
                                       batch_first=True)
            for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


BLOCK_CLASS = nn.TransformerEncoderLayer


def build_model(cfg: ModelConfig, device: torch.device) -> EncoderStack:
    torch.manual_seed(0)
    return EncoderStack(cfg).to(device)


def make_batch(cfg: ModelConfig, rank: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=g)
    y = torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=g)
    return x.to(device), y.to(device)


def _wrap_fsdp_ext(model, device, options):
    import fsdp_ext
    for layer in model.layers:
        fsdp_ext.fully_shard(layer, **options)
    return fsdp_ext.fully_shard(model, **options)


def _wrap_fsdp_ext_policy(**policy):
    def wrap(model, device, options):
        import fsdp_ext
        return _wrap_fsdp_ext(model, device,
                              {**options, "comm_policy": fsdp_ext.CommPolicy(**policy)})
    return wrap


def _wrap_fsdp_ext_split(direct_min_numel: int):
    def wrap(model, device, options):
        from fsdp_ext import MixedPrecisionPolicy
        from fsdp_ext.api.fully_shard import shard_module
        from fsdp_ext.runtime.unit.schedule_options import ScheduleOptions
        from fsdp_ext.runtime.unit.config import UnitOptions

        def config():  # (each unit its own options record)
            return UnitOptions(mp=MixedPrecisionPolicy(), layout="rows",
                               direct_min_numel=direct_min_numel,
                               schedule=ScheduleOptions(**options))
        for layer in model.layers:
            shard_module(layer, options=config())
        return shard_module(model, options=config())
    return wrap


def _fsdp_ext_with_checker(**settings):
    """fsdp_ext whose collective checker gets `settings` after the first forward (the schedule
    and its checker exist from then on)."""
    def wrap(model, device, options):
        model = _wrap_fsdp_ext(model, device, options)

        def set_after_first_forward(module, args, output):
            for name, value in settings.items():
                setattr(module._unit.schedule.checker, name, value)
            handle.remove()
        handle = model.register_forward_hook(set_after_first_forward)
        return model
    return wrap


# FSDP_EXT_CHECK=sync after the first forward: each tag checked on the host where its data is
# waited for (on CPU ranks that is the default already)
_wrap_fsdp_ext_sync_tags = _fsdp_ext_with_checker(on_device=False)
# the collective tags off after the first forward (what they cost)
_wrap_fsdp_ext_unchecked = _fsdp_ext_with_checker(enabled=False)


def _wrap_fsdp_ext_flat(model, device, options):
    import fsdp_ext
    return fsdp_ext.FullyShardedDataParallel(
        model, auto_wrap_policy=fsdp_ext.ModuleWrapPolicy({BLOCK_CLASS}),
        forward_prefetch=options.get("forward_prefetch", 1) > 0)


def _wrap_ddp(model, device, options):
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


def _wrap_fsdp1(model, device, options):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({BLOCK_CLASS}), use_orig_params=True,
        device_id=device)  # on CPU it must be given: FSDP1 otherwise insists on an accelerator


def _wrap_fsdp2(model, device, options):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _wrap_replicate(replicate):
    def wrapped(model, device, options):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (dist.get_world_size(),),
                                mesh_dim_names=("replicate",))
        for layer in model.layers:
            replicate(layer, mesh=mesh)
        return replicate(model, mesh=mesh)
    return wrapped


def _fsdp_ext_replicate(module, **kw):
    import fsdp_ext
    return fsdp_ext.replicate(module, **kw)


def _torch_replicate(module, **kw):
    from torch.distributed._composable.replicate_with_fsdp import replicate
    return replicate(module, **kw)


def _compiled(wrap, per_unit: bool = False):
    """torch.compile (inductor) of the wrapped model, or (per_unit) of each block's forward."""
    def compiled(model, device, options):
        if per_unit:
            for layer in model.layers:
                layer.forward = torch.compile(layer.forward)
            return wrap(model, device, options)
        return torch.compile(wrap(model, device, options))
    return compiled


WRAPPERS = {"fsdp_ext": _wrap_fsdp_ext, "ddp": _wrap_ddp,
            "fsdp1": _wrap_fsdp1, "fsdp2": _wrap_fsdp2,
            "local": lambda model, device, options: model,
            "fsdp_ext-direct": _wrap_fsdp_ext_split(1),
            "fsdp_ext-copied": _wrap_fsdp_ext_split(1 << 62),
            "fsdp_ext-flat": _wrap_fsdp_ext_flat,
            "fsdp_ext-unchecked": _wrap_fsdp_ext_unchecked,
            "fsdp_ext-sync-tags": _wrap_fsdp_ext_sync_tags,
            "fsdp_ext-int8w": _wrap_fsdp_ext_policy(param_gather="int8"),
            "fsdp_ext-int8w-int8g": _wrap_fsdp_ext_policy(param_gather="int8", grad_reduce="int8"),
            "fsdp_ext-fp8w-bf16g": _wrap_fsdp_ext_policy(param_gather="fp8", grad_reduce="bf16"),
            "fsdp_ext-replicate": _wrap_replicate(_fsdp_ext_replicate),
            "torch-replicate": _wrap_replicate(_torch_replicate),
            "fsdp_ext+compile": _compiled(_wrap_fsdp_ext),
            "fsdp_ext+unit-compile": _compiled(_wrap_fsdp_ext, per_unit=True),
            "fsdp2+compile": _compiled(_wrap_fsdp2),
            "local+compile": _compiled(lambda model, device, options: model)}
FRAMEWORKS = ["fsdp_ext", "ddp", "fsdp1", "fsdp2", "local"]  # the default run


def wrap(name: str, model: nn.Module, device: torch.device,
         options: dict | None = None) -> nn.Module:
    return WRAPPERS[name](model, device, options or {})


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _distinct_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            s = _local(t).untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def tensor_accounting(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes of this rank's parameter, gradient and optimizer-state storages, any framework.

    Counts distinct storages (FSDP1's and fsdp_ext's parameters are views of one flat shard), not
    DDP's gradient buckets or any framework's gathered buffers (those are freed by now).
    """
    params = list(model.parameters())
    opt = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return dict(params=_distinct_bytes(params), grads=_distinct_bytes(p.grad for p in params),
                optimizer=_distinct_bytes(opt))
