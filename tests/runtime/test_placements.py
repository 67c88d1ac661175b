"""shard_placement_fn's Shard(dim) placements (runtime/placement/shard_fn.py, runtime/bucket/layout.py), run with
torch's fully_shard and fsdp_ext's on the same script (tests/helpers/placements.py): expert
weights `[experts, in, out]` sharded along dim 1 (torchtitan's choice when experts < FSDP degree)
and along the last dim, beside Shard(0) parameters of the same unit. Losses, gradients, trained
parameters, placements and local shapes equal torch's; mixed precision, CPU offload,
clip_grad_norm_, reshard_after_forward=k and state dicts both ways; uneven sizes (which torch
refuses for dim > 0) against the unwrapped model; experts on a mesh of their own (torch 2.14's
ShardPlacementResult with FSDPMeshInfo or HSDPMeshInfo, and fsdp_ext's MeshPlacement), with CPU
offload and reshard_after_forward=k too; bad placements refused naming the parameter."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

import fsdp_ext

from ..helpers import placements as scripts
from ..helpers.dist import run_checks, run_distributed

FP32 = dict(atol=1e-6, rtol=1e-5)


def _same(what, ours, theirs, **tol):
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), (what, list(ours), list(theirs))
        for name, value in theirs.items():
            _same(f"{what} '{name}'", ours[name], value, **tol)
    elif isinstance(theirs, (list, tuple)) and not isinstance(theirs, torch.Size):
        assert len(ours) == len(theirs), (what, len(ours), len(theirs))
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same(f"{what}[{i}]", a, b, **tol)
    elif isinstance(theirs, torch.Tensor):
        torch.testing.assert_close(ours, theirs, **(tol or FP32), msg=lambda m: f"{what}: {m}")
    else:
        assert ours == theirs, (what, ours, theirs)


def _against_torch(what, rank, world, **kwargs):
    _same(what, scripts.train(fsdp_ext, rank, world, **kwargs),
          scripts.train(torch_fsdp, rank, world, **kwargs))


def check_dim_1(rank, world):
    """shard_placement_fn returning Shard(1) for the expert weights (helpers/placements.py train's
    default), Shard(0) for the rest."""
    _against_torch("Shard(1) experts", rank, world, placement_fn=scripts.experts_on(1))


def check_one_expert_dim_1(rank, world):
    """One expert ([1, in, out], as an expert-parallel rank holds when the experts are as many as
    the EP ranks) Shard(1): the only dim before the shard dim has size 1, so each rank's part is
    one range of the flattened weight, starting at its first row along dim 1."""
    _against_torch("one expert Shard(1)", rank, world, sizes=dict(experts=1))


def check_last_dim_and_clip(rank, world):
    _against_torch("Shard(-1) experts, clipped", rank, world, placement_fn=scripts.experts_on(-1),
                   clip=0.05)


def check_mixed_precision(rank, world):
    mp = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _against_torch("Shard(1) experts, bf16 compute", rank, world, mp_policy=mp)


def check_offload(rank, world):
    _against_torch("Shard(1) experts, CPU offload", rank, world,
                   offload_policy=torch_fsdp.CPUOffloadPolicy(pin_memory=False))


def check_state_dicts_both_ways(rank, world):
    fn = scripts.experts_on(1)
    got = scripts.state_dict_roundtrip(fsdp_ext, torch_fsdp, rank, world, fn)
    expected = {k: v for k, v in scripts.build(seed=2).state_dict().items()}
    _same("torch's state dict loaded by fsdp_ext", got["into_ours"], expected)
    expected = {k: v for k, v in scripts.build(seed=4).state_dict().items()}
    _same("fsdp_ext's state dict loaded by torch", got["into_theirs"], expected)


def check_uneven_against_the_unwrapped_model(rank, world):
    """6 rows over 4 ranks along dim 1 (2, 2, 2, 0): torch's fully_shard refuses uneven sharding
    on dim > 0; fsdp_ext pads the chunks as along dim 0."""
    sizes = dict(dim=6)
    ours = scripts.train(fsdp_ext, rank, world, sizes=sizes)
    _same("uneven Shard(1) vs unwrapped", ours["params"], scripts.unwrapped(world, **sizes),
          atol=1e-5, rtol=1e-4)


def check_reshard_after_forward_k(rank, world):
    """reshard_after_forward=2 (backward regathers from 2 ranks' post-forward chunks, each a
    rank-major block of outer blocks): against the unwrapped model, since torch 2.14's fully_shard
    fails on this script (an IndexError in its post-forward mesh sizes for Shard(1))."""
    ours = scripts.train(fsdp_ext, rank, world, reshard_after_forward=2)
    _same("Shard(1) experts, reshard_after_forward=2 vs unwrapped", ours["params"],
          scripts.unwrapped(world), atol=1e-5, rtol=1e-4)


def check_bad_placements(rank, world):
    model = scripts.build()
    block = model.blocks[0]
    with pytest.raises(ValueError, match=r"parameter 'experts.w1'.*Shard\(3\), out of range"):
        fsdp_ext.fully_shard(block, shard_placement_fn=scripts.experts_on(3))
    with pytest.raises(NotImplementedError, match=r"parameter 'experts.w1'.*_StridedShard"):
        fsdp_ext.fully_shard(block, shard_placement_fn=lambda p: _StridedShard(1, split_factor=2)
                             if p.dim() == 3 else None)
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    with pytest.raises(TypeError, match=r"'experts.w1'.*ShardPlacementResult whose mesh_info is "
                                        r"a NoneType"):
        fsdp_ext.fully_shard(block, shard_placement_fn=lambda p: ShardPlacementResult(Shard(1), None)
                             if p.dim() == 3 else None)
    assert not isinstance(block, fsdp_ext.FSDPModule)  # refused before anything changed


def check_state_paths(rank, world, directory):
    """fsdp_ext's own state paths on Shard(1) experts: full_state_dict, load_full_state_dict,
    summon_full_params with writeback, export_safetensors + load_pretrained (each rank writes one
    range per expert), DCP checkpoints saved by one implementation and loaded by the other."""
    import torch.distributed.checkpoint as dcp
    fn = scripts.experts_on(1)
    reference = scripts.build(seed=5).state_dict()
    model = scripts.shard(fsdp_ext, scripts.build(seed=6), fn)
    fsdp_ext.load_full_state_dict(model, reference)
    _same("full_state_dict after load_full_state_dict", fsdp_ext.full_state_dict(model), reference)
    with fsdp_ext.summon_full_params(model), torch.no_grad():
        model.blocks[1].experts.w2.mul_(2.0)
    reference["blocks.1.experts.w2"] = reference["blocks.1.experts.w2"] * 2.0
    _same("summon_full_params writeback", fsdp_ext.full_state_dict(model), reference)
    path = f"{directory}/model.safetensors"
    fsdp_ext.export_safetensors(model, path)
    other = scripts.shard(fsdp_ext, scripts.build(seed=7), fn)
    fsdp_ext.load_pretrained(other, path)
    _same("export_safetensors + load_pretrained", fsdp_ext.full_state_dict(other), reference)
    dcp.save(model.state_dict(), checkpoint_id=f"{directory}/dcp")
    theirs = scripts.shard(torch_fsdp, scripts.build(seed=8), fn)
    state = theirs.state_dict()
    dcp.load(state, checkpoint_id=f"{directory}/dcp")
    theirs.load_state_dict(state)
    _same("DCP saved by fsdp_ext, loaded by torch",
          {k: v.full_tensor() for k, v in theirs.state_dict().items()}, reference)
    with torch.no_grad():
        theirs.blocks[0].experts.w1.mul_(3.0)
    reference["blocks.0.experts.w1"] = reference["blocks.0.experts.w1"] * 3.0
    dcp.save(theirs.state_dict(), checkpoint_id=f"{directory}/dcp_torch")
    state = model.state_dict()
    dcp.load(state, checkpoint_id=f"{directory}/dcp_torch")
    model.load_state_dict(state)
    _same("DCP saved by torch, loaded by fsdp_ext", fsdp_ext.full_state_dict(model), reference)


def _expert_meshes(world):
    """The unit's mesh (every rank) and an (ep, efsdp) split of it: experts sharded over efsdp,
    replicated across ep (expert parallelism's layout, here without token dispatch: each ep
    group's experts train on its own ranks' data, as torch's fully_shard trains them)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    split = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "efsdp"))
    return mesh, split


def check_own_meshes(rank, world):
    """torch 2.14's ShardPlacementResult: experts Shard(1) over the efsdp mesh (FSDPMeshInfo),
    the rest over the unit's; fsdp_ext's MeshPlacement spelling gives the same; with
    HSDPMeshInfo (2-D replicate x shard) for the experts too."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (FSDPMeshInfo, HSDPMeshInfo,
                                                                  ShardPlacementResult)
    mesh, split = _expert_meshes(world)
    efsdp = FSDPMeshInfo(split["efsdp"], shard_mesh_dim=0)

    def torch_fn(p):
        return ShardPlacementResult(Shard(1), efsdp) if p.dim() == 3 else None
    theirs = scripts.train(torch_fsdp, rank, world, placement_fn=torch_fn, mesh=mesh)
    _same("experts on their own mesh", scripts.train(fsdp_ext, rank, world,
                                                      placement_fn=torch_fn, mesh=mesh), theirs)
    ours = scripts.train(fsdp_ext, rank, world, mesh=mesh, placement_fn=lambda p: (
        fsdp_ext.MeshPlacement(Shard(1), split["efsdp"]) if p.dim() == 3 else None))
    _same("MeshPlacement", ours, theirs)
    hsdp = HSDPMeshInfo(split, shard_mesh_dim=1, replicate_mesh_dim=0)

    def hybrid_fn(p):
        return ShardPlacementResult(Shard(1), hsdp) if p.dim() == 3 else None
    _against_torch("experts on a 2-D (replicate, shard) mesh of their own", rank, world,
                   placement_fn=hybrid_fn, mesh=mesh)


def check_own_mesh_refusals(rank, world):
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, ShardPlacementResult
    mesh, split = _expert_meshes(world)
    block = scripts.build().blocks[0]
    ddp = DDPMeshInfo(split["efsdp"], replicate_mesh_dim=0)
    with pytest.raises(TypeError, match=r"'experts.w1'.*mesh_info is a DDPMeshInfo"):
        fsdp_ext.fully_shard(block, mesh=mesh, shard_placement_fn=lambda p: (
            ShardPlacementResult(Shard(0), ddp) if p.dim() == 3 else None))
    assert not isinstance(block, fsdp_ext.FSDPModule)


def check_own_mesh_offload(rank, world, pin_memory: bool = False):
    """CPU offload with experts on a mesh of their own: their host shards gathered in the
    unit's second all-gather (`pin_memory` for fsdp_ext: the stream-order scenario's; torch's
    host shards stay pageable, which pinning does not change the numbers of)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    mesh, split = _expert_meshes(world)
    efsdp = FSDPMeshInfo(split["efsdp"], shard_mesh_dim=0)

    def placement_fn(p):
        return ShardPlacementResult(Shard(1), efsdp) if p.dim() == 3 else None
    _same("experts on their own mesh, CPU offload",
          scripts.train(fsdp_ext, rank, world, mesh=mesh, placement_fn=placement_fn,
                        offload_policy=fsdp_ext.CPUOffloadPolicy(pin_memory=pin_memory)),
          scripts.train(torch_fsdp, rank, world, mesh=mesh, placement_fn=placement_fn,
                        offload_policy=torch_fsdp.CPUOffloadPolicy(pin_memory=False)))


