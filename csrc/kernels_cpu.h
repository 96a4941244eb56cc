// The emulation's CPU kernels (csrc/*_cpu.cpp), registered by bindings_cpu.cpp as fp8ops_cpu ops.
// Each gives the same bytes as the pure-PyTorch code in fp8ops/ops/emulation.py that it replaces.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace fp8ops_cpu {

// emulation._stochastic_fp8 of a contiguous float32 y (already scaled): the FP8 data, y's shape;
// the random word of flat element i from the stream (seed, offset), each given as its 32-bit
// halves (a schema int is int64; seeds use all 64 bits).
at::Tensor stochastic_round_cpu(const at::Tensor& y, at::ScalarType dtype, int64_t seed_lo,
                                int64_t seed_hi, int64_t offset_lo, int64_t offset_hi);

// (data, scales) of emulation.quantize_mx for a contiguous float32 / bfloat16 / float16 x.
std::tuple<at::Tensor, at::Tensor> quantize_mx_cpu(const at::Tensor& x, at::ScalarType dtype,
                                                   int64_t block_size, int64_t axis, bool rceil);

// The blockwise quantizer's two full-size passes over a contiguous float32 x [R, C] with tiles of
// [block_rows, block_cols] (partial at the edges): each tile's max |x| ([Rb, Cb] float32), and
// the FP8 cast of each element times its tile's multiplier mult [Rb, Cb] (clamped to +-max).
at::Tensor tile_amax_cpu(const at::Tensor& x, int64_t block_rows, int64_t block_cols);
at::Tensor cast_tiles_cpu(const at::Tensor& x, const at::Tensor& mult, int64_t block_rows,
                          int64_t block_cols, at::ScalarType dtype);

// emulation.cast_stats of a 2-D x and its FP8 data (any strides; data at least x's shape): the
// counts (saturated, underflow, non-finite) and amax, in one pass.
std::tuple<at::Tensor, at::Tensor> cast_stats_cpu(const at::Tensor& x, const at::Tensor& data,
                                                  const at::Tensor& scale_inv, int64_t block_rows,
                                                  int64_t block_cols);

}  // namespace fp8ops_cpu
