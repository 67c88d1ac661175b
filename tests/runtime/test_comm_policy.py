"""CommPolicy: quantized parameter all-gathers and gradient reductions, in both APIs.

Against independent references: the exact run of the same script (fsdp_ext without a policy, and
the unwrapped model through it), the format's error bound, torch's own DTensor gather of the
master shards (full_tensor()); and the bytes the collectives move."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_ext
from fsdp_ext import CommPolicy
from examples.models import GPT, Block, GPTConfig

from ..helpers.dist import run_checks, run_distributed

STEPS = 8


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=3, n_head=4, d_model=64))


def _shard(model, api: str, policy, **kwargs):
    if api == "fsdp1":
        return fsdp_ext.FullyShardedDataParallel(
            model, auto_wrap_policy=fsdp_ext.ModuleWrapPolicy({Block}), use_orig_params=True,
            comm_policy=policy, **kwargs)
    for block in model.blocks:
        fsdp_ext.fully_shard(block, **kwargs)
    return fsdp_ext.fully_shard(model, comm_policy=policy, **kwargs)  # the blocks inherit it


def _batch(step: int, rank: int):
    idx = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(100 * step + rank))
    return idx, idx


def _train(model, rank: int, world: int, steps: int = STEPS) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        loss = model(*_batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


EVERY = (CommPolicy("int8"), CommPolicy(grad_reduce="int8"),
         CommPolicy("int8", "int8", block_size=64), CommPolicy("fp8", "bf16"))
ZERO2 = dict(sharding_strategy=fsdp_ext.ShardingStrategy.SHARD_GRAD_OP)


def check_training_follows_exact(rank: int, world: int, runs=(("fully_shard", {}, EVERY),)):
    """Every setting (fully_shard; the slow test adds FSDP1 and SHARD_GRAD_OP): the loss curve
    within 1% of the exact run at every step from the third on (the main job's criterion, on a
    short run), and not identical to it."""
    for api, kwargs, policies in runs:
        exact = _train(_shard(_gpt(), api, None, **kwargs), rank, world)
        for policy in policies:
            losses = _train(_shard(_gpt(), api, policy, **kwargs), rank, world)
            assert losses != exact, (api, policy)
            for step, (a, b) in enumerate(zip(losses, exact)):
                assert abs(a - b) <= 0.01 * b or step < 2, (api, policy, step, losses, exact)


class _Captured:
    """The weight block 0's first MLP layer sees in forward (the gathered, dequantized parameter)."""

    def __init__(self, model):
        self.value = None
        model.blocks[0].mlp[0].register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.value = module.weight.detach().clone()


def check_gathered_parameters(rank: int, world: int) -> None:
    """int8 weights on the wire: every rank computes with the same values, each within half a
    quantization step (amax / 254) of the exact parameter; the master shards stay bit-exact;
    the all-gathers move the quantized bytes (about a quarter of fp32's)."""
    from fsdp_ext.runtime.comm import collectives as comm
    model = _shard(_gpt(), "fully_shard", CommPolicy("int8", block_size=64))
    master = [p._local_tensor.clone() for p in model.parameters()]
    captured = _Captured(model)
    moved, gather, issue = [], comm.all_gather_into, comm.issue_all_gather

    def counting(output, input, *args, **kwargs):
        moved.append(output.numel() * output.element_size())
        return gather(output, input, *args, **kwargs)

    def counting_issued(fulls, *args, **kwargs):  # (CPU: the issue thread's gathers)
        moved.extend(f.numel() * f.element_size() for f in fulls)
        return issue(fulls, *args, **kwargs)
    comm.all_gather_into, comm.issue_all_gather = counting, counting_issued
    try:
        with torch.no_grad():
            model(_batch(0, rank)[0])
    finally:
        comm.all_gather_into, comm.issue_all_gather = gather, issue
    seen = captured.value
    exact = model.blocks[0].mlp[0].weight.full_tensor()  # torch's gather of the master shards
    everyone = [torch.empty_like(seen) for _ in range(world)]
    dist.all_gather(everyone, seen)
    assert all(torch.equal(v, seen) for v in everyone)
    err = (seen - exact).abs()
    assert 0 < err.max() <= exact.abs().max() / 254 * (1 + 1e-6)
    assert all(torch.equal(p._local_tensor, m) for p, m in zip(model.parameters(), master))
    fp32_bytes = sum(4 * p.numel() for p in model.parameters())  # every unit gathered once
    assert 0.25 * fp32_bytes < sum(moved) < 0.30 * fp32_bytes, (sum(moved), fp32_bytes)


