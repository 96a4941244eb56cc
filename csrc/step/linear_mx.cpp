// The FP8 linear layer's step under MXFP8 scaling (32-element E8M0 blocks) as two dispatcher
// calls, as linear_per_tensor.cpp does for the per-tensor recipes: the calls of
// fp8ops/nn/autograd.py's MXLinear, in the same order with the same arguments. Dimensions are
// zero-padded to the block (zeros change neither a block's amax nor a product), and the GEMMs'
// results sliced back.
//
// linear_mx: the weight cast {row data, row scales, column data^T, column scales^T} when the
// layer's cache has none to reuse (returned for the cache), the input's two block copies in one
// call (along K for this GEMM, along M for wgrad), the forward GEMM; y is [M, N] sliced from the
// GEMM's padded result. Its backward casts the output gradient (both copies and the bias gradient
// in one call when dgrad and wgrad are both wanted) and runs them.
#include <ATen/ops/constant_pad_nd.h>
#include <torch/library.h>

#include "step_ops.h"

namespace fp8ops_step {
namespace {

using Pair = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// fp8ops::quantize_mx_pair: (row data, row scales, column data, column scales, column sums)
Pair quantize_pair(const at::Tensor& x, at::ScalarType dtype, int64_t block, bool rceil,
                   OptDtype sum_dtype) {
  static auto h = op<Pair(const at::Tensor&, at::ScalarType, int64_t, bool, OptDtype)>(
      "fp8ops::quantize_mx_pair");
  return h.call(x, dtype, block, rceil, sum_dtype);
}

// fp8ops::quantize_mx: (data, E8M0 scales) blocked along axis
std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x, at::ScalarType dtype,
                                            int64_t block, int64_t axis, bool rceil) {
  static auto h = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::ScalarType,
                                                        int64_t, int64_t, bool)>(
      "fp8ops::quantize_mx");
  return h.call(x, dtype, block, axis, rceil);
}

// fp8ops::gemm_mx: a @ b.T with E8M0 block scales along K
at::Tensor gemm_mx(const at::Tensor& a, const at::Tensor& a_scales, const at::Tensor& b,
                   const at::Tensor& b_scales, const OptTensor& bias, at::ScalarType out_dtype,
                   int64_t block) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const OptTensor&, at::ScalarType, int64_t)>(
      "fp8ops::gemm_mx");
  return h.call(a, a_scales, b, b_scales, bias, out_dtype, block);
}

// t zero-padded at the end of dim to a multiple (t itself when it is one; autograd.py's _pad)
at::Tensor pad(const at::Tensor& t, int64_t dim, int64_t multiple) {
  const int64_t size = t.size(dim), extra = (multiple - size % multiple) % multiple;
  if (extra == 0) return t;
  std::vector<int64_t> p(2 * (t.dim() - dim), 0);
  p.back() = extra;
  return at::constant_pad_nd(t, p, 0);
}

struct Config {
  at::ScalarType fwd, bwd;
  int64_t block;
  bool rceil;
  at::Tensor grad_word;  // int64 [1], CPU: set by a backward that computed dW
};

// The forward without autograd: {y (a slice of the padded result), x's column copy^T and its
// scales^T, the weight cast}
std::tuple<at::Tensor, at::Tensor, at::Tensor, Tensors> forward(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, const Tensors& cached,
    const Config& c, at::ScalarType out_dtype) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_keys());
  Tensors w = cached;  // {row data, row scales, column data^T, column scales^T}
  if (w.empty()) {
    auto wp = pad(pad(weight, 1, c.block), 0, c.block);  // [Np, Kp]
    auto [row, row_scales] = quantize(wp, c.fwd, c.block, 1, c.rceil);
    auto [col, col_scales] = quantize(wp, c.fwd, c.block, 0, c.rceil);  // along N, for dgrad
    w = {row, row_scales, col.t(), col_scales.t()};
  }
  const int64_t n = weight.size(0);
  auto [x_data, x_scales, xc_data, xc_scales, sums] =
      quantize_pair(x, c.fwd, c.block, c.rceil, std::nullopt);
  OptTensor bias_p;
  if (bias.has_value()) bias_p = pad(*bias, 0, c.block);
  auto y = gemm_mx(x_data, x_scales, w[0], w[1], bias_p, out_dtype, c.block).slice(1, 0, n);
  return {y, xc_data.t(), xc_scales.t(), w};
}

