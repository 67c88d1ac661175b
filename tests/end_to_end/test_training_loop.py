"""What a training loop needs: gradient accumulation without communication, clipping, meta-device
init, CPU offload, activation-checkpoint wrappers and tied weights; each against an unwrapped
single-process reference on the concatenated batch."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_ext
from examples.models import GPT, MLP, Block, GPTConfig

from ..helpers.dist import local_slice, run_distributed


def _mlp_batch(step: int, n: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 13, generator=g), torch.randn(n, 5, generator=g)


def _mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _shard_mlp(model, api="fully_shard", **kwargs):
    if api == "fsdp1":
        return fsdp_ext.FullyShardedDataParallel(
            model, auto_wrap_policy=fsdp_ext.ModuleWrapPolicy({nn.Sequential}), **kwargs)
    for block in model.blocks:
        fsdp_ext.fully_shard(block, **kwargs)
    return fsdp_ext.fully_shard(model, **kwargs)


def _assert_params_match(model, reference, atol=1e-5, rtol=1e-4):
    full = fsdp_ext.full_state_dict(model)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, atol=atol, rtol=rtol,
                                   msg=lambda m: f"{key}: {m}")


def check_gradient_accumulation(rank: int, world_size: int) -> None:
    """3 micro-batches, only the last synchronised == one step on the whole batch."""
    for api in ("fully_shard", "fsdp1"):
        torch.manual_seed(0)
        reference = MLP()
        model = _shard_mlp(copy.deepcopy(reference), api)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6)
        for step in range(2):
            x, y = _mlp_batch(step, 3 * 2 * world_size)
            micro = [local_slice(t, rank, world_size).chunk(3) for t in (x, y)]
            for i in range(3):
                last = i == 2
                if api == "fsdp1":
                    ctx = model.no_sync() if not last else _null()
                else:
                    model.set_requires_gradient_sync(last)
                    ctx = _null()
                with ctx:
                    (_mse(model, micro[0][i], micro[1][i]) / 3).backward()
                if not last:  # nothing communicated yet: no sharded gradient exists
                    assert all(p.grad is None for p in model.parameters())
            opt.step()
            opt.zero_grad()
            _mse(reference, x, y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        _assert_params_match(model, reference)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def check_clip_grad_norm(rank: int, world_size: int, mesh=None) -> None:
    for norm_type in (2.0, math.inf):
        torch.manual_seed(0)
        reference = MLP()
        model = _shard_mlp(copy.deepcopy(reference), mesh=mesh)
        x, y = _mlp_batch(0, 2 * world_size)
        _mse(model, local_slice(x, rank, world_size), local_slice(y, rank, world_size)).backward()
        _mse(reference, x, y).backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type)
        got = model.clip_grad_norm_(0.05, norm_type)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
        gathered = [torch.zeros(()) for _ in range(world_size)]
        dist.all_gather(gathered, got.reshape(()))
        assert all(float(g) == float(got) for g in gathered), "ranks disagree on the norm"
        assert float(expected) > 0.05, "the test must actually clip"
        # Clipped gradients: step both and compare parameters.
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=1.0)
        opt.step()
        ref_opt.step()
        _assert_params_match(model, reference)


def check_nonfinite_gradient_names_unit(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _shard_mlp(MLP())
    x, y = _mlp_batch(0, 2)
    x[0, 0] = float("nan") if rank == world_size - 1 else x[0, 0]
    _mse(model, x, y).backward()
    with pytest.raises(fsdp_ext.NonFiniteGradientError, match=r"blocks\.0"):
        model.clip_grad_norm_(1.0, error_if_nonfinite=True)


def check_nonfinite_report_stays_in_its_group(rank: int, world_size: int) -> None:
    """Ranks 0 and 1 shard over a group of their own and the others never clip: the report's
    exchange stays in the units' group (on the default group it would wait for ranks that never
    come, and an NCCL group could not reduce the host tensor it used)."""
    group = dist.new_group([0, 1])
    if rank < 2:
        torch.manual_seed(0)
        model = _shard_mlp(MLP(), process_group=group)
        x, y = _mlp_batch(0, 2)
        x[0, 0] = float("nan") if rank == 1 else x[0, 0]
        _mse(model, x, y).backward()
        with pytest.raises(fsdp_ext.NonFiniteGradientError, match=r"blocks\.0"):
            model.clip_grad_norm_(1.0, error_if_nonfinite=True)
    dist.barrier()


def check_tiny_units_clip(rank: int, world_size: int) -> None:
    """Units smaller than the world size: some ranks own an empty shard."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 2))
    model = copy.deepcopy(reference)
    fsdp_ext.fully_shard(model[0])
    fsdp_ext.fully_shard(model)
    x = torch.randn(2 * world_size, 1, generator=torch.Generator().manual_seed(3))
    model(local_slice(x, rank, world_size)).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
    torch.testing.assert_close(fsdp_ext.clip_grad_norm_(model, 1e-3), expected, atol=1e-6, rtol=1e-5)


