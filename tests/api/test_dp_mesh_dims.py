"""`fully_shard(mesh=<SPMD mesh>, dp_mesh_dims=...)` (torchtitan's default `spmd_types` backend
passes its dense storage mesh so) under torch's fully_shard and fsdp_ext's on the same script: the
parameters plain tensors annotated `R` on every axis, as that backend leaves them. One shard axis
(world 2); HSDP (dp_replicate=2, dp_shard=2), two shard axes flattened (dp_shard=2, cp=2) and
replicate only (world 4, slow): losses and trained parameters equal to torch's, the sharded
parameters' placements and local shapes torch's, DCP checkpoints written by either read by the
other; bad input refused at the call, naming what is wrong. The parameters as its `full_dtensor`
backend makes them, DTensors on the mesh: one shard axis (world 2), HSDP, a tensor-parallel axis,
two shard axes flattened and replicate only (world 4, slow)."""
from __future__ import annotations

import pytest
import spmd_types as spmd
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp_ext

from ..helpers import fsdp2 as scripts
from ..helpers.dist import run_checks, run_distributed

FP32 = dict(atol=1e-6, rtol=1e-5)
DIMS = torch_fsdp.DataParallelMeshDims


def _annotate(model: nn.Module, mesh) -> None:
    """What torchtitan's spmd_types backend does to a parameter it does not split: the `R` type on
    every axis of the storage mesh (torch's fully_shard reads it to build the DTensor)."""
    axes = {spmd.MeshAxis.of(mesh.get_group(name)): spmd.R for name in mesh.mesh_dim_names}
    for param in model.parameters():
        spmd.assert_type(param, axes)


def _run(fsdp, mesh, dims, rank, steps=3):
    """GPT, blocks then the root sharded over `mesh` with `dims`; AdamW; each rank's batch is its
    data-parallel coordinate's. Returns (losses, full parameters, sharded parameters' specs,
    model, optimizer)."""
    model = scripts.build()
    _annotate(model, mesh)
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fsdp.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    specs = {n: (p.placements, tuple(p.to_local().shape), p.shape)
             for n, p in model.named_parameters()}
    opt = scripts.adamw(model)
    dp_rank, dp_size = _dp_coordinate(mesh, dims)
    losses = []
    for step in range(steps):
        idx = scripts.batch(step, dp_rank, dp_size)
        loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    params = {n: scripts.full(p.detach()).clone() for n, p in model.named_parameters()}
    return losses, params, specs, model, opt


def _dp_coordinate(mesh, dims) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks and their count (other axes: the same
    batch on every rank of theirs, as tensor and context parallelism would need)."""
    names = [*dims.replicate_names, *dims.shard_names]
    index, size = 0, 1
    for name in names:
        axis_size = mesh.size(mesh.mesh_dim_names.index(name))
        index = index * axis_size + mesh.get_local_rank(name)
        size *= axis_size
    return index, size


def _compare(what, ours, theirs):
    (l_o, p_o, s_o, *_), (l_t, p_t, s_t, *_) = ours, theirs
    torch.testing.assert_close(l_o, l_t, **FP32, msg=lambda m: f"{what}: losses: {m}")
    assert list(p_o) == list(p_t), (what, list(p_o), list(p_t))
    for name, value in p_t.items():
        torch.testing.assert_close(p_o[name], value, **FP32,
                                   msg=lambda m: f"{what}: parameter '{name}': {m}")
        placements_o, local_o, shape_o = s_o[name]
        placements_t, local_t, shape_t = s_t[name]
        assert (tuple(placements_o), local_o, shape_o) == (tuple(placements_t), local_t,
                                                           shape_t), (what, name, s_o[name],
                                                                      s_t[name])


def _interchange(what, mesh, dims, rank, tmp, run=None):
    """DCP: fsdp_ext's trained state read by torch's model, and torch's by fsdp_ext's."""
    run = run or _run
    runs = {f.__name__: run(f, mesh, dims, rank) for f in (torch_fsdp, fsdp_ext)}
    _compare(what, runs["fsdp_ext"], runs["torch.distributed.fsdp"])
    for writer, reader in (("fsdp_ext", "torch.distributed.fsdp"),
                           ("torch.distributed.fsdp", "fsdp_ext")):
        path = f"{tmp}/{what.replace(' ', '_')}_{writer}"
        dcp.save({"model": runs[writer][3].state_dict()}, checkpoint_id=path)
        fresh = run(torch_fsdp if reader == "torch.distributed.fsdp" else fsdp_ext, mesh, dims,
                     rank, steps=0)[3]
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=path)
        fresh.load_state_dict(state["model"])
        for name, param in fresh.named_parameters():
            torch.testing.assert_close(scripts.full(param.detach()), runs[writer][1][name],
                                       atol=0, rtol=0,
                                       msg=lambda m: f"{what}: {writer} -> {reader} {name}: {m}")


def _tmp(rank) -> str:
    import tempfile
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    return path[0]


def check_one_shard_axis(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    _interchange("dp_shard", mesh, DIMS(shard="dp_shard"), rank, _tmp(rank))


def check_hsdp(rank, world):
    """dp_mesh_dims=DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate"): HSDP."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    _interchange("dp_replicate x dp_shard", mesh,
                 DIMS(shard="dp_shard", replicate="dp_replicate"), rank, _tmp(rank))


