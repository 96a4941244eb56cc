// Torch binding of the optimizer step (adamw.cu).
#include "../adamw.h"
#include "common.h"

namespace {
using namespace fp8ops_bind;

// One FP8AdamW step of one parameter, in place (fp8ops/ops/adamw.py states the layout and the
// arithmetic; the emulation checks the same things in the same words).
void adamw_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& m,
                     const at::Tensor& m_scale_inv, const at::Tensor& v, const at::Tensor& v_scale_inv,
                     double beta1, double one_minus_beta1, double beta2, double one_minus_beta2, double eps,
                     double step_size, double bias2_rsqrt, double decay, double l2, int64_t seed,
                     int64_t offset) {
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{param, "param"}, {grad, "grad"},
                                {m, "m"}, {m_scale_inv, "m_scale_inv"}, {v, "v"}}) {
    check_cuda(t, name);
    check_same_device(t, param, name, "param");
    FP8OPS_CHECK(t.is_contiguous(), "fp8ops: adamw_step: ", name, " must be contiguous");
  }
  const int64_t n = param.numel(), blocks = (n + 127) / 128;
  const auto pt = param.scalar_type();
  FP8OPS_CHECK(pt == at::kFloat || pt == at::kBFloat16, "fp8ops: adamw_step: param must be contiguous "
               "float32 or bfloat16, got ", dtype_str(pt));
  FP8OPS_CHECK(grad.scalar_type() == pt && grad.numel() == n, "fp8ops: adamw_step: grad must be ", dtype_str(pt),
               " of ", n, " values, got ", dtype_str(grad.scalar_type()), " ", shape_str(grad));
  FP8OPS_CHECK(m.scalar_type() == at::kFloat8_e4m3fn && m.numel() == blocks * 128 &&
                   m_scale_inv.scalar_type() == at::kFloat && m_scale_inv.numel() == blocks,
               "fp8ops: adamw_step: m must be E4M3 [", blocks, ", 128] with ", blocks, " float32 scales, got ",
               dtype_str(m.scalar_type()), " ", shape_str(m), " and ", shape_str(m_scale_inv));
  fp8ops::SecondMoment form;
  if (v.scalar_type() == at::kBFloat16) {
    FP8OPS_CHECK(v.numel() == n, "fp8ops: adamw_step: a bfloat16 v must hold ", n, " values, got ", shape_str(v));
    form = fp8ops::SecondMoment::kBF16;
  } else {
    FP8OPS_CHECK((v.scalar_type() == at::kFloat8_e4m3fn || v.scalar_type() == at::kFloat8_e5m2) &&
                     v.numel() == blocks * 128 && v_scale_inv.is_cuda() && v_scale_inv.is_contiguous() &&
                     v_scale_inv.scalar_type() == at::kFloat && v_scale_inv.numel() == blocks,
                 "fp8ops: adamw_step: v must be E4M3 / E5M2 [", blocks, ", 128] with ", blocks,
                 " float32 scales on the device, or bfloat16 of ", n, " values; got ", dtype_str(v.scalar_type()),
                 " ", shape_str(v));
    check_same_device(v_scale_inv, param, "v_scale_inv", "param");
    form = v.scalar_type() == at::kFloat8_e4m3fn ? fp8ops::SecondMoment::kSqrtE4M3 : fp8ops::SecondMoment::kE5M2;
  }
  c10::cuda::CUDAGuard guard(param.device());
  fp8ops::AdamWParams p{};
  p.param = param.data_ptr();
  p.grad = grad.data_ptr();
  p.param_dtype = to_dtype(pt);
  p.n = n;
  p.m = static_cast<uint8_t*>(m.data_ptr());
  p.m_scale_inv = m_scale_inv.data_ptr<float>();
  p.v = v.data_ptr();
  p.v_scale_inv = form == fp8ops::SecondMoment::kBF16 ? nullptr : v_scale_inv.data_ptr<float>();
  p.second_moment = form;
  p.beta1 = float(beta1);
  p.one_minus_beta1 = float(one_minus_beta1);
  p.beta2 = float(beta2);
  p.one_minus_beta2 = float(one_minus_beta2);
  p.eps = float(eps);
  p.step_size = float(step_size);
  p.bias2_rsqrt = float(bias2_rsqrt);
  p.decay = float(decay);
  p.l2 = float(l2);
  p.seed = uint64_t(seed);
  p.offset = uint64_t(offset);
  try {
    fp8ops::launch_adamw_step(p, stream_of(param));
  } catch (const std::exception& e) {
    FP8OPS_CHECK(false, e.what());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8ops, CUDA, m) { m.impl("adamw_step", &adamw_step_cuda); }
