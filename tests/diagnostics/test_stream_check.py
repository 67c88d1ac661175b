"""The stream-order model (fsdp_ext/diagnostics/stream_check.py) and the runtime's side-stream path
checked with it on CPU.

1. The model itself, on hand-written stream programs: each defect it exists to find (a missing wait,
   a read by the host before its copy finished, an early free whose block is reused) is reported
   with both places; the corrected programs are not. The host-sync counter names each blocking
   call's line and spares asynchronous copies from pinned memory; a sync planted in a hook is
   named as the runtime's and fails the allowance (marked `stream_check`).
2. Planted defects in the runtime: without a wait, with nothing kept alive, and the defects the
   model found (the no_sync accumulator and the post-forward chunks dropped while the side stream
   still read them; offloaded shards written by the host while their copy to the device may
   still read them), each re-introduced by a patch, must be reported (marked `stream_check`:
   `make stream-check` runs them with the scenarios).
3. The runtime, parity and training-loop scenarios run under the model (marked `stream_check`,
   `make stream-check`): every sharding strategy, reshard_after_forward True/False/int, prefetch
   depths, no_sync accumulation, CPU offload, HSDP, mixed precision, activation checkpointing,
   tied weights, unshard(async_op=True), clip every step, FSDP x TP, fsdp_ext.optim.Muon's step
   (no host sync of its own): no report, the usual results,
   and no host sync in the runtime's steady-state step beyond host_syncs.ALLOWED (the table goes
   to out/stream-check/, which `make stream-check` prints).
"""
from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
import torch.distributed as dist

from fsdp_ext.diagnostics import host_syncs
from fsdp_ext.diagnostics.stream_check import StreamOrderError, stream_check
from fsdp_ext.runtime.comm import collective_tags, collectives as comm
from fsdp_ext.runtime.core import streams
from fsdp_ext.env import CHECK as CHECK_ENV
from fsdp_ext.runtime.unit import unit as unit_module
from fsdp_ext.runtime.core.host_reads import HostReads
from fsdp_ext.runtime.unit.states import ShardedState

from ..helpers import parity, stream_scenarios
from ..runtime import test_runtime
from ..helpers.dist import run_distributed

CPU = torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- 1. the model on hand-written programs ------------------------------------------------------
def _side_copy(wait: bool, keep_source: bool, host_reads: bool = False):
    """compute writes x; side reads it into y; compute (or the host) reads y."""
    side = streams.new_stream(CPU, name="side")
    compute = streams.current_stream(CPU)
    x = torch.ones(4096)
    streams.wait_stream(side, compute)
    with streams.use_stream(side):
        y = streams.host_empty(4096, torch.float32, pin=True) if host_reads else torch.empty(4096)
        y.copy_(x * 2, non_blocking=True)
        event = streams.record_event(side)
    held = [x] if keep_source else []
    del x
    torch.empty(4096).fill_(7.0)  # a compute allocation that may reuse x's block
    if wait:
        (streams.synchronize if host_reads else
         lambda e: streams.wait_event(compute, e))(event)
    total = y.sum() if not host_reads else y.clone()
    held.clear()
    return total


def _problems(**kwargs) -> list[str]:
    with stream_check(raise_on_exit=False) as model:
        _side_copy(**kwargs)
    return model.problems


def test_model_reports_a_missing_wait():
    problems = _problems(wait=False, keep_source=True)
    assert len(problems) == 1 and problems[0].startswith("(a) read on stream 'compute (cpu)'")
    assert "write by copy_ on stream 'side' at _side_copy" in problems[0]
    assert "then read by sum on stream 'compute (cpu)'" in problems[0]


def test_model_reports_a_host_read_before_the_copy_finished():
    problems = _problems(wait=False, keep_source=True, host_reads=True)
    assert len(problems) == 1 and problems[0].startswith("(a) read on stream 'host'"), problems


