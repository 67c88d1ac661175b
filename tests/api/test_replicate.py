"""`fsdp_ext.replicate` against torch 2.14's `replicate` (torch.distributed._composable.
replicate_with_fsdp: FSDP2-based DDP) on the same script at world 2: per-step losses, the
gradients every rank holds after each synchronised step, trained parameters, the state dict
(keys, DTensor meshes and placements, values), gradient accumulation with
`set_requires_gradient_sync(False)`, and the module classes torch's code tests for."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy

import fsdp_ext

from ..helpers.dist import run_checks, run_distributed

EXACT = dict(atol=0, rtol=0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 4))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _mesh(world: int):
    return init_device_mesh("cpu", (world,), mesh_dim_names=("replicate",))


def _train(replicate, rank: int, mesh, steps: int = 4, **options):
    """Blocks replicated bottom-up over `mesh`, then the root (with `options`); every other step
    accumulates without a gradient sync (set_requires_gradient_sync(False)) and the next one
    syncs and steps."""
    model = _model()
    if options.get("ignored_params") == "last bias":
        options["ignored_params"] = {model[4].bias}
    for index in (0, 2):
        replicate(model[index], mesh=mesh, **options)
    replicate(model, mesh=mesh, **options)
    classes = (isinstance(model, ReplicateModule), isinstance(model, FSDPModule),
               isinstance(model[0], nn.Linear), type(model).__name__)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        sync = step % 2 == 1
        model.set_requires_gradient_sync(sync)
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        if sync:
            grads.append({n: _full(p.grad).clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
    state = {k: (tuple(getattr(v, "device_mesh", mesh).mesh_dim_names),
                 tuple(getattr(v, "placements", ())), _full(v).clone())
             for k, v in model.state_dict().items()}
    return losses, grads, state, classes


def check_against_torch(rank, world):
    """replicate(module, mesh=<1-D mesh>) on each block, then on the root: every module joins
    fsdp_ext's ReplicateModule, which is torch's ReplicateModule and FSDPModule too."""
    ours = _compare(rank, world, _mesh(world))
    assert ours[3] == (True, True, True, "ReplicateSequential"), ours[3]


def check_options_against_torch(rank, world, pin_memory: bool = False):
    """mp_policy (bf16 parameters, fp32 reduction), offload_policy (CPU; `pin_memory` for
    fsdp_ext: the stream-order scenario's, torch's host copies stay pageable, which pinning does
    not change the numbers of) and ignored_params (the last bias: neither replicated nor
    reduced, a plain tensor in the state dict)."""
    _compare(rank, world, _mesh(world),
             mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                            reduce_dtype=torch.float32),
             offload_policy=CPUOffloadPolicy(pin_memory=False),
             ours={"offload_policy": CPUOffloadPolicy(pin_memory=pin_memory)})
    _compare(rank, world, _mesh(world), ignored_params="last bias")


def _compare(rank, world, mesh, ours=None, **options):
    """Both implementations' _train (`ours`: options fsdp_ext's run takes instead): equal bit
    for bit; returns fsdp_ext's."""
    ours = _train(fsdp_ext.replicate, rank, mesh, **{**options, **(ours or {})})
    theirs = _train(torch_replicate, rank, mesh, **options)
    torch.testing.assert_close(ours[0], theirs[0], **EXACT, msg=lambda m: f"losses: {m}")
    assert len(ours[1]) == len(theirs[1]) == 2
    for step, (mine, torchs) in enumerate(zip(ours[1], theirs[1])):
        assert list(mine) == list(torchs)
        for name in torchs:
            torch.testing.assert_close(mine[name], torchs[name], **EXACT,
                                       msg=lambda m: f"step {step} gradient of {name}: {m}")
    assert list(ours[2]) == list(theirs[2])
    for key, (names, placements, value) in theirs[2].items():
        assert ours[2][key][:2] == (names, placements), (key, ours[2][key][:2], names, placements)
        torch.testing.assert_close(ours[2][key][2], value, **EXACT, msg=lambda m: f"{key}: {m}")
    assert ours[3][:3] == theirs[3][:3] == (True, True, True), (ours[3], theirs[3])
    # the gradients were averaged over the ranks: every rank ends with the same parameters
    value = ours[2]["0.weight"][2]
    gathered = [torch.empty_like(value) for _ in range(world)]
    dist.all_gather(gathered, value)
    torch.testing.assert_close(gathered[0], gathered[1], **EXACT)
    return ours


def check_dp_mesh_dims_against_torch(rank, world):
    """dp_mesh_dims naming a replicate axis of an SPMD mesh (plain parameters annotated as
    torchtitan's spmd_types backend leaves them): tests/api/test_dp_mesh_dims.py's script."""
    from types import SimpleNamespace

    from .test_dp_mesh_dims import _run
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_replicate",))
    dims = torch.distributed.fsdp.DataParallelMeshDims(replicate="dp_replicate")
    runs = [_run(SimpleNamespace(fully_shard=lambda m, **kw: replicate(m, **kw)), mesh, dims,
                 rank) for replicate in (fsdp_ext.replicate, torch_replicate)]
    (l_o, p_o, s_o, *_), (l_t, p_t, s_t, *_) = runs
    assert l_o == l_t, (l_o, l_t)
    assert {n: str(v) for n, v in s_o.items()} == {n: str(v) for n, v in s_t.items()}
    for name, value in p_t.items():
        torch.testing.assert_close(p_o[name], value, **EXACT, msg=lambda m: f"{name}: {m}")


def check_bad_input(rank, world):
    """Torch's errors, at the call: a 2-D mesh, a module already managed, shard dims."""
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))
    for replicate in (torch_replicate, fsdp_ext.replicate):
        with pytest.raises(ValueError, match="replicate expects a 1D DeviceMesh"):
            replicate(nn.Linear(4, 4), mesh=mesh2)
    layer = nn.Linear(4, 4)
    fsdp_ext.fully_shard(layer)
    with pytest.raises(RuntimeError, match="already managed"):
        fsdp_ext.replicate(layer)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    with pytest.raises(ValueError, match="replicate-only"):
        fsdp_ext.replicate(nn.Linear(4, 4), mesh=mesh,
                           dp_mesh_dims=torch.distributed.fsdp.DataParallelMeshDims(
                               shard="dp_shard"))


def _worker(rank, world):
    run_checks([check_against_torch, check_options_against_torch,
                check_dp_mesh_dims_against_torch, check_bad_input], rank, world)


def test_replicate_against_torch():
    run_distributed(_worker, 2, timeout_s=180)
