"""Host syncs: the calls that would make the host wait for an accelerator, counted by call site
under the stream-order model (stream_check.py), per steady-state optimizer step (with gradient
accumulation a step spans several forwards and backwards; a scenario without an optimizer counts
per forward).

On a GPU the host must run ahead of the device, queueing kernels while earlier ones run. A call
that needs a device value on the host (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`), a copy
between host and device that is blocking or reads pageable memory (`torch.tensor(data,
device=cuda)` is one), a data-dependent shape (`nonzero`, boolean-mask indexing, `unique`), or an
explicit `synchronize()` stops the host until the device caught up: the GPU then idles while the
host queues the next kernels. On CPU these calls cost nothing, so only a model that knows which
ones would block can see them. Under `stream_check()` a TorchFunctionMode sees every such call
(on CPU, `.tolist()` and `.cpu()` dispatch no op at all) and records it when its tensor stands
for device memory in the model:

  * a tensor with elements: its block is not host memory (stream_check.py: `streams.host_empty`
    buffers and what host-only ops made from them are host memory);
  * a 0-dim tensor: made by an op on device tensors, or by a factory given a torch.device; a
    factory without one or given the string "cpu" (an optimizer's `step = torch.tensor(0.0,
    device="cpu")`) makes a host scalar, as on a GPU run (the model cannot tell by the device:
    every tensor is on the CPU). On this model a torch.device stands for the accelerator.

Each record has its kind, its call site (the innermost frame outside torch), where it comes from
(`runtime`: a frame of fsdp_ext/runtime on the stack, i.e. the hooks and the schedule; `api`: another
fsdp_ext function the user called, e.g. `clip_grad_norm_` returning a norm; `user`: the script's
own code and torch's, e.g. the optimizer), the scenario label, and the root's iteration (the streams
seam's `iteration_started`). Steady state is iteration 2 on: the first step builds and learns.
"""
from __future__ import annotations

import collections
import contextlib
import os
import sys
import weakref
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TORCH_ROOT = os.path.dirname(os.path.abspath(torch.__file__))
_DIAGNOSTICS = os.path.dirname(os.path.abspath(__file__))
_SKIPPED = {os.path.join(_DIAGNOSTICS, f)
            for f in ("host_syncs.py", "stream_check.py", "launch_trace.py")}
STEADY_FROM = 2  # the first iteration counted as steady state
T = torch.Tensor

# Calls that read a device value on the host.
_READS = {T.item: "item", T.tolist: "tolist", T.__bool__: "bool", T.__int__: "int",
          T.__float__: "float", T.__index__: "index", T.__complex__: "complex",
          T.numpy: "numpy", T.cpu: "cpu", T.is_nonzero: "is_nonzero",
          torch.is_nonzero: "is_nonzero", torch.equal: "equal", T.equal: "equal",
          torch.allclose: "allclose", T.allclose: "allclose"}
# Ops whose output shape depends on device values: the host waits to learn the size.
_DATA_DEPENDENT = {torch.nonzero: "nonzero", T.nonzero: "nonzero", torch.argwhere: "argwhere",
                   T.argwhere: "argwhere", torch.unique: "unique", T.unique: "unique",
                   torch.unique_consecutive: "unique_consecutive",
                   T.unique_consecutive: "unique_consecutive",
                   torch.masked_select: "masked_select", T.masked_select: "masked_select"}
_FROM_DATA = {torch.tensor: "tensor", torch.as_tensor: "as_tensor", torch.asarray: "asarray"}
# Factories that take a device: without one they make a host tensor on a GPU run.
_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.zeros, torch.ones, torch.empty,
              torch.full, torch.scalar_tensor}


@dataclass(frozen=True)
class HostSync:
    kind: str        # "item", "tolist", "tensor(data, device=...)", "Event.synchronize", ...
    site: str        # "fsdp_ext/runtime/comm/collective_tags.py:229 (_check)"
    origin: str      # "runtime" | "api" | "user" | "setup"
    scenario: str
    step: int        # the root's iteration (0: before any root's first forward)


