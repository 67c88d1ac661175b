"""The checkpoint resharding matrix, the crash-during-save test and the load errors, one launch per
world size (see test_checkpoint.py).

Every run trains the same GPT on the same global batch (12 sequences, split over the ranks), so a
run resumed at any world size must continue with the losses of the uninterrupted world-4 run, up to
float rounding (gradients are summed in another order at another world size).
"""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fsdp_ext
from fsdp_ext.state import checkpoint_files
from examples.models import GPT, Block, GPTConfig

from .dist import global_mean, local_slice
from .parity import Case, make_batch
from .state_dict import check_safetensors

GLOBAL_BATCH = 12  # divisible by 4, 3, 2 and 1
TOTAL_STEPS = 6
SAVE_AFTER = 3     # the world-4 run saves after this many steps; world 2 after 5


def build(n_layer: int = 2, d_model: int = 24, world_size: int = 1):
    torch.manual_seed(1234)
    model = GPT(GPTConfig(vocab_size=67, block_size=16, n_layer=n_layer, n_head=2, d_model=d_model))
    for module in model.modules():
        if isinstance(module, Block):
            fsdp_ext.fully_shard(module)
    fsdp_ext.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    return model, opt


def train(model, opt, steps: range, rank: int, world_size: int) -> list[float]:
    losses = []
    for step in steps:
        idx, targets = make_batch("gpt", step, GLOBAL_BATCH)
        loss = model(local_slice(idx, rank, world_size), local_slice(targets, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss).item())
    return losses


def assert_losses(got: list[float], expected: list[float], what: str) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{what}: {got} vs uninterrupted {expected}: {m}")


def _make_fail(target, name: str, call_first: bool):
    """Replace `target.name` by a version that raises (after doing its work if `call_first`)."""
    original = getattr(target, name)

    def failing(*args, **kwargs):
        if call_first:
            result = original(*args, **kwargs)
            if hasattr(result, "wait"):
                result.wait()  # the bytes are on disk: the save fails midway, not before it starts
        raise OSError("simulated crash while saving")
    setattr(target, name, failing)
    return original


def _latest(directory: str) -> str:
    with open(os.path.join(directory, "latest")) as f:
        return f.read().strip()


def check_crash_during_save(model, opt, rank: int, directory: str) -> None:
    """A save that fails midway raises on every rank and leaves `latest` on the previous
    checkpoint, with no new step directory. Two places: rank 1's DCP writer raises after writing
    its file; rank 0 fails while publishing, after writing the manifest and before the renames."""
    for target, name, failing_rank, call_first in (
            (dcp.FileSystemWriter, "write_data", 1, True),
            (checkpoint_files, "_fsync_dir", 0, False)):
        original = _make_fail(target, name, call_first) if rank == failing_rank else None
        try:
            fsdp_ext.save_checkpoint(directory, model, opt, step=SAVE_AFTER + 1)
            raise AssertionError(f"save did not fail with a failing {name}")
        except fsdp_ext.CheckpointError as exc:
            assert "simulated crash" in str(exc), exc
        except OSError as exc:
            assert "simulated crash" in str(exc), exc
        finally:
            if original is not None:
                setattr(target, name, original)
        assert _latest(directory) == f"step-{SAVE_AFTER}", name
        assert not os.path.exists(os.path.join(directory, f"step-{SAVE_AFTER + 1}")), name
        if rank == 0:  # rank 0 removes the partial save (a real crash would leave it: harmless)
            assert not os.path.exists(os.path.join(directory, f".tmp-step-{SAVE_AFTER + 1}"))
    dist.barrier()


def world4_worker(rank: int, world_size: int, directory: str) -> None:
    """The uninterrupted run; saves after SAVE_AFTER steps and checks failed saves."""
    model, opt = build()
    losses = train(model, opt, range(SAVE_AFTER), rank, world_size)
    path = fsdp_ext.save_checkpoint(os.path.join(directory, "a"), model, opt, step=SAVE_AFTER,
                                    extra={"losses": torch.tensor(losses), "note": "world 4"})
    assert path.endswith(f"step-{SAVE_AFTER}")
    check_crash_during_save(model, opt, rank, os.path.join(directory, "a"))
    losses += train(model, opt, range(SAVE_AFTER, TOTAL_STEPS), rank, world_size)
    if rank == 0:
        torch.save(losses, os.path.join(directory, "uninterrupted.pt"))
    dist.barrier()


