"""The stream-order model (fsdp_ext/diagnostics/stream_check.py) and the runtime's side-stream path
checked with it on CPU.

1. The model itself, on hand-written stream programs: each defect it exists to find (a missing wait,
   a read by the host before its copy finished, an early free whose block is reused) is reported
   with both places; the corrected programs are not.
2. Planted defects in the runtime: without a wait, with nothing kept alive, and the defects the
   model found (the no_sync accumulator and the post-forward chunks dropped while the side stream
   still read them; offloaded shards written by the host while their copy to the device may
   still read them), each re-introduced by a patch, must be reported (marked `stream_check`:
   `make stream-check` runs them with the scenarios).
3. The runtime, parity and training-loop scenarios run under the model (marked `stream_check`,
   `make stream-check`): every sharding strategy, reshard_after_forward True/False/int, prefetch
   depths, no_sync accumulation, CPU offload, HSDP, mixed precision, activation checkpointing,
   tied weights, unshard(async_op=True): no report, and the usual results.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from fsdp_ext.diagnostics import host_syncs
from fsdp_ext.diagnostics.stream_check import StreamOrderError, stream_check
from fsdp_ext.runtime import comm, streams
from fsdp_ext.runtime import unit as unit_module
from fsdp_ext.runtime.schedule import Schedule

from . import parity, stream_scenarios
from .dist_utils import run_distributed

CPU = torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


# ---- 2. planted defects in the runtime ----------------------------------------------------------
def _skip_event_wait(original):
    def wait(self, host=False):
        self.event = None  # planted: the waiting stream is never ordered after the collective
        return original(self, host)
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
    def reduce_bucket(unit, index, grads):
        accumulator = unit.bucket_grads[index].unsharded_accumulator
        original(unit, index, grads)
        if accumulator is not None and unit.requires_gradient_sync:
            pending = unit.schedule.pending_reduce_scatters[-1].pending
            pending.keep_alive[:] = [t for t in pending.keep_alive if t is not accumulator]
    return reduce_bucket


def _drop_post_forward_chunks(original):
    def unshard(self, async_op=True):
        regather = self.post_forward_chunks is not None
        original(self, async_op)
        if regather and self.pending_unshard is not None:
            self.pending_unshard.keep_alive.clear()
    return unshard


def _no_host_sync(original):
    def sync_host_reads(self):
        self.host_read_event = None  # planted: the host never waits for the copies of its shards
        original(self)
    return sync_host_reads


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
        Schedule, "sync_host_reads", _no_host_sync, stream_scenarios.offload_then_host_update,
        "(a)"),
}


def planted_worker(rank: int, world_size: int, plant: str) -> None:
    owner, attr, patch, scenario, kind = PLANTS[plant]
    original = getattr(owner, attr)
    setattr(owner, attr, patch(original))
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


def scenario_worker(rank: int, world_size: int) -> None:
    with stream_check() as model:
        stream_scenarios.run_all(rank, world_size, model.syncs.label)
    rows = model.syncs.per_step()
    if rank == 0:  # make stream-check prints it (python -m fsdp_ext.diagnostics.host_syncs)
        os.makedirs(SYNC_TABLE_DIR, exist_ok=True)
        steps = {name: len(model.syncs.steps[name])
                 for name, _ in stream_scenarios.scenarios(world_size)}
        with open(os.path.join(SYNC_TABLE_DIR, f"syncs_w{world_size}.json"), "w") as f:
            json.dump({"world_size": world_size, "steps": steps,
                       "rows": [[*key, rate] for key, rate in sorted(rows.items())]}, f, indent=1)
    bad = host_syncs.over_allowance(rows)
    assert not bad, (f"rank {rank}: host syncs in the runtime's steady-state step beyond "
                     "host_syncs.ALLOWED:\n" + "\n".join(bad))
    dist.barrier()


@pytest.mark.stream_check
@pytest.mark.parametrize("world_size", [2, 4])
def test_scenarios_have_no_stream_order_problem(world_size):
    run_distributed(scenario_worker, world_size, timeout_s=900)
