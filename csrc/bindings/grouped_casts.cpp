// Torch bindings of the per-group casts of rows sorted by expert (cast_grouped.h):
// quantize_current_grouped and quantize_scaled_grouped on CUDA. Their meaning is
// fp8ops/ops/emulation_grouped.py's, whose bytes they equal; the offsets' values are checked as
// the emulation checks them on CUDA, with an asynchronous device assert (no host sync).
#include "common.h"

#include "../cast_grouped.h"

namespace {
using namespace fp8ops_bind;

void check_rows(const at::Tensor& x, const at::Tensor& offsets, at::ScalarType dtype, const char* op) {
  check_input(x, "x");
  FP8OPS_CHECK(x.dim() == 2, "fp8ops.", op, ": x must be 2-D [rows, cols], got shape ", shape_str(x));
  check_cuda(offsets, "offsets");
  check_same_device(offsets, x, "offsets", "x");
  FP8OPS_CHECK(offsets.scalar_type() == at::kInt && offsets.dim() == 1, "fp8ops.", op,
               ": offsets must be a 1-D int32 tensor, got ", dtype_str(offsets.scalar_type()), " ", shape_str(offsets));
  FP8OPS_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, "fp8ops.", op,
               ": dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ", dtype_str(dtype));
  const int64_t groups = offsets.size(0);
  if (groups == 0) return;
  at::Tensor ok = offsets[0].ge(0).logical_and(offsets[groups - 1].le(x.size(0)));
  if (groups > 1) ok = ok.logical_and(offsets.slice(0, 1).ge(offsets.slice(0, 0, groups - 1)).all());
  at::_assert_async(ok, fp8ops_bind::cat("fp8ops: ", op, ": offsets must be non-negative, non-decreasing and at most the ",
                                         x.size(0), " rows of the input"));
}

struct GroupedOut {
  at::Tensor data, data_t, amax;
  fp8ops::GroupedCastParams p;
};

GroupedOut grouped_cast(const at::Tensor& xc, const at::Tensor& offsets, at::ScalarType dtype, bool transpose) {
  const auto opts = xc.options();
  GroupedOut o;
  o.data = at::empty(xc.sizes(), opts.dtype(dtype));
  o.data_t = at::empty(transpose ? std::vector<int64_t>{xc.size(1), xc.size(0)} : std::vector<int64_t>{0},
                       opts.dtype(dtype));
  o.amax = at::empty({offsets.size(0)}, opts.dtype(at::kFloat));
  fp8ops::GroupedCastParams& p = o.p;
  p.x = xc.data_ptr();
  p.x_dtype = to_dtype(xc.scalar_type());
  p.rows = xc.size(0);
  p.cols = xc.size(1);
  p.offsets = offsets.data_ptr<int32_t>();
  p.groups = offsets.size(0);
  p.out_dtype = to_dtype(dtype);
  p.data = static_cast<uint8_t*>(o.data.data_ptr());
  p.data_t = transpose ? static_cast<uint8_t*>(o.data_t.data_ptr()) : nullptr;
  p.amax = o.amax.data_ptr<float>();
  return o;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_current_grouped_cuda(
    const at::Tensor& x, const at::Tensor& offsets, at::ScalarType dtype, double margin, bool power_of_two,
    bool transpose) {
  check_rows(x, offsets, dtype, "quantize_current_grouped");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous(), oc = offsets.contiguous();
  GroupedOut o = grouped_cast(xc, oc, dtype, transpose);
  at::Tensor scale = at::empty({oc.size(0)}, xc.options().dtype(at::kFloat)), scale_inv = at::empty_like(scale);
  o.p.scale = nullptr;
  o.p.fp8_max = fp8_max_of(dtype);
  o.p.margin = static_cast<float>(margin);
  o.p.power_of_two = power_of_two;
  o.p.out_scale = scale.data_ptr<float>();
  o.p.out_scale_inv = scale_inv.data_ptr<float>();
  fp8ops::launch_quantize_grouped(o.p, stream_of(xc));
  return {o.data, o.data_t, scale, scale_inv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_scaled_grouped_cuda(const at::Tensor& x,
                                                                            const at::Tensor& offsets,
                                                                            const at::Tensor& scale,
                                                                            at::ScalarType dtype, bool transpose) {
  check_rows(x, offsets, dtype, "quantize_scaled_grouped");
  check_cuda(scale, "scale");
  check_same_device(scale, x, "scale", "x");
  FP8OPS_CHECK(scale.dim() == 1 && scale.size(0) == offsets.size(0) && scale.is_floating_point(),
               "fp8ops.quantize_scaled_grouped: scale must be a floating tensor of shape (", offsets.size(0),
               ",), got ", dtype_str(scale.scalar_type()), " ", shape_str(scale));
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous(), oc = offsets.contiguous(), s = scale.to(at::kFloat).contiguous();
  GroupedOut o = grouped_cast(xc, oc, dtype, transpose);
  o.p.scale = s.data_ptr<float>();
  fp8ops::launch_quantize_grouped(o.p, stream_of(xc));
  return {o.data, o.data_t, o.amax};
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8ops, CUDA, m) {
  m.impl("quantize_current_grouped", &quantize_current_grouped_cuda);
  m.impl("quantize_scaled_grouped", &quantize_scaled_grouped_cuda);
}
