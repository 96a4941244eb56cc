// The receiving end of a reduction that travels in FP8 blocks (fp8ops.distributed.wire): R rows
// of FP8 data, each with one float32 scale_inv per block of block_size contiguous elements, are
// decoded and summed in row order in float32, divided, and written in the output dtype. One read
// of each byte, one write of each output; bit-exact with fp8ops/ops/block_sum.py.
#include "block_sum.h"
#include "common.cuh"

namespace fp8ops {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

template <Fp8 F, typename T>
__global__ void __launch_bounds__(kThreads) dequantize_sum_kernel(DequantizeSumParams p) {
  T* __restrict__ out = static_cast<T*>(p.out);
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < p.cols; i += stride) {
    const int64_t b = i / p.block_size;
    float acc = 0.0f;
    for (int64_t r = 0; r < p.rows; ++r)  // in row (rank) order: the sum is the same on every run
      acc = __fadd_rn(acc, __fmul_rn(fp8_to_float<F>(p.data[r * p.cols + i]), p.scale_inv[r * p.blocks + b]));
    if (p.divisor != 1.0f) acc = __fdiv_rn(acc, p.divisor);
    out[i] = from_float<T>(acc);
  }
}

}  // namespace

void launch_dequantize_sum(const DequantizeSumParams& p, cudaStream_t stream) {
  if (p.cols == 0) return;
  dispatch_fp8(p.data_dtype, [&](auto fmt) {
    constexpr Fp8 F = decltype(fmt)::value;
    dispatch_input(p.out_dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      launch_kernel(dequantize_sum_kernel<F, T>, grid_for(p.cols, kThreads, kMaxBlocks), kThreads, stream, p);
    });
  });
}

}  // namespace fp8ops
