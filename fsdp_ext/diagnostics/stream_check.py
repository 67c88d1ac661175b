"""A model of accelerator stream order that runs on CPU: races and early frees in the runtime's
side-stream path, found without a GPU.

    with stream_check() as report:   # every rank, around the training steps to check
        ...                          # the runtime takes its side-stream path on CPU tensors
    # leaving the block raises StreamOrderError listing what was found (report.problems)

Inside the block the streams seam (runtime/core/streams.py) has StreamModel as its backend, so the
runtime creates side streams, records and waits events and frees buffers exactly as on a GPU, while
the tensors are CPU tensors and the collectives run on gloo. Nothing is delayed: results are those
of a correct program. What the model checks is whether the order the runtime asked for would make
them correct on a GPU, where each stream runs on its own:

  * every stream (and the host) has a vector clock; work issued on a stream happens after what
    that stream already knew; `wait_stream` / `wait_event` merge clocks into a stream, an event
    `synchronize` (and `.item()`, a blocking copy to the host) into the host;
  * a TorchDispatchMode attributes each op's reads and writes (per storage, from the op's schema;
    for c10d collectives from a table) to the current modelled stream, or to the host when every
    tensor it touches is host memory (`streams.host_empty`, or made by host ops from it).
    0-dim tensors are not tracked: on CPU the model cannot tell a host scalar (an optimizer's
    `step`) from a device one, and the runtime moves no data through them;
  * (a) an access is reported when a conflicting access (at least one a write) on another stream
    is not ordered before it;
  * (b) a freed block goes back to the pool of the stream that allocated it, as in the caching
    allocator, which hands it to a later allocation on that stream without waiting for any other
    stream. Such an allocation (of no more bytes, from the same small / large pool) is reported
    when another stream's access to the freed block is not ordered before that stream by then:
    the new owner could write the memory while the other stream still reads or writes it. Frees
    are `streams.free_storage` (resize to 0) and the last reference dropped (seen through storage
    weak references, looked at before every allocation and every seam call). Host memory is
    exempt (pinned blocks are reused only after their copies completed).
Each report names the places involved: the earlier access (stream, op, stack) and the conflicting
access, or the free and the allocation that may reuse the block.
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..runtime.core import streams
from .host_syncs import HostSyncCounter, SyncCalls, copy_blocks, unseen_read

HOST = "host"
SMALL_POOL_BYTES = 1 << 20  # the caching allocator serves allocations up to 1 MiB from a separate pool
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TORCH_ROOT = os.path.dirname(os.path.abspath(torch.__file__))
_THIS_FILE = os.path.abspath(__file__)
_CHECKER_FILES = {os.path.join(os.path.dirname(_THIS_FILE), f)
                  for f in ("stream_check.py", "host_syncs.py", "launch_trace.py")}

# c10d collectives carry no alias annotations: which arguments each writes (the rest it reads).
_C10D_WRITES = {
    "broadcast_": ("tensors",), "allreduce_": ("tensors",), "allreduce_coalesced_": ("tensors",),
    "_allgather_base_": ("output_tensor",), "allgather_": ("output_tensors",),
    "allgather_into_tensor_coalesced_": ("outputs",), "allgather_coalesced_": ("output_lists",),
    "_reduce_scatter_base_": ("output_tensor",), "reduce_scatter_": ("output_tensors",),
    "reduce_scatter_tensor_coalesced_": ("outputs",), "alltoall_base_": ("output",),
    "alltoall_": ("output_tensors",), "recv_": ("tensors",), "recv_any_source_": ("tensors",),
    "reduce_": ("tensors",), "gather_": ("output_tensors",), "scatter_": ("output_tensors",),
}


# Ops that read only their tensor arguments' metadata (shape, dtype, device, pinning).
_METADATA_ONLY = {
    "aten::is_pinned", "aten::empty_like", "aten::zeros_like", "aten::ones_like", "aten::full_like",
    "aten::new_empty", "aten::new_empty_strided", "aten::new_zeros", "aten::new_ones",
    "aten::new_full", "aten::is_same_size", "aten::_has_compatible_shallow_copy_type",
}


class StreamOrderError(AssertionError):
    """What the stream-order model found: accesses or frees a GPU could run out of order."""


@dataclass
class Access:
    stream: str
    tick: int
    kind: str        # "read" | "write"
    op: str
    stack: list      # (file, line, function), innermost last


@dataclass
class Block:
    """One allocation: the storage as it is between an allocation and its free."""

    alloc_stream: str
    nbytes: int
    host: bool
    op: str                                     # what allocated it
    stack: list
    write: Access | None = None
    reads: dict[str, Access] = field(default_factory=dict)
    weak: int | None = None                     # weak reference to the storage
    pinned: bool = False                        # page-locked host memory (streams.host_empty)


class ModelStream:
    def __init__(self, name: str, device: torch.device):
        self.name, self.device = name, device

    def __repr__(self) -> str:
        return f"<stream '{self.name}' on {self.device}>"


class ModelEvent:
    def __init__(self, stream: str, clock: dict[str, int]):
        self.stream, self.clock = stream, clock


def _stack() -> list:
    """The calling frames outside torch and this module, innermost last (at most 8)."""
    frames, frame = [], sys._getframe(2)
    while frame is not None and len(frames) < 8:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_ROOT) and path not in _CHECKER_FILES and "/python3." not in path:
            frames.append((os.path.relpath(path, _PACKAGE_ROOT) if path.startswith(_PACKAGE_ROOT)
                           else path, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames[::-1]


def _where(stack: list) -> str:
    return " <- ".join(f"{name} ({path}:{line})" for path, line, name in reversed(stack)) or "?"


def _storages(value) -> list:
    """The plain tensors behind a value (tensor subclasses such as DTensor are flattened)."""
    out = []
    for leaf in tree_flatten(value)[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        if type(leaf) is not torch.Tensor and hasattr(leaf, "__tensor_flatten__"):
            names, _ = leaf.__tensor_flatten__()
            out.extend(_storages([getattr(leaf, n) for n in names]))
        elif leaf.layout == torch.strided and leaf.device.type != "meta" and leaf.dim() > 0:
            out.append(leaf)
    return out


class StreamModel:
    """The streams seam's backend under stream_check, and the state of the model."""

    def __init__(self):
        self.clocks: dict[str, dict[str, int]] = {HOST: {HOST: 0}}
        self.defaults: dict[str, ModelStream] = {}
        self.stacks: dict[str, list[ModelStream]] = {}
        self.blocks: dict[int, Block] = {}    # by storage (StorageImpl address)
        self.watched: dict[int, Block] = {}   # those other streams touched: whose death matters
        self.pools: dict[str, list[tuple[Block, str, list]]] = {}  # freed: (block, how, where)
        self.problems: list[str] = []
        self._seen: set[tuple] = set()
        self.iteration = 0  # of the root whose forward began last (0: none yet)
        self.syncs = HostSyncCounter(self)

    # ---- the seam ------------------------------------------------------------------------------
    def side_streams(self, device: torch.device) -> bool:
        return device.type != "meta"

    def new_stream(self, device: torch.device, priority: int = 0, name: str = "") -> ModelStream:
        base = name or "side"
        label, n = base, 1
        while label in self.clocks:
            n += 1
            label = f"{base}#{n}"
        self.clocks[label] = {label: 0}
        return ModelStream(label, torch.device(device))

    def _default(self, device: torch.device) -> ModelStream:
        key = str(device)
        if key not in self.defaults:
            self.defaults[key] = stream = ModelStream(f"compute ({key})", torch.device(device))
            self.clocks[stream.name] = {stream.name: 0}
        return self.defaults[key]

    def current_stream(self, device: torch.device) -> ModelStream:
        stack = self.stacks.get(str(torch.device(device)))
        return stack[-1] if stack else self._default(device)

    @contextlib.contextmanager
    def use_stream(self, stream: ModelStream):
        stack = self.stacks.setdefault(str(stream.device), [])
        stack.append(stream)
        try:
            yield stream
        finally:
            stack.pop()

    def wait_stream(self, stream: ModelStream, other: ModelStream) -> None:
        self.poll_frees()
        self._merge(stream.name, self.clocks[other.name])

    def record_event(self, stream: ModelStream) -> ModelEvent:
        self.poll_frees()
        return ModelEvent(stream.name, dict(self.clocks[stream.name]))

    def wait_event(self, stream: ModelStream, event: ModelEvent) -> None:
        self.poll_frees()
        self._merge(stream.name, event.clock)

    def synchronize(self, event: ModelEvent) -> None:
        self.poll_frees()
        self.syncs.record("Event.synchronize", event.stream)
        self._merge(HOST, event.clock)

    def query(self, event: ModelEvent) -> bool:
        return True  # every result is computed already; the synchronize that follows is the sync

    def inject_delay(self, stream: ModelStream) -> None:
        pass  # the model has no clock to delay: every order it does not see is already suspect

    def iteration_started(self, owner: object, iteration: int) -> None:
        """A root's forward began its `iteration`-th step (1: the first)."""
        self.iteration = iteration
        self.syncs.iteration_started(owner, iteration)

    # ---- for subclasses that record what runs (each called after the model's own bookkeeping) ----
    def on_op(self, stream: str, func, args, kwargs, result) -> None:
        """An op ran on `stream` (HOST for host memory only). Ops with no tensor argument
        (factories) count as run on the current stream of their output's device."""

    def on_host_sync(self, stream: str | None, kind: str, site: str, runtime: bool) -> None:
        """The host is about to wait for the work queued on `stream` (None: on every stream of the
        device): `kind` says what call (host_syncs.py), `site` where, `runtime` whether a frame of
        fsdp_ext/runtime was on the stack."""

    def alloc_storage(self, tensor: torch.Tensor) -> None:
        self.poll_frees()
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        stream = self.current_stream(tensor.device).name
        self.allocation(tensor, stream, "alloc_storage", _stack())

    def free_storage(self, tensor: torch.Tensor) -> None:
        self.poll_frees()
        storage = tensor.untyped_storage()
        block = self.blocks.pop(storage._cdata, None)
        if block is not None:
            self._freed(block, storage._cdata, "freed (storage resized to 0) at", _stack())
        storage.resize_(0)

    def host_empty(self, shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)  # (pinning needs an accelerator; no copy waits)
        self._new_block(tensor, HOST, "host_empty", _stack(), host=True).pinned = pin
        return tensor

    def host_tensor(self, values: list, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=dtype)
        self._new_block(tensor, HOST, "host_tensor", _stack(), host=True).pinned = pin
        return tensor

    # ---- clocks --------------------------------------------------------------------------------
    def _merge(self, stream: str, other: dict[str, int]) -> None:
        clock = self.clocks[stream]
        for key, tick in other.items():
            if clock.get(key, 0) < tick:
                clock[key] = tick

    def _tick(self, stream: str) -> int:
        """Issue one piece of work on `stream`: it runs after everything the host did or knows."""
        if stream != HOST:
            self._merge(stream, self.clocks[HOST])
        clock = self.clocks[stream]
        clock[stream] = clock.get(stream, 0) + 1
        return clock[stream]

    def _ordered(self, stream: str, access: Access) -> bool:
        return access.stream == stream or self.clocks[stream].get(access.stream, 0) >= access.tick

    # ---- blocks --------------------------------------------------------------------------------
    def _new_block(self, tensor, stream: str, op: str, stack: list, host: bool = False) -> Block:
        storage = tensor.untyped_storage()
        old = self.blocks.pop(storage._cdata, None)
        if old is not None:  # a storage we had not seen die: its address is taken again
            if torch.UntypedStorage._expired(old.weak):
                self._freed(old, storage._cdata, "freed (its last reference dropped) before",
                            stack)
            else:
                self._forget(old, storage._cdata)
        block = Block(stream, storage.nbytes(), host, op, stack, weak=storage._weak_ref())
        self.blocks[storage._cdata] = block
        return block

    def _block(self, tensor: torch.Tensor) -> Block:
        """The block of `tensor`'s storage. A storage object lives at an address that a dead one
        may have had (one that no op we saw allocated, e.g. `torch.tensor(...)`): the weak
        reference tells them apart."""
        storage = tensor.untyped_storage()
        block = self.blocks.get(storage._cdata)
        if block is not None and torch.UntypedStorage._expired(block.weak):
            block = None  # (_new_block retires the dead one)
        if block is None:  # made before the check started, or outside any op we saw
            block = self._new_block(tensor, self._default(tensor.device).name, "(earlier)", [])
        return block

    def _watch(self, block: Block, tensor: torch.Tensor) -> None:
        if not block.host:
            self.watched[tensor.untyped_storage()._cdata] = block

    def _forget(self, block: Block, key: int) -> None:
        if block.weak is not None:
            torch.UntypedStorage._free_weak_ref(block.weak)
            block.weak = None
        self.watched.pop(key, None)

    def poll_frees(self) -> None:
        """Watched blocks whose storage died since the last look (last reference dropped)."""
        dead = [key for key, block in self.watched.items()
                if torch.UntypedStorage._expired(block.weak)]
        if not dead:
            return
        stack = _stack()
        for key in dead:
            self._freed(self.blocks.pop(key), key, "freed (its last reference dropped) before",
                        stack)

    # ---- checks --------------------------------------------------------------------------------
    def _report(self, kind: str, first: Access, second: str, key: tuple) -> None:
        if key in self._seen:
            return
        self._seen.add(key)
        self.problems.append(
            f"{kind}:\n    {first.kind} by {first.op} on stream '{first.stream}' at "
            f"{_where(first.stack)}\n    {second}")

    def _unordered(self, block: Block) -> Access | None:
        """An access to `block` by another stream that its allocating stream is not ordered after."""
        for access in [block.write, *block.reads.values()]:
            if access is not None and not self._ordered(block.alloc_stream, access):
                return access
        return None

    def _freed(self, block: Block, key: int, how: str, stack: list) -> None:
        self._forget(block, key)
        if not block.host and self._unordered(block) is not None:
            self.pools.setdefault(block.alloc_stream, []).append((block, how, stack))

    def allocation(self, tensor: torch.Tensor, stream: str, op: str, stack: list,
                   host: bool = False) -> Block:
        """A new block on `stream`: first, may it be one that another stream still uses?"""
        nbytes = tensor.untyped_storage().nbytes()
        kept = []
        for block, how, free_stack in self.pools.get(stream, ()):
            other = self._unordered(block)
            if other is None:
                continue  # every other stream is done with it: safe from now on
            same_pool = (block.nbytes <= SMALL_POOL_BYTES) == (nbytes <= SMALL_POOL_BYTES)
            if host or not same_pool or nbytes > block.nbytes:
                kept.append((block, how, free_stack))
                continue
            self._report(
                f"(b) a {block.nbytes}-byte buffer allocated on stream '{stream}' by {block.op} "
                f"at {_where(block.stack)} was {how} {_where(free_stack)}, while stream "
                f"'{other.stream}' may still use it", other,
                f"and stream '{stream}' may hand that memory to {op} ({nbytes} bytes) at "
                f"{_where(stack)}",
                ("free", block.op, tuple(block.stack), tuple(other.stack), tuple(free_stack)))
        self.pools[stream] = kept
        return self._new_block(tensor, stream, op, stack, host)

    def access(self, tensor: torch.Tensor, stream: str, tick: int, kind: str, op: str,
               stack: list) -> None:
        block = self._block(tensor)
        me = Access(stream, tick, kind, op, stack)
        earlier = [block.write] if kind == "read" else [block.write, *block.reads.values()]
        for other in earlier:
            if other is not None and not self._ordered(stream, other):
                self._report(
                    f"(a) {kind} on stream '{stream}' not ordered after a {other.kind} on stream "
                    f"'{other.stream}' ({block.nbytes}-byte buffer allocated by {block.op})", other,
                    f"then {kind} by {op} on stream '{stream}' at {_where(stack)}",
                    ("race", kind, op, tuple(other.stack), tuple(stack)))
        if stream != block.alloc_stream:
            self._watch(block, tensor)
        if kind == "write":
            block.write, block.reads = me, {}
        else:
            block.reads[stream] = me


