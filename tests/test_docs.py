"""Every ```python block of README.md and docs/*.md runs, and every relative link points at a file.

Each page's python blocks run in order in one namespace (a later block may use what an earlier one
defined), in a fresh process per page, inside a world-size-1 gloo process group. Blocks that are
not meant to run are fenced as ```bash or ```text; an unlabelled fence is an error, so a python
block cannot hide behind one.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Runs in the child: reads [(label, code), ...] as JSON from stdin.
RUNNER = r"""
import json, linecache, sys, traceback
import torch.distributed as dist
import fsdp_ext

blocks = json.load(sys.stdin)
dist.init_process_group("gloo", rank=0, world_size=1)
namespace = {"__name__": "__main__"}
for label, code in blocks:
    lines = code.splitlines(True)
    linecache.cache[label] = (len(code), None, lines, label)
    try:
        exec(compile(code, label, "exec"), namespace)
    except BaseException:
        print(f"DOCS-FAILED {label}", file=sys.stderr)
        traceback.print_exc()
        fsdp_ext.exit_without_finalization(1)
dist.destroy_process_group()
print("DOCS-OK", len(blocks))
fsdp_ext.exit_without_finalization(0)
"""


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page, tmp_path):
    blocks = [(f"{page}, block {i} (line {start})", code)
              for i, (start, code) in enumerate(
                  ((start, code) for lang, start, code in fenced_blocks(read(page))
                   if lang == "python"), 1)]
    if not blocks:
        return
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, os.path.join(ROOT, "examples")] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               TMPDIR=str(tmp_path))  # what a block writes to a temporary directory lands here
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(blocks), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0 or f"DOCS-OK {len(blocks)}" not in proc.stdout:
        pytest.fail(f"{page}: a python block failed (exit status {proc.returncode})\n"
                    f"--- stderr ---\n{proc.stderr[-8000:]}\n--- stdout ---\n{proc.stdout[-2000:]}",
                    pytrace=False)


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
