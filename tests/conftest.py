"""Shared pytest options: tests marked `slow` run only with --runslow, those marked `stream_check`
(the scenario suite under the stream-order model) with --stream-check or --runslow. `--budget-s N`
skips, with that reason, every test that would start more than N seconds after the session began
(CI runs the slow cases so, to stay within its time); under a budget the cases marked `essential`
(a real client's run or a fault path: torchtitan's trainer, the restarts, the reliability
scenarios) run first, whatever `--budget-s` says, and one that would start after
`--essential-budget-s` (default: the same) fails instead of being skipped, so CI cannot pass
without them. The examples are a package, imported from the checkout's root (`examples.models`).

Two things for whoever reads the output, often a piped log: a test still running after
`--heartbeat-s` seconds (30 by default; 0: never) is named with its time so far, every that many
seconds, so no stretch of the log is silent for long; and the summary counts the skipped tests by
reason (slow tier, stream-order scenarios, no GPU, optional package missing, ...), each with the
command that runs them."""
import os
import re
import sys
import threading
import time

import pytest



def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run slow tests")
    parser.addoption("--exhaustive", action="store_true", default=False,
                     help="also run the exhaustive sweeps (every float32 bit pattern: minutes each)")
    parser.addoption("--stream-check", action="store_true", default=False,
                     help="also run the scenarios under the stream-order model")
    parser.addoption("--budget-s", type=float, default=None,
                     help="skip the tests that would start after this many seconds")
    parser.addoption("--essential-budget-s", type=float, default=None,
                     help="with --budget-s: a case marked essential fails, instead of running, "
                     "if it would start after this many seconds (default: --budget-s)")
    parser.addoption("--heartbeat-s", type=float, default=30.0,
                     help="name a test still running after this many seconds, and again every "
                     "that many seconds (0: never)")


def pytest_configure(config):
    config._session_start = time.monotonic()
    config.addinivalue_line("markers", "slow: takes long; skipped unless --runslow is given")
    config.addinivalue_line("markers", "exhaustive: a sweep of every input (minutes); skipped "
                            "unless --exhaustive is given, also under --runslow")
    config.addinivalue_line("markers", "stream_check: the scenarios under the stream-order "
                            "model; skipped unless --stream-check or --runslow is given")
    config.addinivalue_line("markers", "essential: a slow case CI must run (a client or a fault "
                            "path): first under --budget-s, and a failure, not a skip, past it")
    config.addinivalue_line("markers", "tool: a slow case that exercises a tool (a benchmark "
                            "script, a printed command, a compiler): last under --budget-s")
    interval = config.getoption("--heartbeat-s")
    if interval and interval > 0:
        config.pluginmanager.register(Heartbeat(config, interval), "fsdp_ext_heartbeat")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--budget-s") is not None:
        # By value, each file's order kept: the essential cases, then fsdp_ext's other checks,
        # then the cases that exercise a tool (a benchmark script, a printed command, a compiler)
        items.sort(key=lambda item: 0 if "essential" in item.keywords else
                   2 if "tool" in item.keywords else 1)
    if not config.getoption("--exhaustive"):  # (kept out of CI's time-boxed slow tier too)
        skip_sweep = pytest.mark.skip(reason="exhaustive: pass --exhaustive to run")
        for item in items:
            if "exhaustive" in item.keywords:
                item.add_marker(skip_sweep)
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
    if budget is None:
        return
    elapsed = time.monotonic() - item.config._session_start
    if "essential" in item.keywords:
        limit = item.config.getoption("--essential-budget-s") or budget
        if elapsed > limit:
            pytest.fail(f"essential case not run: {elapsed:.0f} s into the session, over the "
                        f"time budget of {limit:.0f} s (--essential-budget-s, else --budget-s); "
                        "raise the budget or make the essential cases cheaper", pytrace=False)
        return
    if elapsed > budget:
        pytest.skip(f"over the time budget of {budget:.0f} s (--budget-s)")


