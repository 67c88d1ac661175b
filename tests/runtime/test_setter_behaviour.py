"""FSDP2's scheduling setters observed, not only their numbers: the same script under torch's
fully_shard and fsdp_ext's, each setter called before the first forward and between steps, and the
collectives each framework issues counted as (step, phase, kind, unit).

What a setter changes is compared, not the raw counts: the two runtimes schedule the baseline
differently on purpose (fsdp_ext keeps the last unit of the forward gathered for the backward that
starts with it, where FSDP2 frees and regathers it), so each framework's counts with the setter are
taken against its own counts without it, and those differences must agree. Tags (fsdp_ext's 8-byte
checks) are not counted: the runtime's own timeline events name the data collectives.

Counted: torch's foreach_all_gather / foreach_reduce calls (one per unit gather or reduction, the
unit from the calling parameter group) and, under HSDP, the torch.distributed.all_reduce each
foreach_reduce issues; fsdp_ext's all_gather.issue / reduce_scatter.issue events and the
comm.all_reduce_sum calls between a reduce_scatter.issue and its reduce_scatter.issued.

Prefetch lists change when all-gathers are issued, not how many: for them the order is compared,
the all-gathers issued between the starts of the units' forwards (backwards), each start marked by a
hook the test registers after the framework's own.
"""
from __future__ import annotations

import collections
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.utils._pytree import tree_leaves

from fsdp_ext.runtime.comm import collectives as comm
from fsdp_ext.runtime.core import trace

from ..helpers import fsdp2 as scripts
from ..helpers.dist import run_distributed

STEPS = 3


class _Counter:
    """(step, phase, kind, unit) of every data collective issued while installed; `log` keeps them
    in issue order, interleaved with the units' "forward" / "backward" marks (`mark`)."""

    def __init__(self, model):
        self.units = {id(m): name for name, m in model.named_modules()}
        self.counts: collections.Counter = collections.Counter()
        self.log: list[tuple[int, str, str, str]] = []
        self.step = 0
        self.reducing: str | None = None  # the unit whose gradient reduction is being issued

    def add(self, kind: str, unit: str) -> None:
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        self.counts[(self.step, phase, kind, unit or "root")] += 1
        self.log.append((self.step, phase, kind, unit or "root"))

    def mark(self, model) -> list:
        """Log "forward" when a unit's forward starts computing (after the framework's pre-forward
        hook: registered after it) and "backward" when its backward does (a hook on its outputs,
        after the framework's pre-backward hook on them). Both frameworks run their hooks in
        registration order, so the all-gathers logged before a mark were issued by then."""
        handles = []
        for name, module in model.named_modules():
            if not hasattr(module, "set_modules_to_forward_prefetch"):  # not a unit
                continue
            unit = name or "root"

            def pre(module, args, unit=unit):
                self.log.append((self.step, "forward", "forward", unit))

            def post(module, args, output, unit=unit):
                def backward(grad):
                    self.log.append((self.step, "backward", "backward", unit))
                for t in tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(backward)
            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        return handles

    def install(self, framework: str):
        if framework == "torch":
            originals = (_fsdp_param_group.foreach_all_gather, _fsdp_param_group.foreach_reduce,
                         dist.all_reduce)

            def counted(fn, kind):
                def wrapper(*args, **kwargs):
                    group = sys._getframe(1).f_locals["self"]  # the FSDPParamGroup issuing it
                    unit = self.units[id(group.modules[0])]
                    self.add(kind, unit)
                    if kind != "reduce_scatter":
                        return fn(*args, **kwargs)
                    self.reducing = unit
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        self.reducing = None
                return wrapper

            def all_reduce(*args, **kwargs):  # HSDP: foreach_reduce's all-reduce over replicas
                if self.reducing is not None:
                    self.add("all_reduce", self.reducing)
                return originals[2](*args, **kwargs)
            _fsdp_param_group.foreach_all_gather = counted(originals[0], "all_gather")
            _fsdp_param_group.foreach_reduce = counted(originals[1], "reduce_scatter")
            dist.all_reduce = all_reduce

            def restore():
                (_fsdp_param_group.foreach_all_gather, _fsdp_param_group.foreach_reduce,
                 dist.all_reduce) = originals
            return restore
        original, original_all_reduce = trace.RECORDER.add, comm.all_reduce_sum

        def add(kind: str, unit: str) -> None:
            if kind in ("all_gather.issue", "reduce_scatter.issue"):
                self.add(kind.partition(".")[0], unit)
            # a bucket's reduction is launched between these two events (runtime/bucket/grads.py)
            if kind == "reduce_scatter.issue":
                self.reducing = unit
            elif kind == "reduce_scatter.issued":
                self.reducing = None
            original(kind, unit)

        def all_reduce_sum(*args, **kwargs):  # HSDP: the all-reduce over replicas
            if self.reducing is not None:
                self.add("all_reduce", self.reducing)
            return original_all_reduce(*args, **kwargs)
        trace.RECORDER.add = add
        comm.all_reduce_sum = all_reduce_sum

        def restore():
            trace.RECORDER.add, comm.all_reduce_sum = original, original_all_reduce
        return restore


