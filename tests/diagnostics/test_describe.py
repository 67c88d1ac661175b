"""`fsdp_ext.describe`: the printed plan agrees with the unwrapped model (single process, no dist)."""
from __future__ import annotations

import copy
import io
import re

import torch
from torch import nn

import fsdp_ext
from examples.models import GPT, MLP, Block, GPTConfig


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=2, d_model=16))


def _param_rows(text: str) -> dict[str, tuple[list[int], str, bool, int, int]]:
    """name -> (shape, dtype, requires_grad, offset, elements on this rank), per unit block."""
    rows = {}
    unit = None
    for line in text.splitlines():
        if m := re.match(r"unit '([^']*)'", line):
            unit = m.group(1)
        m = re.match(r"\s{4}(\S+)\s+\[([\d, ]*)\]\s+(\w+)\s+requires_grad=(True|False)\s+shard offset\s+"
                     r"([\d,]+)\s+this rank\s+([\d,]+)", line)
        if m:
            shape = [int(x) for x in m.group(2).split(",") if x.strip()]
            name = m.group(1) if unit == "root" else f"{unit}.{m.group(1)}"
            rows[name] = (shape, m.group(3), m.group(4) == "True",
                          int(m.group(5).replace(",", "")), int(m.group(6).replace(",", "")))
    return rows


def test_describe_lists_every_parameter_and_the_order():
    reference = _gpt()
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fsdp_ext.fully_shard(block)
    fsdp_ext.fully_shard(model)
    out = io.StringIO()
    before = fsdp_ext.describe(model, file=out)
    assert out.getvalue().strip() == before.strip()  # printed and returned alike
    assert "not recorded yet" in before
    rows = _param_rows(before)
    # Every distinct parameter once (the tied lm_head weight is listed as a second name).
    expected = dict(reference.named_parameters())
    assert set(rows) == set(expected), set(rows) ^ set(expected)
    for name, p in expected.items():
        shape, dtype, requires_grad, _, local = rows[name]
        assert shape == list(p.shape) and dtype == "float32" and requires_grad
        assert local == p.numel()  # one rank holds everything
    assert "tied: lm_head.weight" in before

    idx = torch.randint(0, 50, (2, 8))
    model(idx, idx).backward()
    after = fsdp_ext.describe(model, file=None)
    assert "forward order (recorded): root -> blocks.0 -> blocks.1" in after
    assert re.search(r"root\s+prefetches blocks\.0", after)
    assert "regathered: blocks.0" in after  # blocks.1 ran last in forward: kept for backward
    assert "after forward: kept (root)" in after


def test_describe_buckets_padding_and_bytes():
    """Sizes recomputed here from the unwrapped module: 8-element alignment, fp32 and bf16. One
    rank holds every parameter whole; these small ones are gathered together (one copied group)."""
    torch.manual_seed(0)
    reference = MLP()  # prime widths: every parameter needs alignment padding
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fsdp_ext.fully_shard(block, mp_policy=fsdp_ext.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fsdp_ext.fully_shard(model)
    text = fsdp_ext.describe(model, file=None)
    rows = _param_rows(text)
    for i, block in enumerate(reference.blocks):
        offset = 0
        for name, p in block.named_parameters():
            offset = (offset + 7) // 8 * 8
            assert rows[f"blocks.{i}.{name}"][3] == offset, (name, rows[f"blocks.{i}.{name}"])
            offset += p.numel()
        used = sum(p.numel() for p in block.parameters())
        padded = (offset + 7) // 8 * 8
        m = re.search(rf"unit 'blocks\.{i}'.*?\n  bucket 0: float32, requires_grad=True, 4 param\(s\) "
                      rf"\(DTensor Shard\(0\) rows\), ([\d,]+) elements; ([\d,]+) per rank, padding "
                      rf"included; 1 all-gather\(s\), 4 param\(s\) copied out.*?\n.*?sharded "
                      rf"([\d.]+) KiB, unsharded ([\d.]+) KiB as bfloat16", text, re.S)
        assert m, text
        assert int(m.group(1).replace(",", "")) == used
        assert int(m.group(2).replace(",", "")) == padded
        assert float(m.group(3)) == round(padded * 4 / 1024, 1)   # fp32 shard
        assert float(m.group(4)) == round(padded * 2 / 1024, 1)   # bf16 while gathered


def test_describe_fsdp1_names_and_unsharded_model():
    assert "no fsdp_ext units" in fsdp_ext.describe(nn.Linear(2, 2), file=None)
    model = fsdp_ext.FullyShardedDataParallel(_gpt(), auto_wrap_policy=fsdp_ext.ModuleWrapPolicy({Block}))
    text = fsdp_ext.describe(model, file=None)
    assert "_fsdp_wrapped_module" not in text
    assert [m.group(1) for m in re.finditer(r"unit '([^']*)'", text)] == ["root", "blocks.0", "blocks.1"]
