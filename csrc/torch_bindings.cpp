// The only torch-aware C++ in fp8ops: argument checks, device guard, current stream, output
// allocation, and the CUDA kernels' registration for the ops whose schemas fp8ops/ops/__init__.py
// defines.
#include <ATen/ATen.h>
#include <Python.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>
#include <type_traits>

#include "adamw.h"
#include "fp8ops.h"

namespace {

// Error text is built here with std::to_string, and TORCH_CHECK gets one finished string: an
// extension linked by a toolchain that copies parts of libstdc++ into it (devtoolset's
// libstdc++_nonshared.a) crashed (SIGSEGV in its own copy of ostream::_M_insert<long>) whenever a
// TORCH_CHECK message streamed a number (seen with torch 2.11 on an H100 machine).
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}
template <class... A>
std::string cat(const A&... parts) {
  std::string s;
  (append(s, parts), ...);
  return s;
}
#define FP8OPS_CHECK(cond, ...) TORCH_CHECK(cond, cat(__VA_ARGS__))

std::string shape_str(c10::ArrayRef<int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}
std::string shape_str(const at::Tensor& t) { return shape_str(t.sizes()); }
std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    case at::kFloat8_e5m2: return "float8_e5m2";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    default: return "dtype #" + std::to_string(static_cast<int>(t));
  }
}

fp8ops::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return fp8ops::DType::kFloat32;
    case at::kBFloat16: return fp8ops::DType::kBFloat16;
    case at::kHalf: return fp8ops::DType::kFloat16;
    case at::kFloat8_e4m3fn: return fp8ops::DType::kE4M3;
    case at::kFloat8_e5m2: return fp8ops::DType::kE5M2;
    case at::kByte: return fp8ops::DType::kUInt8;
    default: FP8OPS_CHECK(false, "fp8ops: unsupported dtype ", dtype_str(t));
  }
}

void check_cuda(const at::Tensor& t, const char* name) {
  FP8OPS_CHECK(t.is_cuda(), "fp8ops: ", name, " must be a CUDA tensor, got ", t.device().str());
}

void check_input(const at::Tensor& x, const char* name) {
  check_cuda(x, name);
  FP8OPS_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "fp8ops: ", name, " must be float32, bfloat16 or float16, got ", dtype_str(x.scalar_type()));
}

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

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

