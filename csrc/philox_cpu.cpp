// CPU kernel for the emulation's stochastic rounding: the uniforms u = (r >> 8) * 2^-24 of the
// Philox random words r (DESIGN.md section 4). fp8ops._emulation computes the same words in int64
// tensor arithmetic, about sixty passes over memory; here one pass, from the Philox code the CUDA
// kernels run. Built by a plain C++ compiler into fp8ops._cpu (no CUDA toolkit needed); the
// emulation uses it when it is built and keeps its own tensor code otherwise.
#include <ATen/Parallel.h>

#include <algorithm>

#include "cpu_clones.h"
#include "kernels_cpu.h"
#include "philox.h"

namespace fp8ops_cpu {
namespace {

// p[4j .. 4j+3] = the uniforms of Philox block j, for j in [j0, j1); (r >> 8) * 2^-24 is exact.
FP8OPS_CPU_CLONES void uniform24_blocks(float* p, int64_t j0, int64_t j1, uint64_t seed,
                                        uint64_t offset) {
  for (int64_t j = j0; j < j1; ++j) {
    const fp8ops::PhiloxBlock r = fp8ops::philox_block(j, seed, offset);
    p[4 * j] = float(r.x >> 8) * 0x1p-24f;
    p[4 * j + 1] = float(r.y >> 8) * 0x1p-24f;
    p[4 * j + 2] = float(r.z >> 8) * 0x1p-24f;
    p[4 * j + 3] = float(r.w >> 8) * 0x1p-24f;
  }
}

}  // namespace

// out (float32, contiguous, CPU): out[i] = uniform of flat element i of the stream (seed, offset),
// each given as its low and high 32-bit halves (a schema int is int64; seeds use all 64 bits).
void philox_uniform24_cpu(at::Tensor out, int64_t seed_lo, int64_t seed_hi, int64_t offset_lo,
                          int64_t offset_hi) {
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "philox_uniform24_: out must be a contiguous float32 CPU tensor");
  for (int64_t h : {seed_lo, seed_hi, offset_lo, offset_hi})
    TORCH_CHECK(h >= 0 && h <= 0xFFFFFFFFll, "philox_uniform24_: seed and offset halves are 32-bit");
  const uint64_t seed = uint64_t(seed_lo) | uint64_t(seed_hi) << 32;
  const uint64_t offset = uint64_t(offset_lo) | uint64_t(offset_hi) << 32;
  float* p = out.data_ptr<float>();
  const int64_t n = out.numel();
  // 2048 blocks (8192 elements) per task: ~20 us of work, far above a task's scheduling cost
  at::parallel_for(0, (n + 3) / 4, 2048, [&](int64_t b0, int64_t b1) {
    const int64_t full = std::min(b1, n / 4);  // blocks whose four elements all exist
    if (b0 < full) uniform24_blocks(p, b0, full, seed, offset);
    for (int64_t j = std::max(b0, full); j < b1; ++j) {  // the last, partial block
      const fp8ops::PhiloxBlock r = fp8ops::philox_block(j, seed, offset);
      const uint32_t w[4] = {r.x, r.y, r.z, r.w};
      for (int64_t k = 0; k < n - 4 * j; ++k) p[4 * j + k] = float(w[k] >> 8) * 0x1p-24f;
    }
  });
}

}  // namespace fp8ops_cpu
