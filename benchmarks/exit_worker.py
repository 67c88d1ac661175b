"""How the benchmarks' mp.spawn workers end: without interpreter finalization.

Rarely (about 1 in 15 runs of some test launches, and once in a 201.6M-parameter benchmark run) a
rank whose work had all finished aborted during finalization ("terminate called without an active
exception", no Python frame), after destroy_process_group had returned, which fails the whole
mp.spawn launch. The cause inside finalization is not found; tests/dist_utils.py ends its ranks
the same way.
"""
from __future__ import annotations

import os
import sys


def exit_without_finalization() -> None:
    """Call last in a worker, after destroy_process_group and once every result is written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