// ==== BEGIN cast bindings ====
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

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* na, const char* nb) {
  FP8OPS_CHECK(a.device() == b.device(), "fp8ops: ", na, " (", a.device().str(), ") and ", nb, " (",
              b.device().str(), ") must be on the same device");
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

float fp8_max_of(at::ScalarType dtype) { return dtype == at::kFloat8_e4m3fn ? 448.0f : 57344.0f; }

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
  p.scale_amax = amax.data_ptr<float>();
  p.fp8_max = fp8_max_of(dtype);
  p.margin = static_cast<float>(margin);
  p.power_of_two = power_of_two;
  p.out_scale = scale.data_ptr<float>();
  p.out_scale_inv = scale_inv.data_ptr<float>();
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
// ==== END cast bindings ====

// ==== BEGIN gemm bindings ====
bool has_cutlass_sm90() { return fp8ops::gemm_sm90_available(); }

// Compute capability as major * 10 + minor, cached per device (read once, no sync).
int device_cc(int dev) {
  static std::atomic<int> cache[64];
  FP8OPS_CHECK(dev >= 0 && dev < 64, "fp8ops: device index ", dev, " out of range");
  int cc = cache[dev].load(std::memory_order_relaxed);
  if (cc == 0) {
    int major = 0, minor = 0;
    cudaError_t e1 = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaError_t e2 = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    FP8OPS_CHECK(e1 == cudaSuccess && e2 == cudaSuccess, "fp8ops: cudaDeviceGetAttribute failed: ",
                cudaGetErrorString(e1 != cudaSuccess ? e1 : e2));
    cc = major * 10 + minor;
    cache[dev].store(cc, std::memory_order_relaxed);
  }
  return cc;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// The operand pairs the CUTLASS kernels are instantiated for: forward and gradient GEMMs.
bool cutlass_pair(const at::Tensor& a, const at::Tensor& b) {
  return b.scalar_type() == at::kFloat8_e4m3fn &&
         (a.scalar_type() == at::kFloat8_e4m3fn || a.scalar_type() == at::kFloat8_e5m2);
}

// A [rows, cols] FP8 operand as TMA wants it: K-major, ld a multiple of 16, 16-byte aligned base,
// zero-padded to [rows_pad, cols_pad]. Returns the input itself when it already qualifies.
at::Tensor tma_operand(const at::Tensor& x, int64_t rows_pad, int64_t cols_pad) {
  bool ok = x.size(0) == rows_pad && x.size(1) == cols_pad && x.stride(1) == 1 &&
            x.stride(0) >= cols_pad && x.stride(0) % 16 == 0 &&
            reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  if (ok) return x;
  // Byte views: zero-fill and copy without relying on FP8 kernels for fill_/copy_.
  at::Tensor out = at::zeros({rows_pad, cols_pad}, x.options().dtype(at::kByte));
  out.narrow(0, 0, x.size(0)).narrow(1, 0, x.size(1)).copy_(x.view(at::kByte));
  return out.view(x.scalar_type());
}

at::Tensor scalar_f32(const at::Tensor& s, const at::Tensor& like, const char* name) {
  check_cuda(s, name);
  FP8OPS_CHECK(s.device() == like.device(), "fp8ops: ", name, " must be on ", like.device().str());
  FP8OPS_CHECK(s.numel() == 1, "fp8ops: ", name, " must hold one element, got shape ", shape_str(s));
  // a 0-dim float32 scale (what the casts return) as it is: no view per call (host time)
  if (s.scalar_type() == at::kFloat && s.dim() == 0) return s;
  return s.to(at::kFloat).reshape({}).contiguous();
}

void check_gemm_args(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                     at::ScalarType out_dtype, const char* op) {
  check_cuda(a, "a");
  check_cuda(b, "b");
  FP8OPS_CHECK(a.device() == b.device(), "fp8ops.", op, ": a and b must be on the same device");
  FP8OPS_CHECK(a.dim() == 2 && b.dim() == 2, "fp8ops.", op, ": a [M,K] and b [N,K] must be 2-D, got ",
              shape_str(a), " and ", shape_str(b));
  FP8OPS_CHECK(a.size(1) == b.size(1), "fp8ops.", op, ": K mismatch: a ", shape_str(a), ", b ", shape_str(b));
  FP8OPS_CHECK(is_fp8(a.scalar_type()) && is_fp8(b.scalar_type()), "fp8ops.", op,
              ": a and b must be float8_e4m3fn or float8_e5m2, got ", dtype_str(a.scalar_type()), " and ",
              dtype_str(b.scalar_type()));
  FP8OPS_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat,
              "fp8ops.", op, ": out_dtype must be bfloat16, float16 or float32, got ", dtype_str(out_dtype));
  if (bias) {
    check_cuda(*bias, "bias");
    FP8OPS_CHECK(bias->device() == a.device(), "fp8ops.", op, ": bias must be on ", a.device().str());
    FP8OPS_CHECK(bias->dim() == 1 && bias->size(0) == b.size(0), "fp8ops.", op,
                ": bias must have shape [N] = [", b.size(0), "], got ", shape_str(*bias));
    FP8OPS_CHECK(bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16 ||
                    bias->scalar_type() == at::kHalf,
                "fp8ops.", op, ": bias must be float32, bfloat16 or float16, got ", dtype_str(bias->scalar_type()));
  }
}

// Float32 epilogue shared by the non-CUTLASS paths: (acc + bias) rounded once to out_dtype,
// as the emulation does.
at::Tensor finish(at::Tensor acc, const std::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  if (bias) acc = acc + bias->to(at::kFloat);
  return acc.to(out_dtype).contiguous();
}

// bias as float32 [n_pad], zeros past its end.
at::Tensor padded_bias(const at::Tensor& bias, int64_t n_pad) {
  at::Tensor f = bias.to(at::kFloat).contiguous();
  if (f.size(0) == n_pad) return f;
  at::Tensor out = at::zeros({n_pad}, f.options());
  out.narrow(0, 0, f.size(0)).copy_(f);
  return out;
}

// Output buffer whose leading dimension meets TMA's 16-byte rule; crop() returns [M, N] contiguous.
struct PaddedOut {
  at::Tensor buf;
  int64_t m, n;
  PaddedOut(int64_t rows, int64_t m_, int64_t n_, at::ScalarType dt, const at::Tensor& like) : m(m_), n(n_) {
    int64_t per16 = 16 / static_cast<int64_t>(c10::elementSize(dt));
    buf = at::empty({rows, round_up(n, per16)}, like.options().dtype(dt));
  }
  int64_t ld() const { return buf.size(1); }
  at::Tensor crop() const {
    if (buf.size(0) == m && buf.size(1) == n) return buf;
    return buf.narrow(0, 0, m).narrow(1, 0, n).contiguous();
  }
};

// A GEMM's workspace (none allocated for 0 bytes: the usual case, and an allocation per call).
at::Tensor workspace(size_t bytes, const at::Tensor& like) {
  if (bytes == 0) return at::Tensor();
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

at::Tensor gemm_cutlass_sm90(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa,
                             const at::Tensor& sb, const std::optional<at::Tensor>& bias,
                             at::ScalarType out_dtype, bool fast_accum) {
  // TMA needs 16-byte rows: K is padded to 16 and N to 16 bytes of output (zero rows of B and
  // zero bias entries make the padding columns, which crop() drops).
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  const fp8ops::Sm90Problem padded = fp8ops::sm90_padded_problem(M, N, K, to_dtype(out_dtype), false);
  const int64_t Np = padded.n, Kp = padded.k;
  at::Tensor ap = tma_operand(a, M, Kp), bp = tma_operand(b, Np, Kp);  // zero K padding adds 0
  at::Tensor bias_f = bias ? padded_bias(*bias, Np) : at::Tensor();
  PaddedOut out(M, M, N, out_dtype, a);
  fp8ops::GemmParams p{};
  p.a = ap.data_ptr();
  p.b = bp.data_ptr();
  p.a_dtype = to_dtype(a.scalar_type());
  p.b_dtype = to_dtype(b.scalar_type());
  p.out_dtype = to_dtype(out_dtype);
  p.m = M;
  p.n = Np;
  p.k = Kp;
  p.lda = ap.stride(0);
  p.ldb = bp.stride(0);
  p.ldd = out.ld();
  p.a_scale_inv = sa.data_ptr<float>();
  p.b_scale_inv = sb.data_ptr<float>();
  p.bias = bias ? bias_f.data_ptr<float>() : nullptr;
  p.d = out.buf.data_ptr();
  p.fast_accum = fast_accum;
  try {
    size_t ws_bytes = fp8ops::gemm_sm90_workspace_size(p);
    at::Tensor ws = workspace(ws_bytes, a);
    p.workspace = ws_bytes ? ws.data_ptr() : nullptr;
    p.workspace_bytes = ws_bytes;
    fp8ops::launch_gemm_sm90(p, stream_of(a));
  } catch (const std::exception& e) {
    FP8OPS_CHECK(false, e.what());
  }
  return out.crop();
}

// cc 8.9, 10.x+ and Hopper's promoted GEMMs: cuBLASLt through at::_scaled_mm (mat2 must be
// column-major: b.t() of a row-major b). K and N are padded to 16 as it requires. A bias is added
// here in float32 so the result is rounded once, like the emulation (_scaled_mm would round
// before adding it).
at::Tensor gemm_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa,
                          const at::Tensor& sb, const std::optional<at::Tensor>& bias,
                          at::ScalarType out_dtype, bool fast_accum) {
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  const int64_t Kp = round_up(K, 16), Np = round_up(N, 16);
  at::Tensor ap = tma_operand(a, M, Kp), bp = tma_operand(b, Np, Kp);
  at::ScalarType mm_dtype = bias ? at::kFloat : out_dtype;
  at::Tensor out = at::_scaled_mm(ap, bp.t(), sa, sb, std::nullopt, std::nullopt, mm_dtype, fast_accum);
  if (Np != N) out = out.narrow(1, 0, N);
  return bias ? finish(out, bias, out_dtype) : out.contiguous();
}

// Promoted accumulation (fast_accum=false: FP8Linear's dgrad and wgrad) on Hopper: cuBLASLt
// without fast accumulation, the same numerics class, measured faster than the CUTLASS promoted
// mainloop at 21 of 22 backward shapes (up to 2.2x on a long-K wgrad). FP8OPS_SM90_PROMOTED_GEMM
// =cutlass keeps the CUTLASS kernel, as a forced FP8OPS_SM90_GEMM_CONFIG does (benchmarks).
bool promoted_on_cutlass() {
  const char* config = std::getenv("FP8OPS_SM90_GEMM_CONFIG");
  if (config && *config) return true;
  const char* env = std::getenv("FP8OPS_SM90_PROMOTED_GEMM");
  if (!env || !*env) return false;
  const std::string v(env);
  FP8OPS_CHECK(v == "cutlass" || v == "cublaslt",
               "FP8OPS_SM90_PROMOTED_GEMM must be cublaslt or cutlass, got '", v, "'");
  return v == "cutlass";
}

at::Tensor gemm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                     const at::Tensor& b_scale_inv, const std::optional<at::Tensor>& bias,
                     at::ScalarType out_dtype, bool fast_accum) {
  check_gemm_args(a, b, bias, out_dtype, "gemm");
  c10::cuda::CUDAGuard guard(a.device());
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // float32 math
  at::Tensor sa = scalar_f32(a_scale_inv, a, "a_scale_inv");
  at::Tensor sb = scalar_f32(b_scale_inv, a, "b_scale_inv");
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  if (M == 0 || N == 0 || K == 0)  // nothing to launch: the emulation's (0 * alpha) + bias
    return finish(at::zeros({M, N}, a.options().dtype(at::kFloat)) * (sa * sb), bias, out_dtype);
  const int cc = device_cc(a.device().index());
  if (cc == 90 && cutlass_pair(a, b) && (fast_accum || promoted_on_cutlass()))
    return gemm_cutlass_sm90(a, b, sa, sb, bias, out_dtype, fast_accum);
  bool both_e5m2 = a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2;
  if ((cc == 89 || cc >= 90) && !both_e5m2)  // cuBLASLt has no E5M2 x E5M2
    return gemm_scaled_mm(a, b, sa, sb, bias, out_dtype, fast_accum);
  // Anything else (E5M2 x E5M2): exact upcast and a float32 matmul, the emulation's arithmetic.
  return finish(at::matmul(a.to(at::kFloat), b.to(at::kFloat).t()) * (sa * sb), bias, out_dtype);
}

