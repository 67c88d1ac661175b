"""Pipeline parallelism with torch's `torch.distributed.pipelining` on fsdp_ext's units
(fsdp_ext/api/pipelining.py answers what torch's stage asks of an FSDP module):

- torch's stage code still makes the calls that module answers (read from its source: the day
  torch changes them, this fails and names the line);
- PP 2 x FSDP 2 at world 4, one script run with torch's `fully_shard` and with fsdp_ext's, under
  Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B (two stages per rank) and
  ScheduleZBVZeroBubble (two stages per rank in a V, backward split into input and weight
  passes): every loss, gradient and trained parameter bit for bit; and under Schedule1F1B with
  each stage replicated (`replicate`, whose ReplicateModule the stage asks `replicate.state` of);
- the other schedules that split backward (ScheduleInterleavedZeroBubble, ScheduleDualPipeV),
  the same, in the slow tier;
- torchtitan's own trainer with PP is in tests/clients/test_torchtitan_trainer.py.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_ext

from ..helpers.dist import run_distributed

WIDTH, LAYERS, MICRO_BATCHES = 16, 4, 4


def test_torch_stage_still_makes_the_calls_fsdp_ext_answers():
    """The calls fsdp_ext/api/pipelining.py answers, in the torch functions that make them
    (torch 2.14: torch/distributed/pipelining/stage.py, backward_maybe_with_nosync ~936,
    perform_reduce_grad ~1271-1289, _shape_inference ~2257), and the weight pass
    runtime/unit/params.py recognises (_backward.py stage_backward_weight ~281-337: an
    autograd.grad over the stage's parameters, its result added to their .grad)."""
    from torch.distributed.pipelining import _backward, stage
    expected = {
        _backward.stage_backward_weight: [
            "torch.autograd.grad(", "weight.grad = dw", "weight.grad += dw"],
        stage._PipelineStageBase.backward_maybe_with_nosync: [
            "isinstance(self.submod, FSDPModule)", "set_is_last_backward(False)",
            "set_reshard_after_backward(False)", "set_requires_gradient_sync(False)"],
        stage._PipelineStageBase.perform_reduce_grad: [
            "set_is_last_backward(True)", "set_reshard_after_backward(True)",
            "set_requires_gradient_sync(True)", "fully_shard.state(fsdp_module)",
            "isinstance(fsdp_module, ReplicateModule)", "replicate.state(fsdp_module)",
            "_state_ctx.all_states", "_fsdp_param_groups", ".post_backward()",
            "_root_post_backward_final_callback()"],
    }
    for function, calls in expected.items():
        source = inspect.getsource(function)
        missing = [call for call in calls if call not in source]
        assert not missing, (f"torch's {function.__qualname__} "
                             f"({inspect.getsourcefile(function)}:"
                             f"{inspect.getsourcelines(function)[1]}) no longer makes {missing}: "
                             "fsdp_ext/api/pipelining.py answers those calls")
    # The state object is found where torch's fully_shard.state(module) looks.
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    module = fsdp_ext.fully_shard(nn.Linear(4, 4))
    state = torch_fully_shard.state(module)
    assert state is not None and hasattr(state, "_root_post_backward_final_callback")
    # a stage whose gradients never reached its units when the schedule reduces is refused
    module(torch.ones(2, 4)).sum()
    with pytest.raises(NotImplementedError, match=r"ran its micro-batches' backward without any "
                                                  r"gradient reaching its units"):
        state._root_post_backward_final_callback()
    assert [len(s._fsdp_param_groups) for s in state._state_ctx.all_states] == [1]
    # ... and where torch's replicate.state(module) looks, for a module fsdp_ext replicated.
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
    replicated = fsdp_ext.replicate(nn.Linear(4, 4))
    assert torch_replicate.state(replicated) is torch_fully_shard.state(replicated) is not None


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def _stage_ids(schedule: str, pp_rank: int, pp_size: int) -> tuple[list[int], int]:
    """(this rank's stage indices, number of stages): one per rank, or two for the looped
    schedules (Interleaved1F1B, InterleavedZeroBubble: rank r holds r and r + pp; the V-shaped
    ZBVZeroBubble and DualPipeV: r and 2 pp - 1 - r)."""
    if schedule in ("1F1B", "GPipe"):
        return [pp_rank], pp_size
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return [pp_rank, 2 * pp_size - 1 - pp_rank], 2 * pp_size
    return [pp_rank, pp_rank + pp_size], 2 * pp_size


def train(fully_shard, schedule: str, steps: int = 3) -> dict:
    """PP 2 x FSDP 2: the model's blocks cut into stages, each stage's blocks and the stage
    sharded over the dp axis, AdamW; returns this rank's losses (last stage), its stages'
    gradients after the last step's backward and their trained parameters (full)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp = mesh["pp"].get_local_rank(), mesh["dp"]
    torch.manual_seed(0)
    blocks = [Block() for _ in range(LAYERS)]
    ids, n_stages = _stage_ids(schedule, pp_rank, 2)
    per_stage = LAYERS // n_stages
    parts = []
    for index in ids:
        part = copy.deepcopy(nn.Sequential(*blocks[index * per_stage:(index + 1) * per_stage]))
        for block in part:
            fully_shard(block, mesh=dp, reshard_after_forward=False)
        parts.append((index, fully_shard(part, mesh=dp)))
    stages = [PipelineStage(part, index, n_stages, torch.device("cpu"),
                            group=mesh["pp"].get_group()) for index, part in parts]
    cls = get_schedule_class(schedule)
    looped = len(stages) > 1
    pipeline = cls(stages if looped else stages[0], n_microbatches=MICRO_BATCHES,
                   loss_fn=lambda out, target: (out - target).square().mean(), scale_grads=True)
    params = [(f"{i}.{n}", p) for i, part in parts for n, p in part.named_parameters()]
    opt = torch.optim.AdamW([p for _, p in params], lr=1e-2)
    data = torch.Generator().manual_seed(dp.get_local_rank())
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    losses, grads = [], {}
    for _ in range(steps):
        x, y = torch.randn(8, WIDTH, generator=data), torch.randn(8, WIDTH, generator=data)
        step_losses = []
        targets = dict(target=y, losses=step_losses) if last else {}
        pipeline.step(*((x,) if first else ()), **targets)
        losses.extend(step_losses)
        grads = {n: p.grad.full_tensor() for n, p in params}
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, grads=grads, last=last,
                params={n: p.full_tensor() for n, p in params},
                placements={n: str(p.placements) for n, p in params})


def _same(what: str, ours, theirs) -> None:
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), (what, list(ours), list(theirs))
        for key in theirs:
            _same(f"{what} {key}", ours[key], theirs[key])
    elif isinstance(theirs, list):
        assert len(ours) == len(theirs), what
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same(f"{what}[{i}]", a, b)
    elif isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs), (what, ours, theirs)
    else:
        assert ours == theirs, (what, ours, theirs)


def _replicating(replicate):
    """`replicate` called as train() calls fully_shard (it takes no reshard_after_forward)."""
    return lambda module, mesh, reshard_after_forward=None: replicate(module, mesh=mesh)


def schedules_worker(rank: int, world_size: int) -> None:
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
    _same_as_torch(rank, ("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble"))
    # each stage replicated over dp (torch's stage asks replicate.state for a ReplicateModule)
    ours = train(_replicating(fsdp_ext.replicate), "1F1B")
    theirs = train(_replicating(torch_replicate), "1F1B")
    assert set(theirs["placements"].values()) == {"(Replicate(),)"}
    _same(f"rank {rank} 1F1B replicated", ours, theirs)
    dist.barrier()


def _same_as_torch(rank: int, schedules) -> None:
    import torch.distributed.fsdp as torch_fsdp
    for schedule in schedules:
        ours = train(fsdp_ext.fully_shard, schedule)
        theirs = train(torch_fsdp.fully_shard, schedule)
        assert theirs["grads"] and (theirs["losses"] or not theirs["last"]), schedule
        _same(f"rank {rank} {schedule}", ours, theirs)


def test_pipeline_schedules_match_torch_fsdp2_world_4():
    run_distributed(schedules_worker, 4, timeout_s=300.0)


def _split_backward_worker(rank: int, world_size: int) -> None:
    _same_as_torch(rank, ("InterleavedZeroBubble", "DualPipeV"))
    dist.barrier()


@pytest.mark.slow
def test_split_backward_schedules_match_torch_fsdp2_world_4():
    run_distributed(_split_backward_worker, 4, timeout_s=300.0)
