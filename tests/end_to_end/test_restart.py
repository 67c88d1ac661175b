"""Restart with nothing lost, through the real launcher: the main job (examples/train.py) under two
torchrun agents (`--nnodes 2`, one process each, a c10d rendezvous on localhost,
`--max-restarts 1`) with asynchronous checkpoints every 2 steps and `--resume`, as
docs/training.md prints it. A rank is killed
(SIGKILL) mid-run, and in a second case while a checkpoint is being written; the agents restart
the job, it resumes from the last complete checkpoint and finishes with the parameters and the loss
curve of an uninterrupted run, bit for bit (the same data order: each step's batch depends on the
step only)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ..helpers.launch import REPO, environment_without_launcher, free_port

TRAIN = os.path.join(REPO, "examples", "train.py")
ARGS = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--block-size", "32",
        "--batch-size", "2", "--steps", "10", "--save-every", "2", "--log-every", "1",
        "--async-save", "--resume"]
TIMEOUT_S = 180


def _env() -> dict[str, str]:
    env = environment_without_launcher()
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    # A store per rendezvous round: on the agents' shared store, the restarted round's new
    # process groups (same names as the first round's) read the dead round's addresses.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # One thread per rank in both launches (torchrun sets it only for several processes per
    # agent): the same summation order, so the runs can agree bit for bit.
    env["OMP_NUM_THREADS"] = "1"
    return env


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc)."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except FileNotFoundError:
            continue
        for kid in kids:
            out += [kid, *_children(kid)]
    return out


def _worker_of(agent: subprocess.Popen) -> int | None:
    """The pid of the agent's training process (its child running train.py)."""
    for pid in _children(agent.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"train.py" in f.read():
                    return pid
        except FileNotFoundError:
            continue
    return None


def _final_state(directory: str) -> tuple[dict, list]:
    """The latest checkpoint's full model state (DCP -> one file, no process group) and losses."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with open(os.path.join(directory, "latest")) as f:
        path = os.path.join(directory, f.read().strip())
    out = os.path.join(directory, "final.pt")
    dcp_to_torch_save(path, out)
    state = torch.load(out, weights_only=False)
    extra = torch.load(os.path.join(path, "extra.pt"), weights_only=True)
    return state["model"], extra["losses"]


def _uninterrupted(directory: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           TRAIN, *ARGS, "--checkpoint-dir", directory]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _interrupted(directory: str, when: str, log_dir: str) -> list[str]:
    """Two agents; SIGKILL the second one's worker once `when` holds; both must end with 0."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", f"restart-{port}", "--max-restarts", "1", "--monitor-interval", "0.2",
           TRAIN, *ARGS, "--checkpoint-dir", directory]
    logs = [open(os.path.join(log_dir, f"agent{i}.log"), "w+") for i in range(2)]
    agents = [subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
              for log in logs]
    killed = None
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while killed is None and time.monotonic() < deadline:
            if any(a.poll() is not None for a in agents):
                break
            if _ready_to_kill(directory, when):
                killed = _worker_of(agents[1])
                if killed is not None:
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.02)
        codes = [a.wait(timeout=max(1.0, deadline - time.monotonic())) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    assert killed is not None, f"never killed a worker ({when}):\n" + outputs[1][-3000:]
    assert codes == [0, 0], f"agents ended {codes}:\n" + "\n".join(o[-3000:] for o in outputs)
    return outputs


def _ready_to_kill(directory: str, when: str) -> bool:
    names = os.listdir(directory) if os.path.isdir(directory) else []
    if when == "mid-step":  # a checkpoint published, training on
        return "step-4" in names
    return ".tmp-step-6" in names  # mid-save: the save of step 6 is being written


@pytest.mark.slow
@pytest.mark.essential
@pytest.mark.parametrize("when", ["mid-step", "mid-save"])
def test_killed_rank_restarts_and_finishes_as_if_uninterrupted(when, tmp_path):
    reference = str(tmp_path / "uninterrupted")
    _uninterrupted(reference)
    expected, expected_losses = _final_state(reference)
    directory = str(tmp_path / "interrupted")
    outputs = _interrupted(directory, when, str(tmp_path))
    assert any("resumed from" in o and "at step" in o for o in outputs), outputs[0][-3000:]
    state, losses = _final_state(directory)
    assert [s for s, _ in losses] == list(range(1, 11))  # the whole curve, each step once
    assert losses == expected_losses
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