// Per-element float32 scales of a blockwise operand: [R, Kb] (1x128) or [ceil(R/128), Kb]
// (128x128) expanded to [R, K].
at::Tensor expand_scales(const at::Tensor& s, int64_t rows, int64_t K) {
  at::Tensor f = s.to(at::kFloat);
  if (f.size(0) != rows) f = f.repeat_interleave(128, 0).narrow(0, 0, rows);
  return f.repeat_interleave(128, 1).narrow(1, 0, K);
}

at::Tensor gemm_blockwise_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                               const at::Tensor& b_scale_inv, const std::optional<at::Tensor>& bias,
                               at::ScalarType out_dtype) {
  check_gemm_args(a, b, bias, out_dtype, "gemm_blockwise");
  check_cuda(a_scale_inv, "a_scale_inv");
  check_cuda(b_scale_inv, "b_scale_inv");
  FP8OPS_CHECK(a_scale_inv.device() == a.device() && b_scale_inv.device() == a.device(),
              "fp8ops.gemm_blockwise: a_scale_inv and b_scale_inv must be on ", a.device().str());
  c10::cuda::CUDAGuard guard(a.device());
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // float32 math
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1), Kb = (K + 127) / 128, Nb = (N + 127) / 128;
  FP8OPS_CHECK(a_scale_inv.dim() == 2 && a_scale_inv.size(0) == M && a_scale_inv.size(1) == Kb,
              "fp8ops.gemm_blockwise: a_scale_inv must be [M, ceil(K/128)] = [", M, ", ", Kb, "], got ",
              shape_str(a_scale_inv));
  const bool per_row = b_scale_inv.dim() == 2 && b_scale_inv.size(0) == N;  // as the emulation decides
  FP8OPS_CHECK(b_scale_inv.dim() == 2 && (per_row || b_scale_inv.size(0) == Nb) && b_scale_inv.size(1) == Kb,
              "fp8ops.gemm_blockwise: b_scale_inv must be [N, Kb] = [", N, ", ", Kb,
              "] (1x128) or [ceil(N/128), Kb] = [", Nb, ", ", Kb, "] (128x128), got ", shape_str(b_scale_inv));
  if (M == 0 || N == 0 || K == 0)  // nothing to accumulate: bias only, no launch
    return finish(at::zeros({M, N}, a.options().dtype(at::kFloat)), bias, out_dtype);

  if (device_cc(a.device().index()) != 90 || !cutlass_pair(a, b)) {
    // Not Hopper (or an operand pair without a kernel): dequantize per block and matmul in
    // float32. Mathematically the same sum; rounding differs from per-block promotion only by
    // float32 summation order.
    at::Tensor ad = a.to(at::kFloat) * expand_scales(a_scale_inv, M, K);
    at::Tensor bd = b.to(at::kFloat) * expand_scales(b_scale_inv, N, K);
    return finish(at::matmul(ad, bd.t()), bias, out_dtype);
  }

  // CUTLASS reads the A scales with TMA in the 128x128 configuration: M padded to 4 there.
  // float16 has no kernel of its own: float32 out, rounded once to float16 below.
  at::ScalarType kernel_dtype = out_dtype == at::kHalf ? at::kFloat : out_dtype;
  // TMA: K padded to 16, N to 16 bytes of output (zero rows of B, cropped away).
  const fp8ops::Sm90Problem padded = fp8ops::sm90_padded_problem(M, N, K, to_dtype(kernel_dtype), !per_row);
  const int64_t Mp = padded.m, Np = padded.n, Kp = padded.k;
  at::Tensor ap = tma_operand(a, Mp, Kp), bp = tma_operand(b, Np, Kp);
  // CUTLASS's sm90 blockwise mainloop takes MN-major scales: [Kb, M] and [Kb, N or Nb]. Padding
  // rows and columns get scale 1 (their data is zero). Scales already stored that way (the
  // blockwise pair cast writes them so) are read as they are.
  at::Tensor sfa;
  if (Mp == M && a_scale_inv.scalar_type() == at::kFloat && a_scale_inv.t().is_contiguous()) {
    sfa = a_scale_inv.t();
  } else {
    sfa = at::ones({Kb, Mp}, a.options().dtype(at::kFloat));
    sfa.narrow(1, 0, M).copy_(a_scale_inv.t());
  }
  at::Tensor sfb = b_scale_inv.to(at::kFloat).t().contiguous();
  if (per_row && Np != N) {
    at::Tensor padded = at::ones({Kb, Np}, sfb.options());
    padded.narrow(1, 0, N).copy_(sfb);
    sfb = padded;
  }
  at::Tensor bias_f = bias ? padded_bias(*bias, Np) : at::Tensor();
  PaddedOut out(Mp, M, N, kernel_dtype, a);
  fp8ops::GemmBlockwiseParams p{};
  p.a = ap.data_ptr();
  p.b = bp.data_ptr();
  p.a_dtype = to_dtype(a.scalar_type());
  p.b_dtype = to_dtype(b.scalar_type());
  p.out_dtype = to_dtype(kernel_dtype);
  p.m = Mp;
  p.n = Np;
  p.k = Kp;
  p.lda = ap.stride(0);
  p.ldb = bp.stride(0);
  p.ldd = out.ld();
  p.a_scales = sfa.data_ptr<float>();
  p.b_scales = sfb.data_ptr<float>();
  p.b_scales_per_row = per_row;
  p.bias = bias ? bias_f.data_ptr<float>() : nullptr;
  p.d = out.buf.data_ptr();
  try {
    size_t ws_bytes = fp8ops::gemm_blockwise_sm90_workspace_size(p);
    at::Tensor ws = workspace(ws_bytes, a);
    p.workspace = ws_bytes ? ws.data_ptr() : nullptr;
    p.workspace_bytes = ws_bytes;
    fp8ops::launch_gemm_blockwise_sm90(p, stream_of(a));
  } catch (const std::exception& e) {
    FP8OPS_CHECK(false, e.what());
  }
  at::Tensor d = out.crop();
  return kernel_dtype == out_dtype ? d : d.to(out_dtype);
}
// ==== END gemm bindings ====

}  // namespace

TORCH_LIBRARY_IMPL(fp8ops, CUDA, m) {
  m.impl("amax", &amax_cuda);
  // ==== BEGIN cast registrations ====
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
  m.impl("adamw_step", &adamw_step_cuda);
  // ==== END cast registrations ====
  // ==== BEGIN gemm registrations ====
  m.impl("gemm", &gemm_cuda);
  m.impl("gemm_blockwise", &gemm_blockwise_cuda);
  // ==== END gemm registrations ====
}

// Build facts that are not tensor ops (backend() asks whether the CUTLASS GEMM was built).
TORCH_LIBRARY(fp8ops_C, m) { m.def("has_cutlass_sm90() -> bool", &has_cutlass_sm90); }

// The module holds no Python functions: importing it loads the library, whose static
// initializers register the kernels above with the dispatcher.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
