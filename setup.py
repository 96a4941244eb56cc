"""Build fp8ops: the Python package, the CPU extension fp8ops._cpu, and the CUDA extension
fp8ops._C when it can be built.

fp8ops._cpu (the emulation's CPU kernels, csrc/*_cpu.cpp) needs only torch and a C++ compiler
(FP8OPS_SKIP_CPU_BUILD=1 skips it; the emulation then runs its pure-PyTorch code). fp8ops._C is
built when nvcc and a CUDA build of torch are present (FP8OPS_SKIP_CUDA_BUILD=1 skips it).
Install with `pip install --no-build-isolation .` so the build sees the torch you run with.
CUTLASS headers come from the nvidia-cutlass package (pip install --no-deps nvidia-cutlass) or
from CUTLASS_PATH (a CUTLASS checkout).

Architectures: cast kernels are built for sm_89 and sm_90a with compute_90 PTX for newer GPUs
(or TORCH_CUDA_ARCH_LIST when set, read as torch reads it); the CUTLASS GEMM files
(csrc/gemm_sm90*.cu) only for sm_90a, always with -DNDEBUG. fp8ops/_build_info.py records the
targets, so fp8ops never loads kernels that cannot run on the visible GPUs.
"""
import glob
import os
import re
import shutil
import sys
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


# Default targets of the cast kernels: machine code for Ada and Hopper, plus compute_90 PTX that
# the driver compiles for any newer GPU (Blackwell), so no visible FP8 GPU lacks a kernel image.
DEFAULT_ARCHS = "8.9;9.0a;9.0+PTX"


def parse_arch_list(text):
    """TORCH_CUDA_ARCH_LIST as torch reads it: entries separated by ';', ',' or spaces, each
    "X.Y" (machine code), "X.Ya" (arch-specific machine code) or with "+PTX" (PTX too).
    Returns (sass, ptx): lists of "XY" / "XYa" strings."""
    sass, ptx = [], []
    for entry in text.replace(",", " ").replace(";", " ").split():
        with_ptx = entry.endswith("+PTX")
        arch = entry[:-4] if with_ptx else entry
        if not re.fullmatch(r"\d+\.\d+a?", arch):
            raise ValueError(f"TORCH_CUDA_ARCH_LIST: cannot read {entry!r} (expected e.g. 8.9, 9.0a, 9.0+PTX)")
        num = arch.replace(".", "")
        if num not in sass and not (with_ptx and num + "a" in sass):
            sass.append(num)
        if with_ptx and num not in ptx:
            ptx.append(num.rstrip("a"))
    return sass, ptx


def _cast_gencodes(sass, ptx):
    """-gencode flags for the cast kernels."""
    flags = [f"-gencode=arch=compute_{n},code=sm_{n}" for n in sass]
    flags += [f"-gencode=arch=compute_{n},code=compute_{n}" for n in ptx]
    return flags


def _write_build_info(sass, ptx, cutlass_gemm):
    """fp8ops/_build_info.py: which GPUs the built kernels serve, read by fp8ops.ops.backend before
    it loads the extension (a GPU with neither machine code nor PTX at or below its arch falls
    back to the emulation, with the reason)."""
    with open(os.path.join(HERE, "fp8ops", "_build_info.py"), "w") as f:
        f.write('"""Written by setup.py when it builds fp8ops._C: the targets of its cast kernels."""\n')
        f.write(f"SASS = {sorted(set(n.rstrip('a') for n in sass))!r}\n")
        f.write(f"PTX = {sorted(ptx)!r}\n")
        f.write(f"CUTLASS_SM90 = {cutlass_gemm!r}\n")


