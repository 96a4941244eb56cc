// The FP8AdamW step of one parameter (fp8ops/ops/adamw.py is its definition): torch-free.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "fp8ops.h"

namespace fp8ops {

// How v is stored: sqrt(v) in E4M3 blocks, v in E5M2 blocks, or v in bfloat16 (no scale).
enum class SecondMoment : int { kSqrtE4M3, kE5M2, kBF16 };

struct AdamWParams {
  void* param;             // n values, float32 or bfloat16 (param_dtype), contiguous
  const void* grad;        // n values of param_dtype, contiguous
  DType param_dtype;
  int64_t n;
  uint8_t* m;              // E4M3 [blocks, 128], the tail of the last block zero
  float* m_scale_inv;      // [blocks]
  void* v;                 // E4M3 / E5M2 [blocks, 128], or bfloat16 [n]
  float* v_scale_inv;      // [blocks] (unused for bfloat16)
  SecondMoment second_moment;
  // float32 values of the step's scalars (docs/numerics.md, "FP8AdamW")
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias2_rsqrt, decay, l2;
  uint64_t seed, offset;   // the stochastic rounding stream of a bfloat16 param
};

void launch_adamw_step(const AdamWParams& p, cudaStream_t stream);

}  // namespace fp8ops
