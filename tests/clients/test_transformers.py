"""Hugging Face `transformers` models, written by nobody here, sharded by fsdp_ext (CPU, gloo, 2 ranks).

Each model is built from a small config with random weights (no download), wrapped in both API styles
(fully_shard on every decoder/encoder layer then the root; FullyShardedDataParallel with a
ModuleWrapPolicy), trained a few AdamW steps, and compared with the unwrapped model trained in one
process on the concatenated batch: the losses and every gathered parameter must match.

Tolerances as in tests/helpers/parity.py: fp32 losses to 1e-6/1e-5, parameters to 1e-5/1e-4 after the steps,
bf16 compute to about 3e-2. AdamW uses eps=1e-6 because GPT-2's and BERT's attention key biases
have gradients that are zero in exact arithmetic (softmax ignores a shift shared by all keys): both
runs see only rounding noise there, and a tiny eps would turn that noise into full, uncorrelated
lr-sized steps. Every position has a label (no -100), so each rank's mean loss has the same
weight and the mean over ranks equals the reference's mean over the whole batch.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fsdp_ext
from fsdp_ext.runtime.core.trace import recording

from ..helpers.dist import global_mean, local_slice, run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 97, 16


def build(name: str):
    """(model, its layer class): 2 layers, width 32, no dropout, token ids inside the vocabulary."""
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel,
                              LlamaConfig, LlamaForCausalLM)
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    torch.manual_seed(0)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if name.startswith("gpt2"):
        cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)
        return GPT2LMHeadModel(cfg), GPT2Block
    if name.startswith("llama"):
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=SEQ, **ids)
        return LlamaForCausalLM(cfg), LlamaDecoderLayer
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertForMaskedLM(cfg), BertLayer


def wrap(model, layer_cls, api: str, bf16: bool):
    if api == "fsdp1":
        mp = fsdp_ext.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
        return fsdp_ext.FullyShardedDataParallel(
            model, auto_wrap_policy=fsdp_ext.ModuleWrapPolicy({layer_cls}), mixed_precision=mp)
    kwargs = {"mp_policy": fsdp_ext.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                         reduce_dtype=torch.float32)} if bf16 else {}
    for module in model.modules():
        if isinstance(module, layer_cls):
            fsdp_ext.fully_shard(module, **kwargs)
    return fsdp_ext.fully_shard(model, **kwargs)


def batch(step: int, n: int):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(3, VOCAB, (n, SEQ), generator=g),
            torch.randint(3, VOCAB, (n, SEQ), generator=g))


def check_training(rank: int, world: int, name: str, api: str, bf16: bool = False) -> None:
    reference, layer_cls = build(name)
    if "+ckpt" in name:  # the library's own activation checkpointing of each layer
        # (renamed from gradient_checkpointing_enable in transformers 5; either takes the kwargs)
        enable = getattr(reference, "activation_checkpointing_enable", None) or \
            reference.gradient_checkpointing_enable
        enable({"use_reentrant": name.endswith("reentrant")})
    model = wrap(copy.deepcopy(reference), layer_cls, api, bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6)
    tol = dict(atol=3e-2, rtol=3e-2) if bf16 else dict(atol=1e-6, rtol=1e-5)
    param_tol = dict(atol=3e-2, rtol=3e-2) if bf16 else dict(atol=1e-5, rtol=1e-4)
    layers = [f"{n}" for n, m in reference.named_modules() if isinstance(m, layer_cls)]
    for step in range(3):
        ids, labels = batch(step, 2 * world)
        with recording() as events:
            out = model(input_ids=local_slice(ids, rank, world),
                        labels=local_slice(labels, rank, world))
            out.loss.backward()
        opt.step()
        opt.zero_grad()
        ref = reference(input_ids=ids, labels=labels)
        ref.loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(global_mean(out.loss.float()), ref.loss.detach(), **tol,
                                   msg=lambda m: f"{name}/{api} step {step} loss: {m}")
        # The runtime really ran: every layer gathered in forward, freed, regathered in backward
        # (its pre-backward hook found the tensors inside the model's outputs) and reduced.
        kinds = {(e.kind, e.unit) for e in events}
        for layer in layers[:-1]:  # the last layer to run forward stays gathered for backward
            n = sum(1 for e in events if e.kind == "all_gather.issue" and e.unit == layer)
            assert n == 2, f"{name}/{api}: {layer} all-gathered {n} times in a step, expected 2"
        for layer in layers:
            assert ("reduce_scatter.issue", layer) in kinds, f"{name}/{api}: {layer} not reduced"
    full = fsdp_ext.full_state_dict(model)
    expected = reference.state_dict()
    assert list(full) == list(expected), f"{name}/{api}: state-dict keys differ"
    for key, value in expected.items():
        torch.testing.assert_close(full[key], value, **param_tol,
                                   msg=lambda m: f"{name}/{api} {key}: {m}")


def check_generate(rank: int, world: int) -> None:
    """`generate()` (many no-grad forwards with a KV cache) gives the unwrapped model's tokens."""
    reference, layer_cls = build("gpt2")
    model = wrap(copy.deepcopy(reference), layer_cls, "fsdp1", bf16=False)
    prompt = batch(7, 2)[0][:, :4]
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = model.generate(prompt, **kwargs)  # the wrapper forwards attribute lookups
    torch.testing.assert_close(got, reference.generate(prompt, **kwargs), atol=0, rtol=0)


def hf_worker(rank: int, world: int) -> None:
    transformers.logging.set_verbosity_error()
    failures = []
    cases = [(m, api, False) for m in ("gpt2", "llama", "bert") for api in ("fully_shard", "fsdp1")]
    cases += [("gpt2+ckpt", "fully_shard", False), ("llama+ckpt-reentrant", "fsdp1", False),
              ("llama", "fully_shard", True)]
    for name, api, bf16 in cases:
        try:
            check_training(rank, world, name, api, bf16)
        except AssertionError as exc:  # one run reports every failing model
            failures.append(str(exc))
    check_generate(rank, world)
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)
    dist.barrier()


def test_transformers_models_match_unwrapped():
    run_distributed(hf_worker, 2, timeout_s=240.0)
