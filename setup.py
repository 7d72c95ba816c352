"""Build atlas: the pure-Python package, plus the CUDA extension `atlas._C` when it can be built.

One list of sources: `csrc/bindings.cpp` (all torch/pybind11 glue) and every kernel `csrc/*.cu`
(lean CUDA, no torch headers). sm_90 unless TORCH_CUDA_ARCH_LIST says otherwise. Without nvcc
or without a CUDA build of torch, the package installs without the extension and says so.
"""
import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["csrc/bindings.cpp"] + sorted(
    os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "*.cu")))


def _extension():
    """Returns (ext_modules, cmdclass), empty when the extension cannot be built here."""
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception as e:  # torch missing: pure-Python install
        print(f"atlas: building without the CUDA extension (torch not importable: {e})", file=sys.stderr)
        return [], {}
    nvcc = CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))
    if torch.version.cuda is None or not (nvcc or shutil.which("nvcc")):
        why = "torch is a CPU build" if torch.version.cuda is None else "nvcc not found"
        print(f"atlas: building without the CUDA extension ({why}); kernels_available() will be False",
              file=sys.stderr)
        return [], {}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    ext = CUDAExtension(
        name="atlas._C",
        sources=SOURCES,
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args={
            "cxx": ["-O3"],  # torch picks the C++ standard its headers need (C++20 from 2.14)
            # No --use_fast_math: quantization must divide exactly (IEEE) to be bit-exact with the
            # reference; kernels that want fast intrinsics (__expf) call them by name.
            # torch adds -D__CUDA_NO_HALF_OPERATORS__ & co.; kernels are lean CUDA written
            # against the plain CUDA headers, so undo them (as vLLM does).
            "nvcc": ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr",
                     "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                     "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                     "-U__CUDA_NO_BFLOAT16_OPERATORS__"],
        },
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extension()
setup(
    name="atlas",
    version="0.1.0",
    description="CUDA kernels and layers for Qwen3-family decode and speculative decoding (NVFP4/FP8/BF16)",
    packages=find_packages(include=["atlas", "atlas.*"]),
    python_requires=">=3.10",
    install_requires=["torch", "numpy", "safetensors", "tqdm"],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
