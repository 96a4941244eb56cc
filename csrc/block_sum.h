// The sum of FP8 blocks at the receiving end of an FP8 reduction (fp8ops/ops/block_sum.py is its
// definition): torch-free.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "fp8ops.h"

namespace fp8ops {

// out[i] = (sum over r, in order, of data[r, i] * scale_inv[r, i / block_size]) / divisor, in
// float32 arithmetic, rounded once to out_dtype. data [rows, cols] FP8 and scale_inv [rows,
// blocks] float32, both contiguous.
struct DequantizeSumParams {
  const uint8_t* data;
  DType data_dtype;
  int64_t rows, cols, blocks, block_size;
  const float* scale_inv;
  float divisor;
  void* out;
  DType out_dtype;
};
void launch_dequantize_sum(const DequantizeSumParams& p, cudaStream_t stream);

}  // namespace fp8ops
