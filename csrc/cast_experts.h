// The per-tensor casts of a mixture-of-experts weight [E, rows, cols]: each expert's matrix cast
// as launch_amax / launch_quantize cast one matrix, its bytes the same, all experts in one launch
// (blockIdx.y). Torch-free, as fp8ops.h.
#pragma once

#include "fp8ops.h"

namespace fp8ops {

// amax[e] = max |x[e]| for the E matrices of p.n elements each, one after another from p.x
// (0 for empty matrices); p.amax has E elements.
void launch_amax_experts(const AmaxParams& p, int64_t experts, cudaStream_t stream);

// Matrix e of p.n elements (p.cols columns) cast into data + e * n (and data_t + e * n, its
// [cols, rows] transpose), with scale[e] given, or with scale_from_amax(scale_amax[e]) published
// to out_scale[e] / out_scale_inv[e]; amax[e] (when given) receives its max |x|. Round to
// nearest only: no stochastic rounding, no via, no delayed-scaling recording. p.n > 0.
void launch_quantize_experts(const QuantizeParams& p, int64_t experts, cudaStream_t stream);

}  // namespace fp8ops