def test_model_reports_an_early_free_whose_block_is_reused():
    problems = _problems(wait=True, keep_source=False)
    assert len(problems) == 1 and problems[0].startswith(
        "(b) a 16384-byte buffer allocated on stream 'compute (cpu)' by ones"), problems
    assert "read by mul on stream 'side'" in problems[0]
    assert "may hand that memory to empty (16384 bytes) at _side_copy" in problems[0]


def test_model_accepts_the_corrected_programs():
    assert _problems(wait=True, keep_source=True) == []
    assert _problems(wait=True, keep_source=True, host_reads=True) == []


def test_model_raises_on_exit_and_restores_the_seam():
    before = streams.side_streams(CPU)
    with pytest.raises(StreamOrderError, match="1 stream-order problem"):
        with stream_check():
            _side_copy(wait=False, keep_source=True)
    assert streams.side_streams(CPU) == before is False


def _host_syncs(program) -> list:
    """The host syncs `program()` makes under the model, as (kind, site) pairs."""
    with stream_check(raise_on_exit=False) as model:
        program()
    return [(r.kind, r.site) for r in model.syncs.records]


def test_counter_names_each_blocking_call_and_spares_pinned_non_blocking_copies():
    device = torch.ones(1024)  # (made before the check: device memory in the model)

    def program():
        pinned = streams.host_empty(1024, torch.float32, pin=True)
        pageable = streams.host_empty(1024, torch.float32, pin=False)
        pinned.copy_(device, non_blocking=True)      # asynchronous: not a sync
        device.copy_(pinned, non_blocking=True)      # likewise, host to device
        step = torch.tensor(0.0)                     # a host scalar (an optimizer's step)
        step += 1
        float(step)                                  # host memory: not a sync
        pageable.copy_(device, non_blocking=True)    # pageable memory: the copy waits
        pinned.copy_(device)                         # blocking
        device.sum().item()
        device[device > 0]                           # boolean-mask indexing: a data-dependent size
        torch.tensor([3], device=CPU)                # Python data onto the device
    syncs = _host_syncs(program)
    line = program.__code__.co_firstlineno
    here = os.path.relpath(__file__, ROOT)
    assert syncs == [
        ("copy_ device to host (pageable)", f"{here}:{line + 8} (program)"),
        ("copy_ device to host (blocking)", f"{here}:{line + 9} (program)"),
        ("item", f"{here}:{line + 10} (program)"),
        ("boolean-mask indexing", f"{here}:{line + 11} (program)"),
        ("tensor(data, device=...)", f"{here}:{line + 12} (program)"),
    ], syncs


def _planted_sync(original):
    def wait_unshard(self):
        original(self)
        if self.unsharded and self.buckets:
            self.buckets[0].full_data.sum().item()  # planted: a host sync in a hook
    return wait_unshard


def planted_sync_worker(rank: int, world_size: int) -> None:
    """A `.item()` planted in the unit's all-gather wait: the counter names the planted line as a
    runtime sync in every steady-state step, and the allowance check fails."""
    original = unit_module.Unit.wait_unshard
    unit_module.Unit.wait_unshard = _planted_sync(original)
    try:
        with stream_check(raise_on_exit=False) as model:
            stream_scenarios.no_sync_accumulation(rank, world_size)
    finally:
        unit_module.Unit.wait_unshard = original
    line = _planted_sync.__code__.co_firstlineno + 4
    site = f"{os.path.relpath(__file__, ROOT)}:{line} (wait_unshard)"
    rows = model.syncs.per_step()
    planted = [rate for (_, origin, where, kind), rate in rows.items()
               if where == site and origin == "runtime" and kind == "item"]
    assert planted and planted[0] >= 1, rows
    assert any(site in bad for bad in host_syncs.over_allowance(rows))
    dist.barrier()


