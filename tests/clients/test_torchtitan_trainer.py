"""torchtitan 0.3.0's own trainer (`torchtitan.train`, llama3 `llama3_debugmodel`, the default
`spmd_types` backend, chunked loss, selective activation checkpointing, AdamW, DCP checkpoints)
at world 2 on CPU, once with torch's FSDP2 as shipped and once with `fully_shard` swapped for
fsdp_ext's (tests/helpers/titan_cpu.py: the swap and the CPU shims):

- the losses, the largest per-rank loss and the gradient norm agree bitwise every step;
- a checkpoint saved by one implementation at step 2 resumes under the other, and the resumed
  run's steps 3-4 agree bitwise with the uninterrupted runs' (both directions);
- as many gradient reductions as torch's, sending as many elements, with the chunked loss and
  with DeepSeek V3's multi-token prediction (its embedding and head used twice per forward);
- the same with every transformer block compiled (`compile(fullgraph=True)`, aot_eager);
- the same at world 4 with tensor parallelism 2, on its default backend and on full_dtensor;
- the same at world 4 with context parallelism 2 on full_dtensor (two shard axes flattened);
- the same with pipeline parallelism 2 at world 4 (1F1B with a checkpoint resumed across
  implementations, Interleaved1F1B, ZBVZeroBubble);
- the same for its Qwen3 MoE (EP 1 at world 2 and 4; EP 2 at world 4, on its default spmd_types
  backend, with a checkpoint resumed across implementations, and on its partial_dtensor and
  full_dtensor ones);
- the same with its Kimi optimizer recipe (DistMuon for the blocks' matrices, AdamW for the rest),
  with a checkpoint of torch's resumed under fsdp_ext.
"""
from __future__ import annotations

import json
import os

import pytest

from ..helpers.titan_cpu import SMALL, launch, make_assets, qwen3_moe

