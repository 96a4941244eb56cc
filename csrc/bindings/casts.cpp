// Torch bindings of the casts (cast.cu, block_quant.cu, blockwise_pair.cu, mx_pair.cu,
// scaling.cu, stats.cu, transpose.cu): argument checks, device guard, current stream, outputs.
#include "common.h"

namespace {
using namespace fp8ops_bind;

// out = max |xc| (0 for an empty xc).
at::Tensor amax_into(const at::Tensor& xc, const at::Tensor& out) {
  if (xc.numel() == 0) return out.zero_();
  fp8ops::launch_amax({xc.data_ptr(), to_dtype(xc.scalar_type()), xc.numel(), out.data_ptr<float>()}, stream_of(xc));
  return out;
}

at::Tensor amax_cuda(const at::Tensor& x) {
  check_input(x, "x");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous();
  return amax_into(xc, at::empty({}, x.options().dtype(at::kFloat)));
}

void check_fp8(const at::Tensor& t, const char* name) {
  check_cuda(t, name);
  FP8OPS_CHECK(t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2,
              "fp8ops: ", name, " must be float8_e4m3fn or float8_e5m2, got ", dtype_str(t.scalar_type()));
}

void check_fp8_dtype(at::ScalarType t, const char* name) {
  FP8OPS_CHECK(t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2,
              "fp8ops: ", name, " must be torch.float8_e4m3fn or torch.float8_e5m2, got ", dtype_str(t));
}

void check_out_dtype(at::ScalarType t) {
  FP8OPS_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf,
              "fp8ops: out_dtype must be float32, bfloat16 or float16, got ", dtype_str(t));
}

// A one-element float32 tensor on x's device (the per-tensor scale / scale_inv), contiguous.
at::Tensor cast_scale_f32(const at::Tensor& s, const at::Tensor& x, const char* name) {
  check_cuda(s, name);
  check_same_device(s, x, name, "the input");
  FP8OPS_CHECK(s.numel() == 1, "fp8ops: ", name, " must have one element, got shape ", shape_str(s));
  FP8OPS_CHECK(s.is_floating_point(), "fp8ops: ", name, " must be floating point, got ", dtype_str(s.scalar_type()));
  return s.to(at::kFloat).contiguous();
}

// [rows, cols] of the 2-D view [prod(shape[:-1]), shape[-1]] (a 0-dim tensor is [1, 1]).
std::pair<int64_t, int64_t> rows_cols(const at::Tensor& x) {
  if (x.dim() == 0) return {1, 1};
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return {rows, x.size(-1)};
}

// The random-stream buffer int64 [seed, offset] on x's device (nullptr without one).
const int64_t* rng_ptr(const std::optional<at::Tensor>& rng, const at::Tensor& x) {
  if (!rng) return nullptr;
  check_cuda(*rng, "rng");
  check_same_device(*rng, x, "rng", "x");
  FP8OPS_CHECK(rng->scalar_type() == at::kLong && rng->numel() == 2 && rng->is_contiguous(),
              "fp8ops: rng must be a contiguous int64 tensor [seed, offset], got ", dtype_str(rng->scalar_type()),
              " ", shape_str(*rng));
  return rng->data_ptr<int64_t>();
}

// The cast's outputs: data in x's shape, and data_t [cols, rows] (empty [0] without transpose).
std::pair<at::Tensor, at::Tensor> fp8_outputs(const at::Tensor& xc, at::ScalarType dtype, bool transpose) {
  auto [rows, cols] = rows_cols(xc);
  at::Tensor data = at::empty(xc.sizes(), xc.options().dtype(dtype));
  const std::vector<int64_t> tshape = transpose ? std::vector<int64_t>{cols, rows} : std::vector<int64_t>{0};
  return {data, at::empty(tshape, xc.options().dtype(dtype))};
}

// The launch parameters of the cast of xc into data / data_t; the scale and amax are the caller's.
fp8ops::QuantizeParams cast_params(const at::Tensor& xc, at::ScalarType dtype, bool transpose, bool stochastic,
                                   int64_t seed, int64_t offset, const std::optional<at::Tensor>& rng,
                                   const at::Tensor& data, const at::Tensor& data_t) {
  fp8ops::QuantizeParams p{};
  p.x = xc.data_ptr();
  p.x_dtype = to_dtype(xc.scalar_type());
  p.n = xc.numel();
  p.cols = rows_cols(xc).second;
  p.out_dtype = to_dtype(dtype);
  p.data = static_cast<uint8_t*>(data.data_ptr());
  p.data_t = transpose ? static_cast<uint8_t*>(data_t.data_ptr()) : nullptr;
  p.stochastic = stochastic;
  p.seed = static_cast<uint64_t>(seed);  // two's complement bits, as the emulation's masks
  p.offset = static_cast<uint64_t>(offset);
  p.rng = rng_ptr(rng, xc);
  return p;
}

