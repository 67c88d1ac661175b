"""A Lightning strategy that shards with fsdp_ext: `Trainer(strategy=FSDPExtStrategy(...))`.

    from fsdp_ext.integrations.lightning import FSDPExtStrategy
    trainer = L.Trainer(strategy=FSDPExtStrategy(auto_wrap_policy={Block}), devices=2, ...)
    # or, once imported, strategy="fsdp_ext" (no policy: configure_model shards the blocks)

It follows Lightning's conventions for FSDP (its `FSDPStrategy` and `ModelParallelStrategy`):
- the model is built in `configure_model` or in the module's `__init__` (on the meta device under
  `Trainer.init_module(empty_init=True)` or `torch.device("meta")`: sharded there, then each rank
  gives storage to its own rows only, `to_empty` + the modules' `reset_parameters`);
- sharding: the LightningModule's submodules whose class is in `auto_wrap_policy` (a set of
  classes, or torch's policy objects and callables, as FSDPStrategy takes) become units, bottom
  up, then everything else in one root unit; or `configure_model` calls fsdp_ext's `fully_shard`
  itself (ModelParallelStrategy's way), and the strategy adds only the root;
- the optimizers are built by `configure_optimizers` after sharding (over the DTensor parameters);
- `precision="bf16-mixed"` etc. are Lightning's precision plugins (autocast around each step);
  `mp_policy` (torch's MixedPrecisionPolicy) casts the gathered parameters and gradients instead;
- gradient accumulation (`accumulate_grad_batches`) skips the gradient reduction of all but the
  last micro-batch (`set_requires_gradient_sync`), gradient clipping is torch's on the DTensor
  gradients;
- checkpoints: `save_distributed_checkpoint=True` (default) writes a torch.distributed.checkpoint
  folder (each rank its shards, loadable at another world size), False one file with the full
  state gathered on rank 0; both as ModelParallelStrategy writes them, keyed by the
  LightningModule's own parameter names.
"""
from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import _load_checkpoint
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from ..api.fully_shard import fully_shard
from ..api.options import OffloadPolicy
from ..api.wrap import apply_auto_wrap


class _Root(nn.Module):
    """The root unit: the LightningModule's steps reach its forward (Lightning redirects a step
    method through the wrapper's forward, as for DDP and FSDP), so every step starts with the
    root's pre-forward. Calls the module's `forward` directly: when the module is a unit of its
    own, its hooks then run once, at the step's own `self(...)`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module.forward(*args, **kwargs)


class FSDPExtStrategy(ModelParallelStrategy):
    """Args:
        auto_wrap_policy: which submodules become units: a set of module classes, or torch's
            policy objects (ModuleWrapPolicy, ...) and policy callables (as FSDPStrategy takes).
            None: only what `configure_model` sharded, plus the root.
        reshard_after_forward, mp_policy, offload_policy: fully_shard's, for every unit the
            strategy makes (torch's MixedPrecisionPolicy / CPUOffloadPolicy objects).
        save_distributed_checkpoint: True: a DCP folder (sharded); False: one file, full state.
        process_group_backend, timeout: the process group's (gloo on CPU, NCCL on GPUs).
    """

    strategy_name = "fsdp_ext"

    def __init__(self, auto_wrap_policy=None, reshard_after_forward: bool | int = True,
                 mp_policy=None, offload_policy=None, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 data_parallel_size: Literal["auto"] | int = "auto") -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._policy = auto_wrap_policy
        self._shard_kwargs = dict(reshard_after_forward=reshard_after_forward,
                                  offload_policy=offload_policy or OffloadPolicy())
        if mp_policy is not None:
            self._shard_kwargs["mp_policy"] = mp_policy

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":  # every process shards (ModelParallel: per node)
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        # dtype changes before sharding; parameters left on the meta device get storage after it,
        # each rank for its own rows only (to_empty, then the modules' reset_parameters)
        module = self.precision_plugin.convert_module(self.lightning_module)
        self.model = self._shard(module)
        _materialize_distributed_module(self.model, self.root_device)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self, module: nn.Module) -> nn.Module:
        mesh = self.device_mesh["data_parallel"]

        def shard(sub: nn.Module, **overrides) -> None:
            if overrides:
                raise NotImplementedError(
                    f"FSDPExtStrategy: auto_wrap_policy gives {type(sub).__name__} its own "
                    f"arguments {sorted(overrides)}; fsdp_ext's strategy takes one set for all "
                    "units (reshard_after_forward, mp_policy, offload_policy)")
            fully_shard(sub, mesh=mesh, **self._shard_kwargs)

        if self._policy is not None:
            policy = self._policy
            if isinstance(policy, (set, frozenset, list, tuple)):
                policy = ModuleWrapPolicy(set(policy))
            apply_auto_wrap(module, policy, shard, set(), set(), {})  # bottom-up, root last
        root = _Root(module)
        kwargs = {k: v for k, v in self._shard_kwargs.items() if k != "reshard_after_forward"}
        fully_shard(root, mesh=mesh, **kwargs)  # the root keeps its parameters for backward
        return root

    def model_to_device(self) -> None:
        assert self.model is not None
        if self.root_device.type != "cpu" and not _offloaded(self._shard_kwargs):
            self.model.to(self.root_device)

    @contextmanager
    def block_backward_sync(self):
        """Micro-batches before the last of an accumulation: no gradient reduction."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield None
        finally:
            self.model.set_requires_gradient_sync(True)

    # ---- checkpoints: ModelParallelStrategy's formats, keyed by the LightningModule's names ----
    def _state_dict_options(self) -> StateDictOptions:
        return StateDictOptions(full_state_dict=not self._save_distributed_checkpoint,
                                cpu_offload=True)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.lightning_module, options=self._state_dict_options())

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return get_optimizer_state_dict(self.lightning_module, optimizer,
                                        options=self._state_dict_options())

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        state = {"state_dict": self.lightning_module,
                 **{f"optimizer_{i}": opt for i, opt in enumerate(self.optimizers)}}
        return _load_checkpoint(path=path, state=state,
                                strict=self.lightning_module.strict_loading,
                                optimizer_states_from_list=True, weights_only=weights_only)


def _offloaded(kwargs: dict) -> bool:
    return isinstance(kwargs.get("offload_policy"), CPUOffloadPolicy)


# `Trainer(strategy="fsdp_ext")` once this module is imported (no wrap policy: configure_model
# shards the blocks, or the whole model is one unit)
StrategyRegistry.register(FSDPExtStrategy.strategy_name, FSDPExtStrategy, override=True,
                          description="fully sharded data parallel with fsdp_ext")