# Frames that are never the call site: the streams seam (its caller is) and the checker itself.
_SEAM = "fsdp_ext/runtime/core/streams.py"
# Where the runtime builds a unit (fully_shard, FullyShardedDataParallel): set-up, not a step,
# even when it runs between another model's steps.
_SETUP = {("fsdp_ext/runtime/unit/unit.py", "__init__"),
          ("fsdp_ext/api/fully_shard.py", "fully_shard"), ("fsdp_ext/api/fsdp1.py", "__init__")}


def _frames() -> tuple[str, str]:
    """(call site, origin) of the current call: the innermost frame outside torch, Python's own
    modules, the streams seam and the checker; `setup` inside a unit's construction, `runtime` if
    a frame of fsdp_ext/runtime is on the stack, `api` if another fsdp_ext frame is."""
    site, origin, frame = "", "user", sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_TORCH_ROOT) or path in _SKIPPED or "/python3." in path):
            rel = os.path.relpath(path, _PACKAGE_ROOT) if path.startswith(_PACKAGE_ROOT) else path
            if not site and rel != _SEAM:
                site = f"{rel}:{frame.f_lineno} ({frame.f_code.co_name})"
            if (rel, frame.f_code.co_name) in _SETUP:
                return site, "setup"
            if rel.startswith("fsdp_ext/runtime/"):
                origin = "runtime"
            elif rel.startswith("fsdp_ext/") and not rel.startswith("fsdp_ext/diagnostics/") \
                    and origin == "user":
                origin = "api"
        frame = frame.f_back
    return site or "?", origin