@pytest.mark.stream_check
def test_steps_of_a_root_made_where_a_freed_one_was_stay_its_own():
    """A root made after another was freed may get its id(); counted by id(), their steps merged
    (the own_meshes scenario once counted 24 runtime syncs in 23 steps on one rank so). Roots are
    counted by serial: each first-seen root is a new one."""
    import types

    class Root:  # (slots: another size than the weak reference the counter makes)
        __slots__ = ("a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "__weakref__")
    counter = host_syncs.HostSyncCounter(types.SimpleNamespace(iteration=0))
    roots = 0
    for _ in range(1000):
        first = Root()
        address = id(first)
        counter.iteration_started(first, 2)
        roots += 1
        del first
        second = Root()
        if id(second) == address:
            break
        del second
    else:
        pytest.skip("no freed address was reused in 1000 tries")
    counter.iteration_started(second, 2)
    assert counter.steps_of("") == roots + 1


def test_planted_host_sync_is_named():
    run_distributed(planted_sync_worker, 2)


def _planted_starts_sync(original):
    def __init__(self, layout, block, device):
        original(self, layout, block, device)
        host = self.tensors[0][0].to("cpu")   # planted: a blocking copy of the starts ...
        self.tensors[0][0].sum().item()       # ... and a host read of them
        del host
    return __init__


def _planted_clip_syncs(original):
    def to_device(terms, on_host, device):
        moved = original(terms, on_host, device)
        for term in moved:
            term.sum().item()  # planted: one host read per unit's norm terms, on the device
        return moved
    return to_device


def _patched(owner, attr, patch):
    """A context that replaces owner.attr by patch(original) while it is open (None: no patch)."""
    @contextlib.contextmanager
    def patched():
        if patch is None:
            yield
            return
        original = getattr(owner, attr)
        setattr(owner, attr, patch(original))
        try:
            yield
        finally:
            setattr(owner, attr, original)
    return patched()


def _expect(planted: bool, check) -> None:
    """Run `check`; with a planted defect it must fail (what makes its assertion able to fail)."""
    if not planted:
        check()
        return
    with pytest.raises((AssertionError, StreamOrderError)):
        check()


def quantized_first_step_worker(rank: int, world_size: int, plant: bool) -> None:
    """CommPolicy int8 both ways over the first steps, where each bucket's block starts go to
    the device: no host sync from the runtime beyond host_syncs.ALLOWED in any step, the first
    ones included (one non-blocking copy from pinned memory per bucket; one blocking pageable
    copy per gather group and rank before), wherever the runtime would make it. `plant`: a
    blocking copy and a host read added where the starts go to the device must fail that."""
    from ..runtime import test_comm_policy as cp
    from fsdp_ext.runtime.wire import quantized as wire_quantized
    import fsdp_ext
    with _patched(wire_quantized._Starts, "__init__", _planted_starts_sync if plant else None):
        with stream_check() as model:
            cp._train(cp._shard(cp._gpt(), "fully_shard", fsdp_ext.CommPolicy("int8", "int8")),
                      rank, world_size, steps=2)

    def check():
        mine = host_syncs.unallowed(model.syncs.records)
        assert not mine, mine
    _expect(plant, check)
    dist.barrier()


@pytest.mark.stream_check
@pytest.mark.parametrize("plant", [False, True], ids=["as_is", "planted_sync"])
def test_quantized_first_step_makes_no_host_sync(plant):
    run_distributed(quantized_first_step_worker, 2, plant)


# name: (what to patch, its attribute, the patch)
CLIP_PLANTS = {"clip_sync_per_unit": ("api.clip", "_to_device", _planted_clip_syncs),
               "runtime_sync_per_unshard": ("runtime.unit.unit", "Unit.wait_unshard", _planted_sync)}


def _clip_plant(plant):
    if plant is None:
        return _patched(None, None, None)
    import importlib
    module, attr, patch = CLIP_PLANTS[plant]
    owner = importlib.import_module(f"fsdp_ext.{module}")
    *path, attr = attr.split(".")
    for name in path:
        owner = getattr(owner, name)
    return _patched(owner, attr, patch)


def _syncs_of(model, call, into: list):
    """`call`, wrapped: the host syncs each of its calls makes, wherever, go to `into`."""
    def recorded(*args, **kwargs):
        first = len(model.syncs.records)
        result = call(*args, **kwargs)
        into.extend(model.syncs.records[first:])
        return result
    return recorded


def _once_per_step_from_the_second(model, steps: int, rank: int) -> None:
    """The runtime's host syncs at ALLOWED sites only, and one per step from the second on (one
    root, one forward per step)."""
    assert not host_syncs.unallowed(model.syncs.records), model.syncs.records
    runtime = [r.step for r in model.syncs.records if r.origin == "runtime"]
    counts = [runtime.count(s) for s in range(1, steps + 1)]
    assert counts[1:] == [1] * (steps - 1), (rank, counts, model.syncs.records)


def offload_clip_worker(rank: int, world_size: int, plant: str | None) -> None:
    """CPU offload with clip_grad_norm_ every step (four units): the host syncs of fsdp_ext's API
    (the clip) are one per step, the coefficient the host needs to scale the host gradients (the
    norms of every unit go to the device in one copy from pinned memory; one blocking copy per
    unit before); and the runtime's, one per optimizer step in all. `plant`: a host read per unit
    in the clip, or one in every all-gather's wait, must fail these."""
    import fsdp_ext

    in_clip = []  # the host syncs each clip_grad_norm_ call made, wherever in fsdp_ext

    def clip(sharded, _):
        if isinstance(sharded, fsdp_ext.FSDPModule):
            _syncs_of(model, lambda: sharded.clip_grad_norm_(1e9), in_clip)()
    with _clip_plant(plant), stream_check() as model:
        with model.syncs.label("offload_clip"):
            test_runtime._compare_training(
                rank, world_size, stream_scenarios._gpt,
                stream_scenarios._shard_blocks(offload_policy=fsdp_ext.CPUOffloadPolicy()),
                stream_scenarios._tokens, stream_scenarios._gpt_loss, steps=4,
                after_backward=clip)

    def check():
        steps = model.syncs.steps_of("offload_clip")
        steady = [r for r in in_clip if r.step >= host_syncs.STEADY_FROM and r.origin != "user"]
        assert steps >= 2 and len(steady) <= steps, (steps, steady)
        bad = host_syncs.over_allowance(model.syncs.per_step())
        assert not bad, bad
    _expect(plant is not None, check)
    dist.barrier()


@pytest.mark.stream_check
@pytest.mark.parametrize("plant", [None, *CLIP_PLANTS])
def test_offload_clip_syncs_once_per_step(plant):
    run_distributed(offload_clip_worker, 2, plant)


def _pipelined_unknown(original):
    def finish_reductions(self):
        original(self)
        self.pipelined = False  # planted: the schedule forgets that forwards run ahead
    return finish_reductions


def pipeline_worker(rank: int, world_size: int, plant: bool, schedule: str = "1F1B") -> None:
    """PP 2 x FSDP 2 under torch's Schedule1F1B, and ScheduleZBVZeroBubble (two stages per rank, the
    weight passes' gradients held and summed: tests/api/test_pipelining.py), the side-stream path
    under the model: no stream-order problem; the runtime's host syncs only at ALLOWED sites, and
    from the second optimizer step on one per step on every rank, though the first stage runs
    the second micro-batch's forward before the first one's backward (its tags are read once, at
    the step's end). The first step makes one more there: the schedule learns it is pipelined at
    that step's end. `plant`: a schedule that forgets it must fail the count on the first
    stage's ranks. With two stages per rank (ZBV) the model counts 10-11 runtime syncs in 3 steps
    on every rank (1F1B: at most 4), as it does under Interleaved1F1B, which has two stages per
    rank and no weight pass: only the sites are checked there (the count is an open item)."""
    import fsdp_ext
    from fsdp_ext.runtime.unit.schedule import Schedule
    from ..api import test_pipelining
    steps = 3
    with _patched(Schedule, "finish_reductions", _pipelined_unknown if plant else None):
        with stream_check() as model:
            test_pipelining.train(fsdp_ext.fully_shard, schedule, steps=steps)
    # root iterations per step: a micro-batch's forward, per stage this rank holds
    per_step = test_pipelining.MICRO_BATCHES * len(test_pipelining._stage_ids(schedule, 0, 2)[0])

    def check():
        assert not host_syncs.unallowed(model.syncs.records), model.syncs.records
        runtime = [r.step for r in model.syncs.records if r.origin == "runtime"]
        counts = [sum(1 for i in runtime if s * per_step < i <= (s + 1) * per_step)
                  for s in range(steps)]
        if schedule == "1F1B":
            assert counts[0] <= 2 and counts[1:] == [1] * (steps - 1), (rank, counts)
    # (the last stage's ranks, 2 and 3, run each forward's backward before the next forward)
    _expect(plant and rank < 2, check)
    dist.barrier()


@pytest.mark.stream_check
@pytest.mark.parametrize("plant", [False, True], ids=["as_is", "planted_sync"])
def test_pipeline_syncs_once_per_step(plant):
    run_distributed(pipeline_worker, 4, plant, timeout_s=300.0)


@pytest.mark.stream_check
def test_split_backward_pipeline_syncs_once_per_step():
    run_distributed(pipeline_worker, 4, False, "ZBVZeroBubble", timeout_s=300.0)



def _every_group_sent(original):
    def groups_sent(layout, used, ran):
        return None  # planted: a member that did not run is sent as zeros
    return groups_sent


def _tested_at_once(original):
    def unpublish_unused(bucket, indices, host_reads):
        for i in indices:  # planted: each one's zeros tested on the host at once
            if not bucket.grad_views[i].any():
                bucket.unpublish_grad(i)
    return unpublish_unused


def chunked_loss_worker(rank: int, world_size: int, plant: bool) -> None:
    """torchtitan's chunked loss (tests/runtime/test_reduce_once.py's decoder: `[norm, lm_head]` one
    list unit, `lm_head` run per chunk with a backward each) with an optimizer step, on the
    side-stream path under the model: no stream-order problem, and from the second step on one
    runtime host sync per step. `plant`: the member that did not run sent as zeros and their
    test read on the host at once (grads.py before the gradients were reduced as torch reduces
    them) must fail the count."""
    from torchtitan.components.loss import ChunkedLossWrapper

    import fsdp_ext
    from fsdp_ext.runtime.bucket import grads
    from ..runtime.test_reduce_once import Decoder
    steps = 3
    with _patched(grads, "groups_sent", _every_group_sent if plant else None), \
            _patched(grads, "_unpublish_unused", _tested_at_once if plant else None), \
            stream_check() as model:
        torch.manual_seed(0)
        decoder = Decoder()
        for module in (decoder.emb, decoder.body):
            fsdp_ext.fully_shard(module)
        fsdp_ext.fully_shard([decoder.norm, decoder.lm_head])
        fsdp_ext.fully_shard(decoder)
        opt = torch.optim.AdamW(decoder.parameters(), lr=1e-3)
        loss_fn = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=2))
        loss_fn.set_lm_head(decoder.lm_head)
        for step in range(steps):
            idx = torch.randint(0, Decoder.VOCAB, (2, 8),
                                generator=torch.Generator().manual_seed(10 * step + rank))
            loss, _ = loss_fn(decoder(idx), idx.roll(1, 1))
            loss.backward()
            opt.step()
            opt.zero_grad()

    _expect(plant, lambda: _once_per_step_from_the_second(model, steps, rank))
    dist.barrier()


