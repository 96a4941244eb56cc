#!/usr/bin/env bash
# Make .venv/ with everything fp8ops needs and build fp8ops into it (the CUDA extension too when
# nvcc is present; FP8OPS_SKIP_CUDA_BUILD=1 skips it). Safe to run again: it only adds what lacks.
# --cuda-if-gpu (the demo): build the CUDA extension only where a CUDA GPU is visible; on a
# CPU-only machine its CUTLASS GEMMs would be most of the build time, for kernels nothing runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check "torch==2.14.1" numpy ml_dtypes pytest matplotlib tqdm ninja setuptools wheel \
  "transformers==5.24.0" "accelerate==1.15.0" "compressed-tensors==0.20.1"
pip install -q --disable-pip-version-check --no-deps "nvidia-cutlass==4.2.0.0"  # headers only
pip install -q --disable-pip-version-check --no-deps "torchao==0.18.0"  # the demo's torchao MoE recipes
# fp8ops.integrations.torchtitan's tests; without its pins on datasets and huggingface_hub (they
# would downgrade transformers' huggingface_hub), with the packages its trainer imports
pip install -q --disable-pip-version-check --no-deps "torchtitan==0.3.0"
pip install -q --disable-pip-version-check "tyro==1.0.17" "spmd_types==0.2.3" "torchdata==0.11.0" \
  "tensorboard==2.21.0" "datasets==5.2.0"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
mkdir -p build
# The editable install serves Python changes live; rebuild only when the C++/CUDA sources, the
# build files or the build switches changed since the last successful build.
sources=$(cat setup.py pyproject.toml $(find csrc -type f | LC_ALL=C sort) | sha256sum | cut -c1-16)
stamp_for() { echo "$sources-$1-${FP8OPS_SKIP_CPU_BUILD:-0}-${CUDA_HOME:-}"; }  # $1: skip CUDA
built() { ls fp8ops/_C*.so fp8ops/_cpu*.so fp8ops/_step*.so 2>/dev/null || true; }  # the built extensions
so_count() { built | wc -l; }
built_as() { [ "$(cat build/.stamp 2>/dev/null)" = "$(stamp_for "$1")-$(so_count)" ]; }
gpu_visible() { python -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; }
serves=false  # whether the last build serves this call as it is
if [ "${1:-}" = "--cuda-if-gpu" ] && [ -z "${FP8OPS_SKIP_CUDA_BUILD:-}" ] && ! gpu_visible; then
  # a build with the CUDA extension (scripts/test.sh's) serves the demo too
  built_as 0 && serves=true
  export FP8OPS_SKIP_CUDA_BUILD=1
  echo "fp8ops: no CUDA GPU visible: the CUDA extension is not needed here (scripts/test.sh builds it)"
fi
built_as "${FP8OPS_SKIP_CUDA_BUILD:-0}" && serves=true
if $serves && python -c "import fp8ops" 2>/dev/null; then
  echo "fp8ops: build is up to date ($(built | xargs echo) $([ "$(so_count)" -gt 0 ] || echo 'pure Python'))"
  exit 0
fi
echo "fp8ops: building (MAX_JOBS=$MAX_JOBS; log in build/setup.log)"
start=$(date +%s)
if ! pip install --disable-pip-version-check --no-build-isolation --no-deps -e . > build/setup.log 2>&1; then
  tail -n 60 build/setup.log
  echo "fp8ops: build failed (full log: build/setup.log)" >&2
  exit 1
fi
echo "$(stamp_for "${FP8OPS_SKIP_CUDA_BUILD:-0}")-$(so_count)" > build/.stamp
echo "fp8ops: built in $(( $(date +%s) - start )) s; extensions: $(built | xargs echo) $([ "$(so_count)" -gt 0 ] || echo 'none (pure Python)')"