class HostSyncCounter:
    """The records of one stream_check() block, and what the model needs to classify tensors."""

    def __init__(self, model):
        self.model = model
        self.records: list[HostSync] = []
        self.scenario = ""
        self.steps: dict[str, set] = collections.defaultdict(set)  # scenario -> steady steps
        # scenario -> the steady-state iterations, as in `steps`, in which an optimizer stepped
        # (a reference model's optimizer stepping beside the sharded one's counts once), and
        # those that began without gradients (evaluation): see steps_of
        self.optimizer_steps: dict[str, set] = collections.defaultdict(set)
        self.no_grad: dict[str, set] = collections.defaultdict(set)
        self._root = 0  # the root whose iteration runs (its serial)
        # root -> serial, in the order first seen: a root made after another was freed may get
        # its id(), which would merge their steps into one
        self._serials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._held: dict = {}
        self._next_serial = 1
        self._scalars: dict[int, tuple[int, bool]] = {}  # 0-dim storage -> (weak ref, host)

    # ---- what the model tells us ---------------------------------------------------------------
    def iteration_started(self, owner: object, iteration: int) -> None:
        try:
            serials, serial = self._serials, self._serials.get(owner)
        except TypeError:  # no weak reference to it (None): held, so its id is never reused
            serials, serial = self._held, self._held.get(owner)
        if serial is None:
            serial = serials[owner] = self._next_serial
            self._next_serial += 1
        self._root = serial
        if iteration >= STEADY_FROM:
            self.steps[self.scenario].add((self._root, iteration))
            if not torch.is_grad_enabled():
                self.no_grad[self.scenario].add((self._root, iteration))

    def optimizer_stepped(self) -> None:
        """An optimizer's step() returned (a global post-hook installed by stream_check)."""
        if self.model.iteration >= STEADY_FROM:
            self.optimizer_steps[self.scenario].add((self._root, self.model.iteration))

    def steps_of(self, scenario: str) -> int:
        """What a scenario's syncs are counted per, over its steady-state iterations: each
        optimizer step (with gradient accumulation a step spans several iterations), each
        iteration without gradients (an evaluation forward is a step of its own), and each
        iteration with gradients after the root's last optimizer step (a backward no optimizer
        step follows). Without an optimizer: every iteration."""
        optimizer, no_grad = self.optimizer_steps[scenario], self.no_grad[scenario]
        last = collections.defaultdict(int)
        for root, iteration in optimizer:
            last[root] = max(last[root], iteration)
        trailing = {(root, i) for root, i in self.steps[scenario] - no_grad if i > last[root]}
        return len(optimizer) + len(no_grad) + len(trailing)

    def note_scalar(self, tensor: torch.Tensor, host: bool) -> None:
        """A 0-dim tensor was made, on the host or on the device (see the module docstring)."""
        storage = tensor.untyped_storage()
        old = self._scalars.pop(storage._cdata, None)
        if old is not None:
            torch.UntypedStorage._free_weak_ref(old[0])
        self._scalars[storage._cdata] = (storage._weak_ref(), host)

    def on_device(self, value) -> bool:
        """Whether any tensor in `value` stands for device memory in the model."""
        for leaf in tree_flatten(value)[0]:
            if not isinstance(leaf, torch.Tensor):
                continue
            if type(leaf) is not torch.Tensor and hasattr(leaf, "__tensor_flatten__"):
                names, _ = leaf.__tensor_flatten__()
                if self.on_device([getattr(leaf, n) for n in names]):
                    return True
                continue
            if leaf.device.type == "meta" or leaf.layout != torch.strided:
                continue
            if leaf.dim() > 0:
                if not self.model._block(leaf).host:
                    return True
                continue
            if not self.scalar_is_host(leaf):
                return True
        return False

    def scalar_is_host(self, tensor: torch.Tensor) -> bool:
        """A 0-dim tensor made before the check or out of its sight counts as device memory."""
        known = self._scalars.get(tensor.untyped_storage()._cdata)
        return known is not None and not torch.UntypedStorage._expired(known[0]) and known[1]

    def is_pinned_host(self, tensor: torch.Tensor) -> bool:
        block = self.model._block(tensor) if tensor.dim() > 0 else None
        return block is not None and block.host and block.pinned

    # ---- records -------------------------------------------------------------------------------
    def record(self, kind: str, stream: str | None = None, every_stream: bool = False) -> None:
        """The host waits here for `stream` (None: the device's current stream; `every_stream`:
        for every stream of the device)."""
        site, origin = _frames()
        step = self.model.iteration
        self.records.append(HostSync(kind, site, origin, self.scenario, step))
        if stream is None and not every_stream:
            stream = self.model.current_stream(torch.device("cpu")).name  # the model's device
        self.model.on_host_sync(stream, kind, site, origin == "runtime")

    @contextlib.contextmanager
    def label(self, scenario: str):
        previous, self.scenario = self.scenario, scenario
        try:
            yield
        finally:
            self.scenario = previous

    def steady(self) -> list[HostSync]:
        """The records inside steady-state steps (a unit's set-up is not in a step)."""
        return [r for r in self.records if r.step >= STEADY_FROM and r.origin != "setup"]

    def per_step(self) -> dict[tuple[str, str, str, str], float]:
        """(scenario, origin, site, kind) -> steady-state syncs per optimizer step (steps_of; user
        code summed into one row per scenario: its sites are the script's, not the library's)."""
        counts: dict[tuple, int] = collections.Counter()
        for r in self.steady():
            site, kind = (r.site, r.kind) if r.origin != "user" else ("(the script and torch)", "*")
            counts[(r.scenario, r.origin, site, kind)] += 1
        return {key: n / max(1, self.steps_of(key[0])) for key, n in counts.items()}


def _names_host(device) -> bool:
    """Whether a factory's `device` argument means host memory in the model: none, or the string
    "cpu" (code that means the host says so, as torch's optimizers do for their `step`); a
    torch.device, the runtime's way of naming its device, stands for the accelerator."""
    return device is None or (isinstance(device, str) and device == "cpu")


