"""What runs under the stream-order model (tests/diagnostics/test_stream_check.py): the parity, runtime and
training-loop suites' own checks, and the runtime paths they do not reach, each against the
unwrapped model. Under the model the runtime takes its side-stream (GPU) path on CPU tensors."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

import fsdp_ext
from examples.models import GPT, Block, GPTConfig

from . import parity
from ..runtime import test_runtime
from ..end_to_end import test_training_loop


def no_sync_accumulation(rank: int, world_size: int) -> None:
    test_training_loop.check_gradient_accumulation(rank, world_size)


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=53, block_size=8, n_layer=3, n_head=2, d_model=16))


def _tokens(step: int, n: int):
    idx = torch.randint(0, 53, (n, 8), generator=torch.Generator().manual_seed(step))
    return idx, idx


def _gpt_loss(model, idx, targets):
    return model(idx, targets)


def _shard_blocks(**kwargs):
    def wrap(model):
        for block in model.blocks:
            fsdp_ext.fully_shard(block, **kwargs)
        return fsdp_ext.fully_shard(model, **kwargs)
    return wrap


def prefetch_depths(rank: int, world_size: int) -> None:
    """Depth 0 and 2 in both directions, and FSDP1's BACKWARD_POST with forward prefetch."""
    for depth in (0, 2):
        test_runtime._compare_training(
            rank, world_size, _gpt, _shard_blocks(forward_prefetch=depth, backward_prefetch=depth),
            _tokens, _gpt_loss)
    fsdp1 = lambda model: fsdp_ext.FullyShardedDataParallel(  # noqa: E731
        model, auto_wrap_policy=fsdp_ext.ModuleWrapPolicy({Block}),
        backward_prefetch=fsdp_ext.BackwardPrefetch.BACKWARD_POST, forward_prefetch=True)
    test_runtime._compare_training(rank, world_size, _gpt, fsdp1, _tokens, _gpt_loss)


def explicit_async_unshard(rank: int, world_size: int) -> None:
    """unshard(async_op=True) on every block before each forward, as a user prefetching by hand."""
    def loss(model, idx, targets):
        if isinstance(model, fsdp_ext.FSDPModule) and model._unit.schedule is not None:
            for block in model.blocks:  # from the second step on: the root knows the order
                block.unshard(async_op=True)
        return model(idx, targets)
    test_runtime._compare_training(rank, world_size, _gpt, _shard_blocks(), _tokens, loss)


def offload_then_host_update(rank: int, world_size: int) -> None:
    """CPU offload: a no-grad forward whose output nothing reads, then the host writes every
    shard in place (halving, then doubling: the same values), then training."""
    def wrap(model):
        model = _shard_blocks(offload_policy=fsdp_ext.CPUOffloadPolicy())(model)
        with torch.no_grad():
            model(_tokens(rank, 2)[0])
            for p in model.parameters():
                p.mul_(0.5)
                p.mul_(2.0)
        return model
    test_runtime._compare_training(rank, world_size, _gpt, wrap, _tokens, _gpt_loss)


def activation_checkpointing(rank: int, world_size: int) -> None:
    """torch's checkpoint wrapper around every block, then fully_shard: three steps."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing)

    def wrap(model):
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        return _shard_blocks()(model)
    test_runtime._compare_training(rank, world_size, _gpt, wrap, _tokens, _gpt_loss)


def clip_every_step(rank: int, world_size: int) -> None:
    """clip_grad_norm_ between backward and the optimizer step, three steps. A bound no gradient
    reaches leaves the results those of the unclipped reference; the clip still computes the norm
    and scales every gradient. The norm comes back as a tensor: reading it would be the script's
    own host sync."""
    test_runtime._compare_training(rank, world_size, _gpt, _shard_blocks(), _tokens, _gpt_loss,
                                   after_backward=lambda model, _: model.clip_grad_norm_(1e9))


def post_optim_event(rank: int, world_size: int) -> None:
    """set_post_optim_event after every optimizer step, as torchtitan's users do on GPUs: the
    root's first all-gather of the next step waits for that event alone, not for the whole
    compute stream (work queued after it, such as zero_grad's, may still run)."""
    from fsdp_ext.runtime.core import streams

    def after_step(model):
        device = model._unit.groups.device
        model.set_post_optim_event(streams.record_event(streams.current_stream(device)))
        torch.zeros(64).add_(1)  # compute work after the event, on memory the allocator recycles
    test_runtime._compare_training(rank, world_size, _gpt, _shard_blocks(), _tokens, _gpt_loss,
                                   steps=4, after_step=after_step)


def tensor_parallel(rank: int, world_size: int) -> None:
    """FSDP x TP on a (dp, tp) = (2, 2) mesh: three steps (world 4 only)."""
    from torch.distributed.device_mesh import init_device_mesh

    from .fsdp2 import ours
    from ..api.test_fsdp2_interop import _tp_model, _tp_train
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _tp_model(ours(), mesh)
    _tp_train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh, 3)


