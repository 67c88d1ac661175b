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

`dist_muon` gives a llama3 decoder torchtitan's Kimi optimizer recipe (DistMuon for the blocks'
matrices, AdamW for the rest), which only its Kimi configs ship:

    --override.imports 'tests.helpers.titan_overrides.dist_muon={"n_layers": 6, "head_dim": 16}'

`fsdp_ext_muon` is the same split with fsdp_ext.optim.Muon in DistMuon's place (wqkv per head
through `block_rows`, the other matrices whole), registered as torchtitan's optimizer "Muon"
(torchtitan resolves optimizer names from a fixed table: Adam, AdamW, DistMuon):

    --override.imports 'tests.helpers.titan_overrides.fsdp_ext_muon={"head_dim": 16}'
"""
from __future__ import annotations

from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
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


@override(target=OptimizersContainer.Config, description="DistMuon on the blocks' matrices")
def dist_muon(cfg: OptimizersContainer.Config, *, n_layers: int, head_dim: int,
              lr: float = 8e-4) -> OptimizersContainer.Config:
    """torchtitan's Kimi recipe on a llama3 decoder: DistMuon for each block's attention and
    feed-forward matrices (the fused wqkv per head: BlockShard(0, head_dim); wo, w1, w2, w3
    whole: Owned), one bucket per block; AdamW for embeddings, norms and the output head."""
    from torchtitan.distributed.flex_shard import BlockShard, BucketConfig, ComputeLayout, Owned

    per_head = ComputeLayout({"dp_shard": BlockShard(dim=0, block_size=head_dim)})
    owned = ComputeLayout({"dp_shard": Owned()})
    layouts = {}
    for layer in range(n_layers):
        layouts[f"layers.{layer}.attention.qkv_linear.wqkv.weight"] = per_head
        layouts[f"layers.{layer}.attention.wo.weight"] = owned
        for name in ("w1", "w2", "w3"):
            layouts[f"layers.{layer}.feed_forward.{name}.weight"] = owned
    buckets = tuple(BucketConfig(name=f"layers.{layer}", patterns=(f"layers.{layer}.*",))
                    for layer in range(n_layers))
    cfg.implementation = "foreach"  # as the Kimi configs: DistMuon refuses fused groups
    cfg.param_groups = [
        ParamGroupConfig(pattern=r"(attention\.(qkv_linear\.wqkv|wo)|feed_forward\.w[123])\.weight$",
                         optimizer_name="DistMuon",
                         optimizer_kwargs={"lr": lr, "weight_decay": 0.1, "foreach": False,
                                           "adjust_lr_fn": "match_rms_adamw"}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                         optimizer_kwargs={"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8,
                                           "weight_decay": 0.1}),
    ]
    cfg.optimizer_factory_kwargs_by_name = {
        "DistMuon": {"bucket_configs": buckets, "compute_sharding_by_fqn": layouts}}
    return cfg


@override(target=OptimizersContainer.Config, description="fsdp_ext's Muon on the blocks' matrices")
def fsdp_ext_muon(cfg: OptimizersContainer.Config, *, head_dim: int,
                  lr: float = 8e-4) -> OptimizersContainer.Config:
    """dist_muon's split and hyperparameters with fsdp_ext.optim.Muon: each block's fused wqkv
    per head (`block_rows=head_dim`, the heads batched by shape as DistMuon batches a
    parameter's blocks, so that the two round alike), wo, w1, w2, w3 whole; AdamW for the
    rest."""
    import fsdp_ext.optim

    resolve = OptimizersContainer._resolve_optimizer_factory
    if getattr(resolve, "__name__", "") != "fsdp_ext_muon_factory":
        def fsdp_ext_muon_factory(name: str):
            return fsdp_ext.optim.Muon if name == "Muon" else resolve(name)
        OptimizersContainer._resolve_optimizer_factory = staticmethod(fsdp_ext_muon_factory)
    muon = {"lr": lr, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    cfg.implementation = "foreach"  # AdamW as dist_muon runs it (the default fuses it)
    cfg.param_groups = [
        ParamGroupConfig(pattern=r"attention\.qkv_linear\.wqkv\.weight$", optimizer_name="Muon",
                         optimizer_kwargs={**muon, "block_rows": head_dim,
                                           "batch_same_shape": True}),
        ParamGroupConfig(pattern=r"(attention\.wo|feed_forward\.w[123])\.weight$",
                         optimizer_name="Muon", optimizer_kwargs=muon),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                         optimizer_kwargs={"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8,
                                           "weight_decay": 0.1}),
    ]
    return cfg


@override(target=ChunkedLossWrapper.Config, description="the whole sequence's loss at once")
def unchunked_loss(cfg: ChunkedLossWrapper.Config) -> BaseLoss.Config:
    """The chunked loss (torchtitan's default) replaced by the loss it wraps, applied to the
    whole sequence. The chunked loss runs the output head's backward inside the loss call; under
    a schedule that splits backward into input and weight passes (ZBV), torch's FSDP2 then leaves
    the final norm's gradient None (step 1's gradient norm 0.4434, against 0.4483 with this
    loss), so it is no reference there; fsdp_ext gives 0.4483 either way."""
    return cfg.loss_fn
