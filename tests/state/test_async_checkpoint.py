"""dcp.async_save of fsdp_ext's model and optimizer state (torchtitan's async mode): training goes
on while it saves, the checkpoint holds the values at the call, and it loads bit-exactly into
fsdp_ext and into torch's FSDP2 at another world size. Thread staging, and process staging with
pinned shared memory; `copy.deepcopy` and `torch.save` of the same state dict too. Then
fsdp_ext.save_checkpoint(async_save=True) several times without a wait: one save in flight at a
time (state/checkpoint.py, [Note: one save in flight])."""
from __future__ import annotations

import copy
import faulthandler
import io
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

import fsdp_ext

from ..helpers import fsdp2 as scripts
from ..helpers.dist import run_distributed

STAGINGS = ("thread", "process")


def _state(model, opt, full: bool = False) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=full))
    return {"model": msd, "optim": osd}


def _flat(state: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _assert_equal(got: dict, expected: dict, what: str) -> None:
    got, expected = _flat(got), _flat(expected)
    assert got.keys() == expected.keys(), what
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(scripts.full(got[key]), value), f"{what}: {key}"
        else:
            assert got[key] == value, f"{what}: {key}"


def _async_save(state: dict, path: str, staging: str, group):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    if staging == "thread":
        return dcp.async_save(state, checkpoint_id=path, process_group=group)
    return dcp.async_save(
        state, checkpoint_id=path, process_group=group,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        async_stager=DefaultStager(StagingOptions(  # (pinned memory and non-blocking
            use_pinned_memory=False, use_shared_memory=True,  # copies need an accelerator)
            use_async_staging=True, use_non_blocking_copy=False)))


def _wait(response) -> None:
    if hasattr(response, "upload_completion"):  # AsyncSaveResponse: staged, then written
        response.upload_completion.result()
    else:
        response.result()


def save_worker(rank: int, world: int, directory: str) -> None:
    """Train 2 steps; per staging, save asynchronously and train 2 more steps while it saves."""
    model = scripts.shard(scripts.ours(), scripts.build())
    opt = scripts.adamw(model)
    scripts.train(model, opt, 2, rank, world)
    sharded = _state(model, opt)
    copied = copy.deepcopy(sharded)
    buffer = io.BytesIO()
    torch.save(sharded, buffer)
    group = dist.new_group(backend="gloo")  # the checkpoint's own, as torchtitan's async mode
    at_call, step = {}, 2
    for staging in STAGINGS:
        # gathered before the save; cloned: the optimizer's `step` tensors are the live ones
        at_call[staging] = tree_map_only(torch.Tensor, torch.clone, _state(model, opt, full=True))
        response = _async_save(_state(model, opt), f"{directory}/{staging}", staging, group)
        if staging == "process":  # staged on a thread: the state is copied before it changes
            response.staging_completion.result()  # (torchtitan waits so before its next step)
        scripts.train(model, opt, 2, rank, world, first_step=step)  # while it saves
        step += 2
        _wait(response)
    after = _state(model, opt, full=True)
    for staging in STAGINGS:  # (the values did change after each call)
        assert not torch.equal(after["model"]["lm_head.weight"],
                               at_call[staging]["model"]["lm_head.weight"])
    reloaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    for what, state in (("copy.deepcopy", copied), ("torch.save", reloaded)):
        _assert_equal(state, at_call["thread"], f"rank {rank}: {what} of the sharded state dict")
    if rank == 0:
        torch.save(at_call, f"{directory}/at_call.pt")
    dist.barrier()


def load_worker(rank: int, world: int, directory: str) -> None:
    """At another world size, each checkpoint into fsdp_ext and into torch's FSDP2: the values
    at the call, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    at_call = torch.load(f"{directory}/at_call.pt", weights_only=False)
    for staging in STAGINGS:
        for fsdp in (scripts.ours(), scripts.torch_fsdp()):
            model = scripts.shard(fsdp, scripts.build(seed=5))
            opt = scripts.adamw(model)
            scripts.train(model, opt, 1, rank, world)  # optimizer state to load into
            state = _state(model, opt)
            dcp.load(state, checkpoint_id=f"{directory}/{staging}")
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            _assert_equal(_state(model, opt, full=True), at_call[staging],
                          f"rank {rank}: {staging} staging, loaded into {fsdp.name}")
    dist.barrier()


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("async_checkpoint"))


@pytest.mark.parametrize("phase,world_size", [("save", 2), ("load", 3)])
def test_async_save_holds_the_values_at_the_call(phase, world_size, checkpoint_dir):
    run_distributed(save_worker if phase == "save" else load_worker, world_size, checkpoint_dir,
                    timeout_s=300)


def _exit_if_still_running(seconds: float) -> None:
    """End this rank after `seconds`, printing every thread's stack: a hang fails the test
    instead of stalling it (the checkpoint's group waits 30 min by default). faulthandler's
    watchdog is a C thread: it fires even while a hung collective holds the GIL."""
    faulthandler.dump_traceback_later(seconds, exit=True)


def back_to_back_worker(rank: int, world: int, directory: str) -> None:
    """save_checkpoint(async_save=True) twice without a wait in between, then twice more with a
    training step before each: a save started while another is in flight waits for it and
    publishes it first. Nothing hangs, each checkpoint holds the values at its call, and
    `latest` names the last one."""
    _exit_if_still_running(60)
    if rank == world - 1:  # a slower disk here: this rank's writer ends after the others'
        from torch.distributed.checkpoint import FileSystemWriter
        write_data = FileSystemWriter.write_data

        def slow_write_data(self, plan, planner):
            time.sleep(0.5)
            return write_data(self, plan, planner)
        FileSystemWriter.write_data = slow_write_data
    model = scripts.shard(scripts.ours(), scripts.build())
    opt = scripts.adamw(model)
    scripts.train(model, opt, 1, rank, world)
    at_call, pending = {}, {}
    for step in (1, 2, 3, 4):
        if step >= 3:
            scripts.train(model, opt, 1, rank, world, first_step=step)
        at_call[step] = scripts.full_params(model)
        pending[step] = fsdp_ext.save_checkpoint(directory, model, opt, step=step,
                                                 extra={"step": step}, async_save=True)
    published_by_the_next_save = [pending[step].path is not None for step in (1, 2, 3)]
    paths = {step: p.result() for step, p in pending.items()}  # (hung here, every rank)
    assert published_by_the_next_save == [True, True, True]
    assert paths == {step: os.path.join(directory, f"step-{step}") for step in paths}, paths
    with open(os.path.join(directory, "latest")) as f:
        assert f.read().strip() == "step-4"
    for step in (1, 2, 3, 4):
        resumed = scripts.shard(scripts.ours(), scripts.build(seed=5))
        loaded, extra = fsdp_ext.load_checkpoint(directory, resumed, scripts.adamw(resumed),
                                                 step=step)
        assert (loaded, extra) == (step, {"step": step})
        for name, value in scripts.full_params(resumed).items():
            assert torch.equal(value, at_call[step][name]), (step, name)
    _failed_save_in_flight(rank, model, opt, directory)
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()


def _failed_save_in_flight(rank: int, model, opt, directory: str) -> None:
    """An async save whose writes fail on rank 0: the next save raises its error on every rank
    and does not start; `latest` stays on the last good checkpoint; a save after that works."""
    from torch.distributed.checkpoint import FileSystemWriter
    write_data = FileSystemWriter.write_data

    def failing_write_data(self, plan, planner):
        raise OSError("simulated disk failure")
    if rank == 0:  # (called on the writer thread, after save_checkpoint returned)
        FileSystemWriter.write_data = failing_write_data
    try:
        failed = fsdp_ext.save_checkpoint(directory, model, opt, step=5, async_save=True)
        with pytest.raises(fsdp_ext.CheckpointError, match="simulated disk failure") as info:
            fsdp_ext.save_checkpoint(directory, model, opt, step=6)
    finally:
        FileSystemWriter.write_data = write_data
    assert "step 6 was not saved" in " ".join(getattr(info.value, "__notes__", [])), info.value
    assert failed.path is None
    for step in (5, 6):
        assert not os.path.exists(os.path.join(directory, f"step-{step}")), step
    with open(os.path.join(directory, "latest")) as f:
        assert f.read().strip() == "step-4"
    assert fsdp_ext.save_checkpoint(directory, model, opt, step=6).endswith("step-6")


def test_async_saves_back_to_back(tmp_path):
    run_distributed(back_to_back_worker, 2, str(tmp_path))