@pytest.mark.stream_check
@pytest.mark.parametrize("plant", [False, True], ids=["as_is", "planted_zeros_tested"])
def test_chunked_loss_syncs_once_per_step(plant):
    run_distributed(chunked_loss_worker, 2, plant)


def _muon_reads_each_update(original):
    def apply(param, ortho, group, lr):
        float(ortho.abs().max())  # planted: a host read per parameter in the optimizer step
        return original(param, ortho, group, lr)
    return apply


def muon_worker(rank: int, world_size: int, plant: bool) -> None:
    """fsdp_ext.optim.Muon on fsdp_ext's shards (tests/optim/test_dist_muon.py's split: qkv per
    head, whole blocks on each rank, batched by shape; the other matrices each to an owner rank
    and back, two all-to-alls), AdamW for the rest, under the model: no stream-order problem;
    the runtime's host syncs at ALLOWED sites, one per step from the second on; and none at all
    from the Muon step (split sizes and owners come from shapes on the host). `plant`: a host
    read of each parameter's update in the step must fail the last."""
    import fsdp_ext
    from fsdp_ext.optim import muon
    from ..optim import test_dist_muon, test_muon
    steps = 4
    with _patched(muon, "_apply", _muon_reads_each_update if plant else None), \
            stream_check() as model:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
        net, optimizers = test_dist_muon._built(
            fsdp_ext.fully_shard, lambda m, mesh: test_dist_muon._fsdp_ext_muon(m, mesh, True),
            mesh)
        in_muon = []  # the host syncs each Muon step made
        optimizers[0].step = _syncs_of(model, optimizers[0].step, in_muon)
        test_muon._steps(net, optimizers, rank, world_size, range(steps), rows=8)

    def check():
        _once_per_step_from_the_second(model, steps, rank)
        assert not in_muon, in_muon
    _expect(plant, check)
    dist.barrier()


