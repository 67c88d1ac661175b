"""A small mixture-of-experts (MoE) decoder for CPU: the example trainer's `--model moe`, and the
model the tests shard through torchtitan's `apply_fsdp_to_decoder`.

Its module tree and attribute names are those torchtitan 0.3.0's `apply_fsdp_to_decoder` reads, so
that function accepts it unchanged:

    MoEDecoder
      tok_embeddings          nn.Embedding                       (a unit)
      pos_embeddings          learned positions                  (the root unit's own parameter)
      layers                  nn.ModuleDict "0", "1", ...        (one unit each)
        .moe_enabled          False: a dense block (.feed_forward), True: an MoE block (.moe)
        .attention_norm .attention (wq wk wv wo) .ffn_norm
        .moe.router.gate                 nn.Linear(dim, num_experts)
        .moe.routed_experts.inner_experts  GroupedExperts: .num_experts, w1 w2 w3
        .moe.shared_experts              a SwiGLU FeedForward every token goes through
      norm, lm_head           RMSNorm and the untied output layer (one list unit)
      enable_weight_tying     False

Routing is token choice: softmax scores over the experts, each token sent to its top-k experts and
their outputs weighted by the scores. The grouped experts hold `[num_experts, in, out]` weights
(w1, w3: `[E, dim, hidden]`, w2: `[E, hidden, dim]`), which `apply_fsdp_to_decoder` shards along
dim 1 (`Shard(1)`) when the FSDP degree exceeds the number of experts, else along dim 0. They are
computed by a loop over the experts (no grouped GEMM), which runs anywhere. The load-balance loss
(Switch Transformer's: E * sum_e f_e * P_e, with f_e the share of routed slots expert e got and P_e
its mean score) is kept on each MoE module as `aux_loss` after a forward; the decoder's
`forward(tokens, targets)` adds `aux_loss_coeff` times their sum to the cross-entropy when gradients
are being computed (training), and returns the cross-entropy alone otherwise.

Expert parallelism (moe_ep.py's `apply_expert_parallel(model, ep_mesh)`, after the weights are
initialized) leaves each rank of an `ep` group num_experts / ep of every MoE block's experts (its
slice of the same weights, as DTensors Shard(0) on `ep_mesh`) and replaces the loop above with a
dispatch by all-to-all: each rank sorts its (token, top-k slot) pairs by expert, sends each token
row to the rank holding its expert, that rank runs its experts on what it received, the results
come back by the reverse all-to-all and are weighted and summed into the tokens' rows as here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MoEConfig:
    vocab_size: int = 256              # bytes
    block_size: int = 64
    dim: int = 64
    n_heads: int = 4
    layer_experts: tuple = (0, 8, 8)   # per block: 0 = a dense block, n = an MoE block of n experts
    top_k: int = 2
    hidden_dim: int = 96               # each routed expert's and the shared expert's hidden width
    dense_hidden_dim: int = 256        # a dense block's feed-forward width
    aux_loss_coeff: float = 0.01


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); the dense blocks' and the shared expert's."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts as three `[num_experts, in, out]` parameters."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert `expert` applied to the tokens `x` ([n, dim]) routed to it."""
        return expert_swiglu(x, self.w1[expert], self.w2[expert], self.w3[expert])


def expert_swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU on its tokens `x` ([n, dim]); w1, w3: [dim, hidden], w2: [hidden, dim]
    (also what moe_ep.py runs on each rank's own experts)."""
    h = F.silu(x @ w1) * (x @ w3)
    return h @ w2


class RoutedExperts(nn.Module):
    """Dispatch and combine around the grouped experts: each expert runs on the tokens routed to
    it; its outputs, weighted by their scores, are summed back into the tokens' rows."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.inner_experts = GroupedExperts(dim, hidden_dim, num_experts)

    def forward(self, x: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.inner_experts.num_experts):
            token, slot = torch.nonzero(experts == e, as_tuple=True)
            y = self.inner_experts(x[token], e) * scores[token, slot, None]
            out = out.index_add(0, token, y)
        return out


class TokenChoiceTopKRouter(nn.Module):
    """Softmax scores over the experts; each token picks its top-k."""

    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, min(top_k, num_experts)

    def forward(self, x: torch.Tensor):
        probs = F.softmax(self.gate(x).float(), dim=-1)          # [n, E]
        scores, experts = torch.topk(probs, self.top_k, dim=-1)  # [n, k]
        return probs, scores.to(x.dtype), experts


class MoE(nn.Module):
    """Routed experts plus a shared expert; `aux_loss`: the last forward's load-balance loss."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k)
        self.routed_experts = RoutedExperts(dim, hidden_dim, num_experts)
        self.shared_experts = FeedForward(dim, hidden_dim)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs, scores, experts = self.router(flat)
        counts = torch.bincount(experts.flatten(), minlength=self.router.num_experts)
        share = counts.to(probs.dtype) / experts.numel()          # f_e (no gradient)
        self.aux_loss = self.router.num_experts * (share * probs.mean(0)).sum()
        out = self.routed_experts(flat, scores, experts) + self.shared_experts(flat)
        return out.view_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-norm attention, then a dense SwiGLU feed-forward (`num_experts` 0) or an MoE."""

    def __init__(self, cfg: MoEConfig, num_experts: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim)
        self.attention = Attention(cfg.dim, cfg.n_heads)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.moe_enabled = num_experts > 0
        if self.moe_enabled:
            self.moe = MoE(cfg.dim, cfg.hidden_dim, num_experts, cfg.top_k)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.dense_hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return x + ffn(self.ffn_norm(x))


class MoEDecoder(nn.Module):
    """The decoder; `forward(tokens)` gives logits, `forward(tokens, targets)` the loss."""

    enable_weight_tying = False

    def __init__(self, cfg: MoEConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        with torch.device("meta"):  # built without drawing numbers; init_weights fills it
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.pos_embeddings = nn.Parameter(torch.empty(cfg.block_size, cfg.dim))
            self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, n)
                                         for i, n in enumerate(cfg.layer_experts)})
            self.norm = nn.RMSNorm(cfg.dim)
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.to_empty(device="cpu")
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """The same weights for the same seed, whatever the global random state: norms at one,
        every other parameter N(0, 0.02), drawn in parameter order from a generator of its own."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)

    def moe_layers(self) -> list[MoE]:
        return [layer.moe for layer in self.layers.values() if layer.moe_enabled]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        h = self.tok_embeddings(tokens) + self.pos_embeddings[:tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h)
        logits = self.lm_head(self.norm(h))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        if torch.is_grad_enabled() and self.moe_layers():
            loss = loss + self.cfg.aux_loss_coeff * sum(m.aux_loss for m in self.moe_layers())
        return loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
