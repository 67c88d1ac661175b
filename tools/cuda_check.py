"""Compile-checks every csrc/cuda/*.cu with nvcc, without linking or running anything.

For machines without a GPU (CI, laptops): nvcc and torch's CUDA headers are enough. Each .cu is
compiled with the flags setup.py's build uses (torch include paths, -std=c++20 as torch's headers
require, TORCH_CUDA_ARCH_LIST, by default setup.py's "8.0;9.0+PTX") to an object in a temporary
directory that is then deleted. The exit status is non-zero if any file fails.

Stricter than the build: every warning is an error (nvcc's -Werror all-warnings), and ptxas warns
when a kernel spills registers to local memory or uses a stack frame at all (-warn-spills,
-warn-lmem-usage): a spill is a silent slowdown the build would accept, and no kernel here needs
local memory. The failure names each such kernel, demangled, with ptxas's byte counts.

This always runs nvcc rather than reusing objects from a previous `pip install -e .`: those live in
a temporary build directory that pip removes, and one .cu takes about two minutes on two cores.
Where the full CUDA build already ran in CI, this check is redundant and may be skipped.

    python tools/cuda_check.py [--arch "9.0"] [files...]
"""
from __future__ import annotations

import argparse
import glob
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


DEFAULT_ARCH_LIST = "8.0;9.0+PTX"  # setup.py's default: Ampere, Hopper, PTX for newer GPUs


def arch_flags(arch_list: str) -> list[str]:
    """'8.0;9.0+PTX' -> one -gencode per architecture: its SASS, and with +PTX also its PTX
    (which the driver compiles for GPUs newer than any listed), as torch's build does."""
    flags = []
    for arch in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        if arch:
            number = arch.replace(".", "").replace("+PTX", "")
            codes = f"[sm_{number},compute_{number}]" if arch.endswith("+PTX") else f"sm_{number}"
            flags.append(f"-gencode=arch=compute_{number},code={codes}")
    return flags


def nvcc_command(cuda_home: str, source: str, obj: str, arch_list: str) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    try:
        torch_includes = cpp_extension.include_paths(device_type="cuda")
    except TypeError:  # torch < 2.7 spelled it include_paths(cuda=True)
        torch_includes = cpp_extension.include_paths(cuda=True)
    includes = [os.path.join(ROOT, "csrc")] + torch_includes
    includes.append(sysconfig.get_paths()["include"])
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ([os.path.join(cuda_home, "bin", "nvcc"), "-c", source, "-o", obj, "-std=c++20", "-O3",
             "--compiler-options", "-fPIC", "-Xcompiler=-ffp-contract=off",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_EXTENSION_NAME=_C"]
            + cpp_extension.COMMON_NVCC_FLAGS + arch_flags(arch_list) + STRICT_FLAGS
            + [f"-I{path}" for path in includes])


# Warnings are errors, and ptxas warns of register spills and of any local memory (stack frame).
STRICT_FLAGS = ["-Werror", "all-warnings", "-Xptxas=-warn-spills,-warn-lmem-usage"]


def demangled(text: str) -> str:
    """nvcc's output with the kernels' mangled names readable (c++filt, where it is installed)."""
    try:
        return subprocess.run(["c++filt"], input=text, capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="default: csrc/cuda/*.cu")
    parser.add_argument("--arch", default=os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST))
    parser.add_argument("-v", "--verbose", action="store_true", help="print the nvcc commands")
    args = parser.parse_args()

    # Set before torch.utils.cpp_extension is imported: it guesses CUDA_HOME from `which nvcc`.
    cuda_home = os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    if not os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        print(f"cuda_check: no nvcc under {cuda_home} (set CUDA_HOME)", file=sys.stderr)
        return 2
    sources = args.files or sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
    if not sources:
        print("cuda_check: no .cu files found", file=sys.stderr)
        return 2

    failures = 0
    with tempfile.TemporaryDirectory(prefix="cuda_check_") as tmp:
        for source in sources:
            obj = os.path.join(tmp, os.path.basename(source) + ".o")
            command = nvcc_command(cuda_home, source, obj, args.arch)
            if args.verbose:
                print(shlex.join(command))
            start = time.time()
            result = subprocess.run(command, capture_output=True, text=True)
            status = "ok" if result.returncode == 0 else "FAILED"
            name = os.path.relpath(source, ROOT)
            print(f"cuda_check: {name} [{args.arch}] {status} in {time.time() - start:.0f}s")
            if result.returncode != 0 or args.verbose:
                sys.stdout.write(demangled(result.stdout + result.stderr))
            failures += result.returncode != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
