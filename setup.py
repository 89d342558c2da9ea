"""Builds torchcast._C, the compiled extension (the project's metadata is in
pyproject.toml).

- default: a CppExtension; a CUDAExtension when CUDA is available or
  TORCHCAST_CUDA=1 (then TORCH_CUDA_ARCH_LIST is honoured, default sm_80 and
  sm_90 plus PTX, and TORCHCAST_NVCC_FLAGS adds flags to nvcc's).
- TORCHCAST_NO_EXTENSION=1: nothing is compiled; every op runs its
  pure-PyTorch implementation (bit-identical, slower).

Either way torchcast/_build_info.py records what was built and against which
torch, so that importing the extension under another torch fails with a clear
message instead of an undefined symbol."""
import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
NO_EXTENSION = os.environ.get("TORCHCAST_NO_EXTENSION") == "1"


def want_cuda(torch):
    flag = os.environ.get("TORCHCAST_CUDA")
    if flag is not None:
        return flag == "1"
    return torch.cuda.is_available()


def extension(torch):
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    cpu_sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    # No -ffast-math anywhere: reassociation deletes the Kahan compensation.
    # No FMA contraction either: CPU and CUDA must round every step alike.
    # No -std: torch's BuildExtension adds the one its headers need (c++20
    # from torch 2.14 on, which refuses c++17). -g0 drops the debug info that
    # Python's own CFLAGS ask for: it doubles compile and link time and
    # changes no instruction.
    cxx = ["-O3", "-g0", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math",
           "-fno-math-errno"]
    if not want_cuda(torch):
        return CppExtension(
            "torchcast._C", cpu_sources,
            extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    nvcc = ["-O3", "--fmad=false", "--expt-relaxed-constexpr",
            # nvcc's defaults, stated: IEEE division and sqrt, subnormals kept,
            # as on the CPU (the stats must match it bit for bit).
            "-ftz=false", "-prec-div=true", "-prec-sqrt=true",
            "-Xcompiler=-ffp-contract=off"]
    # Flags that change no instruction, for .ci/cuda_facts.py to read the
    # build's own PTX, SASS and ptxas report (.ci/cuda_stage.sh sets them).
    nvcc += os.environ.get("TORCHCAST_NVCC_FLAGS", "").split()
    return CUDAExtension(
        "torchcast._C", cpu_sources + sorted(glob.glob("csrc/cuda/*.cu")),
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=["-fopenmp"])


def build_info(torch_version, with_extension, with_cuda):
    return ('"""Written by setup.py: what this install of torchcast was built with."""\n'
            f"TORCH_VERSION = {torch_version!r}\n"
            f"WITH_EXTENSION = {with_extension!r}\n"
            f"WITH_CUDA = {with_cuda!r}\n")


def with_build_info(command, info):
    """A setuptools command that also writes torchcast/_build_info.py: into
    the source tree for an editable install or an in-place build (whose
    package files are the source tree's), into the build directory for a
    wheel."""

    class Command(command):
        def run(self):
            super().run()
            in_tree = getattr(self, "editable_mode", False) or getattr(self, "inplace", False)
            package = os.path.join(ROOT if in_tree else self.build_lib, "torchcast")
            os.makedirs(package, exist_ok=True)
            with open(os.path.join(package, "_build_info.py"), "w") as f:
                f.write(info)

    return Command


if NO_EXTENSION:
    from setuptools.command.build_py import build_py

    setup(cmdclass={"build_py": with_build_info(build_py, build_info(None, False, False))})
else:
    import torch
    from setuptools.command.build_py import build_py
    from torch.utils.cpp_extension import BuildExtension

    info = build_info(torch.__version__, True, want_cuda(torch))
    setup(ext_modules=[extension(torch)],
          cmdclass={"build_ext": with_build_info(BuildExtension.with_options(use_ninja=True), info),
                    "build_py": with_build_info(build_py, info)})