def check_flattened_shard_axes(rank, world):
    """DataParallelMeshDims(shard=("dp_shard", "cp")): one shard dimension of both axes."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_shard", "cp"))
    _interchange("dp_shard x cp flattened", mesh, DIMS(shard=("dp_shard", "cp")), rank,
                 _tmp(rank))


def check_replicate_only(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_replicate",))
    _interchange("replicate only", mesh, DIMS(replicate="dp_replicate"), rank, _tmp(rank))


def check_bad_input(rank, world):
    """A name not in the mesh: torch's ValueError, with the name; a plain parameter without an
    annotation on an axis that is neither shard nor replicate with several ranks, or a DTensor
    parameter on another mesh: refused naming the parameter."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for fsdp in (torch_fsdp, fsdp_ext):
        with pytest.raises(ValueError, match="'dp'"):
            fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=DIMS(shard="dp"))
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        DIMS()
    with pytest.raises(ValueError, match=r"parameter 'weight'.*no spmd_types annotation on the "
                                          r"storage mesh's axis 'tp'"):
        tp_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
        fsdp_ext.fully_shard(nn.Linear(4, 4), mesh=tp_mesh, dp_mesh_dims=DIMS(shard="dp_shard"))
    layer = nn.Linear(4, 4)
    other = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    layer.weight = nn.Parameter(torch.distributed.tensor.distribute_tensor(
        layer.weight.detach(), other, [torch.distributed.tensor.Replicate()]))
    with pytest.raises(NotImplementedError, match=r"parameter 'weight' of Linear is a DTensor on "
                                                  r"DeviceMesh\(\(tp=4\).*not DTensors on "
                                                  r"another mesh"):
        fsdp_ext.fully_shard(layer, mesh=mesh, dp_mesh_dims=DIMS(shard="dp_shard"))
    assert not isinstance(layer.bias, DTensor)  # refused before anything changed
    # DTensor parameters on shard axes apart from each other: refused, naming them.
    apart = init_device_mesh("cpu", (2, world // 2, 1), mesh_dim_names=("dp_shard", "tp", "cp"))
    layer = nn.Linear(4, 4)
    for name in ("weight", "bias"):
        setattr(layer, name, nn.Parameter(torch.distributed.tensor.distribute_tensor(
            getattr(layer, name).detach(), apart, [torch.distributed.tensor.Replicate()] * 3)))
    with pytest.raises(NotImplementedError, match=r"fully_shard\(Linear\): parameter 'weight'.*"
                                                  r"shard axes \['dp_shard', 'cp'\]"):
        fsdp_ext.fully_shard(layer, mesh=apart, dp_mesh_dims=DIMS(shard=("dp_shard", "cp")))


def _run_full_dtensor(fsdp, mesh, dims, rank, steps=3):
    """_run's training for parameters as torchtitan's full_dtensor backend makes them: DTensors
    on the storage mesh, Replicate() but on a "tp" axis, and inputs DTensors Shard(0) over the
    data-parallel axes (the loss a mean over the global batch, its gradient Partial there, which
    the reduce-scatter sums). An MLP: DTensor has no CPU attention strategy."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
                            for _ in range(2)))
    names = mesh.mesh_dim_names
    # a "tp" axis: each block's first Linear column-wise (Shard(0)), its second row-wise
    tp = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1)}
    for block in model:
        for index in (0, 2):
            for leaf in ("weight", "bias"):
                placements = [tp.get(f"{index}.{leaf}", Replicate()) if n == "tp" else Replicate()
                              for n in names]
                layer = block[index]
                setattr(layer, leaf, nn.Parameter(distribute_tensor(
                    getattr(layer, leaf).detach(), mesh, placements)))
    for block in model:
        fsdp.fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fsdp.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    specs = {n: ((p.device_mesh.mesh_dim_names, p.device_mesh.shape, *p.placements),
                 tuple(p.to_local().shape), p.shape) for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # (AdamW would hide a gradient's scale)
    losses = []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(DTensor.from_local(x, mesh, [Replicate() if n == "tp" else Shard(0)
                                                  for n in names])).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.full_tensor()))
    params = {n: scripts.full(p.detach()).clone() for n, p in model.named_parameters()}
    return losses, params, specs, model, opt


def check_full_dtensor(rank, world):
    """torchtitan's full_dtensor backend's parameters: DTensors on the storage mesh, Replicate,
    the inputs Shard(0) there: losses, parameters, placements and local shapes torch's."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    dims = DIMS(shard="dp_shard")
    _compare("full_dtensor parameters", _run_full_dtensor(fsdp_ext, mesh, dims, rank),
             _run_full_dtensor(torch_fsdp, mesh, dims, rank))


def check_full_dtensor_hsdp(rank, world):
    """The same on (dp_replicate 2, dp_shard 2): Replicate() kept on the replicate axis."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    dims = DIMS(shard="dp_shard", replicate="dp_replicate")
    _compare("full_dtensor parameters, HSDP", _run_full_dtensor(fsdp_ext, mesh, dims, rank),
             _run_full_dtensor(torch_fsdp, mesh, dims, rank))


def check_full_dtensor_tensor_parallel(rank, world):
    """The same on (dp_shard 2, tp 2), the Linear layers' DTensors split over tp too: the
    gradients' Partial on dp_shard kept for the reduce-scatter, tp's placements restored."""
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
    dims = DIMS(shard="dp_shard")
    _compare("full_dtensor parameters, TP", _run_full_dtensor(fsdp_ext, mesh, dims, rank),
             _run_full_dtensor(torch_fsdp, mesh, dims, rank))


def check_full_dtensor_flattened(rank, world):
    """The same on (dp_shard 2, cp 2), both shard axes: one flattened shard axis in the face."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_shard", "cp"))
    _interchange("full_dtensor dp_shard x cp flattened", mesh, DIMS(shard=("dp_shard", "cp")),
                 rank, _tmp(rank), run=_run_full_dtensor)


def check_full_dtensor_replicate_only(rank, world):
    """The same on dp_replicate alone: every rank holds the whole parameter, gradients summed."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_replicate",))
    _interchange("full_dtensor replicate only", mesh, DIMS(replicate="dp_replicate"), rank,
                 _tmp(rank), run=_run_full_dtensor)


def _worker2(rank, world):
    run_checks([check_one_shard_axis, check_full_dtensor], rank, world)


def _worker4(rank, world):
    run_checks([check_hsdp, check_flattened_shard_axes, check_replicate_only, check_bad_input,
                check_full_dtensor_hsdp, check_full_dtensor_tensor_parallel,
                check_full_dtensor_flattened, check_full_dtensor_replicate_only],
               rank, world)


def test_dp_mesh_dims_against_torch():
    run_distributed(_worker2, 2, timeout_s=240)


@pytest.mark.slow
def test_dp_mesh_dims_against_torch_world4():
    run_distributed(_worker4, 4, timeout_s=400)
