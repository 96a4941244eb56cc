// The emulation's CPU kernels (csrc/*_cpu.cpp), registered by bindings_cpu.cpp as fp8ops_cpu ops.
// Each gives the same bytes as the pure-PyTorch code in fp8ops/ops/emulation.py that it replaces.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>

namespace fp8ops_cpu {

// emulation._stochastic_fp8 of y * scale (float32 multiply; y contiguous float32): the FP8 data,
// y's shape; the random word of flat element i from the stream (seed, offset), each given as its
// 32-bit halves (a schema int is int64; seeds use all 64 bits).
at::Tensor stochastic_round_cpu(const at::Tensor& y, at::ScalarType dtype, int64_t seed_lo,
                                int64_t seed_hi, int64_t offset_lo, int64_t offset_hi,
                                double scale);

// (data, scales) of emulation.quantize_mx for a contiguous float32 / bfloat16 / float16 x.
std::tuple<at::Tensor, at::Tensor> quantize_mx_cpu(const at::Tensor& x, at::ScalarType dtype,
                                                   int64_t block_size, int64_t axis, bool rceil);

// The blockwise quantizer's two full-size passes over a contiguous float32 x [R, C] with tiles of
// [block_rows, block_cols] (partial at the edges): each tile's max |x| ([Rb, Cb] float32), and
// the FP8 cast of each element times its tile's multiplier mult [Rb, Cb] (clamped to +-max).
at::Tensor tile_amax_cpu(const at::Tensor& x, int64_t block_rows, int64_t block_cols);
at::Tensor cast_tiles_cpu(const at::Tensor& x, const at::Tensor& mult, int64_t block_rows,
                          int64_t block_cols, at::ScalarType dtype);

// emulation._quantize_blockwise_2d of a contiguous float32 x [R, C] whole: (data, scale_inv per
// tile), the tile scales as emulation.blockwise_scales gives them.
std::tuple<at::Tensor, at::Tensor> quantize_tiles_cpu(const at::Tensor& x, at::ScalarType dtype,
                                                      int64_t block_rows, int64_t block_cols,
                                                      bool power_of_two);

// fused.quantize_blockwise_pair of a contiguous float32 x [M, K] but the column sums: (data
// [M, K], scale_inv [M, K / 128 blocks], data_t [K, M], scale_inv_t [K, M / 128 blocks]), both
// scale tensors with their rows contiguous (fused.mn_major).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_blockwise_pair_cpu(
    const at::Tensor& x, at::ScalarType dtype, bool power_of_two);

// max |x| of a contiguous float32 x (0-d float32; 0 for an empty x). Some NaN when x holds one
// (emulation._abs_max then takes torch's amax for its payload).
at::Tensor abs_max_cpu(const at::Tensor& x);

// emulation.quantize's cast of a contiguous float32 x by a float32 scale, round to nearest:
// (data, data_t: the transpose of data's 2-D view [rows, last dim], or an empty [0]).
std::tuple<at::Tensor, at::Tensor> cast_scaled_cpu(const at::Tensor& x, double scale,
                                                   at::ScalarType dtype, bool transpose);

// FP8 data -> float32 into out (data's sizes and strides; data dense): false, with out partly
// written, when data holds a NaN byte (the caller then takes torch's conversion).
bool decode_fp8_cpu(const at::Tensor& data, const at::Tensor& out);

// emulation._dequantize_mx_f32 of 2-D data (any strides) with E8M0 scales along its rows into a
// contiguous float32 out: false when data holds a NaN byte, as decode_fp8.
bool dequantize_mx_cpu(const at::Tensor& data, const at::Tensor& scales, int64_t block_size,
                       const at::Tensor& out);

// The contiguous transpose of 2-D one-byte data (any strides).
at::Tensor transpose_bytes_cpu(const at::Tensor& data);

// The emulation's GEMMs without the final conversion to out_dtype (gemm_cpu.cpp): a [M, K] times
// b [N, K]^T from their FP8 bytes, read into af and bf (their sizes and strides), bias (any float
// dtype, [N]) added in float32.
// emulation.gemm: a new float32 [M, N], (a @ b^T) * alpha + bias.
at::Tensor gemm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& alpha,
                    const c10::optional<at::Tensor>& bias, const at::Tensor& af,
                    const at::Tensor& bf);
// emulation.gemm_blockwise into acc (contiguous float32 [M, N]), the K blocks' partial sums in
// groups of part.size(0) in part ([G, M, N]): false, with nothing promised about acc, when a scale
// is NaN or an operand holds a NaN byte (the caller then runs the tensor code).
bool gemm_blockwise_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                        const at::Tensor& b_scale_inv, const c10::optional<at::Tensor>& bias,
                        const at::Tensor& acc, const at::Tensor& af, const at::Tensor& bf,
                        const at::Tensor& part);
// emulation.gemm_mx into acc, the dequantized operands in ad and bd (contiguous float32): false
// when an operand holds a NaN byte, as gemm_blockwise.
bool gemm_mx_cpu(const at::Tensor& a, const at::Tensor& a_scales, const at::Tensor& b,
                 const at::Tensor& b_scales, int64_t block_size, const c10::optional<at::Tensor>& bias,
                 const at::Tensor& acc, const at::Tensor& ad, const at::Tensor& bd);

// emulation.cast_stats of a 2-D x and its FP8 data (any strides; data at least x's shape): the
// counts (saturated, underflow, non-finite) and amax, in one pass.
std::tuple<at::Tensor, at::Tensor> cast_stats_cpu(const at::Tensor& x, const at::Tensor& data,
                                                  const at::Tensor& scale_inv, int64_t block_rows,
                                                  int64_t block_cols);

}  // namespace fp8ops_cpu
