"""No init_process_group() call: under `torchrun --nproc-per-node 2` fully_shard initialises the
default group from the environment and shards, as torch's does (same losses, DTensor Shard(0)
parameters, same backend), and FullyShardedDataParallel raises torch's FSDP1 error; in a plain
`python` process torch raises and fsdp_ext runs one process, saying so. An optimizer built before
fully_shard raises at its first step (torch's runs on, training nothing)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..helpers.launch import REPO, environment_without_launcher

SCRIPT = os.path.join(REPO, "tests", "helpers", "no_group_job.py")


def run(args: list[str], out) -> list[dict]:
    """Run `python args` without any launcher variable; the ranks' JSON results, by rank."""
    env = environment_without_launcher()
    env.update(OMP_NUM_THREADS="1", NO_GROUP_OUT=str(out),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return [json.loads(path.read_text()) for path in sorted(out.iterdir())]


def torchrun(api: str, out) -> dict[int, dict]:
    out.mkdir()
    results = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   SCRIPT, "--api", api], out)
    return {r["rank"]: r for r in results}


@pytest.fixture(scope="module")
def under_torchrun(tmp_path_factory):
    base = tmp_path_factory.mktemp("no_group")
    return torchrun("fsdp_ext", base / "fsdp_ext"), torchrun("torch", base / "torch")


def test_fully_shard_initialises_the_group_and_shards_as_torch(under_torchrun):
    ours, torchs = under_torchrun
    assert sorted(ours) == sorted(torchs) == [0, 1]
    for rank in (0, 1):
        assert not ours[rank]["initialised_before"]
        assert ours[rank]["backend"] == torchs[rank]["backend"]
        assert ours[rank]["kinds"] == torchs[rank]["kinds"] == ["DTensor(Shard(dim=0),)"]
        assert ours[rank]["losses"] == pytest.approx(torchs[rank]["losses"], rel=1e-5, abs=1e-6)
    # the two ranks saw different data: the losses only agree with torch's if gradients were
    # averaged across ranks, i.e. the run was sharded and reduced
    assert ours[0]["losses"][1:] != ours[1]["losses"][1:]


def test_fsdp1_raises_torchs_error_without_a_group(under_torchrun):
    ours, _ = under_torchrun
    for rank in (0, 1):
        assert ours[rank]["ours_fsdp1"] == ours[rank]["torch_fsdp1"]
        assert ours[rank]["ours_fsdp1"].startswith("ValueError: Default process group has not")


def test_optimizer_built_before_fully_shard_raises_at_its_first_step(under_torchrun):
    ours, _ = under_torchrun
    for rank in (0, 1):
        message = ours[rank]["early_step"]
        assert message.startswith("ValueError: AdamW.step(): param_groups[0]['params'][0] is "
                                  "parameter 'wte.weight' (Embedding.weight)"), message
        assert "Build the optimizer after fully_shard" in message


def test_plain_python_is_an_announced_single_process_run(tmp_path):
    (result,) = run([SCRIPT, "--api", "plain"], tmp_path)
    assert result["torch_error"].startswith("ValueError"), result["torch_error"]
    assert not result["initialised"]
    assert result["kinds"] == ["Parameter"]
    assert sum("nothing is sharded" in w for w in result["warnings"]) == 1
    assert result["describe"][1].startswith("single-process mode: no process group")