// data (and data_t) of x (rounded to via first, when given) cast with the scale on the device;
// amax_out receives max |x|.
std::pair<at::Tensor, at::Tensor> cast_with(const at::Tensor& xc, const at::Tensor& scale, at::ScalarType dtype,
                                            bool transpose, bool stochastic, int64_t seed, int64_t offset,
                                            const std::optional<at::Tensor>& rng, const at::Tensor& amax_out,
                                            std::optional<at::ScalarType> via = std::nullopt) {
  auto [data, data_t] = fp8_outputs(xc, dtype, transpose);
  fp8ops::QuantizeParams p = cast_params(xc, dtype, transpose, stochastic, seed, offset, rng, data, data_t);
  if (via) p.via = to_dtype(*via);
  if (xc.numel() == 0) {
    amax_out.zero_();
  } else {
    p.scale = scale.data_ptr<float>();
    p.amax = amax_out.data_ptr<float>();
    fp8ops::launch_quantize(p, stream_of(xc));
  }
  return {data, data_t};
}

// A fused stochastic cast that read its random stream from rng advances the offset by one.
void advance_rng(bool stochastic, const std::optional<at::Tensor>& rng) {
  if (stochastic && rng) rng->narrow(0, 1, 1).add_(1);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x, const at::Tensor& scale,
                                                             at::ScalarType dtype, bool transpose,
                                                             bool stochastic, int64_t seed, int64_t offset,
                                                             const std::optional<at::Tensor>& rng,
                                                             std::optional<at::ScalarType> via) {
  check_input(x, "x");
  check_fp8_dtype(dtype, "dtype");
  FP8OPS_CHECK(!via || *via == at::kFloat || *via == at::kBFloat16 || *via == at::kHalf,
               "fp8ops: via must be float32, bfloat16 or float16, got ", dtype_str(*via));
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous(), s = cast_scale_f32(scale, x, "scale");
  at::Tensor amax = at::empty({}, xc.options().dtype(at::kFloat));
  auto [data, data_t] = cast_with(xc, s, dtype, transpose, stochastic, seed, offset, rng, amax, via);
  return {data, data_t, amax};  // (quantize only reads rng: the fused ops advance it)
}

at::Tensor dequantize_cuda(const at::Tensor& data, const at::Tensor& scale_inv, at::ScalarType out_dtype) {
  check_fp8(data, "data");
  check_out_dtype(out_dtype);
  c10::cuda::CUDAGuard guard(data.device());
  at::Tensor dc = data.contiguous(), s = cast_scale_f32(scale_inv, data, "scale_inv");
  at::Tensor out = at::empty(dc.sizes(), dc.options().dtype(out_dtype));
  if (dc.numel() == 0) return out;
  fp8ops::launch_dequantize({static_cast<const uint8_t*>(dc.data_ptr()), to_dtype(dc.scalar_type()), dc.numel(),
                             s.data_ptr<float>(), out.data_ptr(), to_dtype(out_dtype)},
                            stream_of(dc));
  return out;
}

// data^T, contiguous: a 2-D FP8 (or uint8) tensor's transposed copy in one tiled kernel.
at::Tensor transpose_fp8_cuda(const at::Tensor& data) {
  check_cuda(data, "data");
  const auto t = data.scalar_type();
  FP8OPS_CHECK(t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2 || t == at::kByte,
              "fp8ops: transpose_fp8: data must be float8_e4m3fn, float8_e5m2 or uint8, got ", dtype_str(t));
  FP8OPS_CHECK(data.dim() == 2, "fp8ops: transpose_fp8: data must be 2-D, got shape ", shape_str(data));
  c10::cuda::CUDAGuard guard(data.device());
  at::Tensor dc = data.contiguous();
  at::Tensor out = at::empty({dc.size(1), dc.size(0)}, dc.options());
  if (dc.numel() == 0) return out;
  fp8ops::launch_transpose_bytes({static_cast<const uint8_t*>(dc.data_ptr()), dc.size(0), dc.size(1),
                                  static_cast<uint8_t*>(out.data_ptr())},
                                 stream_of(dc));
  return out;
}

// x viewed as [outer, len, inner] around `axis` (normalized), checking the MX block.
struct MxView {
  int64_t axis, outer = 1, len, inner = 1;
};
MxView mx_view(const at::Tensor& x, int64_t block_size, int64_t axis, const char* op) {
  FP8OPS_CHECK(x.dim() >= 1, "fp8ops: ", op, ": needs a tensor with at least one dimension");
  FP8OPS_CHECK(axis >= -x.dim() && axis < x.dim(), "fp8ops: ", op, ": axis ", axis,
              " out of range for a tensor of ", x.dim(), " dimensions");
  FP8OPS_CHECK(block_size > 0 && block_size <= (1 << 20), "fp8ops: ", op, ": block_size must be in [1, 2^20], got ",
              block_size);
  MxView v;
  v.axis = axis < 0 ? axis + x.dim() : axis;
  v.len = x.size(v.axis);
  FP8OPS_CHECK(v.len % block_size == 0, "fp8ops: ", op, ": the length along axis ", axis, " (", v.len,
              ") must be a multiple of block_size (", block_size, ")");
  for (int64_t d = 0; d < v.axis; ++d) v.outer *= x.size(d);
  for (int64_t d = v.axis + 1; d < x.dim(); ++d) v.inner *= x.size(d);
  return v;
}

