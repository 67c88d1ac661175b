"""How the benchmarks' mp.spawn workers end: without interpreter finalization.

Rarely (about 1 in 15 runs of some test launches, once in a 201.6M-parameter benchmark run, 2 in
20 runs of a small overlap script) a rank whose work had all finished aborted during finalization
("terminate called without an active exception"), which fails the whole mp.spawn launch. The core
dump: a gloo worker thread finishing the last barrier drops the last reference to an earlier
collective's tensor, whose Python object needs the GIL; taking the GIL during finalization ends
the thread with pthread_exit, whose unwinding through a noexcept destructor calls std::terminate.
tests/dist_utils.py ends its ranks the same way.
"""
from __future__ import annotations

import os
import sys


def exit_without_finalization() -> None:
    """Call last in a worker, after destroy_process_group and once every result is written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
