// The per-group casts of a mixture-of-experts layer's activations and gradients: rows x [rows,
// cols] sorted by expert, offsets int32 [groups] the cumulative end row of each group (as
// torch._grouped_mm takes them). Each group's rows are cast with the group's scale, as the dense
// per-tensor cast casts a matrix; rows past the last group become zero bytes. The group sizes
// stay on the device: no host sync. Torch-free, as fp8ops.h.
#pragma once

#include "fp8ops.h"

namespace fp8ops {

struct GroupedCastParams {
  const void* x;
  DType x_dtype;
  int64_t rows, cols;
  const int32_t* offsets;  // device, [groups]; checked by the caller (a bad one stays in bounds)
  int64_t groups;
  DType out_dtype;  // kE4M3 or kE5M2
  uint8_t* data;    // [rows, cols]
  uint8_t* data_t;  // [cols, rows] or nullptr
  float* amax;      // device, [groups]: each group's max |x| (0 for an empty group)
  // the scales: given per group (delayed scaling), or nullptr: current scaling, each group's
  // scale_from_amax(amax[g], 1, fp8_max, margin, power_of_two), published with its reciprocal
  const float* scale;
  float fp8_max = 0.0f, margin = 1.0f;
  bool power_of_two = false;
  float* out_scale = nullptr;  // [groups] (current scaling)
  float* out_scale_inv = nullptr;
};
void launch_quantize_grouped(const GroupedCastParams& p, cudaStream_t stream);

}  // namespace fp8ops
