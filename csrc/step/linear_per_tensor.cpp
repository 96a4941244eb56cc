// The FP8 linear layer's training step as two dispatcher calls: a forward op whose autograd node,
// in C++, is the backward. No Python runs between a layer's call and the kernels it launches: the
// casts and GEMMs are the fp8ops ops, called through the dispatcher, so a CUDA tensor reaches
// fp8ops._C's kernels and a CPU tensor the emulation, with the calls (and so the bytes) of
// fp8ops/nn/autograd.py's PerTensorLinear, the reference the tests compare with.
//
// Per-tensor scaling, round-to-nearest casts:
//   linear_current  current scaling: each cast takes its tensor's own amax
//   linear_delayed  delayed scaling: each role's cast takes the scale of its seven state buffers
//                   (quantize_delayed), stepping and recording them in place when `live`
// The layer's weight cache decides whether its cached weight cast serves the call: if so the op
// takes it (w_data, w_data_t, w_scale_inv), else it casts the weight (from the weight's own amax
// or role, or with w_scale, a scale decided for the accumulation window) and returns that cast,
// {data, data^T, scale_inv, scale}, for the cache. Then it casts the input and runs the forward
// GEMM, saving the FP8 input's transposed copy. The backward casts the output gradient (the bias
// gradient in the same op) and runs dgrad and wgrad; it sets grad_word[0] when it computed the
// weight's gradient from the weight cast (the cache's voucher), and under delayed scaling steps
// the grad role when recording_word[0] (the layer's training mode at backward time) is set.
#include <torch/library.h>

#include <Python.h>

#include <string>

#include "step_ops.h"

namespace fp8ops_step {
namespace {

// How the step's casts take their scales: current scaling, or delayed (the roles' buffers)
struct Scaling {
  at::ScalarType fwd, bwd;
  double margin, grad_margin;
  bool power_of_two;
  at::Tensor grad_word;       // int64 [1], CPU: set by a backward that computed dW
  at::Tensor recording_word;  // int64 [1], CPU: the layer records (delayed scaling)
  // delayed scaling (else current scaling)
  bool delayed = false;
  Tensors input_role, weight_role, grad_role;  // each role's seven buffers, in schema order
  int64_t interval = 1;
  std::string algo;
  double ema_alpha = 0, percentile = 0;
  bool live = false, weight_warm = false, input_warm = false, grad_warm = false;
};

// One per-tensor cast with its transposed copy: (data, data_t, scale, scale_inv, column sums)
Cast cast(const at::Tensor& x, const Scaling& s, const Tensors& role, at::ScalarType dtype,
          double margin, bool update, bool warm, bool record,
          OptDtype sum_dtype) {
  if (!s.delayed) {
    static auto current = op<Cast(const at::Tensor&, at::ScalarType, double, bool, bool, OptDtype,
                                bool, int64_t, int64_t, const OptTensor&)>(
      "fp8ops::quantize_current");
    return current.call(x, dtype, margin, s.power_of_two, /*transpose=*/true, sum_dtype,
                        /*stochastic=*/false, 0, 0, std::nullopt);
  }
  static auto delayed =
      // (the buffers the op updates in place come as const Tensor&, as fp8ops._C registers
      // its kernel: the dispatcher checks a call's C++ signature against the kernel's)
      op<Cast(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              at::ScalarType, double, int64_t, c10::string_view, double, double, bool, bool, bool,
              bool, bool, OptDtype, bool, int64_t, int64_t, const OptTensor&)>(
          "fp8ops::quantize_delayed");
  TORCH_CHECK(role.size() == 7, "fp8ops_step: a delayed-scaling role has seven buffers, got ",
              role.size());
  const Tensors& b = role;  // (the op updates these buffers in place)
  return delayed.call(x, b[0], b[1], b[2], b[3], b[4], b[5], b[6], dtype, margin, s.interval,
                      s.algo, s.ema_alpha, s.percentile, s.power_of_two, update, warm, record,
                      /*transpose=*/true, sum_dtype, /*stochastic=*/false, 0, 0, std::nullopt);
}

// fp8ops::quantize: x * scale cast, with its transposed copy (and x's amax, unused here)
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x,
                                                        const at::Tensor& scale,
                                                        at::ScalarType dtype) {
  static auto h = op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, at::ScalarType, bool, bool, int64_t, int64_t,
      const OptTensor&, OptDtype)>("fp8ops::quantize");
  return h.call(x, scale, dtype, /*transpose=*/true, /*stochastic=*/false, 0, 0, std::nullopt,
                 std::nullopt);
}

