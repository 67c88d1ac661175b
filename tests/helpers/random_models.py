"""Random module trees for the property-based parity test, described by JSON-able specs.

A spec is drawn by hypothesis in the test process and rebuilt in every rank. Each node is a module
with a Linear (`own`, possibly frozen, with or without bias), optionally a bf16 gain (so one unit
holds fp32 and bf16 buckets), optionally a tied pair of Linears (two attributes, one Parameter),
and nested child nodes applied in sequence; `shard` says whether the node becomes its own unit.
Widths include primes and 1, so buckets get padding and some ranks get empty shards.
"""
from __future__ import annotations

import torch
from hypothesis import strategies as st
from torch import nn

WIDTHS = (1, 2, 3, 5, 7, 8, 11, 13, 16)
OUT_DIM = 3


@st.composite
def node_specs(draw, depth: int, mixed: bool) -> dict:
    return {
        "width": draw(st.sampled_from(WIDTHS)),
        "bias": draw(st.booleans()),
        "frozen": draw(st.integers(0, 3)) == 0,  # about a quarter of the Linears frozen
        "gain_bf16": mixed and draw(st.booleans()),
        "tied": draw(st.booleans()),
        "shard": draw(st.booleans()),
        "children": draw(st.lists(node_specs(depth - 1, mixed), min_size=1, max_size=3)) if depth else [],
    }


@st.composite
def model_specs(draw) -> dict:
    depth = draw(st.integers(1, 3))
    # Only some models get bf16 weights: the others are compared at fp32 tolerances.
    mixed = draw(st.integers(0, 2)) > 0
    return {"seed": draw(st.integers(0, 2**16)), "in_dim": draw(st.sampled_from(WIDTHS)),
            "root": draw(node_specs(depth, mixed))}


class RandomNode(nn.Module):
    def __init__(self, d_in: int, spec: dict):
        super().__init__()
        self.spec = spec
        width = spec["width"]
        self.own = nn.Linear(d_in, width, bias=spec["bias"])
        if spec["frozen"]:
            self.own.requires_grad_(False)
        gain = torch.linspace(0.5, 1.5, width).to(torch.bfloat16) if spec["gain_bf16"] else None
        self.register_parameter("gain", nn.Parameter(gain) if gain is not None else None)
        if spec["tied"]:
            self.tie_a = nn.Linear(width, width, bias=False)
            self.tie_b = nn.Linear(width, width, bias=False)
            self.tie_b.weight = self.tie_a.weight
        self.inner = nn.ModuleList()
        for child in spec["children"]:
            self.inner.append(RandomNode(width, child))
            width = self.inner[-1].out_width
        self.out_width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.own(x))
        if self.gain is not None:
            h = h * self.gain.float()
        if self.spec["tied"]:
            h = h + self.tie_b(torch.tanh(self.tie_a(h)))
        for child in self.inner:
            h = child(h)
        return h


class RandomModel(nn.Module):
    def __init__(self, spec: dict):
        super().__init__()
        torch.manual_seed(spec["seed"])
        self.body = RandomNode(spec["in_dim"], spec["root"])
        self.head = nn.Linear(self.body.out_width, OUT_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def shard_as_specified(model: RandomModel, **kwargs) -> RandomModel:
    """fully_shard every node whose spec says so, bottom-up, then the model (the root)."""
    import fsdp_ext
    for module in reversed(list(model.modules())):  # pre-order reversed: children first
        if isinstance(module, RandomNode) and module.spec["shard"]:
            fsdp_ext.fully_shard(module, **kwargs)
    return fsdp_ext.fully_shard(model, **kwargs)


def has_bf16(spec: dict) -> bool:
    def walk(node):
        return node["gain_bf16"] or any(walk(c) for c in node["children"])
    return walk(spec["root"])


def count_nodes(spec: dict) -> int:
    def walk(node):
        return 1 + sum(walk(c) for c in node["children"])
    return walk(spec["root"])
