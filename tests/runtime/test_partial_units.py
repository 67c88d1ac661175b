"""Units that run partly, or one member at a time (tests/helpers/partial_units.py), under torch's
fully_shard and fsdp_ext's on the same script: torchtitan's chunked loss call for call (its list
unit `[norm, lm_head]` half run in the root's forward, `lm_head` per chunk outside it, one backward
per chunk), the same with norm and lm_head as units of their own, and a list unit whose members
run in different forwards. Losses, gradients and trained parameters equal to torch's."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp

import fsdp_ext
from fsdp_ext.runtime.core.trace import recording
from fsdp_ext.runtime.unit.states import StateError

from ..helpers import partial_units as scripts
from ..helpers.dist import run_checks, run_distributed

FP32 = dict(atol=1e-6, rtol=1e-5)


def _same(what, ours, theirs):
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), (what, list(ours), list(theirs))
        for name, value in theirs.items():
            _same(f"{what} '{name}'", ours[name], value)
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), (what, len(ours), len(theirs))
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same(f"{what}[{i}]", a, b)
    else:
        torch.testing.assert_close(ours, theirs, **FP32, msg=lambda m: f"{what}: {m}")


def _against_torch(what, script, rank, world, **kwargs):
    """`script` run with torch's fully_shard and with fsdp_ext's: what it returns must agree."""
    theirs = script(torch_fsdp, rank, world, **kwargs)
    _same(what, script(fsdp_ext, rank, world, **kwargs), theirs)


def check_chunked_loss(rank, world):
    """torchtitan's chunked loss: the default reshard policy and "always"."""
    for policy in ("default", "always"):
        _against_torch(f"chunked loss ({policy})", scripts.train_chunked, rank, world,
                       reshard_policy=policy)


def check_chunked_loss_gathers_once(rank, world):
    """The unit stays gathered across the chunks (the setters' point): one all-gather of
    `[norm, lm_head]` in the root's forward, none in the loop, one in the decoder's backward
    (the loop's reshard() freed it); its gradients reduced once in the loop, once after."""
    model = scripts.shard_like_torchtitan(fsdp_ext, scripts.build())
    model.skip_lm_head = True
    inputs, labels = scripts.batch(0, rank, world)
    with recording() as events:
        hidden = model(inputs)
        loss = scripts.chunked_loss(model.lm_head, fsdp_ext.FSDPModule, hidden, labels, 100)
        loss.backward()
    unit = "[norm, lm_head]"
    kinds = [e.kind for e in events if e.unit == unit and e.kind in (
        "all_gather.issue", "reduce_scatter.issue")]
    assert kinds.count("all_gather.issue") == 2, kinds
    assert kinds.count("reduce_scatter.issue") == 2, kinds


def check_separate_head_units(rank, world):
    """norm and lm_head as units of their own: lm_head a whole unit called per chunk outside the
    root's forward, each chunk's backward ending with its own end-of-backward."""
    _against_torch("separate units", scripts.train_chunked, rank, world, lm_head_unit="separate")


def check_members_in_different_forwards(rank, world):
    """The root's forward runs `norm`, the loss `lm_head`, one backward over both."""
    for policy in ("default", "always"):
        _against_torch(f"members in different forwards ({policy})", scripts.train_head_outside,
                       rank, world, reshard_policy=policy)


def check_illegal_transition_still_raises(rank, world):
    """A partial pass opens no other door: a unit's post-backward outside any backward while it is
    SUMMONED still raises naming the unit."""
    model = scripts.shard_like_torchtitan(fsdp_ext, scripts.build())
    inputs, _ = scripts.batch(0, rank, world)
    model(inputs).sum().backward()
    unit = model.lm_head._unit
    with fsdp_ext.summon_full_params(model):
        with pytest.raises(StateError, match=r"unit '\[norm, lm_head\]'"):
            unit.post_backward([])


CHECKS = [check_chunked_loss, check_chunked_loss_gathers_once, check_separate_head_units,
          check_members_in_different_forwards, check_illegal_transition_still_raises]


def _worker(rank, world):
    run_checks(CHECKS, rank, world)


def test_partial_units_against_torch():
    run_distributed(_worker, 2, timeout_s=240)


@pytest.mark.slow
def test_partial_units_against_torch_world3():
    run_distributed(_worker, 3, timeout_s=300)