std::tuple<at::Tensor, at::Tensor> quantize_mx_cuda(const at::Tensor& x, at::ScalarType dtype, int64_t block_size,
                                                    int64_t axis, bool rceil) {
  check_input(x, "x");
  check_fp8_dtype(dtype, "dtype");
  const MxView v = mx_view(x, block_size, axis, "quantize_mx");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous();
  std::vector<int64_t> sshape(xc.sizes().begin(), xc.sizes().end());
  sshape[v.axis] = v.len / block_size;
  at::Tensor data = at::empty(xc.sizes(), xc.options().dtype(dtype));
  at::Tensor scales = at::empty(sshape, xc.options().dtype(at::kByte));
  if (xc.numel() == 0) return {data, scales};
  fp8ops::QuantizeMxParams p{};
  p.x = xc.data_ptr();
  p.x_dtype = to_dtype(xc.scalar_type());
  p.outer = v.outer;
  p.len = v.len;
  p.inner = v.inner;
  p.block_size = static_cast<int>(block_size);
  p.out_dtype = to_dtype(dtype);
  p.rceil = rceil;
  p.data = static_cast<uint8_t*>(data.data_ptr());
  p.scales = scales.data_ptr<uint8_t>();
  fp8ops::launch_quantize_mx(p, stream_of(xc));
  return {data, scales};
}

at::Tensor dequantize_mx_cuda(const at::Tensor& data, const at::Tensor& scales, int64_t block_size, int64_t axis,
                              at::ScalarType out_dtype) {
  check_fp8(data, "data");
  check_cuda(scales, "scales");
  check_same_device(data, scales, "data", "scales");
  check_out_dtype(out_dtype);
  FP8OPS_CHECK(scales.scalar_type() == at::kByte, "fp8ops: dequantize_mx: scales must be uint8 (E8M0 bytes), got ",
              dtype_str(scales.scalar_type()));
  const MxView v = mx_view(data, block_size, axis, "dequantize_mx");
  std::vector<int64_t> sshape(data.sizes().begin(), data.sizes().end());
  sshape[v.axis] = v.len / block_size;
  FP8OPS_CHECK(scales.sizes() == at::IntArrayRef(sshape), "fp8ops: dequantize_mx: scales must have shape ",
              shape_str(sshape), " for data of shape ", shape_str(data), ", got ", shape_str(scales));
  c10::cuda::CUDAGuard guard(data.device());
  at::Tensor dc = data.contiguous(), sc = scales.contiguous();
  at::Tensor out = at::empty(dc.sizes(), dc.options().dtype(out_dtype));
  if (dc.numel() == 0) return out;
  fp8ops::DequantizeMxParams p{};
  p.data = static_cast<const uint8_t*>(dc.data_ptr());
  p.data_dtype = to_dtype(dc.scalar_type());
  p.scales = sc.data_ptr<uint8_t>();
  p.outer = v.outer;
  p.len = v.len;
  p.inner = v.inner;
  p.block_size = static_cast<int>(block_size);
  p.out = out.data_ptr();
  p.out_dtype = to_dtype(out_dtype);
  fp8ops::launch_dequantize_mx(p, stream_of(dc));
  return out;
}

void check_block(int64_t block_rows, int64_t block_cols, const char* op) {
  FP8OPS_CHECK(block_rows > 0 && block_cols > 0 && block_rows * block_cols <= (int64_t(1) << 24), "fp8ops: ", op,
              ": block_rows and block_cols must be positive with at most 2^24 elements per block, got ",
              block_rows, " x ", block_cols);
}

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cuda(const at::Tensor& x, at::ScalarType dtype,
                                                           int64_t block_rows, int64_t block_cols,
                                                           bool power_of_two) {
  check_input(x, "x");
  check_fp8_dtype(dtype, "dtype");
  check_block(block_rows, block_cols, "quantize_blockwise");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous();
  auto [rows, cols] = rows_cols(xc);
  at::Tensor data = at::empty(xc.sizes(), xc.options().dtype(dtype));
  at::Tensor scale_inv = at::empty({(rows + block_rows - 1) / block_rows, (cols + block_cols - 1) / block_cols},
                                   xc.options().dtype(at::kFloat));
  if (xc.numel() == 0) return {data, scale_inv};
  fp8ops::QuantizeBlockwiseParams p{};
  p.x = xc.data_ptr();
  p.x_dtype = to_dtype(xc.scalar_type());
  p.rows = rows;
  p.cols = cols;
  p.block_rows = static_cast<int>(block_rows);
  p.block_cols = static_cast<int>(block_cols);
  p.out_dtype = to_dtype(dtype);
  p.power_of_two = power_of_two;
  p.data = static_cast<uint8_t*>(data.data_ptr());
  p.scale_inv = scale_inv.data_ptr<float>();
  fp8ops::launch_quantize_blockwise(p, stream_of(xc));
  return {data, scale_inv};
}

