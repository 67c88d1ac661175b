"""What torch's pipelining (`torch.distributed.pipelining`) asks of a stage module that
`fully_shard` sharded, answered on fsdp_ext's units.

torch's `PipelineStage` drives FSDP itself (torch 2.14, torch/distributed/pipelining/stage.py):

- around each micro-batch's backward (`backward_maybe_with_nosync`, ~936):
  `set_is_last_backward(False)`, `set_reshard_after_backward(False)`,
  `set_requires_gradient_sync(False)`: FSDPModule methods, which fsdp_ext's class has;
- after shape inference (~2257): `reshard()` on each FSDPModule, and `param.grad = None`;
- once every micro-batch ran backward (`perform_reduce_grad`, ~1271-1289): the three setters with
  True, then `fully_shard.state(module)._state_ctx.all_states[*]._fsdp_param_groups[*]
  .post_backward()` and `_root_post_backward_final_callback()`: torch's private state, looked up
  under torch's `fully_shard` in the module's composable-API states.

For the last, `register(module)` puts a `_StageState` there. Its `post_backward()` per unit
reduces what the no_sync micro-batches accumulated (grads.reduce_accumulated); the final callback
waits for those reductions, reshards and makes the step's one host sync
(Schedule.finish_reductions).

The schedules that split backward (ZBV, zero bubble, DualPipeV) take the weights' gradients in a
pass of their own: `stage_backward_weight(module.parameters(), ...)` (_backward.py ~281-337), an
`autograd.grad` over the sharded parameters. The units' views are made with the sharded
parameters as inputs of their autograd node (runtime/unit/params.py), so that pass reaches the
unit's gradient path, which sums them as torch's stage sums them into .grad (in the parameter
dtype, until the unit's next backward or this reduction: UnitParams.hold_weight_pass); the
parameters get zeros from it there, added to their .grad before the reduction adds the gradient.
tests/api/test_pipelining.py checks the calls above are still the ones torch's stage makes, and
fails the day they change.
"""
from __future__ import annotations

import inspect

import torch.distributed as dist
from torch import nn
from torch.distributed._composable.contract import STATE_KEY as _STATE_KEY
from torch.distributed._composable.replicate_with_fsdp import replicate as _torch_replicate
from torch.distributed.fsdp import fully_shard as _torch_fully_shard

from ..runtime.bucket.grads import reduce_accumulated
from ..runtime.core.registry import unit_of, units_with_paths


# The key torch's `fully_shard.state(module)` reads: the undecorated function its `contract`
# decorator closed over (found once, not at every fully_shard call).
_TORCH_STATE_KEY = inspect.getclosurevars(_torch_fully_shard.state).nonlocals["func"]
_TORCH_REPLICATE_KEY = inspect.getclosurevars(_torch_replicate.state).nonlocals["func"]


class _ParamGroup:
    """One unit, as torch's FSDPParamGroup for `post_backward()`."""

    def __init__(self, unit, stage: "_StageState"):
        self.unit, self.stage = unit, stage

    def post_backward(self, *unused) -> None:
        unit = self.unit
        if unit.schedule is None:
            return
        if unit.params.held is not None:  # weight passes since its last backward: reduced with
            unit.params.flush_held(unit)  # what the accumulators hold (gradient sync is on)
            self.stage.note_reduced()
        elif reduce_accumulated(unit):
            self.stage.note_reduced()


class _UnitState:
    def __init__(self, unit, stage: "_StageState"):
        self._fsdp_param_groups = [_ParamGroup(unit, stage)]


class _StateContext:
    def __init__(self, module: nn.Module, stage: "_StageState"):
        self.all_states = [_UnitState(unit, stage) for unit in units_with_paths(module)]


class _StageState:
    """What `fully_shard.state(stage_module)` returns for a module fsdp_ext sharded."""

    def __init__(self, module: nn.Module):
        self._module = module
        self.reduced = False  # since the last final callback: a post_backward() reduced something

    def note_reduced(self) -> None:
        self.reduced = True

    @property
    def _state_ctx(self) -> _StateContext:
        return _StateContext(self._module, self)

    def _root_post_backward_final_callback(self) -> None:
        unit = unit_of(self._module)
        if unit is None or unit.schedule is None:
            return
        reduced, self.reduced = self.reduced, False
        trainable = [u for u in units_with_paths(self._module) if u.params.grad_indices]
        if trainable and not reduced:
            # A schedule whose backward never reached the units' gradient path (one that takes
            # gradients otherwise than torch's stage does): refused rather than a silent step.
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise NotImplementedError(
                f"fsdp_ext: pipeline stage {type(self._module).__name__} ('{unit.name or '<root>'}'"
                f", rank {rank}) ran its micro-batches' backward without any "
                "gradient reaching its units: the schedule took the gradients otherwise than "
                "torch's PipelineStage backward and weight passes do")
        unit.schedule.finish_reductions()


def register(module: nn.Module) -> None:
    """Make torch's `fully_shard.state(module)` answer for fsdp_ext's unit of `module`."""
    states = module.__dict__.setdefault(_STATE_KEY, {})
    states[_TORCH_STATE_KEY] = _StageState(module)


def register_replicate(module: nn.Module) -> None:
    """The same for torch's `replicate.state(module)`, which the stage asks instead for a
    ReplicateModule (stage.py ~1277)."""
    states = module.__dict__.setdefault(_STATE_KEY, {})
    states[_TORCH_REPLICATE_KEY] = states[_TORCH_STATE_KEY]
