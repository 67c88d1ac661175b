"""Ending a gloo rank without the interpreter finalization that can abort it.

On rare runs (about 1 in 15 short multi-process runs here, once in the main job's reduced CI run) a
rank whose work had all finished aborted during finalization ("terminate called without an active
exception"). A core dump shows why: a gloo worker thread, having just completed the last
collective, drops that work and with it the last reference to an earlier collective's tensor,
whose Python object needs the GIL to be freed; a thread that takes the GIL during finalization is
ended with pthread_exit, which unwinds through a noexcept destructor: std::terminate. This sits
between torch's gloo process group and CPython (README, "Not covered").
"""
from __future__ import annotations

import os
import sys


def exit_without_finalization(status: int = 0) -> None:
    """Flush stdout/stderr and end the process now, skipping finalization and atexit handlers.

    Call it last, after destroy_process_group() and once every file is written and closed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
