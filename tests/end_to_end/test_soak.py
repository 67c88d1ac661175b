"""Soak: hundreds of steps at world 4 with a random number of micro-batches per step (no_sync for
all but the last), gradient clipping and periodic checkpoints, checking every step's loss against an
unwrapped single-process reference and that memory does not grow: the runtime's own buffers must be
byte-for-byte the same after every step once warm, and the process RSS may move only a little.

Slow: runs with --runslow. `make soak` runs a short budget (FSDP_EXT_SOAK_STEPS, default 300 here).
"""
from __future__ import annotations

import copy
import ctypes
import gc
import os
import random

import pytest
import torch
import torch.distributed as dist

import fsdp_ext
from examples.models import GPT, Block, GPTConfig
from fsdp_ext.runtime.core.registry import units_of

from ..helpers.dist import global_mean, local_slice, run_distributed

WORLD = 4
PER_RANK = 2                 # sequences per rank per micro-batch
SAVE_EVERY = 40
WARM_STEPS = 25              # after the first checkpoint (step 20): DCP's one-time allocations
RSS_BOUND_MB = 16.0
LOSS_TOL = dict(rel=2e-5, abs=1e-6)  # float rounding only: ~5e-7 seen over 300 steps
PERMUTATION = torch.randperm(67, generator=torch.Generator().manual_seed(0))


def _steps() -> int:
    return int(os.environ.get("FSDP_EXT_SOAK_STEPS", "300"))


def runtime_bytes(model, optimizer) -> dict[str, int]:
    """Every buffer the runtime and the optimizer hold for `model` on this rank, by kind."""
    out = dict(shards=0, grad_shards=0, unsharded=0, no_sync_accumulators=0, pending=0, optim=0)
    for unit in units_of(model):
        for bucket, full, grads in ((b, b.full_data, b.grads) for b in unit.buckets):
            out["shards"] += bucket.shard.untyped_storage().nbytes()
            if bucket.grad_shard is not None:
                out["grad_shards"] += bucket.grad_shard.untyped_storage().nbytes()
            out["unsharded"] += full.untyped_storage().nbytes()
            if grads.unsharded_accumulator is not None:
                out["no_sync_accumulators"] += grads.unsharded_accumulator.untyped_storage().nbytes()
        if unit.schedule is not None and unit.is_root:
            out["pending"] += len(unit.schedule.pending_reduce_scatters)
    for state in optimizer.state.values():
        out["optim"] += sum(v.untyped_storage().nbytes() for v in state.values()
                            if isinstance(v, torch.Tensor))
    return out


def rss_mb() -> float:
    """Resident memory after returning freed heap pages (so RSS follows live memory)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _build():
    torch.manual_seed(7)
    return GPT(GPTConfig(vocab_size=67, block_size=16, n_layer=3, n_head=2, d_model=24))


def _shard(model):
    for module in model.modules():
        if isinstance(module, Block):
            fsdp_ext.fully_shard(module)
    return fsdp_ext.fully_shard(model)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)


def _batch(step: int, sequences: int):
    """A learnable task (each token's target is a fixed permutation of it). On random targets the
    loss sits at ln(vocab) with gradients of pure noise, which AdamW amplifies until two runs that
    differ only in float rounding part ways (seen after ~200 steps): a soak must stay comparable."""
    g = torch.Generator().manual_seed(10_000 + step)
    idx = torch.randint(0, 67, (sequences, 16), generator=g)
    return idx, PERMUTATION[idx]


def soak_worker(rank: int, world_size: int, steps: int, directory: str) -> None:
    reference = _build()
    model = _shard(copy.deepcopy(reference))
    opt, ref_opt = _optimizer(model), _optimizer(reference)
    fsdp_ext.check_optimizer(model, opt)
    micro_counts = random.Random(3)  # the same draws on every rank
    warm_bytes = warm_rss = None
    worst = 0.0
    for step in range(steps):
        n_micro = micro_counts.randint(1, 4)
        idx, targets = _batch(step, n_micro * world_size * PER_RANK)
        micro = [t.chunk(n_micro) for t in (idx, targets)]
        total = torch.zeros(())
        for i in range(n_micro):
            model.set_requires_gradient_sync(i == n_micro - 1)
            loss = model(local_slice(micro[0][i], rank, world_size),
                         local_slice(micro[1][i], rank, world_size)) / n_micro
            loss.backward()
            total += loss.detach()
        norm = model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        ref_loss = reference(idx, targets)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        got = global_mean(total).item()
        assert got == pytest.approx(ref_loss.item(), **LOSS_TOL), (step, got, ref_loss.item())
        assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-3, abs=1e-5), step
        worst = max(worst, abs(got - ref_loss.item()) / abs(ref_loss.item()))
        if step % SAVE_EVERY == SAVE_EVERY // 2:
            fsdp_ext.save_checkpoint(directory, model, opt, step=step + 1)
            saved = (step + 1, fsdp_ext.full_state_dict(model))
        now = runtime_bytes(model, opt)
        assert now["unsharded"] == 0 and now["pending"] == 0, (step, now)
        assert now["no_sync_accumulators"] == 0, (step, now)
        if step == WARM_STEPS:
            warm_bytes, warm_rss = now, rss_mb()
        elif warm_bytes is not None:
            assert now == warm_bytes, f"step {step}: runtime buffers {now} != after warm-up {warm_bytes}"
    grown = rss_mb() - warm_rss
    print(f"[rank {rank}] soak: {steps} steps, worst relative loss difference {worst:.2e}, "
          f"RSS {warm_rss:.1f} MB after warm-up, {grown:+.1f} MB at the end", flush=True)
    assert grown < RSS_BOUND_MB, f"RSS grew by {grown:.1f} MB over {steps - WARM_STEPS} steps"
    # The last periodic checkpoint loads into a fresh model and holds what the model held then.
    fresh = _shard(_build())
    loaded_step, _ = fsdp_ext.load_checkpoint(directory, fresh, _optimizer(fresh))
    assert loaded_step == saved[0], (loaded_step, saved[0])
    loaded = fsdp_ext.full_state_dict(fresh)
    for key, value in saved[1].items():
        torch.testing.assert_close(loaded[key], value, atol=0, rtol=0, msg=lambda m: f"{key}: {m}")
    dist.barrier()


@pytest.mark.slow
def test_soak(tmp_path):
    steps = _steps()
    assert steps > WARM_STEPS + SAVE_EVERY, "too few steps to see growth after warm-up"
    run_distributed(soak_worker, WORLD, steps, str(tmp_path), timeout_s=300.0)
