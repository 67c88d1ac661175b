"""Tensor-subclass parameters with FSDP2's all-gather hooks, against torch's fully_shard on the same
script: torchao's int8 weight-only and int8 mixed-precision training, float8 training with float8
all-gather and the precomputed dynamic scale, a frozen NF4 base weight under LoRA adapters, and
this suite's own two-dtype subclass (subclass_recipes.HiLo). Losses and every parameter's local
shard bit-equal to torch's, the bytes on the wire torch's (the pre-hooks' tensors, not fp32), the
deterministic recipes close to the unwrapped single-process model; evaluation, mixed precision,
reshard_after_forward=False, state dicts, a subclass without hooks, and what is refused."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ..helpers.dist import run_checks, run_distributed

pytest.importorskip("torchao")

from ..helpers import subclass_recipes as recipes  # noqa: E402  (imports torchao's recipes lazily)

STEPS = 4


class _WireCounter:
    """Bytes every all-gather moves (its output), by patching the all-gather entry points:
    torch's `all_gather_single` (what its fully_shard calls), and fsdp_ext's byte buffers (the
    subclass buckets') at `comm.issue_all_gather` (CPU: the issue thread) and
    `comm.all_gather_into` (plain buckets' float buffers: not counted, and not compared)."""

    def __init__(self):
        self.torch_bytes = self.ours_bytes = 0

    def __enter__(self):
        from fsdp_ext.runtime.comm import collectives as comm
        self._torch = dist.all_gather_single
        self._ours, self._issued = comm.all_gather_into, comm.issue_all_gather

        def torch_gather(output, input, *args, **kwargs):
            self.torch_bytes += output.numel() * output.element_size()
            return self._torch(output, input, *args, **kwargs)

        def ours_gather(output, input, *args, **kwargs):
            if output.dtype == torch.uint8:
                self.ours_bytes += output.numel()
            return self._ours(output, input, *args, **kwargs)

        def ours_issued(fulls, *args, **kwargs):
            self.ours_bytes += sum(f.numel() for f in fulls if f.dtype == torch.uint8)
            return self._issued(fulls, *args, **kwargs)
        dist.all_gather_single = torch_gather
        comm.all_gather_into, comm.issue_all_gather = ours_gather, ours_issued
        return self

    def __exit__(self, *exc):
        from fsdp_ext.runtime.comm import collectives as comm
        dist.all_gather_single = self._torch
        comm.all_gather_into, comm.issue_all_gather = self._ours, self._issued


def _run(recipe: str, fully_shard, rank: int, world: int, **kwargs):
    """Train; then count the bytes one evaluation forward gathers (every unit once, in both
    frameworks: their schedules keep different units across forward and backward)."""
    model = recipes.shard(recipes.build(recipe), fully_shard, **kwargs)
    losses = recipes.train(recipe, model, STEPS, rank, world)
    with _WireCounter() as wire, torch.no_grad():
        model(recipes.inputs(recipe, 0, rank, world)[0])
    return model, losses, wire


def _plain_bytes(model: nn.Module) -> int:
    """Bytes a full gather of the model's plain (non-subclass) parameters moves per forward."""
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if type(getattr(p, "_local_tensor", p)) is torch.Tensor)


def check_recipes_match_torch(rank: int, world: int) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_ext import fully_shard
    for recipe in recipes.RECIPES:
        theirs, their_losses, their_wire = _run(recipe, torch_fully_shard, rank, world)
        ours, our_losses, our_wire = _run(recipe, fully_shard, rank, world)
        assert our_losses == their_losses, (recipe, our_losses, their_losses)
        for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert type(p._local_tensor) is type(q._local_tensor), (recipe, name)
            assert torch.equal(recipes.plain(p), recipes.plain(q)), (recipe, name)
        # torch moves the subclasses' tensors and the plain parameters in one byte buffer per
        # unit; ours the subclasses' alone (each input 16-byte aligned in a rank's slot).
        subclass_bytes = their_wire.torch_bytes - _plain_bytes(theirs)
        inputs = sum(len(r.input_sizes) for u in _units(ours) for b in u.buckets
                     for r in getattr(b.wire, "params", ()))
        slack = world * 16 * inputs
        assert subclass_bytes <= our_wire.ours_bytes <= subclass_bytes + slack, (
            recipe, our_wire.ours_bytes, subclass_bytes)
        fp32_weight_bytes = sum(4 * p.numel() for p in ours.parameters()
                                if type(p._local_tensor) is not torch.Tensor)
        if recipe in ("int8_weight_only", "float8", "nf4_lora"):  # fewer bytes than fp32
            assert our_wire.ours_bytes < 0.4 * fp32_weight_bytes, recipe


def _units(model: nn.Module):
    from fsdp_ext.runtime.core.registry import units_of
    return units_of(model)


def check_close_to_single_process(rank: int, world: int) -> None:
    """Recipes whose numerics do not depend on the local batch: the sharded run follows the
    unwrapped model. Not int8 weight-only (its updates round stochastically, per shard) nor
    float8 (its activation scales come from each rank's own batch); torch's FSDP2 is their
    reference (check_recipes_match_torch)."""
    for recipe in ("int8_mixed_precision", "nf4_lora", "hilo"):
        recipes.check_close_to_unwrapped(recipe, rank, world, STEPS)


def check_options_match_torch(rank: int, world: int) -> None:
    """Mixed precision (bf16 parameters, fp32 reduction), no resharding after forward, and an
    evaluation forward after training: torch's results bit for bit."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_ext import fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for recipe, kwargs in (("int8_weight_only", {"mp_policy": mp}), ("hilo", {"mp_policy": mp}),
                           ("float8", {"reshard_after_forward": False}),
                           ("nf4_lora", {"reshard_after_forward": False})):
        models = []
        for fs in (torch_fully_shard, fully_shard):
            model, losses, _ = _run(recipe, fs, rank, world, **kwargs)
            with torch.no_grad():
                x, _ = recipes.inputs(recipe, 99, rank, world)
                models.append((losses, model(x)))
        (their_losses, their_eval), (our_losses, our_eval) = models
        assert our_losses == their_losses, (recipe, kwargs, our_losses, their_losses)
        assert torch.equal(our_eval, their_eval), (recipe, kwargs)


def check_state_dicts(rank: int, world: int, directory: str) -> None:
    """The sharded state dict holds DTensors over the subclass shards (torch's), full state dicts
    hold the full subclass values (torch's helpers call full_tensor(): where the subclass has
    none, both raise), and sharded and full state dicts load back into a fresh sharded model;
    fsdp_ext's checkpoints (DCP underneath) round-trip NF4 weights (whether DCP can write a
    subclass is the subclass's matter, as with torch's FSDP2: torchao's int8 weights cannot)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_ext import fully_shard, load_checkpoint, load_full_state_dict, save_checkpoint
    for recipe in ("int8_weight_only", "hilo", "nf4_lora"):
        ours, _, _ = _run(recipe, fully_shard, rank, world)
        theirs, _, _ = _run(recipe, torch_fully_shard, rank, world)
        sharded = ours.state_dict()
        for key, value in theirs.state_dict().items():
            assert type(sharded[key]) is type(value), (recipe, key)
            assert type(sharded[key]._local_tensor) is type(value._local_tensor), (recipe, key)
            assert torch.equal(recipes.plain(sharded[key]), recipes.plain(value)), (recipe, key)
        full_options = StateDictOptions(full_state_dict=True)
        try:
            their_full = get_model_state_dict(theirs, options=full_options)
        except NotImplementedError as exc:  # the subclass has no full_tensor() (torchao's int8)
            with pytest.raises(NotImplementedError, match=str(exc).split(":")[0]):
                get_model_state_dict(ours, options=full_options)
        else:
            full = get_model_state_dict(ours, options=full_options)
            for key, value in their_full.items():
                assert torch.equal(recipes.plain(full[key]), recipes.plain(value)), (recipe, key)
            fresh = recipes.shard(recipes.build(recipe, seed=3), fully_shard)
            load_full_state_dict(fresh, full)  # full tensors: each rank copies its own rows
            for (name, p), (_, q) in zip(fresh.named_parameters(), ours.named_parameters()):
                assert torch.equal(recipes.plain(p), recipes.plain(q)), (recipe, name)
        fresh = recipes.shard(recipes.build(recipe, seed=3), fully_shard)
        set_model_state_dict(fresh, get_model_state_dict(ours))
        for (name, p), (_, q) in zip(fresh.named_parameters(), ours.named_parameters()):
            assert torch.equal(recipes.plain(p), recipes.plain(q)), (recipe, name)
        x, _ = recipes.inputs(recipe, 0, rank, world)
        with torch.no_grad():
            assert torch.equal(fresh(x), ours(x)), recipe
    ours, _, _ = _run("nf4_lora", fully_shard, rank, world)
    save_checkpoint(directory, ours, None, step=STEPS)
    fresh = recipes.shard(recipes.build("nf4_lora", seed=3), fully_shard)
    assert load_checkpoint(directory, fresh)[0] == STEPS
    for (name, p), (_, q) in zip(fresh.named_parameters(), ours.named_parameters()):
        assert torch.equal(recipes.plain(p), recipes.plain(q)), name


def check_subclass_without_hooks(rank: int, world: int) -> None:
    """A subclass without the hooks is gathered as itself (its values, as torch's default
    path): the same training as torch's, the shard stays the subclass."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_ext import fully_shard
    results = []
    for fs in (torch_fully_shard, fully_shard):
        model = recipes.build("hilo")
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.weight = nn.Parameter(recipes.HiLoNoHooks.from_float(
                    recipes.plain(layer.weight)))
        recipes.shard(model, fs)
        losses = recipes.train("hilo", model, STEPS, rank, world)
        assert type(model[0].weight._local_tensor) is recipes.HiLoNoHooks
        results.append((losses, [recipes.plain(p) for p in model.parameters()]))
    (their_losses, theirs), (our_losses, ours) = results
    assert our_losses == their_losses
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def check_refused(rank: int, world: int) -> None:
    """What cannot work here is refused at the call, naming the parameter."""
    from fsdp_ext import CPUOffloadPolicy, FullyShardedDataParallel, fully_shard
    with pytest.raises(NotImplementedError, match=r"parameter '0.weight'.*FullyShardedDataParall"):
        FullyShardedDataParallel(recipes.build("hilo"), use_orig_params=True)
    with pytest.raises(NotImplementedError, match=r"parameter 'weight' of Linear.*CPU offload"):
        fully_shard(recipes.build("hilo")[0], offload_policy=CPUOffloadPolicy())
    one_hook = recipes.build("hilo")
    one_hook[0].weight = nn.Parameter(recipes.HiLoPreHookOnly.from_float(one_hook[0].weight))
    with pytest.raises(TypeError, match=r"parameter 'weight' of Linear.*only one of"):
        fully_shard(one_hook[0])


def _worker(rank: int, world: int, directory: str) -> None:
    def check_state_dicts_and_checkpoints(rank: int, world: int) -> None:
        check_state_dicts(rank, world, directory)
    run_checks([check_recipes_match_torch, check_state_dicts_and_checkpoints, check_refused],
                rank, world)


def test_subclass_parameters_train_as_with_torch_fully_shard(tmp_path):
    run_distributed(_worker, 2, str(tmp_path), timeout_s=600)


def _more_worker(rank: int, world: int) -> None:
    run_checks([check_close_to_single_process, check_options_match_torch,
                check_subclass_without_hooks], rank, world)


@pytest.mark.slow
def test_subclass_parameters_options_and_references():
    """The unwrapped model as reference, mixed precision / no resharding / evaluation against
    torch, a subclass without hooks (world 2; slow to keep the default suite in its budget)."""
    run_distributed(_more_worker, 2, timeout_s=600)


def _hsdp_worker(rank: int, world: int) -> None:
    """HSDP on a (replicate, shard) = (2, 2) mesh: torch's results bit for bit; and
    reshard_after_forward=int refused at the call."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_ext import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for recipe in ("int8_weight_only", "nf4_lora", "hilo"):
        results = []
        for fs in (torch_fully_shard, fully_shard):
            model = recipes.shard(recipes.build(recipe), fs, mesh=mesh)
            losses = recipes.train(recipe, model, 3, rank, world)
            results.append((losses, [recipes.plain(p) for p in model.parameters()]))
        (their_losses, theirs), (our_losses, ours) = results
        assert our_losses == their_losses, (recipe, our_losses, their_losses)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), recipe
    with pytest.raises(NotImplementedError, match=r"parameter 'weight'.*reshard_after_forward"):
        fully_shard(recipes.build("hilo")[0], reshard_after_forward=2)
    dist.barrier()


@pytest.mark.slow
def test_subclass_parameters_under_hsdp():
    run_distributed(_hsdp_worker, 4, timeout_s=600)
