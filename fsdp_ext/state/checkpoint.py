"""Distributed checkpoints: sharded model + optimizer state with torch.distributed.checkpoint (DCP).

save_checkpoint: every rank writes its own shards (DCP dedupes replicas) into `.tmp-step-N`
(with `async_save`, in the background: the state is staged first, the publication waits for
`PendingCheckpoint.result()`); the ranks hash what was written; rank 0 writes the manifest and
publishes the directory with renames (see checkpoint_files). A crash at any point before the last
rename leaves `latest` and the checkpoint it names untouched. One save at a time: a save waits
for the asynchronous one in flight and publishes it first ([Note: one save in flight]).

[Note: one save in flight]
DCP's writer thread issues collectives (the plan, the write results) on the checkpoint's gloo
group. Two writer threads on one group interleave them differently on each rank (a rank whose
disk is slower finishes the first save's writes after the second save planned): the collectives
pair wrongly and every rank hangs. So save_checkpoint first waits for the save in flight, as
`result()` would (torchtitan likewise waits for its previous async save before the next). It
also publishes in call order, so `latest` names the newest checkpoint and a failed save leaves
the one before it in place. Alternatives considered: a group per save (torch's dcp.async_save
works so) lets the writes overlap, but each save would hold its own staged copy of the state,
cost a group creation (a collective) per save, and publish in whichever order the writes end,
so an older step could replace a newer one in `latest`; refusing the second save would turn a
schedule torchtitan users run as is (a save every N steps, with N small) into an error.

load_checkpoint: rank 0 resolves the checkpoint, checks the manifest and reads DCP's metadata, and
broadcasts the outcome, so a missing or damaged checkpoint raises on every rank instead of leaving
the others waiting. Every rank then checks the keys and shapes against the model, builds a state
dict shaped for its own layout (any world size: entries are flattened parameters, resharded by
1-D ranges) and lets DCP read into it; the model's entries are its shard views, so the parameters
are filled in place.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from . import checkpoint_files as files
from .agree import all_ok, on_rank0
from .checkpoint_files import CheckpointError
from .checkpoint_template import check_model, optim_template, param_shapes, saved_entries
from .load_optim_state_dict import load_optim_state_dict
from .optim_state_dict import optim_state_dict
from .state_dict import sharded_state_dict


@contextlib.contextmanager
def quiet_sharded_tensor():
    """DCP touches ShardedTensor attributes, each of which warns that ShardedTensor is deprecated
    in favour of DTensor; DTensor cannot describe FSDP1's flat layout (a rank's part of a parameter
    may cut a row), whose state dicts use it, so silence that one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*",
                                category=FutureWarning)
        yield


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ---- save -------------------------------------------------------------------------------------------
def save_checkpoint(directory, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    step: int, extra=None, async_save: bool = False):
    """Save model and optimizer state as `directory/step-{step}` and point `latest` at it.

    Every rank must call it. `extra` (anything `torch.load(weights_only=True)` can read back:
    tensors, numbers, strings, containers) is stored as is and returned by load_checkpoint.
    Returns the published path; with `async_save` a PendingCheckpoint at once: the state is
    staged (copied) before this returns, the files are written in the background while training
    goes on, and `result()` (every rank) waits for them and publishes. A save started while an
    asynchronous one is in flight first waits for it and publishes it; an error of that save is
    raised here, and this one does not start.
    """
    _finish_the_save_in_flight(step)
    directory = os.fspath(directory)
    on_rank0(lambda: files.prepare_tmp(directory, step))
    tmp = files.tmp_dir(directory, step)
    state = {"model": sharded_state_dict(model)}
    if optimizer is not None:
        state["optim"] = optim_state_dict(model, optimizer, full=False)
    pending = PendingCheckpoint(directory, tmp, step, model, optimizer is not None, extra)
    with pending.failing():
        with quiet_sharded_tensor():
            # DCP gathers every rank's write result, so a failure anywhere raises everywhere.
            if async_save:
                pending.future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(tmp),
                                                process_group=_async_group())
                _IN_FLIGHT.append(pending)
                return pending
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
    return pending.result()


_ASYNC_GROUP: list = []
_IN_FLIGHT: list = []  # the asynchronous save not published yet (at most one)


def _finish_the_save_in_flight(step: int) -> None:
    """Wait for the asynchronous save in flight and publish it ([Note: one save in flight])."""
    while _IN_FLIGHT:
        earlier = _IN_FLIGHT[0]
        try:
            earlier.result()
        except BaseException as exc:
            exc.add_note(f"(raised by save_checkpoint(step={step}), which waits for the "
                         f"asynchronous save of step {earlier.step} first; step {step} was not "
                         "saved)")
            raise


