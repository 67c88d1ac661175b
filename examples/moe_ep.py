"""Expert parallelism (EP) for examples/moe.py's decoder: each rank of an `ep` group holds
num_experts / ep of every MoE block's routed experts, and the tokens travel to the rank holding
their expert and back by all-to-all.

    model = MoEDecoder(cfg, seed=0)            # the full weights, the same on every rank
    apply_expert_parallel(model, ep_mesh)      # then fully_shard, with the experts over `efsdp`

Each MoE block's GroupedExperts w1, w2, w3 become DTensors Shard(0) on the 1-D `ep_mesh` (rank r
of the group holds experts [r * E/ep, (r + 1) * E/ep) of the initialized weights: the same model
as without EP), which is what torchtitan's `apply_fsdp_to_decoder(..., ep_degree, edp_mesh)`
expects to shard further over the expert-data-parallel mesh. Its RoutedExperts is replaced by
ExpertParallelRoutedExperts, which keeps the `inner_experts` attribute torchtitan reads.

A forward, per MoE block, on each rank of the group:
  1. its (token, top-k slot) pairs sorted by expert, so that the rows for each peer's experts are
     contiguous, in peer order;
  2. the per-expert row counts exchanged (all_to_all_single): each rank learns how many rows each
     peer sends for each of its own experts;
  3. the token rows sent to the ranks holding their experts (an uneven all_to_all_single; its
     backward sends the gradients back the same way);
  4. each local expert run on the rows it received, with the parameters' local tensors
     (`to_local()`, through which the gradient reaches the DTensor parameter);
  5. the results returned by the reverse all-to-all, weighted by their scores and summed into the
     tokens' rows in expert order, as RoutedExperts sums them without EP.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from examples.moe import MoEDecoder, expert_swiglu


class _AllToAll(torch.autograd.Function):
    """Rows of `x` exchanged over `group`: `send[p]` rows to peer p (in peer order), `recv[p]`
    rows from it. The gradient goes back by the same exchange reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return out


class ExpertParallelRoutedExperts(nn.Module):
    """RoutedExperts with its experts spread over `ep_mesh`'s ranks: dispatch and combine by
    all-to-all (the module docstring's steps)."""

    def __init__(self, inner_experts: nn.Module, ep_mesh):
        super().__init__()
        self.inner_experts = inner_experts
        self.ep_mesh = ep_mesh
        self.local_experts = inner_experts.num_experts // ep_mesh.size()

    def forward(self, x: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        group, peers, local = self.ep_mesh.get_group(), self.ep_mesh.size(), self.local_experts
        top_k = experts.shape[1]
        flat = experts.flatten()
        order = flat.argsort(stable=True)   # stable: an expert's tokens in order, as without EP
        token, slot = order // top_k, order % top_k
        counts = torch.bincount(flat, minlength=peers * local)   # rows per expert, from here
        received = torch.empty_like(counts)                       # [peer, my expert] rows to come
        dist.all_to_all_single(received, counts, group=group)
        send = counts.view(peers, local).sum(1).tolist()
        recv = received.view(peers, local).sum(1).tolist()
        rows = _AllToAll.apply(x[token], send, recv, group)
        ex = self.inner_experts
        w1, w2, w3 = (w.to_local() for w in (ex.w1, ex.w2, ex.w3))
        # The rows came in blocks, peer by peer and within a peer's by my experts. Each block runs
        # as a matmul of its own: its rows are those the peer's own forward without EP gives that
        # expert, in the same order, so the results are the EP=1 path's bit for bit.
        blocks = rows.split(received.tolist())
        y = torch.cat([expert_swiglu(b, w1[i % local], w2[i % local], w3[i % local])
                       for i, b in enumerate(blocks)])
        back = _AllToAll.apply(y, recv, send, group)
        return torch.zeros_like(x).index_add(0, token, back * scores[token, slot, None])


def apply_expert_parallel(model: MoEDecoder, ep_mesh) -> MoEDecoder:
    """Spread every MoE block's routed experts over the 1-D `ep_mesh` (in place; returns `model`).
    Call it after the weights are initialized and before fully_shard. Refused, before anything
    changes, when a block's expert count is not a multiple of the mesh's size."""
    ep = ep_mesh.size()
    for i, moe in enumerate(model.moe_layers()):
        n = moe.routed_experts.inner_experts.num_experts
        if n % ep:
            raise ValueError(f"expert parallelism over {ep} ranks needs every MoE block's expert "
                             f"count to be a multiple of {ep}; MoE block {i} has {n} experts")
    rank = ep_mesh.get_local_rank()
    for moe in model.moe_layers():
        experts = moe.routed_experts.inner_experts
        for name in ("w1", "w2", "w3"):
            mine = getattr(experts, name).detach().chunk(ep)[rank].clone()
            local = DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(local))
        moe.routed_experts = ExpertParallelRoutedExperts(experts, ep_mesh)
    return model