STEPS, SAVE_AT = 4, 2
COMPARED = ("loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "grad_norm")


def _trajectory(records: list[dict]) -> dict[int, tuple[float, ...]]:
    return {r["step"]: tuple(r[k] for k in COMPARED) for r in records}


def _both(tmp_path, assets, args: list[str], steps: int, logged: str = "",
          same_reductions: bool = False, **launch_kw) -> dict[str, dict]:
    """Torch's FSDP2, then fsdp_ext, on the same arguments: each run's trajectory (every step
    1..steps), checked for the swap (and `logged`) in its log and equal between the two.
    `same_reductions`: fsdp_ext also issued as many gradient reductions as torch's, sending as
    many elements (titan_cpu.count_gradient_collectives)."""
    runs, reductions = {}, {}
    for impl in ("torch", "fsdp_ext"):
        records, log = launch(impl, str(tmp_path / impl), assets, args, **launch_kw)
        assert f"FSDP implementation: {impl} (" in log     # the swap took (or was not made)
        assert logged in log
        runs[impl] = _trajectory(records)
        assert sorted(runs[impl]) == list(range(1, steps + 1))
        with open(tmp_path / impl / "grad_collectives.json") as f:
            reductions[impl] = json.load(f)
    assert runs["fsdp_ext"] == runs["torch"]
    if same_reductions:
        assert reductions["fsdp_ext"] == reductions["torch"], reductions
    return runs


BOTH_WAYS = (("torch", "fsdp_ext"), ("fsdp_ext", "torch"))


def _resume_across(tmp_path, assets, runs: dict, steps: int, saved_at: int,
                   directions=BOTH_WAYS, label: str = "", **launch_kw) -> None:
    """Each implementation resumes from the other's step-`saved_at` checkpoint (model, optimizer,
    lr scheduler, dataloader, step; load_only keeps that folder as it was): its later steps equal
    the uninterrupted run's. `directions`: (source, resumer) pairs; `label` tells the resumed
    runs' folders apart from another call's."""
    uninterrupted = {s: v for s, v in runs["torch"].items() if s > saved_at}
    for source, impl in directions:
        resume = ["--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.load_only",
                  "--checkpoint.folder", str(tmp_path / source / "checkpoint"),
                  "--checkpoint.load_step", str(saved_at)]
        records, _ = launch(impl, str(tmp_path / f"{impl}{label}_from_{source}"), assets, resume,
                            **launch_kw)
        assert _trajectory(records) == uninterrupted, f"{impl} from {source}'s step {saved_at}"


@pytest.mark.slow
@pytest.mark.essential
def test_torchtitan_trainer_fsdp_ext_matches_torch_fsdp2(tmp_path):
    assets = make_assets(str(tmp_path / "assets"))
    save = ["--training.steps", str(STEPS), "--checkpoint.enable",
            "--checkpoint.interval", str(SAVE_AT)]
    runs = _both(tmp_path, assets, save, STEPS, same_reductions=True)  # (the chunked loss)
    for impl in ("torch", "fsdp_ext"):
        assert os.path.isdir(tmp_path / impl / "checkpoint" / f"step-{SAVE_AT}")
    assert runs["torch"][STEPS][0] < runs["torch"][1][0]    # it trains
    _resume_across(tmp_path, assets, runs, STEPS, SAVE_AT)


@pytest.mark.slow
@pytest.mark.essential
def test_torchtitan_trainer_dist_muon_matches_torch_fsdp2(tmp_path):
    """llama3 with torchtitan's Kimi recipe (tests/helpers/titan_overrides.py `dist_muon`: its
    DistMuon per head for the fused wqkv, whole for wo/w1/w2/w3; AdamW for the rest): the losses and
    gradient norms agree bitwise every step, and fsdp_ext resumes torch's checkpoint (DistMuon's
    momentum included) onto the same trajectory. fsdp_ext with its own Muon in DistMuon's place
    (`fsdp_ext_muon`) gives the same trajectory, and resumes the same checkpoint onto it."""
    assets = make_assets(str(tmp_path / "assets"))
    muon = ["--override.imports",
            'tests.helpers.titan_overrides.dist_muon={"n_layers": 6, "head_dim": 16}']
    save = [*muon, "--training.steps", str(STEPS), "--checkpoint.enable",
            "--checkpoint.interval", str(SAVE_AT)]
    runs = _both(tmp_path, assets, save, STEPS, logged="DistMuon")
    assert runs["torch"][STEPS][0] < runs["torch"][1][0]    # it trains
    _resume_across(tmp_path, assets, runs, STEPS, SAVE_AT, directions=(("torch", "fsdp_ext"),),
                   base=[*SMALL, *muon])
    # fsdp_ext's own Muon on the same split (tests/helpers/titan_overrides.py `fsdp_ext_muon`):
    # torch's trajectory under DistMuon, bit for bit, from the start and from its checkpoint
    # (DistMuon's momenta are fsdp_ext's Muon's: one per matrix, placed as the parameter)
    own = ["--override.imports", 'tests.helpers.titan_overrides.fsdp_ext_muon={"head_dim": 16}']
    records, log = launch("fsdp_ext", str(tmp_path / "fsdp_ext_muon"), assets,
                          [*own, "--training.steps", str(STEPS)])
    assert "Optimizer Muon" in log and "DistMuon" not in log
    assert _trajectory(records) == runs["torch"]
    _resume_across(tmp_path, assets, runs, STEPS, SAVE_AT, directions=(("torch", "fsdp_ext"),),
                   label="_muon", base=[*SMALL, *own])


@pytest.mark.slow
@pytest.mark.essential
def test_torchtitan_trainer_multi_token_prediction_matches_torch_fsdp2(tmp_path):
    """DeepSeek V3 with multi-token prediction (`deepseek_v3_debugmodel_mtp`, cut to CPU size):
    its embedding and output head run twice per forward. Bitwise equal to torch's FSDP2, with as
    many gradient reductions and elements sent: each unit reduced once per backward."""
    assets = make_assets(str(tmp_path / "assets"))
    mtp = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel_mtp",
           "--training.seq_len", "128", "--training.local_batch_size", "2",
           "--training.disable_cuda_graphs", "--debug.seed", "42"]
    _both(tmp_path, assets, ["--training.steps", "3"], 3, same_reductions=True, base=mtp)


@pytest.mark.slow
@pytest.mark.essential
def test_torchtitan_trainer_compiled_blocks_match_torch_fsdp2(tmp_path):
    """`--compile.enable --compile.components model`: torchtitan compiles each transformer
    block with `fullgraph=True` (a graph break inside a block would raise), here with aot_eager
    (its FlexAttention region too: titan_cpu's shim). Bitwise equal to torch's FSDP2, with as
    many gradient reductions and elements sent."""
    assets = make_assets(str(tmp_path / "assets"))
    compiled = ["--training.steps", "3", "--compile.enable", "--compile.components", "model",
                "--compile.backend", "aot_eager"]
    _both(tmp_path, assets, compiled, 3, logged="Compiling each TransformerBlock",
          same_reductions=True)