def tensor_subclass_params(rank: int, world_size: int) -> None:
    """Weights of a tensor subclass with FSDP2's all-gather hooks (two dtypes, gathered as bytes,
    rebuilt by the post-hook): four steps against the unwrapped model."""
    from . import subclass_recipes
    subclass_recipes.check_close_to_unwrapped("hilo", rank, world_size, 4)


def comm_policy(rank: int, world_size: int) -> None:
    """CommPolicy int8 both ways (byte buffers quantized on the collectives' streams, dequantized
    after their waits), with fully_shard and with FullyShardedDataParallel: the loss curve within
    1% of the exact run's from the third step."""
    from ..runtime import test_comm_policy as cp
    for api in ("fully_shard", "fsdp1"):
        exact = cp._train(cp._shard(cp._gpt(), api, None), rank, world_size, steps=4)
        losses = cp._train(cp._shard(cp._gpt(), api, fsdp_ext.CommPolicy("int8", "int8")),
                           rank, world_size, steps=4)
        assert all(abs(a - b) <= 0.01 * b for a, b in zip(losses[2:], exact[2:])), (losses, exact)


def own_meshes(rank: int, world_size: int) -> None:
    """Parameters on meshes of their own (one all-gather per mesh per unit): Shard(1) experts
    over an efsdp mesh, with CPU offload, with reshard_after_forward=2 (world 4), and expert-
    parallel weights split over ep and sharded again over efsdp (annotated, and DTensors on the
    storage mesh), DTensor parameters on the storage mesh dp_mesh_dims names; each against
    torch's fully_shard on the same script."""
    from ..api import test_dp_mesh_dims, test_expert_parallel
    from ..runtime import test_placements
    test_placements.check_own_meshes(rank, world_size)
    test_placements.check_own_mesh_offload(rank, world_size, pin_memory=True)
    test_expert_parallel.check_spmd_types_shard0(rank, world_size)
    test_expert_parallel.check_storage_shard1(rank, world_size)
    test_expert_parallel.check_replicated_sums_over_ep(rank, world_size)  # (its all-reduce)
    test_dp_mesh_dims.check_full_dtensor(rank, world_size)
    if world_size == 4:
        test_placements.check_own_mesh_reshard_after_forward_k(rank, world_size)


def replicate(rank: int, world_size: int) -> None:
    """fsdp_ext.replicate (nothing gathered; the gradients all-reduced over the mesh) against
    torch's replicate on the same script: plain, with mixed precision and CPU offload (pinned
    host copies), and with an ignored parameter."""
    from ..api import test_replicate
    test_replicate.check_against_torch(rank, world_size)
    test_replicate.check_options_against_torch(rank, world_size, pin_memory=True)


def scenarios(world_size: int) -> list[tuple[str, object]]:
    """(label, fn(rank, world_size)) for every scenario run under the model at `world_size`."""
    out = [(case.name, lambda r, w, case=case: parity.run_case(case, r, w))
           for case in parity.cases_for(world_size)]
    loop = [test_training_loop.check_summon_and_sync_module_states,
            test_training_loop.check_gradient_accumulation, test_training_loop.check_clip_grad_norm,
            test_training_loop.check_nonfinite_gradient_names_unit,
            test_training_loop.check_tiny_units_clip, test_training_loop.check_meta_init,
            test_training_loop.check_cpu_offload, test_training_loop.check_checkpoint_wrapper]
    if world_size == 4:
        loop.append(test_training_loop.check_forward_without_backward_then_update)
    out += [(fn.__name__.removeprefix("check_"), fn) for fn in loop]
    runtime = [test_runtime.check_awkward_models, test_runtime.check_parameterless_root,
               test_runtime.check_no_grad_frees_everything]
    out += [(fn.__name__.removeprefix("check_"), fn) for fn in runtime]
    if world_size == 2:
        out += [("prefetch_order", lambda r, w: test_runtime.check_prefetch_order(r)),
                ("in_flight_bound", lambda r, w: test_runtime.check_in_flight_bound(r))]
    out += [("activation_checkpointing", activation_checkpointing),
            ("clip_grad_norm_every_step", clip_every_step),
            ("post_optim_event", post_optim_event),
            ("prefetch_depths", prefetch_depths), ("explicit_async_unshard", explicit_async_unshard),
            ("offload_then_host_update", offload_then_host_update),
            ("tensor_subclass_params", tensor_subclass_params),
            ("comm_policy", comm_policy), ("own_meshes", own_meshes), ("replicate", replicate)]
    if world_size == 4:
        out.append(("fsdp_x_tp", tensor_parallel))
    return out


def run_all(rank: int, world_size: int, label=None) -> None:
    """Every scenario, each inside `label(name)` (a context manager; the host-sync counter's)."""
    for name, fn in scenarios(world_size):
        with (label(name) if label is not None else contextlib.nullcontext()):
            fn(rank, world_size)