class _OpAccesses(TorchDispatchMode):
    """Attributes each op's reads and writes to the current modelled stream (or the host)."""

    def __init__(self, model: StreamModel):
        super().__init__()
        self.model = model

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        model = self.model
        reads, writes, shaped_by = _classify(func, args, kwargs)
        fresh_outputs = not func._schema.is_mutable and not _aliases_input(func)
        tensors = reads + writes + shaped_by
        if not tensors:  # a factory (empty, arange, full, ...), or an op on 0-dim tensors only
            if kind := unseen_read(model.syncs, func, args):  # (`bool(t.any())` in a backward)
                model.syncs.record(kind)
            result = func(*args, **kwargs)
            scalars = [t for t in tree_flatten((args, kwargs))[0]
                       if isinstance(t, torch.Tensor) and t.dim() == 0]
            # the result of host scalars is a host scalar; of none (a factory), the device's
            # unless the factory had no device (SyncCalls says so afterwards)
            host = bool(scalars) and all(model.syncs.scalar_is_host(t) for t in scalars)
            if fresh_outputs:  # (what host scalars make, torch.stack of them, is host memory)
                self._allocated(result, func, [], HOST if host else None, host)
                self._scalars(result, host)
            outputs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
            model.on_op(HOST if host or not outputs else model.current_stream(outputs[0].device).name,
                        func, args, kwargs, result)
            return result
        on_host = [model._block(t).host for t in tensors]
        device = next((t.device for t, h in zip(tensors, on_host) if not h), None)
        host = device is None
        if (not host and writes and all(model._block(t).host for t in writes)
                and func._schema.name != "aten::copy_"):
            # Host memory written from device memory by an op other than a copy: on a GPU the
            # operands were first brought to the host (`.to("cpu")`, a no-op on this CPU model),
            # which blocks the host until the device's stream got there.
            model._merge(HOST, model.clocks[model.current_stream(device).name])
            host = True
        stream = HOST if host else model.current_stream(device).name
        tick = model._tick(stream)
        stack, op = _stack(), str(func.overloadpacket.__name__)
        for t in reads:
            model.access(t, stream, tick, "read", op, stack)
        for t in writes:
            model.access(t, stream, tick, "write", op, stack)
        if not host and (kind := copy_blocks(model.syncs, func, args, kwargs, model)
                         or unseen_read(model.syncs, func, args)):
            model.syncs.record(kind, stream)
        result = func(*args, **kwargs)
        if fresh_outputs:
            self._allocated(result, func, tensors, stream, host)
            self._scalars(result, host)
        if not host and _syncs_host(func, args, kwargs, model):
            model._merge(HOST, model.clocks[stream])
        model.on_op(stream, func, args, kwargs, result)
        return result

    def _scalars(self, result, host: bool) -> None:
        for out in tree_flatten(result)[0]:
            if isinstance(out, torch.Tensor) and out.dim() == 0 and out.device.type != "meta" \
                    and type(out) is torch.Tensor:
                self.model.syncs.note_scalar(out, host)

    def _allocated(self, result, func, inputs: list, stream: str | None = None,
                   host: bool = False) -> None:
        """Blocks for the op's new outputs (not those that are its inputs' storages)."""
        known = {t.untyped_storage()._cdata for t in inputs}
        outputs = [t for t in _storages(result) if t.untyped_storage()._cdata not in known]
        if not outputs:
            return
        model = self.model
        model.poll_frees()
        stack, op = _stack(), str(func.overloadpacket.__name__)
        for out in outputs:
            on = stream or model.current_stream(out.device).name
            tick = model._tick(on) if stream is None else model.clocks[on][on]
            block = model.allocation(out, on, op, stack, host=host)
            block.write = Access(on, tick, "write", op, stack)