class SyncCalls(TorchFunctionMode):
    """Records the calls that would block the host (see the module docstring)."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._blocking(func, args, kwargs)
        if kind is not None:
            self.counter.record(kind)
        result = func(*args, **kwargs)
        if func in _FACTORIES and isinstance(result, torch.Tensor) and result.dim() == 0:
            # a factory without a device (or naming the host) makes a host scalar on a GPU run
            self.counter.note_scalar(result, host=_names_host(kwargs.get("device")))
        return result

    def _blocking(self, func, args, kwargs) -> str | None:
        counter = self.counter
        if func in _READS:
            return _READS[func] if counter.on_device(args[:1]) else None
        if func in _DATA_DEPENDENT:
            return _DATA_DEPENDENT[func] if counter.on_device(args[:1]) else None
        if func is torch.where and len(args) + len(kwargs) == 1:
            return "where(condition)" if counter.on_device(args[:1]) else None
        if func in (T.__getitem__, T.__setitem__):
            index = args[1] if len(args) > 1 else None
            masks = [t for t in tree_flatten(index)[0]
                     if isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)]
            return "boolean-mask indexing" if masks and counter.on_device(args[:1]) else None
        if func in _FROM_DATA:
            data = args[0] if args else kwargs.get("data")
            if not _names_host(kwargs.get("device")) and not isinstance(data, torch.Tensor):
                return f"{_FROM_DATA[func]}(data, device=...)"
            return None
        if func is T.new_tensor:
            data = args[1] if len(args) > 1 else kwargs.get("data")
            on_device = counter.on_device(args[:1]) if kwargs.get("device") is None else True
            return "new_tensor(data)" if on_device and not isinstance(data, torch.Tensor) else None
        if func is T.to:
            return self._copy_to(args, kwargs)
        if func is torch.repeat_interleave or func is T.repeat_interleave:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
                return "repeat_interleave(tensor repeats)" if counter.on_device(repeats) else None
        return None

    def _copy_to(self, args, kwargs) -> str | None:
        """`t.to(device)` from host memory to the device: blocking unless non-blocking from
        pinned memory. (`.to(device)` of a device tensor names no host: device to device.)"""
        source = args[0]
        target = kwargs.get("device")
        if target is None:
            target = next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
        other = next((a for a in args[1:] if isinstance(a, torch.Tensor)), None)
        if target is None and other is None:
            return None
        counter = self.counter
        if counter.on_device(source):
            return None  # (a 0-dim host scalar to the device is a blocking copy too)
        if other is not None and not counter.on_device(other):
            return None
        non_blocking = kwargs.get("non_blocking", next(
            (a for a in args[1:] if isinstance(a, bool)), False))
        if non_blocking and counter.is_pinned_host(source):
            return None
        return "to(device) from " + ("pageable" if non_blocking else "host") + " memory"


# Ops that read device values on the host, as the dispatch mode sees them.
_DISPATCHED_READS = {"aten::_local_scalar_dense": "item/bool", "aten::equal": "equal",
                     "aten::is_nonzero": "is_nonzero", "aten::nonzero": "nonzero",
                     "aten::masked_select": "masked_select", "aten::_unique2": "unique",
                     "aten::unique_consecutive": "unique_consecutive"}


def unseen_read(counter: HostSyncCounter, func, args) -> str | None:
    """For the dispatch mode: a host read of a device value that SyncCalls cannot see. Torch
    function modes are off while autograd runs a backward (its custom functions' backwards, tensor
    hooks and end-of-backward callbacks: the runtime's post-backward and gradient path), but
    dispatch modes stay on, so there the reads are judged by the ops they dispatch. (`.tolist()`
    and `.cpu()` of a CPU tensor dispatch none: inside a backward the model cannot see them.)"""
    kind = _DISPATCHED_READS.get(func._schema.name)
    if (kind is None or torch._C._current_graph_task_id() == -1
            or torch._C._is_torch_function_mode_enabled()):
        return None
    return f"{kind} (in backward)" if counter.on_device(args[:1]) else None


def copy_blocks(counter: HostSyncCounter, func, args, kwargs, model) -> str | None:
    """For the dispatch mode: `dst.copy_(src)` between host and device memory waits unless it is
    non-blocking and its host side is pinned."""
    if func._schema.name != "aten::copy_" or len(args) < 2:
        return None
    dst, src = args[0], args[1]
    if dst.dim() == 0 or src.dim() == 0:
        return None
    dst_host, src_host = model._block(dst).host, model._block(src).host
    if dst_host == src_host:
        return None
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    host_side = dst if dst_host else src
    if non_blocking and counter.is_pinned_host(host_side):
        return None
    direction = "device to host" if dst_host else "host to device"
    return f"copy_ {direction} ({'pageable' if non_blocking else 'blocking'})"


# Where the runtime may make its host sync, by (file, function), and why: one per optimizer step
# in all (ALLOWED_PER_STEP), at one of these; everything else the runtime does in a step must not
# block the host.
ALLOWED = {
    ("fsdp_ext/runtime/core/host_reads.py", "wait_bounded"): (
        1, "the collective tags' one check per step (read_flags), at the end of the backward that "
           "reduces gradients (a mismatch raises on every rank before an optimizer step can use "
           "the data); with CPU offload it also covers the host shards' copies to the device"),
    ("fsdp_ext/runtime/core/host_reads.py", "sync"): (
        1, "CPU offload without the tags on the device: the host shards are written by the "
           "optimizer step, after their copies to the device (read by the forward) completed "
           "(FSDP2 waits the same way)"),
}
ALLOWED_PER_STEP = 1


def _key(site: str) -> tuple[str, str]:
    """("path", "function") of a site "path:line (function)"."""
    path, _, rest = site.partition(":")
    return path, rest.partition("(")[2].rstrip(")")


def unallowed(records) -> list[HostSync]:
    """The runtime's host syncs, in any step (the first ones and set-up between steps included),
    at a site ALLOWED does not list: whatever the file, so a sync added anywhere in the runtime
    is found, not only one in a file a check names."""
    return [r for r in records if r.origin == "runtime" and _key(r.site) not in ALLOWED]


def over_allowance(rows: dict) -> list[str]:
    """The runtime's steady-state syncs beyond the allowance (rows: HostSyncCounter.per_step()):
    a site not in ALLOWED, or more than ALLOWED_PER_STEP per optimizer step in a scenario."""
    bad, totals = [], collections.Counter()
    for (scenario, origin, site, kind), rate in sorted(rows.items()):
        if origin != "runtime":
            continue
        totals[scenario] += rate
        limit = ALLOWED.get(_key(site), (0, ""))[0]
        if rate > limit + 1e-9:
            bad.append(f"{scenario}: {site}: {kind}, {rate:g} per step (allowed: {limit})")
    for scenario, total in sorted(totals.items()):
        if total > ALLOWED_PER_STEP + 1e-9:
            bad.append(f"{scenario}: {total:g} runtime host syncs per optimizer step in all "
                       f"(allowed: {ALLOWED_PER_STEP})")
    return bad


def table(rows: dict, steps: dict[str, int]) -> str:
    """Markdown: per scenario, the runtime's syncs per steady-state optimizer step (its total
    first, then by site), then fsdp_ext functions the user called, then the script's own."""
    lines = ["| scenario | steady optimizer steps | from | syncs per step | call site (kind) |",
             "|---|---|---|---|---|"]
    order = {"runtime": 0, "api": 1, "user": 2}
    for scenario in sorted(steps):
        mine = sorted(((order[o], site, kind, rate) for (s, o, site, kind), rate in rows.items()
                       if s == scenario), key=lambda r: (r[0], r[1]))
        runtime = sum(rate for o, _, _, rate in mine if o == 0)
        lines.append(f"| {scenario} | {steps[scenario]} | runtime | {runtime:g} | "
                     f"{'' if mine and mine[0][0] == 0 else '(none)'} |")
        for o, site, kind, rate in mine:
            name = [k for k, v in order.items() if v == o][0]
            label = site if kind == "*" else f"{site} ({kind})"
            lines.append(f"| | | {name} | {rate:g} | {label} |")
    return "\n".join(lines)


def main() -> None:
    """Print the tables `make stream-check` wrote (JSON files given on the command line)."""
    import json
    for path in sys.argv[1:]:
        with open(path) as f:
            data = json.load(f)
        rows = {tuple(r[:4]): r[4] for r in data["rows"]}
        print(f"\nHost syncs per steady-state optimizer step (iteration {STEADY_FROM} on), world "
              f"{data['world_size']}, under the stream-order model (diagnostics/host_syncs.py):\n")
        print(table(rows, data["steps"]))


if __name__ == "__main__":
    main()
