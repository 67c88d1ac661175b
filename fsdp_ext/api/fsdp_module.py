"""`FSDPModule`: the class every module passed to `fully_shard` joins, with torch's methods.

It subclasses torch's own `torch.distributed.fsdp.FSDPModule`, so `isinstance(m, FSDPModule)` in
accelerate, transformers, Lightning or torch's pipelining holds for either import. Every public
method of torch's class is defined here: it does what torch's documentation says on fsdp_ext's
runtime, or raises NotImplementedError naming itself (docs/compat.md lists which). torch's
`register_fsdp_forward_method` reaches the unit through `_get_fsdp_state()`, defined here too.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as _TorchUnshardHandle

from ..runtime.comm import collectives as comm, process_groups
from ..runtime.bucket.adopt import refuse_cast
from ..runtime.unit.forward_methods import run_method
from ..runtime.core.registry import UNIT_ATTR, unit_of
from ..runtime.unit.schedule_options import ScheduleOptions
from ..runtime.unit.unit import Unit
from ..state.load_checks import load_problems
from .clip import clip_grad_norm_


class UnshardHandle(_TorchUnshardHandle):
    """What `unshard(async_op=True)` returns: `wait()` makes the gathered parameters the module's
    (the next forward would wait for them itself)."""

    def __init__(self, unit: Unit):
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.wait_unshard()
            if self._unit.unsharded:
                self._unit.params.install_unsharded(self._unit)
            self._unit = None


class _StateView:
    """What torch's register_fsdp_forward_method needs of `_get_fsdp_state()`."""

    def __init__(self, unit: Unit):
        self.unit = unit

    def _pre_forward(self, module, args, kwargs):
        args, kwargs = self.unit._pre_forward(module, args, kwargs)
        self.unit.enter_method()
        return args, kwargs

    def _post_forward(self, module, args, output):
        self.unit.leave_method()
        result = self.unit._post_forward(module, args, {}, output)
        return output if result is None else result


def _units_under(module: nn.Module, recurse: bool) -> list[Unit]:
    modules = module.modules() if recurse else [module]
    return list(dict.fromkeys(u for m in modules if (u := unit_of(m)) is not None))


def _fsdp_units(modules, method: str) -> list[Unit]:
    units = []
    for module in modules:
        if (unit := unit_of(module)) is None:
            raise ValueError(f"{method}: expects FSDPModules (modules given to fully_shard), got "
                             f"{type(module).__name__}")
        units.append(unit)
    return list(dict.fromkeys(units))  # the modules of one list unit name it once


