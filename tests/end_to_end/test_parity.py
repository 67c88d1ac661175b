"""Sharded training matches a single-process model on the concatenated batch (CPU, gloo).

Covers both API styles, every sharding strategy, an MLP with prime widths, a GPT with tied
embeddings, a unit mixing fp32, bf16 and frozen parameters, and bf16 mixed precision; see
tests/helpers/parity.py for the cases and the tolerances.
"""
import pytest

from ..helpers.dist import run_distributed
from ..helpers.parity import parity_worker


@pytest.mark.parametrize("world_size", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_parity(world_size):
    run_distributed(parity_worker, world_size)
