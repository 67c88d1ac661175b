"""The launch commands printed in docs/integrations.md run as printed: each ```bash block that
calls torchrun, through bash, from the top of the checkout (its first line activates the venv that
`make build` made; with no such venv there is nothing to run as printed, and the test skips)."""
from __future__ import annotations

import os
import subprocess

import pytest

from .proc_launch import environment_without_launcher
from .test_docs import ROOT, fenced_blocks, read

ACTIVATE = os.path.join(ROOT, ".venv", "bin", "activate")
BLOCKS = [(start, code) for lang, start, code in fenced_blocks(read("docs/integrations.md"))
          if lang == "bash" and "torchrun" in code]
# What each printed launch shows when it trained, and how many times: titan_flow.py prints the
# mean loss on rank 0, hf_trainer.py each of the 2 ranks its own micro-batch losses.
EXPECTED = {"titan_flow.py": ("step 5: loss", 1), "hf_trainer.py": ("micro-batch losses", 2)}


def test_the_page_prints_launch_commands():
    assert len(BLOCKS) == 2
    for _, code in BLOCKS:
        assert code.startswith("source .venv/bin/activate"), code


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(ACTIVATE), reason="no .venv made by `make build` here")
@pytest.mark.parametrize("start,code", BLOCKS, ids=[f"line{start}" for start, _ in BLOCKS])
def test_printed_commands_run(start, code):
    env = environment_without_launcher("VIRTUAL_ENV")
    proc = subprocess.run(["bash", "-e", "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"docs/integrations.md line {start}:\n{output[-6000:]}"
    launches = code.count("torchrun ")
    (example,) = {name for name in EXPECTED if name in code}
    line, per_launch = EXPECTED[example]
    assert output.count(line) == launches * per_launch, output[-4000:]