struct LinearMX : public torch::autograd::Function<LinearMX> {
  static std::tuple<at::Tensor, Tensors> forward_only(const at::Tensor& x, const at::Tensor& weight,
                                                      const OptTensor& bias, const Tensors& cached,
                                                      const Config& c, at::ScalarType out_dtype) {
    auto [y, xc_t, xc_t_scales, w] = fp8ops_step::forward(x, weight, bias, cached, c, out_dtype);
    return {y, w};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const OptTensor& bias, const Tensors& cached, const Config& c,
                               at::ScalarType out_dtype) {
    ctx->set_materialize_grads(false);  // no zeros for the weight cast's outputs (no gradient)
    auto [y, xc_t, xc_t_scales, w] = fp8ops_step::forward(x, weight, bias, cached, c, out_dtype);
    ctx->save_for_backward({xc_t, xc_t_scales, w[2], w[3], saved_weight(x, weight)});
    auto& d = ctx->saved_data;
    save_common(ctx, x, weight, bias, c.grad_word);
    d["bwd"] = static_cast<int64_t>(c.bwd);
    d["block"] = c.block;
    d["rceil"] = c.rceil;
    d["m"] = x.size(0);
    d["k"] = x.size(1);
    d["n"] = weight.size(0);
    return with_cast(ctx, y, w, cached.empty());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    constexpr size_t kArgs = 6;  // one gradient (or none) per forward argument
    if (!grads[0].defined()) return variable_list(kArgs);
    const bool create_graph = at::GradMode::is_enabled();
    at::NoGradGuard no_grad;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_keys());
    auto saved = ctx->get_saved_variables();
    const auto& xc_t = saved[0];
    const auto& xc_t_scales = saved[1];
    const auto& w_col_t = saved[2];
    const auto& w_col_t_scales = saved[3];
    auto& d = ctx->saved_data;
    const auto bwd = static_cast<at::ScalarType>(d["bwd"].toInt());
    const int64_t bs = d["block"].toInt(), m = d["m"].toInt(), k = d["k"].toInt(),
                  n = d["n"].toInt();
    const bool rceil = d["rceil"].toBool();
    const int64_t b_dtype = d["b_dtype"].toInt();
    const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1);
    const bool need_db = b_dtype >= 0 && ctx->needs_input_grad(2);
    const auto sum_dtype = static_cast<at::ScalarType>(b_dtype);

    auto dy = grads[0].contiguous();
    at::Tensor g_data, g_scales, gc_data, gc_scales, dx, dw, db;
    if (need_dx && need_dw) {  // both copies and the bias gradient in one call
      at::Tensor sums;
      std::tie(g_data, g_scales, gc_data, gc_scales, sums) =
          quantize_pair(dy, bwd, bs, rceil, need_db ? OptDtype(sum_dtype) : std::nullopt);
      if (need_db) db = sums;
    } else {
      auto dyp = pad(pad(dy, 1, bs), 0, bs);  // [Mp, Np]
      if (need_dx) std::tie(g_data, g_scales) = quantize(dyp.slice(0, 0, m), bwd, bs, 1, rceil);
      if (need_dw) std::tie(gc_data, gc_scales) = quantize(dyp, bwd, bs, 0, rceil);
      if (need_db) db = column_sums(dy, sum_dtype);
    }
    if (need_dx)
      dx = gemm_mx(g_data, g_scales, w_col_t, w_col_t_scales, std::nullopt,
                   static_cast<at::ScalarType>(d["x_dtype"].toInt()), bs)
               .slice(1, 0, k);
    if (need_dw) {
      dw = gemm_mx(gc_data.t(), gc_scales.t(), xc_t, xc_t_scales, std::nullopt,
                   static_cast<at::ScalarType>(d["w_dtype"].toInt()), bs)
               .slice(0, 0, n)
               .slice(1, 0, k);
      vouch(d["grad_word"].toTensor());
    }
    return first_order_only({dx, dw, db}, create_graph, kArgs);
  }
};

template <bool kAutograd>
Outputs linear_mx(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                  at::TensorList cached, const at::Tensor& grad_word, at::ScalarType fwd_dtype,
                  at::ScalarType bwd_dtype, int64_t block_size, bool rceil,
                  at::ScalarType out_dtype) {
  TORCH_CHECK(block_size > 0, "fp8ops_step: block_size must be positive, got ", block_size);
  return block_step<LinearMX>(kAutograd, x, weight, bias, cached, 4,
                              Config{fwd_dtype, bwd_dtype, block_size, rceil, grad_word},
                              out_dtype);
}

}  // namespace
}  // namespace fp8ops_step

TORCH_LIBRARY_FRAGMENT(fp8ops_step, m) {
  m.def(
      "linear_mx(Tensor x, Tensor weight, Tensor? bias, Tensor[] cached, Tensor grad_word, "
      "ScalarType fwd_dtype, ScalarType bwd_dtype, int block_size, bool rceil, "
      "ScalarType out_dtype) -> (Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(fp8ops_step, Autograd, m) {
  m.impl("linear_mx", &fp8ops_step::linear_mx<true>);
}

TORCH_LIBRARY_IMPL(fp8ops_step, CompositeExplicitAutograd, m) {
  m.impl("linear_mx", &fp8ops_step::linear_mx<false>);
}
