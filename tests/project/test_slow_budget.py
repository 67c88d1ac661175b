"""The slow tier's time budget (tests/conftest.py, `--budget-s`), run on a throwaway suite by
pytest itself: the cases marked `essential` run first under a budget, those marked `tool` last,
in their files' order;
past the budget an essential case fails the run (an error at its set-up) while any other is
skipped; with a separate budget for the essential cases they run past the others' budget, saying why; without
a budget nothing is reordered."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CONFTEST = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")

SUITE = textwrap.dedent("""
    import pytest

    @pytest.mark.slow
    @pytest.mark.tool
    def test_tool_0():
        pass

    @pytest.mark.slow
    def test_plain_a():
        pass

    @pytest.mark.slow
    @pytest.mark.essential
    def test_essential_b():
        pass

    @pytest.mark.slow
    def test_plain_c():
        pass

    @pytest.mark.slow
    @pytest.mark.essential
    def test_essential_d():
        pass
""")


def _run(tmp_path, *args):
    (tmp_path / "conftest.py").write_text(open(CONFTEST).read())
    (tmp_path / "test_suite.py").write_text(SUITE)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--runslow",
         "--heartbeat-s", "0", *args, "test_suite.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return out.returncode, out.stdout


def _outcomes(stdout: str) -> list[tuple[str, str]]:
    """(test, PASSED/ERROR/SKIPPED) in the order pytest ran them."""
    rows = []
    for line in stdout.splitlines():
        if line.startswith("test_suite.py::") and " " in line:
            name, outcome = line.split()[:2]
            rows.append((name.removeprefix("test_suite.py::test_"), outcome))
    return rows


def test_essential_cases_run_first_under_a_budget(tmp_path):
    code, out = _run(tmp_path, "--budget-s", "600")
    assert code == 0, out
    assert _outcomes(out) == [("essential_b", "PASSED"), ("essential_d", "PASSED"),
                              ("plain_a", "PASSED"), ("plain_c", "PASSED"),
                              ("tool_0", "PASSED")], out


def test_without_a_budget_the_order_is_the_files(tmp_path):
    code, out = _run(tmp_path)
    assert code == 0, out
    assert [name for name, _ in _outcomes(out)] == ["tool_0", "plain_a", "essential_b",
                                                    "plain_c", "essential_d"], out


def test_an_essential_case_past_the_budget_fails_the_run(tmp_path):
    # A budget already spent: both essential cases fail at their set-up (pytest's ERROR, which
    # fails the run like a FAILED) naming the budget; the others skip.
    code, out = _run(tmp_path, "--budget-s", "0", "-rfs")
    assert code == 1, out
    assert _outcomes(out) == [("essential_b", "ERROR"), ("essential_d", "ERROR"),
                              ("plain_a", "SKIPPED"), ("plain_c", "SKIPPED"),
                              ("tool_0", "SKIPPED")], out
    assert "essential case not run" in out and "over the time budget of 0 s" in out, out


def test_essential_cases_run_past_the_budget_of_the_others(tmp_path):
    # The others' budget spent, the essential one not: the essential cases run, the others skip.
    code, out = _run(tmp_path, "--budget-s", "0", "--essential-budget-s", "600")
    assert code == 0, out
    assert _outcomes(out) == [("essential_b", "PASSED"), ("essential_d", "PASSED"),
                              ("plain_a", "SKIPPED"), ("plain_c", "SKIPPED"),
                              ("tool_0", "SKIPPED")], out
