"""Hugging Face accelerate and transformers' Trainer with fsdp_ext
(fsdp_ext.integrations.accelerate) against the same scripts on torch's FSDP2, at world 2 on
CPU/gloo:

- examples/hf_trainer.py (Trainer, FSDP2 through fsdp_config, gradient accumulation and clipping,
  sharded checkpoints): the same micro-batch losses and trained parameters; resuming from either
  implementation's step-2 checkpoint continues with the same losses, and from a FULL_STATE_DICT
  checkpoint (one file, the Trainer's default); tied embeddings with bf16 mixed precision,
  cpu_ram_efficient_loading and activation checkpointing (accelerate then shards
  [final norm, embedding, head] as one list unit, on the meta device, loads rank 0's weights, and
  wraps each block in torch's checkpoint_wrapper);
- an accelerate loop (accumulate(), clip_grad_norm_, save_state / load_state, get_state_dict),
  and the same loop with HSDP (ParallelismConfig: 2 replicas x 2 shards, world 4);
- what is refused (the FSDP1 path) raises at prepare(), naming the setting.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Replicate, Shard

import fsdp_ext

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from examples.hf_trainer import build_model, dataset, train  # noqa: E402  (examples/)

from ..helpers.dist import run_distributed  # noqa: E402

FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = FP32  # measured equal to the last bit; both reduce in the same dtype and order


def _launch_env(rank: int, world: int) -> None:
    """What torchrun sets: accelerate reads the launch from the environment."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))


def _same_params(ours: dict, theirs: dict, tol: dict, what: str) -> None:
    assert list(ours) == list(theirs), (what, list(ours), list(theirs))
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, **tol, msg=lambda m: f"{what}: {name}: {m}")


def trainer_worker(rank: int, world: int, directory: str) -> None:
    _launch_env(rank, world)
    runs = {name: train(name, 4, os.path.join(directory, name)) for name in ("torch", "fsdp_ext")}
    (l_torch, p_torch, m_torch), (l_ours, p_ours, m_ours) = runs["torch"], runs["fsdp_ext"]
    assert isinstance(m_ours, fsdp_ext.FSDPModule) and isinstance(m_torch, FSDPModule)
    assert not isinstance(m_torch, fsdp_ext.FSDPModule)
    # accelerate's grouping of the final norm and the head: one fsdp_ext unit
    assert m_ours.lm_head._unit is m_ours.model.norm._unit, "norm and head in one unit"
    assert len(l_ours) == 8 and len(set(l_ours)) > 1, l_ours  # 4 steps x 2 micro-batches
    torch.testing.assert_close(l_ours, l_torch, **FP32)
    _same_params(p_ours, p_torch, FP32, "trained parameters")
    for source in ("fsdp_ext", "torch"):
        resumed, p_resumed, _ = train("fsdp_ext", 4, os.path.join(directory, "resumed"),
                                   resume_from=os.path.join(directory, source, "checkpoint-2"))
        torch.testing.assert_close(resumed, l_torch[4:], **FP32,
                                   msg=lambda m: f"resumed from {source}'s checkpoint: {m}")
        _same_params(p_resumed, p_torch, FP32, f"resumed from {source}'s checkpoint")
    full = os.path.join(directory, "full")  # FULL_STATE_DICT checkpoints (the Trainer's default)
    l_full, _, _ = train("fsdp_ext", 4, full, state_dict_type="FULL_STATE_DICT")
    torch.testing.assert_close(l_full, l_torch, **FP32)
    resumed, _, _ = train("fsdp_ext", 4, os.path.join(directory, "resumed-full"),
                          resume_from=os.path.join(full, "checkpoint-2"),
                          state_dict_type="FULL_STATE_DICT")
    torch.testing.assert_close(resumed, l_torch[4:], **FP32, msg=lambda m: f"full checkpoint: {m}")
    tied = {name: train(name, 2, os.path.join(directory, f"tied-{name}"), tied=True, bf16=True,
                        ram_efficient=True, checkpointing=True)
            for name in ("torch", "fsdp_ext")}
    unit = tied["fsdp_ext"][2].lm_head._unit
    assert unit is tied["fsdp_ext"][2].model.embed_tokens._unit, unit.name
    torch.testing.assert_close(tied["fsdp_ext"][0], tied["torch"][0], **BF16)
    _same_params(tied["fsdp_ext"][1], tied["torch"][1], BF16, "tied, bf16")
    dist.barrier()


