#!/usr/bin/env bash
# Every GPU check in one pass, on a machine with an H100/H200 (run from the repository root):
#
#   bash scripts/gpu_check.sh                 # build, test, bench (about 10 minutes)
#   bash scripts/gpu_check.sh build test      # or any of the sections
#   bash scripts/gpu_check.sh demo            # the training demo at --size gpu (not in the default)
#
# Needs: a CUDA build of torch, nvcc, pytest (pytest-xdist optional), compute-sanitizer, and the
# CUTLASS headers (`pip install --no-deps nvidia-cutlass`, or CUTLASS_PATH). fp8ops is built
# in place against the torch you run with (pip install -e .).
# Sections: build; test (pytest -m gpu, compute-sanitizer memcheck of every op, racecheck of the
# transpose and scale-update kernels); bench (Python benchmarks; C++ microbenchmarks with
# BENCH_CPP=1). Logs go to $OUT (default gpu_check_out/), results to bench/results/. A failing
# section is recorded and the next one still runs; the exit status says whether any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
status=0
section() { echo; echo "==== $1 ===="; }
record() { if [ "$1" -ne 0 ]; then echo "FAILED ($2, rc=$1)"; status=1; fi; echo "$2 rc=$1" >> "$OUT/summary.txt"; }
export PYTHONUNBUFFERED=1
SECTIONS=${*:-build test bench}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
: > "$OUT/summary.txt"

section "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/env.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tee -a "$OUT/env.txt"

if want build; then
  section "build (pip install -e .)"
  MAX_JOBS=${MAX_JOBS:-$(nproc)} timeout 600 python3 -m pip install -q --no-build-isolation --no-deps -e . \
    > "$OUT/build.log" 2>&1
  rc=$?; tail -5 "$OUT/build.log"; record $rc build
fi
python3 -c "import fp8ops; print('backend:', fp8ops.backend(), '-', fp8ops.backend().reason)" 2>&1 | tee -a "$OUT/env.txt"

if want test; then
  section "pytest -m gpu"
  XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
  timeout 600 python3 -m pytest -q -m gpu tests $XDIST -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
  rc=$?; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest_gpu.log" | tail -30; record $rc pytest_gpu

  section "compute-sanitizer memcheck (every op)"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/sanitize_ops.py \
    > "$OUT/memcheck.log" 2>&1
  rc=$?; tail -4 "$OUT/memcheck.log"; record $rc memcheck

  section "compute-sanitizer racecheck (shared-memory kernels)"
  timeout 300 compute-sanitizer --tool racecheck --error-exitcode 3 python3 scripts/sanitize_ops.py --race \
    > "$OUT/racecheck.log" 2>&1
  rc=$?; tail -4 "$OUT/racecheck.log"; record $rc racecheck
fi

if want bench; then
  section "bench/bench_gemm.py"
  timeout 600 python3 bench/bench_gemm.py --iters 20 > "$OUT/bench_gemm.log" 2>&1
  rc=$?; tail -8 "$OUT/bench_gemm.log"; record $rc bench_gemm

  section "bench/bench_backward_gemm.py"
  timeout 600 python3 bench/bench_backward_gemm.py > "$OUT/bench_backward_gemm.log" 2>&1
  rc=$?; tail -6 "$OUT/bench_backward_gemm.log"; record $rc bench_backward_gemm

  section "bench/bench_linear.py"
  timeout 600 python3 bench/bench_linear.py --recipes current,delayed,mxfp8,blockwise --with-auto \
    > "$OUT/bench_linear.log" 2>&1
  rc=$?; tail -16 "$OUT/bench_linear.log"; record $rc bench_linear

  section "bench/bench_linear.py --graph (forward and backward replayed: the step without launch work)"
  timeout 600 python3 bench/bench_linear.py --recipes current,delayed --graph --rounds 4 --iters 5 \
    > "$OUT/bench_linear_graph.log" 2>&1
  rc=$?; tail -16 "$OUT/bench_linear_graph.log"; record $rc bench_linear_graph

  section "bench/profile_linear.py (host time of one layer step, FP8 and bf16; where it goes)"
  timeout 300 python3 bench/profile_linear.py --ops --python > "$OUT/profile_linear.log" 2>&1
  rc=$?; grep "^== " "$OUT/profile_linear.log"; record $rc profile_linear

  section "bench/bench_block.py (Llama-3-8B block, seq 8192: every recipe vs bf16, eager and CUDA-graphed)"
  timeout 600 python3 bench/bench_block.py > "$OUT/bench_block.log" 2>&1
  rc=$?; tail -20 "$OUT/bench_block.log"; record $rc bench_block

  section "bench/bench_comm.py (NCCL, one process: FSDP2's collective bytes per step)"
  timeout 600 python3 bench/bench_comm.py --backend nccl --world 1 --models gpt \
    --out "$OUT/comm_nccl.md" > "$OUT/bench_comm.log" 2>&1
  rc=$?; tail -12 "$OUT/bench_comm.log"; record $rc bench_comm

  section "bench/bench_fsdp_step.py (NCCL, one process: FP8 vs high-precision all-gather)"
  timeout 600 python3 bench/bench_fsdp_step.py --backend nccl --world 1 --models gpt,llama8b_block \
    --seq-len 2048 --profile 15 > "$OUT/bench_fsdp_step.log" 2>&1
  rc=$?; sed -n '/^| model |/,/^$/p' "$OUT/bench_fsdp_step.log"; record $rc bench_fsdp_step

  section "bench/bench_cast.py"
  timeout 900 python3 bench/bench_cast.py --iters 20 > "$OUT/bench_cast.log" 2>&1
  rc=$?; tail -12 "$OUT/bench_cast.log"; record $rc bench_cast

  if [ "${BENCH_CPP:-0}" = 1 ]; then
    section "C++ microbenchmarks (bench/cpp)"
    cmake -S . -B build/cmake_gpu -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$(command -v python3)" \
      > "$OUT/cmake.log" 2>&1 && cmake --build build/cmake_gpu -j"$(nproc)" >> "$OUT/cmake.log" 2>&1
    rc=$?; tail -3 "$OUT/cmake.log"; record $rc cmake_build
    if [ $rc -eq 0 ]; then
      for b in build/cmake_gpu/bench_*; do
        [ -x "$b" ] || continue
        echo "-- $b"; timeout 120 "$b" 2>&1 | tee -a "$OUT/bench_cpp.log"; record "${PIPESTATUS[0]}" "$(basename "$b")"
      done
    fi
  fi
fi

if want demo; then
  section "examples/train_gpt.py --size gpu (every recipe vs bf16: loss, tokens/s, peak memory)"
  timeout 900 python3 examples/train_gpt.py --size gpu --steps ${DEMO_STEPS:-600} --no-progress \
    --out-dir "$OUT/demo" > "$OUT/demo.log" 2>&1
  rc=$?; tail -20 "$OUT/demo.log"; record $rc demo
fi

section "summary"
cat "$OUT/summary.txt"
exit $status
