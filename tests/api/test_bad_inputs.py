"""The bad-input catalogue: each mistake gets an error that names the module / parameter / rank,
raised before any collective where the mistake is visible locally; the training-time ones are also
checked to leave nothing hanging and nothing silently wrong (against an unwrapped reference)."""
from __future__ import annotations

import copy
import re
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_ext
from fsdp_ext.runtime.core.registry import units_of

from ..helpers.dist import local_slice, run_distributed


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(5, 7), nn.Tanh()), nn.Linear(7, 3))


def _shard(model: nn.Sequential, **kwargs) -> nn.Sequential:
    fsdp_ext.fully_shard(model[0], **kwargs)
    return fsdp_ext.fully_shard(model, **kwargs)


def _batch(world_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * world_size, 5, generator=g)


def _loss(model, x):
    return model(x).pow(2).mean()


def _collectives_issued(model) -> int:
    """Tagged collectives so far, over every group (each all-gather / reduce-scatter / all-reduce
    while the tags are on)."""
    schedule = units_of(model)[0].schedule
    return sum(schedule.checker.sequences.values()) if schedule is not None else 0


# ---- wrapping -------------------------------------------------------------------------------------
def check_wrapping_errors(rank: int, world_size: int) -> None:
    model = _shard(_mlp())
    with pytest.raises(ValueError, match=r"FSDPSequential is already sharded by fully_shard"):
        fsdp_ext.fully_shard(model)
    with pytest.raises(ValueError, match=r"already sharded"):
        fsdp_ext.FullyShardedDataParallel(model)
    # torch's shard_placement_fn: Shard(dim) is honoured, a dim out of range refused naming the
    # parameter (tests/runtime/test_placements.py has the rest).
    from torch.distributed.tensor import Shard
    fsdp_ext.fully_shard(_mlp(), shard_placement_fn=lambda p: Shard(p.dim() - 1))
    with pytest.raises(ValueError, match=r"shard_placement_fn for parameter '0\.0\.weight' "
                                         r"returned Shard\(2\), out of range"):
        fsdp_ext.fully_shard(_mlp(), shard_placement_fn=lambda p: Shard(p.dim()))
    parent = fsdp_ext.fully_shard(_mlp())
    with pytest.raises(ValueError, match=r"parameter 'weight' of Linear already belongs to the unit "
                                         r"of Sequential \(parameter '1\.weight'\); apply fully_shard "
                                         r"bottom-up"):
        fsdp_ext.fully_shard(parent[1])


def check_several_devices(rank: int, world_size: int) -> None:
    """Two real devices need a GPU; the check reads only `.device`, so stand-ins show its message."""
    class TwoDevices(nn.Module):
        def named_parameters(self, *args, **kwargs):
            yield "a.weight", types.SimpleNamespace(device=torch.device("cpu"), is_meta=False)
            yield "b.weight", types.SimpleNamespace(device=torch.device("cuda", 0), is_meta=False)

        def parameters(self, recurse=True):
            return (p for _, p in self.named_parameters())

    with pytest.raises(ValueError, match=r"TwoDevices has parameters on several devices: "
                                         r"'a\.weight' on cpu, 'b\.weight' on cuda:0"):
        fsdp_ext.fully_shard(TwoDevices())


def check_parameter_dtypes(rank: int, world_size: int) -> None:
    for dtype in (torch.int64, torch.float64, torch.complex64):
        model = nn.Linear(3, 3)
        model.extra = nn.Parameter(torch.zeros(4, dtype=dtype), requires_grad=False)
        with pytest.raises(TypeError, match=rf"parameter 'extra' of Linear has dtype {dtype}; "
                                            r"fsdp_ext shards fp32/bf16/fp16 only"):
            fsdp_ext.fully_shard(model)
    # torch itself refuses the other half: an integer parameter that requires grad.
    with pytest.raises(RuntimeError, match=r"Only Tensors of floating point"):
        nn.Parameter(torch.zeros(4, dtype=torch.int64), requires_grad=True)
    # A cast after sharding (torch's FSDP2 casts the shards) is refused at the call, naming the
    # parameter and the alternatives, and leaves the model as it was: it trains on.
    model = _shard(_mlp())
    x = local_slice(_batch(world_size), rank, world_size)
    _loss(model, x).backward()  # (the root has named its units)
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.double(), lambda m: m.half()):
        with pytest.raises(NotImplementedError, match=r"parameter '1\.weight' of unit '<root>' "
                                                      r"\(Sequential\) would change dtype "
                                                      r".*MixedPrecisionPolicy\(param_dtype"):
            cast(model)
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32 and torch.equal(param.to_local(), before[name]), name
    model.zero_grad()
    reference = _mlp()
    _loss(model, x).backward()
    _loss(reference, _batch(world_size)).backward()
    _assert_grads_match(model, reference)