at::Tensor dequantize_blockwise_cuda(const at::Tensor& data, const at::Tensor& scale_inv, int64_t block_rows,
                                     int64_t block_cols, at::ScalarType out_dtype) {
  check_fp8(data, "data");
  check_cuda(scale_inv, "scale_inv");
  check_same_device(data, scale_inv, "data", "scale_inv");
  check_out_dtype(out_dtype);
  check_block(block_rows, block_cols, "dequantize_blockwise");
  auto [rows, cols] = rows_cols(data);
  const int64_t rb = (rows + block_rows - 1) / block_rows, cb = (cols + block_cols - 1) / block_cols;
  FP8OPS_CHECK(scale_inv.dim() == 2 && scale_inv.size(0) == rb && scale_inv.size(1) == cb,
              "fp8ops: dequantize_blockwise: scale_inv must have shape [", rb, ", ", cb, "] for data of shape ",
              shape_str(data), " and blocks ", block_rows, "x", block_cols, ", got ", shape_str(scale_inv));
  FP8OPS_CHECK(scale_inv.is_floating_point(), "fp8ops: dequantize_blockwise: scale_inv must be floating point, got ",
              dtype_str(scale_inv.scalar_type()));
  c10::cuda::CUDAGuard guard(data.device());
  at::Tensor dc = data.contiguous(), sc = scale_inv.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(dc.sizes(), dc.options().dtype(out_dtype));
  if (dc.numel() == 0) return out;
  fp8ops::DequantizeBlockwiseParams p{};
  p.data = static_cast<const uint8_t*>(dc.data_ptr());
  p.data_dtype = to_dtype(dc.scalar_type());
  p.rows = rows;
  p.cols = cols;
  p.block_rows = static_cast<int>(block_rows);
  p.block_cols = static_cast<int>(block_cols);
  p.scale_inv = sc.data_ptr<float>();
  p.out = out.data_ptr();
  p.out_dtype = to_dtype(out_dtype);
  fp8ops::launch_dequantize_blockwise(p, stream_of(dc));
  return out;
}

