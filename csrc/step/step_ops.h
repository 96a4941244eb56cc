// What the layer steps in C++ share (csrc/step/*.cpp): the fp8ops ops they call, through the
// dispatcher (a CUDA tensor reaches fp8ops._C's kernels, a CPU tensor the emulation), and the
// pieces of their autograd.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/graph_task.h>

#include <optional>
#include <tuple>
#include <vector>

namespace fp8ops_step {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Tensors = std::vector<at::Tensor>;
using OptTensor = std::optional<at::Tensor>;
using OptDtype = std::optional<at::ScalarType>;
using Cast = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// what a forward op returns: y, then the weight cast it made (empty when given the cached one)
using Outputs = std::tuple<at::Tensor, Tensors>;

template <class Signature>
inline c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// fp8ops::gemm: a @ b.T in float32 accumulation, scaled by both scale_invs
inline at::Tensor gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                       const at::Tensor& b_scale_inv, const OptTensor& bias,
                       at::ScalarType out_dtype, bool fast_accum) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const OptTensor&, at::ScalarType, bool)>(
      "fp8ops::gemm");
  return h.call(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, fast_accum);
}

// fp8ops::gemm_blockwise: a @ b.T with 1x128 / 128x128 block scales
inline at::Tensor gemm_blockwise(const at::Tensor& a, const at::Tensor& b,
                                 const at::Tensor& a_scale_inv, const at::Tensor& b_scale_inv,
                                 const OptTensor& bias, at::ScalarType out_dtype) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const OptTensor&, at::ScalarType)>(
      "fp8ops::gemm_blockwise");
  return h.call(a, b, a_scale_inv, b_scale_inv, bias, out_dtype);
}

// Autocast must not retype the ops' own calls (the emulation's float32 arithmetic is its
// definition; the Python path runs them with autocast off too)
inline c10::DispatchKeySet autocast_keys() {
  return c10::DispatchKeySet({c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA});
}

// What every step's backward reads besides its own: the host word it vouches through, and the
// dtypes of the gradients it returns (b_dtype -1: no bias)
inline void save_common(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                        const OptTensor& bias, const at::Tensor& grad_word) {
  auto& d = ctx->saved_data;
  d["grad_word"] = grad_word;
  d["x_dtype"] = static_cast<int64_t>(x.scalar_type());
  d["w_dtype"] = static_cast<int64_t>(weight.scalar_type());
  d["b_dtype"] = bias.has_value() ? static_cast<int64_t>(bias->scalar_type()) : int64_t(-1);
}

// What a step Function saves of the weight: the weight itself where dgrad reads it (x takes a
// gradient), as nn.Linear saves it, else nothing. The backward reads only the casts; unpacking
// the weight makes autograd check its version, so a write to it between the forward and the
// backward (an optimizer step) raises autograd's error, as on the Python path. A saved parameter
// is the parameter itself (no copy); under saved-tensor hooks it is packed as the Python path's.
inline at::Tensor saved_weight(const at::Tensor& x, const at::Tensor& weight) {
  return x.requires_grad() ? weight : at::Tensor();
}

// A step Function's outputs: y, then the weight cast w when the forward made it (for the
// layer's cache; nothing to differentiate)
inline variable_list with_cast(AutogradContext* ctx, const at::Tensor& y, const Tensors& w,
                               bool made) {
  variable_list out = {y};
  if (made) {
    out.insert(out.end(), w.begin(), w.end());
    ctx->mark_non_differentiable(w);  // (one call: each call replaces the last one's set)
  }
  return out;
}

// A step Function's outputs {y, the weight cast it made...} as the forward op returns them
inline Outputs split_outputs(variable_list out) {
  at::Tensor y = out[0];
  out.erase(out.begin());
  return {y, out};
}

inline void check_word(const at::Tensor& word, const char* name) {
  TORCH_CHECK(word.device().is_cpu() && word.scalar_type() == at::kLong && word.numel() == 1 &&
                  word.is_contiguous(),
              "fp8ops_step: ", name, " must be one int64 on the CPU");
}

// The body of a block recipe's forward op: its Function under autograd, the Function's forward
// alone below it (inference mode). cached: the layer's cached weight cast (n_cast tensors), or
// none (the op casts the weight and returns that cast).
template <class Function, class Config>
Outputs block_step(bool autograd, const at::Tensor& x, const at::Tensor& weight,
                   const OptTensor& bias, at::TensorList cached, size_t n_cast, const Config& c,
                   at::ScalarType out_dtype) {
  check_word(c.grad_word, "grad_word");
  TORCH_CHECK(cached.empty() || cached.size() == n_cast, "fp8ops_step: a cached weight cast has ",
              n_cast, " tensors, got ", cached.size());
  if (autograd)
    return split_outputs(Function::apply(x, weight, bias, cached.vec(), c, out_dtype));
  auto [y, w] = Function::forward_only(x, weight, bias, cached.vec(), c, out_dtype);
  if (!cached.empty()) w.clear();
  return {y, w};
}

// The gradient about to be accumulated comes from the layer's weight cast: its weight cache may
// take it as that cast's voucher (a host word the cache's gradient hook reads) when this backward
// pass accumulates it (the word names the pass: its graph task id + 1, as
// WeightCache.expect_grad writes on the Python path)
inline void vouch(const at::Tensor& grad_word) {
  grad_word.data_ptr<int64_t>()[0] = torch::autograd::get_current_graph_task_id() + 1;
}

// The sums over the rows of x [rows, cols] in float32, rounded to dtype (a bias gradient; as
// fp8ops/ops/fused.py's column_sums)
inline at::Tensor column_sums(const at::Tensor& x, at::ScalarType dtype) {
  return at::sum(x, {0}, false, at::kFloat).to(dtype);
}

// A backward's gradients {dx, dw, db}, resized to one per forward argument. Under create_graph
// differentiating them again raises (as fp8ops/nn/autograd.py's first_order_only): the FP8
// backward has no second-order term.
inline variable_list first_order_only(variable_list out, bool create_graph, size_t n_args) {
  if (create_graph) {
    for (auto& t : out)
      if (t.defined()) t = t.detach().requires_grad_(true);
    out = std::make_shared<torch::autograd::DelayedError>(
              "fp8ops.linear / FP8Linear does not support double backward (create_graph=True "
              "through an FP8 layer, e.g. a gradient penalty): its FP8 backward has no "
              "second-order term. Keep that layer in high precision (convert_to_fp8's "
              "filter_fn) or use torch.nn.functional.linear there",
              static_cast<int64_t>(out.size()))
              ->apply(std::move(out));
  }
  out.resize(n_args);
  return out;
}

}  // namespace fp8ops_step
