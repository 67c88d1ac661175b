"""Hugging Face `generate()` on encoder-decoder models (T5, BART, Whisper) after sharding.

`generate()` calls the encoder (`get_encoder()`) outside the root's `forward`, then `forward` many
times with a cache: the root unit's parameters (embeddings, encoder stem) must be gathered for the
whole method. Checked for both API styles against the unwrapped model (exact tokens) and against
torch's FSDP2/FSDP1 on the same script:
- `fully_shard`: without registration the call fails naming the module and the fix (torch's fails
  deep in DTensor dispatch); after `register_fsdp_forward_method(model, "generate")` the tokens are
  the unwrapped model's, as torch's are.
- `FullyShardedDataParallel`: inside `summon_full_params(model, recurse=False)` (the FSDP1 idiom)
  the tokens are the unwrapped model's, as torch's FSDP1 are.
Weights are re-drawn with std 0.5 and no token may repeat, so that the tokens tell models apart.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed import fsdp as torch_fsdp

import fsdp_ext

from ..helpers.dist import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB = 97
GENERATE = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, no_repeat_ngram_size=1)


def build(name: str):
    """(model in eval mode, its layer classes, an input batch of 2)."""
    torch.manual_seed(0)
    inputs = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    if name == "t5":
        from transformers import T5Config, T5ForConditionalGeneration
        from transformers.models.t5.modeling_t5 import T5Block
        cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                       decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
        model, layers = T5ForConditionalGeneration(cfg), (T5Block,)
    elif name == "bart":
        from transformers import BartConfig, BartForConditionalGeneration
        from transformers.models.bart.modeling_bart import BartDecoderLayer, BartEncoderLayer
        cfg = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                         decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)
        model, layers = BartForConditionalGeneration(cfg), (BartEncoderLayer, BartDecoderLayer)
    else:
        from transformers import WhisperConfig, WhisperForConditionalGeneration
        from transformers.models.whisper.modeling_whisper import (WhisperDecoderLayer,
                                                                  WhisperEncoderLayer)
        cfg = WhisperConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                            encoder_attention_heads=4, decoder_attention_heads=4,
                            encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                            max_source_positions=16, max_target_positions=32, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                            suppress_tokens=[], begin_suppress_tokens=[])
        model = WhisperForConditionalGeneration(cfg)
        layers = (WhisperEncoderLayer, WhisperDecoderLayer)
        inputs = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))  # mel frames
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5)
    return model.eval(), layers, inputs


def shard_fsdp2(fsdp, model, layers):
    for module in model.modules():
        if isinstance(module, layers):
            fsdp.fully_shard(module)
    return fsdp.fully_shard(model)


def wrap_fsdp1(fsdp, model, layers):
    if fsdp is fsdp_ext:
        return fsdp_ext.FullyShardedDataParallel(
            model, auto_wrap_policy=fsdp_ext.ModuleWrapPolicy(set(layers)))
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return torch_fsdp.FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy(set(layers)), device_id=torch.device("cpu"),
        use_orig_params=True)


def check_model(name: str) -> None:
    reference, layers, inputs = build(name)
    expected = reference.generate(inputs, **GENERATE)
    assert expected[0].unique().numel() > 2, f"{name}: degenerate reference tokens {expected[0]}"
    for fsdp in (fsdp_ext, torch_fsdp):
        who = f"{name}/{fsdp.__name__}"
        model = shard_fsdp2(fsdp, copy.deepcopy(reference), layers)
        if fsdp is fsdp_ext:
            with pytest.raises(RuntimeError, match="was called while its parameters are sharded"
                               r"(.|\n)*register_fsdp_forward_method\(model, 'generate'\)"):
                model.generate(inputs, **GENERATE)
        fsdp.register_fsdp_forward_method(model, "generate")
        got = model.generate(inputs, **GENERATE)
        assert torch.equal(got, expected), f"{who} fully_shard: {got.tolist()} != {expected.tolist()}"
        # The same model trains afterwards: nothing stayed gathered or half-registered.
        loss = model(inputs, labels=expected[:, 1:].contiguous()).loss
        loss.backward()

        wrapped = wrap_fsdp1(fsdp, copy.deepcopy(reference), layers)
        with fsdp.FullyShardedDataParallel.summon_full_params(wrapped, recurse=False):
            got = wrapped.generate(inputs, **GENERATE)
        assert torch.equal(got, expected), f"{who} FSDP1: {got.tolist()} != {expected.tolist()}"
        wrapped(inputs, labels=expected[:, 1:].contiguous()).loss.backward()


def worker(rank: int, world: int) -> None:
    transformers.logging.set_verbosity_error()
    for name in ("t5", "bart", "whisper"):
        check_model(name)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_encoder_decoder_generate_matches_unwrapped(world_size):
    run_distributed(worker, world_size, timeout_s=240.0)