@pytest.mark.slow
@pytest.mark.essential
def test_torchtitan_trainer_hsdp_world4_matches_torch_fsdp2(tmp_path):
    """World 4 as HSDP (dp_replicate 2 x dp_shard 2: torchtitan passes both axes through
    dp_mesh_dims): the losses and gradient norms agree bitwise every step."""
    assets = make_assets(str(tmp_path / "assets"))
    hsdp = ["--training.steps", "4", "--parallelism.data_parallel_replicate_degree", "2",
            "--parallelism.data_parallel_shard_degree", "2"]
    _both(tmp_path, assets, hsdp, 4, world_size=4)


# Backends other than torchtitan's default are not essential: the default tier's
# tests/api/test_dp_mesh_dims.py and tests/api/test_expert_parallel.py run fsdp_ext on the parameters
# those backends leave, against torch's fully_shard.
@pytest.mark.slow
@pytest.mark.parametrize("backend", [pytest.param("spmd_types", marks=pytest.mark.essential),
                                     "full_dtensor"])
def test_torchtitan_trainer_tensor_parallel_matches_torch_fsdp2(tmp_path, backend):
    """World 4 as (dp_shard 2, tp 2): torchtitan's tensor parallelism on its default backend
    (plain weights annotated S(dim) on tp, norms R: their gradients summed over tp) and on
    full_dtensor (DTensors on the storage mesh): losses and gradient norms bitwise equal."""
    assets = make_assets(str(tmp_path / "assets"))
    tp = ["--training.steps", "3", "--parallelism.tensor_parallel_degree", "2",
          "--parallelism.spmd_backend", backend]
    _both(tmp_path, assets, tp, 3, world_size=4)


@pytest.mark.slow
def test_torchtitan_trainer_context_parallel_full_dtensor_matches_torch_fsdp2(tmp_path):
    """World 4 as (dp_shard 2, cp 2) on the full_dtensor backend: its parameters are DTensors on
    the storage mesh and its dp_mesh_dims shard over ("dp_shard", "cp"), flattened into one
    shard axis: losses and gradient norms bitwise equal. (CP's flex attention takes sequences
    of 2 x its 128-token block: seq_len 256.)"""
    assets = make_assets(str(tmp_path / "assets"))
    cp = ["--training.steps", "3", "--parallelism.context_parallel_degree", "2",
          "--parallelism.spmd_backend", "full_dtensor", "--training.seq_len", "256"]
    _both(tmp_path, assets, cp, 3, world_size=4)


@pytest.mark.slow
@pytest.mark.essential
@pytest.mark.parametrize("world_size,num_experts,top_k,placement", [
    (2, 4, 2, "Shard(dim=0)"),     # experts >= FSDP degree: torchtitan shards dim 0
    (4, 2, 1, "Shard(dim=1)"),     # experts < FSDP degree: its shard_placement_fn picks Shard(1)
])
def test_torchtitan_trainer_qwen3_moe_matches_torch_fsdp2(tmp_path, world_size, num_experts,
                                                          top_k, placement):
    """torchtitan's trainer on its Qwen3 MoE debug config (`qwen3_moe_debug`, EP=1, cut to CPU
    size by tests/titan_cpu.qwen3_moe), whose apply_fsdp_to_decoder shards the routed experts
    Shard(0), or Shard(1) through a shard_placement_fn where the experts are fewer than the
    ranks: the losses and gradient norms agree bitwise every step, and it trains."""
    assets = make_assets(str(tmp_path / "assets"))
    runs = _both(tmp_path, assets, ["--training.steps", "4"], 4,
                 f"FSDP expert placements: ({placement},)", world_size=world_size,
                 base=qwen3_moe(num_experts, top_k))
    assert runs["torch"][4][0] < runs["torch"][1][0]        # it trains


