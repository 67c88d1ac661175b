"""Every ```python block of README.md and docs/*.md runs, and every relative link points at a file.

Each page's python blocks run in order in one namespace (a later block may use what an earlier one
defined), as one script on both ranks of a `torchrun --nproc-per-node 2` launch per page, with no
process group made for them (tests/helpers/docs.py). Blocks that are not meant to run are fenced as
```bash or ```text; an unlabelled fence is an error, so a python block cannot hide behind one.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ..helpers.launch import environment_without_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
    if name.endswith(".md"))
LANGUAGES = {"python", "bash", "text"}
TIMEOUT_S = 300

_FENCE = re.compile(r"^```(\S*)\s*$")


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, first line number of the code, code) of every fenced block, in order."""
    blocks, lang, start, lines = [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if lang is None:
            if match:
                lang, start, lines = match.group(1), number + 1, []
        elif line.rstrip() == "```":
            blocks.append((lang, start, "\n".join(lines) + "\n"))
            lang = None
        else:
            lines.append(line)
    if lang is not None:
        raise AssertionError(f"a ``` fence opened at line {start - 1} is never closed")
    return blocks


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


RUNNER = os.path.join(ROOT, "tests", "helpers", "docs.py")
WORLD = 2


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page, tmp_path):
    """The page's python blocks as one script on every rank of a torchrun launch at world 2, from
    one working directory, the checkout's root on the path (as the README's snippet.py beside
    examples/ has it)."""
    blocks = [(f"{page}, block {i} (line {start})", code)
              for i, (start, code) in enumerate(
                  ((start, code) for lang, start, code in fenced_blocks(read(page))
                   if lang == "python"), 1)]
    if not blocks:
        return
    script = tmp_path / "blocks.json"
    script.write_text(json.dumps(blocks))
    work = tmp_path / "work"
    work.mkdir()
    env = environment_without_launcher()
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env["TMPDIR"] = str(tmp_path)  # what a block writes to a temporary directory lands here
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(WORLD), RUNNER, str(script)], cwd=work,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    finished = [rank for rank in range(WORLD) if (work / f"docs-ok-rank{rank}").exists()]
    if proc.returncode != 0 or finished != list(range(WORLD)):
        pytest.fail(f"{page}: a python block failed at world {WORLD} (exit status "
                    f"{proc.returncode}, ranks finished: {finished})\n--- stderr ---\n"
                    f"{proc.stderr[-8000:]}\n--- stdout ---\n{proc.stdout[-2000:]}",
                    pytrace=False)
    for line in PRINTS.get(page, ()):  # what the page says its script prints on success
        assert line in proc.stdout, (line, proc.stdout[-2000:])


# The lines README.md's script prints (rank 0), as the README shows them.
PRINTS = {"README.md": [
    "fully_shard: 3 units on 2 ranks, one training step on DTensor shards; DCP checkpoint saved "
    "to checkpoints/readme, read back",
    "FullyShardedDataParallel: forward and backward on 2 ranks, parameters under the unwrapped "
    "model's names"]}


@pytest.mark.parametrize("page", PAGES)
def test_fences_are_labelled(page):
    for lang, start, _ in fenced_blocks(read(page)):
        assert lang in LANGUAGES, (f"{page}: the block at line {start - 1} is fenced as "
                                   f"```{lang}; use one of {sorted(LANGUAGES)}")


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$")


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings (outside code blocks)."""
    found, seen, in_code = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        match = None if in_code else _HEADING.match(line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(text: str) -> list[str]:
    """Link targets outside code blocks and inline code."""
    out, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            out += _LINK.findall(re.sub(r"`[^`]*`", "", line))
    return out


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    text = read(page)
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else \
            os.path.join(ROOT, page)
        assert os.path.exists(file), f"{page}: link {target!r} points at a missing file"
        if anchor and file.endswith(".md"):
            with open(file, encoding="utf-8") as f:
                assert anchor in anchors(f.read()), f"{page}: link {target!r}: no such heading"


def test_pages_exist_and_readme_is_short():
    assert len(PAGES) > 1
    assert len(read("README.md").splitlines()) <= 400
    readme_links = {os.path.normpath(t.partition("#")[0]) for t in links(read("README.md"))}
    for page in PAGES[1:]:
        assert page in readme_links, f"README.md does not link {page}"
