// The FP8AdamW step of one parameter, or of a list of them in one launch (fp8ops/ops/adamw.py is
// its definition): torch-free.
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

// One parameter of a multi-tensor step: AdamWParams' tensors (the scalars are in the tables of
// AdamWMultiParams) and where its blocks start in the launch.
struct AdamWTensor {
  void* param;
  const void* grad;
  uint8_t* m;
  float* m_scale_inv;
  void* v;
  float* v_scale_inv;   // nullptr for a bfloat16 v
  int64_t n;
  int64_t first_block;  // the blocks of the tensors before it: a non-decreasing prefix sum
};

constexpr int kAdamWScalars = 9;  // beta1 ... l2, in AdamWParams' order

// Tensors sharing one param dtype and one second-moment format, stepped in one launch; every
// pointer is to device memory.
struct AdamWMultiParams {
  const AdamWTensor* tensors;  // [count]
  const float* scalars;        // [count, kAdamWScalars]: each tensor's float scalars
  const int64_t* rng;          // [count, 2]: each tensor's seed and offset
  int64_t count;
  int64_t total_blocks;        // the blocks of all tensors
  DType param_dtype;
  SecondMoment second_moment;
};

void launch_adamw_step_multi(const AdamWMultiParams& p, cudaStream_t stream);

}  // namespace fp8ops
