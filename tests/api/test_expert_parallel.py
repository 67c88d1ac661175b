"""Expert-parallel parameters under fully_shard (runtime/placement/shard_fn.py, runtime/placement/spmd_params.py,
runtime/placement/model_parallel.py): expert weights split over `ep`, sharded again over `efsdp` through
torch 2.14's ShardPlacementResult, the rest over every rank; in torchtitan's three spellings
(DTensors on `ep` with a 1-D mesh-info; plain tensors annotated with spmd_types, and DTensors on
the (efsdp, ep) storage mesh, with a mesh-info over named axes), Shard(0) and Shard(1). Losses,
gradients, trained parameters, placements and local shapes equal torch's fully_shard on the same
script (tests/helpers/expert_parallel.py); what fsdp_ext cannot take is refused naming the
parameter. torchtitan's own trainer under EP:
tests/clients/test_torchtitan_trainer.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import fsdp_ext

from ..helpers import expert_parallel as scripts
from ..helpers.dist import run_checks, run_distributed

pytest.importorskip("spmd_types")


def _same(ours: dict, theirs: dict) -> None:
    for key in ("placements", "local_shapes"):
        assert ours[key] == theirs[key], (key, ours[key], theirs[key])
    torch.testing.assert_close(ours["losses"], theirs["losses"], atol=1e-6, rtol=1e-5)
    for key in ("grads", "params"):
        for name, value in theirs[key].items():
            torch.testing.assert_close(ours[key][name], value, atol=1e-6, rtol=1e-5,
                                       msg=lambda m: f"{key} '{name}': {m}")


STRIDED = "(_StridedShard(dim=0, sf=2), Shard(dim=0))"   # Shard(0) over efsdp of rows ep split
SHARD_1 = "(Shard(dim=1), Shard(dim=0))"


def _against_torch(rank, world, spelling: str, dim: int, expected: str) -> None:
    ours = scripts.train(fsdp_ext, rank, world, spelling, dim)
    _same(ours, scripts.train(torch_fsdp, rank, world, spelling, dim))
    assert ours["placements"]["blocks.0.experts.w1"] == expected, ours["placements"]
    assert ours["losses"][-1] < ours["losses"][0]


def check_spmd_types_shard0(rank, world):
    _against_torch(rank, world, "spmd_types", 0, STRIDED)


def check_dtensor_shard1(rank, world):
    _against_torch(rank, world, "dtensor", 1, SHARD_1)


def check_storage_shard0(rank, world):
    _against_torch(rank, world, "storage", 0, STRIDED)


def check_storage_shard1(rank, world):
    _against_torch(rank, world, "storage", 1, SHARD_1)


def check_replicated_sums_over_ep(rank, world):
    """R on ep: the whole experts on every rank, their gradients summed over ep, as torch's."""
    _against_torch(rank, world, "replicated", 1, "(Shard(dim=1), Replicate())")


def check_spmd_types_shard1(rank, world):
    _against_torch(rank, world, "spmd_types", 1, SHARD_1)


def check_dtensor_shard0(rank, world):
    _against_torch(rank, world, "dtensor", 0, STRIDED)


def check_refusals(rank, world):
    """Annotations fsdp_ext cannot take, a DTensor with a mesh-info over named axes that is not on
    their storage mesh, or not Replicate on its data-parallel axis, are refused at the call
    naming the parameter."""
    import spmd_types as spmd
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    dense, sparse = scripts.meshes(world)
    info = scripts.expert_mesh_info(sparse, "spmd_types")
    efsdp = spmd.MeshAxis.of(sparse.get_group("efsdp"))
    ep = spmd.MeshAxis.of(sparse.get_group("ep"))

    def refused(param, error, match):
        block = scripts.Block()
        block.experts.w1 = param
        with pytest.raises(error, match=match):
            fsdp_ext.fully_shard(block, mesh=dense, shard_placement_fn=lambda p: (
                ShardPlacementResult(Shard(0), info) if p is param else None))
        assert not isinstance(block, fsdp_ext.FSDPModule)

    partial = nn.Parameter(torch.zeros(2, scripts.DIM, scripts.HIDDEN))
    spmd.assert_type(partial, {efsdp: spmd.R, ep: spmd.P})
    refused(partial, NotImplementedError, r"'experts.w1': annotated P on the model-parallel "
                                          r"axis 'ep'")
    unannotated = nn.Parameter(torch.zeros(2, scripts.DIM, scripts.HIDDEN))
    refused(unannotated, ValueError, r"'experts.w1': no spmd_types annotation on the storage "
                                     r"mesh's axis 'ep'")
    on_ep = nn.Parameter(DTensor.from_local(torch.zeros(2, scripts.DIM, scripts.HIDDEN),
                                            sparse["ep"], [Shard(0)], run_check=False))
    refused(on_ep, ValueError, r"'experts.w1': a DTensor on DeviceMesh\(\(ep=2\).*not on the "
                               r"storage mesh")
    sharded = nn.Parameter(DTensor.from_local(torch.zeros(2, scripts.DIM, scripts.HIDDEN),
                                              sparse, [Shard(1), Shard(0)], run_check=False))
    refused(sharded, ValueError, r"'experts.w1': S\(1\) on the data-parallel axis "
                                 r"'efsdp'; fully_shard takes Replicate\(\) there")


def _world(rank, world, checks):
    run_checks(checks, rank, world)


def test_expert_parallel_matches_torch_world_2():
    """efsdp of one rank, ep of two."""
    run_distributed(_world, 2, [check_spmd_types_shard0, check_dtensor_shard1,
                                 check_storage_shard1, check_replicated_sums_over_ep,
                                 check_refusals])


@pytest.mark.slow
def test_expert_parallel_matches_torch_world_4():
    """(efsdp 2, ep 2), both spellings, both placements."""
    run_distributed(_world, 4, [check_spmd_types_shard0, check_dtensor_shard1,
                                 check_storage_shard0, check_storage_shard1,
                                 check_spmd_types_shard1, check_dtensor_shard0])
