"""The commands the docs print run as printed.

The launch commands of docs/integrations.md: each ```bash block that calls torchrun runs through
bash from the top of the checkout (its first line activates the venv that `make build` made; with
no such venv there is nothing to run as printed, and the test skips).

The main job's options: `examples/train.py --help` shows every option's default, and
docs/training.md's table, which says it lists them as --help does, has every option. `make help`
lists every target the Makefile declares.

The benchmark commands of README.md and docs/*.md, `python -m benchmarks.<folder>.<script> ARGS`
in ```bash blocks and in inline code: each names a script of the benchmarks package, and every
option it passes is one that script's parser defines (read from its source, nothing run); the
slow set also runs each printed script with --help under `python -m` from the top of the checkout,
which imports it as the printed command does. Makefile and tools/gpu_check.py name the scripts
they run the same way.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

from ..helpers.launch import environment_without_launcher
from .test_docs import PAGES, ROOT, fenced_blocks, read

ACTIVATE = os.path.join(ROOT, ".venv", "bin", "activate")
BLOCKS = [(start, code) for lang, start, code in fenced_blocks(read("docs/integrations.md"))
          if lang == "bash" and "torchrun" in code]
# What each printed launch shows when it trained, and how many times: titan_flow.py prints the
# mean loss on rank 0, hf_trainer.py each of the 2 ranks its own micro-batch losses, torchtitan's
# trainer (tests/helpers/titan_cpu.py) which implementation sharded the model, on each of the 2 ranks.
EXPECTED = {"titan_flow.py": ("step 5: loss", 1), "hf_trainer.py": ("micro-batch losses", 2),
            "tests.helpers.titan_cpu": ("FSDP implementation: fsdp_ext (", 2)}


def test_the_page_prints_launch_commands():
    assert len(BLOCKS) == 3
    for _, code in BLOCKS:
        assert code.startswith("source .venv/bin/activate"), code


@pytest.mark.slow
@pytest.mark.tool
@pytest.mark.skipif(not os.path.exists(ACTIVATE), reason="no .venv made by `make build` here")
@pytest.mark.parametrize("start,code", BLOCKS, ids=[f"line{start}" for start, _ in BLOCKS])
def test_printed_commands_run(start, code):
    env = environment_without_launcher("VIRTUAL_ENV")
    proc = subprocess.run(["bash", "-e", "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"docs/integrations.md line {start}:\n{output[-6000:]}"
    launches = code.count("torchrun ")
    (example,) = {name for name in EXPECTED if name in code}
    line, per_launch = EXPECTED[example]
    assert output.count(line) == launches * per_launch, output[-4000:]


_MODULE = re.compile(r"python\s+-m\s+(benchmarks(?:\.\w+)+)")


def _printed_pieces(text: str) -> list[str]:
    """The lines of a page's ```bash blocks (continuations joined, comments cut) and its inline code
    spans outside code blocks."""
    pieces = []
    for lang, _, code in fenced_blocks(text):
        if lang == "bash":
            pieces += [re.split(r"\s#", line)[0] for line in code.replace("\\\n", " ").splitlines()]
    prose, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code:
            prose.append(line)
    return pieces + re.findall(r"`([^`]+)`", "\n".join(prose))


def benchmark_commands() -> list[tuple[str, str, list[str]]]:
    """(page, module, arguments) of every benchmark command printed in README.md and docs/*.md."""
    found = []
    for page in PAGES:
        for piece in _printed_pieces(read(page)):
            for match in _MODULE.finditer(piece):
                rest = _MODULE.split(piece[match.end():])[0]  # up to a next command on the line
                found.append((page, match.group(1), shlex.split(rest)))
    return found


COMMANDS = benchmark_commands()
MODULES = sorted({module for _, module, _ in COMMANDS})


def _script(module: str) -> str:
    return os.path.join(ROOT, *module.split(".")) + ".py"


def _options(module: str) -> set[str]:
    """The options the script's argparse parser defines, from its source."""
    with open(_script(module)) as f:
        tree = ast.parse(f.read())
    return {"-h", "--help"} | {
        arg.value for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
        for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("-")}


def test_benchmark_commands_name_scripts_and_their_options():
    folders = {name for name in os.listdir(os.path.join(ROOT, "benchmarks"))
               if os.path.exists(os.path.join(ROOT, "benchmarks", name, "__init__.py"))}
    assert {module.split(".")[1] for module in MODULES} == folders  # every folder is shown
    for page, module, args in COMMANDS:
        path = _script(module)
        assert os.path.exists(path), f"{page}: python -m {module}: no such script"
        with open(path) as f:
            assert 'if __name__ == "__main__":' in f.read(), f"{page}: {module} is not a script"
        unknown = {a.split("=")[0] for a in args if a.startswith("--")} - _options(module)
        assert not unknown, f"{page}: python -m {module}: {sorted(unknown)} are not its options"
    for page in PAGES:  # the old form, a benchmark run by its file path, is gone
        assert not re.search(r"python\s+(?:\S+/)?benchmarks/\w", read(page)), page


def test_make_and_gpu_check_name_benchmark_scripts():
    for name in ("Makefile", os.path.join("tools", "gpu_check.py")):
        modules = re.findall(r"-m[\s\",]+(benchmarks(?:\.\w+)+)", read(name))
        assert modules, name
        for module in modules:
            assert os.path.exists(_script(module)), f"{name}: {module}: no such script"


@pytest.mark.slow
@pytest.mark.tool
@pytest.mark.parametrize("module", MODULES)
def test_printed_benchmark_scripts_import(module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT,
                          env=environment_without_launcher(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-3000:]


def _train_parser():
    spec = importlib.util.spec_from_file_location("_train_for_help",
                                                  os.path.join(ROOT, "examples", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def test_train_options_show_their_defaults_and_are_documented():
    parser = _train_parser()
    formatter = parser._get_formatter()
    options = {}
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            text = formatter._get_help_string(action) % vars(action)
            assert text.count("(default") == 1, f"{action.option_strings[0]}: {text!r}"
            options[action.option_strings[0]] = text
    table = [line.split("|")[1] for line in read("docs/training.md").splitlines()
             if line.startswith("| `--")]
    documented = set(re.findall(r"--[a-z][a-z-]*", " ".join(table)))
    assert documented == set(options), (sorted(set(options) - documented),
                                        sorted(documented - set(options)))


def test_make_help_lists_every_target():
    makefile = read("Makefile")
    phony = set(re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split())
    noted = set(re.findall(r"^([a-z][a-z-]*):[^\n]*## ", makefile, re.M))
    assert noted == phony, (sorted(phony - noted), sorted(noted - phony))
    assert re.search(r"^\.DEFAULT_GOAL := help$", makefile, re.M)