def _cpu_extension(cpp_extension):
    if os.environ.get("FP8OPS_SKIP_CPU_BUILD", "0") == "1":
        print("fp8ops: FP8OPS_SKIP_CPU_BUILD=1, not building the CPU kernels (fp8ops._cpu)")
        return None
    # at::parallel_for's OpenMP loop is compiled into the extension: without -fopenmp it runs on
    # one thread. The OpenMP runtime is the one torch already loaded (same soname).
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    return cpp_extension.CppExtension(
        name="fp8ops._cpu",
        sources=sorted(glob.glob("csrc/*_cpu.cpp")),
        include_dirs=[os.path.join(HERE, "csrc")],
        # No FMA contraction: the kernels repeat the emulation's float32 operations one by one.
        # -fno-trapping-math only drops FP exception flags (which nothing reads), so that loops
        # with float compares (the clamp) vectorize; it changes no value.
        extra_compile_args={"cxx": ["-O3", "-DNDEBUG", "-ffp-contract=off", "-fno-trapping-math"]
                            + openmp},
        extra_link_args=openmp,
    )


def _step_extension(cpp_extension):
    """fp8ops._step: the layer step as two dispatcher calls (csrc/step/): autograd glue in C++
    over the fp8ops ops, no kernels of its own, so it builds with any C++ compiler and serves
    CPU and CUDA tensors alike."""
    if os.environ.get("FP8OPS_SKIP_CPU_BUILD", "0") == "1":
        print("fp8ops: FP8OPS_SKIP_CPU_BUILD=1, not building the C++ step (fp8ops._step)")
        return None
    return cpp_extension.CppExtension(
        name="fp8ops._step",
        sources=sorted(glob.glob("csrc/step/*.cpp")),
        extra_compile_args={"cxx": ["-O2", "-DNDEBUG"]},
    )


def _cuda_extension(torch, cpp_extension):
    if os.environ.get("FP8OPS_SKIP_CUDA_BUILD", "0") == "1":
        print("fp8ops: FP8OPS_SKIP_CUDA_BUILD=1, not building the CUDA extension")
        return None
    if torch.version.cuda is None or cpp_extension.CUDA_HOME is None or not shutil.which(
            os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")):
        print("fp8ops: no nvcc or a CPU build of torch; not building the CUDA extension")
        return None
    cutlass = _cutlass_includes()
    if cutlass is None:
        raise RuntimeError("fp8ops: CUTLASS headers not found. `pip install --no-deps "
                           "nvidia-cutlass` or set CUTLASS_PATH, or FP8OPS_SKIP_CUDA_BUILD=1.")
    sources = sorted(glob.glob("csrc/*.cu")) + sorted(glob.glob("csrc/bindings/*.cpp"))
    sass, ptx = parse_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS)
    _write_build_info(sass, ptx, cutlass_gemm=True)
    nvcc = ["-O3", "-std=c++17", "-DNDEBUG", "--expt-relaxed-constexpr", "-lineinfo",
            "-Xcompiler=-fno-strict-aliasing"] + _cast_gencodes(sass, ptx)
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
    return ext


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
    post = next((line for line in lines if line.startswith("cuda_post_cflags = ")), None)
    if post is None:  # a C++-only extension
        return
    no_arch = [t for t in post.split(" ")[2:] if not t.startswith(("-gencode", "--generate-code"))]
    override = "  cuda_post_cflags = " + " ".join(no_arch + [SM90A])
    out = []
    for line in lines:
        out.append(line)
        if line.startswith("build ") and " cuda_compile " in line and GEMM_SOURCE.search(line):
            out.append(override)
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def _extensions():
    if not os.environ.get("CUDA_HOME") and os.path.exists("/usr/local/cuda/include/cuda_runtime.h"):
        # torch guesses CUDA_HOME from `which nvcc`, which may be a wrapper outside the toolkit
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("fp8ops: torch not importable at build time (use --no-build-isolation); "
              "building the pure-Python package only")
        return [], {}
    exts = [e for e in (_cpu_extension(cpp_extension), _cuda_extension(torch, cpp_extension),
                        _step_extension(cpp_extension)) if e]
    return exts, ({"build_ext": _gemm_arch_build_ext(cpp_extension)} if exts else {})


ext_modules, cmdclass = _extensions()
setup(
    packages=find_packages(include=["fp8ops", "fp8ops.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
