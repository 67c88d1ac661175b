"""Run by tests/runtime/test_no_process_group.py under `torchrun --nproc-per-node 2` (or plain `python`),
with no init_process_group() call: what each API does about the process group, as JSON lines.

    --api fsdp_ext   FSDP1 with no group (its error, beside torch's), then fully_shard (which must
                     initialise the group as torch's does), 3 training steps, then an optimizer
                     built before fully_shard, stepped
    --api torch      torch's fully_shard on the same model and data, 3 training steps
    --api plain      (no launcher) fsdp_ext's single-process mode, and torch's error
"""
import argparse
import json
import os
import warnings

import torch
import torch.distributed as dist

from examples.models import GPT, GPTConfig

CFG = GPTConfig(n_layer=2, d_model=32, n_head=4, block_size=16, vocab_size=64)


def report(**fields) -> None:
    """One JSON file per rank in $NO_GROUP_OUT (ranks' stdout lines interleave)."""
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(os.environ["NO_GROUP_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(fields, f)


def error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # the message is what is compared
        return f"{type(e).__name__}: {e}"
    return "no error"


def train(shard) -> tuple[list[float], list[str]]:
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        shard(block)
    shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(3):
        x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size + 1), generator=data)
        loss = model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    kinds = sorted({f"{type(p).__name__}{getattr(p, 'placements', '')}"
                    for p in model.parameters()})
    return losses, kinds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=["fsdp_ext", "torch", "plain"], required=True)
    api = parser.parse_args().api
    if api == "torch":
        from torch.distributed.fsdp import fully_shard
        losses, kinds = train(fully_shard)
        report(api=api, rank=dist.get_rank(), backend=dist.get_backend_config(), losses=losses,
               kinds=kinds)
    elif api == "fsdp_ext":
        import fsdp_ext
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        torch_fsdp1 = error_of(lambda: TorchFSDP(GPT(CFG), device_id=torch.device("cpu")))
        ours_fsdp1 = error_of(lambda: fsdp_ext.FullyShardedDataParallel(GPT(CFG)))
        initialised_before = dist.is_initialized()
        losses, kinds = train(fsdp_ext.fully_shard)
        model = GPT(CFG)
        early = torch.optim.AdamW(model.parameters())
        fsdp_ext.fully_shard(model)
        model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
        early_step = error_of(early.step)
        report(api=api, rank=dist.get_rank(), backend=dist.get_backend_config(), losses=losses,
               kinds=kinds, torch_fsdp1=torch_fsdp1, ours_fsdp1=ours_fsdp1,
               initialised_before=initialised_before, early_step=early_step)
    else:
        import fsdp_ext
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        torch_error = error_of(lambda: torch_fully_shard(GPT(CFG)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses, kinds = train(fsdp_ext.fully_shard)
        model = GPT(CFG)
        fsdp_ext.fully_shard(model)
        report(api=api, initialised=dist.is_initialized(), torch_error=torch_error,
               losses=losses, kinds=kinds, warnings=[str(w.message) for w in caught],
               describe=fsdp_ext.describe(model, file=None).splitlines()[:2])
    if dist.is_initialized():
        dist.barrier()
    fsdp_ext_exit = __import__("fsdp_ext").exit_without_finalization
    fsdp_ext_exit(0)


if __name__ == "__main__":
    main()
