"""Shared pytest options: tests marked `slow` run only with --runslow, those marked `stream_check`
(the scenario suite under the stream-order model) with --stream-check or --runslow. `--budget-s N`
skips, with that reason, every test that would start more than N seconds after the session began
(CI runs the slow cases so, to stay within its time). The example models (examples/models.py) are
importable as `models`, as in the examples and benchmarks."""
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run slow tests")
    parser.addoption("--stream-check", action="store_true", default=False,
                     help="also run the scenarios under the stream-order model")
    parser.addoption("--budget-s", type=float, default=None,
                     help="skip the tests that would start after this many seconds")


def pytest_configure(config):
    config._session_start = time.monotonic()
    config.addinivalue_line("markers", "slow: takes long; skipped unless --runslow is given")
    config.addinivalue_line("markers", "stream_check: the scenarios under the stream-order "
                            "model; skipped unless --stream-check or --runslow is given")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    stream_check = config.getoption("--stream-check")
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow to run")
    skip_stream = pytest.mark.skip(reason="stream_check: pass --stream-check to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
        elif "stream_check" in item.keywords and not stream_check:
            item.add_marker(skip_stream)


def pytest_runtest_setup(item):
    budget = item.config.getoption("--budget-s")
    if budget is not None and time.monotonic() - item.config._session_start > budget:
        pytest.skip(f"over the time budget of {budget:.0f} s (--budget-s)")
