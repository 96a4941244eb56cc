#!/usr/bin/env bash
# Every GPU check in one pass, on a machine with an H100/H200 (run from the repository root):
#
#   bash scripts/gpu_check.sh                 # build, test, bench (about 10 minutes)
#   bash scripts/gpu_check.sh build test      # or any of the sections
#   bash scripts/gpu_check.sh demo            # the training demo at --size gpu (not in the default)
#   bash scripts/gpu_check.sh --quick         # at most 8 minutes, build included (below)
#
# --quick: a build for this GPU's architecture alone; the GPU tests of QUICK_TESTS (default: those
# of what changed last: the C++ layer step, the FP8 reduction (dequantize_sum, and the
# reduce-scatter and DDP hook on NCCL with one process), the grouped (MoE) GEMMs, the dense GEMMs
# and the layer; the casts', MoE casts', FP8AdamW's and the statistics kernel's test files, which
# passed on an H200 unchanged since, run in the full `test` section; time limit QUICK_TEST_LIMIT)
# and racecheck of the shared-memory kernels; then the figures the open performance goals need,
# most important first: the host time of one layer step, the GPU timeline of one step at
# 16384x8192x1280, the layer step against bf16 at five key shapes, 60 steps of the --size gpu
# demo (bf16 first and last, current, delayed: about 55 s), the casts at 64 and 256 MB,
# FP8AdamW's step against torch's fused AdamW, the MoE expert step against bf16
# torch._grouped_mm, and the FP8 reduce-scatter's casts against a copy. The whole took 488 s on
# an H200 with 16 cores and the earlier test list. Every section has its own time limit;
# the last lines are a table for bench/RESULTS.md, and all logs are packed into
# $OUT/logs.tar.gz.
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
QUICK=0
if [ "${1:-}" = "--quick" ]; then
  QUICK=1; shift
  SECTIONS=${*:-build quicktest quickbench}
  # one architecture: the GPU in hand (the cast kernels for three targets triple their build)
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(python3 -c \
    "import torch; c = torch.cuda.get_device_capability(); print(f'{c[0]}.{c[1]}' + ('a' if c == (9, 0) else ''))")}
else
  SECTIONS=${*:-build test bench}
fi
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
: > "$OUT/summary.txt"

section "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/env.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tee -a "$OUT/env.txt"

if want build; then
  section "build (pip install -e .)"
  t0=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-$(nproc)} timeout $([ "$QUICK" = 1 ] && echo 300 || echo 600) python3 -m pip install -q --no-build-isolation --no-deps -e . \
    > "$OUT/build.log" 2>&1
  rc=$?; tail -5 "$OUT/build.log"; echo "build took $(( $(date +%s) - t0 )) s"; record $rc build
fi
python3 -c "import fp8ops; print('backend:', fp8ops.backend(), '-', fp8ops.backend().reason)" 2>&1 | tee -a "$OUT/env.txt"

gpu_tests() {  # $1: time limit (s), $2: pytest-xdist workers; the rest: what pytest runs
  local limit=$1 workers=$2; shift 2
  section "pytest -m gpu ($*)"
  XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n $workers")
  timeout "$limit" python3 -m pytest -q -m gpu "$@" $XDIST -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
  rc=$?; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest_gpu.log" | tail -30; record $rc pytest_gpu
}

sanitize() {  # $1: memcheck or racecheck, $2: time limit (s); racecheck runs the shared-memory kernels
  section "compute-sanitizer $1"
  timeout "$2" compute-sanitizer --tool "$1" --error-exitcode 3 python3 scripts/sanitize_ops.py \
    $([ "$1" = racecheck ] && echo --race) > "$OUT/$1.log" 2>&1
  rc=$?; tail -4 "$OUT/$1.log"; record $rc "$1"
}

if want test; then
  gpu_tests 600 8 tests
  sanitize memcheck 300
  sanitize racecheck 300
fi

if want quicktest; then
  # shellcheck disable=SC2086
  gpu_tests ${QUICK_TEST_LIMIT:-210} 14 ${QUICK_TESTS:-tests/test_step_gpu.py tests/test_block_sum_gpu.py tests/test_expert_parallel_gpu.py tests/test_grouped_gpu.py tests/test_gemm_gpu.py tests/test_modules_gpu.py}
  sanitize racecheck 45
fi