def resume_worker(rank: int, world_size: int, directory: str) -> None:
    """Resume at world 2 or 3 from the world-4 checkpoint (world 2 also saves for world 1)."""
    expected = torch.load(os.path.join(directory, "uninterrupted.pt"))
    model, opt = build()
    step, extra = fsdp_ext.load_checkpoint(os.path.join(directory, "a"), model, opt)
    assert step == SAVE_AFTER and extra["note"] == "world 4", (step, extra)
    assert_losses(extra["losses"].tolist(), expected[:SAVE_AFTER], "extra")
    assert opt.param_groups[0]["lr"] == 1e-2
    if world_size == 2:
        losses = train(model, opt, range(SAVE_AFTER, 5), rank, world_size)
        fsdp_ext.save_checkpoint(os.path.join(directory, "b"), model, opt, step=5)
        losses += train(model, opt, range(5, TOTAL_STEPS), rank, world_size)
        check_load_errors(rank, directory)
        check_safetensors(Case("gpt", "fully_shard", "FULL_SHARD"), rank, world_size, directory)
    else:
        losses = train(model, opt, range(SAVE_AFTER, TOTAL_STEPS), rank, world_size)
    assert_losses(losses, expected[SAVE_AFTER:], f"resumed at world {world_size}")
    dist.barrier()


def world1_worker(rank: int, world_size: int, directory: str) -> None:
    expected = torch.load(os.path.join(directory, "uninterrupted.pt"))
    model, opt = build()
    step, _ = fsdp_ext.load_checkpoint(os.path.join(directory, "b"), model, opt)
    assert step == 5
    assert_losses(train(model, opt, range(5, TOTAL_STEPS), rank, world_size), expected[5:],
                  "saved at world 2, resumed at world 1")


# ---- errors -----------------------------------------------------------------------------------------
def _expect(fn, exc_type, *needles: str) -> None:
    try:
        fn()
    except exc_type as exc:
        for needle in needles:
            assert needle in str(exc), f"'{needle}' not in: {exc}"
        return
    raise AssertionError(f"no {exc_type.__name__} mentioning {needles}")


def _damaged_copy(rank: int, directory: str, name: str, damage) -> str:
    """A copy of checkpoint a/step-3 with `damage(path)` applied by rank 0 to one file."""
    target = os.path.join(directory, f"damaged-{name}")
    if rank == 0:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(os.path.join(directory, "a"), target)
        step = os.path.join(target, f"step-{SAVE_AFTER}")
        files = sorted(f for f in os.listdir(step) if f.endswith(".distcp"))
        damage(os.path.join(step, files[-1] if name != "metadata" else ".metadata"))
    dist.barrier()
    return target


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def _flip_bytes(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def check_load_errors(rank: int, directory: str) -> None:
    """Each error is raised on every rank (none waits forever) and names what is wrong."""
    model, opt = build()
    _expect(lambda: fsdp_ext.load_checkpoint(os.path.join(directory, "nowhere"), model, opt),
            FileNotFoundError, "nowhere")
    for kwargs, needle in ((dict(d_model=32), "size mismatch for wte.weight"),
                           (dict(n_layer=3), "missing keys"), (dict(n_layer=1), "unexpected keys")):
        other, other_opt = build(**kwargs)
        _expect(lambda: fsdp_ext.load_checkpoint(os.path.join(directory, "a"), other, other_opt),
                fsdp_ext.CheckpointError, needle)
    for name, damage, needle in (("truncated", _truncate, "truncated"),
                                 ("flipped", _flip_bytes, "corrupt"),
                                 ("metadata", _flip_bytes, ".metadata")):
        path = _damaged_copy(rank, directory, name, damage)
        _expect(lambda: fsdp_ext.load_checkpoint(path, model, opt), fsdp_ext.CheckpointError,
                needle, os.path.join(path, f"step-{SAVE_AFTER}"))
