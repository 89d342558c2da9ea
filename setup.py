"""Builds torchcast._C: a CppExtension, or a CUDAExtension when CUDA is
available or TORCHCAST_CUDA=1 (then TORCH_CUDA_ARCH_LIST is honoured, default
sm_80 and sm_90 plus PTX)."""
import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

import torch

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda():
    flag = os.environ.get("TORCHCAST_CUDA")
    if flag is not None:
        return flag == "1"
    return torch.cuda.is_available()


def extension():
    cpu_sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    # No -ffast-math anywhere: reassociation deletes the Kahan compensation.
    # No FMA contraction either: CPU and CUDA must round every step alike.
    # No -std: torch's BuildExtension adds the one its headers need (c++20
    # from torch 2.14 on, which refuses c++17).
    cxx = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"]
    if not want_cuda():
        return CppExtension(
            "torchcast._C", cpu_sources,
            extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    nvcc = ["-O3", "--fmad=false", "-DTORCHCAST_WITH_CUDA",
            "--expt-relaxed-constexpr",
            # nvcc's defaults, stated: IEEE division and sqrt, subnormals kept,
            # as on the CPU (the stats must match it bit for bit).
            "-ftz=false", "-prec-div=true", "-prec-sqrt=true",
            "-Xcompiler=-ffp-contract=off"]
    return CUDAExtension(
        "torchcast._C", cpu_sources + sorted(glob.glob("csrc/cuda/*.cu")),
        extra_compile_args={"cxx": cxx + ["-DTORCHCAST_WITH_CUDA"], "nvcc": nvcc},
        extra_link_args=["-fopenmp"])


setup(
    name="torchcast",
    version="0.1.0",
    description="Accountable dtype casts and compensated low-precision arithmetic for PyTorch",
    packages=find_packages(include=["torchcast", "torchcast.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.5", "numpy"],
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
