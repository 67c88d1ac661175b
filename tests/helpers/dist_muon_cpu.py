"""torchtitan's `DistMuon` (torchtitan/distributed/flex_shard/) on CPU ranks, for tests: its code
asks for a CUDA device and overlaps its redistribution on CUDA streams. On CPU every operation
runs in order on the calling thread, so a stream is only an ordering that already holds; the
shim answers those calls and changes nothing of the optimizer's math or its collectives:

- `torch.get_device_module("cpu")`, as its redistribution runtime calls it (only there: that
  module's `torch` is a view of torch with this one function answered), gives streams and events
  that accept torchtitan's arguments (`Stream(device=, priority=)`) and order nothing;
- `Tensor.record_stream` is a no-op on CPU tensors (no caching allocator tracks them);
- `DistMuon._validate_parameter_storage` accepts DTensor parameters on one CPU device (its only
  other check, "one CUDA device per process").
"""
from __future__ import annotations

import contextlib
import types

import torch


class _Stream:
    def __init__(self, device=None, priority: int = 0):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Event:
    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


_CALLER = _Stream()
_CPU_MODULE = types.SimpleNamespace(
    Stream=_Stream, Event=_Event, stream=lambda stream: contextlib.nullcontext(),
    current_stream=lambda device=None: _CALLER, synchronize=lambda device=None: None)


class _TorchWithCpuStreams:
    """torch, but for `get_device_module` of a CPU device."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def get_device_module(device=None):
        if device is not None and torch.device(device).type == "cpu":
            return _CPU_MODULE
        return torch.get_device_module(device)


def apply() -> None:
    """Let DistMuon run on CPU ranks (idempotent)."""
    from torchtitan.distributed.flex_shard import _optimizer_reshard_runtime as runtime
    from torchtitan.distributed.flex_shard import dist_muon

    if getattr(dist_muon.DistMuon, "_cpu_shim", False):
        return
    runtime.torch = _TorchWithCpuStreams()

    record_stream = torch.Tensor.record_stream

    def record_stream_off_cpu(tensor, stream):
        if tensor.device.type != "cpu":
            record_stream(tensor, stream)

    torch.Tensor.record_stream = record_stream_off_cpu

    validate = dist_muon.DistMuon._validate_parameter_storage

    def validate_on_cpu(self):
        params = [p for group in self.param_groups for p in group["params"]]
        devices = {p.to_local().device for p in params
                   if isinstance(p, torch.distributed.tensor.DTensor)}
        if len(params) and devices == {torch.device("cpu")} and all(
                isinstance(p, torch.distributed.tensor.DTensor) for p in params):
            return torch.device("cpu")
        return validate(self)

    dist_muon.DistMuon._validate_parameter_storage = validate_on_cpu
    dist_muon.DistMuon._cpu_shim = True
