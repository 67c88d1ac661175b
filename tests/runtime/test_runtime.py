"""The runtime's timeline and awkward models, each against an unwrapped single-process reference."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import fsdp_ext
from examples.models import GPT, Block, GPTConfig
from fsdp_ext.runtime.core.registry import units_of
from fsdp_ext.runtime.core.trace import recording

from ..helpers.dist import global_mean, local_slice, run_distributed


def _index(events, kind, unit, start=0):
    for i in range(start, len(events)):
        if events[i].kind == kind and events[i].unit == unit:
            return i
    raise AssertionError(f"no {kind} event for unit '{unit}' after position {start}")


def _gpt_with_units(depth: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=4, n_head=2, d_model=16))
    for block in model.blocks:
        fsdp_ext.fully_shard(block, forward_prefetch=depth, backward_prefetch=depth)
    fsdp_ext.fully_shard(model, forward_prefetch=depth, backward_prefetch=depth)
    return model


def _train_step(model, rank):
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, 50, (2, 8), generator=g)
    model(idx, idx).backward()


def check_prefetch_order(rank: int) -> None:
    """With depth 1, unit i+1's all-gather is issued before unit i finishes, both directions."""
    model = _gpt_with_units(depth=1)
    _train_step(model, rank)  # the first step records the execution order
    with recording() as events:
        _train_step(model, rank)
    order = [f"blocks.{i}" for i in range(4)]
    for cur, nxt in zip(order, order[1:]):
        assert _index(events, "all_gather.issue", nxt) < _index(events, "forward.end", cur), (
            f"forward: all-gather of {nxt} not issued before {cur} finished")
    backward_start = _index(events, "backward.begin", "")
    back = order[::-1]
    for cur, nxt in zip(back, back[1:]):
        issued = _index(events, "all_gather.issue", nxt, backward_start)
        assert issued < _index(events, "backward.end", cur, backward_start), (
            f"backward: all-gather of {nxt} not issued before {cur}'s backward finished")
    # The same check must fail without prefetch: it is not satisfied by construction.
    model = _gpt_with_units(depth=0)
    _train_step(model, rank)
    with recording() as events:
        _train_step(model, rank)
    assert _index(events, "all_gather.issue", "blocks.1") > _index(events, "forward.end", "blocks.0")


def check_in_flight_bound(rank: int) -> None:
    for depth in (1, 2):
        model = _gpt_with_units(depth)
        schedule = None
        for _ in range(3):
            _train_step(model, rank)
            schedule = units_of(model)[-1].schedule
        assert schedule.peak_transient_unsharded <= depth + 1, (depth, schedule.peak_transient_unsharded)
        # Prefetching really runs ahead (the bound is reached, not vacuous).
        assert schedule.peak_transient_unsharded == depth + 1, (depth, schedule.peak_transient_unsharded)
        assert not any(u.holds_unsharded_memory() for u in units_of(model)), "leaked after backward"


def _compare_training(rank, world_size, build, wrap, batch, loss_fn, steps=3, per_chunk=False,
                      after_backward=None, after_step=None):
    """Train wrapped and reference models; compare losses and gathered parameters.

    per_chunk: the reference runs each rank's slice separately and averages (for BatchNorm, whose
    training-mode statistics are per rank by design). after_backward(model, reference): called
    between each backward and optimizer step; after_step(model): after each optimizer step.
    """
    reference = build()
    model = wrap(copy.deepcopy(reference))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    for step in range(steps):
        inputs, targets = batch(step, 2 * world_size)
        loss = loss_fn(model, local_slice(inputs, rank, world_size),
                       local_slice(targets, rank, world_size))
        loss.backward()
        grads_none = {n for n, p in model.named_parameters() if p.grad is None}
        if after_backward is not None:
            after_backward(model, reference)
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model)
        if per_chunk:
            ref_loss = sum(loss_fn(reference, local_slice(inputs, r, world_size),
                                   local_slice(targets, r, world_size))
                           for r in range(world_size)) / world_size
        else:
            ref_loss = loss_fn(reference, inputs, targets)
        ref_loss.backward()
        ref_none = {n for n, p in reference.named_parameters() if p.grad is None}
        assert grads_none == ref_none, f"grad None for {grads_none}, reference {ref_none}"
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(global_mean(loss), ref_loss.detach(), atol=1e-6, rtol=1e-5)
    full = fsdp_ext.full_state_dict(model)
    for key, value in reference.state_dict().items():
        if per_chunk and "running" in key or key.endswith("num_batches_tracked"):
            continue
        torch.testing.assert_close(full[key], value, atol=1e-5, rtol=1e-4, msg=lambda m: f"{key}: {m}")
    return model