@pytest.mark.stream_check
@pytest.mark.parametrize("plant", [False, True], ids=["as_is", "planted_read"])
def test_muon_step_makes_no_host_sync(plant):
    run_distributed(muon_worker, 2, plant)


# ---- 2. planted defects in the runtime ----------------------------------------------------------
def _skip_event_wait(original):
    def wait(self):
        self.event = None  # planted: the waiting stream is never ordered after the collective
        return original(self)
    return wait


def _hold_nothing(original):
    class Forgetful(list):
        def extend(self, items):  # planted: nothing is kept for the side stream
            pass

    def launch(self, stream_name, fn, keep_alive, label="", after_event=None, tags=None):
        pending = original(self, stream_name, fn, [], label, after_event, tags)
        pending.keep_alive = Forgetful()
        return pending
    return launch


def _drop_accumulator(original):
    def reduce_bucket(unit, bucket, grads, ran=None):
        accumulator = bucket.grads.unsharded_accumulator
        original(unit, bucket, grads, ran)
        if accumulator is not None and unit.requires_gradient_sync:
            pending = unit.schedule.pending_reduce_scatters[-1].pending
            pending.keep_alive[:] = [t for t in pending.keep_alive if t is not accumulator]
    return reduce_bucket


def _drop_post_forward_chunks(original):
    def unshard(self, async_op=True, **kwargs):
        regather = self.params.sharded_state is ShardedState.SHARDED_POST_FORWARD
        original(self, async_op, **kwargs)
        if regather and self.params.in_flight is not None:
            self.params.in_flight.pending.keep_alive.clear()
    return unshard


