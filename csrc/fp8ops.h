// fp8ops kernel API: torch-free. Plain parameter structs (pointers, sizes, strides) and launch_*()
// functions; every launch runs on the given stream and throws std::runtime_error on a CUDA error.
// The only torch-aware C++ is torch_bindings.cpp. Numerics: DESIGN.md sections 3-5, with
// fp8ops/_emulation.py as the bit-exact reference.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace fp8ops {

enum class DType : int { kFloat32, kBFloat16, kFloat16, kE4M3, kE5M2, kUInt8 };

// ---- cast kernels (cast.cu) -------------------------------------------------------------------
// amax = max |x| over n contiguous elements, written as float32 to *amax (NaN if any NaN,
// 0 for n == 0).
struct AmaxParams {
  const void* x;
  DType x_dtype;
  int64_t n;
  float* amax;  // device, 1 element
};
void launch_amax(const AmaxParams& p, cudaStream_t stream);

// ==== BEGIN cast kernels (issue 3) ====
// ==== END cast kernels ====

// ==== BEGIN gemm (issue 4) ====
// ==== END gemm ====

}  // namespace fp8ops
