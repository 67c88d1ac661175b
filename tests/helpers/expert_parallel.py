"""Scripts for tests/api/test_expert_parallel.py: expert weights already split by expert parallelism
(each rank of `ep` holds experts/ep of them), sharded again by fully_shard over `efsdp` through
a per-parameter mesh, the rest of the model over every rank, as torchtitan's
apply_fsdp_to_decoder does under EP. Written once against torch's FSDP2 API and run with either
implementation (`fsdp`: torch.distributed.fsdp or fsdp_ext), in torchtitan's two spellings:

    "dtensor"     the experts are DTensors Shard(0) on `ep`; their mesh-info is
                  FSDPMeshInfo(efsdp mesh) (torchtitan's partial_dtensor backend)
    "spmd_types"  the experts are plain tensors annotated R on `efsdp` and S(0) on `ep`; their
                  mesh-info names the axes of the (efsdp, ep) mesh with dp_mesh_dims
                  (torchtitan's default spmd_types backend)
    "storage"     the experts are DTensors (Replicate(), Shard(0)) on the (efsdp, ep) mesh, with
                  that mesh-info (torchtitan's full_dtensor backend)
    "replicated"  every expert whole on every rank, annotated R on `ep` too (as that backend
                  annotates a tensor-parallel model's norms): each ep rank's gradient is a part,
                  summed over ep

There is no token dispatch: every token goes through each of the rank's own experts, so ranks of
one `ep` group compute with different experts; what is compared is the two implementations on
the same script."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .placements import trained

EXPERTS, DIM, HIDDEN = 4, 8, 16


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.2)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = _local(self.w1), _local(self.w2)
        return sum(F.silu(x @ w1[e]) @ w2[e] for e in range(w1.shape[0]))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts(self.proj(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


_MESHES: dict[int, tuple] = {}


def meshes(world: int):
    """(every rank's 1-D mesh, the (efsdp, ep) mesh: ep the fast axis, 2 ranks), made once per
    process as a trainer makes them (torch's fully_shard holds an annotated parameter's storage
    mesh to the one object its mesh-info names)."""
    if world not in _MESHES:
        _MESHES[world] = (init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)),
                          init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("efsdp", "ep")))
    return _MESHES[world]


def split_experts(model: Model, sparse, spelling: str) -> set:
    """Keep this rank's experts of each weight (its `ep` coordinate's block of rows), as a
    DTensor on `ep` or as a plain tensor annotated for spmd_types; returns the new parameters."""
    ep = sparse["ep"]
    rank, size = ep.get_local_rank(), ep.size()
    new = set()
    for block in model.blocks:
        for name in ("w1", "w2"):
            full = getattr(block.experts, name).detach()
            mine = full.chunk(size)[rank].clone()
            if spelling == "replicated":
                import spmd_types as spmd
                param = nn.Parameter(full.clone())
                spmd.assert_type(param, {spmd.MeshAxis.of(sparse.get_group("efsdp")): spmd.R,
                                         spmd.MeshAxis.of(sparse.get_group("ep")): spmd.R})
            elif spelling == "dtensor":
                param = nn.Parameter(DTensor.from_local(mine, ep, [Shard(0)], run_check=False))
            elif spelling == "storage":
                param = nn.Parameter(DTensor.from_local(mine, sparse, [Replicate(), Shard(0)],
                                                        run_check=False))
            else:
                import spmd_types as spmd
                param = nn.Parameter(mine)
                spmd.assert_type(param, {spmd.MeshAxis.of(sparse.get_group("efsdp")): spmd.R,
                                         spmd.MeshAxis.of(sparse.get_group("ep")): spmd.S(0)})
            setattr(block.experts, name, param)
            new.add(param)
    return new


def expert_mesh_info(sparse, spelling: str):
    """The experts' mesh-info, as torchtitan builds it for each spelling."""
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    if spelling == "dtensor":
        return FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0)
    # (the others: the storage mesh's axes named, as torchtitan's SPMD backends pass them)
    return _get_mesh_info(sparse, DataParallelMeshDims(shard="efsdp"))


def shard(fsdp, model: Model, world: int, spelling: str, dim: int) -> Model:
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    dense, sparse = meshes(world)
    experts = split_experts(model, sparse, spelling)
    info = expert_mesh_info(sparse, spelling)

    def placement_fn(param):
        return ShardPlacementResult(Shard(dim), info) if param in experts else None

    for block in model.blocks:
        fsdp.fully_shard(block, mesh=dense, shard_placement_fn=placement_fn)
    return fsdp.fully_shard(model, mesh=dense)


def train(fsdp, rank: int, world: int, spelling: str, dim: int = 0, steps: int = 3) -> dict:
    """Losses (summed over ranks), the gradients after the last backward, the trained parameters
    (full DTensors), their placements and local shapes."""
    torch.manual_seed(0)
    model = shard(fsdp, Model(), world, spelling, dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(6, DIM, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).square().mean()
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
    return trained(model, losses, grads)