def _gpt_loss(model, step, rank, world):
    idx = scripts.batch(step, rank, world)
    return model(idx, idx)


def _gpt(fsdp):
    """GPT, blocks then root sharded; (model, loss(model, step, rank, world))."""
    return scripts.shard(fsdp, scripts.build()), _gpt_loss


def _embedding_unit(fsdp):
    """An embedding unit (its backward needs no parameter), an MLP unit, the root."""
    from ..api.test_fsdp2_surface import _EmbedThenMLP
    model = _EmbedThenMLP()
    fsdp.fully_shard(model.embed)
    fsdp.fully_shard(model.mlp)
    fsdp.fully_shard(model)
    return model, lambda model, step, rank, world: model(scripts.batch(step, rank, world))


_HSDP_MESH: list = []  # built once per process (a mesh makes process groups on every rank)


def _gpt_hsdp(fsdp):
    """GPT as `_gpt`, over a (world, 1) mesh (replicate, shard): HSDP at world 2, each unit's
    gradients reduced over its one-rank shard group, then all-reduced over the two replicas (a
    (1, world) mesh would leave a single replica: nothing to all-reduce over)."""
    if not _HSDP_MESH:
        _HSDP_MESH.append(init_device_mesh("cpu", (dist.get_world_size(), 1),
                                           mesh_dim_names=("replicate", "shard")))
    return scripts.shard(fsdp, scripts.build(), mesh=_HSDP_MESH[0]), _gpt_loss


def _collectives(fsdp, rank: int, world: int, setter, when: str, build=_gpt) -> _Counter:
    """The script (`build`'s model, AdamW, STEPS steps) with `setter(model)` called before the
    first forward ("before") or after the first step ("between"), or never (None)."""
    model, loss = build(fsdp)
    opt = scripts.adamw(model)
    counter = _Counter(model)
    handles = counter.mark(model)
    restore = counter.install(fsdp.name)
    try:
        if setter is not None and when == "before":
            setter(model)
        for step in range(STEPS):
            counter.step = step
            loss(model, step, rank, world).backward()
            opt.step()
            opt.zero_grad()
            if setter is not None and when == "between" and step == 0:
                setter(model)
    finally:
        restore()
        for handle in handles:
            handle.remove()
    return counter


_BASELINES: dict = {}  # (framework, model) -> the _Counter of a run without a setter (run once)


def _baseline(fsdp, rank, world, build) -> _Counter:
    key = (fsdp.name, build.__name__)
    if key not in _BASELINES:
        _BASELINES[key] = _collectives(fsdp, rank, world, None, "before", build)
    return _BASELINES[key]


