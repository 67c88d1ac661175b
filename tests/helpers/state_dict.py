"""Checks of the model/optimizer state dicts and the safetensors export, run inside one launch per
world size (see test_state_dict.py). Every check compares with an unwrapped single-process model."""
from __future__ import annotations

import copy
import json
import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor, Shard

import fsdp_ext
from fsdp_ext.state.checkpoint import quiet_sharded_tensor

from .dist import global_mean, local_slice
from .parity import Case, build_model, compute_loss, make_batch
from .parity import wrap as _wrap


def wrap(case: Case, model, world_size: int):
    """parity.wrap; FullyShardedDataParallel models set to SHARDED_STATE_DICT (torch's FSDP1
    default is FULL_STATE_DICT, which check_state_dict_types covers), so that both APIs give their
    sharded form here."""
    wrapped = _wrap(case, model, world_size)
    if case.api == "fsdp1":
        fsdp_ext.FullyShardedDataParallel.set_state_dict_type(
            wrapped, fsdp_ext.StateDictType.SHARDED_STATE_DICT)
    return wrapped


def _perturbed(name: str) -> torch.nn.Module:
    """The same architecture with other values, to load into."""
    model = build_model(name)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.full_like(p, 0.25 + i))
    return model


def _param_names(model) -> set[str]:
    return {n for n, _ in model.named_parameters(remove_duplicate=False)}


