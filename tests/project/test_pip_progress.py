"""tools/pip_progress.py, which make runs pip through: one line per compiled file and per install,
setuptools' editable-install box kept out of the terminal, the whole output in the log, and pip's
exit status passed on with the log's last lines when it fails (so make stops)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "pip_progress.py")

# What pip -v prints while it builds the extension, shortened (flags cut, as pip indents them).
BUILD_OUTPUT = f"""\
Building wheels for collected packages: fsdp_ext
  running build_ext
  building 'fsdp_ext._C' extension
  [1/2] c++ -MMD -MF /tmp/b/csrc/ops.o.d -O3 -fPIC -c {ROOT}/csrc/ops.cpp -o /tmp/b/csrc/ops.o
  [2/2] /usr/local/cuda/bin/nvcc -O3 -c {ROOT}/csrc/cuda/flat_param.cu -o /tmp/b/flat_param.o
  g++ -O3 -shared /tmp/b/csrc/ops.o /tmp/b/flat_param.o -o /tmp/l/fsdp_ext/_C.cpython-311-x86_64-linux-gnu.so
  /x/setuptools/command/editable_wheel.py:354: BuildBackendWarning: Editable installation.
  !!

          ********************************************************************************
          Please be careful with folders in your working directory with the same
          name as your package as they may take precedence during imports.
          ********************************************************************************

  !!
Installing collected packages: fsdp_ext
Successfully installed fsdp_ext-0.1.0
"""


def _run(tmp_path, status: int):
    log = tmp_path / "build.log"
    fake_pip = ("import sys; sys.stdout.write(open(sys.argv[1]).read()); sys.stdout.flush(); "
                "sys.exit(int(sys.argv[2]))")
    out = tmp_path / "output.txt"
    out.write_text(BUILD_OUTPUT)
    proc = subprocess.run([sys.executable, TOOL, "--log", str(log), "--", sys.executable, "-c",
                           fake_pip, str(out), str(status)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "MAX_JOBS": "2"})
    return proc, log.read_text()


def test_a_line_per_step_and_the_whole_output_in_the_log(tmp_path):
    proc, log = _run(tmp_path, 0)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "   compiling fsdp_ext._C with ninja, 2 at a time: each file is listed as it is done"
    assert lines[1].startswith("   [1/2] compiled csrc/ops.cpp  (")
    assert lines[2].startswith("   [2/2] compiled csrc/cuda/flat_param.cu  (")
    assert lines[3].startswith("   linking _C.cpython-311-x86_64-linux-gnu.so  (")
    assert lines[4:] == ["   Installing collected packages: fsdp_ext",
                         "   Successfully installed fsdp_ext-0.1.0"]
    assert "careful" not in proc.stdout + proc.stderr
    assert log == BUILD_OUTPUT


def test_a_failure_passes_the_status_on_with_the_log_tail(tmp_path):
    proc, _ = _run(tmp_path, 3)
    assert proc.returncode == 3
    assert "failed (exit status 3)" in proc.stderr
    assert "Successfully installed fsdp_ext-0.1.0" in proc.stderr  # the log's last lines
