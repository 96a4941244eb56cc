// Launcher of the grouped FP8 GEMMs on Hopper: argument checks, the scratch layout, the plain
// kernels around the CUTLASS one (packing the wgrad's operands so that every group starts
// 16-byte aligned, zeroing what no group writes), and the dispatch to the instantiations in
// gemm_sm90_grouped_<a>.cu. Sees only the template declarations (no CUTLASS).
#include <atomic>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "gemm_sm90_grouped.cuh"
#include "grouped_layout.h"

namespace fp8ops {
namespace {

template <class T>
struct Type {
  using type = T;
};

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("fp8ops grouped_gemm_sm90: " + msg); }

int64_t out_bytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
size_t align256(size_t x) { return (x + 255) / 256 * 256; }

int sm_count() {
  static std::atomic<int> cache[64];
  int dev = 0;
  FP8OPS_CUDA_CHECK(cudaGetDevice(&dev));
  int n = dev >= 0 && dev < 64 ? cache[dev].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    FP8OPS_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    if (dev >= 0 && dev < 64) cache[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

void check(const GroupedGemmParams& p) {
  bool rows = p.problem == GroupedProblem::kRows;
  if (!rows && p.problem != GroupedProblem::kWgrad) fail("unknown problem kind");
  if (p.groups <= 0) fail("groups must be > 0");
  if (p.m <= 0 || p.m > INT32_MAX || p.n <= 0 || p.n > INT32_MAX || p.k <= 0 || p.k > INT32_MAX)
    fail("m, n and k must be in [1, 2^31) (the binding answers m = 0 itself), got m, n, k = " + std::to_string(p.m) + ", " +
         std::to_string(p.n) + ", " + std::to_string(p.k));
  if (!(p.a_dtype == DType::kE4M3 || p.a_dtype == DType::kE5M2) || p.b_dtype != DType::kE4M3)
    fail("operands must be (E4M3, E4M3) or (E5M2, E4M3)");
  if (p.out_dtype != DType::kBFloat16 && p.out_dtype != DType::kFloat32) fail("out_dtype must be bfloat16 or float32");
  // TMA: 16-byte aligned rows. The wgrad's packed operands are aligned by construction.
  if (rows && p.k % 16) fail("k must be a multiple of 16, got " + std::to_string(p.k));
  int64_t d_row = rows ? p.n : p.k;
  if ((d_row * out_bytes(p.out_dtype)) % 16)
    fail("the output's rows must be a multiple of 16 bytes, got " + std::to_string(d_row) + " elements");
  if (!p.a || !p.b || !p.d || !p.offsets || !p.a_scale_inv || !p.b_scale_inv) fail("null pointer argument");
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.d)) fail("a, b and d must be 16-byte aligned");
  if (reinterpret_cast<uintptr_t>(p.workspace) & 255) fail("the workspace must be 256-byte aligned");
}

template <class F>
void dispatch(const GroupedGemmParams& p, F&& f) {
  auto by_out = [&](auto a) {
    using A = decltype(a);
    if (p.out_dtype == DType::kBFloat16)
      f(Type<sm90::GroupedGemmSm90<A::value, DType::kE4M3, DType::kBFloat16>>{});
    else
      f(Type<sm90::GroupedGemmSm90<A::value, DType::kE4M3, DType::kFloat32>>{});
  };
  if (p.a_dtype == DType::kE4M3)
    by_out(std::integral_constant<DType, DType::kE4M3>{});
  else
    by_out(std::integral_constant<DType, DType::kE5M2>{});
}

// The scratch, in order: spans (3 x groups int64), the packed wgrad operands, CUTLASS's arrays.
struct Layout {
  size_t spans, packed_a, packed_b, arrays;
  int64_t packed_ld;
};

Layout layout(const GroupedGemmParams& p) {
  Layout l{};
  l.spans = align256(3 * sizeof(int64_t) * static_cast<size_t>(p.groups));
  if (p.problem == GroupedProblem::kWgrad) {
    l.packed_ld = grouped::packed_length(p.m, p.groups);
    l.packed_a = align256(static_cast<size_t>(p.n * l.packed_ld));
    l.packed_b = align256(static_cast<size_t>(p.k * l.packed_ld));
  }
  dispatch(p, [&](auto t) { l.arrays = decltype(t)::type::arrays_bytes(p.groups, sm_count()); });
  return l;
}

sm90::GroupedSpans carve(const GroupedGemmParams& p, const Layout& l) {
  auto* base = static_cast<uint8_t*>(p.workspace);
  sm90::GroupedSpans s{};
  s.start = reinterpret_cast<int64_t*>(base);
  s.rows = s.start + p.groups;
  s.packed_start = s.rows + p.groups;
  if (p.problem == GroupedProblem::kWgrad) {
    s.packed_a = base + l.spans;
    s.packed_b = s.packed_a + l.packed_a;
  }
  s.packed_ld = l.packed_ld;
  return s;
}

// ---- the kernels around the GEMM --------------------------------------------------------------
constexpr int kThreads = 256;

// The group whose packed columns hold column c: the last with packed_start <= c (an empty group
// shares its packed_start with the next one, which is then the one found).
__device__ int packed_group_of(const sm90::GroupedSpans& s, int groups, int64_t c) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (s.packed_start[mid] <= c) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Fills the packed operands from dY^T [n, m] and X^T [k, m]: group g's rows at columns
// packed_start[g] on, then zeros up to its packed_columns (the padding its reduction reads).
__global__ void pack_wgrad_kernel(const uint8_t* a, const uint8_t* b, int64_t n, int64_t k, int64_t m, int groups,
                                  sm90::GroupedSpans s) {
  int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  int64_t used = s.packed_start[groups - 1] + grouped::packed_columns(s.rows[groups - 1]);
  if (c >= used) return;
  int g = packed_group_of(s, groups, c);
  int64_t j = c - s.packed_start[g];
  bool pad = j >= s.rows[g];
  int64_t from = s.start[g] + j;
  for (int64_t r = blockIdx.y; r < n + k; r += gridDim.y) {
    const uint8_t* src = r < n ? a + r * m : b + (r - n) * m;
    uint8_t* dst = r < n ? s.packed_a + r * s.packed_ld : s.packed_b + (r - n) * s.packed_ld;
    dst[c] = pad ? uint8_t(0) : src[from];
  }
}

// Zeroes 16-byte chunks [from, to) of d, grid-stride.
__device__ void zero_chunks(uint4* d, int64_t from, int64_t to) {
  for (int64_t i = from + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < to;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    d[i] = make_uint4(0, 0, 0, 0);
}

// The output rows past the last group (the emulation's zeros).
__global__ void zero_tail_rows_kernel(uint4* d, int64_t m, int64_t row_chunks, int groups, sm90::GroupedSpans s) {
  int64_t end = s.start[groups - 1] + s.rows[groups - 1];
  zero_chunks(d, end * row_chunks, m * row_chunks);
}

// dW_g of the groups with no rows: zeros (their problem has no tiles).
__global__ void zero_empty_groups_kernel(uint4* d, int64_t group_chunks, sm90::GroupedSpans s) {
  int g = blockIdx.y;
  if (s.rows[g] == 0) zero_chunks(d, g * group_chunks, (g + 1) * group_chunks);
}

unsigned grid_for(int64_t work, int64_t cap) {
  int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

void between(const GroupedGemmParams& p, const sm90::GroupedSpans& s, cudaStream_t stream) {
  auto* d = static_cast<uint4*>(p.d);
  if (p.problem == GroupedProblem::kRows) {
    int64_t row_chunks = p.n * out_bytes(p.out_dtype) / 16;
    launch_kernel(zero_tail_rows_kernel, dim3(grid_for(p.m * row_chunks, 1024)), dim3(kThreads), stream, d, p.m,
                  row_chunks, p.groups, s);
    return;
  }
  int64_t rows = p.n + p.k;
  dim3 grid(static_cast<unsigned>((grouped::packed_length(p.m, p.groups) + kThreads - 1) / kThreads), static_cast<unsigned>(rows < 65535 ? rows : 65535));
  launch_kernel(pack_wgrad_kernel, grid, dim3(kThreads), stream, static_cast<const uint8_t*>(p.a),
                static_cast<const uint8_t*>(p.b), p.n, p.k, p.m, p.groups, s);
  int64_t group_chunks = p.n * p.k * out_bytes(p.out_dtype) / 16;
  launch_kernel(zero_empty_groups_kernel, dim3(grid_for(group_chunks, 64), static_cast<unsigned>(p.groups)),
                dim3(kThreads), stream, d, group_chunks, s);
}

}  // namespace

size_t grouped_gemm_sm90_workspace_size(const GroupedGemmParams& p) {
  check(p);
  Layout l = layout(p);
  return l.spans + l.packed_a + l.packed_b + l.arrays;
}

void launch_grouped_gemm_sm90(const GroupedGemmParams& p, cudaStream_t stream) {
  check(p);
  Layout l = layout(p);
  if (p.workspace_bytes < l.spans + l.packed_a + l.packed_b + l.arrays) fail("the workspace is too small");
  sm90::GroupedSpans s = carve(p, l);
  void* arrays = static_cast<uint8_t*>(p.workspace) + l.spans + l.packed_a + l.packed_b;
  dispatch(p, [&](auto t) { decltype(t)::type::run(p, s, arrays, l.arrays, sm_count(), stream, &between); });
}

}  // namespace fp8ops