class SeededLinear(nn.Linear):
    """A Linear whose init depends only on a per-module seed: identical on meta or not."""

    def __init__(self, seed: int, *args, **kwargs):
        self.seed = seed
        super().__init__(*args, **kwargs)

    def reset_parameters(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=g) * 0.1)
            if self.bias is not None:
                self.bias.copy_(torch.randn(self.bias.shape, generator=g) * 0.1)


def _seeded_model() -> nn.Module:
    blocks = [nn.Sequential(SeededLinear(10 * i + 1, 6, 9), nn.Tanh(), SeededLinear(10 * i + 2, 9, 6))
              for i in range(3)]
    return nn.Sequential(*blocks, SeededLinear(99, 6, 2))


def check_meta_init(rank: int, world_size: int) -> None:
    """Built on the meta device. fully_shard leaves the parameters there (as torch's does) until
    `to_empty`; fsdp_ext's `param_init_fn` materialises and initialises them at fully_shard."""
    reference = _seeded_model()
    x = torch.randn(2 * world_size, 6, generator=torch.Generator().manual_seed(1))
    with torch.device("meta"):
        model = _seeded_model()
    for block in list(model)[:3]:
        fsdp_ext.fully_shard(block)
    fsdp_ext.fully_shard(model)
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(RuntimeError, match="on the meta device: call model.to_empty"):
        model(local_slice(x, rank, world_size))
    model.to_empty(device="cpu")
    assert not any(p.is_meta for p in model.parameters())
    model.load_state_dict(reference.state_dict())
    _assert_params_match(model, reference, atol=0, rtol=0)
    torch.testing.assert_close(model(local_slice(x, rank, world_size)),
                               reference(local_slice(x, rank, world_size)), atol=1e-6, rtol=1e-5)

    with torch.device("meta"):
        model = _seeded_model()
    init = lambda m: m.reset_parameters() if isinstance(m, SeededLinear) else None  # noqa: E731
    for block in list(model)[:3]:
        fsdp_ext.fully_shard(block, param_init_fn=init)
    fsdp_ext.fully_shard(model, param_init_fn=init)
    assert not any(p.is_meta for p in model.parameters())
    _assert_params_match(model, reference, atol=0, rtol=0)


def check_cpu_offload(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    reference = GPT(GPTConfig(vocab_size=41, block_size=8, n_layer=2, n_head=2, d_model=16))
    model = copy.deepcopy(reference)
    policy = fsdp_ext.CPUOffloadPolicy(pin_memory=True)
    for block in model.blocks:
        fsdp_ext.fully_shard(block, offload_policy=policy)
    fsdp_ext.fully_shard(model, offload_policy=policy)
    assert all(p.device.type == "cpu" for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6)
    for step in range(3):
        idx = torch.randint(0, 41, (2 * world_size, 8), generator=torch.Generator().manual_seed(step))
        model(local_slice(idx, rank, world_size), local_slice(idx, rank, world_size)).backward()
        assert all(p.grad is None or p.grad.device.type == "cpu" for p in model.parameters())
        opt.step()
        opt.zero_grad()
        reference(idx, idx).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_params_match(model, reference)


def check_forward_without_backward_then_update(rank: int, world_size: int) -> None:
    """reshard_after_forward=2 keeps a chunk of each unit for a cheaper regather in backward. A
    forward whose backward never runs, then an in-place parameter update: the next step must
    gather the new values, not the chunks the abandoned forward kept."""
    torch.manual_seed(0)
    reference = GPT(GPTConfig(vocab_size=41, block_size=8, n_layer=2, n_head=2, d_model=16))
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fsdp_ext.fully_shard(block, reshard_after_forward=2)
    fsdp_ext.fully_shard(model)
    idx = torch.randint(0, 41, (2 * world_size, 8), generator=torch.Generator().manual_seed(0))
    mine = local_slice(idx, rank, world_size)
    model(mine, mine)  # the graph is dropped: no backward
    with torch.no_grad():
        for p in [*model.parameters(), *reference.parameters()]:
            p.mul_(0.5)
    loss = model(mine, mine)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total / world_size, reference(idx, idx).detach(), atol=1e-6,
                               rtol=1e-5)


