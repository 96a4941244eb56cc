// Torch bindings of the GEMMs (gemm_sm90*.cu), and the extension module itself.
#include <Python.h>

#include <atomic>

#include "common.h"

namespace {
using namespace fp8ops_bind;

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
// column-major: b.t() of a row-major b). K and N are padded to 16 as its FP8 kernels require.
// cuBLASLt refuses (CUBLAS_STATUS_NOT_SUPPORTED) a scale whose address is not 16-byte aligned,
// such as sa[g], a view into a per-expert vector: such a scale is copied. A bias is added here
// in float32 so the result is rounded once, like the emulation (_scaled_mm would round before
// adding it).
at::Tensor gemm_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa,
                          const at::Tensor& sb, const std::optional<at::Tensor>& bias,
                          at::ScalarType out_dtype, bool fast_accum) {
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  const int64_t Kp = round_up(K, 16), Np = round_up(N, 16);
  at::Tensor ap = tma_operand(a, M, Kp), bp = tma_operand(b, Np, Kp);
  auto aligned = [](const at::Tensor& s) {
    return reinterpret_cast<uintptr_t>(s.data_ptr()) % 16 == 0 ? s : s.clone();
  };
  at::ScalarType mm_dtype = bias ? at::kFloat : out_dtype;
  at::Tensor out = at::_scaled_mm(ap, bp.t(), aligned(sa), aligned(sb), std::nullopt, std::nullopt,
                                  mm_dtype, fast_accum);
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

}  // namespace

TORCH_LIBRARY_IMPL(fp8ops, CUDA, m) {
  m.impl("gemm", &gemm_cuda);
  m.impl("gemm_blockwise", &gemm_blockwise_cuda);
}

// Build facts that are not tensor ops (backend() asks whether the CUTLASS GEMM was built).
TORCH_LIBRARY(fp8ops_C, m) { m.def("has_cutlass_sm90() -> bool", &has_cutlass_sm90); }

// The module holds no Python functions: importing it loads the library, whose static
// initializers register the kernels above with the dispatcher.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