def _effect(fsdp, rank, world, setter, when, build) -> dict:
    """What the setter changed: counts with it minus counts without it (non-zero entries)."""
    base = _baseline(fsdp, rank, world, build).counts
    with_it = _collectives(fsdp, rank, world, setter, when, build).counts
    keys = set(base) | set(with_it)
    return {k: with_it[k] - base[k] for k in sorted(keys) if with_it[k] != base[k]}


# name: (setter, model, units whose changes are left out of the comparison, and why)
SETTERS = {
    # no reduce-scatter in the steps after it (gradients accumulate unsharded)
    "set_requires_gradient_sync(False)": (lambda m: m.set_requires_gradient_sync(False), _gpt,
                                          ()),
    # every unit stays gathered from forward to backward: no backward all-gathers. The last unit
    # of the forward is left out: fsdp_ext never regathers it anyway (nothing to remove)
    "set_reshard_after_forward(False)": (lambda m: m.set_reshard_after_forward(False), _gpt,
                                         ("blocks.1",)),
    # gathered from backward to the next forward: that forward gathers nothing
    "set_reshard_after_backward(False)": (lambda m: m.set_reshard_after_backward(False), _gpt,
                                          ()),
    # the embedding's backward needs no parameters: no backward all-gather for it (torch's
    # contract: a unit whose backward does need them fails there)
    "embed.set_unshard_in_backward(False)": (lambda m: m.embed.set_unshard_in_backward(False),
                                             _embedding_unit, ()),
    # HSDP: the reductions still reduce-scatter, none all-reduces over the replicas
    "set_requires_all_reduce(False) (HSDP)": (lambda m: m.set_requires_all_reduce(False),
                                              _gpt_hsdp, ()),
    # HSDP: neither reduce-scatter nor all-reduce (torch: it "controls both")
    "set_requires_gradient_sync(False) (HSDP)": (lambda m: m.set_requires_gradient_sync(False),
                                                 _gpt_hsdp, ()),
}


def check_setter(rank: int, world: int, name: str, when: str) -> None:
    setter, build, left_out = SETTERS[name]
    effects = {}
    for fsdp in (scripts.torch_fsdp(), scripts.ours()):
        effect = _effect(fsdp, rank, world, setter, when, build)
        effects[fsdp.name] = {k: v for k, v in effect.items() if k[3] not in left_out}
    assert effects["torch"], f"{name} ({when}): torch's collectives did not change: vacuous"
    assert effects["fsdp_ext"] == effects["torch"], (
        f"rank {rank}: {name} called {when} the first forward changed the collectives "
        f"(step, phase, kind, unit): +added / -removed\n  torch:    {effects['torch']}\n"
        f"  fsdp_ext: {effects['fsdp_ext']}")


# ---- explicit prefetch lists: the order of the all-gathers ---------------------------------
def _issue_points(counter: _Counter, left_out=()) -> dict:
    """Per (step, phase), each unit's start of forward or backward in order, with the all-gathers
    issued since the previous one: [(unit, (units gathered, in issue order)), ...]. A unit gathered
    ahead of its own start shows at an earlier unit: where a prefetch list moves it. Gathers of
    `left_out` units are dropped."""
    points: dict = {}
    issued = collections.defaultdict(list)
    for step, phase, kind, unit in counter.log:
        key = (step, phase)
        if kind == "all_gather":
            if unit not in left_out:
                issued[key].append(unit)
        elif kind == phase and unit not in {u for u, _ in points.get(key, ())}:  # first start only
            points.setdefault(key, []).append((unit, tuple(issued.pop(key, ()))))
    for key, rest in issued.items():
        if rest:
            points.setdefault(key, []).append(("end", tuple(rest)))
    return points


def _set_prefetch_lists(model, phase: str, lists: dict) -> None:
    modules = {name or "root": m for name, m in model.named_modules()}
    for unit, listed in lists.items():
        setter = getattr(modules[unit], f"set_modules_to_{phase}_prefetch")
        setter([modules[name] for name in listed])