// Checks the delayed-scaling buffers and arguments; fills the update's inputs and settings (the
// caller sets the pointers it passes: copies, or the buffers themselves for an update in place).
fp8ops::DelayedScaleParams delayed_params(const char* op, const at::Tensor& amax_history, const at::Tensor& scale,
                                          const at::Tensor& amax_rep, const at::Tensor& pending_amax,
                                          const at::Tensor& step, double fp8_max, double margin, int64_t interval,
                                          c10::string_view algo, double ema_alpha, double percentile,
                                          bool power_of_two) {
  const std::pair<const at::Tensor*, const char*> f32s[] = {
      {&amax_history, "amax_history"}, {&scale, "scale"}, {&amax_rep, "amax_rep"}, {&pending_amax, "pending_amax"}};
  for (const auto& [t, name] : f32s) {
    check_cuda(*t, name);
    check_same_device(*t, amax_history, name, "amax_history");
    FP8OPS_CHECK(t->scalar_type() == at::kFloat, "fp8ops: ", op, ": ", name, " must be float32, got ",
                dtype_str(t->scalar_type()));
    FP8OPS_CHECK(t == &amax_history || t->numel() == 1, "fp8ops: ", op, ": ", name,
                " must have one element, got shape ", shape_str(*t));
  }
  check_cuda(step, "step");
  check_same_device(step, amax_history, "step", "amax_history");
  FP8OPS_CHECK(!step.is_floating_point() && !step.is_complex() && step.scalar_type() != at::kBool &&
                  step.numel() == 1,
              "fp8ops: ", op, ": step must be a one-element integer tensor, got ", dtype_str(step.scalar_type()), " ",
              shape_str(step));
  FP8OPS_CHECK(amax_history.dim() == 1 && amax_history.numel() >= 1 && amax_history.numel() <= fp8ops::kMaxHistory,
              "fp8ops: ", op, ": amax_history must be 1-D with 1 to ", fp8ops::kMaxHistory,
              " entries (the CUDA kernel sorts it in one block), got shape ", shape_str(amax_history));
  FP8OPS_CHECK(interval >= 1, "fp8ops: ", op, ": interval must be >= 1, got ", interval);
  fp8ops::AmaxAlgo a;
  if (algo == "max") a = fp8ops::AmaxAlgo::kMax;
  else if (algo == "most_recent") a = fp8ops::AmaxAlgo::kMostRecent;
  else if (algo == "ema") a = fp8ops::AmaxAlgo::kEma;
  else if (algo == "percentile") a = fp8ops::AmaxAlgo::kPercentile;
  else FP8OPS_CHECK(false, "fp8ops: ", op, ": unknown amax_compute_algo '", std::string(algo),
                   "'; expected one of max, most_recent, ema, percentile");
  // rank ceil(p / 100 * n) must stay within the n filled slots (the kernel indexes shared memory with it)
  FP8OPS_CHECK(a != fp8ops::AmaxAlgo::kPercentile || percentile <= 100.0, "fp8ops: ", op,
              ": percentile must be at most 100, got ", percentile);
  fp8ops::DelayedScaleParams p{};
  p.history_len = static_cast<int>(amax_history.numel());
  p.interval = interval;
  p.algo = a;
  p.fp8_max = static_cast<float>(fp8_max);  // the emulation's torch.tensor(fp8_max, float32)
  p.margin = static_cast<float>(margin);
  p.ema_a = static_cast<float>(ema_alpha);
  p.ema_b = static_cast<float>(1.0 - ema_alpha);  // difference in double, as in Python
  p.percentile_q = percentile / 100.0;
  p.power_of_two = power_of_two;
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> delayed_scale_update_cuda(
    const at::Tensor& amax_history, const at::Tensor& scale, const at::Tensor& amax_rep,
    const at::Tensor& pending_amax, const at::Tensor& step, double fp8_max, double margin, int64_t interval,
    c10::string_view algo, double ema_alpha, double percentile, bool power_of_two) {
  fp8ops::DelayedScaleParams p = delayed_params("delayed_scale_update", amax_history, scale, amax_rep, pending_amax,
                                                step, fp8_max, margin, interval, algo, ema_alpha, percentile,
                                                power_of_two);
  c10::cuda::CUDAGuard guard(amax_history.device());
  at::Tensor hist = amax_history.contiguous(), st = step.to(at::kLong).contiguous();
  at::Tensor out_hist = at::empty_like(hist), out_scale = at::empty_like(scale),
             out_scale_inv = at::empty_like(scale), out_rep = at::empty_like(amax_rep),
             out_pending = at::empty_like(pending_amax);
  p.amax_history = hist.data_ptr<float>();
  p.scale = scale.data_ptr<float>();  // one element: contiguous enough
  p.amax_rep = amax_rep.data_ptr<float>();
  p.pending_amax = pending_amax.data_ptr<float>();
  p.step = st.data_ptr<int64_t>();
  p.out_history = out_hist.data_ptr<float>();
  p.out_scale = out_scale.data_ptr<float>();
  p.out_scale_inv = out_scale_inv.data_ptr<float>();
  p.out_amax_rep = out_rep.data_ptr<float>();
  p.out_pending = out_pending.data_ptr<float>();
  fp8ops::launch_delayed_scale_update(p, stream_of(hist));
  return {out_hist, out_scale, out_scale_inv, out_rep, out_pending};
}

// ---- fused per-tensor casts: scale math and amax bookkeeping in the cast's one call ----------
// (fp8ops/ops/fused.py is their definition; the kernels are those of the unfused ops.)
using FusedCast = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Sums over the rows of x's 2-D view in float32, rounded to sum_dtype (empty float32 without one).
at::Tensor column_sums(const at::Tensor& xc, std::optional<at::ScalarType> sum_dtype) {
  if (!sum_dtype) return at::empty({0}, xc.options().dtype(at::kFloat));
  FP8OPS_CHECK(xc.dim() >= 1, "fp8ops: column sums need a tensor with at least one dimension");
  auto [rows, cols] = rows_cols(xc);
  return at::sum(xc.reshape({rows, cols}), {0}, false, at::kFloat).to(*sum_dtype);
}

// out_scale / out_scale_inv of a cast: from amax (current scaling) or a copy of scale.
void cast_scale(const float* amax, const float* scale, at::ScalarType dtype, double margin, bool power_of_two,
                const at::Tensor& out_scale, const at::Tensor& out_scale_inv, cudaStream_t stream) {
  fp8ops::CastScaleParams p{};
  p.amax = amax;
  p.scale = scale;
  p.fp8_max = fp8_max_of(dtype);
  p.margin = static_cast<float>(margin);
  p.power_of_two = power_of_two;
  p.out_scale = out_scale.data_ptr<float>();
  p.out_scale_inv = out_scale_inv.data_ptr<float>();
  fp8ops::launch_cast_scale(p, stream);
}


FusedCast quantize_current_cuda(const at::Tensor& x, at::ScalarType dtype, double margin, bool power_of_two,
                                bool transpose, std::optional<at::ScalarType> sum_dtype, bool stochastic, int64_t seed,
                                int64_t offset, const std::optional<at::Tensor>& rng) {
  check_input(x, "x");
  check_fp8_dtype(dtype, "dtype");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous();
  const auto f32 = xc.options().dtype(at::kFloat);
  at::Tensor amax = at::empty({}, f32), scale = at::empty({}, f32), scale_inv = at::empty({}, f32);
  amax_into(xc, amax);
  if (xc.numel() == 0) {
    cast_scale(amax.data_ptr<float>(), nullptr, dtype, margin, power_of_two, scale, scale_inv, stream_of(xc));
    auto [data, data_t] = cast_with(xc, scale, dtype, transpose, stochastic, seed, offset, rng, amax);
    return {data, data_t, scale, scale_inv, column_sums(xc, sum_dtype)};
  }
  // one launch after the amax: the cast takes its scale from the amax and publishes it
  auto [data, data_t] = fp8_outputs(xc, dtype, transpose);
  fp8ops::QuantizeParams p = cast_params(xc, dtype, transpose, stochastic, seed, offset, rng, data, data_t);
  take_scale_from_amax(p, amax, dtype, margin, power_of_two, scale, scale_inv);
  fp8ops::launch_quantize(p, stream_of(xc));
  advance_rng(stochastic, rng);
  return {data, data_t, scale, scale_inv, column_sums(xc, sum_dtype)};
}

FusedCast quantize_delayed_cuda(const at::Tensor& x, const at::Tensor& amax_history, const at::Tensor& scale,
                                const at::Tensor& scale_inv, const at::Tensor& amax_rep, const at::Tensor& pending_amax,
                                const at::Tensor& step, const at::Tensor& nonfinite_count, at::ScalarType dtype,
                                double margin, int64_t interval, c10::string_view algo, double ema_alpha,
                                double percentile, bool power_of_two, bool update, bool warm, bool record,
                                bool transpose, std::optional<at::ScalarType> sum_dtype, bool stochastic, int64_t seed,
                                int64_t offset, const std::optional<at::Tensor>& rng) {
  const char* op = "quantize_delayed";
  check_input(x, "x");
  check_fp8_dtype(dtype, "dtype");
  fp8ops::DelayedScaleParams p = delayed_params(op, amax_history, scale, amax_rep, pending_amax, step,
                                                fp8_max_of(dtype), margin, interval, algo, ema_alpha, percentile,
                                                power_of_two);
  check_same_device(amax_history, x, "amax_history", "x");
  // the buffers change in place: each must be the tensor itself, not a copy
  FP8OPS_CHECK(amax_history.is_contiguous(), "fp8ops: ", op, ": amax_history must be contiguous");
  const auto check_scalar = [&](const at::Tensor& t, const char* name, at::ScalarType type) {
    check_cuda(t, name);
    check_same_device(t, x, name, "x");
    FP8OPS_CHECK(t.scalar_type() == type && t.numel() == 1, "fp8ops: ", op, ": ", name, " must be a one-element ",
                dtype_str(type), " tensor, got ", dtype_str(t.scalar_type()), " ", shape_str(t));
  };
  check_scalar(scale_inv, "scale_inv", at::kFloat);
  check_scalar(step, "step", at::kLong);
  check_scalar(nonfinite_count, "nonfinite_count", at::kLong);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous();
  cudaStream_t stream = stream_of(xc);
  if (update) {  // step += 1, then the state machine, in place
    p.amax_history = amax_history.data_ptr<float>();
    p.scale = scale.data_ptr<float>();
    p.amax_rep = amax_rep.data_ptr<float>();
    p.pending_amax = pending_amax.data_ptr<float>();
    p.step = step.data_ptr<int64_t>();
    p.step_inout = step.data_ptr<int64_t>();
    p.out_history = amax_history.data_ptr<float>();
    p.out_scale = scale.data_ptr<float>();
    p.out_scale_inv = scale_inv.data_ptr<float>();
    p.out_amax_rep = amax_rep.data_ptr<float>();
    p.out_pending = pending_amax.data_ptr<float>();
    fp8ops::launch_delayed_scale_update(p, stream);
  }
  const auto f32 = xc.options().dtype(at::kFloat);
  at::Tensor used = at::empty({}, f32), used_inv = at::empty({}, f32);
  if (warm || xc.numel() == 0) {  // the warm start's amax comes first (its first step only)
    at::Tensor amax = at::empty({}, f32);
    if (warm) amax_into(xc, amax);
    cast_scale(warm ? amax.data_ptr<float>() : nullptr, scale.data_ptr<float>(), dtype, margin, power_of_two, used,
               used_inv, stream);
    auto [data, data_t] = cast_with(xc, used, dtype, transpose, stochastic, seed, offset, rng, amax);
    advance_rng(stochastic, rng);
    if (record) {
      fp8ops::launch_record_amax({amax.data_ptr<float>(), pending_amax.data_ptr<float>(),
                                  nonfinite_count.data_ptr<int64_t>()},
                                 stream);
    }
    return {data, data_t, used, used_inv, column_sums(xc, sum_dtype)};
  }
  // one launch: the cast reads the role's scale, publishes it, and its last block records the amax
  auto [data, data_t] = fp8_outputs(xc, dtype, transpose);
  fp8ops::QuantizeParams c = cast_params(xc, dtype, transpose, stochastic, seed, offset, rng, data, data_t);
  c.scale = scale.data_ptr<float>();
  c.out_scale = used.data_ptr<float>();
  c.out_scale_inv = used_inv.data_ptr<float>();
  at::Tensor amax_done;  // [amax, count of finished blocks]: only a recording cast needs the amax
  if (record) {
    amax_done = at::empty({2}, f32);
    c.amax = amax_done.data_ptr<float>();
    c.pending_amax = pending_amax.data_ptr<float>();
    c.nonfinite_count = nonfinite_count.data_ptr<int64_t>();
    c.blocks_done = reinterpret_cast<unsigned*>(c.amax + 1);
  }
  fp8ops::launch_quantize(c, stream);
  advance_rng(stochastic, rng);
  return {data, data_t, used, used_inv, column_sums(xc, sum_dtype)};
}

// ---- fused block casts: the row-wise copy, the column-wise copy for the backward GEMMs and the
// column sums of a 2-D x in one call (one kernel each; MXFP8 with blocks other than 32: two
// quantizer launches on a padded copy)
void check_matrix(const at::Tensor& x, const char* op) {
  FP8OPS_CHECK(x.dim() == 2, "fp8ops: ", op, ": x must be 2-D [rows, cols], got shape ", shape_str(x));
}

FusedCast quantize_blockwise_pair_cuda(const at::Tensor& x, at::ScalarType dtype, bool power_of_two,
                                       std::optional<at::ScalarType> sum_dtype) {
  check_input(x, "x");
  check_matrix(x, "quantize_blockwise_pair");
  check_fp8_dtype(dtype, "dtype");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), cols = xc.size(1);
  const auto f32 = xc.options().dtype(at::kFloat);
  at::Tensor data = at::empty({rows, cols}, xc.options().dtype(dtype));
  at::Tensor data_t = at::empty({cols, rows}, xc.options().dtype(dtype));
  // the scales with their rows contiguous (what the GEMM reads): [blocks, rows] buffers, transposed
  at::Tensor scale_inv = at::empty({(cols + 127) / 128, rows}, f32).t();
  at::Tensor scale_inv_t = at::empty({(rows + 127) / 128, cols}, f32).t();
  fp8ops::QuantizeBlockwisePairParams p{};
  p.x = xc.data_ptr();
  p.x_dtype = to_dtype(xc.scalar_type());
  p.rows = rows;
  p.cols = cols;
  p.out_dtype = to_dtype(dtype);
  p.power_of_two = power_of_two;
  p.data = static_cast<uint8_t*>(data.data_ptr());
  p.scale_inv = scale_inv.data_ptr<float>();
  p.data_t = static_cast<uint8_t*>(data_t.data_ptr());
  p.scale_inv_t = scale_inv_t.data_ptr<float>();
  try {
    fp8ops::launch_quantize_blockwise_pair(p, stream_of(xc));
  } catch (const std::exception& e) {
    FP8OPS_CHECK(false, e.what());
  }
  return {data, scale_inv, data_t, scale_inv_t, column_sums(xc, sum_dtype)};
}

