"""torch.compile on CPU: a unit's compiled forward inside fsdp_ext, the whole sharded model compiled
(inductor, which generates C++: the runtime's hooks must stay out of its graphs), and the custom ops
traced in a full graph (their fake implementations). The per-unit case uses the aot_eager backend,
which exercises Dynamo and AOTAutograd without generating code, to keep the test fast."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fsdp_ext
from examples.models import GPT, GPTConfig
from fsdp_ext.ops import reference

from ..helpers.dist import global_mean, local_slice, run_distributed


def compile_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=41, block_size=8, n_layer=2, n_head=2, d_model=16))
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fsdp_ext.fully_shard(block)
        block.forward = torch.compile(block.forward, backend="aot_eager")
    fsdp_ext.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        idx = torch.randint(0, 41, (2 * world_size, 8), generator=torch.Generator().manual_seed(step))
        loss = model(local_slice(idx, rank, world_size), local_slice(idx, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(idx, idx)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(global_mean(loss), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    dist.barrier()


@pytest.mark.slow
def test_compiled_unit_forward_trains():
    run_distributed(compile_worker, 2)


def whole_model_worker(rank: int, world_size: int) -> None:
    """torch.compile(model) of a sharded model trains with the eager sharded model's losses (and
    the unwrapped model's); after the first step no frame is compiled again."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=41, block_size=8, n_layer=2, n_head=2, d_model=16))
    models = []
    for _ in range(2):
        model = copy.deepcopy(ref)
        for block in model.blocks:
            fsdp_ext.fully_shard(block)
        models.append(fsdp_ext.fully_shard(model))
    eager, compiled = models[0], torch.compile(models[1])
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, *models)]
    for step in range(4):
        idx = torch.randint(0, 41, (2 * world_size, 8), generator=torch.Generator().manual_seed(step))
        mine = local_slice(idx, rank, world_size)
        losses = [ref(idx, idx), eager(mine, mine), compiled(mine, mine)]
        for loss, opt in zip(losses, opts):
            loss.backward()
            opt.step()
            opt.zero_grad()
        ref_loss, eager_loss, compiled_loss = (losses[0].detach(), global_mean(losses[1]),
                                               global_mean(losses[2]))
        torch.testing.assert_close(compiled_loss, eager_loss, atol=1e-5, rtol=0,
                                   msg=lambda m: f"step {step}, compiled vs eager: {m}")
        torch.testing.assert_close(eager_loss, ref_loss, atol=1e-5, rtol=1e-5)
        if step == 0:
            frames = counters["stats"]["unique_graphs"]
    assert frames > 0, "torch.compile compiled nothing"
    assert counters["stats"]["unique_graphs"] == frames, \
        f"recompiled after step 0: {frames} -> {counters['stats']['unique_graphs']} graphs"
    dist.barrier()


@pytest.mark.slow
def test_compiled_whole_model_trains():
    run_distributed(whole_model_worker, 2, timeout_s=300.0)


def _per_block_compiled(fully_shard, backend: str):
    """torchtitan's per-block compile: each block sharded, then `block.compile(fullgraph=True)`;
    three SGD steps: losses and the last gradients (full)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=41, block_size=8, n_layer=2, n_head=2, d_model=16))
    for block in model.blocks:
        fully_shard(block)
        block.compile(backend=backend, fullgraph=True)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(3):
        idx = torch.randint(0, 41, (2 * world, 8), generator=torch.Generator().manual_seed(step))
        mine = local_slice(idx, rank, world)
        loss = model(mine, mine)
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, grads


def per_block_fullgraph_worker(rank: int, world_size: int, backend: str) -> None:
    """Blocks compiled with fullgraph=True (torchtitan's --compile.components model): no graph
    break from fsdp_ext's hooks inside a block, and the losses and gradients of torch's FSDP2
    on the same script, bit for bit; in eager, a block's submodule called while sharded still
    raises naming itself (the check a trace skips)."""
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    torch._dynamo.reset()
    counters.clear()
    ours = _per_block_compiled(fsdp_ext.fully_shard, backend)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()
    theirs = _per_block_compiled(torch_fully_shard, backend)
    for step, (a, b) in enumerate(zip(*(losses for losses, _ in (ours, theirs)))):
        assert torch.equal(a, b), (step, a, b)
    for name, grad in theirs[1].items():
        assert torch.equal(ours[1][name], grad), name
    torch.manual_seed(0)
    eager = GPT(GPTConfig(vocab_size=41, block_size=8, n_layer=2, n_head=2, d_model=16))
    for block in eager.blocks:
        fsdp_ext.fully_shard(block)
    fsdp_ext.fully_shard(eager)
    with pytest.raises(RuntimeError, match=r"was called while its parameters are sharded"):
        eager.blocks[0].attn(torch.randn(1, 8, 16))
    dist.barrier()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_per_block_fullgraph_compile_matches_torch_fsdp2(backend):
    run_distributed(per_block_fullgraph_worker, 2, backend, timeout_s=300.0)


@pytest.mark.skipif(not fsdp_ext.ops.HAVE_EXTENSION, reason="needs the compiled extension")
def test_custom_ops_in_a_full_graph():
    @torch.compile(backend="aot_eager", fullgraph=True)
    def pack_and_scale(a, b, out):
        torch.ops.fsdp_ext.pack([a, b], [0, 8], out, 0, 0.5)
        return out * 2

    a, b = torch.randn(5), torch.randn(3)
    expected = torch.empty(16)
    reference.pack([a, b], [0, 8], expected, 0, 0.5)
    torch.testing.assert_close(pack_and_scale(a, b, torch.empty(16)), expected * 2)