def check_groups_and_mesh(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    with pytest.raises(ValueError, match=r"fully_shard\(Sequential\): pass either mesh or "
                                         r"process_group, not both"):
        fsdp_ext.fully_shard(_mlp(), mesh=mesh, process_group=dist.group.WORLD)
    with pytest.raises(RuntimeError, match=r"Mesh should not be bigger than default world size"):
        init_device_mesh("cpu", (2, world_size))  # torch's own check: dims beyond the world
    # A mesh or group that leaves out the last rank (built on every rank, as torch requires).
    subset = list(range(world_size - 1))
    sub_mesh = DeviceMesh("cpu", subset)
    sub_group = dist.new_group(subset)
    if rank == world_size - 1:
        with pytest.raises(ValueError, match=re.escape(f"rank {rank} is not in the mesh (ranks {subset}")):
            fsdp_ext.fully_shard(_mlp(), mesh=sub_mesh)
        with pytest.raises(ValueError, match=rf"rank {rank} is not a member of the shard process "
                                             r"group"):
            fsdp_ext.fully_shard(_mlp(), process_group=sub_group)
    with pytest.raises(ValueError, match=r"share ranks \[.*\]; they must meet only at this rank"):
        fsdp_ext.fully_shard(_mlp(), process_group=(dist.group.WORLD, dist.group.WORLD))


# ---- after wrapping -------------------------------------------------------------------------------
def check_replaced_parameter(rank: int, world_size: int) -> None:
    x = local_slice(_batch(world_size), rank, world_size)
    for how in ("new Parameter", "new .data"):
        model = _shard(_mlp())
        _loss(model, x).backward()
        before = _collectives_issued(model)
        if how == "new Parameter":
            model[0][0].weight = nn.Parameter(torch.randn(7, 5))
            pattern = (r"parameter '0\.0\.weight' \(Linear\.weight\) was replaced after "
                       r"fully_shard")
        else:
            model[1].weight.data = torch.randn(3, 7)
            pattern = (r"parameter '1\.weight' had its \.data replaced after fully_shard \(now "
                       r"shape \[3, 7\]; this rank's shard is \[[\d, ]+\] of the original \[3, 7\]\)")
        with pytest.raises(RuntimeError, match=pattern):
            model(x)
        assert _collectives_issued(model) == before, "raised only after issuing collectives"
    # In-place edits are fine and reach the model.
    model = _shard(_mlp())
    with torch.no_grad():
        model[1].bias.fill_(0.5)
    expected = _mlp()
    with torch.no_grad():
        expected[1].bias.fill_(0.5)
    torch.testing.assert_close(model(x), expected(x))


def _reference_and_sharded():
    reference = _mlp()
    return reference, _shard(copy.deepcopy(reference))


def _assert_grads_match(model, reference) -> None:
    """Every parameter got a gradient; one SGD step with lr 1 gives the reference's parameters."""
    for name, param in model.named_parameters():
        assert param.grad is not None, name
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    torch.optim.SGD(reference.parameters(), lr=1.0).step()
    got = fsdp_ext.full_state_dict(model)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-5,
                                   msg=lambda m: f"{key}: {m}")


def check_backward_twice(rank: int, world_size: int) -> None:
    x = _batch(world_size)
    mine = local_slice(x, rank, world_size)
    # Same graph, no retain_graph: torch's error on every rank, and the model still trains.
    reference, model = _reference_and_sharded()
    loss = _loss(model, mine)
    loss.backward()
    with pytest.raises(RuntimeError, match=r"Trying to backward through the graph a second time"):
        loss.backward()
    _loss(reference, x).backward()
    _assert_grads_match(model, reference)
    # Same graph with retain_graph: gradients add up, as without sharding.
    reference, model = _reference_and_sharded()
    loss = _loss(model, mine)
    loss.backward(retain_graph=True)
    loss.backward()
    ref_loss = _loss(reference, x)
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    _assert_grads_match(model, reference)
    # Two forwards, two backwards, no zero_grad in between: accumulation.
    reference, model = _reference_and_sharded()
    y = _batch(world_size, seed=1)
    _loss(model, mine).backward()
    _loss(model, local_slice(y, rank, world_size)).backward()
    _loss(reference, x).backward()
    _loss(reference, y).backward()
    _assert_grads_match(model, reference)


def check_optimizer_mismatch(rank: int, world_size: int) -> None:
    reference, model = _reference_and_sharded()
    fsdp_ext.check_optimizer(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match=r"optimizer param_groups\[0\]\['params'\]\[0\] \(shape "
                                         r"\[7, 5\]\) is not a parameter of the sharded "
                                         r"FSDPSequential; it has the unsharded shape of "
                                         r"'0\.0\.weight'"):
        fsdp_ext.check_optimizer(model, torch.optim.AdamW(reference.parameters()))
    # An optimizer built before fully_shard holds the parameters fully_shard replaced.
    early = _mlp()
    opt = torch.optim.AdamW(early.parameters())
    _shard(early)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] is parameter "
                                         r"'0\.0\.weight' as it was before fully_shard"):
        fsdp_ext.check_optimizer(early, opt)
    _loss(early, _batch(world_size)).backward()  # (the first forward names the units)
    with pytest.raises(ValueError, match=r"AdamW\.step\(\): param_groups\[0\]\['params'\]\[0\] is "
                                         r"parameter '0\.0\.weight' \(Linear\.weight\) as it was"):
        opt.step()
    # FullyShardedDataParallel keeps the parameter objects (FSDP1's flat views): an optimizer that
    # stepped before wrapping holds full-shape state.
    early = _mlp()
    opt = torch.optim.AdamW(early.parameters())
    _loss(early, _batch(world_size)).backward()
    opt.step()
    early = fsdp_ext.FullyShardedDataParallel(early)
    with pytest.raises(ValueError, match=r"optimizer state 'exp_avg' of parameter '0\.0\.weight' "
                                         r"has shape \[7, 5\], the parameter's local shard is "
                                         r"\[\d+\]: the optimizer stepped before fully_shard"):
        fsdp_ext.check_optimizer(early, opt)