# name: (phase, {unit: the units it lists}, units left out of the comparison). Every unit of the
# phase gets a list: explicit lists replace each framework's own prefetching (torch: none in
# forward, the previous unit in reverse forward order in backward; fsdp_ext: its prefetch depth), so
# the whole order is the lists', the same in both; each gives an order neither framework has
# without lists. An empty forward list prefetches nothing in both; in backward torch treats an
# empty list as none given (its default prefetch runs: EMPTY_BACKWARD_LISTS), so a backward list
# that should prefetch nothing names the root, gathered from forward to the end of backward in both
# (no all-gather). blocks.1 is left out of the backward ones: fsdp_ext keeps the last unit of the
# forward gathered for its backward, where torch frees and regathers it.
PREFETCH = {
    "forward: root lists blocks.0 and blocks.1": (
        "forward", {"root": ["blocks.0", "blocks.1"], "blocks.0": [], "blocks.1": []}, ()),
    "forward: root lists blocks.1 only": (
        "forward", {"root": ["blocks.1"], "blocks.0": [], "blocks.1": []}, ()),
    "backward: root lists blocks.1 and blocks.0": (
        "backward", {"root": ["blocks.1", "blocks.0"], "blocks.1": ["root"], "blocks.0": ["root"]},
        ("blocks.1",)),
    "backward: root lists blocks.0 only": (
        "backward", {"root": ["blocks.0"], "blocks.1": ["root"], "blocks.0": ["root"]},
        ("blocks.1",)),
}
# torch's FSDPState._pre_backward: `default_prefetch = len(self._states_to_backward_prefetch) == 0`
EMPTY_BACKWARD_LISTS = ("backward", {"root": [], "blocks.1": [], "blocks.0": []}, ("blocks.1",))


def _steps_with_setter(when: str) -> range:
    return range(STEPS) if when == "before" else range(1, STEPS)


def _prefetch_orders(rank: int, world: int, scenario, when: str) -> tuple[dict, dict]:
    """Per framework, the scenario's phase per step with its lists set (`when`), and without lists:
    {step: [(unit start, all-gathers issued since the previous start)]}."""
    phase, lists, left_out = scenario
    patterns, baselines = {}, {}
    for fsdp in (scripts.torch_fsdp(), scripts.ours()):
        counter = _collectives(fsdp, rank, world,
                               lambda m: _set_prefetch_lists(m, phase, lists), when)
        points = _issue_points(counter, left_out)
        base = _issue_points(_baseline(fsdp, rank, world, _gpt), left_out)
        patterns[fsdp.name] = {s: points.get((s, phase)) for s in _steps_with_setter(when)}
        baselines[fsdp.name] = {s: base.get((s, phase)) for s in _steps_with_setter(when)}
    return patterns, baselines


def _same_order(rank: int, name: str, when: str, phase: str, patterns: dict) -> None:
    assert patterns["fsdp_ext"] == patterns["torch"], (
        f"rank {rank}: {name}, set {when} the first forward: the {phase} order of all-gathers "
        f"differs, per step [(unit start, all-gathers issued since the previous start)]:\n"
        f"  torch:    {patterns['torch']}\n  fsdp_ext: {patterns['fsdp_ext']}")


def check_prefetch_lists(rank: int, world: int, name: str, when: str) -> None:
    """With the lists, in both frameworks: every listed unit's all-gather is issued by the time the
    unit listing it starts (forward or backward), and the order of all-gathers and unit starts is
    torch's. Not vacuous: without lists, neither framework issues them so."""
    phase, lists, left_out = PREFETCH[name]
    patterns, baselines = _prefetch_orders(rank, world, PREFETCH[name], when)
    for framework, orders in patterns.items():
        for step, order in orders.items():
            starts = [unit for unit, _ in order]
            where = {g: starts.index(unit) for unit, gathered in order for g in gathered}
            for unit, listed in lists.items():
                for target in (t for t in listed if t not in left_out and t != "root"):
                    assert where.get(target, len(starts)) <= starts.index(unit), (
                        f"rank {rank}: {framework}, {name}, set {when} the first forward: step "
                        f"{step}'s {phase} all-gather of {target} is not issued by the time "
                        f"{unit} starts: (unit start, all-gathers issued since the previous "
                        f"start) {order}")
    for framework, base in baselines.items():
        assert base != patterns["torch"], (
            f"{name}: {framework} without lists already issues torch's order: vacuous")
    _same_order(rank, name, when, phase, patterns)