// The weight's cast as the layer's cache keeps it: {data, data^T, scale_inv, scale}; the given
// cached one ({data, data^T, scale_inv}), or a new one: with the decided scale w_scale, or from
// the weight's own amax (current) or its role (delayed: stepped and recorded when live)
Tensors weight_cast(const at::Tensor& weight, const OptTensor& w_data, const OptTensor& w_data_t,
                    const OptTensor& w_scale_inv, const OptTensor& w_scale, const Scaling& s) {
  if (w_data.has_value()) {
    TORCH_CHECK(w_data_t.has_value() && w_scale_inv.has_value(),
                "fp8ops_step: a cached weight cast needs w_data, w_data_t and w_scale_inv");
    return {*w_data, *w_data_t, *w_scale_inv};
  }
  if (w_scale.has_value()) {
    auto [data, data_t, amax] = quantize(weight, *w_scale, s.fwd);
    return {data, data_t, at::reciprocal(*w_scale), *w_scale};
  }
  const bool step = s.live;  // (a recast with a decided scale never steps: above)
  auto [data, data_t, scale, scale_inv, sums] = cast(weight, s, s.weight_role, s.fwd, s.margin,
                                                     step, s.weight_warm, step, std::nullopt);
  return {data, data_t, scale_inv, scale};
}

// The forward without autograd: {y, x's FP8 transposed copy, x's scale_inv, the weight cast}
std::tuple<at::Tensor, at::Tensor, at::Tensor, Tensors> forward(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, const OptTensor& w_data,
    const OptTensor& w_data_t, const OptTensor& w_scale_inv, const OptTensor& w_scale,
    const Scaling& s, at::ScalarType out_dtype) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_keys());
  auto w = weight_cast(weight, w_data, w_data_t, w_scale_inv, w_scale, s);
  auto [xq, xq_t, x_scale, x_scale_inv, sums] =
      cast(x, s, s.input_role, s.fwd, s.margin, s.live, s.input_warm, s.live, std::nullopt);
  auto y = gemm(xq, w[0], x_scale_inv, w[2], bias, out_dtype, /*fast_accum=*/true);
  return {y, xq_t, x_scale_inv, w};
}

struct LinearPerTensor : public torch::autograd::Function<LinearPerTensor> {
  // {y, then the weight cast it made (none when given the cached one)}
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const OptTensor& bias, const OptTensor& w_data,
                               const OptTensor& w_data_t, const OptTensor& w_scale_inv,
                               const OptTensor& w_scale, const Scaling& s,
                               at::ScalarType out_dtype) {
    ctx->set_materialize_grads(false);  // no zeros for the weight cast's outputs (no gradient)
    auto [y, xq_t, x_scale_inv, w] =
        fp8ops_step::forward(x, weight, bias, w_data, w_data_t, w_scale_inv, w_scale, s, out_dtype);
    ctx->save_for_backward({xq_t, w[1], x_scale_inv, w[2], saved_weight(x, weight)});
    auto& d = ctx->saved_data;
    save_common(ctx, x, weight, bias, s.grad_word);
    d["recording_word"] = s.recording_word;
    d["delayed"] = s.delayed;
    d["grad_role"] = s.grad_role;
    d["interval"] = s.interval;
    d["algo"] = s.algo;
    d["ema_alpha"] = s.ema_alpha;
    d["percentile"] = s.percentile;
    d["grad_warm"] = s.grad_warm;
    d["bwd"] = static_cast<int64_t>(s.bwd);
    d["grad_margin"] = s.grad_margin;
    d["power_of_two"] = s.power_of_two;
    return with_cast(ctx, y, w, !w_data.has_value());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    constexpr size_t kArgs = 9;  // one gradient (or none) per forward argument
    if (!grads[0].defined()) return variable_list(kArgs);  // y took no part in the loss
    const bool create_graph = at::GradMode::is_enabled();
    at::NoGradGuard no_grad;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_keys());
    auto saved = ctx->get_saved_variables();
    const auto& xq_t = saved[0];
    const auto& w_data_t = saved[1];
    const auto& x_scale_inv = saved[2];
    const auto& w_scale_inv = saved[3];
    auto& d = ctx->saved_data;
    const auto dtype = [&](const char* name) {
      return static_cast<at::ScalarType>(d[name].toInt());
    };
    Scaling s;
    s.power_of_two = d["power_of_two"].toBool();
    s.grad_role = d["grad_role"].toTensorVector();
    s.interval = d["interval"].toInt();
    s.algo = d["algo"].toStringRef();
    s.ema_alpha = d["ema_alpha"].toDouble();
    s.percentile = d["percentile"].toDouble();
    s.delayed = d["delayed"].toBool();
    const bool stepping =
        s.delayed && d["recording_word"].toTensor().data_ptr<int64_t>()[0] != 0;
    const int64_t b_dtype = d["b_dtype"].toInt();
    const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1);
    const bool need_db = b_dtype >= 0 && ctx->needs_input_grad(2);

    auto dy = grads[0].contiguous();
    auto [gq, gq_t, g_scale, g_scale_inv, sums] =
        cast(dy, s, s.grad_role, dtype("bwd"), d["grad_margin"].toDouble(), stepping,
             d["grad_warm"].toBool(), stepping,
             need_db ? OptDtype(static_cast<at::ScalarType>(b_dtype))
                     : std::nullopt);
    at::Tensor dx, dw, db;
    if (need_dx)
      dx = gemm(gq, w_data_t, g_scale_inv, w_scale_inv, std::nullopt, dtype("x_dtype"), false);
    if (need_dw) {
      dw = gemm(gq_t, xq_t, g_scale_inv, x_scale_inv, std::nullopt, dtype("w_dtype"), false);
      vouch(d["grad_word"].toTensor());
    }
    if (need_db) db = sums;
    return first_order_only({dx, dw, db}, create_graph, kArgs);
  }
};

