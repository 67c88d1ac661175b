"""docs/architecture.md, the checkout's map, is what tools/architecture.py gives from the code now:
a moved, added or removed file, a changed layer table or a folder's new purpose makes this fail
until the page is written again (`python tools/architecture.py`)."""
from __future__ import annotations

import os
import subprocess
import sys

from tools import architecture

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_map_is_current():
    with open(architecture.DOC) as f:
        assert f.read() == architecture.render(), (
            "docs/architecture.md is stale: run python tools/architecture.py")


def test_the_map_names_every_runtime_module_and_test_file():
    page = architecture.render()
    missing = []
    for top in (os.path.join(ROOT, "fsdp_ext", "runtime"), os.path.join(ROOT, "tests")):
        for folder, _, names in os.walk(top):
            if "__pycache__" in folder or folder == top:
                continue
            missing += [os.path.join(folder, n) for n in names
                        if n.endswith(".py") and n != "__init__.py" and f"`{n}`" not in page]
    assert missing == []


def test_the_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    stale = tmp_path / "architecture.md"
    stale.write_text(architecture.render().replace("`grads.py`, ", ""))
    monkeypatch.setattr(architecture, "DOC", str(stale))
    monkeypatch.setattr(sys, "argv", ["architecture.py", "--check"])
    assert architecture.main() == 1
    out = subprocess.run([sys.executable, "tools/architecture.py", "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
