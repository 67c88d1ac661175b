"""Builds the compiled ops module fsdp_ext._C (metadata lives in pyproject.toml).

CPU kernels are always built. The CUDA kernels are added when a CUDA build of torch and nvcc are
both present, unless FSDP_EXT_NO_CUDA=1 (useful while iterating: the .cu alone takes minutes on a
small machine). No GPU is needed to build. Other knobs: CUDA_HOME (default /usr/local/cuda when it
exists), TORCH_CUDA_ARCH_LIST (default "8.0;9.0+PTX": machine code for Ampere and Hopper, and PTX
that the driver compiles on first use for any newer GPU, so the kernels load there too),
MAX_JOBS (ninja parallelism), DEBUG=1 (-O0 -g).

    MAX_JOBS=2 pip install --no-build-isolation -e .
"""
import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))

# torch.utils.cpp_extension reads these when it is imported, so set the defaults first.
if not os.environ.get("CUDA_HOME") and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")

import torch  # noqa: E402
from torch.utils.cpp_extension import (  # noqa: E402
    CUDA_HOME, BuildExtension, CppExtension, CUDAExtension)


def want_cuda() -> bool:
    if os.environ.get("FSDP_EXT_NO_CUDA", "0") == "1":
        return False
    nvcc = os.path.join(CUDA_HOME or "", "bin", "nvcc")
    return torch.version.cuda is not None and os.path.exists(nvcc)


def sources(pattern: str) -> list[str]:
    # Relative paths keep absolute build-machine paths out of the build metadata.
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def extension():
    debug = os.environ.get("DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    # -ffp-contract=off: no fused multiply-add, so results are bit-identical to the reference.
    # -fno-trapping-math (as torch builds): lets the cast loops evaluate both sides of a select,
    # so they vectorize; it changes no value.
    # -fopenmp: at::parallel_for is OpenMP in torch's headers; without it the loops run serially.
    cxx = opt + ["-ffp-contract=off", "-fno-trapping-math", "-fopenmp"]
    srcs = sources("csrc/*.cpp") + sources("csrc/cpu/*.cpp")
    kwargs = dict(
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_link_args=["-fopenmp"],  # resolves to the libgomp torch already loads
    )
    if want_cuda():
        # The device side of flat_layout.h uses __fmul_rn/__fadd_rn, so contraction is moot
        # there; keep the flag for the host code nvcc compiles.
        nvcc = opt + ["-Xcompiler=-ffp-contract=off", "--threads=2"]
        return CUDAExtension("fsdp_ext._C", srcs + sources("csrc/cuda/*.cu"),
                             extra_compile_args={"cxx": cxx,
                                                 "nvcc": nvcc}, **kwargs)
    return CppExtension("fsdp_ext._C", srcs, extra_compile_args={"cxx": cxx}, **kwargs)


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
