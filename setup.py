"""Build fp8ops: the Python package, plus the CUDA extension fp8ops._C when it can be built.

fp8ops._C is built when nvcc and a CUDA build of torch are present (FP8OPS_SKIP_CUDA_BUILD=1 skips
it). Install with `pip install --no-build-isolation .` so the build sees the torch you run with.
CUTLASS headers come from the nvidia-cutlass package (pip install --no-deps nvidia-cutlass) or
from CUTLASS_PATH (a CUTLASS checkout).

Architectures: cast kernels are built for sm_89 and sm_90a (or TORCH_CUDA_ARCH_LIST when set);
the CUTLASS GEMM files (csrc/gemm_sm90*.cu) only for sm_90a, always with -DNDEBUG.
"""
import glob
import os
import re
import shutil
from importlib.util import find_spec

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
GEMM_SOURCE = re.compile(r"gemm_sm90[^/ ]*\.cu$")
SM90A = "-gencode=arch=compute_90a,code=sm_90a"


def _cutlass_includes():
    root = os.environ.get("CUTLASS_PATH")
    if root:
        return [os.path.join(root, "include"), os.path.join(root, "tools", "util", "include")]
    spec = find_spec("cutlass_library")  # nvidia-cutlass; found without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    src = os.path.join(list(spec.submodule_search_locations)[0], "source")
    return [os.path.join(src, "include"), os.path.join(src, "tools", "util", "include")]


def _cast_gencodes():
    """-gencode flags for the cast kernels: TORCH_CUDA_ARCH_LIST if set, else 8.9 and 9.0a."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.9;9.0a").replace(",", ";").split(";")
    flags = []
    for arch in filter(None, (a.strip() for a in archs)):
        num = arch.replace(".", "").replace("+PTX", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


def _cuda_extension():
    if os.environ.get("FP8OPS_SKIP_CUDA_BUILD", "0") == "1":
        print("fp8ops: FP8OPS_SKIP_CUDA_BUILD=1, building the pure-Python package only")
        return None, {}
    if not os.environ.get("CUDA_HOME") and os.path.exists("/usr/local/cuda/include/cuda_runtime.h"):
        # torch guesses CUDA_HOME from `which nvcc`, which may be a wrapper outside the toolkit
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("fp8ops: torch not importable at build time (use --no-build-isolation); "
              "building the pure-Python package only")
        return None, {}
    if torch.version.cuda is None or cpp_extension.CUDA_HOME is None or not shutil.which(
            os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")):
        print("fp8ops: no nvcc or a CPU build of torch; building the pure-Python package only")
        return None, {}
    cutlass = _cutlass_includes()
    if cutlass is None:
        raise RuntimeError("fp8ops: CUTLASS headers not found. `pip install --no-deps "
                           "nvidia-cutlass` or set CUTLASS_PATH, or FP8OPS_SKIP_CUDA_BUILD=1.")
    sources = sorted(glob.glob("csrc/*.cu")) + ["csrc/torch_bindings.cpp"]
    nvcc = ["-O3", "-std=c++17", "-DNDEBUG", "--expt-relaxed-constexpr", "-lineinfo",
            "-Xcompiler=-fno-strict-aliasing"] + _cast_gencodes()
    # CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL stays undefined: CUTLASS then fetches
    # cuTensorMapEncodeTiled through cudart, so _C never links libcuda and imports without a driver.
    ext = cpp_extension.CUDAExtension(
        name="fp8ops._C",
        sources=sources,
        include_dirs=[os.path.join(HERE, "csrc")] + cutlass,
        # No -std for the C++ binding: torch's BuildExtension adds the standard the installed
        # torch was built with (C++17 up to 2.1x, C++20 later); forcing another one breaks inline
        # c10 code that differs between the two.
        extra_compile_args={"cxx": ["-O3", "-DNDEBUG"], "nvcc": nvcc},
    )
    return ext, {"build_ext": _gemm_arch_build_ext(cpp_extension)}


def _gemm_arch_build_ext(cpp_extension):
    """BuildExtension whose ninja file compiles the CUTLASS GEMM sources for sm_90a only.

    torch's ninja writer has one set of nvcc flags for all sources; ninja lets a build statement
    shadow a variable, so we give each GEMM object its own cuda_post_cflags."""

    class BuildExtension(cpp_extension.BuildExtension):
        def build_extensions(self):
            original = cpp_extension._write_ninja_file

            def write(path, *args, **kwargs):
                original(path, *args, **kwargs)
                _retarget_gemm_objects(path)

            cpp_extension._write_ninja_file = write
            try:
                super().build_extensions()
            finally:
                cpp_extension._write_ninja_file = original

    return BuildExtension.with_options(use_ninja=True)


def _retarget_gemm_objects(path):
    with open(path) as f:
        lines = f.read().splitlines()
    post = next(line for line in lines if line.startswith("cuda_post_cflags = "))
    no_arch = [t for t in post.split(" ")[2:] if not t.startswith(("-gencode", "--generate-code"))]
    override = "  cuda_post_cflags = " + " ".join(no_arch + [SM90A])
    out = []
    for line in lines:
        out.append(line)
        if line.startswith("build ") and " cuda_compile " in line and GEMM_SOURCE.search(line):
            out.append(override)
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


ext, cmdclass = _cuda_extension()
setup(
    packages=find_packages(include=["fp8ops", "fp8ops.*"]),
    ext_modules=[ext] if ext is not None else [],
    cmdclass=cmdclass,
)
