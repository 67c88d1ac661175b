"""`fsdp_ext.load_pretrained`: a Hugging Face safetensors checkpoint read straight into the shards.

A small Llama (tied and untied embeddings) is saved with `save_pretrained` as a sharded checkpoint
(an index and several files) in bf16; each rank builds the model, shards it (fully_shard, and
FullyShardedDataParallel), loads the checkpoint and must hold exactly the checkpoint's values,
cast to fp32, for every parameter; each rank's reads are recorded and must cover only its rows.
A GPT built on the meta device, sharded, `to_empty`'d and loaded trains like the unwrapped model
loaded by `load_state_dict`. Shape mismatches, missing and unexpected keys raise before anything is
written. World 2 and 3.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_ext
from fsdp_ext.state import pretrained
from examples.models import GPT, GPTConfig

from ..helpers.dist import run_distributed

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


def _shard(model, api: str):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    if api == "fsdp1":
        return fsdp_ext.FullyShardedDataParallel(
            model, auto_wrap_policy=fsdp_ext.ModuleWrapPolicy({LlamaDecoderLayer}))
    for layer in model.model.layers:
        fsdp_ext.fully_shard(layer)
    return fsdp_ext.fully_shard(model)


class _Recording:
    """Wraps safetensors handles to record which rows of which tensor this rank asked for."""

    def __init__(self, monkeypatch_target):
        self.rows: dict[str, int] = {}
        self.wholes: list[str] = []
        original_rows, original_whole = pretrained._Files.rows, pretrained._Files.whole
        recording = self

        def rows(files, name, start, end):
            recording.rows[name] = recording.rows.get(name, 0) + (end - start)
            return original_rows(files, name, start, end)

        def whole(files, name):
            recording.wholes.append(name)
            return original_whole(files, name)
        monkeypatch_target.rows, monkeypatch_target.whole = rows, whole
        self._restore = (original_rows, original_whole)

    def undo(self):
        pretrained._Files.rows, pretrained._Files.whole = self._restore


def check_hf_checkpoint(rank: int, world: int, directory: str, tied: bool, api: str) -> None:
    saved = {}
    for f in os.listdir(directory):
        if f.endswith(".safetensors"):
            saved.update(safetensors_torch.load_file(os.path.join(directory, f)))
    model = _shard(_llama(tied), api)  # random values, replaced by the load
    recording = _Recording(pretrained._Files)
    try:
        result = fsdp_ext.load_pretrained(model, directory)
    finally:
        recording.undo()
    assert result.missing_keys == [] and result.unexpected_keys == []
    full = fsdp_ext.full_state_dict(model)
    for name, value in saved.items():
        torch.testing.assert_close(full[name], value.float(), atol=0, rtol=0,
                                   msg=lambda m: f"{api} tied={tied} {name}: {m}")
    if tied:
        assert "lm_head.weight" not in saved
        torch.testing.assert_close(full["lm_head.weight"], saved["model.embed_tokens.weight"].float())
    # Each rank read about 1/world of the checkpoint: its share of the elements, plus at most two
    # boundary rows per tensor (FSDP1's flat shards cut rows), and no matrix whole.
    def row(name):
        return saved[name][0].numel() if saved[name].dim() else 1
    read = sum(rows * row(name) for name, rows in recording.rows.items())
    total = sum(v.numel() for v in saved.values())
    slack = sum(2 * row(name) for name in recording.rows)
    assert read <= total / world + slack, (read, total, world, slack)
    assert read >= total / world - slack, (read, total, world, slack)
    assert not [n for n in recording.wholes if saved[n].dim() > 1], recording.wholes


def check_meta_init_then_train(rank: int, world: int, path: str) -> None:
    cfg = GPTConfig(vocab_size=61, block_size=8, n_layer=2, n_head=2, d_model=24)
    reference = GPT(cfg)
    reference.load_state_dict(safetensors_torch.load_file(path), strict=False)  # tied head
    with torch.device("meta"):
        model = GPT(cfg)
    for block in model.blocks:
        fsdp_ext.fully_shard(block)
    fsdp_ext.fully_shard(model)
    with pytest.raises(ValueError, match="meta device: call model.to_empty"):
        fsdp_ext.load_pretrained(model, path)
    model.to_empty(device="cpu")
    fsdp_ext.load_pretrained(model, path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        idx = torch.randint(0, cfg.vocab_size, (2 * world, 8),
                            generator=torch.Generator().manual_seed(step))
        mine = idx[rank * 2:(rank + 1) * 2]
        loss = model(mine, mine)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = reference(idx, idx)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, ref_loss.detach(), atol=1e-5, rtol=1e-5)


def check_bad_checkpoints(rank: int, world: int, path: str, directory: str) -> None:
    cfg = GPTConfig(vocab_size=61, block_size=8, n_layer=2, n_head=2, d_model=24)
    model = GPT(cfg)
    for block in model.blocks:
        fsdp_ext.fully_shard(block)
    fsdp_ext.fully_shard(model)
    before = copy.deepcopy(fsdp_ext.full_state_dict(model))
    values = safetensors_torch.load_file(path)
    values["blocks.0.attn.qkv.weight"] = torch.zeros(9, 24)
    del values["ln_f.bias"]
    values["extra.weight"] = torch.zeros(2)
    bad = os.path.join(directory, f"bad-{rank}.safetensors")
    safetensors_torch.save_file(values, bad)
    with pytest.raises(ValueError) as info:
        fsdp_ext.load_pretrained(model, bad)
    message = str(info.value)
    assert ("size mismatch for blocks.0.attn.qkv.weight: the checkpoint has shape [9, 24], the "
            "model has [72, 24]") in message, message
    assert "missing keys (in the model, not in the checkpoint): ['ln_f.bias']" in message, message
    assert "unexpected keys (in the checkpoint, not in the model): ['extra.weight']" in message
    after = fsdp_ext.full_state_dict(model)
    for key, value in before.items():  # nothing was written
        torch.testing.assert_close(after[key], value, atol=0, rtol=0)
    del values["extra.weight"]
    values["blocks.0.attn.qkv.weight"] = before["blocks.0.attn.qkv.weight"]
    lenient = os.path.join(directory, f"lenient-{rank}.safetensors")
    safetensors_torch.save_file(values, lenient)
    result = fsdp_ext.load_pretrained(model, lenient, strict=False)
    assert result.missing_keys == ["ln_f.bias"], result


def worker(rank: int, world: int, directory: str) -> None:
    transformers.logging.set_verbosity_error()
    for tied in (False, True):
        for api in ("fully_shard", "fsdp1"):
            check_hf_checkpoint(rank, world, os.path.join(directory, f"llama-{tied}"), tied, api)
    gpt = os.path.join(directory, "gpt.safetensors")
    check_meta_init_then_train(rank, world, gpt)
    check_bad_checkpoints(rank, world, gpt, directory)
    dist.barrier()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("pretrained"))
    for tied in (False, True):  # bf16 on disk, several files and an index
        _llama(tied).to(torch.bfloat16).save_pretrained(
            os.path.join(directory, f"llama-{tied}"), max_shard_size="20KB")
    torch.manual_seed(1)
    gpt = GPT(GPTConfig(vocab_size=61, block_size=8, n_layer=2, n_head=2, d_model=24))
    state = {k: v for k, v in gpt.state_dict().items() if k != "lm_head.weight"}  # tied
    safetensors_torch.save_file(state, os.path.join(directory, "gpt.safetensors"))
    return directory


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_load_pretrained(world_size, checkpoints):
    assert os.path.exists(os.path.join(checkpoints, "llama-False", "model.safetensors.index.json"))
    run_distributed(worker, world_size, checkpoints, timeout_s=180)
