// Torch binding of the FP8 reduction's receiving end (block_sum.cu): argument checks (in the
// words of fp8ops/ops/block_sum.py), device guard, current stream, output.
#include <cmath>

#include "../block_sum.h"
#include "common.h"

namespace {
using namespace fp8ops_bind;

at::Tensor dequantize_sum_cuda(const at::Tensor& data, const at::Tensor& scale_inv, int64_t block_size,
                               double divisor, at::ScalarType out_dtype) {
  check_cuda(data, "data");
  FP8OPS_CHECK(data.dim() == 2 && (data.scalar_type() == at::kFloat8_e4m3fn || data.scalar_type() == at::kFloat8_e5m2),
               "fp8ops: dequantize_sum: data must be 2-D float8_e4m3fn or float8_e5m2, got ",
               dtype_str(data.scalar_type()), " ", shape_str(data));
  FP8OPS_CHECK(block_size > 0, "fp8ops: dequantize_sum: block_size must be positive, got ", block_size);
  const int64_t rows = data.size(0), cols = data.size(1), blocks = (cols + block_size - 1) / block_size;
  FP8OPS_CHECK(scale_inv.dim() == 2 && scale_inv.size(0) == rows && scale_inv.size(1) == blocks &&
                   scale_inv.scalar_type() == at::kFloat,
               "fp8ops: dequantize_sum: scale_inv must be float32 [", rows, ", ", blocks, "], got ",
               dtype_str(scale_inv.scalar_type()), " ", shape_str(scale_inv));
  check_same_device(data, scale_inv, "data", "scale_inv");
  FP8OPS_CHECK(std::isfinite(divisor) && divisor > 0, "fp8ops: dequantize_sum: divisor must be positive and "
               "finite, got ", divisor);
  FP8OPS_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
               "fp8ops: dequantize_sum: out_dtype must be float32, bfloat16 or float16, got ", dtype_str(out_dtype));
  c10::cuda::CUDAGuard guard(data.device());
  at::Tensor dc = data.contiguous(), sc = scale_inv.contiguous();
  at::Tensor out = at::empty({cols}, data.options().dtype(out_dtype));
  fp8ops::DequantizeSumParams p{};
  p.data = static_cast<const uint8_t*>(dc.data_ptr());
  p.data_dtype = to_dtype(dc.scalar_type());
  p.rows = rows;
  p.cols = cols;
  p.blocks = blocks;
  p.block_size = block_size;
  p.scale_inv = sc.data_ptr<float>();
  p.divisor = static_cast<float>(divisor);
  p.out = out.data_ptr();
  p.out_dtype = to_dtype(out_dtype);
  fp8ops::launch_dequantize_sum(p, stream_of(dc));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8ops, CUDA, m) { m.impl("dequantize_sum", &dequantize_sum_cuda); }
