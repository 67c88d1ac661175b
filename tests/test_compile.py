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
from models import GPT, GPTConfig
from fsdp_ext.ops import reference

from .dist_utils import global_mean, local_slice, run_distributed


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