def check_reduced_gradients(rank: int, world: int) -> None:
    """int8 gradient reduction: each parameter's reduced gradient within 1% (relative L2) of the
    exact reduction of the same backward, and exact where the policy says bf16 is enough."""
    grads = {}
    for name, policy in (("exact", None), ("int8", CommPolicy(grad_reduce="int8"))):
        model = _shard(_gpt(), "fully_shard", policy)
        model(*_batch(0, rank)).backward()
        grads[name] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    for n, exact in grads["exact"].items():
        got = grads["int8"][n]
        rel = ((got - exact).norm() / exact.norm()).item()
        if rank == 0:
            print("REL", n, rel)
        assert rel <= 0.01, (n, rel)


def check_checkpoints_hold_the_masters(rank: int, world: int) -> None:
    """A run with int8 on the wire saves the exact master weights (the state path gathers
    them exactly): full state dict == torch's full_tensor() of every shard."""
    model = _shard(_gpt(), "fully_shard", CommPolicy("int8", "int8"))
    _train(model, rank, world, steps=2)
    full = fsdp_ext.full_state_dict(model)
    for name, p in model.named_parameters():
        assert torch.equal(full[name], p.full_tensor()), name


class _PoisonedAllocations(TorchDispatchMode):
    """Every uninitialised allocation (torch.empty and kin) comes back full of NaN, or of
    garbage (huge finite values), as reused memory may: what a shard's padding holds if the
    code that allocates it leaves it so."""

    EMPTY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
             torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default}

    def __init__(self, poison: str):
        super().__init__()
        self.poison = poison

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.EMPTY and out.is_floating_point() and not out.is_meta:
            local = out.to_local() if isinstance(out, DTensor) else out
            if self.poison == "nan":
                local.fill_(float("nan"))
            else:
                garbage = torch.randn(local.shape, generator=torch.Generator().manual_seed(5))
                local.copy_(garbage.mul_(1e30))
        return out


def _padding_mask(bucket) -> torch.Tensor:
    """Which elements of a bucket's shard hold no parameter (the padding)."""
    mask = torch.ones(bucket.shard_numel, dtype=torch.bool)
    for i in range(len(bucket.slots)):
        mask[slice(*bucket.layout.local_range(i))] = False
    return mask


def _padding_of(bucket) -> torch.Tensor:
    """The elements of a bucket's shard that hold no parameter (the padding)."""
    return bucket.shard[_padding_mask(bucket)]


def _uneven() -> GPT:  # 97 rows (uneven chunks), LayerNorms of 36: 18 values and 6 padding
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=4, d_model=36))


