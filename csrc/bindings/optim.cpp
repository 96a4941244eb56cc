// Torch binding of the optimizer step (adamw.cu): one parameter, or a list of them in one launch.
#include <cstring>
#include <string>
#include <vector>

#include "../adamw.h"
#include "common.h"

namespace {
using namespace fp8ops_bind;

// One parameter's tensors, checked (fp8ops/ops/adamw.py states the layout; the emulation checks
// the same things in the same words) against the device `device`; gives v's format. `where`
// names the op, and for a list the tensor's place in it.
fp8ops::SecondMoment check_param(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& m,
                                 const at::Tensor& m_scale_inv, const at::Tensor& v, const at::Tensor& v_scale_inv,
                                 const at::Device& device, const std::string& where) {
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{param, "param"}, {grad, "grad"},
                                {m, "m"}, {m_scale_inv, "m_scale_inv"}, {v, "v"}}) {
    FP8OPS_CHECK(t.is_cuda(), "fp8ops: ", where, ": ", name, " must be a CUDA tensor, got ", t.device().str());
    FP8OPS_CHECK(t.device() == device, "fp8ops: ", where, ": ", name, " (", t.device().str(), ") and the param (",
                 device.str(), ") must be on the same device");
    FP8OPS_CHECK(t.is_contiguous(), "fp8ops: ", where, ": ", name, " must be contiguous");
  }
  const int64_t n = param.numel(), blocks = (n + 127) / 128;
  const auto pt = param.scalar_type();
  FP8OPS_CHECK(pt == at::kFloat || pt == at::kBFloat16, "fp8ops: ", where, ": param must be contiguous "
               "float32 or bfloat16, got ", dtype_str(pt));
  FP8OPS_CHECK(grad.scalar_type() == pt && grad.numel() == n, "fp8ops: ", where, ": grad must be ", dtype_str(pt),
               " of ", n, " values, got ", dtype_str(grad.scalar_type()), " ", shape_str(grad));
  FP8OPS_CHECK(m.scalar_type() == at::kFloat8_e4m3fn && m.numel() == blocks * 128 &&
                   m_scale_inv.scalar_type() == at::kFloat && m_scale_inv.numel() == blocks,
               "fp8ops: ", where, ": m must be E4M3 [", blocks, ", 128] with ", blocks, " float32 scales, got ",
               dtype_str(m.scalar_type()), " ", shape_str(m), " and ", shape_str(m_scale_inv));
  if (v.scalar_type() == at::kBFloat16) {
    FP8OPS_CHECK(v.numel() == n, "fp8ops: ", where, ": a bfloat16 v must hold ", n, " values, got ", shape_str(v));
    return fp8ops::SecondMoment::kBF16;
  }
  FP8OPS_CHECK((v.scalar_type() == at::kFloat8_e4m3fn || v.scalar_type() == at::kFloat8_e5m2) &&
                   v.numel() == blocks * 128 && v_scale_inv.is_cuda() && v_scale_inv.is_contiguous() &&
                   v_scale_inv.scalar_type() == at::kFloat && v_scale_inv.numel() == blocks,
               "fp8ops: ", where, ": v must be E4M3 / E5M2 [", blocks, ", 128] with ", blocks,
               " float32 scales on the device, or bfloat16 of ", n, " values; got ", dtype_str(v.scalar_type()),
               " ", shape_str(v));
  FP8OPS_CHECK(v_scale_inv.device() == device, "fp8ops: ", where, ": v_scale_inv (", v_scale_inv.device().str(),
               ") and the param (", device.str(), ") must be on the same device");
  return v.scalar_type() == at::kFloat8_e4m3fn ? fp8ops::SecondMoment::kSqrtE4M3 : fp8ops::SecondMoment::kE5M2;
}