FusedCast quantize_mx_pair_cuda(const at::Tensor& x, at::ScalarType dtype, int64_t block_size, bool rceil,
                                std::optional<at::ScalarType> sum_dtype) {
  check_input(x, "x");
  check_matrix(x, "quantize_mx_pair");
  FP8OPS_CHECK(block_size > 0 && block_size <= (1 << 20), "fp8ops: quantize_mx_pair: block_size must be in [1, 2^20], got ",
              block_size);
  check_fp8_dtype(dtype, "dtype");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  const int64_t pad_m = (block_size - m % block_size) % block_size, pad_k = (block_size - k % block_size) % block_size;
  if (block_size == fp8ops::kMxPairBlock) {  // one kernel, one read of x, no padded copy
    const int64_t mp = m + pad_m, kp = k + pad_k;
    const auto bytes = xc.options().dtype(at::kByte);
    at::Tensor row = at::empty({m, kp}, xc.options().dtype(dtype)), row_scales = at::empty({m, kp / block_size}, bytes);
    at::Tensor col = at::empty({mp, kp}, xc.options().dtype(dtype)), col_scales = at::empty({mp / block_size, kp}, bytes);
    fp8ops::QuantizeMxPairParams p{};
    p.x = xc.data_ptr();
    p.x_dtype = to_dtype(xc.scalar_type());
    p.rows = m;
    p.cols = k;
    p.out_dtype = to_dtype(dtype);
    p.rceil = rceil;
    p.row_data = static_cast<uint8_t*>(row.data_ptr());
    p.row_scales = row_scales.data_ptr<uint8_t>();
    p.col_data = static_cast<uint8_t*>(col.data_ptr());
    p.col_scales = col_scales.data_ptr<uint8_t>();
    try {
      fp8ops::launch_quantize_mx_pair(p, stream_of(xc));
    } catch (const std::exception& e) {
      FP8OPS_CHECK(false, e.what());
    }
    return {row, row_scales, col, col_scales, column_sums(xc, sum_dtype)};
  }
  // zeros change neither a block's amax nor a product
  at::Tensor xp = pad_m || pad_k ? at::constant_pad_nd(xc, {0, pad_k, 0, pad_m}) : xc;
  auto [row, row_scales] = quantize_mx_cuda(xp.narrow(0, 0, m), dtype, block_size, 1, rceil);
  auto [col, col_scales] = quantize_mx_cuda(xp, dtype, block_size, 0, rceil);
  return {row, row_scales, col, col_scales, column_sums(xc, sum_dtype)};
}