def check_meta_init_zeroes_padding(rank: int, world: int) -> None:
    """Meta device -> fully_shard with each wire format -> to_empty (its allocations poisoned
    with NaN, then with garbage) -> torch's set_model_state_dict: every shard's padding is zero
    (whatever the allocator handed out) and training gives the losses, bit for bit, of the same
    model built with its values."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    values = _uneven().state_dict()
    for policy in (None, CommPolicy("int8"), CommPolicy("fp8")):
        expected = _train(_shard(_uneven(), "fully_shard", policy), rank, world, steps=3)
        for poison in ("nan", "garbage"):
            with torch.device("meta"):
                model = _shard(_uneven(), "fully_shard", policy)
            with _PoisonedAllocations(poison):
                model.to_empty(device="cpu")
            set_model_state_dict(model, values, options=StateDictOptions(full_state_dict=True))
            for unit in fsdp_ext.runtime.core.registry.units_of(model):
                for bucket in unit.buckets:
                    padding = _padding_of(bucket)
                    assert (padding == 0).all(), (policy, poison, unit.name, padding)
            losses = _train(model, rank, world, steps=3)
            assert losses == expected, (policy, poison, losses, expected)


def _gathered_and_grads(model, rank: int):
    """Every parameter as forward sees it (the gathered values), then the loss and the reduced
    gradients of one step."""
    seen = {}

    def capture(module, args):
        for attr, value in module._parameters.items():
            if value is not None:  # (what forward sees: the gathered tensor)
                seen[f"{names[module]}.{attr}"] = getattr(module, attr).detach().clone()
    names = {m: n for n, m in model.named_modules()}
    hooks = [m.register_forward_pre_hook(capture) for m in names]
    loss = model(*_batch(0, rank))
    loss.backward()
    for h in hooks:
        h.remove()
    return seen, loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def check_nan_in_padding_stays_in_the_padding(rank: int, world: int) -> None:
    """NaN planted in every shard's padding (as anything that writes a shard might leave it):
    each quantized block's scale comes from the values it holds, so the gathered parameters
    (forward and backward's regather), the loss and the gradients are those of zero padding."""
    for policy in (CommPolicy("int8", "int8", block_size=64), CommPolicy("fp8")):
        runs, planted = [], 0
        for poison in (False, True):
            model = _shard(_uneven(), "fully_shard", policy)
            with torch.no_grad():
                model(_batch(0, rank)[0])  # (lazy init: the units' buckets exist after it)
                for unit in fsdp_ext.runtime.core.registry.units_of(model):
                    for bucket in unit.buckets:
                        padding = _padding_mask(bucket)
                        if poison:
                            bucket.shard[padding] = float("nan")
                            planted += int(padding.sum())
            runs.append(_gathered_and_grads(model, rank))
        assert planted >= 6 * 5, planted  # (at least the LayerNorms' 6 on every rank)
        (seen, loss, grads), (seen_nan, loss_nan, grads_nan) = runs
        assert seen.keys() == seen_nan.keys() and len(seen) > 10, sorted(seen)
        for name, value in seen_nan.items():
            assert value.isfinite().all() and torch.equal(value, seen[name]), (policy, name)
        assert torch.equal(loss_nan, loss), (policy, loss_nan, loss)
        for name, grad in grads_nan.items():
            assert torch.equal(grad, grads[name]), (policy, name)


def check_inheritance_and_describe(rank: int, world: int) -> None:
    model = _gpt()
    fsdp_ext.fully_shard(model.blocks[0], comm_policy=CommPolicy(grad_reduce="bf16"))
    for block in model.blocks[1:]:
        fsdp_ext.fully_shard(block)
    fsdp_ext.fully_shard(model, comm_policy=CommPolicy("fp8"))
    model(*_batch(0, rank)).backward()
    policies = {u.name or "root": getattr(b.wire, "policy", None)
                for u in model._unit.schedule.units for b in u.buckets}
    assert policies["blocks.0"] == CommPolicy(grad_reduce="bf16")
    assert policies["blocks.1"] == policies["root"] == CommPolicy("fp8")
    text = fsdp_ext.describe(model, file=None)
    assert "on the wire: param_gather=None, grad_reduce=bf16, block_size=256" in text
    assert "on the wire: param_gather=fp8, grad_reduce=None, block_size=256 (the root's)" in text


def check_bad_input(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="param_gather='int4'"):
        CommPolicy(param_gather="int4")
    with pytest.raises(ValueError, match="block_size=12"):
        CommPolicy("int8", block_size=12)
    mp = fsdp_ext.MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"fully_shard\(Block\).*grad_reduce='int8'.*float16"):
        fsdp_ext.fully_shard(_gpt().blocks[0], mp_policy=mp,
                             comm_policy=CommPolicy(grad_reduce="int8"))
    with pytest.raises(TypeError, match="comm_policy must be an fsdp_ext.CommPolicy"):
        fsdp_ext.fully_shard(_gpt().blocks[0], comm_policy={"param_gather": "int8"})
    # The same check where a child inherits the root's policy (at the root's first forward,
    # before any collective); a policy of its own (exact) opts the child out.
    fp16_grads = fsdp_ext.MixedPrecisionPolicy(reduce_dtype=torch.float16)
    int8, bf16 = CommPolicy(grad_reduce="int8"), CommPolicy(grad_reduce="bf16")
    for policy, own in ((int8, None), (bf16, None), (bf16, CommPolicy())):
        model = _gpt()
        fsdp_ext.fully_shard(model.blocks[1], mp_policy=fp16_grads, comm_policy=own)
        fsdp_ext.fully_shard(model, comm_policy=policy)
        if own is not None:
            model(*_batch(0, rank)).backward()
            assert model.blocks[1]._unit.buckets[0].wire.kind == "exact"
            continue
        with pytest.raises(ValueError, match=(
                rf"fully_shard\(Block\) 'blocks\.1', which inherits its root's comm_policy .*"
                rf"CommPolicy\(grad_reduce='{policy.grad_reduce}'\).*reduce_dtype=torch.float16")):
            model(*_batch(0, rank))


