"""fsdp_ext's Lightning strategy (fsdp_ext.integrations.lightning.FSDPExtStrategy) on
examples/lightning_fit.py against Lightning's own strategies on the same LightningModule, at
world 2 on CPU/gloo: the same step losses as FSDPStrategy (torch's FSDP1) with the same wrap
policy (given as a set of classes, torch's ModuleWrapPolicy or transformer_auto_wrap_policy),
gradient accumulation and clipping; a policy with per-module arguments refused; bf16-mixed, and
the model built on the meta device, as ModelParallelStrategy with torch's fully_shard; resuming
from a sharded (DCP folder) and a full (one file) checkpoint of its own, and from
ModelParallelStrategy's, continues with the uninterrupted run's losses."""
from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy, transformer_auto_wrap_policy

pytest.importorskip("lightning")

from examples.lightning_fit import fit  # noqa: E402  (examples/)
from examples.models import Block  # noqa: E402

import fsdp_ext  # noqa: E402
import lightning as L  # noqa: E402
from fsdp_ext.integrations.lightning import FSDPExtStrategy  # noqa: E402

from ..helpers.dist import run_distributed  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)


def worker(rank: int, world: int, directory: str) -> None:
    # What torchrun sets; Lightning then joins the launch instead of starting processes.
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", RANK=str(rank), WORLD_SIZE=str(world))
    reference, _ = fit("fsdp", 2, world)
    ours, trainer = fit("fsdp_ext", 2, world)
    assert len(ours) == 12 and len(set(ours)) > 1, ours  # 2 epochs of 6 steps
    assert isinstance(trainer.model, fsdp_ext.FSDPModule)
    assert isinstance(trainer.lightning_module.model.blocks[0], fsdp_ext.FSDPModule)
    torch.testing.assert_close(ours, reference, **TOL)
    by_name = L.Trainer(strategy="fsdp_ext", accelerator="cpu", devices=world, logger=False)
    assert isinstance(by_name.strategy, FSDPExtStrategy)
    # torch's policy objects and callables pick the same units
    for policy in (ModuleWrapPolicy({Block}),
                   functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})):
        again, trainer = fit("fsdp_ext", 1, world, policy=policy)
        assert isinstance(trainer.lightning_module.model.blocks[1], fsdp_ext.FSDPModule)
        torch.testing.assert_close(again, reference[:6], **TOL)
    per_module = CustomPolicy(lambda m: {"reshard_after_forward": False}
                              if isinstance(m, Block) else False)
    refused = r"Block its own arguments \['reshard_after_forward'\]"
    with pytest.raises(NotImplementedError, match=refused):
        fit("fsdp_ext", 1, world, policy=per_module)

    bf16_ref, _ = fit("model_parallel", 1, world, precision="bf16-mixed")
    bf16_ours, _ = fit("fsdp_ext", 1, world, precision="bf16-mixed")
    torch.testing.assert_close(bf16_ours, bf16_ref, **TOL)

    # built on the meta device: sharded, then each rank's rows materialised and initialised
    meta_ref, _ = fit("model_parallel", 1, world, on_meta=True)
    meta_ours, trainer = fit("fsdp_ext", 1, world, on_meta=True)
    assert meta_ours[0] != ours[0]  # reset_parameters' initialisation, not GPT's own
    torch.testing.assert_close(meta_ours, meta_ref, **TOL)

    for source, form in (("fsdp_ext", "sharded"), ("fsdp_ext", "full"),
                         ("model_parallel", "sharded")):
        path = os.path.join(directory, f"{source}-{form}.ckpt")
        first, _ = fit(source, 1, world, save_to=path, checkpoint=form)
        resumed, _ = fit("fsdp_ext", 2, world, ckpt_path=path, checkpoint=form)
        torch.testing.assert_close(first + resumed, reference, **TOL,
                                   msg=lambda m: f"resumed from {source}'s {form} checkpoint: {m}")
    dist.barrier()


def test_lightning_strategy_matches_lightnings_fsdp(tmp_path):
    run_distributed(worker, 2, str(tmp_path), timeout_s=300)
