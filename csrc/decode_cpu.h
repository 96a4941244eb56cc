// The FP8 readers of decode_cpu.cpp for the other CPU kernels (the GEMMs of gemm_cpu.cpp): both
// operands of a GEMM in one parallel region. Each result says, per operand, whether it was
// decoded (false: it holds a NaN byte, its output is partly written, and the caller converts it
// as the emulation does).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

namespace fp8ops_cpu {

// a_out = float32 of a, b_out = float32 of b (each dense, its output of its sizes and strides).
std::pair<bool, bool> decode_fp8_pair(const at::Tensor& a, const at::Tensor& a_out,
                                      const at::Tensor& b, const at::Tensor& b_out);

// emulation._dequantize_mx_f32 of 2-D a and b (any strides) with E8M0 scales along their rows,
// into contiguous float32 outputs.
std::pair<bool, bool> dequantize_mx_pair(const at::Tensor& a, const at::Tensor& a_scales,
                                         const at::Tensor& a_out, const at::Tensor& b,
                                         const at::Tensor& b_scales, const at::Tensor& b_out,
                                         int64_t block_size);

}  // namespace fp8ops_cpu
