"""How each variant of benchmarks/step/moe_step.py shards the example MoE decoder: the calls of
torchtitan 0.3.0's apply_fsdp_to_decoder with torch's fully_shard or fsdp_ext's ("fsdp_ext",
"torch"), the routed experts forced to Shard(0) ("-shard0"), or with expert parallelism first
("-ep2": examples/moe_ep.py over the fast axis of an (efsdp, ep) mesh, the experts then sharded
over efsdp); and what the experts' all-gathers move, computed from their shapes and placement."""
from __future__ import annotations

import math

from examples.moe import MoEConfig, MoEDecoder


def variants(world: int, experts: int, ep: int) -> list[str]:
    """torchtitan's choice for both implementations; where that is Shard(1), also Shard(0);
    with expert parallelism where `ep` divides the world (with ranks to spare) and the experts."""
    names = ["fsdp_ext", "torch"]
    out = names + [f"{n}-shard0" for n in names] if world > experts else names
    if ep > 1 and world > ep and world % ep == 0 and experts % ep == 0:
        out += [f"{n}-ep{ep}" for n in names]
    return out


def ep_of(name: str) -> int:
    return int(name.rsplit("-ep", 1)[1]) if "-ep" in name else 1


def expert_dim(name: str, world: int, experts: int) -> int:
    """torchtitan's rule: Shard(1) where the ranks sharding the experts (under EP: efsdp x ep,
    the world again) outnumber them."""
    return 0 if name.endswith("-shard0") or world <= experts else 1


def shard(model: MoEDecoder, name: str, mesh):
    """apply_fsdp_to_decoder's calls, with torch's fully_shard or fsdp_ext's; under EP the
    experts get the efsdp mesh (torch's ShardPlacementResult, fsdp_ext's MeshPlacement)."""
    if name.startswith("fsdp_ext"):
        from fsdp_ext import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    world, ep = mesh.size(), ep_of(name)
    where = _expert_parallel(model, name, world, ep) if ep > 1 else (lambda placement: placement)
    fully_shard(model.tok_embeddings, mesh=mesh)
    fully_shard([model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    for block in model.layers.values():
        if not block.moe_enabled:
            fully_shard(block, mesh=mesh)
            continue
        experts = block.moe.routed_experts.inner_experts
        params = set(experts.parameters())
        dim = expert_dim(name, world, experts.num_experts)
        fully_shard(block, mesh=mesh, shard_placement_fn=lambda p, d=dim: (
            where(Shard(d)) if p in params else None))
    model = fully_shard(model, mesh=mesh)
    if ep > 1:  # an expert's gradient sums the whole world's tokens: divide by its size
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(world)
                if not name.startswith("fsdp_ext"):
                    module.set_force_sum_reduction_for_comms(True)
    return model


def _expert_parallel(model: MoEDecoder, name: str, world: int, ep: int):
    """EP over the fast axis of an (efsdp, ep) mesh; returns what puts a placement on efsdp, in
    the implementation's spelling."""
    from examples.moe_ep import apply_expert_parallel
    from torch.distributed.device_mesh import init_device_mesh
    sparse = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    apply_expert_parallel(model, sparse["ep"])
    efsdp = sparse["efsdp"]
    if name.startswith("fsdp_ext"):
        from fsdp_ext import MeshPlacement
        return lambda placement: MeshPlacement(placement, efsdp)
    from torch.distributed.fsdp._fully_shard._fsdp_common import (FSDPMeshInfo,
                                                                  ShardPlacementResult)
    info = FSDPMeshInfo(efsdp, shard_mesh_dim=0)
    return lambda placement: ShardPlacementResult(placement, info)


def expert_gather_bytes(cfg: MoEConfig, dim: int, world: int, ep: int = 1) -> int:
    """What one all-gather of one MoE block moves for its routed experts: per weight (a rank's
    E / ep experts, gathered over its world / ep expert-FSDP ranks), the ranks' chunks of the
    largest size torch.chunk makes along `dim` (the padded shard), fp32."""
    E, d, h, ranks = cfg.layer_experts[-1] // ep, cfg.dim, cfg.hidden_dim, world // ep
    total = 0
    for shape in ((E, d, h), (E, h, d), (E, d, h)):
        chunk = math.ceil(shape[dim] / ranks)
        total += ranks * chunk * math.prod(shape) // shape[dim]
    return 4 * total
