"""What examples/train.py shows a user before training starts: a mistaken flag is reported once,
by rank 0, before any process-group work, and the progress bar draws on a terminal that reports
no width."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios

import pytest

from examples import report, train

from ..helpers.launch import REPO, environment_without_launcher

BAD = [(["--mixed-precision", "fp16"], "argument --mixed-precision: invalid choice: 'fp16'"),
       (["--model", "moe", "--experts", "4", "--ep", "3"],
        "--ep 3 needs a world size it divides (got 2 ranks)"),
       (["--resume"], "--resume needs --checkpoint-dir")]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_mistake_is_printed_by_rank_0_alone(rank, monkeypatch, capsys):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for argv, message in BAD:
        with pytest.raises(SystemExit) as info:
            train.checked_args(argv)
        assert info.value.code == (2 if rank == "0" else 0)  # (see checked_args)
        out, err = capsys.readouterr()
        assert out == "" and (err == "" if rank == "1" else
                              err.count(message) == 1 and err.startswith("usage: ")), err
    assert train.checked_args(["--steps", "3"]).steps == 3


def test_argument_problems_are_named():
    problems = train.argument_problems(train.parse_args(
        ["--log-every", "0", "--d-model", "30", "--n-head", "4", "--comm-policy", "int4",
         "--data", "/no/such/file", "--sharding-strategy", "HYBRID_SHARD"]), 3, 2)
    text = "; ".join(problems)
    for expected in ("--log-every must be at least 1 (got 0)",
                     "--d-model 30 must be a multiple of --n-head 4", "--comm-policy int4: ",
                     "--data /no/such/file: no such file",
                     "HYBRID_SHARD needs the same ranks on every node (got 3 ranks, 2 on this one)"):
        assert expected in text, text
    assert train.argument_problems(train.parse_args([]), 2, 2) == []


@pytest.mark.slow
@pytest.mark.parametrize("argv,message", BAD[:2], ids=["argparse", "ep"])
def test_a_mistaken_flag_under_torchrun_is_printed_once(argv, message):
    """2 ranks under torchrun: the message and the usage once, from rank 0, no traceback of the
    script (torchrun's own report of the failed workers follows, as for any failed worker)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "examples/train.py", *argv], cwd=REPO, env=environment_without_launcher(),
        capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert output.count(message) == 1 and output.count("usage: train.py") == 1, output
    assert 'examples/train.py", line' not in output, output


def test_the_progress_bar_draws_on_a_terminal_of_size_0(monkeypatch):
    """A terminal that reports a size of 0 (some containers' consoles): tqdm would draw nothing;
    the bar falls back to 80 columns."""
    pytest.importorskip("tqdm")
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    with os.fdopen(side, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        bar = report.progress_bar(10, 0, enabled=True)
        bar.update(3)
        bar.refresh()  # (an update within the bar's mininterval draws nothing by itself)
        bar.close()
    drawn = b""
    while select.select([main], [], [], 1.0)[0]:  # (a pty hands its bytes over in pieces)
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the other side is closed and drained
            break
        if not chunk:
            break
        drawn += chunk
    drawn = drawn.decode()
    os.close(main)
    assert "3/10" in drawn, repr(drawn)
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", drawn)  # (cursor moves: another bar was open)
    assert max(len(line) for line in text.replace("\r", "\n").split("\n")) <= 80, repr(drawn)
