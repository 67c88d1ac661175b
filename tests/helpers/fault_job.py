"""One rank of a small training run that can be told to fail, for the rank-failure tests.

Run as one process per rank (tests/helpers/launch.py sets RANK, WORLD_SIZE, MASTER_ADDR/PORT):

    python tests/helpers/fault_job.py --mode {none,sleep,kill,exit,raise,leave} --fail-step 2 --steps 4

At step `--fail-step`, rank WORLD_SIZE-1 sleeps forever in the forward of blocks.1 (sleep),
SIGKILLs itself there (kill), calls os._exit in that block's backward (exit), or raises there
(raise), or leaves its training loop before that step and ends normally (leave); before that
step's forward it SIGKILLs itself (kill_before_forward) or sleeps forever (sleep_before_forward):
with --fail-step 0, before the first all-gather. The other ranks run the script unchanged.
Mode late_rank0 makes rank 0 instead (the store's host, as when it loads a checkpoint alone)
sleep --late-s seconds before the first forward, then go on; --default-timeout-s stands in for
the 300 s default collective timeout, so that the case runs in seconds.
Mode unpadded_hook gives every rank the same bug instead: the head's weight (in the root unit,
gathered first; 4 rows, uneven over 3 ranks) is a tensor subclass whose fsdp_pre_all_gather
returns the unpadded local rows, so at world 3 the last rank (the padded one) raises at the first
all-gather, naming the parameter. With --ckpt-dir every rank saves a
checkpoint after each step (`step-N`: N steps done), and mode kill_in_save SIGKILLs that rank
inside the save of step-`fail-step`, after its shards are written and before the checkpoint is
published; --resume starts from the directory's latest checkpoint. Each rank prints
"LOSS <step> <local loss>" (means over equal local batches: their average is the global loss) and
"DONE" when it finishes.
The model, batches and optimizer are defined here so that the test can build the unwrapped
reference from the same code.
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import time

import torch
from torch import nn

GLOBAL_BATCH = 12  # divisible by world sizes 1, 2, 3, 4


def build_model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 31), nn.Tanh(), nn.Linear(31, 16)) for _ in range(3)]
    return nn.Sequential(*blocks, nn.Linear(16, 4))  # blocks 0-2, head 3


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def _inject(block: nn.Module, mode: str) -> None:
    """Make `block` fail in the way `mode` says, the next time it runs."""
    def forward_hook(module, args, output):
        if mode == "sleep":
            time.sleep(3600)  # stuck (a deadlock in user code, a hung data loader, ...)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode in ("exit", "raise"):
            output.register_hook(backward_hook)

    def backward_hook(grad):
        if mode == "exit":
            os._exit(7)  # dies mid-backward, without any cleanup
        raise RuntimeError(f"injected failure on rank {os.environ['RANK']} in backward")

    block.register_forward_hook(forward_hook)


def _kill_after_writing_shards() -> None:
    """Die inside the next save_checkpoint, once DCP wrote this rank's files (it then lists them)."""
    from fsdp_ext.state import checkpoint_files

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_files.describe_files = die


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="none",
                        choices=["none", "sleep", "kill", "exit", "raise", "leave",
                                 "kill_in_save", "kill_before_forward", "sleep_before_forward",
                                 "unpadded_hook", "late_rank0"])
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--fail-step", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pg-timeout-s", type=float, default=600.0)
    parser.add_argument("--late-s", type=float, default=0.0)
    parser.add_argument("--default-timeout-s", type=float, default=None)
    args = parser.parse_args()

    import torch.distributed as dist

    import fsdp_ext
    if args.default_timeout_s is not None:
        from fsdp_ext.runtime.comm import collectives as comm
        comm.DEFAULT_TIMEOUT_S = args.default_timeout_s
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A long process-group timeout: whatever ends the survivors sooner is fsdp_ext's doing.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    model = build_model()
    if args.mode == "unpadded_hook":
        from tests.helpers.subclass_recipes import HiLo
        layer = model[3]
        layer.weight = nn.Parameter(HiLo.from_float(layer.weight))
    for block in list(model)[:3]:
        fsdp_ext.fully_shard(block)
    fsdp_ext.fully_shard(model)
    optimizer = make_optimizer(model)
    first = 0
    if args.resume:
        first, _ = fsdp_ext.load_checkpoint(args.ckpt_dir, model, optimizer)
        print(f"RESUMED {first}", flush=True)
    per_rank = GLOBAL_BATCH // world
    failing = rank == world - 1 and args.mode != "none"
    for step in range(first, args.steps):
        if step == args.fail_step and failing and args.mode == "leave":
            print("LEFT", flush=True)  # e.g. its data loader ran out a batch early
            break
        if step == args.fail_step and failing and args.mode == "kill_before_forward":
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.fail_step and failing and args.mode == "sleep_before_forward":
            time.sleep(3600)
        if step == 0 and rank == 0 and args.mode == "late_rank0":
            time.sleep(args.late_s)
        if step == args.fail_step and failing and args.mode in ("sleep", "kill", "exit", "raise"):
            _inject(model[1], args.mode)
        x, y = (t[rank * per_rank:(rank + 1) * per_rank] for t in make_batch(step))
        loss = loss_of(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"LOSS {step} {loss.item()!r}", flush=True)
        if args.ckpt_dir is not None:
            if step + 1 == args.fail_step and failing and args.mode == "kill_in_save":
                _kill_after_writing_shards()
            fsdp_ext.save_checkpoint(args.ckpt_dir, model, optimizer, step=step + 1)
    print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from fsdp_ext import run_then_exit
    run_then_exit(main)