def _aliases_input(func) -> bool:
    return any(r.alias_info is not None for r in func._schema.returns)


def _classify(func, args, kwargs) -> tuple[list, list, list]:
    """(tensors read, tensors written, tensors whose metadata alone the op uses) by one call."""
    schema = func._schema
    named = dict(zip((a.name for a in schema.arguments), args))
    named.update(kwargs)
    if func.namespace == "c10d":
        written = _C10D_WRITES.get(schema.name.split("::")[-1])
        reads, writes = [], []
        for arg in schema.arguments:
            value = named.get(arg.name)
            (writes if written is None or arg.name in written else reads).extend(_storages(value))
        return reads, writes, []
    if (_aliases_input(func) and not schema.is_mutable) or schema.name in _METADATA_ONLY:
        # A view shares its input's storage; `empty_like` and the like read only its shape.
        return [], [], _storages([named.get(a.name) for a in schema.arguments])
    reads, writes = [], []
    for arg in schema.arguments:
        tensors = _storages(named.get(arg.name))
        if arg.alias_info is not None and arg.alias_info.is_write:
            writes.extend(tensors)
        else:
            reads.extend(tensors)
    return reads, writes, []


def _syncs_host(func, args, kwargs, model: StreamModel) -> bool:
    """`.item()` and blocking copies between host and device memory wait on the host."""
    name = func._schema.name
    if name == "aten::_local_scalar_dense":
        return True
    if name in ("aten::copy_", "aten::_to_copy") and not kwargs.get(
            "non_blocking", args[2] if name == "aten::copy_" and len(args) > 2 else False):
        kinds = {model._block(t).host for t in _storages(args[:2])}
        return len(kinds) > 1
    return False


