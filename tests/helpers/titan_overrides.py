"""Config overrides for torchtitan's trainer, activated through its own `--override.imports`
(torchtitan imports this module by name once the config is parsed, so it must stay importable
on its own; the CPU shims live in tests/helpers/titan_cpu.py).

`moe_size` cuts a decoder's MoE debug config to CPU size in place: the first `n_layers` blocks,
`num_experts` routed experts per MoE block (every config field that carries the count: the MoE,
its router and router gate, the grouped experts, the token dispatcher), `top_k`, and the
experts' hidden size. torchtitan's model config exposes none of these on its command line. The
config object is mutated rather than replaced: the trainer builds the model from the object it
held before the overrides ran.

    --override.imports 'tests.helpers.titan_overrides.moe_size={"n_layers": 2, "num_experts": 2,
                                                        "top_k": 1, "hidden_dim": 256}'
"""
from __future__ import annotations

from torchtitan.config.override import override
from torchtitan.models.common.decoder import Decoder


@override(target=Decoder.Config, description="MoE debug config cut to CPU size")
def moe_size(cfg: Decoder.Config, *, n_layers: int | None = None, num_experts: int | None = None,
             top_k: int | None = None, hidden_dim: int | None = None) -> Decoder.Config:
    if n_layers is not None:
        assert 0 < n_layers <= len(cfg.layers), (n_layers, len(cfg.layers))
        cfg.layers = cfg.layers[:n_layers]
    for layer in cfg.layers:
        moe = getattr(layer, "moe", None)
        if moe is None:
            continue
        router = moe.router
        experts = moe.routed_experts.inner_experts
        dispatcher = moe.routed_experts.token_dispatcher
        if num_experts is not None:
            moe.num_experts = router.num_experts = experts.num_experts = num_experts
            router.gate.out_features = dispatcher.num_experts = num_experts
            assert router.num_expert_groups is None, "grouped routing: set the groups too"
        if top_k is not None:
            router.top_k = dispatcher.top_k = top_k
        if hidden_dim is not None:
            experts.hidden_dim = hidden_dim
        assert router.top_k <= router.num_experts, (router.top_k, router.num_experts)
    return cfg
