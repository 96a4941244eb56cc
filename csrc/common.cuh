// Shared device helpers for the fp8ops kernels: error checks, format traits, conversions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "fp8ops.h"

#define FP8OPS_CUDA_CHECK(expr)                                                              \
  do {                                                                                       \
    cudaError_t err_ = (expr);                                                               \
    if (err_ != cudaSuccess)                                                                 \
      throw std::runtime_error(std::string("fp8ops CUDA error: ") + cudaGetErrorString(err_) + \
                               " at " __FILE__ ":" + std::to_string(__LINE__) + ": " #expr); \
  } while (0)

// After a <<<...>>> launch: catches bad configurations (the launch itself is asynchronous).
#define FP8OPS_CHECK_LAUNCH() FP8OPS_CUDA_CHECK(cudaGetLastError())

namespace fp8ops {

// Input element -> float32 (exact for all three input types).
template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

// |v| as ordered bits: for non-negative floats (NaN included, sign cleared) unsigned comparison
// of the bit patterns orders like the values and puts NaN above +inf, so atomicMax on the bits
// is a NaN-propagating float max.
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

template <typename T>
struct Type {
  using type = T;
};

// Calls f(Type<T>{}) with T the C++ type of an input dtype (float, bf16, half).
template <typename F>
void dispatch_input(DType dt, F&& f) {
  switch (dt) {
    case DType::kFloat32: f(Type<float>{}); break;
    case DType::kBFloat16: f(Type<__nv_bfloat16>{}); break;
    case DType::kFloat16: f(Type<__half>{}); break;
    default: throw std::invalid_argument("fp8ops: input must be float32, bfloat16 or float16");
  }
}

inline int grid_for(int64_t n, int threads, int max_blocks = 65535) {
  int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 1 ? 1 : (b > max_blocks ? max_blocks : b));
}

}  // namespace fp8ops
