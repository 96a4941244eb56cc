// CPU kernel for the emulation's stochastic rounding: the uniforms u = (r >> 8) * 2^-24 of the
// Philox random words r (DESIGN.md section 4). fp8ops._emulation computes the same words in int64
// tensor arithmetic, about sixty passes over memory; here one pass, from the Philox code the CUDA
// kernels run. Built by a plain C++ compiler into fp8ops._cpu (no CUDA toolkit needed); the
// emulation uses it when it is built and keeps its own tensor code otherwise.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "philox.h"

namespace {

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
  const int64_t blocks = (n + 3) / 4;
  // 2048 blocks (8192 elements) per task: ~20 us of work, far above a task's scheduling cost
  at::parallel_for(0, blocks, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t j = b0; j < b1; ++j) {
      const fp8ops::PhiloxBlock r = fp8ops::philox_block(j, seed, offset);
      const uint32_t w[4] = {r.x, r.y, r.z, r.w};
      const int64_t i = 4 * j, m = n - i < 4 ? n - i : 4;
      for (int64_t k = 0; k < m; ++k) p[i + k] = float(w[k] >> 8) * 0x1p-24f;  // both exact
    }
  });
}

}  // namespace

TORCH_LIBRARY(fp8ops_cpu, m) {
  m.def("philox_uniform24_(Tensor(a!) out, int seed_lo, int seed_hi, int offset_lo, int offset_hi) -> ()");
}

TORCH_LIBRARY_IMPL(fp8ops_cpu, CPU, m) { m.impl("philox_uniform24_", &philox_uniform24_cpu); }

// Importing the module loads the library, whose static initializers register the op above.
extern "C" PyObject* PyInit__cpu(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
