"""What the host would queue on a GPU during one training step, recorded on CPU.

    recorder = LaunchRecorder(iteration=3)        # the step to record (1: the first)
    with stream_check(model=recorder):            # every rank; the runtime takes its GPU path
        for step in range(3):
            ...                                   # forward, backward, optimizer step
        recorder.stop()                           # (or the next root forward stops it)
    trace = recorder.trace()                      # LaunchTrace: records in host issue order

Why: on CPU everything runs at once and in program order, so the order the runtime gives the
host and the streams is visible, but not how long anything takes on a GPU. This recorder writes
down that order together with a size for every piece of work; gpu_projection.py replays it with
GPU costs. It is a StreamModel (stream_check.py), so the stream-order checks run as usual.

Records, in the order the host issues them:
  * Launch: an op on a modelled stream ("compute (cpu)", "all_gather", "reduce_scatter"; "host"
    for ops on host memory only), its unit, and its size: FLOPs for matmul-like ops (torch's
    flop_counter formulas, plus the CPU flash attention), bytes read and written for the rest,
    kind / full bytes / group size for collectives. Views, allocations and metadata ops launch no
    kernel (`kernel=False`): they cost host time only.
  * EventRecord / EventWait / StreamWait: the seam's ordering calls.
  * HostSync: the host waits for an event (`synchronize`) or for a stream's queued work
    (`on_host_sync`). A Launch whose `sync` is set makes the host wait for that op itself
    (`.item()`, a blocking copy between host and device, a tensor made from Python data on the
    device: a copy from pageable memory that waits for its stream). A sync announced by
    `on_host_sync` and then seen by the model too is recorded once.
  * Mark: the runtime's timeline events (runtime/core/trace.py: "all_gather.issue", "forward.begin",
    ...), which also give every other record its unit.

CPU substitutions, recorded as what the GPU path issues:
  * a CPU all-gather is one `broadcast_` per rank into the gathered buffer (runtime/comm/collectives.py): the run of
    broadcasts into one buffer becomes ONE all-gather of the total bytes;
  * the gradient reduce-scatter is an in-place `allreduce_` of the packed buffer on the
    reduce_scatter stream: the first all-reduce inside a reduce-scatter's launch becomes ONE
    reduce-scatter of that full size (later ones, HSDP's, stay all-reduces).

Sizes that depend on the world size (`per_shard`: the copy-in of the local shard, the gradient
epilogue, everything after backward, i.e. the optimizer step) are marked so a projection to
another world size can scale them; the full sizes of collectives and the model's compute do not
depend on it.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch.utils import flop_counter

from ..runtime.core import streams as _streams
from ..runtime.core import trace as runtime_trace
from . import stream_check as _sc
from .stream_check import HOST, StreamModel

# Ops that launch no kernel on a GPU (besides views, found from the schema): allocations,
# metadata, in-place metadata changes.
_NO_KERNEL = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
    "aten::new_empty_strided", "aten::_unsafe_view", "aten::is_pinned", "aten::is_same_size",
    "aten::_has_compatible_shallow_copy_type", "aten::resize_", "aten::set_", "aten::as_strided_",
    "aten::t_", "aten::transpose_", "aten::squeeze_", "aten::unsqueeze_", "aten::detach_",
    "aten::sym_size", "aten::sym_numel", "aten::sym_stride", "aten::sym_storage_offset",
}
# The CPU's fused attention (the GPU runs flash / memory-efficient attention, in flop_counter).
_CPU_ATTENTION = "aten::_scaled_dot_product_flash_attention_for_cpu"
_PER_SHARD_OPS = {"fsdp_ext::cast_into_slot", "fsdp_ext::grad_epilogue"}
_HERE = os.path.abspath(__file__)
_SKIP = (os.path.dirname(os.path.abspath(torch.__file__)), os.path.abspath(_sc.__file__), _HERE,
         os.path.abspath(_streams.__file__))


# ---- records -------------------------------------------------------------------------------------
@dataclass
class Launch:
    stream: str                 # the modelled stream; HOST: host memory only, no GPU work
    op: str                     # "aten.mm", "c10d.allreduce_", ... (what the CPU ran)
    unit: str | None            # the unit ("" the root); None outside every unit (optimizer)
    phase: str                  # "forward" / "backward" / "optimizer" (after backward)
    role: str = ""              # the collective of `unit` being launched or waited for when it
    #                             was issued ("all_gather" / "reduce_scatter"); "": model work
    kernel: bool = True         # False: a view / allocation / metadata op (host time only)
    flops: float = 0.0          # matmul-like ops
    bytes: float = 0.0          # the rest: every tensor argument read + every output written
    dtype: str = ""             # of the first tensor argument ("float32", "bfloat16", ...)
    collective: str = ""        # "all_gather" / "reduce_scatter" / "all_reduce" / c10d name
    group_size: int = 0         # ranks of the collective's group (as recorded)
    per_shard: bool = False     # size is 1/W of something: scales with the world size
    sync: str = ""              # the host waits for this op to finish: what kind of call
    site: str = ""              # for syncs: the innermost frame outside torch
    runtime: bool = False       # for syncs: the runtime's own (a frame of fsdp_ext/runtime on
    #                             the stack), not the model's or the script's


@dataclass
class EventRecord:
    stream: str
    event: int                  # an id, unique within the trace


@dataclass
class EventWait:
    stream: str
    event: int | None           # None: an event recorded before the step (already complete)


@dataclass
class StreamWait:
    stream: str                 # waits for everything queued on `other` so far
    other: str


@dataclass
class HostSync:
    stream: str | None          # the host waits for this stream's queued work (None: all)...
    event: int | None           # ...or, when set, for this event
    kind: str
    site: str
    runtime: bool = False       # the runtime's own sync (as Launch.runtime)


@dataclass
class Mark:
    kind: str                   # runtime/core/trace.py's event kinds
    unit: str


RECORD_TYPES = {cls.__name__: cls for cls in (Launch, EventRecord, EventWait, StreamWait,
                                              HostSync, Mark)}


@dataclass
class LaunchTrace:
    records: list
    recorded_world: int = 1     # the world size the recording ran at
    iteration: int = 0
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(recorded_world=self.recorded_world, iteration=self.iteration, meta=self.meta,
                    records=[dict(type=type(r).__name__, **asdict(r)) for r in self.records])

    @classmethod
    def from_json(cls, data: dict) -> "LaunchTrace":
        records = []
        for item in data["records"]:
            item = dict(item)
            records.append(RECORD_TYPES[item.pop("type")](**item))
        return cls(records, data.get("recorded_world", 1), data.get("iteration", 0),
                   data.get("meta", {}))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)

    @classmethod
    def load(cls, path: str) -> "LaunchTrace":
        with open(path) as f:
            return cls.from_json(json.load(f))


# ---- sizes ---------------------------------------------------------------------------------------
def _nbytes(tensors) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors))


def _named(func, args, kwargs) -> dict:
    named = dict(zip((a.name for a in func._schema.arguments), args))
    named.update(kwargs)
    return named


def matmul_flops(func, args, kwargs, result) -> float | None:
    """FLOPs of a matmul-like op (None for others): torch's flop_counter formulas, the CPU's
    fused attention as the GPU's, and half of an attention's FLOPs when it is causal (flash
    attention skips the masked blocks)."""
    name = func._schema.name
    formula = flop_counter.flop_registry.get(func.overloadpacket)
    if formula is not None:
        flops = float(formula(*args, **kwargs, out_val=result))
    elif name == _CPU_ATTENTION:
        q, k, v = args[:3]
        flops = float(flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape))
    elif name == _CPU_ATTENTION + "_backward":
        grad_out, q, k, v = args[:4]
        flops = float(flop_counter.sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape,
                                                            v.shape))
    else:
        return None
    if "attention" in name and _named(func, args, kwargs).get("is_causal"):
        flops /= 2
    return flops


def launches_kernel(func) -> bool:
    schema = func._schema
    if func.namespace in ("c10d", "fsdp_ext"):
        return True
    if schema.name in _NO_KERNEL:
        return False
    aliases = any(r.alias_info is not None for r in schema.returns)
    return not (aliases and not schema.is_mutable)  # a view shares its input's storage


def _group_size(named: dict) -> int:
    group = named.get("process_group")  # a ScriptObject: unboxed to read its size
    try:
        return int(dist.ProcessGroup.unbox(group).size())
    except Exception:
        return 0


def _site() -> str:
    """The innermost calling frame outside torch, installed packages, the streams seam and the
    stream-order model: where the runtime (or the user) asked for the sync."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_SKIP) and "/python3." not in path:
            return f"{os.path.basename(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


