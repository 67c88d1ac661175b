"""docs/compat.md is current and every public name of the installed torch's FSDP APIs is either
tested against torch or refused at the call (tools/compat.py holds the table and the checks)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_compat_table_covers_torch_and_is_current():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compat.py"), "--check"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, f"tools/compat.py --check:\n{result.stdout}{result.stderr}"