class FSDPModule(_TorchFSDPModule):
    """Joined by every module passed to `fully_shard` (its class becomes a subclass)."""

    # torch's __new__ builds the original class (containers indexing into themselves); the MRO
    # here is [FSDP<Orig>, fsdp_ext's FSDPModule, torch's FSDPModule, Orig, ...].
    _orig_cls_mro_index = 3

    @property
    def _unit(self) -> Unit:
        return self.__dict__[UNIT_ATTR]

    def _get_fsdp_state(self) -> _StateView:
        return _StateView(self._unit)

    # ---- unshard / reshard --------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (not recursive) and make them the module's; with
        `async_op=True` return a handle whose `wait()` does the latter (pre-forward waits too)."""
        unit = self._unit
        unit.unshard(async_op=True)
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the gathered parameters and register the sharded ones (not recursive)."""
        self._unit.reshard()

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: wait for collectives in flight, drop the failed
        step's gradients and reshard everything, so that the next iteration runs. Root only."""
        unit = self._unit
        if unit.schedule is None or unit.schedule.standalone:
            return  # nothing ran yet
        if not unit.is_root:
            raise RuntimeError(f"reset_iter_state() must be called on the root FSDPModule, not on "
                               f"{type(self).__name__} ('{unit.name}')")
        unit.schedule.reset_iter_state()

    # ---- gradient synchronisation -------------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: accumulate gradients unsharded without communication (FSDP1's no_sync)."""
        for unit in _units_under(self, recurse):
            unit.set_requires_gradient_sync(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters but defers the all-reduce over replicas (the partial sums
        are added to the next reduction that all-reduces)."""
        for unit in _units_under(self, recurse):
            unit.set_requires_all_reduce(requires_all_reduce)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the next backward's end does not wait for its gradient reductions (they finish
        by the next backward's end or the next forward). Set True for the last micro-batch.
        Schedule-wide: on the root (or, after the first forward, any module of its tree)."""
        _schedule_options(self._unit).update(is_last_backward=bool(is_last_backward))

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduced gradients are the sum divided by `factor` (default: the data-parallel size)."""
        for unit in _units_under(self, False):
            unit.set_gradient_divide_factor(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        warnings.warn("set_reduce_scatter_divide_factor is deprecated; use "
                      "set_gradient_divide_factor", FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """fsdp_ext's reductions are always SUM (the divide is fused into its kernels), which is
        what True asks for; False lets torch use AVG / PREMUL_SUM, with the same results: both
        are honoured by doing nothing."""
        if not isinstance(enable, bool):
            raise TypeError(f"enable must be a bool, got {type(enable).__name__}")

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """fsdp_ext always reduces zeros for parameters a rank did not use (so ranks that use
        different parameters never mismatch), which is True's behaviour; with False torch skips
        them, which gives the same gradients wherever its collectives still match: both are
        honoured by doing nothing."""
        if not isinstance(reduce_scatter_unused_params, bool):
            raise TypeError("reduce_scatter_unused_params must be a bool, got "
                            f"{type(reduce_scatter_unused_params).__name__}")

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """`hook(reduce_output)` on each reduced gradient shard of this module (after the
        reduce-scatter, or after the all-reduce under HSDP), before it is accumulated into .grad;
        it runs where the reduction is finished, in stream order after it."""
        unit = self._unit
        if stream is not None and unit.groups.replicate is not None:
            raise ValueError("stream cannot be set when using native HSDP")
        if stream is not None:
            raise NotImplementedError(
                "set_all_reduce_hook(stream=...): the hook runs on fsdp_ext's reduce stream, "
                "ordered after the reduction; leave stream=None")
        unit.set_all_reduce_hook(hook)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """How many packed gradient buffers may be in flight at once (default 1)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for unit in _units_under(self, recurse):  # one bound per schedule: the root's applies
            _schedule_options(unit).update(max_pending_reduce_scatters=max_input_buffers)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Gradient reductions on their own process group over the shard ranks (collective:
        every rank calls it at the same point)."""
        for unit in _units_under(self, recurse):
            if enable:  # made now, for the unit's groups and its own meshes', in one order
                timeout = comm.collective_timeout(_schedule_options(unit).collective_timeout,
                                                  unit.config.env.collective_timeout)
                for groups in dict.fromkeys(unit.every_groups()):
                    process_groups.separate_group(groups.shard, timeout)
            unit.set_separate_reduce_scatter(enable)

    # ---- resharding and prefetch --------------------------------------------------------------------
    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for unit in _units_under(self, recurse):
            unit.set_reshard_after_forward(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps the parameters gathered from backward to the next forward (gradient
        accumulation without re-gathering); set True again before the optimizer step."""
        for unit in _units_under(self, recurse):
            unit.set_reshard_after_backward(reshard_after_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this module's backward needs none of its parameters (e.g. an embedding), so
        they are not gathered again for it."""
        self._unit.set_unshard_in_backward(unshard_in_backward)

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """After this module's all-gather, issue those of `modules` (replaces the depth rule)."""
        self._unit.set_prefetch_units(
            forward=_fsdp_units(modules, "set_modules_to_forward_prefetch"))

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """Before this module's backward, issue the all-gathers of `modules`."""
        self._unit.set_prefetch_units(
            backward=_fsdp_units(modules, "set_modules_to_backward_prefetch"))

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The root's next all-gather waits for `event` instead of the whole compute stream
        (accelerators; on CPU the optimizer step has ended before the forward starts)."""
        unit = self._unit
        if unit.schedule is not None and not unit.schedule.standalone:
            unit.schedule.set_post_optim_event(event)

    # ---- communication choices fsdp_ext does not offer ----------------------------------------------
    def set_custom_all_gather(self, comm) -> None:
        raise NotImplementedError(
            "set_custom_all_gather: fsdp_ext gathers into its own per-unit buffers with its own "
            "copy-in kernels; torch's AllGather objects do not apply. Use torch's fully_shard for "
            "custom collectives")

    def set_custom_reduce_scatter(self, comm) -> None:
        raise NotImplementedError(
            "set_custom_reduce_scatter: fsdp_ext packs and reduces gradients with its own kernels; "
            "torch's ReduceScatter objects do not apply. set_all_reduce_hook can post-process the "
            "reduced gradients")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        if enable:
            raise NotImplementedError(
                "set_allocate_memory_from_process_group_for_comm(True): fsdp_ext allocates its "
                "communication buffers itself (storage cache / caching allocator)")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        raise NotImplementedError(
            "set_symm_mem_for_comm: symmetric-memory all-gathers are not implemented in fsdp_ext")

    # ---- fsdp_ext extensions and nn.Module overrides --------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip all sharded gradients under this module; returns the global norm (every rank)."""
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def set_prefetch_depth(self, forward: int | None = None, backward: int | None = None) -> None:
        """Prefetch depth of the root's schedule (fsdp_ext extension; default 1 and 1).
        Schedule-wide: on the root (or, after the first forward, any module of its tree)."""
        options = _schedule_options(self._unit)
        for name, depth in (("forward", forward), ("backward", backward)):
            if depth is None:
                continue
            if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
                raise ValueError(f"{name} prefetch depth must be an int >= 0, got {depth!r}")
            options.update(**{f"{name}_prefetch": depth})

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module's, after a check of every key (strict) and global shape that raises before
        anything is written: a failed load leaves the model as it was."""
        problems = load_problems(self, state_dict, strict)
        if problems:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t"
                               + "\n\t".join(problems))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _apply(self, *args, **kwargs):
        """nn.Module._apply (`to_empty`, `to`, ...) gives the modules new parameter tensors: the
        unit copies them into its shard (allocating it if it was on meta) and points them back.
        A cast to another dtype is refused first, for every unit below (runtime/bucket/adopt.py)."""
        refuse_cast(_units_under(self, recurse=True), args[0] if args else kwargs["fn"])
        self._unit.reshard()
        result = nn.Module._apply(self, *args, **kwargs)
        self._unit.adopt_params()
        return result


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>` run with the module's parameters gathered, as forward does
    (e.g. `generate`, which calls the encoder and forward itself). A no-op on a module that is not
    sharded, as torch's."""
    unit = unit_of(module)
    if unit is None:
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)

    def wrapped(*args, **kwargs):
        return run_method(unit, method, args, kwargs)

    wrapped.__wrapped__ = method
    wrapped.__name__ = getattr(method, "__name__", method_name)
    wrapped.__doc__ = getattr(method, "__doc__", None)
    setattr(module, method_name, wrapped)


def _schedule_options(unit) -> ScheduleOptions:
    """The options record a schedule-wide setter writes: the root schedule's once a forward ran
    (from any module of the tree); before that the unit's own, which the schedule reads if the
    unit becomes the root (torch's FSDP2 likewise keeps what was set on its root before lazy
    initialisation, runtime/unit/schedule_options.py)."""
    return unit.schedule.options if unit.schedule is not None else unit.options


def share_comm_ctx(modules: list) -> None:
    """Roots that run one after another (pipeline stages) share their collective streams."""
    units = _fsdp_units(modules, "share_comm_ctx")
    if not units:
        return
    if units[0].options.comm_ctx is None:
        units[0].options.update(comm_ctx={})
    for unit in units[1:]:
        unit.options.update(comm_ctx=units[0].options.comm_ctx)