// fp8ops.monitor's statistics of one cast (emulation.cast_stats): one kernel over the 2-D views
// of x and data ([rows, last dim], as the emulation's _as_2d), read in place with their strides.
std::tuple<at::Tensor, at::Tensor> cast_stats_cuda(const at::Tensor& x, const at::Tensor& data,
                                                   const at::Tensor& scale_inv, int64_t block_rows,
                                                   int64_t block_cols) {
  check_input(x, "x");
  check_fp8(data, "data");
  check_cuda(scale_inv, "scale_inv");
  check_same_device(data, x, "data", "x");
  check_same_device(scale_inv, x, "scale_inv", "x");
  auto [rows, cols] = rows_cols(x);
  auto [drows, dcols] = rows_cols(data);
  FP8OPS_CHECK(drows >= rows && dcols >= cols, "fp8ops: cast_stats: data ", shape_str(data),
               " is smaller than x ", shape_str(x), " (as [rows, last dim]: [", drows, ", ", dcols, "] < [", rows,
               ", ", cols, "])");
  const bool one = block_rows == 0 && block_cols == 0;
  FP8OPS_CHECK(one || (block_rows > 0 && block_cols > 0), "fp8ops: cast_stats: block_rows and block_cols must both "
               "be 0 (one scale) or positive, got ", block_rows, " and ", block_cols);
  const auto st = scale_inv.scalar_type();
  if (one) {
    FP8OPS_CHECK(scale_inv.numel() == 1 && scale_inv.is_floating_point(), "fp8ops: cast_stats: scale_inv must be "
                 "one floating-point value (blocks 0 x 0), got ", dtype_str(st), " ", shape_str(scale_inv));
  } else {
    const int64_t rb = (rows + block_rows - 1) / block_rows, cb = (cols + block_cols - 1) / block_cols;
    FP8OPS_CHECK(scale_inv.dim() == 2 && (scale_inv.is_floating_point() || st == at::kByte),
                 "fp8ops: cast_stats: block scale_inv must be 2-D, floating point (read as float32) or uint8 "
                 "(E8M0), got ", dtype_str(st), " ", shape_str(scale_inv));
    FP8OPS_CHECK(scale_inv.size(0) >= rb && scale_inv.size(1) >= cb, "fp8ops: cast_stats: scale_inv ",
                 shape_str(scale_inv), " must cover x's ", block_rows, "x", block_cols, " blocks: at least [", rb,
                 ", ", cb, "] for x of shape ", shape_str(x));
  }
  c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({rows, cols});
  const at::Tensor d2 = data.dim() == 2 ? data : data.reshape({drows, dcols});
  const at::Tensor s = st == at::kByte ? scale_inv : scale_inv.to(at::kFloat);  // (float32 as it is)
  at::Tensor counts = at::empty({3}, x.options().dtype(at::kLong));
  at::Tensor amax = at::empty({}, x.options().dtype(at::kFloat));
  fp8ops::CastStatsParams p{};
  p.x = x2.data_ptr();
  p.x_dtype = to_dtype(x2.scalar_type());
  p.rows = rows;
  p.cols = cols;
  p.x_stride0 = x2.stride(0);
  p.x_stride1 = x2.stride(1);
  p.data = static_cast<const uint8_t*>(d2.data_ptr());
  p.data_dtype = to_dtype(d2.scalar_type());
  p.data_stride0 = d2.stride(0);
  p.data_stride1 = d2.stride(1);
  p.scale_inv = s.data_ptr();
  p.scale_dtype = one || st != at::kByte ? fp8ops::DType::kFloat32 : fp8ops::DType::kUInt8;
  p.scale_stride0 = one ? 0 : s.stride(0);
  p.scale_stride1 = one ? 0 : s.stride(1);
  p.block_rows = block_rows;
  p.block_cols = block_cols;
  p.counts = counts.data_ptr<int64_t>();
  p.amax = amax.data_ptr<float>();
  try {
    fp8ops::launch_cast_stats(p, stream_of(x2));
  } catch (const std::exception& e) {
    FP8OPS_CHECK(false, e.what());
  }
  return {counts, amax};
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8ops, CUDA, m) {
  m.impl("amax", &amax_cuda);
  m.impl("quantize", &quantize_cuda);
  m.impl("dequantize", &dequantize_cuda);
  m.impl("transpose_fp8", &transpose_fp8_cuda);
  m.impl("quantize_mx", &quantize_mx_cuda);
  m.impl("dequantize_mx", &dequantize_mx_cuda);
  m.impl("quantize_blockwise", &quantize_blockwise_cuda);
  m.impl("dequantize_blockwise", &dequantize_blockwise_cuda);
  m.impl("delayed_scale_update", &delayed_scale_update_cuda);
  m.impl("quantize_current", &quantize_current_cuda);
  m.impl("quantize_delayed", &quantize_delayed_cuda);
  m.impl("quantize_blockwise_pair", &quantize_blockwise_pair_cuda);
  m.impl("quantize_mx_pair", &quantize_mx_pair_cuda);
  m.impl("cast_stats", &cast_stats_cuda);
}
