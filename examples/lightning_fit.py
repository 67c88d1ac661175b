"""A LightningModule fitted with fsdp_ext's Lightning strategy, or with Lightning's own strategies.

The module builds the small GPT of examples/models.py in `configure_model` and trains it with
AdamW, gradient clipping (configure_gradient_clipping) and gradient accumulation; `--strategy`
picks who shards it:
  fsdp_ext        fsdp_ext.integrations.lightning.FSDPExtStrategy(auto_wrap_policy={Block})
  fsdp            Lightning's FSDPStrategy (torch's FSDP1) with the same policy
  model_parallel  Lightning's ModelParallelStrategy, configure_model calling torch's fully_shard
Checkpoints are Lightning's (`trainer.save_checkpoint`, `fit(ckpt_path=...)`).

    torchrun --nproc-per-node 2 examples/lightning_fit.py --strategy fsdp_ext --epochs 2
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: for examples.*
from fsdp_ext.integrations.lightning import FSDPExtStrategy
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from examples.models import GPT, Block, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab_size=67, block_size=8, n_layer=2, n_head=2, d_model=24)


class GPTModule(L.LightningModule):
    def __init__(self, shard_in_configure_model: bool = False, on_meta: bool = False):
        super().__init__()
        self.shard_in_configure_model = shard_in_configure_model
        self.on_meta = on_meta
        self.model = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        torch.manual_seed(0)
        if self.on_meta:  # built without storage: the strategy materialises each rank's shards
            with torch.device("meta"):
                self.model = GPT(CFG)
        else:
            self.model = GPT(CFG)
        if self.shard_in_configure_model:  # ModelParallelStrategy's way: the module shards itself
            from torch.distributed.fsdp import fully_shard
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_index):
        (idx,) = batch
        loss = self.model(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        """Clip at norm 1.0: torch's clip_grad_norm_ over the DTensor gradients; torch's FSDP1
        (whose Lightning precision plugin does not clip) with its own method."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(self.trainer.model, FullyShardedDataParallel):
            self.trainer.model.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy, let run on CPU processes: Lightning refuses its exact class without
    a GPU, and torch's FSDP1 (which itself runs on gloo) needs device_id=cpu to be said."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                        mixed_precision=self.mixed_precision_config,
                                        sharding_strategy=self.sharding_strategy,
                                        device_id=torch.device("cpu"), **self.kwargs)


def strategy(name: str, checkpoint: str = "sharded", policy=None):
    """`policy`: fsdp_ext's auto_wrap_policy (default: the set {Block})."""
    if name == "fsdp_ext":
        return FSDPExtStrategy(auto_wrap_policy={Block} if policy is None else policy,
                               save_distributed_checkpoint=checkpoint == "sharded")
    if name == "fsdp":
        return CPUFSDPStrategy(auto_wrap_policy={Block}, state_dict_type=(
            "sharded" if checkpoint == "sharded" else "full"), process_group_backend="gloo")
    return ModelParallelStrategy(data_parallel_size=torch.distributed.get_world_size()
                                 if torch.distributed.is_initialized() else "auto",
                                 tensor_parallel_size=1,
                                 save_distributed_checkpoint=checkpoint == "sharded")


def data(n: int = 24) -> DataLoader:
    ids = torch.randint(0, CFG.vocab_size, (n, CFG.block_size + 1),
                        generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(ids), batch_size=2, shuffle=False)


def fit(name: str, epochs: int, devices: int, ckpt_path: str | None = None,
        save_to: str | None = None, checkpoint: str = "sharded",
        precision: str = "32-true", on_meta: bool = False,
        policy=None) -> tuple[list[float], L.Trainer]:
    """Fit `epochs` epochs (from `ckpt_path` if given); save a checkpoint at the end to `save_to`;
    this rank's step losses, and the trainer."""
    module = GPTModule(shard_in_configure_model=name == "model_parallel", on_meta=on_meta)
    trainer = L.Trainer(accelerator="cpu", devices=devices,
                        strategy=strategy(name, checkpoint, policy), max_epochs=epochs,
                        precision=precision, accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data(), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return module.losses, trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", choices=["fsdp_ext", "fsdp", "model_parallel"],
                        default="fsdp_ext")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    cli = parser.parse_args()
    losses, _ = fit(cli.strategy, cli.epochs, cli.devices)
    print(f"{cli.strategy}: step losses {[round(x, 5) for x in losses]}")


if __name__ == "__main__":
    main()
