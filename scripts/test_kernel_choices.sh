#!/usr/bin/env bash
# Run pytest once per CPU kernel choice this machine can force: ATen's vector width, oneDNN's and
# MKL's instruction sets, MKL's conditional numerical reproducibility and the thread count. A
# test that holds the digits of a whole run passes only if it passes under all of them, as it
# must on another CPU. Extra args go to pytest (default: the tests that train whole runs).
#   bash scripts/test_kernel_choices.sh                        # the default selection
#   bash scripts/test_kernel_choices.sh tests/test_modules.py  # any pytest arguments
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh >/dev/null || exit 1
if [ $# -eq 0 ]; then
  set -- tests/test_examples.py tests/test_modules.py tests/test_step.py tests/test_hf.py \
    tests/test_hf_moe.py tests/test_grouped.py tests/test_distributed.py tests/test_fsdp_fp8.py
fi
choices=(
  "ATEN_CPU_CAPABILITY=default" "ATEN_CPU_CAPABILITY=avx2" "ATEN_CPU_CAPABILITY=avx512"
  "ONEDNN_MAX_CPU_ISA=SSE41" "ONEDNN_MAX_CPU_ISA=AVX512_CORE"
  "MKL_ENABLE_INSTRUCTIONS=SSE4_2" "MKL_ENABLE_INSTRUCTIONS=AVX512" "MKL_CBWR=COMPATIBLE"
  "OMP_NUM_THREADS=1" "OMP_NUM_THREADS=2" "OMP_NUM_THREADS=4"
)
# torch.compile's on-disk cache does not key its kernels by ATEN_CPU_CAPABILITY: a kernel built
# for one vector width and loaded under another reads and writes the wrong number of lanes
# (wrong results, a corrupted heap). Each choice gets a cache of its own.
caches=$(mktemp -d)
trap 'rm -rf "$caches"' EXIT
failed=()
for choice in "${choices[@]}"; do
  echo "== $choice"
  if ! env "$choice" TORCHINDUCTOR_CACHE_DIR="$caches/${choice//[^A-Za-z0-9]/_}" \
      .venv/bin/python -m pytest -q -p no:cacheprovider -x "$@" | tail -n 3; then
    failed+=("$choice")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed under: ${failed[*]}" >&2
  exit 1
fi
echo "passed under every kernel choice (${#choices[@]})"
