"""Shared pytest options: tests marked `slow` run only with --runslow. The example models
(examples/models.py) are importable as `models`, as in the examples and benchmarks."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run slow tests")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes long; skipped unless --runslow is given")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
