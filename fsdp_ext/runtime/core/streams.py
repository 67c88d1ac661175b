"""The streams seam: the one place the runtime touches streams, events, and the storage of buffers
that several streams use.

[Note: stream order and buffer lifetime]
On an accelerator the runtime issues its collectives on side streams; every ordering decision and
every lifetime decision goes through the functions below, always with an explicit device:
  * order: a side stream `wait_stream`s the compute stream before it reads what compute wrote; the
    compute stream `wait_event`s the side stream's event before it reads what the collective wrote;
    the host `synchronize`s an event before it reads host memory a stream copied into.
  * lifetime: the caching allocator hands a freed block to the next allocation on the stream that
    allocated it, without waiting for other streams. So a buffer that another stream reads or writes
    is kept referenced (in the record of the collective, `comm.Pending`) until the allocating
    stream has waited for that stream's event; only then is it released. No `record_stream`.
    Since torch 2.7 a collective issued with async_op=False on a side stream keeps no reference to
    its tensors, so nothing but that record keeps them alive.
  * storage: buffers freed and refilled in place (gathered parameters) change size only through
    `alloc_storage` / `free_storage`, on the current stream.

The backend is torch's device-generic API (torch.Stream, torch.Event, torch.accelerator). Tests swap
in a model of stream order that runs on CPU (`set_backend`, see diagnostics/stream_check.py), under
which the runtime takes this same side-stream path with CPU tensors and gloo.
"""
from __future__ import annotations

import contextlib

import torch

from ... import env

# Cycles a side stream spins before each collective it runs (CUDA only; 0: none). A test knob for
# `make gpu-check` (FSDP_EXT_SIDE_STREAM_DELAY_CYCLES, fsdp_ext/env.py; read once per process,
# here rather than at each collective): a late collective exposes a missing wait or an early free
# on a real GPU.
_DELAY_CYCLES = env.process().side_stream_delay_cycles


class DeviceStreams:
    """torch's device-generic streams and events; side streams on every device but the CPU."""

    def side_streams(self, device: torch.device) -> bool:
        return device.type not in ("cpu", "meta")

    def new_stream(self, device: torch.device, priority: int = 0, name: str = ""):
        return torch.Stream(device=device, priority=priority)

    def current_stream(self, device: torch.device):
        return torch.accelerator.current_stream(device)

    def use_stream(self, stream):
        return stream  # torch.Stream is a context manager that makes it current on its device

    def wait_stream(self, stream, other) -> None:
        stream.wait_stream(other)

    def record_event(self, stream):
        event = torch.Event(device=stream.device)
        event.record(stream)
        return event

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def synchronize(self, event) -> None:
        event.synchronize()

    def query(self, event) -> bool:
        return event.query()

    def inject_delay(self, stream) -> None:
        if _DELAY_CYCLES and stream.device.type == "cuda":
            torch.cuda._sleep(_DELAY_CYCLES)  # queued on the current stream: `stream`

    def iteration_started(self, owner: object, iteration: int) -> None:
        pass  # (the stream-order model counts host syncs per steady-state step)

    def alloc_storage(self, tensor: torch.Tensor) -> None:
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())

    def free_storage(self, tensor: torch.Tensor) -> None:
        tensor.untyped_storage().resize_(0)

    def host_empty(self, shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)

    def host_tensor(self, values: list, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=dtype)
        return tensor.pin_memory() if pin else tensor


_backend = DeviceStreams()

def set_backend(backend) -> object:
    """Install `backend` (an object with DeviceStreams' methods); returns the previous one."""
    global _backend
    previous, _backend = _backend, backend
    return previous


@contextlib.contextmanager
def backend_installed(backend):
    previous = set_backend(backend)
    try:
        yield backend
    finally:
        set_backend(previous)


def side_streams(device: torch.device) -> bool:
    """Whether the runtime issues collectives on side streams for `device` (else: CPU work
    handles and the issue thread)."""
    return _backend.side_streams(device)


def new_stream(device: torch.device, priority: int = 0, name: str = ""):
    """A new stream on `device` (`name` says what it is for, in reports)."""
    return _backend.new_stream(device, priority, name)


def current_stream(device: torch.device):
    return _backend.current_stream(device)


def use_stream(stream):
    """Context manager: `stream` is the current stream of its device inside the block."""
    return _backend.use_stream(stream)


def wait_stream(stream, other) -> None:
    """Work issued on `stream` from now on runs after everything issued on `other` so far."""
    _backend.wait_stream(stream, other)


def record_event(stream):
    """An event that completes when everything issued on `stream` so far has run."""
    return _backend.record_event(stream)


def wait_event(stream, event) -> None:
    """Work issued on `stream` from now on runs after `event`."""
    _backend.wait_event(stream, event)


def synchronize(event) -> None:
    """Block the host until `event` has completed."""
    _backend.synchronize(event)


def query(event) -> bool:
    """Whether `event` has completed (never blocks)."""
    return _backend.query(event)


def inject_delay(stream) -> None:
    """Inside `use_stream(stream)`: hold `stream` up before its next work, when the test knob
    FSDP_EXT_SIDE_STREAM_DELAY_CYCLES asks for it (nothing otherwise)."""
    _backend.inject_delay(stream)


def iteration_started(owner: object, iteration: int) -> None:
    """The root `owner` began its `iteration`-th training step (its forward)."""
    _backend.iteration_started(owner, iteration)


def alloc_storage(tensor: torch.Tensor) -> None:
    """Give `tensor`'s (empty) storage room for all its elements, on the current stream."""
    _backend.alloc_storage(tensor)


def free_storage(tensor: torch.Tensor) -> None:
    """Free `tensor`'s storage in place (views and autograd's saved tensors stay valid)."""
    _backend.free_storage(tensor)


def host_empty(shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer; `pin` page-locks it so copies to and from a device can be asynchronous."""
    return _backend.host_empty(shape, dtype, pin)


def host_tensor(values: list, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor of Python `values`; `pin` as for host_empty."""
    return _backend.host_tensor(values, dtype, pin)
