// The FP8 linear layer's step under blockwise scaling (DeepSeek-V3 style: activations and
// gradients in 1x128 blocks, the weight in 128x128 blocks) as two dispatcher calls, as
// linear_per_tensor.cpp does for the per-tensor recipes: the calls of
// fp8ops/nn/autograd.py's BlockwiseLinear, in the same order with the same arguments.
//
// linear_blockwise: the weight cast {data, scale_inv, data^T} (`cached`, or made when the
// layer's cache has none to reuse, and returned for the cache), the input's two block copies in
// one call (1x128 along K for this GEMM, along M for wgrad), the forward GEMM. Its backward
// casts the output gradient (both copies and the bias gradient in one call when dgrad and wgrad
// are both wanted) and runs them.
#include <torch/library.h>

#include "step_ops.h"

namespace fp8ops_step {
namespace {

using Pair = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// fp8ops::quantize_blockwise_pair: (data, scale_inv, data^T, scale_inv^T, column sums)
Pair quantize_pair(const at::Tensor& x, at::ScalarType dtype, bool power_of_two,
                   OptDtype sum_dtype) {
  static auto h = op<Pair(const at::Tensor&, at::ScalarType, bool, OptDtype)>(
      "fp8ops::quantize_blockwise_pair");
  return h.call(x, dtype, power_of_two, sum_dtype);
}

// fp8ops::quantize_blockwise: (data, scale_inv per block_rows x block_cols tile)
std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x, at::ScalarType dtype,
                                            int64_t block_rows, int64_t block_cols,
                                            bool power_of_two) {
  static auto h = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::ScalarType,
                                                        int64_t, int64_t, bool)>(
      "fp8ops::quantize_blockwise");
  return h.call(x, dtype, block_rows, block_cols, power_of_two);
}

at::Tensor transpose_fp8(const at::Tensor& data) {
  static auto h = op<at::Tensor(const at::Tensor&)>("fp8ops::transpose_fp8");
  return h.call(data);
}

struct Config {
  at::ScalarType fwd, bwd;
  bool power_of_two;
  at::Tensor grad_word;  // int64 [1], CPU: set by a backward that computed dW
};

// The forward without autograd: {y, x^T's data and scale_inv, the weight cast}
std::tuple<at::Tensor, at::Tensor, at::Tensor, Tensors> forward(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, const Tensors& cached,
    const Config& c, at::ScalarType out_dtype) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_keys());
  Tensors w = cached;  // {data, scale_inv, data^T}: the cache's payload
  if (w.empty()) {
    auto [data, scale_inv] = quantize(weight, c.fwd, 128, 128, c.power_of_two);
    w = {data, scale_inv, transpose_fp8(data)};
  }
  auto [x_data, x_scale_inv, xt_data, xt_scale_inv, sums] =
      quantize_pair(x, c.fwd, c.power_of_two, std::nullopt);
  auto y = gemm_blockwise(x_data, w[0], x_scale_inv, w[1], bias, out_dtype);
  return {y, xt_data, xt_scale_inv, w};
}

