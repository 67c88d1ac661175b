"""Runs a pip command for `make` (the venv's installs, the extension's build) and says what it does.

pip says either nothing (-q: minutes of silence while torch installs or the compiler runs) or
hundreds of lines of resolver notes and compiler flags (-v). This keeps pip's whole output in a log
file and prints a line per step instead: each source file as ninja finishes compiling it, with the
time since the start, the link, the packages installed, and a line every 30 s while nothing else is
printed (what it is doing, how long so far), so a log never goes quiet for long. Everything else
stays in the log only, setuptools' "Editable installation ... be careful with folders" box among
it: it warns that a folder named like the package in the working directory is imported first,
which here is the checkout itself, the very code the editable install points at.

On failure it prints the log's last lines and exits with pip's status, so make stops there.

    python tools/pip_progress.py --log .venv/build.log -- python -m pip install -v ... -e .
"""
from __future__ import annotations

import argparse
import os
import queue
import re
import subprocess
import sys
import threading
import time

# A ninja status line, printed as each command finishes when output is not a terminal:
# "[3/6] c++ -MMD ... -c /abs/csrc/cpu/x.cpp -o /abs/build/.../x.o" (nvcc lines alike).
NINJA = re.compile(r"^\s*\[(\d+)/(\d+)\]\s+(.*)$")
SOURCE = re.compile(r"\s-c\s+(\S+\.(?:cpp|cc|cxx|c|cu))(?:\s|$)")
# The link, run by setuptools after ninja: "... g++ ... -shared ... -o .../fsdp_ext/_C....so".
LINK = re.compile(r"\s-shared\s.*-o\s+(\S+\.so)\b")
QUIET_S = 30.0


def fmt(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


class Filter:
    """Turns the command's lines into the few that are printed."""

    def __init__(self, root: str):
        self.root = root
        self.phase = "resolving the dependencies"

    def rel(self, path: str) -> str:
        path = os.path.abspath(path)
        return os.path.relpath(path, self.root) if path.startswith(self.root + os.sep) else path

    def __call__(self, line: str, elapsed: float) -> list[str]:
        text = line.strip()
        m = NINJA.match(line)
        if m:
            step, total, command = int(m.group(1)), int(m.group(2)), m.group(3)
            src = SOURCE.search(command)
            if src is None:
                return []
            self.phase = f"compiling: {step} of {total} files done"
            return [f"   [{step}/{total}] compiled {self.rel(src.group(1))}  ({fmt(elapsed)})"]
        if text.startswith("building '") and text.endswith("' extension"):
            name = text.split("'")[1]
            self.phase = f"compiling {name}"
            jobs = os.environ.get("MAX_JOBS")
            at_once = f", {jobs} at a time" if jobs else ""
            return [f"   compiling {name} with ninja{at_once}: each file is listed as it is done"]
        if text.startswith("ninja: no work to do"):
            return ["   nothing to compile: the objects under build/ are current"]
        m = LINK.search(line)
        if m:
            self.phase = "linking"
            return [f"   linking {os.path.basename(m.group(1))}  ({fmt(elapsed)})"]
        if text.startswith("Installing collected packages:"):
            self.phase = "installing"
            return [f"   {shorten(text)}"]
        if text.startswith("Successfully installed"):
            return [f"   {shorten(text)}"]
        if text.startswith("Collecting "):
            self.phase = f"fetching packages (last: {text[len('Collecting '):].split()[0]})"
        elif text.startswith("Building editable for") or text.startswith("Building wheel for"):
            self.phase = "preparing the build"
        return []

    def heartbeat(self, elapsed: float) -> str:
        return f"   ... {self.phase}  ({fmt(elapsed)})"


def shorten(text: str, width: int = 110) -> str:
    return text if len(text) <= width else text[:width - 5] + " ..."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", required=True, help="file that receives the command's whole output")
    parser.add_argument("--tail", type=int, default=40, help="log lines printed on failure")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the pip command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")

    os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
    lines: queue.Queue = queue.Queue()
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1)

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    keep = Filter(os.getcwd())
    last_print = start
    with open(args.log, "w") as log:
        while True:
            try:
                line = lines.get(timeout=max(0.1, QUIET_S - (time.monotonic() - last_print)))
            except queue.Empty:
                print(keep.heartbeat(time.monotonic() - start), flush=True)
                last_print = time.monotonic()
                continue
            if line is None:
                break
            log.write(line)
            log.flush()
            for out in keep(line.rstrip("\n"), time.monotonic() - start):
                print(out, flush=True)
                last_print = time.monotonic()
    rc = proc.wait()
    if rc != 0:
        with open(args.log) as f:
            tail = f.readlines()[-args.tail:]
        print(f"== failed (exit status {rc}); the last {len(tail)} lines of {args.log}:",
              file=sys.stderr)
        sys.stderr.write("".join(tail))
        print(f"== the whole output: {args.log}", file=sys.stderr)
        return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