def assert_same_full(model, expected: dict, what: str, exact: bool = True) -> None:
    full = fsdp_ext.full_state_dict(model)
    assert list(full) == list(expected), f"{what}: keys {list(full)} != {list(expected)}"
    for key, value in expected.items():
        tol = dict(atol=0, rtol=0) if exact else dict(atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(full[key], value, **tol, msg=lambda m: f"{what} {key}: {m}")


# ---- sharded entries -------------------------------------------------------------------------------
def check_sharded_entries(case: Case, world_size: int) -> None:
    """Right after wrapping: keys of the unwrapped model. fully_shard: each parameter a DTensor
    of the parameter's shape, Shard(0) on the shard dimension, whose local tensor is torch.chunk's
    chunk for this rank and whose full_tensor() is the parameter. FullyShardedDataParallel (FSDP1):
    a flattened ShardedTensor whose local shard is this rank's range and whose shards tile
    [0, numel) once."""
    reference = build_model(case.model)
    model = wrap(case, copy.deepcopy(reference), world_size)
    sd, expected = model.state_dict(), reference.state_dict()
    assert list(sd) == list(expected), f"{case.name}: {list(sd)} != {list(expected)}"
    params = _param_names(reference)
    for key, value in expected.items():
        if key not in params:
            assert torch.equal(sd[key], value), key
            continue
        entry = sd[key]
        if case.api == "fully_shard":
            assert isinstance(entry, DTensor) and entry.shape == value.shape, (key, type(entry))
            assert entry.placements[-1] == Shard(0), (key, entry.placements)
            shards, rank = entry.device_mesh.size(-1), entry.device_mesh.get_local_rank(-1)
            chunks = torch.chunk(value, shards, dim=0)
            mine = chunks[rank] if rank < len(chunks) else value[:0]
            assert torch.equal(entry.to_local(), mine), key
            assert torch.equal(entry.full_tensor(), value), key
            continue
        assert isinstance(entry, ShardedTensor), f"{key}: {type(entry)}"
        md = entry.metadata()
        assert list(md.size) == [value.numel()], (key, md.size)
        # Every shard-group rank has a shard; ranks owning nothing an empty one at the end.
        spans = sorted((s.shard_offsets[0], s.shard_sizes[0]) for s in md.shards_metadata
                       if s.shard_sizes[0])
        position = 0
        for offset, size in spans:
            assert offset == position, f"{key}: shards {spans} do not tile the parameter"
            position += size
        assert position == value.numel(), f"{key}: shards {spans} cover {position}"
        for shard in entry.local_shards():
            (offset,), (size,) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            assert torch.equal(shard.tensor, value.reshape(-1)[offset:offset + size]), key


# ---- load_state_dict -------------------------------------------------------------------------------
def _expect_error(fn, *needles: str) -> None:
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        for needle in needles:
            assert needle in str(exc), f"'{needle}' not in error: {exc}"
        return
    raise AssertionError(f"no error raised (expected one mentioning {needles})")


def check_load_forms(case: Case, world_size: int) -> None:
    reference = build_model(case.model)
    expected = reference.state_dict()
    # Full tensors.
    target = wrap(case, _perturbed(case.model), world_size)
    target.load_state_dict(expected)
    assert_same_full(target, expected, f"{case.name} full load")
    # The sharded form of another model with the same layout.
    source = wrap(case, copy.deepcopy(reference), world_size)
    target = wrap(case, _perturbed(case.model), world_size)
    target.load_state_dict(source.state_dict())
    assert_same_full(target, expected, f"{case.name} sharded load")
    target.load_state_dict(target.state_dict())  # its own entries alias its shards
    assert_same_full(target, expected, f"{case.name} self load")
    # strict=False with a missing parameter: the others load, that one keeps its values.
    target = wrap(case, _perturbed(case.model), world_size)
    counts = {}
    for _, p in reference.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    kept = next(n for n, p in reference.named_parameters() if counts[id(p)] == 1)  # not tied
    before = fsdp_ext.full_state_dict(target)[kept]
    partial = {k: v for k, v in expected.items() if k != kept}
    missing, unexpected = target.load_state_dict(partial, strict=False)
    assert kept in missing and not unexpected, (missing, unexpected)
    assert_same_full(target, {**expected, kept: before}, f"{case.name} partial load")
    # Errors name the parameter.
    _expect_error(lambda: target.load_state_dict(partial), "Missing key", kept)
    _expect_error(lambda: target.load_state_dict({**expected, "bogus.weight": torch.zeros(1)}),
                  "Unexpected key", "bogus.weight")
    wrong = {**expected, kept: torch.zeros(expected[kept].numel() + 1)}
    other = {k: v + 1 for k, v in expected.items()}  # what a half-done load would have written
    before = fsdp_ext.full_state_dict(target)
    _expect_error(lambda: target.load_state_dict({**other, kept: wrong[kept]}),
                  "size mismatch for " + kept)
    assert_same_full(target, before, f"{case.name} after a failed load (nothing written)")


# ---- full state dict and FSDP1's state_dict_type ---------------------------------------------------
def check_state_dict_types(world_size: int, rank: int) -> None:
    FSDP = fsdp_ext.FullyShardedDataParallel
    from torch.distributed.fsdp import (FullStateDictConfig, ShardedStateDictConfig,
                                        StateDictType)
    case = Case("gpt", "fsdp1", "FULL_SHARD")
    reference = build_model("gpt")
    expected = reference.state_dict()
    model = _wrap(case, copy.deepcopy(reference), world_size)
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())  # torch's default
    settings = FSDP.get_state_dict_type(model)
    assert settings.state_dict_type == StateDictType.FULL_STATE_DICT, settings
    assert settings.optim_state_dict_config.offload_to_cpu, settings  # FullOptimStateDictConfig()
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        sd = model.state_dict()
    if rank == 0:
        assert list(sd) == list(expected)
        for key, value in expected.items():
            assert sd[key].device.type == "cpu" and torch.equal(sd[key], value), key
    else:
        assert sd == {}, list(sd)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in expected.items())
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
        assert isinstance(model.state_dict()["wte.weight"], ShardedTensor)
    assert not isinstance(model.state_dict()["wte.weight"], ShardedTensor)  # back to FULL
    previous = FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT,
                                        ShardedStateDictConfig(offload_to_cpu=True))
    assert previous.state_dict_type == StateDictType.FULL_STATE_DICT, previous
    entry = model.state_dict()["wte.weight"]
    assert isinstance(entry, ShardedTensor) and entry.local_shards()[0].tensor.device.type == "cpu"
    target = wrap(case, _perturbed("gpt"), world_size)
    fsdp_ext.load_full_state_dict(target, expected)
    assert_same_full(target, expected, "load_full_state_dict")