def check_checkpoint_wrapper(rank: int, world_size: int) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing)
    torch.manual_seed(0)
    reference = GPT(GPTConfig(vocab_size=41, block_size=8, n_layer=2, n_head=2, d_model=16))
    model = copy.deepcopy(reference)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    for module in list(model.modules()):
        if isinstance(module, Block):
            fsdp_ext.fully_shard(module)
    fsdp_ext.fully_shard(model)
    idx = torch.randint(0, 41, (2 * world_size, 8), generator=torch.Generator().manual_seed(0))
    model(local_slice(idx, rank, world_size), local_slice(idx, rank, world_size)).backward()
    reference(idx, idx).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.grad is not None, name
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1.0) for m in (model, reference))
    opt.step()
    ref_opt.step()
    _assert_params_match(model, reference)


def check_tied_across_units_rejected(rank: int, world_size: int) -> None:
    model = GPT(GPTConfig(vocab_size=41, block_size=8, n_layer=1, n_head=2, d_model=16))
    fsdp_ext.fully_shard(model.lm_head)
    with pytest.raises(ValueError, match=r"lm_head\.weight.*wte|wte.*lm_head"):
        fsdp_ext.fully_shard(model)


def check_summon_and_sync_module_states(rank: int, world_size: int) -> None:
    torch.manual_seed(rank)  # every rank starts different; sync_module_states takes rank 0's
    model = MLP()
    rank0 = [p.detach().clone() for p in model.parameters()]
    for t in rank0:
        dist.broadcast(t, src=0)
    model = fsdp_ext.FullyShardedDataParallel(
        model, auto_wrap_policy=fsdp_ext.ModuleWrapPolicy({nn.Sequential}), sync_module_states=True)
    with fsdp_ext.FullyShardedDataParallel.summon_full_params(model):
        for p, expected in zip(model.parameters(), rank0):
            torch.testing.assert_close(p, expected, atol=0, rtol=0)
        with torch.no_grad():
            model.module.head.weight.fill_(0.5)
    assert model.module.head.weight.dim() == 1, "back to the shard view after the block"
    full = fsdp_ext.full_state_dict(model)
    assert bool((full["head.weight"] == 0.5).all()), "writeback lost"
    with fsdp_ext.summon_full_params(model, writeback=False), torch.no_grad():
        model.module.head.weight.fill_(-1.0)
    assert bool((fsdp_ext.full_state_dict(model)["head.weight"] == 0.5).all())


def training_loop_worker(rank: int, world_size: int) -> None:
    check_summon_and_sync_module_states(rank, world_size)
    check_gradient_accumulation(rank, world_size)
    check_clip_grad_norm(rank, world_size)
    if world_size == 4:
        from torch.distributed.device_mesh import init_device_mesh
        check_clip_grad_norm(rank, world_size, mesh=init_device_mesh("cpu", (2, 2)))
    check_nonfinite_gradient_names_unit(rank, world_size)
    if world_size > 2:
        check_nonfinite_report_stays_in_its_group(rank, world_size)
    check_tiny_units_clip(rank, world_size)
    check_meta_init(rank, world_size)
    check_cpu_offload(rank, world_size)
    if world_size == 4:
        check_forward_without_backward_then_update(rank, world_size)
    check_checkpoint_wrapper(rank, world_size)
    check_tied_across_units_rejected(rank, world_size)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_training_loop(world_size):
    run_distributed(training_loop_worker, world_size)