Outputs run(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
            const OptTensor& w_data, const OptTensor& w_data_t, const OptTensor& w_scale_inv,
            const OptTensor& w_scale, const Scaling& s, at::ScalarType out_dtype, bool autograd) {
  check_word(s.grad_word, "grad_word");
  if (!autograd) {  // below autograd (inference mode): the forward alone
    auto [y, xq_t, x_scale_inv, w] =
        forward(x, weight, bias, w_data, w_data_t, w_scale_inv, w_scale, s, out_dtype);
    if (w_data.has_value()) w.clear();
    return {y, w};
  }
  return split_outputs(LinearPerTensor::apply(x, weight, bias, w_data, w_data_t, w_scale_inv,
                                              w_scale, s, out_dtype));
}

template <bool kAutograd>
Outputs linear_current(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                       const OptTensor& w_data, const OptTensor& w_data_t,
                       const OptTensor& w_scale_inv, const OptTensor& w_scale,
                       const at::Tensor& grad_word, at::ScalarType fwd_dtype,
                       at::ScalarType bwd_dtype, double margin, double grad_margin,
                       bool power_of_two, at::ScalarType out_dtype) {
  Scaling s{fwd_dtype, bwd_dtype, margin, grad_margin, power_of_two, grad_word, grad_word};
  return run(x, weight, bias, w_data, w_data_t, w_scale_inv, w_scale, s, out_dtype, kAutograd);
}

template <bool kAutograd>
Outputs linear_delayed(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                       const OptTensor& w_data, const OptTensor& w_data_t,
                       const OptTensor& w_scale_inv, const OptTensor& w_scale,
                       at::TensorList input_role, at::TensorList weight_role,
                       at::TensorList grad_role, const at::Tensor& grad_word,
                       const at::Tensor& recording_word, at::ScalarType fwd_dtype,
                       at::ScalarType bwd_dtype, double margin, double grad_margin,
                       bool power_of_two, int64_t interval, c10::string_view algo,
                       double ema_alpha, double percentile, bool live, bool weight_warm,
                       bool input_warm, bool grad_warm, at::ScalarType out_dtype) {
  check_word(recording_word, "recording_word");
  TORCH_CHECK(input_role.size() == 7 && weight_role.size() == 7 && grad_role.size() == 7,
              "fp8ops_step: each delayed-scaling role has seven buffers");
  Scaling s{fwd_dtype, bwd_dtype, margin, grad_margin, power_of_two, grad_word, recording_word};
  s.delayed = true;
  s.input_role = input_role.vec();
  s.weight_role = weight_role.vec();
  s.grad_role = grad_role.vec();
  s.interval = interval;
  s.algo = std::string(algo);
  s.ema_alpha = ema_alpha;
  s.percentile = percentile;
  s.live = live;
  s.weight_warm = weight_warm;
  s.input_warm = input_warm;
  s.grad_warm = grad_warm;
  return run(x, weight, bias, w_data, w_data_t, w_scale_inv, w_scale, s, out_dtype, kAutograd);
}

}  // namespace
}  // namespace fp8ops_step

TORCH_LIBRARY(fp8ops_step, m) {
  m.def(
      "linear_current(Tensor x, Tensor weight, Tensor? bias, Tensor? w_data, Tensor? w_data_t, "
      "Tensor? w_scale_inv, Tensor? w_scale, Tensor grad_word, ScalarType fwd_dtype, "
      "ScalarType bwd_dtype, float margin, float grad_margin, bool power_of_two, "
      "ScalarType out_dtype) -> (Tensor, Tensor[])");
  m.def(
      "linear_delayed(Tensor x, Tensor weight, Tensor? bias, Tensor? w_data, Tensor? w_data_t, "
      "Tensor? w_scale_inv, Tensor? w_scale, Tensor(a!)[] input_role, Tensor(b!)[] weight_role, "
      "Tensor(c!)[] grad_role, Tensor grad_word, Tensor recording_word, ScalarType fwd_dtype, "
      "ScalarType bwd_dtype, float margin, float grad_margin, bool power_of_two, int interval, "
      "str algo, float ema_alpha, float percentile, bool live, bool weight_warm, "
      "bool input_warm, bool grad_warm, ScalarType out_dtype) -> (Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(fp8ops_step, Autograd, m) {
  m.impl("linear_current", &fp8ops_step::linear_current<true>);
  m.impl("linear_delayed", &fp8ops_step::linear_delayed<true>);
}

TORCH_LIBRARY_IMPL(fp8ops_step, CompositeExplicitAutograd, m) {
  m.impl("linear_current", &fp8ops_step::linear_current<false>);
  m.impl("linear_delayed", &fp8ops_step::linear_delayed<false>);
}

// Importing the module loads the library, whose static initializers register the ops above.
extern "C" PyObject* PyInit__step(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_step", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