CHECKS = [check_training_follows_exact, check_gathered_parameters, check_reduced_gradients,
          check_checkpoints_hold_the_masters, check_meta_init_zeroes_padding,
          check_nan_in_padding_stays_in_the_padding, check_inheritance_and_describe,
          check_bad_input]


def _worker(rank: int, world: int) -> None:
    # Parameters of 4096 elements and more gathered directly (layout.py): buckets of several
    # gather groups, each with its own slot stride and blocks, beside one copied group.
    os.environ["FSDP_EXT_DIRECT_MIN_NUMEL"] = "4096"
    run_checks(CHECKS, rank, world)


def test_comm_policy_at_world_2():
    run_distributed(_worker, 2, timeout_s=600)


def _hsdp_worker(rank: int, world: int) -> None:
    """HSDP (2 x 2) and HYBRID_SHARD with int8 both ways: within 1% of the exact run."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    exact = _train(_shard(_gpt(), "fully_shard", None, mesh=mesh), rank, world)
    losses = _train(_shard(_gpt(), "fully_shard", CommPolicy("int8", "int8"), mesh=mesh),
                    rank, world)
    assert all(abs(a - b) <= 0.01 * b for a, b in zip(losses[2:], exact[2:])), (losses, exact)
    hybrid = dict(sharding_strategy=fsdp_ext.ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)
    exact = _train(_shard(_gpt(), "fsdp1", None, **hybrid), rank, world)
    losses = _train(_shard(_gpt(), "fsdp1", CommPolicy("int8", "int8"), **hybrid), rank, world)
    assert all(abs(a - b) <= 0.01 * b for a, b in zip(losses[2:], exact[2:])), (losses, exact)
    dist.barrier()


def _fsdp1_worker(rank: int, world: int) -> None:
    os.environ["FSDP_EXT_DIRECT_MIN_NUMEL"] = "4096"
    check_training_follows_exact(rank, world, (("fsdp1", {}, EVERY), ("fsdp1", ZERO2, EVERY)))
    dist.barrier()


@pytest.mark.slow
def test_comm_policy_with_fsdp1_and_shard_grad_op():
    run_distributed(_fsdp1_worker, 2, timeout_s=600)


@pytest.mark.slow
def test_comm_policy_under_hsdp():
    run_distributed(_hsdp_worker, 4, timeout_s=600)