// One FP8AdamW step of one parameter, in place.
void adamw_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& m,
                     const at::Tensor& m_scale_inv, const at::Tensor& v, const at::Tensor& v_scale_inv,
                     double beta1, double one_minus_beta1, double beta2, double one_minus_beta2, double eps,
                     double step_size, double bias2_rsqrt, double decay, double l2, int64_t seed,
                     int64_t offset) {
  check_cuda(param, "param");
  const fp8ops::SecondMoment form =
      check_param(param, grad, m, m_scale_inv, v, v_scale_inv, param.device(), "adamw_step");
  c10::cuda::CUDAGuard guard(param.device());
  fp8ops::AdamWParams p{};
  p.param = param.data_ptr();
  p.grad = grad.data_ptr();
  p.param_dtype = to_dtype(param.scalar_type());
  p.n = param.numel();
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

// A per-tensor table of adamw_step_multi (scalars float32 [n, 9], rng int64 [n, 2]): on the CPU
// (copied to the device with the tensor table) or on the params' device (read where it is).
void check_table(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t n, int64_t cols,
                 const at::Device& device) {
  FP8OPS_CHECK(t.scalar_type() == dtype && t.dim() == 2 && t.size(0) == n && t.size(1) == cols,
               "fp8ops: adamw_step_multi: ", name, " must be ", dtype_str(dtype), " [", n, ", ", cols, "], got ",
               dtype_str(t.scalar_type()), " ", shape_str(t));
  FP8OPS_CHECK(t.is_cpu() || (t.device() == device && t.is_contiguous()), "fp8ops: adamw_step_multi: ", name,
               " must be on the CPU or contiguous on the params' device (", device.str(), "), got ",
               t.device().str());
}

// The bytes copied to the device in one transfer: the tensor table, then the tables given on the
// CPU. Offsets keep every part 8-byte aligned (AdamWTensor and int64 first).
struct Upload {
  std::vector<fp8ops::AdamWTensor> tensors;
  at::Tensor rng, scalars;  // contiguous CPU tables, or undefined when on the device

  size_t rng_at() const { return tensors.size() * sizeof(fp8ops::AdamWTensor); }
  size_t scalars_at() const { return rng_at() + (rng.defined() ? rng.nbytes() : 0); }
  size_t bytes() const { return scalars_at() + (scalars.defined() ? scalars.nbytes() : 0); }

  // One pinned host buffer copied asynchronously on the current stream (the caching host
  // allocator keeps the buffer until the copy is done); the device copy is freed after the
  // kernel in stream order.
  at::Tensor to_device(const at::Device& device) const {
    at::Tensor host = at::empty({int64_t(bytes())}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    auto* base = static_cast<char*>(host.data_ptr());
    std::memcpy(base, tensors.data(), rng_at());
    if (rng.defined()) std::memcpy(base + rng_at(), rng.data_ptr(), rng.nbytes());
    if (scalars.defined()) std::memcpy(base + scalars_at(), scalars.data_ptr(), scalars.nbytes());
    return at::empty({int64_t(bytes())}, at::TensorOptions().dtype(at::kByte).device(device)).copy_(host, true);
  }
};

// adamw_step on each parameter of the lists, in one launch.
void adamw_step_multi_cuda(at::TensorList params, at::TensorList grads, at::TensorList m,
                           at::TensorList m_scale_inv, at::TensorList v, at::TensorList v_scale_inv,
                           const at::Tensor& scalars, const at::Tensor& rng) {
  const size_t n = params.size();
  FP8OPS_CHECK(grads.size() == n && m.size() == n && m_scale_inv.size() == n && v.size() == n &&
                   v_scale_inv.size() == n,
               "fp8ops: adamw_step_multi: params, grads, m, m_scale_inv, v and v_scale_inv must be lists of one "
               "length, got ", n, ", ", grads.size(), ", ", m.size(), ", ", m_scale_inv.size(), ", ", v.size(), ", ",
               v_scale_inv.size());
  if (n == 0) return;
  check_cuda(params[0], "params[0]");
  const at::Device device = params[0].device();
  check_table(scalars, "scalars", at::kFloat, int64_t(n), fp8ops::kAdamWScalars, device);
  check_table(rng, "rng", at::kLong, int64_t(n), 2, device);
  Upload up;
  up.tensors.resize(n);
  fp8ops::SecondMoment form{};
  int64_t blocks = 0;
  for (size_t i = 0; i < n; ++i) {
    const std::string where = cat("adamw_step_multi: tensor ", i);
    const fp8ops::SecondMoment f = check_param(params[i], grads[i], m[i], m_scale_inv[i], v[i], v_scale_inv[i],
                                               device, where);
    FP8OPS_CHECK(i == 0 || (params[i].scalar_type() == params[0].scalar_type() && f == form), "fp8ops: ", where,
                 ": the params must share one dtype and the v one format, got ", dtype_str(params[i].scalar_type()),
                 " and v ", dtype_str(v[i].scalar_type()), " after ", dtype_str(params[0].scalar_type()),
                 " and v ", dtype_str(v[0].scalar_type()));
    form = f;
    up.tensors[i] = {params[i].data_ptr(), grads[i].data_ptr(), static_cast<uint8_t*>(m[i].data_ptr()),
                     m_scale_inv[i].data_ptr<float>(), v[i].data_ptr(),
                     f == fp8ops::SecondMoment::kBF16 ? nullptr : v_scale_inv[i].data_ptr<float>(),
                     params[i].numel(), blocks};
    blocks += (params[i].numel() + 127) / 128;
  }
  if (blocks == 0) return;
  c10::cuda::CUDAGuard guard(device);
  if (rng.is_cpu()) up.rng = rng.contiguous();
  if (scalars.is_cpu()) up.scalars = scalars.contiguous();
  const at::Tensor table = up.to_device(device);
  const auto* base = static_cast<const char*>(table.data_ptr());
  fp8ops::AdamWMultiParams p{};
  p.tensors = reinterpret_cast<const fp8ops::AdamWTensor*>(base);
  p.rng = rng.is_cpu() ? reinterpret_cast<const int64_t*>(base + up.rng_at()) : rng.data_ptr<int64_t>();
  p.scalars = scalars.is_cpu() ? reinterpret_cast<const float*>(base + up.scalars_at()) : scalars.data_ptr<float>();
  p.count = int64_t(n);
  p.total_blocks = blocks;
  p.param_dtype = to_dtype(params[0].scalar_type());
  p.second_moment = form;
  try {
    fp8ops::launch_adamw_step_multi(p, stream_of(params[0]));
  } catch (const std::exception& e) {
    FP8OPS_CHECK(false, e.what());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8ops, CUDA, m) {
  m.impl("adamw_step", &adamw_step_cuda);
  m.impl("adamw_step_multi", &adamw_step_multi_cuda);
}
