"""Distributed checkpoints across world sizes (CPU, gloo): the resharding matrix, crash during save,
load errors. See tests/helpers/checkpoint.py.

    world 4: train 3 steps, save (a/step-3), two failing saves of step 4 (a writer raising midway,
             publishing raising), 3 more steps: the uninterrupted losses
    world 2: resume from a/step-3, 2 steps, save b/step-5, 1 step; every load error; the
             safetensors export at world 2
    world 3: resume from a/step-3, 3 steps
    world 1: resume from b/step-5 (saved at world 2), 1 step
Each resumed run's losses equal the uninterrupted run's up to float rounding.
"""
import pytest

from ..helpers.checkpoint import resume_worker, world1_worker, world4_worker
from ..helpers.dist import run_distributed


@pytest.mark.slow  # 40-45 s; the DCP interchange tests cover resharding (2 -> 3) in the default suite
def test_resharding_matrix(tmp_path):
    directory = str(tmp_path)
    run_distributed(world4_worker, 4, directory)
    run_distributed(resume_worker, 2, directory)
    run_distributed(resume_worker, 3, directory)
    run_distributed(world1_worker, 1, directory)