# ---- optimizer state --------------------------------------------------------------------------------
def _train(case, model, opt, steps: int, world_size: int, first_step: int = 0,
           rank: int | None = None) -> list[torch.Tensor]:
    """Steps on the global batch of `world_size` ranks; with `rank`, on that rank's slice only."""
    losses = []
    for step in range(first_step, first_step + steps):
        inputs, targets = make_batch(case.model, step, 2 * world_size)
        if rank is not None:
            inputs = local_slice(inputs, rank, world_size)
            targets = local_slice(targets, rank, world_size)
        loss = compute_loss(case.model, model, inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _adamw(params, lr=1e-2):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, eps=1e-6)


def _by_names(reference, ref_opt) -> dict:
    """What the unwrapped model's optimizer holds, re-keyed by parameter names."""
    names = [n for n, _ in reference.named_parameters()]
    osd = ref_opt.state_dict()
    return {"state": {names[i]: s for i, s in osd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                             for g in osd["param_groups"]]}


def check_optimizer(case: Case, rank: int, world_size: int) -> None:
    reference = build_model(case.model)
    model = wrap(case, copy.deepcopy(reference), world_size)
    opt, ref_opt = _adamw(model.parameters()), _adamw(reference.parameters())
    _train(case, model, opt, 2, world_size, rank=rank)
    _train(case, reference, ref_opt, 2, world_size)
    full = fsdp_ext.optim_state_dict(model, opt, full=True)
    expected = _by_names(reference, ref_opt)
    assert full["param_groups"] == expected["param_groups"], full["param_groups"]
    assert list(full["state"]) == list(expected["state"]), list(full["state"])
    for name, state in expected["state"].items():
        assert list(full["state"][name]) == list(state), (name, list(full["state"][name]))
        for key, value in state.items():
            torch.testing.assert_close(full["state"][name][key], value, atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"{case.name} {name}.{key}: {m}")
    only0 = fsdp_ext.optim_state_dict(model, opt, full=True, rank0_only=True)
    assert (only0 != {}) == (rank == 0)
    # Full form into a fresh optimizer that never stepped, with another lr: state and lr restored,
    # and the next step matches the reference's.
    fresh = wrap(case, copy.deepcopy(reference), world_size)
    fresh_opt = _adamw(fresh.parameters(), lr=0.5)
    fsdp_ext.load_optim_state_dict(fresh, fresh_opt, full)
    assert fresh_opt.param_groups[0]["lr"] == 1e-2
    loss = _train(case, fresh, fresh_opt, 1, world_size, first_step=2, rank=rank)[0]
    ref_loss = _train(case, reference, ref_opt, 1, world_size, first_step=2)[0]
    torch.testing.assert_close(global_mean(loss), ref_loss, atol=1e-5, rtol=1e-4)
    assert_same_full(fresh, reference.state_dict(), f"{case.name} after resumed step", exact=False)
    # Sharded form, same layout: exactly the same local state.
    sharded = fsdp_ext.optim_state_dict(model, opt, full=False)
    copy_opt = _adamw(model.parameters())
    fsdp_ext.load_optim_state_dict(model, copy_opt, sharded)
    for p in model.parameters():
        for key, value in opt.state[p].items():
            assert torch.equal(copy_opt.state[p][key], value), key


# ---- DCP across world sizes -------------------------------------------------------------------------
def save_for_resharding(rank: int, world_size: int, directory: str) -> None:
    """World 4: save a FULL_SHARD and an HSDP model with DCP, plus the expected full values;
    load the FULL_SHARD one back into an HSDP model (every replica must be filled)."""
    reference = build_model("gpt")
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    expected = reference.state_dict()
    if rank == 0:
        torch.save(expected, os.path.join(directory, "expected.pt"))
    for strategy in ("FULL_SHARD", "HYBRID_SHARD"):
        model = wrap(Case("gpt", "fully_shard", strategy), copy.deepcopy(reference), world_size)
        with quiet_sharded_tensor():
            dcp.save(model.state_dict(), checkpoint_id=os.path.join(directory, strategy))
    hsdp = wrap(Case("gpt", "fully_shard", "HYBRID_SHARD"), _perturbed("gpt"), world_size)
    sd = hsdp.state_dict()
    with quiet_sharded_tensor():
        dcp.load(sd, checkpoint_id=os.path.join(directory, "FULL_SHARD"))
    hsdp.load_state_dict(sd)
    assert_same_full(hsdp, expected, "HSDP load from a world-4 FULL_SHARD checkpoint")


