"""The training text: the project's own source files as bytes (vocabulary 256), no download.

Any machine that has the repository has the corpus, so the main job runs offline. `--data FILE`
trains on any other text file instead. Batches are drawn from a generator seeded by (seed, step,
rank, micro-batch), so a resumed run sees exactly the batches the uninterrupted run would have.
"""
from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("fsdp_ext", "csrc", "tests", "examples", "benchmarks", "docs", "tools")
SUFFIXES = {".py", ".h", ".cpp", ".cu", ".md", ".toml", ".txt"}


def load_corpus(path: str | None = None) -> torch.Tensor:
    """All source files of the repository (sorted, so every rank gets the same bytes), or `path`."""
    if path:
        return torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
    files = sorted(p for d in SOURCES if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*")
                   if p.suffix in SUFFIXES and p.is_file() and ".venv" not in p.parts)
    files += sorted(p for p in ROOT.glob("*.md"))
    text = b"".join(b"\n# file: " + str(p.relative_to(ROOT)).encode() + b"\n" + p.read_bytes()
                    for p in files)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def split(data: torch.Tensor, holdout: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): the last `holdout` of the bytes is never trained on."""
    cut = int(len(data) * (1 - holdout))
    return data[:cut], data[cut:]


def batch(data: torch.Tensor, batch_size: int, block_size: int, seed: int, step: int, rank: int,
          micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` random windows: inputs [B, T] and next-byte targets [B, T] (int64)."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1009 + rank) * 101 + micro)
    starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=g)
    rows = torch.stack([data[s:s + block_size + 1] for s in starts.tolist()]).long()
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
