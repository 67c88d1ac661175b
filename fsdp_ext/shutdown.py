"""Ending a gloo rank without the interpreter finalization that can abort it.

On rare runs (about 1 in 15 short multi-process runs here, once in the main job's reduced CI run) a
rank whose work had all finished aborted during finalization ("terminate called without an active
exception"). A core dump shows why: a gloo worker thread, having just completed the last
collective, drops that work and with it the last reference to an earlier collective's tensor,
whose Python object needs the GIL to be freed; a thread that takes the GIL during finalization is
ended with pthread_exit, which unwinds through a noexcept destructor: std::terminate. This sits
between torch's gloo process group and CPython (docs/diagnostics.md, "Not covered").
"""
from __future__ import annotations

import os
import sys
import traceback


def exit_without_finalization(status: int = 0) -> None:
    """Flush stdout/stderr and end the process now, skipping finalization and atexit handlers.

    Call it last, after destroy_process_group() and once every file is written and closed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_then_exit(main, *args) -> None:
    """Run `main(*args)` and end the process without finalization, with the status Python would
    give: 0, a SystemExit's code, or 1 after printing the traceback of any other exception (a rank
    that raises would otherwise meet the same abort, and end with SIGABRT's status instead)."""
    try:
        main(*args)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
        status = 1
    else:
        status = 0
    exit_without_finalization(status)