def check_own_mesh_reshard_after_forward_k(rank, world):
    """reshard_after_forward=2 applied per mesh, as torch applies it: on the efsdp mesh of 2
    ranks every rank keeps its own shard after forward; on a 4-rank mesh of another order, the
    chunks of its own post-forward pairs. The efsdp case against torch's fully_shard on the same
    meshes (with reshard_after_forward=2 for Shard(0); torch 2.14 fails Shard(1) with an int, see
    check_reshard_after_forward_k, so there with True); the reordered one, which torch refuses,
    against the unwrapped model."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    mesh, split = _expert_meshes(world)
    efsdp = FSDPMeshInfo(split["efsdp"], shard_mesh_dim=0)
    reordered = DeviceMesh("cpu", torch.tensor([0, 2, 1, 3]))
    unwrapped = scripts.unwrapped(world)
    for dim in (0, 1):
        ours = scripts.train(fsdp_ext, rank, world, mesh=mesh, reshard_after_forward=2,
                             placement_fn=lambda p: ShardPlacementResult(Shard(dim), efsdp)
                             if p.dim() == 3 else None)
        # torch 2.14 applies an int only where its post-forward mesh sizes work (Shard(0)); for
        # Shard(1) its reshard_after_forward=True is the reference: the policy decides when a
        # unit is regathered, not the values it computes.
        k = 2 if dim == 0 else True
        _same(f"efsdp mesh, Shard({dim}), reshard_after_forward=2 vs torch's "
              f"reshard_after_forward={k}", ours, scripts.train(
                  torch_fsdp, rank, world, mesh=mesh, reshard_after_forward=k,
                  placement_fn=lambda p: ShardPlacementResult(Shard(dim), efsdp)
                  if p.dim() == 3 else None))
        # torch refuses a second mesh-info over the default group's ranks (its reordered mesh
        # shares that group): the unwrapped model is the reference.
        ours = scripts.train(fsdp_ext, rank, world, mesh=mesh, reshard_after_forward=2,
                             placement_fn=lambda p: fsdp_ext.MeshPlacement(Shard(dim), reordered)
                             if p.dim() == 3 else None)
        _same(f"reordered mesh, Shard({dim}), reshard_after_forward=2 vs unwrapped",
              ours["params"], unwrapped, atol=1e-5, rtol=1e-4)
    # k equal to the unit's shard size (4) is the same as True for the unit, and must still
    # divide the experts' own 2-rank mesh: refused, as torch refuses it
    with pytest.raises(ValueError, match=r"'experts.w1' is sharded over a mesh of its own with 2 "
                                         r"shard ranks, which reshard_after_forward=4 does not"):
        fsdp_ext.fully_shard(scripts.build().blocks[0], mesh=mesh, reshard_after_forward=4,
                             shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), efsdp)
                             if p.dim() == 3 else None)
    from torch.distributed.device_mesh import init_device_mesh
    alone = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "efsdp"))["efsdp"]
    block = scripts.build().blocks[0]
    with pytest.raises(ValueError, match=r"'experts.w1' is sharded over a mesh of its own with 1 "
                                         r"shard ranks, which reshard_after_forward=2 does not"):
        fsdp_ext.fully_shard(block, mesh=mesh, reshard_after_forward=2, shard_placement_fn=(
            lambda p: fsdp_ext.MeshPlacement(None, alone) if p.dim() == 3 else None))


def _world_2(rank, world, directory):
    def check_state_paths_here(rank, world):
        check_state_paths(rank, world, directory)
    run_checks([check_dim_1, check_one_expert_dim_1, check_last_dim_and_clip,
                check_state_dicts_both_ways, check_state_paths_here, check_bad_placements,
                check_own_meshes, check_own_mesh_refusals, check_own_mesh_offload], rank, world)


def _world_4(rank, world):
    run_checks([check_dim_1, check_last_dim_and_clip, check_mixed_precision, check_offload,
                check_state_dicts_both_ways, check_uneven_against_the_unwrapped_model,
                check_reshard_after_forward_k, check_own_meshes, check_own_mesh_offload,
                check_own_mesh_reshard_after_forward_k], rank, world)


def test_rows_layout_range_along_a_later_dim_after_size_one_dims():
    """param_range of a [1, 4, 3] weight Shard(1) over 2 ranks: rank 1 holds rows 2-3 of dim 1,
    flattened elements [6, 12) (it once took the row count from dim 0: [3, 9))."""
    from fsdp_ext.runtime.bucket.layout import rows_layout
    layout = rows_layout([(1, 4, 3)], world_size=2, rank=1, direct_min_numel=1, dims=[1])
    assert layout.contiguous(0)
    assert [layout.param_range(0, r) for r in (0, 1)] == [(0, 6), (6, 12)]


def test_shard_dim_placements_match_torch_world_2(tmp_path):
    run_distributed(_world_2, 2, str(tmp_path))


@pytest.mark.slow
def test_shard_dim_placements_match_torch_world_4():
    run_distributed(_world_4, 4, timeout_s=300)
