"""torchtitan's training flow for a Llama, with the FSDP implementation as a switch.

The steps are torchtitan's (its `parallelize_llama` / `apply_fsdp`, model init and checkpoint
manager), written out for a small Llama so that the script runs anywhere:
  1. build the model on the meta device;
  2. `apply_fsdp`: `fully_shard` each transformer block, then the root, with a mixed-precision
     policy, and the explicit prefetch lists (each block prefetches the next in forward and the
     previous in backward);
  3. `to_empty` on the device, then the model's own `init_weights` (which also rebuilds the rotary
     cache, a non-persistent buffer);
  4. train with AdamW and torch's `clip_grad_norm_` on the DTensor gradients;
  5. checkpoint with torch.distributed.checkpoint through `get_state_dict` / `set_state_dict`,
     and resume from it.
`--fsdp torch` uses torch.distributed.fsdp, `--fsdp fsdp_ext` fsdp_ext: nothing else differs.

    torchrun --nproc-per-node 2 examples/titan_flow.py --fsdp fsdp_ext --steps 6 \\
        --checkpoint-at 3 --out /tmp/titan
"""
from __future__ import annotations

import argparse
import importlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


@dataclass
class LlamaArgs:
    dim: int = 64
    n_layers: int = 3
    n_heads: int = 4
    vocab_size: int = 97
    max_seq_len: int = 32
    rope_theta: float = 10000.0


def rope_cache(args: LlamaArgs, device) -> torch.Tensor:
    head = args.dim // args.n_heads
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, head, 2, device=device).float() / head))
    angles = torch.outer(torch.arange(args.max_seq_len, device=device).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)  # [seq, head/2, 2]


def rotate(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cache[: x.shape[1], :, 0][None, :, None], cache[: x.shape[1], :, 1][None, :, None]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False)
                                              for _ in range(4))

    def forward(self, x, cache):
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, d // self.n_heads)
                   for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, cache), rotate(k, cache)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        hidden = 4 * dim
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(args.dim), nn.RMSNorm(args.dim)
        self.attention, self.feed_forward = Attention(args), FeedForward(args.dim)

    def forward(self, x, cache):
        x = x + self.attention(self.attention_norm(x), cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_cache(args, None), persistent=False)

    def init_weights(self, buffer_device=None) -> None:
        """torchtitan's contract: callable after to_empty, on DTensor parameters."""
        with torch.no_grad():
            self.rope = rope_cache(self.args, buffer_device or self.rope.device)
            nn.init.normal_(self.tok_embeddings.weight)
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.trunc_normal_(module.weight, std=0.02)
                elif isinstance(module, nn.RMSNorm):
                    module.reset_parameters()

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def apply_fsdp(model: Transformer, fsdp, mesh, param_dtype=torch.float32) -> None:
    """torchtitan's apply_fsdp: blocks, then the root; explicit prefetch lists."""
    mp = fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # torchtitan keeps the last block gathered for the backward that follows at once
        fsdp.fully_shard(block, mesh=mesh, mp_policy=mp,
                         reshard_after_forward=i < len(blocks) - 1)
    fsdp.fully_shard(model, mesh=mesh, mp_policy=mp)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
        block.set_modules_to_backward_prefetch(blocks[i - 1:i] if i else [])


def batch(step: int, rank: int, world: int, args: LlamaArgs, per_rank: int = 2):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, args.vocab_size, (per_rank * world, 17), generator=g)
    mine = tokens[rank * per_rank:(rank + 1) * per_rank]
    return mine[:, :-1], mine[:, 1:]


def train(fsdp_name: str, steps: int, out: str, checkpoint_at: int | None = None,
          resume_from: str | None = None, args: LlamaArgs = LlamaArgs()) -> list[float]:
    """Returns this rank's losses of the steps it ran (their mean over ranks is the global loss)."""
    fsdp = importlib.import_module("fsdp_ext" if fsdp_name == "fsdp_ext" else "torch.distributed.fsdp")
    from torch.distributed.device_mesh import init_device_mesh
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    apply_fsdp(model, fsdp, mesh)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = 0
    if resume_from is not None:  # torchtitan's CheckpointManager.load
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=resume_from)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        first = int(open(os.path.join(resume_from, "step.txt")).read())
    losses = []
    for step in range(first, steps):
        inputs, labels = batch(step, rank, world, args)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if checkpoint_at is not None and step + 1 == checkpoint_at:
            path = os.path.join(out, f"step-{step + 1}")
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            if rank == 0:
                with open(os.path.join(path, "step.txt"), "w") as f:
                    f.write(str(step + 1))
            dist.barrier()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fsdp", choices=["torch", "fsdp_ext"], default="fsdp_ext")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpoint-at", type=int, default=None)
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--out", default="out/titan")
    cli = parser.parse_args()
    dist.init_process_group("gloo")
    losses = train(cli.fsdp, cli.steps, cli.out, cli.checkpoint_at, cli.resume_from)
    for i, loss in enumerate(losses):
        mean = torch.tensor(loss)
        dist.all_reduce(mean)
        if dist.get_rank() == 0:
            print(f"step {cli.steps - len(losses) + i}: loss {mean.item() / dist.get_world_size():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    from fsdp_ext import run_then_exit
    run_then_exit(main)  # without interpreter finalization: see fsdp_ext/shutdown.py