def check_empty_backward_prefetch_lists(rank: int, world: int, when: str) -> None:
    """set_modules_to_backward_prefetch([]) on every unit: torch runs its default backward prefetch
    (each unit's pre-backward gathers the previous unit in reverse forward order), as with no list;
    fsdp_ext's should give the same order."""
    patterns, baselines = _prefetch_orders(rank, world, EMPTY_BACKWARD_LISTS, when)
    assert patterns["torch"] == baselines["torch"], "torch: an empty list is no longer its default"
    _same_order(rank, "every unit's backward prefetch list empty", when, "backward", patterns)


def check_prefetch_depth(rank: int, world: int, when: str) -> None:
    """fsdp_ext's set_prefetch_depth (torch's FSDP2 has none), as documented (runtime/unit/schedule.py):
    from the second step on, forward issues the next `forward` units' all-gathers before the current
    unit computes, backward those of the previous `backward` ones. Depth 2 forward, 0 backward on
    this model: the root gathers both blocks, and each block gathers itself in backward (blocks.1
    left out: kept gathered from its forward)."""
    counter = _collectives(scripts.ours(), rank, world,
                           lambda m: m.set_prefetch_depth(forward=2, backward=0), when)
    points = {**_issue_points(counter), **{
        key: order for key, order in _issue_points(counter, ("blocks.1",)).items()
        if key[1] == "backward"}}
    expected = {
        "forward": [("root", ("root", "blocks.0", "blocks.1")), ("blocks.0", ()), ("blocks.1", ())],
        "backward": [("root", ()), ("blocks.1", ()), ("blocks.0", ("blocks.0",))]}
    for step in _steps_with_setter(when):
        if step == 0:  # no forward order yet: no forward prefetch by depth
            continue
        for phase, order in expected.items():
            assert points.get((step, phase)) == order, (
                f"rank {rank}: set_prefetch_depth(forward=2, backward=0) set {when} the first "
                f"forward: step {step}'s {phase} is {points.get((step, phase))}, documented "
                f"{order}")


# ---- HSDP gradient accumulation: reduce-scatters and all-reduces per micro-batch ----------
# Torch's documented gradient accumulation under HSDP: set_requires_gradient_sync(False) reduces
# nothing (it "controls both reduce-scatter and all-reduce"); set_requires_all_reduce(False)
# reduce-scatters but leaves the all-reduce to the next micro-batch that does it.
MICRO_BATCHES = (
    ("no sync", lambda m: m.set_requires_gradient_sync(False)),
    ("reduce-scatter only", lambda m: (m.set_requires_gradient_sync(True),
                                       m.set_requires_all_reduce(False))),
    ("synchronised", lambda m: m.set_requires_all_reduce(True)),
)


