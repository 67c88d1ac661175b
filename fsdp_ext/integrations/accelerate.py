"""Hugging Face accelerate, and transformers' `Trainer` (which runs on it), sharding with fsdp_ext.

    import fsdp_ext.integrations.accelerate
    fsdp_ext.integrations.accelerate.enable()   # before Accelerator() / Trainer(...)

On CPU processes (a multi-process launch without GPUs, gloo), accelerate itself ignores an FSDP
plugin and wraps the model in DistributedDataParallel; once enabled, such a launch with an FSDP
plugin takes accelerate's FSDP path as a GPU launch does. `enable(implementation="torch")` does
only that, keeping torch's `fully_shard`: the same script on torch's FSDP2, as a reference.

accelerate's FSDP2 path (`FullyShardedDataParallelPlugin(fsdp_version=2)`, `fsdp_version: 2` in an
accelerate config, or `Trainer(fsdp_config={"version": 2})`) then calls fsdp_ext's `fully_shard`
where it would call torch's, with the same arguments: the plugin's wrap policy, reshard setting,
mixed precision and CPU offload policies (torch's objects, read by meaning) and ignored modules.
Everything else accelerate does with the sharded model goes through torch's public API, which
fsdp_ext's modules answer as torch's do: `isinstance(m, FSDPModule)`, DTensor parameters and
gradients (`accelerator.clip_grad_norm_`), `set_requires_gradient_sync` (`accumulate()` /
`no_sync()`), the `torch.distributed.checkpoint` state-dict helpers (`get_state_dict`,
`save_state` / `load_state`). `cpu_ram_efficient_loading` (the model sharded on the meta device,
rank 0's weights sent to the others) uses torch's `set_model_state_dict(broadcast_from_rank0=True)`
instead of accelerate's `load_state_dict(assign=True)`, which would replace the sharded parameters.

Refused when `prepare()` is called, naming the setting: the FSDP1 path (`fsdp_version=1`: it wraps
with torch's FullyShardedDataParallel class itself), context parallelism and accelerate's tensor
parallelism (`parallelism_config` with `cp_size` or `tp_size` > 1).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed.fsdp as torch_fsdp

from ..api.fully_shard import fully_shard

_ORIGINALS: dict[str, object] = {}


def enable(implementation: str = "fsdp_ext") -> None:
    """Make accelerate's FSDP2 preparation shard with fsdp_ext (`implementation="torch"`: with
    torch's fully_shard, only letting CPU launches use FSDP), for every Accelerator created from
    now on in this process. Calling it again switches the implementation; `disable()` undoes it."""
    if implementation not in ("fsdp_ext", "torch"):
        raise ValueError(f"enable(implementation={implementation!r}): 'fsdp_ext' or 'torch'")
    disable()
    import accelerate.accelerator as acc_module
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import fsdp_utils

    _ORIGINALS.update(prepare_model=fsdp_utils.fsdp2_prepare_model, prepare=Accelerator.prepare,
                      load_full=fsdp_utils.fsdp2_load_full_state_dict,
                      state_init=AcceleratorState.__init__)
    AcceleratorState.__init__ = functools.wraps(AcceleratorState.__init__)(_state_init)
    if implementation == "torch":
        return
    prepare_model = functools.wraps(fsdp_utils.fsdp2_prepare_model)(_prepare_model)
    fsdp_utils.fsdp2_prepare_model = prepare_model
    acc_module.fsdp2_prepare_model = prepare_model  # accelerator.py calls its imported name
    fsdp_utils.fsdp2_load_full_state_dict = _load_full_state_dict
    Accelerator.prepare = functools.wraps(Accelerator.prepare)(_checked_prepare)


def disable() -> None:
    """Give accelerate its own functions back."""
    if not _ORIGINALS:
        return
    import accelerate.accelerator as acc_module
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import fsdp_utils

    fsdp_utils.fsdp2_prepare_model = acc_module.fsdp2_prepare_model = _ORIGINALS["prepare_model"]
    fsdp_utils.fsdp2_load_full_state_dict = _ORIGINALS["load_full"]
    Accelerator.prepare = _ORIGINALS["prepare"]
    AcceleratorState.__init__ = _ORIGINALS["state_init"]
    _ORIGINALS.clear()


def _state_init(self, *args, fsdp_plugin=None, **kwargs):
    """AcceleratorState.__init__; then a multi-process CPU launch given an FSDP plugin takes the
    FSDP path (accelerate sets it for accelerators only), as accelerate does on GPUs."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    _ORIGINALS["state_init"](self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = self.distributed_type


@contextlib.contextmanager
def _fully_shard_is_ours():
    """accelerate imports `fully_shard` from torch.distributed.fsdp inside the function that
    prepares the model: during that call only, the name is fsdp_ext's."""
    original = torch_fsdp.fully_shard
    torch_fsdp.fully_shard = fully_shard
    try:
        yield
    finally:
        torch_fsdp.fully_shard = original


def _prepare_model(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    with _fully_shard_is_ours():
        return _ORIGINALS["prepare_model"](accelerator, model)


def _checked_prepare(self, *args, **kwargs):
    """Accelerator.prepare, after refusing what fsdp_ext does not do through accelerate."""
    from accelerate.utils import DistributedType

    if self.distributed_type == DistributedType.FSDP:
        if not self.is_fsdp2:
            raise NotImplementedError(
                "fsdp_ext.integrations.accelerate: fsdp_version=1 wraps the model in torch's "
                "FullyShardedDataParallel class; fsdp_ext shards through accelerate's FSDP2 path: "
                "set fsdp_version=2 (FullyShardedDataParallelPlugin(fsdp_version=2), "
                "'fsdp_version: 2' in the accelerate config, or Trainer's "
                "fsdp_config={'version': 2})")
        config = getattr(self, "parallelism_config", None)
        for setting in ("cp_size", "tp_size"):
            if config is not None and getattr(config, setting, 1) > 1:
                raise NotImplementedError(
                    f"fsdp_ext.integrations.accelerate: parallelism_config.{setting}="
                    f"{getattr(config, setting)} is not supported with fsdp_ext (data parallel "
                    "sharding only, with dp_replicate_size / dp_shard_size)")
    return _ORIGINALS["prepare"](self, *args, **kwargs)


def _load_full_state_dict(accelerator, model: torch.nn.Module, full_sd: dict,
                          cpu_offload: bool = False) -> torch.nn.Module:
    """accelerate's `cpu_ram_efficient_loading`: the sharded model is on the meta device, rank 0
    holds the weights. Storage first (`to_empty`), then torch's broadcast-from-rank-0 load, which
    writes each rank's rows into its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    device = torch.device("cpu") if cpu_offload else accelerator.device
    model.to_empty(device=device)
    set_model_state_dict(model, full_sd if accelerator.is_main_process else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model