if want quickbench; then
  section "bench/profile_linear.py: host time of one layer step; GPU timeline at 16384x8192x1280"
  timeout 60 python3 bench/profile_linear.py --timeline 16384x8192x1280 > "$OUT/profile_linear.log" 2>&1
  rc=$?; grep -E "^== |^   span" "$OUT/profile_linear.log"; record $rc profile_linear

  section "bench/bench_linear.py: key shapes"
  timeout 90 python3 bench/bench_linear.py --recipes current,delayed --with-auto --rounds 3 --iters 5 \
    --shapes 16384x8192x7168,16384x8192x1280,8192x4096x4096,4096x4096x4096,1024x4096x4096 \
    --out "$OUT/results" > "$OUT/bench_linear.log" 2>&1
  rc=$?; record $rc bench_linear

  section "examples/train_gpt.py --size gpu, 60 steps: bf16 (first and last), current, delayed"
  # the bf16 baseline runs twice in one process: its spread bounds what the run can say
  timeout 120 python3 examples/train_gpt.py --size gpu --steps 60 --eval-every 30 --no-progress \
    --recipes baseline,current,delayed,baseline --out-dir "$OUT/demo" > "$OUT/demo.log" 2>&1
  rc=$?; record $rc demo_quick

  section "bench/bench_cast.py: 64 and 256 MB"
  timeout 45 python3 bench/bench_cast.py --sizes-mb 64,256 --iters 10 --no-compile \
    --out "$OUT/results" > "$OUT/bench_cast.log" 2>&1
  rc=$?; record $rc bench_cast

  section "bench/bench_optimizer.py: FP8AdamW's fused step against torch AdamW(fused=True)"
  timeout 45 python3 bench/bench_optimizer.py --time-only --device cuda > "$OUT/bench_optimizer.log" 2>&1
  rc=$?; record $rc bench_optimizer

  section "bench/bench_grouped.py: the MoE expert step against bf16 torch._grouped_mm (Mixtral, 16384 tokens)"
  timeout 60 python3 bench/bench_grouped.py --models mixtral --projs gate_up --tokens 16384 \
    --variants "bf16 grouped_mm,current,scaled_grouped_mm" --rounds 3 --iters 3 \
    --out "$OUT/results" > "$OUT/bench_grouped.log" 2>&1
  rc=$?; record $rc bench_grouped

  section "bench/bench_wire_casts.py: the FP8 reduce-scatter's casts against a copy (64 and 256 MiB)"
  timeout 30 python3 bench/bench_wire_casts.py --sizes-mb 64,256 --iters 10 \
    --out "$OUT/results" > "$OUT/bench_wire_casts.log" 2>&1
  rc=$?; record $rc bench_wire_casts

  section "table for bench/RESULTS.md"
  cat "$OUT/env.txt"
  echo; grep "^FP8AdamW step time" "$OUT/bench_optimizer.log"
  echo; echo "MoE expert step (bench/bench_grouped.py):"; grep -E "^Mixtral" "$OUT/bench_grouped.log"
  echo; echo "Host time of one layer step (bench/profile_linear.py):"
  grep -E "^== (bf16|current|delayed)(:python)? M=" "$OUT/profile_linear.log"
  echo; echo "GPU timeline of one step (bench/profile_linear.py --timeline 16384x8192x1280):"
  grep -E "^== timeline|^   span" "$OUT/profile_linear.log"
  echo; sed -n '/^| M |/,/^| geomean/p' "$OUT/results/linear.md" 2>/dev/null
  echo; echo "Demo, --size gpu, 60 steps:"; sed -n '/^| recipe |/,/^$/p' "$OUT/demo/results.md" 2>/dev/null
  echo; grep -E "^\| input MB|^\| ---|d2d copy|amax|quantize\+transpose|fused (delayed|current)" \
    "$OUT/results/cast.md" 2>/dev/null
  echo; sed -n '/^| gradient MiB/,$p' "$OUT/results/wire_casts.md" 2>/dev/null
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
  # --size gpu: the Llama-style model, 412.1M parameters, 8192 tokens a step: 6 x 412M x 8192 =
  # 2.0e13 FLOPs a step (attention adds under 10%), 50-100 ms on an H100 at 200-400 TFLOP/s bf16.
  # DEMO_STEPS=100 (the preset runs 300) keeps the six default recipes, with each one's model
  # setup and evaluation and the slower MXFP8 and blockwise steps, to about 4 minutes (an
  # estimate from those FLOPs, not a measurement). DEMO_RECIPES picks recipes (default: all six).
  section "examples/train_gpt.py --size gpu (Llama-style 412M; every recipe vs bf16: loss, tokens/s, peak memory)"
  timeout ${DEMO_TIMEOUT:-900} python3 examples/train_gpt.py --size gpu --steps ${DEMO_STEPS:-100} \
    ${DEMO_RECIPES:+--recipes "$DEMO_RECIPES"} --no-progress --out-dir "$OUT/demo" > "$OUT/demo.log" 2>&1
  rc=$?; tail -20 "$OUT/demo.log"; record $rc demo
fi

section "summary"
cat "$OUT/summary.txt"
if [ "$QUICK" = 1 ]; then  # one archive: the logs and result tables travel as one file
  tar czf "$OUT/logs.tar.gz" -C "$OUT" --exclude logs.tar.gz . 2>/dev/null
  [ -s "$OUT/logs.tar.gz" ] && find "$OUT" -mindepth 1 ! -name logs.tar.gz ! -name summary.txt -delete
fi
exit $status
