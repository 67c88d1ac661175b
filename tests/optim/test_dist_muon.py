"""torchtitan's DistMuon (torchtitan/distributed/flex_shard/) on fsdp_ext's fully_shard: the
optimizer torchtitan's Kimi configs train with reads the parameters' DTensor placements and
redistributes each matrix to its compute layout (`Owned`: the whole matrix to one rank;
`BlockShard(0, R)`: whole R-row blocks, one attention head each), so it runs on any FSDP whose
parameters are torch's Shard(0) DTensors. Run on CPU ranks through tests/helpers/dist_muon_cpu.py
(its streams and CUDA check answered; its math and collectives untouched):

- fsdp_ext and torch's FSDP2 on the same script give the same losses and parameters bit for bit;
- fsdp_ext's own Muon on the same split (qkv per head with `block_rows`, the other matrices
  each to one owner) gives DistMuon's parameters bit for bit, with its heads orthogonalised one
  by one and batched by shape across the layers (`batch_same_shape`: DistMuon batches each
  parameter's blocks, in the same batched kernels);
- DistMuon's state saved with DCP from fsdp_ext's model loads into torch's FSDP2 model and the
  two continue bit for bit.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp_ext
from examples.models import GPT, GPTConfig

from ..helpers import dist_muon_cpu
from ..helpers.dist import run_distributed
from . import test_muon

pytest.importorskip("torchtitan.distributed.flex_shard")
EXACT = dict(atol=0, rtol=0)
HEAD_DIM = 8


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, d_model=16))


def _is_matrix(name: str, param) -> bool:
    return param.ndim == 2 and name.startswith("blocks.")


def _dist_muon(model, mesh):
    """DistMuon on the blocks' matrices (qkv per head, the rest whole), AdamW on the rest, as
    torchtitan's Kimi configs split them."""
    from torchtitan.distributed.flex_shard import BlockShard, BucketConfig, ComputeLayout, Owned
    from torchtitan.distributed.flex_shard import build_dist_muon
    matrices = [(n, p) for n, p in model.named_parameters() if _is_matrix(n, p)]
    layouts = {n: ComputeLayout({"dp_shard": BlockShard(0, HEAD_DIM) if ".qkv." in n
                                 else Owned()}) for n, _ in matrices}
    muon = build_dist_muon([{"params": [p for _, p in matrices],
                             "param_names": [n for n, _ in matrices]}],
                           compute_sharding_by_fqn=layouts,
                           bucket_configs=[BucketConfig(("blocks.0.*",), name="block 0"),
                                           BucketConfig(("blocks.1.*",), name="block 1")],
                           lr=0.02, adjust_lr_fn="match_rms_adamw")
    others = [p for n, p in model.named_parameters() if not _is_matrix(n, p)]
    return [muon, torch.optim.AdamW(others, lr=1e-3)]


def _fsdp_ext_muon(model, mesh, batch_heads: bool = False):
    """fsdp_ext's Muon on the same split: qkv per head (block_rows), the rest whole."""
    matrices = [(n, p) for n, p in model.named_parameters() if _is_matrix(n, p)]
    heads = [(n, p) for n, p in matrices if ".qkv." in n]
    whole = [(n, p) for n, p in matrices if ".qkv." not in n]
    others = [p for n, p in model.named_parameters() if not _is_matrix(n, p)]
    return [fsdp_ext.optim.Muon([{"params": heads, "block_rows": HEAD_DIM,
                                  "batch_same_shape": batch_heads}, {"params": whole}],
                                lr=0.02, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(others, lr=1e-3)]


def _built(shard, make_optimizers, mesh):
    model = _gpt()
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model, make_optimizers(model, mesh)


def _steps(model, optimizers, rank: int, world: int, steps) -> list[torch.Tensor]:
    return test_muon._steps(model, optimizers, rank, world, steps, rows=8)


def check_against_torch_fsdp2(rank, world, mesh):
    ours, our_opts = _built(fsdp_ext.fully_shard, _dist_muon, mesh)
    theirs, their_opts = _built(torch_fully_shard, _dist_muon, mesh)
    torch.testing.assert_close(torch.stack(_steps(ours, our_opts, rank, world, range(4))),
                               torch.stack(_steps(theirs, their_opts, rank, world, range(4))),
                               **EXACT)
    for name, value in test_muon._full_params(theirs).items():
        torch.testing.assert_close(test_muon._full_params(ours)[name], value, **EXACT, msg=lambda m: f"{name}: {m}")


def check_against_fsdp_ext_muon(rank, world, mesh):
    dist_muon, dist_opts = _built(fsdp_ext.fully_shard, _dist_muon, mesh)
    _steps(dist_muon, dist_opts, rank, world, range(3))
    theirs = test_muon._full_params(dist_muon)
    for batch_heads in (False, True):
        own, own_opts = _built(fsdp_ext.fully_shard,
                               lambda m, mesh: _fsdp_ext_muon(m, mesh, batch_heads), mesh)
        _steps(own, own_opts, rank, world, range(3))
        mine = test_muon._full_params(own)
        for name, value in theirs.items():
            torch.testing.assert_close(mine[name], value, **EXACT,
                                       msg=lambda m: f"{name} (batched: {batch_heads}): {m}")


def check_checkpoint_into_torch_fsdp2(rank, world, mesh, directory):
    test_muon.dcp_into_torch_fsdp2(lambda shard: _built(shard, _dist_muon, mesh), rank, world,
                                   directory, rows=8)


def _worker(rank, world, directory):
    dist_muon_cpu.apply()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    check_against_torch_fsdp2(rank, world, mesh)
    check_against_fsdp_ext_muon(rank, world, mesh)
    if directory is not None:
        check_checkpoint_into_torch_fsdp2(rank, world, mesh, directory)


def test_dist_muon_on_fsdp_ext_at_world_2(tmp_path):
    run_distributed(_worker, 2, str(tmp_path / "dcp"), timeout_s=240)


@pytest.mark.slow
def test_dist_muon_on_fsdp_ext_at_world_4():
    run_distributed(_worker, 4, None, timeout_s=300)