def _async_group():
    """A gloo group of the checkpoint's own (torchtitan's async mode): its collectives run on the
    writer's thread, beside the training's on the default group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if not _ASYNC_GROUP:
        _ASYNC_GROUP.append(dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[0]


class PendingCheckpoint:
    """A checkpoint whose files may still be written; `result()` publishes it (every rank)."""

    def __init__(self, directory: str, tmp: str, step: int, model: nn.Module,
                 has_optimizer: bool, extra):
        self.directory, self.tmp, self.step = directory, tmp, step
        self.model, self.has_optimizer, self.extra = model, has_optimizer, extra
        self.future = None
        self.path: str | None = None

    @contextlib.contextmanager
    def failing(self):
        try:
            yield
        except (Exception, CheckpointException) as exc:
            if _rank_world()[0] == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise CheckpointError(f"saving '{self.tmp}' failed; '{self.directory}' still holds "
                                  f"the previous checkpoint: {exc}") from exc

    def result(self) -> str:
        """Wait for the files, hash them, write the manifest and publish; the published path."""
        if self.path is not None:
            return self.path
        try:
            return self._publish()
        finally:  # published or failed: no longer in flight
            if self in _IN_FLIGHT:
                _IN_FLIGHT.remove(self)

    def _publish(self) -> str:
        if self.future is not None:
            future, self.future = self.future, None
            with self.failing():
                future.result()
        rank, world = _rank_world()
        described, error = {}, None
        try:
            names = sorted(os.listdir(self.tmp))
            described = files.describe_files(self.tmp, names[rank::world])
        except Exception as exc:  # noqa: BLE001 - reported on every rank by all_ok
            error = exc
        all_ok(error)
        every = [described]
        if world > 1:
            every = [None] * world
            dist.all_gather_object(every, described)

        def publish():
            torch.save(self.extra, os.path.join(self.tmp, files.EXTRA))
            listing = {k: v for d in every for k, v in d.items()}
            listing.update(files.describe_files(self.tmp, [files.EXTRA]))
            manifest = {"format": files.FORMAT, "step": self.step, "world_size": world,
                        "has_optimizer": self.has_optimizer,
                        "param_shapes": param_shapes(self.model), "files": listing}
            try:
                return files.publish(self.directory, self.step, manifest)
            except BaseException:
                shutil.rmtree(self.tmp, ignore_errors=True)  # (gone already if renamed)
                raise

        self.path = on_rank0(publish)
        return self.path


# ---- load -------------------------------------------------------------------------------------------
def _inspect(directory: str, step: int | None) -> dict:
    """Rank 0: find the checkpoint, check its files, read DCP's metadata and `extra`."""
    path = files.resolve(directory, step)
    manifest = files.read_manifest(path)
    files.verify_checksums(path, manifest, 0, 1, only=(".metadata", files.EXTRA))  # before unpickling
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"cannot read '{os.path.join(path, '.metadata')}': {exc}") from exc
    try:
        extra = torch.load(os.path.join(path, files.EXTRA), weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read '{os.path.join(path, files.EXTRA)}': {exc}") from exc
    return {"path": path, "manifest": manifest, "metadata": metadata, "extra": extra}


def load_checkpoint(directory, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    step: int | None = None):
    """Load `latest` (or `step`) from `directory` into a model/optimizer sharded over any world
    size. Every rank must call it. Returns (step, extra)."""
    directory = os.fspath(directory)
    rank, world = _rank_world()
    found = on_rank0(lambda: _inspect(directory, step))
    path, manifest, metadata = found["path"], found["manifest"], found["metadata"]
    error = None
    try:
        files.verify_checksums(path, manifest, rank, world)
    except Exception as exc:  # noqa: BLE001 - reported on every rank by all_ok
        error = exc
    all_ok(error)
    model_sd = sharded_state_dict(model)
    check_model(model_sd, saved_entries(metadata, "model"), manifest, model)
    state = {"model": model_sd}
    if optimizer is not None:
        if not manifest["has_optimizer"]:
            raise CheckpointError(f"'{path}' holds no optimizer state")
        state["optim"] = optim_template(model, saved_entries(metadata, "optim"))
    with quiet_sharded_tensor():
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(path))
        except CheckpointException as exc:  # a BaseException: make it an ordinary error
            raise CheckpointError(f"reading '{path}' failed: {exc}") from exc
        model.load_state_dict(state["model"])
        if optimizer is not None:
            load_optim_state_dict(model, optimizer, state["optim"])
    return manifest["step"], found["extra"]
