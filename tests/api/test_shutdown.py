"""run_then_exit ends a process with the status (and traceback) Python itself gives, for each way a
main function can end; the reference is the same function run as a plain script."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BODIES = {
    "returns": "print('done')",
    "raises": "raise ValueError('boom')",
    "exit code": "sys.exit(3)",
    "exit message": "sys.exit('bad input')",
    "exit None": "sys.exit()",
}


def _run(body: str, wrapped: bool) -> subprocess.CompletedProcess:
    call = "import fsdp_ext; fsdp_ext.run_then_exit(main)" if wrapped else "main()"
    script = f"import sys\ndef main():\n    {body}\n{call}\n"
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.parametrize("body", list(BODIES.values()), ids=list(BODIES))
def test_same_status_and_output_as_python(body):
    plain, wrapped = _run(body, wrapped=False), _run(body, wrapped=True)
    assert wrapped.returncode == plain.returncode
    assert wrapped.stdout == plain.stdout
    # The last line of stderr: the exception (a traceback's frames differ by the wrapper's own).
    assert wrapped.stderr.strip().splitlines()[-1:] == plain.stderr.strip().splitlines()[-1:]