@contextlib.contextmanager
def _explicit_synchronize(model: StreamModel):
    """`torch.cuda.synchronize()` and `torch.accelerator.synchronize()` inside the block: a host
    sync on every stream of the device (the model's host learns everything issued so far)."""
    def synchronize(device=None):
        model.syncs.record("device synchronize", every_stream=True)
        for clock in list(model.clocks.values()):
            model._merge(HOST, clock)
    saved = torch.cuda.synchronize, torch.accelerator.synchronize
    torch.cuda.synchronize = torch.accelerator.synchronize = synchronize
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.accelerator.synchronize = saved


@contextlib.contextmanager
def stream_check(raise_on_exit: bool = True, model: StreamModel | None = None):
    """Run the block with the stream-order model (see the module docstring); yields the model,
    whose `problems` lists what was found; with `raise_on_exit`, StreamOrderError if any.
    `model`: a StreamModel (or a subclass that records more) to use instead of a new one."""
    model = model if model is not None else StreamModel()
    counted = register_optimizer_step_post_hook(
        lambda optimizer, args, kwargs: model.syncs.optimizer_stepped())
    try:
        with streams.backend_installed(model), _OpAccesses(model), SyncCalls(model.syncs), \
                _explicit_synchronize(model):
            yield model
            model.poll_frees()
    finally:
        counted.remove()
    if raise_on_exit and model.problems:
        raise StreamOrderError(f"{len(model.problems)} stream-order problem(s):\n"
                               + "\n".join(model.problems))
