"""Scripts in which a unit runs partly, or one member at a time, written for torch's fully_shard and
run with torch's and fsdp_ext's (tests/runtime/test_partial_units.py compares them).

The main one reproduces torchtitan 0.3.0's chunked loss (`components/loss.py:
ChunkedLossWrapper`, its `llama3_debugmodel` default) call for call: the decoder's forward stops
before `lm_head`, whose list unit `[norm, lm_head]` therefore runs only half in the root's
forward; the loss then calls `lm_head` on each sequence chunk outside any root forward, with one
`backward()` per chunk, the unit's setters and `unshard()`/`reshard()` around the loop, and hands
the summed chunk gradients to the decoder through an autograd function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from examples.models import Block, GPTConfig

CFG = GPTConfig(vocab_size=67, block_size=8, n_layer=2, n_head=2, d_model=24)
GLOBAL_BATCH = 12  # divides by 2, 3 and 4


class Decoder(nn.Module):
    """torchtitan's Decoder layout: tok_embeddings, layers (a ModuleDict), norm, lm_head; with
    `skip_lm_head` its forward returns the normed hidden states."""

    def __init__(self, cfg: GPTConfig = CFG):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.skip_lm_head = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(idx)
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h)
        return h if self.skip_lm_head else self.lm_head(h)


def build(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder()


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.block_size + 1), generator=g)
    per_rank = GLOBAL_BATCH // world
    mine = tokens[rank * per_rank:(rank + 1) * per_rank]
    return mine[:, :-1], mine[:, 1:]


def shard_like_torchtitan(fsdp, model: Decoder, reshard_policy: str = "default",
                          lm_head_unit: str = "list") -> Decoder:
    """torchtitan's apply_fsdp_to_decoder (dense, untied): the embedding, `[norm, lm_head]` as one
    list unit kept gathered after forward unless "always", each block, the root; then the divide
    factor 1.0 (torchtitan scales by the global token count itself), with sum reductions (torch's
    would use PREMUL_SUM for it, which gloo lacks). `lm_head_unit` "separate" shards norm and
    lm_head as units of their own instead."""
    always = reshard_policy == "always"
    fsdp.fully_shard(model.tok_embeddings)
    if lm_head_unit == "list":
        fsdp.fully_shard([model.norm, model.lm_head], reshard_after_forward=always)
    else:
        fsdp.fully_shard(model.norm, reshard_after_forward=always)
        fsdp.fully_shard(model.lm_head, reshard_after_forward=always)
    for layer in model.layers.values():
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    for module in model.modules():
        if isinstance(module, fsdp.FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


class _DecoderOutputGradient(torch.autograd.Function):
    """torchtitan's bridge: the loss's backward hands the summed chunk gradients to the decoder."""

    @staticmethod
    def forward(ctx, hidden, accumulated_grad, loss):
        ctx.save_for_backward(accumulated_grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_output):
        (accumulated_grad,) = ctx.saved_tensors
        return accumulated_grad, None, None


def chunked_loss(lm_head: nn.Module, fsdp_module_class, hidden: torch.Tensor,
                 labels: torch.Tensor, tokens: int, num_chunks: int = 4) -> torch.Tensor:
    """ChunkedLossWrapper.__call__, call for call (no DTensor inputs, no SPMD typing)."""
    fsdp_enabled = isinstance(lm_head, fsdp_module_class)
    requires_grad = hidden.requires_grad
    h_chunks = [c.detach().requires_grad_(requires_grad)
                for c in hidden.chunk(num_chunks, dim=1)]
    label_chunks = labels.chunk(num_chunks, dim=1)
    grads = torch.zeros_like(hidden, dtype=torch.float32) if requires_grad else None
    total = hidden.new_zeros((), dtype=torch.float32)
    if fsdp_enabled:
        lm_head.set_reshard_after_forward(False)
        lm_head.set_reshard_after_backward(False)
        lm_head.set_requires_gradient_sync(False, recurse=False)
        lm_head.unshard()
    chunk_len = hidden.shape[1] // num_chunks
    for i, (h, y) in enumerate(zip(h_chunks, label_chunks)):
        if fsdp_enabled and i == num_chunks - 1:
            lm_head.set_requires_gradient_sync(True, recurse=False)
        logits = lm_head(h)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") / tokens
        total = total + loss.detach()
        if requires_grad:
            loss.backward()
            grads[:, i * chunk_len:(i + 1) * chunk_len] += h.grad
            h.grad = None
    if fsdp_enabled:
        lm_head.set_reshard_after_forward(True)
        lm_head.set_reshard_after_backward(True)
        lm_head.set_requires_gradient_sync(True, recurse=False)
        lm_head.reshard()
    if not requires_grad:
        return total
    return _DecoderOutputGradient.apply(hidden, grads.to(hidden.dtype), total)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _global_tokens(labels: torch.Tensor) -> int:
    import torch.distributed as dist
    count = torch.tensor(labels.numel())
    dist.all_reduce(count)
    return int(count)


def train_chunked(fsdp, rank: int, world: int, steps: int = 3, reshard_policy: str = "default",
                  lm_head_unit: str = "list", validate: bool = True):
    """torchtitan's train step with the chunked loss, then (as its validator) the same loss under
    no_grad: per step the global loss, the gradients' full values before the optimizer step and
    the validation loss; then the trained parameters."""
    import torch.distributed as dist
    model = shard_like_torchtitan(fsdp, build(), reshard_policy, lm_head_unit)
    model.skip_lm_head = True
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    losses, grads = [], []
    for step in range(steps):
        inputs, labels = batch(step, rank, world)
        tokens = _global_tokens(labels)
        hidden = model(inputs)
        loss = chunked_loss(model.lm_head, fsdp.FSDPModule, hidden, labels, tokens)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
        grads.append({n: _full(p.grad).clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
        opt.zero_grad()
        if validate:
            with torch.no_grad():
                hidden = model(inputs)
                val = chunked_loss(model.lm_head, fsdp.FSDPModule, hidden, labels, tokens)
            dist.all_reduce(val)
            losses.append(float(val))
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return losses, grads, params


def train_head_outside(fsdp, rank: int, world: int, steps: int = 3, reshard_policy="default"):
    """A list unit whose members run in different forwards: the root's forward runs `norm`, the
    loss calls `lm_head` afterwards (no setters), one backward over both."""
    import torch.distributed as dist
    model = shard_like_torchtitan(fsdp, build(), reshard_policy)
    model.skip_lm_head = True
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    losses = []
    for step in range(steps):
        inputs, labels = batch(step, rank, world)
        logits = model.lm_head(model(inputs))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        loss = loss / _global_tokens(labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return losses, params