def check_hsdp_accumulation(rank: int, world: int) -> None:
    """Two optimizer steps of the three micro-batches above (the setters called before each, so
    before the first forward and between steps): the reductions each issues, per (step, micro-batch,
    kind, unit), are torch's, and so are the parameters after them."""
    counts, params = {}, {}
    for fsdp in (scripts.torch_fsdp(), scripts.ours()):
        model, loss = _gpt_hsdp(fsdp)
        opt = scripts.adamw(model)
        counter = _Counter(model)
        restore = counter.install(fsdp.name)
        try:
            for step in range(2):
                for micro, (what, setter) in enumerate(MICRO_BATCHES):
                    setter(model)
                    counter.step = (step, what)
                    loss(model, 3 * step + micro, rank, world).backward()
                opt.step()
                opt.zero_grad()
        finally:
            restore()
        counts[fsdp.name] = {k: v for k, v in counter.counts.items() if k[2] != "all_gather"}
        params[fsdp.name] = scripts.full_params(model)
    all_reduced = {k[0][1] for k in counts["torch"] if k[2] == "all_reduce"}
    assert all_reduced == {"synchronised"}, f"torch all-reduced in {all_reduced}: vacuous"
    assert counts["fsdp_ext"] == counts["torch"], (
        f"rank {rank}: HSDP gradient accumulation, reductions per ((step, micro-batch), phase, "
        f"kind, unit):\n  torch:    {sorted(counts['torch'].items())}\n"
        f"  fsdp_ext: {sorted(counts['fsdp_ext'].items())}")
    for name, value in params["torch"].items():
        torch.testing.assert_close(params["fsdp_ext"][name], value, atol=1e-6, rtol=1e-5)


def setters_worker(rank: int, world: int) -> None:
    for name in SETTERS:
        for when in ("before", "between"):
            check_setter(rank, world, name, when)
    for when in ("before", "between"):
        for name in PREFETCH:
            check_prefetch_lists(rank, world, name, when)
        check_prefetch_depth(rank, world, when)
    check_hsdp_accumulation(rank, world)
    check_is_last_backward_before_first_forward(rank, world)
    for when in ("before", "between"):
        check_empty_backward_prefetch_lists(rank, world, when)


def check_is_last_backward_before_first_forward(rank: int, world: int) -> None:
    """set_is_last_backward(False) before the first forward: that backward's end leaves its
    gradient reductions pending (torch: its end does not wait for them), the next forward finishes
    them; with micro-batches the results equal torch's."""
    model = scripts.shard(scripts.ours(), scripts.build())
    model.set_is_last_backward(False)
    idx = scripts.batch(0, rank, world)
    model(idx, idx).backward()
    schedule = model._unit.schedule
    assert schedule.pending_reduce_scatters, "set before the first forward, it was ignored"
    model.set_is_last_backward(True)
    model(idx, idx).backward()
    assert not schedule.pending_reduce_scatters
    results = {}
    for fsdp in (scripts.torch_fsdp(), scripts.ours()):
        model = scripts.shard(fsdp, scripts.build())
        model.set_is_last_backward(False)  # before the first forward, as a script may
        opt = scripts.adamw(model)
        for m in range(2):
            model.set_is_last_backward(m == 1)
            model(scripts.batch(m, rank, world), scripts.batch(m, rank, world)).backward()
        opt.step()
        results[fsdp.name] = [scripts.full(p.detach()).clone() for p in model.parameters()]
    for ours, theirs in zip(results["fsdp_ext"], results["torch"]):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("world_size", [2])
def test_setters_change_the_collectives_as_torchs_do(world_size):
    run_distributed(setters_worker, world_size, timeout_s=300)


def test_prefetch_depth_on_a_non_root_before_the_first_forward_is_its_own():
    """Schedule-wide setters write the record the root's schedule will read: on the root before
    the first forward, on any module after it; a non-root's own record before then is not the
    schedule's (torch's FSDP2 keeps only its root's state context at lazy initialisation)."""
    model = scripts.shard(scripts.ours(), scripts.build())
    model.blocks[0].set_prefetch_depth(forward=0)
    model.set_prefetch_depth(backward=2)
    with pytest.raises(ValueError, match="prefetch depth must be an int >= 0"):
        model.set_prefetch_depth(forward=-1)
    idx = torch.randint(0, scripts.CFG.vocab_size, (2, scripts.CFG.block_size))
    model(idx, idx).backward()
    options = model._unit.schedule.options
    assert (options.forward_prefetch, options.backward_prefetch) == (1, 2)
    model.blocks[1].set_prefetch_depth(forward=0)  # after the first forward: the schedule's
    assert options.forward_prefetch == 0 and model.blocks[0]._unit.schedule.options is options