class Heartbeat:
    """Names the test that is running once it has run `interval` seconds, then every `interval`.

    While a test runs, pytest points file descriptor 1 at its capture file, so the line goes to a
    duplicate of the terminal's descriptor taken while pytest itself writes there (at a test's
    start). The thread writes only when nothing was reported for `interval` seconds, under a lock
    that each report takes first, so its line never lands inside one of pytest's; the report then
    starts a fresh line (with the file's name where pytest shows it) for its result."""

    def __init__(self, config, interval: float):
        self.config = config
        self.interval = interval
        self.lock = threading.Lock()
        self.fd = None
        self.nodeid = None
        self.started = self.last = 0.0
        self.interrupted = False
        self.wake = threading.Event()
        self.thread = None

    @pytest.hookimpl(trylast=True)  # after the terminal reporter wrote and flushed the test's start
    def pytest_runtest_logstart(self, nodeid, location):
        with self.lock:
            if self.fd is None:
                sys.stdout.flush()
                self.fd = os.dup(1)
                self.thread = threading.Thread(target=self._run, name="pytest-heartbeat",
                                               daemon=True)
                self.thread.start()
            self.nodeid = nodeid
            self.started = self.last = time.monotonic()

    @pytest.hookimpl(tryfirst=True)  # before the terminal reporter writes the result
    def pytest_runtest_logreport(self, report):
        with self.lock:
            self.last = time.monotonic()
            if self.interrupted:
                self.interrupted = False
                self._resume_line()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logfinish(self, nodeid, location):
        with self.lock:
            self.nodeid = None

    def pytest_unconfigure(self, config):
        self.wake.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _resume_line(self):
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        if reporter.showlongtestinfo:  # -v: pytest writes the test's name again before its result
            reporter.currentfspath = None
        elif reporter.showfspath and reporter.currentfspath is not None:
            reporter.line("")
            reporter.write(os.path.relpath(str(reporter.currentfspath), str(reporter.startpath))
                           + " ")
        else:  # -q: the dots go on
            reporter.line("")

    def _run(self):
        while not self.wake.wait(1.0):
            with self.lock:
                now = time.monotonic()
                if self.nodeid is None or now - self.last < self.interval:
                    continue
                self.last = now
                self.interrupted = True
                line = f"\n    ... still running {self.nodeid} ({now - self.started:.0f} s)"
                try:
                    os.write(self.fd, line.encode())
                except OSError:
                    pass


# Skip reasons -> (what they are, how to run them). The first pattern that matches a reason wins.
SKIP_GROUPS = [
    (r"^slow:", "marked slow", "make test-slow (or pytest --runslow)"),
    (r"^exhaustive:", "exhaustive sweeps (marked exhaustive)", "make test-all (or pytest --exhaustive)"),
    (r"^stream_check:", "stream-order scenarios (marked stream_check)",
     "make stream-check (or pytest --stream-check)"),
    (r"over the time budget", "started after the --budget-s time budget", "run without --budget-s"),
    (r"GPU|CUDA|NVIDIA", "need a CUDA GPU", "make gpu-check, on a machine with one"),
    (r"could not import|No module named", "an optional package is missing",
     "make build installs the extras (pip install -e \".[accelerate,lightning,torchao,titan]\")"),
    (r"_C is not built|compiled extension|\.venv made by", "need the built extension or make's venv",
     "make build"),
]


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    groups: dict = {}
    for report in skipped:
        reason = _skip_reason(report)
        for pattern, what, how in SKIP_GROUPS:
            if re.search(pattern, reason):
                key = (what, how)
                break
        else:
            key = (reason, "")
        entry = groups.setdefault(key, [0, set()])
        entry[0] += 1
        if key[0] == "an optional package is missing":
            entry[1].update(re.findall(r"import '([^']+)'", reason))
    terminalreporter.section(f"{len(skipped)} skipped, by reason", sep="-")
    for (what, how), (count, names) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        if names:
            what = f"{what} ({', '.join(sorted(names))})"
        terminalreporter.line(f"{count:5d}  {what}" + (f"; to run them: {how}" if how else ""))
