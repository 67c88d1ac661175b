"""The files of a checkpoint directory: publishing, the `latest` pointer, the manifest and its checks.

    directory/
      latest                  "step-N": the newest complete checkpoint (replaced atomically)
      step-N/                 published with one rename once everything below is on disk
        .metadata, *.distcp   torch.distributed.checkpoint's files
        fsdp_ext.json         manifest: step, parameter shapes, every file's size and CRC-32
        extra.pt              the caller's `extra` object
      .tmp-step-N/            a save in progress (or one that crashed: never read)

Renames within one file system are atomic, so a reader sees either the old or the new `latest`,
and `step-N` appears complete or not at all. The manifest turns a truncated or corrupted file into
an error that names it, instead of a failure deep inside unpickling or garbage weights.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib

FORMAT = "fsdp_ext-dcp/1"
MANIFEST = "fsdp_ext.json"
EXTRA = "extra.pt"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: missing, incomplete, corrupt, or of another model."""


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step}")


def tmp_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f".tmp-step-{step}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: str, data: bytes) -> None:
    """Write `data` to a temporary name, flush it to disk, then rename it over `path`."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def prepare_tmp(directory: str, step: int) -> None:
    """Create the directory and an empty temporary directory for this save (a stale one from a
    crashed save of the same step is removed)."""
    os.makedirs(directory, exist_ok=True)
    tmp = tmp_dir(directory, step)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)


def file_crc32(path: str, chunk: int = 1 << 22) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def describe_files(root: str, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes", "crc32"}} for the given files under `root`."""
    return {n: {"bytes": os.path.getsize(os.path.join(root, n)),
                "crc32": file_crc32(os.path.join(root, n))} for n in names}


def publish(directory: str, step: int, manifest: dict) -> str:
    """Write the manifest into the temporary directory, rename it to step-N, point `latest` at it."""
    tmp, final = tmp_dir(directory, step), step_dir(directory, step)
    write_file_atomically(os.path.join(tmp, MANIFEST),
                          json.dumps(manifest, indent=1, sort_keys=True).encode())
    _fsync_dir(tmp)
    old = None
    if os.path.exists(final):  # re-saving a step: rename() cannot replace a non-empty directory
        old = os.path.join(directory, f".old-step-{step}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(directory)
    write_file_atomically(os.path.join(directory, LATEST), f"step-{step}\n".encode())
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve(directory: str, step: int | None) -> str:
    """The step directory to load: `step`'s, or the one `latest` names."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory '{directory}' does not exist")
    if step is None:
        pointer = os.path.join(directory, LATEST)
        if not os.path.exists(pointer):
            raise FileNotFoundError(f"no checkpoint in '{directory}' (no '{LATEST}' file)")
        with open(pointer) as f:
            name = f.read().strip()
        if not name.startswith("step-") or os.sep in name:
            raise CheckpointError(f"'{pointer}' is corrupt: {name!r}")
        path = os.path.join(directory, name)
    else:
        path = step_dir(directory, step)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    return path


def read_manifest(path: str) -> dict:
    """The manifest of a published checkpoint, after checking every file's presence and size."""
    file = os.path.join(path, MANIFEST)
    try:
        with open(file) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"'{file}' is missing: '{path}' is not a checkpoint written by "
                              "fsdp_ext.save_checkpoint") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read '{file}': {exc}") from exc
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"'{file}': unknown format {manifest.get('format')!r}")
    for name, info in manifest["files"].items():
        full = os.path.join(path, name)
        if not os.path.exists(full):
            raise CheckpointError(f"checkpoint file '{full}' is missing")
        size = os.path.getsize(full)
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint file '{full}' is truncated or damaged: {size} "
                                  f"bytes, the manifest says {info['bytes']}")
    return manifest


def verify_checksums(path: str, manifest: dict, rank: int, world_size: int,
                     only: tuple[str, ...] | None = None) -> None:
    """Check the CRC-32 of this rank's share of the files (every world_size-th, by name)."""
    for i, (name, info) in enumerate(sorted(manifest["files"].items())):
        if only is not None and name not in only:
            continue
        if i % world_size == rank and file_crc32(os.path.join(path, name)) != info["crc32"]:
            raise CheckpointError(f"checkpoint file '{os.path.join(path, name)}' is corrupt "
                                  "(CRC-32 differs from the manifest)")
