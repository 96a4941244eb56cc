"""CMakeLists.txt builds the torch-free kernels and a C++ microbenchmark from the same sources
(compile-only on a machine without a GPU)."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = os.environ.get("CUDACXX") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


@pytest.mark.skipif(shutil.which("cmake") is None or not os.path.exists(NVCC),
                    reason="needs cmake and nvcc (the CUDA toolkit)")
def test_cmake_builds_cast_kernels_and_bench(tmp_path):
    cfg = ["cmake", "-S", ROOT, "-B", str(tmp_path), "-DCMAKE_BUILD_TYPE=Release",
           f"-DCMAKE_CUDA_COMPILER={NVCC}", f"-DPython3_EXECUTABLE={sys.executable}"]
    subprocess.run(cfg, check=True, capture_output=True, text=True)
    jobs = str(os.cpu_count() or 2)
    build = subprocess.run(["cmake", "--build", str(tmp_path), "--target", "bench_amax", "-j", jobs],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    assert os.access(tmp_path / "bench_amax", os.X_OK)
    assert (tmp_path / "libfp8ops_cast.a").exists()