# ---- non-finite gradients -------------------------------------------------------------------------
def check_nonfinite_gradients(rank: int, world_size: int) -> None:
    x = local_slice(_batch(world_size), rank, world_size).clone()
    if rank == world_size - 1:
        x[0, 0] = float("inf")  # inf * 0 weights and tanh' -> NaN in the first block's gradients
    # clip_grad_norm_ names the unit.
    model = _shard(_mlp())
    _loss(model, x).backward()
    with pytest.raises(fsdp_ext.NonFiniteGradientError, match=r"non-finite gradients in unit\(s\): "
                                                              r"0"):
        model.clip_grad_norm_(1.0, error_if_nonfinite=True)
    # Off (the default): no error, the NaN reaches the gradients as without sharding.
    model = _shard(_mlp())
    _loss(model, x).backward()
    assert not torch.isfinite(fsdp_ext.clip_grad_norm_(model, 1.0))
    # On: every rank raises in backward, naming unit, parameter and the rank that produced it.
    last = world_size - 1
    for micro_batches in (1, 2):  # 2: the NaN comes in a no_sync micro-batch, raised at the sync
        model = _shard(_mlp(), check_finite_grads=True)
        clean = local_slice(_batch(world_size, seed=2), rank, world_size)
        if micro_batches == 2:
            model.set_requires_gradient_sync(False)
            _loss(model, x).backward()
            model.set_requires_gradient_sync(True)
        with pytest.raises(fsdp_ext.NonFiniteGradientError) as info:
            _loss(model, clean if micro_batches == 2 else x).backward()
        message = str(info.value)
        assert re.search(rf"rank {rank}: non-finite gradient \(NaN/Inf\) in unit '0' bucket 0, "
                         rf"before its reduce-scatter, for parameter\(s\) '0\.0\.weight' "
                         rf"\(rank {last}\)", message), message
        # After the error the model trains on: a clean step matches the reference.
        model.zero_grad()
        reference = _mlp()
        _loss(model, clean).backward()
        _loss(reference, _batch(world_size, seed=2)).backward()
        _assert_grads_match(model, reference)


def bad_inputs_worker(rank: int, world_size: int) -> None:
    check_wrapping_errors(rank, world_size)
    check_several_devices(rank, world_size)
    check_parameter_dtypes(rank, world_size)
    check_groups_and_mesh(rank, world_size)
    check_replaced_parameter(rank, world_size)
    check_backward_twice(rank, world_size)
    check_optimizer_mismatch(rank, world_size)
    check_nonfinite_gradients(rank, world_size)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_bad_inputs(world_size):
    run_distributed(bad_inputs_worker, world_size)


# ---- the global optimizer step pre-hook and optimizers that are not fully_shard's -------------------
class _ComparableSGD(torch.optim.SGD):
    """An optimizer class with an `__eq__` of its own (Python then makes it unhashable)."""

    def __eq__(self, other):
        return isinstance(other, _ComparableSGD) and self.defaults == other.defaults


class _AllEqualSGD(torch.optim.SGD):
    """Every instance equal to every other, one hash for all."""

    def __eq__(self, other):
        return isinstance(other, _AllEqualSGD)

    def __hash__(self):
        return 0


def test_step_check_keys_optimizers_by_identity():
    """fully_shard registers one step pre-hook for every optimizer of the process: an unhashable
    optimizer steps as without fsdp_ext, and optimizers that compare equal are checked apart."""
    from fsdp_ext.diagnostics.optim_check import install_step_check
    from fsdp_ext.runtime.core.registry import record_replaced
    install_step_check()  # what fully_shard of any other model does
    layer = nn.Linear(3, 2)
    opt = _ComparableSGD(layer.parameters(), lr=0.1)
    layer(torch.randn(4, 3)).sum().backward()
    opt.step()  # was: TypeError: unhashable type: '_ComparableSGD'
    opt.step()
    clean = _AllEqualSGD(nn.Linear(3, 2).parameters(), lr=0.1)
    clean.step()
    stale = nn.Parameter(torch.zeros(2))
    record_replaced(stale, ("Linear", "bias", "0.bias"))  # as fully_shard records what it replaced
    with pytest.raises(ValueError, match=r"_AllEqualSGD\.step\(\): param_groups\[0\]\['params'\]"
                                         r"\[0\] is parameter '0\.bias'"):
        _AllEqualSGD([stale], lr=0.1).step()