def _fresh_state() -> None:
    """accelerate keeps its state in process-wide singletons: a new plugin needs them emptied
    (the process group stays)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _accelerate_loop(fsdp: str, directory: str, resume: bool,
                     hsdp: bool = False) -> tuple[list[float], dict]:
    """An accelerate script: accumulate(), clip_grad_norm_, save_state at step 2, and (resume)
    load_state from it before steps 3-4; the losses of the steps it ran and get_state_dict.
    `hsdp`: accelerate's ParallelismConfig with 2 replicas of 2 shards (world 4)."""
    import fsdp_ext.integrations.accelerate as switch
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    switch.enable(fsdp)
    _fresh_state()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2,
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    parallelism = None
    if hsdp:
        from accelerate.parallelism_config import ParallelismConfig
        parallelism = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    accelerator = Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=2, cpu=True,
                              parallelism_config=parallelism)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(model, fsdp_ext.FSDPModule) == (fsdp == "fsdp_ext"), type(model).__mro__
    if hsdp:  # replicated across the 2 replicas, sharded within each
        placements = model.model.layers[0].self_attn.q_proj.weight.placements
        assert placements == (Replicate(), Shard(0)), placements
    data = dataset()
    rank, world = dist.get_rank(), dist.get_world_size()
    first = 2 if resume else 0
    if resume:
        accelerator.load_state(os.path.join(directory, "state"))
    losses = []
    for step in range(first, 4):
        for micro in range(2):
            i = (step * 2 + micro) * world + rank
            batch = {k: torch.stack([data[i][k], data[i + 32][k]]) for k in data[i]}
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(float(loss.detach()))
        if step == 1 and not resume:
            accelerator.save_state(os.path.join(directory, "state"))
    return losses, accelerator.get_state_dict(model)


def accelerate_worker(rank: int, world: int, directory: str) -> None:
    _launch_env(rank, world)
    l_torch, sd_torch = _accelerate_loop("torch", os.path.join(directory, "torch"), False)
    l_ours, sd_ours = _accelerate_loop("fsdp_ext", os.path.join(directory, "ours"), False)
    torch.testing.assert_close(l_ours, l_torch, **FP32)
    if rank == 0:  # get_state_dict gathers the full state dict to rank 0
        _same_params(sd_ours, sd_torch, FP32, "get_state_dict")
    resumed, _ = _accelerate_loop("fsdp_ext", os.path.join(directory, "ours"), True)
    torch.testing.assert_close(resumed, l_torch[4:], **FP32)
    _refused()
    dist.barrier()


def hsdp_worker(rank: int, world: int, directory: str) -> None:
    _launch_env(rank, world)
    l_torch, _ = _accelerate_loop("torch", os.path.join(directory, "torch"), False, hsdp=True)
    l_ours, _ = _accelerate_loop("fsdp_ext", os.path.join(directory, "ours"), False, hsdp=True)
    torch.testing.assert_close(l_ours, l_torch, **FP32)
    dist.barrier()


def _refused() -> None:
    import fsdp_ext.integrations.accelerate as switch
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    switch.enable()
    _fresh_state()
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1), cpu=True)
    model = build_model()
    with pytest.raises(NotImplementedError, match="fsdp_version=2"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    switch.disable()


def test_trainer_matches_torch_fsdp2_and_resumes(tmp_path):
    run_distributed(trainer_worker, 2, str(tmp_path), timeout_s=300)


def test_accelerate_loop_matches_torch_fsdp2(tmp_path):
    run_distributed(accelerate_worker, 2, str(tmp_path), timeout_s=300)


@pytest.mark.slow
@pytest.mark.essential
def test_accelerate_hsdp_matches_torch_fsdp2(tmp_path):
    """ParallelismConfig(dp_replicate_size=2, dp_shard_size=2): a 2-D mesh, HSDP, at world 4."""
    run_distributed(hsdp_worker, 4, str(tmp_path), timeout_s=300)
