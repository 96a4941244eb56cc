// Launchers for the CUTLASS Hopper FP8 GEMMs: argument checks, tile heuristic, dispatch to the
// explicit instantiations in gemm_sm90_{e4m3,e5m2}*.cu and gemm_sm90_blockwise_*.cu. This file
// sees only the template declarations (no CUTLASS), so it compiles quickly.
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "gemm_sm90.cuh"

namespace fp8ops {
namespace {

using sm90::TileConfig;

// Multiprocessor count per device, cached: it sizes the persistent grid on every call.
int sm_count() {
  static std::atomic<int> cache[64];
  int dev = 0;
  FP8OPS_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) {
    int n = 0;
    FP8OPS_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }
  int n = cache[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    FP8OPS_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cache[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

int64_t elem_bytes(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
    default: return 1;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

[[noreturn]] void fail(const char* what, const std::string& msg) {
  throw std::invalid_argument(std::string("fp8ops ") + what + ": " + msg);
}

// Checks shared by both GEMMs: TMA needs 16-byte aligned bases and leading dimensions.
template <class P>
void check_common(const P& p, const char* what) {
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) fail(what, "m, n, k must be > 0 (empty problems do not launch)");
  if (p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX) fail(what, "m, n, k must fit in int32");
  if (p.k % 16) fail(what, "k must be a multiple of 16 (pad K with zeros), got " + std::to_string(p.k));
  if (p.lda < p.k || p.lda % 16) fail(what, "lda must be >= k and a multiple of 16, got " + std::to_string(p.lda));
  if (p.ldb < p.k || p.ldb % 16) fail(what, "ldb must be >= k and a multiple of 16, got " + std::to_string(p.ldb));
  if (p.ldd < p.n || (p.ldd * elem_bytes(p.out_dtype)) % 16)
    fail(what, "ldd must be >= n and ldd * sizeof(out) a multiple of 16 bytes, got " + std::to_string(p.ldd));
  if (!p.a || !p.b || !p.d) fail(what, "null a, b or d");
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.d)) fail(what, "a, b and d must be 16-byte aligned");
  if (p.bias && (reinterpret_cast<uintptr_t>(p.bias) & 3)) fail(what, "bias must be 4-byte aligned");
}

// FP8OPS_SM90_GEMM_CONFIG (coop128, pingpong64, fast_pingpong128, fast_coop256) forces one
// configuration, for benchmarks that compare them; unset, the heuristic below decides.
bool forced_tile(TileConfig* c) {
  const char* env = std::getenv("FP8OPS_SM90_GEMM_CONFIG");
  if (!env || !*env) return false;
  const std::string v(env);
  if (v == "coop128") *c = TileConfig::kCooperative128x128;
  else if (v == "pingpong64") *c = TileConfig::kPingpong64x128;
  else if (v == "fast_pingpong128") *c = TileConfig::kFastPingpong128x128;
  else if (v == "fast_coop256") *c = TileConfig::kFastCooperative128x256;
  else fail("gemm_sm90", "FP8OPS_SM90_GEMM_CONFIG must be coop128, pingpong64, fast_pingpong128 or "
                         "fast_coop256, got '" + v + "'");
  return true;
}

// Tiles per rasterization swizzle: neighbouring CTAs share A and B tiles in L2, which large
// problems (tens of MB per operand) otherwise stream from HBM again. FP8OPS_SM90_SWIZZLE
// (1, 2, 4, 8) overrides it for benchmarks.
constexpr int kDefaultSwizzle = 4;

int pick_swizzle() {
  const char* env = std::getenv("FP8OPS_SM90_SWIZZLE");
  if (!env || !*env) return kDefaultSwizzle;
  const std::string v(env);
  if (v == "1" || v == "2" || v == "4" || v == "8") return std::stoi(v);
  fail("gemm_sm90", "FP8OPS_SM90_SWIZZLE must be 1, 2, 4 or 8, got '" + v + "'");
}

// Busy fraction of the SMs over the waves that `tiles` CTAs need on a persistent grid of `sms`.
double wave_efficiency(int64_t tiles, int sms) {
  int64_t waves = (tiles + sms - 1) / sms;
  return static_cast<double>(tiles) / static_cast<double>(waves * sms);
}

// Small grids waste the 128x128 tile's SMs: when it cannot fill the GPU once, the 64x128
// ping-pong kernel gives twice the CTAs and overlaps one tile's epilogue with the next's MMAs.
// Fast accumulation on larger grids takes a mainloop without promotion copies.
TileConfig pick_tile(const GemmParams& p, int sms) {
  TileConfig forced;
  if (forced_tile(&forced)) {
    if (!p.fast_accum && (forced == TileConfig::kFastPingpong128x128 || forced == TileConfig::kFastCooperative128x256))
      return TileConfig::kCooperative128x128;  // a fast-accumulation kernel never serves promoted numerics
    return forced;
  }
  int64_t tiles_128 = ((p.m + 127) / 128) * ((p.n + 127) / 128);
  if (p.m <= 64 || tiles_128 < sms) return TileConfig::kPingpong64x128;
  if (!p.fast_accum) return TileConfig::kCooperative128x128;
  // 128x256 tiles run fastest when they fill whole waves of the GPU; when half their last wave
  // would idle (e.g. M = 1024, N = 6144: 192 tiles on 132 SMs) the 128x128 ping-pong kernel,
  // with twice the tiles, fills the waves better.
  int64_t tiles_256 = ((p.m + 127) / 128) * ((p.n + 255) / 256);
  if (wave_efficiency(tiles_128, sms) > wave_efficiency(tiles_256, sms) + 0.1)
    return TileConfig::kFastPingpong128x128;
  return TileConfig::kFastCooperative128x256;
}

template <DType A, DType B, DType D, class F>
void by_tile(TileConfig c, F&& f) {
  switch (c) {
    case TileConfig::kCooperative128x128: f(Type<sm90::GemmSm90<A, B, D, TileConfig::kCooperative128x128>>{}); break;
    case TileConfig::kPingpong64x128: f(Type<sm90::GemmSm90<A, B, D, TileConfig::kPingpong64x128>>{}); break;
    case TileConfig::kFastPingpong128x128: f(Type<sm90::GemmSm90<A, B, D, TileConfig::kFastPingpong128x128>>{}); break;
    case TileConfig::kFastCooperative128x256:
      f(Type<sm90::GemmSm90<A, B, D, TileConfig::kFastCooperative128x256>>{});
      break;
  }
}

template <DType A, DType B, class F>
void by_out(DType out, TileConfig c, F&& f) {
  switch (out) {
    case DType::kBFloat16: by_tile<A, B, DType::kBFloat16>(c, f); break;
    case DType::kFloat16: by_tile<A, B, DType::kFloat16>(c, f); break;
    case DType::kFloat32: by_tile<A, B, DType::kFloat32>(c, f); break;
    default: fail("gemm_sm90", "out_dtype must be bfloat16, float16 or float32");
  }
}

template <class F>
void dispatch_gemm(const GemmParams& p, TileConfig c, F&& f) {
  if (p.a_dtype == DType::kE4M3 && p.b_dtype == DType::kE4M3)
    by_out<DType::kE4M3, DType::kE4M3>(p.out_dtype, c, f);
  else if (p.a_dtype == DType::kE5M2 && p.b_dtype == DType::kE4M3)
    by_out<DType::kE5M2, DType::kE4M3>(p.out_dtype, c, f);
  else
    fail("gemm_sm90", "operands must be (E4M3, E4M3) or (E5M2, E4M3)");
}

template <DType A, DType B, DType D, class F>
void by_gran(bool per_row, F&& f) {
  if (per_row)
    f(Type<sm90::GemmBlockwiseSm90<A, B, D, 1>>{});
  else
    f(Type<sm90::GemmBlockwiseSm90<A, B, D, 128>>{});
}

template <DType A, DType B, class F>
void by_out_blockwise(const GemmBlockwiseParams& p, F&& f) {
  switch (p.out_dtype) {
    case DType::kBFloat16: by_gran<A, B, DType::kBFloat16>(p.b_scales_per_row, f); break;
    case DType::kFloat32: by_gran<A, B, DType::kFloat32>(p.b_scales_per_row, f); break;
    default: fail("gemm_blockwise_sm90", "out_dtype must be bfloat16 or float32");
  }
}

template <class F>
void dispatch_blockwise(const GemmBlockwiseParams& p, F&& f) {
  if (p.a_dtype == DType::kE4M3 && p.b_dtype == DType::kE4M3)
    by_out_blockwise<DType::kE4M3, DType::kE4M3>(p, f);
  else if (p.a_dtype == DType::kE5M2 && p.b_dtype == DType::kE4M3)
    by_out_blockwise<DType::kE5M2, DType::kE4M3>(p, f);
  else
    fail("gemm_blockwise_sm90", "operands must be (E4M3, E4M3) or (E5M2, E4M3)");
}

void check_gemm(const GemmParams& p) {
  check_common(p, "gemm_sm90");
  if (!p.a_scale_inv || !p.b_scale_inv) fail("gemm_sm90", "a_scale_inv and b_scale_inv are required");
}

void check_blockwise(const GemmBlockwiseParams& p) {
  check_common(p, "gemm_blockwise_sm90");
  if (!p.a_scales || !p.b_scales) fail("gemm_blockwise_sm90", "a_scales and b_scales are required");
  if (!p.b_scales_per_row && (p.m % 4 || !aligned16(p.a_scales)))
    fail("gemm_blockwise_sm90", "with 128x128 B scales, m must be a multiple of 4 and a_scales "
                                "16-byte aligned (TMA), got m = " + std::to_string(p.m));
}

}  // namespace

template <class P>
P with_swizzle(const P& p) {
  P q = p;
  if (q.swizzle == 0) q.swizzle = pick_swizzle();
  return q;
}

size_t gemm_sm90_workspace_size(const GemmParams& params) {
  check_gemm(params);
  const GemmParams p = with_swizzle(params);
  int sms = sm_count();
  size_t bytes = 0;
  dispatch_gemm(p, pick_tile(p, sms), [&](auto tag) { bytes = decltype(tag)::type::workspace_size(p, sms); });
  return bytes;
}

void launch_gemm_sm90(const GemmParams& params, cudaStream_t stream) {
  check_gemm(params);
  const GemmParams p = with_swizzle(params);
  int sms = sm_count();
  dispatch_gemm(p, pick_tile(p, sms), [&](auto tag) { decltype(tag)::type::run(p, sms, stream); });
}

size_t gemm_blockwise_sm90_workspace_size(const GemmBlockwiseParams& params) {
  check_blockwise(params);
  const GemmBlockwiseParams p = with_swizzle(params);
  int sms = sm_count();
  size_t bytes = 0;
  dispatch_blockwise(p, [&](auto tag) { bytes = decltype(tag)::type::workspace_size(p, sms); });
  return bytes;
}

void launch_gemm_blockwise_sm90(const GemmBlockwiseParams& params, cudaStream_t stream) {
  check_blockwise(params);
  const GemmBlockwiseParams p = with_swizzle(params);
  int sms = sm_count();
  dispatch_blockwise(p, [&](auto tag) { decltype(tag)::type::run(p, sms, stream); });
}

bool gemm_sm90_available() { return true; }

}  // namespace fp8ops