def _no_host_sync(original):
    def order(self):
        self.event = None  # planted: nothing waits for the copies of the host shards
        original(self)
    return order


def _reshard_2(rank: int, world_size: int) -> None:
    parity.run_case(parity.Case("gpt", "fully_shard", "RESHARD_2"), rank, world_size)


# name: (what to patch, its attribute, the patch, the scenario, the kind of report expected)
PLANTS = {
    "missing_wait": (comm.Pending, "wait", _skip_event_wait,
                     stream_scenarios.no_sync_accumulation, "(a)"),
    "nothing_kept_alive": (comm.Streams, "launch", _hold_nothing,
                           stream_scenarios.no_sync_accumulation, "(b)"),
    "no_sync_accumulator_dropped": (unit_module, "reduce_bucket", _drop_accumulator,
                                    stream_scenarios.no_sync_accumulation, "(b)"),
    "post_forward_chunks_dropped": (unit_module.Unit, "unshard", _drop_post_forward_chunks,
                                    _reshard_2, "(b)"),
    "offloaded_shards_written_during_their_copy": (
        HostReads, "order", _no_host_sync, stream_scenarios.offload_then_host_update,
        "(a)"),
}


# The collective tags' one host sync per step (collective_tags.read_flags) orders the host after
# every all-gather the compute stream waited for: with them on, the host shards are safe to write
# even without HostReads.sync's wait. Off, that wait alone orders them.
PLANT_ENV = {"offloaded_shards_written_during_their_copy": {CHECK_ENV: "off"}}