def load_resharded(rank: int, world_size: int, directory: str) -> None:
    """World 3: load both world-4 checkpoints; the HSDP one holds every chunk exactly once."""
    expected = torch.load(os.path.join(directory, "expected.pt"))
    for strategy in ("FULL_SHARD", "HYBRID_SHARD"):
        path = os.path.join(directory, strategy)
        model = wrap(Case("gpt", "fully_shard", "FULL_SHARD"), _perturbed("gpt"), world_size)
        sd = model.state_dict()
        with quiet_sharded_tensor():
            dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd)
        assert_same_full(model, expected, f"world {world_size} load of {strategy}")
        metadata = dcp.FileSystemReader(path).read_metadata()
        for key, md in metadata.state_dict_metadata.items():
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
            assert sum(math.prod(size) for _, size in chunks) == md.size.numel(), (
                strategy, key, chunks)


# ---- safetensors ------------------------------------------------------------------------------------
def check_safetensors(case: Case, rank: int, world_size: int, directory: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file
    reference = build_model(case.model)
    model = wrap(case, copy.deepcopy(reference), world_size)
    _train(case, model, _adamw(model.parameters()), 1, world_size, rank=rank)  # not the init
    full = fsdp_ext.full_state_dict(model)
    path = os.path.join(directory, f"{case.model}-{case.strategy}-{world_size}.safetensors")
    fsdp_ext.export_safetensors(model, path)
    loaded = load_file(path)
    assert sorted(loaded) == sorted(full), (sorted(loaded), sorted(full))
    for key, value in full.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    with open(path, "rb") as f:
        assert int.from_bytes(f.read(8), "little") % 8 == 0
    plain = build_model(case.model)
    plain.load_state_dict(loaded)  # strict
    assert not os.path.exists(path + ".tmp")
    if case.model == "gpt":  # tied embeddings: once, with the alias in the metadata
        once = path.replace(".safetensors", "-once.safetensors")
        fsdp_ext.export_safetensors(model, once, save_tied_once=True)
        loaded = load_file(once)
        assert "lm_head.weight" not in loaded and torch.equal(loaded["wte.weight"],
                                                              full["wte.weight"])
        with safe_open(once, "pt") as f:
            assert json.loads(f.metadata()["fsdp_ext.tied"]) == {"lm_head.weight": "wte.weight"}
        missing, unexpected = build_model("gpt").load_state_dict(loaded, strict=False)
        assert missing == ["lm_head.weight"] and not unexpected, (missing, unexpected)
    dist.barrier()


# ---- the launches -----------------------------------------------------------------------------------
def state_dict_worker(rank: int, world_size: int, directory: str) -> None:
    """World 4 runs every check (HSDP included) and saves for world 3; world 3 loads that and
    repeats the layout-dependent checks on the GPT at an odd size; world 2 (slow) runs them all."""
    cases = [Case("gpt", "fully_shard", "FULL_SHARD"), Case("mixed", "fsdp1", "FULL_SHARD"),
             Case("mlp", "fsdp1", "NO_SHARD")]
    if world_size == 3:
        cases = cases[:1]
    if world_size == 4:
        cases.append(Case("gpt", "fully_shard", "HYBRID_SHARD"))
    for case in cases:
        check_sharded_entries(case, world_size)
        check_load_forms(case, world_size)
    gpt_cases = [c for c in cases if c.model == "gpt"]
    if world_size != 3:
        for case in gpt_cases:
            check_optimizer(case, rank, world_size)
        check_state_dict_types(world_size, rank)
    for case in gpt_cases:
        check_safetensors(case, rank, world_size, directory)
    if world_size == 4:
        save_for_resharding(rank, world_size, directory)
    if world_size == 3:
        load_resharded(rank, world_size, directory)
    dist.barrier()