def _vector_batch(dim, out):
    def batch(step, n):
        g = torch.Generator().manual_seed(step)
        return torch.randn(n, dim, generator=g), torch.randn(n, out, generator=g)
    return batch


def _mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


class TwiceUsed(nn.Module):
    """The same block applied twice, plus a layer the forward never uses."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(9, 9), nn.Tanh())
        self.unused = nn.Linear(9, 4)
        self.head = nn.Linear(9, 2)

    def forward(self, x):
        return self.head(self.block(self.block(x)))


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(9, 17), nn.GELU(), nn.Linear(17, 9))
                                    for _ in range(3))
        self.head = nn.Linear(9, 2)

    def forward(self, x):
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        # No bias before BatchNorm: its gradient is zero in exact arithmetic (rounding noise only).
        self.body = nn.Sequential(nn.Linear(6, 10, bias=False), nn.BatchNorm1d(10), nn.ReLU())
        self.tiny = nn.Linear(1, 1)  # 2 parameters: fewer than the world size, empty shards
        self.head = nn.Linear(10, 1)

    def forward(self, x):
        return self.tiny(self.head(self.body(x)))


def _shard_children(classes):
    def wrap(model):
        for module in reversed(list(model.modules())):  # bottom-up
            if module is not model and isinstance(module, classes):
                fsdp_ext.fully_shard(module)
        fsdp_ext.fully_shard(model)
        return model
    return wrap


def check_awkward_models(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    _compare_training(rank, world_size, TwiceUsed, _shard_children((nn.Sequential,)),
                      _vector_batch(9, 2), _mse)
    for reentrant in (False, True):
        torch.manual_seed(0)
        _compare_training(rank, world_size, lambda: Checkpointed(reentrant),
                          _shard_children((nn.Sequential,)), _vector_batch(9, 2), _mse)
    torch.manual_seed(0)
    model = _compare_training(rank, world_size, WithBatchNorm,
                              _shard_children((nn.Sequential, nn.Linear)), _vector_batch(6, 1),
                              _mse, per_chunk=True)
    assert model.body[1].running_mean.shape == (10,)


def check_parameterless_root(rank: int, world_size: int) -> None:
    """A root whose parameters all belong to child units trains like the reference and issues no
    all-gather of its own (it has nothing to gather)."""
    torch.manual_seed(0)
    build = lambda: nn.Sequential(nn.Linear(9, 13), nn.Tanh(), nn.Linear(13, 2))  # noqa: E731
    model = _compare_training(rank, world_size, build, _shard_children((nn.Linear,)),
                              _vector_batch(9, 2), _mse)
    x = torch.randn(4, 9)
    with recording() as events:
        _mse(model, x, torch.zeros(4, 2)).backward()
        with torch.no_grad():
            model(x)
    gathered = {e.unit for e in events if e.kind == "all_gather.issue"}
    assert gathered == {"0", "2"}, gathered
    assert not any(u.holds_unsharded_memory() for u in units_of(model))


def check_no_grad_frees_everything(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    reference = GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=3, n_head=2, d_model=16))
    model = _shard_children((Block,))(copy.deepcopy(reference))
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(rank))
    for mode in ("no_grad", "eval", "inference_mode", "no_grad after an update"):
        if mode.endswith("update"):  # no-grad views are made once: they must see new values
            with torch.no_grad():
                for p in [*model.parameters(), *reference.parameters()]:
                    p.mul_(0.5)
        model.eval() if mode == "eval" else model.train()
        ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
        with ctx:
            out = model(idx)
        torch.testing.assert_close(out, reference(idx).detach(), atol=1e-6, rtol=1e-5)
        leaked = [u.name for u in units_of(model) if u.holds_unsharded_memory()]
        assert not leaked, f"{mode}: units still unsharded after forward: {leaked}"
    model.train()
    model(idx, idx).backward()  # training still works after inference passes
    assert all(p.grad is not None for p in model.parameters())


def runtime_worker(rank: int, world_size: int) -> None:
    if world_size == 2:
        check_prefetch_order(rank)
        check_in_flight_bound(rank)
    check_awkward_models(rank, world_size)
    check_parameterless_root(rank, world_size)
    check_no_grad_frees_everything(rank, world_size)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_runtime(world_size):
    run_distributed(runtime_worker, world_size)