@pytest.mark.slow
@pytest.mark.parametrize("backend,num_experts,top_k,placement,resume", [
    # torchtitan's default backend: experts are plain tensors annotated S(0) on `ep`, their
    # mesh-info names the sparse mesh's axes (dp_mesh_dims); 2 experts < efsdp x ep: Shard(1)
    pytest.param("spmd_types", 2, 1, "(Shard(dim=1), Shard(dim=0))", True,
                 marks=pytest.mark.essential),
    # experts are DTensors Shard(0) on `ep`, their mesh-info the 1-D efsdp mesh; 4 experts:
    # Shard(0) again over efsdp, a strided shard of the global rows
    ("partial_dtensor", 4, 2, "(_StridedShard(dim=0, sf=2), Shard(dim=0))", False),
    # every parameter a DTensor on its storage mesh: the experts (Replicate(), Shard(0)) on
    # (efsdp, ep), their gradients Partial over efsdp
    ("full_dtensor", 2, 1, "(Shard(dim=1), Shard(dim=0))", False),
])
def test_torchtitan_trainer_qwen3_moe_ep2_matches_torch_fsdp2(tmp_path, backend, num_experts,
                                                              top_k, placement, resume):
    """Expert parallelism: Qwen3 MoE at world 4 with EP 2 (torchtitan's token all-to-all over
    `ep`; apply_fsdp_to_decoder shards the routed experts over `efsdp` through per-parameter
    meshes, the rest over the 4 ranks): losses and gradient norms bitwise equal to torch's FSDP2
    every step; on the default backend, a step-2 checkpoint of either implementation resumes
    under the other with steps 3-4 bitwise equal."""
    assets = make_assets(str(tmp_path / "assets"))
    base = qwen3_moe(num_experts, top_k) + ["--parallelism.expert_parallel_degree", "2",
                                            "--parallelism.spmd_backend", backend]
    save = ["--checkpoint.enable", "--checkpoint.interval", "2"] if resume else []
    runs = _both(tmp_path, assets, ["--training.steps", "4", *save], 4,
                 f"FSDP expert placements: {placement}", world_size=4, base=base)
    assert runs["torch"][4][0] < runs["torch"][1][0]        # it trains
    if resume:
        _resume_across(tmp_path, assets, runs, 4, 2, world_size=4, base=base)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,resume", [
    pytest.param("1F1B", True, marks=pytest.mark.essential),
    ("Interleaved1F1B", False),   # (the default tier's tests/api/test_pipelining.py runs it too)
    pytest.param("ZBVZeroBubble", False, marks=pytest.mark.essential),
])
def test_torchtitan_trainer_pipeline_parallel_matches_torch_fsdp2(tmp_path, schedule, resume):
    """World 4 as PP 2 x FSDP 2 (torchtitan's pipeline_llm: torch's PipelineStage and schedule
    drive each stage's FSDPModule, tests/api/test_pipelining.py): the gradient norms (global; the
    losses live on the last stage's ranks, rank 0 logs none) bitwise equal every step; under
    1F1B, fsdp_ext resumes torch's step-2 checkpoint with step 3 bitwise equal (both ways are
    shown on the non-pipelined runs above). ZBV (two stages per rank in a V, backward split into
    input and weight passes, bf16 parameters: the weight passes' sums in bf16 as torch's stage
    makes them) runs without activation checkpointing (torch's own run fails on CPU under
    torchtitan's default selective checkpointing) and with the unchunked loss
    (tests/helpers/titan_overrides.py `unchunked_loss`: under the chunked one torch's FSDP2
    loses the final norm's gradient)."""
    assets = make_assets(str(tmp_path / "assets"))
    pp = ["--parallelism.pipeline_parallel_degree", "2",
          "--parallelism.pipeline_parallel_schedule", schedule]
    last = []  # (a subcommand: after every option)
    if schedule == "ZBVZeroBubble":
        pp += ["--override.imports", "tests.helpers.titan_overrides.unchunked_loss"]
        last = ["activation_checkpoint:none"]
    save = ["--checkpoint.enable", "--checkpoint.interval", "2"] if resume else []
    runs = _both(tmp_path, assets, ["--training.steps", "3", *save, *last], 3, world_size=4,
                 base=SMALL + pp)
    assert len({grad_norm for *_, grad_norm in runs["torch"].values()}) == 3  # it trains
    if resume:
        _resume_across(tmp_path, assets, runs, 3, 2, directions=BOTH_WAYS[:1], world_size=4,
                       base=SMALL + pp)
