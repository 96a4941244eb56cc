// Torch bindings of the experts' weight casts (cast_experts.h): a weight [E, rows, cols] cast
// expert by expert with per-tensor scales, every expert in one launch. Their meaning is
// fp8ops/ops/expert_casts.py's loop of the dense ops, whose bytes they equal.
#include "common.h"

#include "../cast_experts.h"

namespace {
using namespace fp8ops_bind;

void check_experts(const at::Tensor& w, at::ScalarType dtype, const char* op) {
  check_input(w, "w");
  FP8OPS_CHECK(w.dim() == 3, "fp8ops.", op, ": the experts' weight must be 3-D [experts, out, in], got shape ",
               shape_str(w));
  FP8OPS_CHECK(w.size(0) <= 65535, "fp8ops.", op, ": at most 65535 experts, got ", w.size(0));
  FP8OPS_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, "fp8ops.", op,
               ": dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ", dtype_str(dtype));
}

// data [E, rows, cols] and data^T [E, cols, rows] (an empty [0] without transpose).
std::pair<at::Tensor, at::Tensor> expert_outputs(const at::Tensor& wc, at::ScalarType dtype, bool transpose) {
  const auto opts = wc.options().dtype(dtype);
  at::Tensor data = at::empty(wc.sizes(), opts);
  at::Tensor data_t = transpose ? at::empty({wc.size(0), wc.size(2), wc.size(1)}, opts) : at::empty({0}, opts);
  return {data, data_t};
}

fp8ops::QuantizeParams expert_params(const at::Tensor& wc, at::ScalarType dtype, const at::Tensor& data,
                                     const at::Tensor& data_t, bool transpose) {
  fp8ops::QuantizeParams p{};
  p.x = wc.data_ptr();
  p.x_dtype = to_dtype(wc.scalar_type());
  p.n = wc.size(1) * wc.size(2);
  p.cols = wc.size(2);
  p.out_dtype = to_dtype(dtype);
  p.data = static_cast<uint8_t*>(data.data_ptr());
  p.data_t = transpose ? static_cast<uint8_t*>(data_t.data_ptr()) : nullptr;
  return p;
}

at::Tensor amax_experts_into(const at::Tensor& wc, const at::Tensor& out) {
  fp8ops::launch_amax_experts({wc.data_ptr(), to_dtype(wc.scalar_type()), wc.size(1) * wc.size(2),
                               out.data_ptr<float>()},
                              wc.size(0), stream_of(wc));
  return out;
}

at::Tensor amax_experts_cuda(const at::Tensor& w) {
  check_input(w, "w");
  FP8OPS_CHECK(w.dim() == 3, "fp8ops.amax_experts: the experts' weight must be 3-D, got shape ", shape_str(w));
  FP8OPS_CHECK(w.size(0) <= 65535, "fp8ops.amax_experts: at most 65535 experts, got ", w.size(0));
  c10::cuda::CUDAGuard guard(w.device());
  at::Tensor wc = w.contiguous();
  return amax_experts_into(wc, at::empty({w.size(0)}, wc.options().dtype(at::kFloat)));
}

// Current scaling per expert: the amaxes, then one cast launch that takes each expert's scale
// from its amax and publishes it (and its reciprocal), as quantize_current casts one matrix.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_experts_current_cuda(
    const at::Tensor& w, at::ScalarType dtype, double margin, bool power_of_two, bool transpose) {
  check_experts(w, dtype, "quantize_experts_current");
  FP8OPS_CHECK(w.numel() > 0, "fp8ops.quantize_experts_current: empty experts take the emulation's loop");
  c10::cuda::CUDAGuard guard(w.device());
  at::Tensor wc = w.contiguous();
  const auto f32 = wc.options().dtype(at::kFloat);
  at::Tensor amax = amax_experts_into(wc, at::empty({w.size(0)}, f32));
  at::Tensor scale = at::empty({w.size(0)}, f32), scale_inv = at::empty({w.size(0)}, f32);
  auto [data, data_t] = expert_outputs(wc, dtype, transpose);
  fp8ops::QuantizeParams p = expert_params(wc, dtype, data, data_t, transpose);
  take_scale_from_amax(p, amax, dtype, margin, power_of_two, scale, scale_inv);
  fp8ops::launch_quantize_experts(p, w.size(0), stream_of(wc));
  return {data, data_t, scale, scale_inv};
}

// Each expert cast with its given scale [E] (delayed scaling); amax [E] of each expert's values.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_experts_scaled_cuda(const at::Tensor& w,
                                                                            const at::Tensor& scale,
                                                                            at::ScalarType dtype, bool transpose) {
  check_experts(w, dtype, "quantize_experts_scaled");
  FP8OPS_CHECK(w.numel() > 0, "fp8ops.quantize_experts_scaled: empty experts take the emulation's loop");
  check_cuda(scale, "scale");
  check_same_device(scale, w, "scale", "w");
  FP8OPS_CHECK(scale.dim() == 1 && scale.size(0) == w.size(0) && scale.is_floating_point(),
               "fp8ops.quantize_experts_scaled: scale must be a floating tensor of shape (", w.size(0),
               ",), got ", dtype_str(scale.scalar_type()), " ", shape_str(scale));
  c10::cuda::CUDAGuard guard(w.device());
  at::Tensor wc = w.contiguous(), s = scale.to(at::kFloat).contiguous();
  at::Tensor amax = at::empty({w.size(0)}, wc.options().dtype(at::kFloat));
  auto [data, data_t] = expert_outputs(wc, dtype, transpose);
  fp8ops::QuantizeParams p = expert_params(wc, dtype, data, data_t, transpose);
  p.scale = s.data_ptr<float>();
  p.amax = amax.data_ptr<float>();
  fp8ops::launch_quantize_experts(p, w.size(0), stream_of(wc));
  return {data, data_t, amax};
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8ops, CUDA, m) {
  m.impl("amax_experts", &amax_experts_cuda);
  m.impl("quantize_experts_current", &quantize_experts_current_cuda);
  m.impl("quantize_experts_scaled", &quantize_experts_scaled_cuda);
}