_RUNTIME_DIR = os.path.dirname(os.path.abspath(runtime_trace.__file__)) + os.sep


def _in_runtime() -> bool:
    """Whether a frame of fsdp_ext/runtime is on the stack (the runtime asked for the sync)."""
    frame = sys._getframe(1)
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename).startswith(_RUNTIME_DIR):
            return True
        frame = frame.f_back
    return False


# ---- the recorder --------------------------------------------------------------------------------
class LaunchRecorder(StreamModel):
    """A StreamModel that records one training step (the root's `iteration`-th forward up to the
    next root forward, or `stop()`) as a LaunchTrace."""

    def __init__(self, iteration: int = 3):
        super().__init__()
        self.target = iteration
        self.records: list = []
        self.recording = False
        self.done = False
        self._event_ids = 0
        self._marks_from = 0           # the runtime's timeline events read so far
        self._marks_start = 0          # the first one of the recorded step
        self._recorder_was_enabled = False
        self._windows: list[tuple[str, str]] = []      # (collective, unit) being launched
        self._waits: list[tuple[str, str]] = []        # (collective, unit) being waited for
        self._compute: list[tuple[str, str]] = []      # ("forward" / "backward", unit),
        #                                               innermost last
        self._phase = "forward"  # then "backward" (the root's began), "optimizer" (finalized)
        self._gather: tuple[Launch, int, int] | None = None  # merging broadcasts: (record,
        #                                               storage, broadcasts so far)
        self._reduce_scatter_open = False  # inside a reduce-scatter launch, before its collective

    # ---- start / stop ----------------------------------------------------------------------------
    def iteration_started(self, owner: object, iteration: int) -> None:
        super().iteration_started(owner, iteration)
        if self.recording:
            self.stop()
        if iteration == self.target and not self.done:
            self._start()

    def _start(self) -> None:
        recorder = runtime_trace.RECORDER
        self._recorder_was_enabled = recorder.enabled
        recorder.set_enabled(True)  # the unit names come from the runtime's timeline events
        self._marks_from = self._marks_start = len(recorder.events)
        self.recording = True

    def stop(self) -> None:
        """End the recording (the step is over)."""
        if not self.recording:
            return
        self._flush_marks()
        recorder = runtime_trace.RECORDER
        if not self._recorder_was_enabled:  # leave the runtime's recorder as it was
            recorder.drop_from(self._marks_start)
            recorder.set_enabled(False)
        self.recording, self.done = False, True

    def trace(self) -> LaunchTrace:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return LaunchTrace(list(self.records), world, self.target)

    # ---- context from the runtime's timeline events ----------------------------------------------
    def _flush_marks(self) -> None:
        events = runtime_trace.RECORDER.events
        while self._marks_from < len(events):
            e = events[self._marks_from]
            self._marks_from += 1
            self._on_mark(e.kind, e.unit)

    def _on_mark(self, kind: str, unit: str) -> None:
        self.records.append(Mark(kind, unit))
        phase, _, edge = kind.rpartition(".")
        if kind == "backward.finalize":  # autograd is done: the rest is the optimizer's
            self._phase = "optimizer"
        elif edge == "issue":
            self._windows.append((phase, unit))
            self._reduce_scatter_open = phase == "reduce_scatter"
        elif edge == "issued" and (phase, unit) in self._windows:
            self._windows.remove((phase, unit))
            self._reduce_scatter_open = False
        elif phase.endswith(".wait"):
            key = (phase[:-len(".wait")], unit)
            if edge == "begin":
                self._waits.append(key)
            elif key in self._waits:
                self._waits.remove(key)
        elif phase in ("forward", "backward"):
            if edge == "begin":
                self._compute.append((phase, unit))
                if phase == "backward" and self._phase == "forward":
                    self._phase = "backward"
            elif (phase, unit) in self._compute:  # the innermost open one
                i = len(self._compute) - 1 - self._compute[::-1].index((phase, unit))
                del self._compute[i]

    def _context(self) -> tuple[str | None, str, str]:
        """(unit, phase, role) of the work issued now."""
        if self._windows:
            return self._windows[-1][1], self._phase, self._windows[-1][0]
        if self._waits:
            return self._waits[-1][1], self._phase, self._waits[-1][0]
        if self._compute:
            return self._compute[-1][1], self._phase, ""
        return None, self._phase, ""

    # ---- the seam --------------------------------------------------------------------------------
    def record_event(self, stream):
        event = super().record_event(stream)
        if self.recording:
            self._flush_marks()
            self._event_ids += 1
            event.trace_id = self._event_ids
            self.records.append(EventRecord(stream.name, self._event_ids))
        return event

    def wait_event(self, stream, event) -> None:
        super().wait_event(stream, event)
        if self.recording:
            self._flush_marks()
            self.records.append(EventWait(stream.name, getattr(event, "trace_id", None)))

    def wait_stream(self, stream, other) -> None:
        super().wait_stream(stream, other)
        if self.recording:
            self._flush_marks()
            self.records.append(StreamWait(stream.name, other.name))

    def synchronize(self, event) -> None:
        super().synchronize(event)
        if self.recording:
            self._flush_marks()
            announced = self._announced_sync(event.stream)
            self.records.append(HostSync(
                event.stream, getattr(event, "trace_id", None),
                announced.kind if announced else "event.synchronize",
                announced.site if announced else _site(),
                announced.runtime if announced else _in_runtime()))

    def on_host_sync(self, stream, kind: str, site: str, runtime: bool) -> None:
        if self.recording:
            self._flush_marks()
            self.records.append(HostSync(stream, None, kind, site, runtime))

    def _announced_sync(self, stream: str) -> HostSync | None:
        """The `on_host_sync` record of `stream` issued just before (nothing else since, but
        marks), removed: the sync being recorded now is that same call, known more precisely
        (its event, or the op it waits for). One sync, one record."""
        for i in range(len(self.records) - 1, -1, -1):
            record = self.records[i]
            if isinstance(record, Mark):
                continue
            if isinstance(record, HostSync) and record.event is None and record.stream == stream:
                return self.records.pop(i)
            return None
        return None

    # ---- ops -------------------------------------------------------------------------------------
    def on_op(self, stream: str, func, args, kwargs, result) -> None:
        if not self.recording:
            return
        self._flush_marks()
        unit, phase, role = self._context()
        if func.namespace == "c10d":
            self._collective(stream, func, args, kwargs, result, unit, phase, role)
            return
        name = func._schema.name
        inputs = _sc._storages((args, kwargs))
        record = Launch(stream, str(func).rsplit(".", 1)[0], unit, phase, role,
                        kernel=launches_kernel(func),
                        dtype=str(inputs[0].dtype).replace("torch.", "") if inputs else "",
                        per_shard=name in _PER_SHARD_OPS or phase == "optimizer")
        if stream != HOST:
            if name == "aten::lift_fresh" and _nbytes(inputs):  # torch.tensor(data, device=...):
                # a copy from pageable memory, which waits for the stream (none when empty)
                record.kernel, record.sync = True, "tensor from host data"
            elif _sc._syncs_host(func, args, kwargs, self):
                record.sync = "item" if name == "aten::_local_scalar_dense" else "blocking copy"
            if record.sync:
                announced = self._announced_sync(stream)
                record.site = announced.site if announced else _site()
                record.runtime = announced.runtime if announced else _in_runtime()
        if record.kernel:
            flops = matmul_flops(func, args, kwargs, result)
            if flops is not None:
                record.flops = flops
            elif name == "aten::lift_fresh":
                record.bytes = _nbytes(inputs)
            else:
                record.bytes = _nbytes(inputs) + _nbytes(_sc._storages(result))
        self.records.append(record)

    def _collective(self, stream, func, args, kwargs, result, unit, phase, role) -> None:
        op = func._schema.name.split("::")[-1]
        named = _named(func, args, kwargs)
        size = _group_size(named)
        written = _sc._C10D_WRITES.get(op, ())
        outputs = [t for name in written for t in _sc._storages(named.get(name))]
        inputs = [t for a in func._schema.arguments if a.name not in written
                  for t in _sc._storages(named.get(a.name))]
        tensors = outputs or inputs
        dtype = str(tensors[0].dtype).replace("torch.", "") if tensors else ""
        if op == "broadcast_" and role == "all_gather" and outputs:
            key = outputs[0].untyped_storage().data_ptr()
            if self._gather is not None and self._gather[0].stream == stream \
                    and self._gather[1] == key and self._gather[2] < self._gather[0].group_size:
                record, _, count = self._gather
                record.bytes += _nbytes(outputs)
                self._gather = (record, key, count + 1)
                return
            record = Launch(stream, "c10d.broadcast_ (per rank) as all_gather", unit, phase,
                            role, bytes=_nbytes(outputs), dtype=dtype, collective="all_gather",
                            group_size=size)
            self._gather = (record, key, 1)
            self.records.append(record)
            return
        self._gather = None
        if op in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"):
            kind, nbytes = "all_gather", _nbytes(outputs)
        elif op in ("_reduce_scatter_base_", "reduce_scatter_",
                    "reduce_scatter_tensor_coalesced_"):
            kind, nbytes = "reduce_scatter", _nbytes(inputs)
        elif op in ("allreduce_", "allreduce_coalesced_") and self._reduce_scatter_open \
                and stream == "reduce_scatter":
            kind, nbytes = "reduce_scatter", _nbytes(outputs)  # gloo's stand-in, in place
            self._reduce_scatter_open = False
        elif op in ("allreduce_", "allreduce_coalesced_"):
            kind, nbytes = "all_reduce", _nbytes(outputs)
        else:
            kind, nbytes = op, _nbytes(outputs) or _nbytes(inputs)
        self.records.append(Launch(stream, f"c10d.{op}", unit, phase, role, bytes=nbytes,
                                   dtype=dtype, collective=kind, group_size=size))