def planted_worker(rank: int, world_size: int, plant: str) -> None:
    owner, attr, patch, scenario, kind = PLANTS[plant]
    original = getattr(owner, attr)
    setattr(owner, attr, patch(original))
    os.environ.update(PLANT_ENV.get(plant, {}))
    try:
        with stream_check(raise_on_exit=False) as model:
            scenario(rank, world_size)
    finally:
        setattr(owner, attr, original)
    found = [p for p in model.problems if p.startswith(kind)]
    assert found, f"rank {rank}: planted '{plant}' not reported; problems: {model.problems}"
    dist.barrier()


@pytest.mark.stream_check
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_runtime_defect_is_reported(plant):
    run_distributed(planted_worker, 4 if plant == "post_forward_chunks_dropped" else 2, plant)


# ---- 3. the scenarios under the model -----------------------------------------------------------
SYNC_TABLE_DIR = os.environ.get("FSDP_EXT_SYNC_TABLE_DIR", os.path.join(ROOT, "out", "stream-check"))


def scenario_worker(rank: int, world_size: int, plant: str | None = None) -> None:
    """Every scenario under the model: no stream-order problem, and no host sync of the runtime's
    steady-state step beyond host_syncs.ALLOWED (the table goes to SYNC_TABLE_DIR). `plant`: one
    scenario with a runtime defect of SCENARIO_PLANTS, which must fail those checks."""
    chosen = stream_scenarios.scenarios(world_size)
    patch = None
    if plant is not None:
        chosen = [(name, fn) for name, fn in chosen if name == SCENARIO_PLANTED_IN]
        patch = SCENARIO_PLANTS[plant]

    def check():
        with stream_check() as model:
            for name, fn in chosen:
                with model.syncs.label(name):
                    fn(rank, world_size)
        rows = model.syncs.per_step()
        if rank == 0 and plant is None:  # make stream-check prints it (host_syncs' __main__)
            os.makedirs(SYNC_TABLE_DIR, exist_ok=True)
            steps = {name: model.syncs.steps_of(name) for name, _ in chosen}
            with open(os.path.join(SYNC_TABLE_DIR, f"syncs_w{world_size}.json"), "w") as f:
                json.dump({"world_size": world_size, "steps": steps,
                           "rows": [[*key, rate] for key, rate in sorted(rows.items())]}, f,
                          indent=1)
        bad = host_syncs.over_allowance(rows)
        assert not bad, (f"rank {rank}: host syncs in the runtime's steady-state step beyond "
                         "host_syncs.ALLOWED:\n" + "\n".join(bad))
    with _patched(*patch) if patch else contextlib.nullcontext():
        _expect(plant is not None, check)
    dist.barrier()


# The scenario suite's two verdicts, each made to fail by a defect planted in the runtime: an
# access not ordered after the collective (a stream-order report), a host read in every unit's
# all-gather wait (over the allowance).
SCENARIO_PLANTED_IN = "gradient_accumulation"
SCENARIO_PLANTS = {"missing_wait": (comm.Pending, "wait", _skip_event_wait),
                   "host_sync_per_unshard": (unit_module.Unit, "wait_unshard", _planted_sync)}


@pytest.mark.stream_check
@pytest.mark.parametrize("world_size", [2, 4])
def test_scenarios_have_no_stream_order_problem(world_size):
    run_distributed(scenario_worker, world_size, timeout_s=900)


@pytest.mark.stream_check
@pytest.mark.parametrize("plant", sorted(SCENARIO_PLANTS))
def test_scenario_verdicts_fail_on_a_planted_defect(plant):
    run_distributed(scenario_worker, 2, plant)
