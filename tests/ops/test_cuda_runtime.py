"""The same runtime on CUDA with NCCL (side streams and events instead of gloo work handles).

Skipped without a GPU. With one GPU it runs a world of 1 (streams, kernels, no peers); with two or
more, a world of 2. The model runs on the GPU; the reference is the same unwrapped model on the GPU.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fsdp_ext
from examples.models import GPT, GPTConfig

from ..helpers.dist import global_mean, local_slice, run_distributed
from ..helpers.parity import parity_worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_parity_worker(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank)
    for bf16 in (False, True):
        torch.manual_seed(0)
        reference = GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=3, n_head=4, d_model=64)).to(device)
        model = copy.deepcopy(reference)
        mp = fsdp_ext.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                           reduce_dtype=torch.float32) if bf16 else fsdp_ext.MixedPrecisionPolicy()
        for block in model.blocks:
            fsdp_ext.fully_shard(block, mp_policy=mp)
        fsdp_ext.fully_shard(model, mp_policy=mp)
        assert all(p.device == device for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
        tol = dict(atol=3e-2, rtol=3e-2) if bf16 else dict(atol=1e-5, rtol=1e-4)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 97, (2 * world_size, 32), generator=g).to(device)
            loss = model(local_slice(idx, rank, world_size), local_slice(idx, rank, world_size))
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = reference(idx, idx)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(global_mean(loss), ref_loss.detach(), **tol)
        full = fsdp_ext.full_state_dict(model)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(full[key], value, **tol, msg=lambda m: f"{key}: {m}")
    dist.barrier()


def test_cuda_nccl_parity():
    world_size = min(torch.cuda.device_count(), 2)
    run_distributed(cuda_parity_worker, world_size, backend="nccl")


def _parity_suite_on_cuda(rank: int, world_size: int) -> None:
    parity_worker(rank, world_size, f"cuda:{rank}")


def test_parity_suite_on_cuda():
    """tests/helpers/parity.py's cases (both APIs, every strategy, bf16, mixed dtypes) on CUDA + NCCL;
    HSDP and reshard_after_forward=2 need 4 GPUs."""
    world_size = 4 if torch.cuda.device_count() >= 4 else min(torch.cuda.device_count(), 2)
    run_distributed(_parity_suite_on_cuda, world_size, backend="nccl")


def no_host_sync_worker(rank: int, world_size: int) -> None:
    """Steady-state steps with the collective tags on: forward and backward (the runtime's hooks,
    the end-of-backward flag read included) run under torch.cuda.set_sync_debug_mode("error"), so
    any `.item()`, `.tolist()`, blocking copy or `synchronize` of a stream raises. The flags' read
    waits on an event, which is the one sync per step the design allows (docs/gpu.md)."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=3, n_head=4, d_model=64)).to(device)
    mp = fsdp_ext.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fsdp_ext.fully_shard(block, mp_policy=mp)
    fsdp_ext.fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(6):
        idx = torch.randint(0, 97, (2, 32), device=device)
        if step >= 3:  # the first steps build, learn the order and allocate
            torch.cuda.set_sync_debug_mode("error")
        try:
            model(idx, idx).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        opt.step()
        opt.zero_grad()
    dist.barrier()


def test_steady_state_step_has_no_host_sync():
    run_distributed(no_host_sync_worker, min(torch.cuda.device_count(), 2), backend="nccl")


def subclass_recipes_worker(rank: int, world_size: int) -> None:
    """The tensor-subclass recipes (tests/helpers/subclass_recipes.py: torchao's int8 and float8
    training with float8 all-gather and the precomputed scale, NF4 + LoRA, a two-dtype subclass)
    on the GPU: fsdp_ext's fully_shard gives torch's losses and shards, bit for bit."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from ..helpers import subclass_recipes as recipes
    device = f"cuda:{rank}"
    torch.cuda.set_device(device)
    for recipe in recipes.RECIPES:
        results = []
        for fully_shard in (torch_fully_shard, fsdp_ext.fully_shard):
            model = recipes.shard(recipes.build(recipe, device=device), fully_shard)
            losses = recipes.train(recipe, model, 4, rank, world_size, device)
            results.append((losses, [recipes.plain(p) for p in model.parameters()]))
        (their_losses, theirs), (our_losses, ours) = results
        assert our_losses == their_losses, (recipe, our_losses, their_losses)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), recipe
    dist.barrier()


def test_subclass_recipes_on_cuda():
    pytest.importorskip("torchao")
    run_distributed(subclass_recipes_worker, min(torch.cuda.device_count(), 2), backend="nccl")


def comm_policy_worker(rank: int, world_size: int) -> None:
    """CommPolicy int8 weights and gradients on NCCL (the quantize kernels on the side streams,
    the dequantize after the waits): the loss curve within 1% of the exact run's from the
    third step; each step free of host syncs like the exact one (sync debug mode "error")."""
    from ..runtime import test_comm_policy as cp
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)

    def run(policy):
        model = cp._gpt().to(device)
        cp._shard(model, "fully_shard", policy)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for step in range(8):
            idx, targets = (t.to(device) for t in cp._batch(step, rank))
            if step >= 3:
                torch.cuda.set_sync_debug_mode("error")
            try:
                loss = model(idx, targets)
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            opt.step()
            opt.zero_grad()
            losses.append(global_mean(loss).item())
        return losses
    exact, quantized = run(None), run(fsdp_ext.CommPolicy("int8", "int8"))
    assert all(abs(a - b) <= 0.01 * b for a, b in zip(quantized[2:], exact[2:])), (
        quantized, exact)
    dist.barrier()


def test_comm_policy_on_cuda():
    run_distributed(comm_policy_worker, min(torch.cuda.device_count(), 2), backend="nccl")