struct LinearBlockwise : public torch::autograd::Function<LinearBlockwise> {
  static std::tuple<at::Tensor, Tensors> forward_only(const at::Tensor& x, const at::Tensor& weight,
                                                      const OptTensor& bias, const Tensors& cached,
                                                      const Config& c, at::ScalarType out_dtype) {
    auto [y, xt_data, xt_scale_inv, w] =
        fp8ops_step::forward(x, weight, bias, cached, c, out_dtype);
    return {y, w};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const OptTensor& bias, const Tensors& cached, const Config& c,
                               at::ScalarType out_dtype) {
    ctx->set_materialize_grads(false);  // no zeros for the weight cast's outputs (no gradient)
    auto [y, xt_data, xt_scale_inv, w] =
        fp8ops_step::forward(x, weight, bias, cached, c, out_dtype);
    ctx->save_for_backward({xt_data, xt_scale_inv, w[2], w[1].t(), saved_weight(x, weight)});
    auto& d = ctx->saved_data;
    save_common(ctx, x, weight, bias, c.grad_word);
    d["bwd"] = static_cast<int64_t>(c.bwd);
    d["power_of_two"] = c.power_of_two;
    return with_cast(ctx, y, w, cached.empty());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    constexpr size_t kArgs = 6;  // one gradient (or none) per forward argument
    if (!grads[0].defined()) return variable_list(kArgs);
    const bool create_graph = at::GradMode::is_enabled();
    at::NoGradGuard no_grad;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_keys());
    auto saved = ctx->get_saved_variables();
    const auto& xt_data = saved[0];
    const auto& xt_scale_inv = saved[1];
    const auto& w_data_t = saved[2];
    const auto& w_t_scale_inv = saved[3];
    auto& d = ctx->saved_data;
    const auto bwd = static_cast<at::ScalarType>(d["bwd"].toInt());
    const bool p2 = d["power_of_two"].toBool();
    const int64_t b_dtype = d["b_dtype"].toInt();
    const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1);
    const bool need_db = b_dtype >= 0 && ctx->needs_input_grad(2);
    const auto sum_dtype = static_cast<at::ScalarType>(b_dtype);

    auto dy = grads[0].contiguous();
    at::Tensor g_data, g_scale_inv, gt_data, gt_scale_inv, dx, dw, db;
    if (need_dx && need_dw) {  // both copies and the bias gradient in one call
      at::Tensor sums;
      std::tie(g_data, g_scale_inv, gt_data, gt_scale_inv, sums) =
          quantize_pair(dy, bwd, p2, need_db ? OptDtype(sum_dtype) : std::nullopt);
      if (need_db) db = sums;
    } else {
      if (need_dx) std::tie(g_data, g_scale_inv) = quantize(dy, bwd, 1, 128, p2);
      if (need_dw) std::tie(gt_data, gt_scale_inv) = quantize(dy.t(), bwd, 1, 128, p2);
      if (need_db) db = column_sums(dy, sum_dtype);
    }
    if (need_dx)
      dx = gemm_blockwise(g_data, w_data_t, g_scale_inv, w_t_scale_inv, std::nullopt,
                          static_cast<at::ScalarType>(d["x_dtype"].toInt()));
    if (need_dw) {
      dw = gemm_blockwise(gt_data, xt_data, gt_scale_inv, xt_scale_inv, std::nullopt,
                          static_cast<at::ScalarType>(d["w_dtype"].toInt()));
      vouch(d["grad_word"].toTensor());
    }
    return first_order_only({dx, dw, db}, create_graph, kArgs);
  }
};

template <bool kAutograd>
Outputs linear_blockwise(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                         at::TensorList cached, const at::Tensor& grad_word,
                         at::ScalarType fwd_dtype, at::ScalarType bwd_dtype, bool power_of_two,
                         at::ScalarType out_dtype) {
  return block_step<LinearBlockwise>(kAutograd, x, weight, bias, cached, 3,
                                     Config{fwd_dtype, bwd_dtype, power_of_two, grad_word},
                                     out_dtype);
}

}  // namespace
}  // namespace fp8ops_step

TORCH_LIBRARY_FRAGMENT(fp8ops_step, m) {
  m.def(
      "linear_blockwise(Tensor x, Tensor weight, Tensor? bias, Tensor[] cached, "
      "Tensor grad_word, ScalarType fwd_dtype, ScalarType bwd_dtype, bool power_of_two, "
      "ScalarType out_dtype) -> (Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(fp8ops_step, Autograd, m) {
  m.impl("linear_blockwise", &fp8ops_step::linear_blockwise<true>);
}

TORCH_LIBRARY_IMPL(fp8ops_step, CompositeExplicitAutograd, m) {
  m.impl("linear_blockwise", &fp8ops_step::linear_blockwise<false>);
}
