"""A unit used several times in one forward is reduced once per backward, its uses' gradients
summed as autograd sums them, as torch's fully_shard does (runtime/unit/backward_uses.py): the
gradients equal torch's bit for bit and as many gradient collectives run as torch's."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..helpers import fsdp2 as scripts
from ..helpers.dist import run_distributed


class TwoHeads(nn.Module):
    """Multi-token prediction in miniature: the embedding and the output head each run twice,
    the second head's input computed from the first's hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 24)
        self.body = nn.Linear(24, 24)
        self.mtp = nn.Linear(24, 24)
        self.head = nn.Linear(24, 37)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(self.emb(idx)))
        h2 = torch.tanh(self.mtp(h + self.emb(idx.roll(1, 1))))
        return self.head(h).logsumexp(-1).mean() + self.head(h2).logsumexp(-1).mean()


def gradient_collectives(calls: list) -> None:
    """Count the gradient collectives and their elements: torch's reduce-scatters, fsdp_ext's
    (on gloo an in-place all-reduce of the packed buffer)."""
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce"):
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            calls.append(max(t.numel() for t in tensors))  # (a reduce-scatter's input)
            return _original(*args, **kwargs)
        setattr(dist, name, counted)


def twice_worker(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    calls: list[int] = []
    gradient_collectives(calls)
    for param_dtype in (torch.bfloat16, None):
        grads, counts = {}, {}
        for fsdp in (scripts.torch_fsdp(), scripts.ours()):
            torch.manual_seed(0)
            model = TwoHeads()
            mp = fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
            for module in (model.emb, model.body, model.mtp, model.head):
                fsdp.fully_shard(module, mesh=mesh, mp_policy=mp)
            fsdp.fully_shard(model, mesh=mesh, mp_policy=mp)
            calls.clear()
            for step in range(2):  # the second backward accumulates into the first's gradients
                idx = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(
                    10 * step + rank))
                model(idx).backward()
            counts[fsdp.name] = list(calls)
            grads[fsdp.name] = {n: p.grad.to_local() for n, p in model.named_parameters()}
        assert len(counts["fsdp_ext"]) == len(counts["torch"]), (param_dtype, counts)
        for name, expected in grads["torch"].items():
            got = grads["fsdp_ext"][name]
            assert torch.equal(got, expected), (param_dtype, name,
                                                float((got - expected).abs().max()))
    dist.barrier()


def test_unit_used_twice_is_reduced_once_as_torch(world_size=2):
    run_distributed(twice_worker, world_size)


class Decoder(nn.Module):
    """A decoder whose output head runs outside its forward, in the chunks of torchtitan's
    ChunkedLossWrapper (forward with the head skipped, then the head per chunk, each chunk's
    backward on its own, then the decoder's backward)."""

    VOCAB = 1031  # an lm_head big enough to be gathered on its own (layout.py)

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(self.VOCAB, 64)
        self.body = nn.Linear(64, 64)
        self.norm = nn.RMSNorm(64)
        self.lm_head = nn.Linear(64, self.VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.body(self.emb(idx))))


def chunked_worker(rank: int, world_size: int) -> None:
    from torchtitan.components.loss import ChunkedLossWrapper
    mesh = init_device_mesh("cpu", (world_size,))
    calls: list[int] = []
    gradient_collectives(calls)
    grads, counts = {}, {}
    for fsdp in (scripts.torch_fsdp(), scripts.ours()):
        torch.manual_seed(0)
        model = Decoder()
        for module in (model.emb, model.body):
            fsdp.fully_shard(module, mesh=mesh)
        fsdp.fully_shard([model.norm, model.lm_head], mesh=mesh)  # as torchtitan shards them
        fsdp.fully_shard(model, mesh=mesh)
        loss_fn = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=2))
        loss_fn.set_lm_head(model.lm_head)
        calls.clear()
        for step in range(2):
            idx = torch.randint(0, Decoder.VOCAB, (2, 8), generator=torch.Generator().manual_seed(
                10 * step + rank))
            loss, _ = loss_fn(model(idx), idx.roll(1, 1))
            loss.backward()
        counts[fsdp.name] = list(calls)
        grads[fsdp.name] = {n: p.grad.to_local() for n, p in model.named_parameters()}
    ours, theirs = counts["fsdp_ext"], counts["torch"]
    assert len(ours) == len(theirs), counts
    # Elements sent: torch's, give or take fsdp_ext's alignment of each gather group (layout.py)
    assert sum(ours) <= sum(theirs) + 8 * world_size * len(ours), counts
    for name, expected in grads["torch"].items():
        got = grads["fsdp_ext"][name]
        assert torch.equal(got, expected), (name, float((got - expected).abs().max()))
    dist.barrier()


def test_chunked_loss_sends_each_parameter_once_as_torch(world_size=2):
    run_distributed(chunked_worker, world_size)
