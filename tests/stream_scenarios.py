"""What runs under the stream-order model (tests/test_stream_check.py): the parity, runtime and
training-loop suites' own checks, and the runtime paths they do not reach, each against the
unwrapped model. Under the model the runtime takes its side-stream (GPU) path on CPU tensors."""
from __future__ import annotations

import torch
from torch import nn

import fsdp_ext
from models import GPT, Block, GPTConfig

from . import parity, test_runtime, test_training_loop


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


def run_all(rank: int, world_size: int) -> None:
    parity.parity_worker(rank, world_size)  # strategies, reshard int (world 4), HSDP, bf16, tied
    test_training_loop.training_loop_worker(rank, world_size)  # no_sync, clip, offload, meta, AC
    test_runtime.runtime_worker(rank, world_size)  # units used twice, checkpointing, no_grad
    prefetch_depths(rank, world_size)
    explicit_async_unshard(rank, world_size)
    offload_then_host_update(rank, world_size)
