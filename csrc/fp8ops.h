// fp8ops kernel API: torch-free. Plain parameter structs (pointers, sizes, strides) and launch_*()
// functions; every launch runs on the given stream and throws std::runtime_error on a CUDA error.
// The torch-aware C++ of fp8ops._C is csrc/bindings/. Numerics: docs/design.md, with
// fp8ops/ops/emulation.py as the bit-exact reference.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace fp8ops {

enum class DType : int { kFloat32, kBFloat16, kFloat16, kE4M3, kE5M2, kUInt8 };

// ---- cast kernels (cast.cu) -------------------------------------------------------------------
// amax = max |x| over n contiguous elements, written as float32 to *amax (NaN if any NaN,
// 0 for n == 0).
struct AmaxParams {
  const void* x;
  DType x_dtype;
  int64_t n;
  float* amax;  // device, 1 element
};
void launch_amax(const AmaxParams& p, cudaStream_t stream);

// ==== BEGIN cast kernels ====
// All tensors are contiguous, row-major. FP8 data and E8M0 scales are raw bytes.

// data = FP8(x * *scale) (nearest or stochastic), *amax = max |x|, and optionally data_t, the
// transpose [cols, rows] of the 2-D view [rows = n / cols, cols] of data, all from one read of x.
struct QuantizeParams {
  const void* x;
  DType x_dtype;
  int64_t n;           // elements
  int64_t cols;        // last dim (used when data_t != nullptr)
  const float* scale;  // device, 1 element
  DType out_dtype;     // kE4M3 or kE5M2
  uint8_t* data;       // n bytes
  uint8_t* data_t;     // n bytes or nullptr
  float* amax;         // device, 1 element
  DType via = DType::kFloat32;  // kBFloat16 / kFloat16: x rounded to it first (kFloat32: as it is)
  bool stochastic;
  uint64_t seed, offset;  // Philox key and counter high half (docs/design.md, "Stochastic rounding")
  // device int64 [seed, offset] read by the kernel instead of seed and offset (nullptr: those):
  // a CUDA graph replays the stream the buffer holds at replay time
  const int64_t* rng = nullptr;
  // The training step's one-call casts fold their scale math and amax bookkeeping into this
  // launch (all nullptr: none of it). amax may then be nullptr (no amax wanted).
  const float* scale_amax = nullptr;  // cast with scale_from_amax(*scale_amax, 1, ...), not *scale
  float fp8_max = 0.0f, margin = 1.0f;
  bool power_of_two = false;
  float* out_scale = nullptr;      // the scale used and its reciprocal, written once
  float* out_scale_inv = nullptr;
  // The last block to finish records the whole amax into a delayed-scaling role, as
  // launch_record_amax does: needs amax, and blocks_done right after it (amax + 1), zeroed with it.
  float* pending_amax = nullptr;
  int64_t* nonfinite_count = nullptr;
  unsigned* blocks_done = nullptr;
};
void launch_quantize(const QuantizeParams& p, cudaStream_t stream);

// out = (float(data) * *scale_inv) rounded to out_dtype.
struct DequantizeParams {
  const uint8_t* data;
  DType data_dtype;  // kE4M3 or kE5M2
  int64_t n;
  const float* scale_inv;  // device, 1 element
  void* out;
  DType out_dtype;  // kFloat32, kBFloat16 or kFloat16
};
void launch_dequantize(const DequantizeParams& p, cudaStream_t stream);

// MXFP8: x viewed as [outer, len, inner], blocks of block_size along len (the op's axis).
// scales [outer, len / block_size, inner] E8M0 bytes; data has the shape of x.
struct QuantizeMxParams {
  const void* x;
  DType x_dtype;
  int64_t outer, len, inner;
  int block_size;
  DType out_dtype;
  bool rceil;
  uint8_t* data;
  uint8_t* scales;
};
void launch_quantize_mx(const QuantizeMxParams& p, cudaStream_t stream);

struct DequantizeMxParams {
  const uint8_t* data;
  DType data_dtype;
  const uint8_t* scales;
  int64_t outer, len, inner;
  int block_size;
  void* out;
  DType out_dtype;
};
void launch_dequantize_mx(const DequantizeMxParams& p, cudaStream_t stream);

// MXFP8 copies of x [rows, cols] blocked along both axes, from one read of x (mx_pair.cu): x zero-
// padded to [rows_p, cols_p] (multiples of 32), row_data [rows, cols_p] with row_scales
// [rows, cols_p / 32] (blocks along the columns, the rows < rows only), col_data [rows_p, cols_p]
// with col_scales [rows_p / 32, cols_p] (blocks along the rows); the bytes of launch_quantize_mx
// (block 32) on the padded x along axis 1 and axis 0.
constexpr int kMxPairBlock = 32;
struct QuantizeMxPairParams {
  const void* x;
  DType x_dtype;
  int64_t rows, cols;
  DType out_dtype;
  bool rceil;
  uint8_t* row_data;
  uint8_t* row_scales;
  uint8_t* col_data;
  uint8_t* col_scales;
};
void launch_quantize_mx_pair(const QuantizeMxPairParams& p, cudaStream_t stream);

// Blockwise: x viewed as [rows, cols], tiles block_rows x block_cols (last ones may be partial),
// scale_inv [ceil(rows / block_rows), ceil(cols / block_cols)] float32.
struct QuantizeBlockwiseParams {
  const void* x;
  DType x_dtype;
  int64_t rows, cols;
  int block_rows, block_cols;
  DType out_dtype;
  bool power_of_two;
  uint8_t* data;
  float* scale_inv;
};
void launch_quantize_blockwise(const QuantizeBlockwiseParams& p, cudaStream_t stream);

// Blockwise 1x128 casts of x [rows, cols] and of its transpose, from one read of x (blockwise_pair.cu):
// data [rows, cols] with scale_inv [rows, ceil(cols / 128)] (the blocks run along the rows), and
// data_t [cols, rows] with scale_inv_t [cols, ceil(rows / 128)] (x^T's rows: x's columns); the
// bytes of launch_quantize_blockwise (1x128) on x and on a contiguous x^T. Both scale tensors are
// stored with their rows contiguous ([blocks, rows] in memory: what the sm90 GEMM reads).
struct QuantizeBlockwisePairParams {
  const void* x;
  DType x_dtype;
  int64_t rows, cols;
  DType out_dtype;
  bool power_of_two;
  uint8_t* data;
  float* scale_inv;
  uint8_t* data_t;
  float* scale_inv_t;
};
void launch_quantize_blockwise_pair(const QuantizeBlockwisePairParams& p, cudaStream_t stream);
// Its launch: one block per 128x128 tile, the tile in shared memory (rows padded to 16 bytes) and
// the transposed bytes staged (rows of an odd number of words: no bank conflicts).
constexpr int kBlockwisePairTile = 128;
constexpr int kBlockwisePairStageLd = kBlockwisePairTile + 4;
__host__ __device__ constexpr int blockwise_pair_row_elems(size_t elem_bytes) {
  return kBlockwisePairTile + int(16 / elem_bytes);
}
struct BlockwisePairPlan {
  int64_t tiles_r, tiles_c;  // grid = tiles_r * tiles_c
  size_t smem_bytes;         // dynamic shared memory per block
};
inline BlockwisePairPlan plan_blockwise_pair(int64_t rows, int64_t cols, int elem_bytes) {
  BlockwisePairPlan plan{};
  plan.tiles_r = (rows + kBlockwisePairTile - 1) / kBlockwisePairTile;
  plan.tiles_c = (cols + kBlockwisePairTile - 1) / kBlockwisePairTile;
  plan.smem_bytes = size_t(kBlockwisePairTile) * blockwise_pair_row_elems(elem_bytes) * elem_bytes +
                    size_t(kBlockwisePairTile) * kBlockwisePairStageLd;
  return plan;
}

struct DequantizeBlockwiseParams {
  const uint8_t* data;
  DType data_dtype;
  int64_t rows, cols;
  int block_rows, block_cols;
  const float* scale_inv;
  void* out;
  DType out_dtype;
};
void launch_dequantize_blockwise(const DequantizeBlockwiseParams& p, cudaStream_t stream);

// Delayed scaling: one step of the amax-history state machine (fp8ops.ops.emulation
// .delayed_scale_update), one block, no host sync. Outputs may be the inputs themselves (an update
// in place: every input is read before any output is written).
enum class AmaxAlgo : int { kMax, kMostRecent, kEma, kPercentile };
constexpr int kMaxHistory = 1024;
struct DelayedScaleParams {
  const float* amax_history;  // [history_len]
  const float* scale;         // 1 element each
  const float* amax_rep;
  const float* pending_amax;
  const int64_t* step;
  int history_len;  // 1 .. kMaxHistory
  int64_t interval;
  AmaxAlgo algo;
  float fp8_max, margin;
  float ema_a, ema_b;   // float(alpha), float(1 - alpha) (the difference taken in double)
  double percentile_q;  // percentile / 100
  bool power_of_two;
  float* out_history;  // [history_len]
  float* out_scale;
  float* out_scale_inv;
  float* out_amax_rep;
  float* out_pending;
  int64_t* step_inout = nullptr;  // not null: *step_inout += 1 first (step then points to it)
};
void launch_delayed_scale_update(const DelayedScaleParams& p, cudaStream_t stream);

// The scale a per-tensor cast uses, and its reciprocal, written by one thread: from an amax as
// current scaling computes it (amax != nullptr: scale_from_amax with prev 1.0), else a copy of
// *scale (a delayed-scaling role's scale, snapshotted for backward).
struct CastScaleParams {
  const float* amax;   // device, 1 element, or nullptr
  const float* scale;  // device, 1 element (used when amax is nullptr)
  float fp8_max, margin;
  bool power_of_two;
  float* out_scale;
  float* out_scale_inv;
};
void launch_cast_scale(const CastScaleParams& p, cudaStream_t stream);

// A delayed-scaling role's record of one cast's amax: *pending = max(*pending, *amax) for a
// finite amax, else *nonfinite_count += 1 (fp8ops.ops.fused.record_amax).
struct RecordAmaxParams {
  const float* amax;
  float* pending_amax;
  int64_t* nonfinite_count;
};
void launch_record_amax(const RecordAmaxParams& p, cudaStream_t stream);
// out [cols, rows] = the transpose of the row-major byte matrix x [rows, cols] (transpose.cu).
struct TransposeBytesParams {
  const uint8_t* x;
  int64_t rows, cols;
  uint8_t* out;  // rows * cols bytes, not overlapping x
};
void launch_transpose_bytes(const TransposeBytesParams& p, cudaStream_t stream);
// ==== END cast kernels ====

// ---- cast statistics (stats.cu) ---------------------------------------------------------------
// fp8ops.monitor's statistics of one cast (emulation.cast_stats; stats_cpu.cpp on the CPU), one
// kernel: over x [rows, cols] and its FP8 data read at the same indices (any strides, in elements;
// data's padding beyond x is not read), each value read back as raw * multiplier in float32, the
// multiplier *scale_inv (block_rows = block_cols = 0) or that of the element's block_rows x
// block_cols tile, scale_inv[(r / block_rows) * scale_stride0 + (c / block_cols) * scale_stride1]
// (float32, or E8M0 bytes: 2^(e - 127), 0xFF NaN). counts = [saturated, underflow, non-finite],
// amax = max |x| (NaN if any is NaN; 0 when empty); both zeroed on the stream first.
struct CastStatsParams {
  const void* x;
  DType x_dtype;  // kFloat32, kBFloat16 or kFloat16
  int64_t rows, cols, x_stride0, x_stride1;
  const uint8_t* data;
  DType data_dtype;  // kE4M3 or kE5M2
  int64_t data_stride0, data_stride1;
  const void* scale_inv;
  DType scale_dtype;  // kFloat32, or kUInt8 (blocks only)
  int64_t scale_stride0, scale_stride1;
  int64_t block_rows, block_cols;
  int64_t* counts;  // device, 3 elements
  float* amax;      // device, 1 element
};
void launch_cast_stats(const CastStatsParams& p, cudaStream_t stream);

// ==== BEGIN gemm ====
// CUTLASS Hopper FP8 GEMM (gemm_sm90*.cu, sm_90a): D[M,N] = alpha * (A[M,K] @ B[N,K]^T) + bias[N],
// FP32 accumulation, A and B K-major (row-major, TN). Operand pairs E4M3 x E4M3 and E5M2 x E4M3;
// D bfloat16, float16 or float32. The caller pads: K % 16 == 0, lda/ldb % 16 == 0 (elements),
// ldd * sizeof(D) % 16 == 0, pointers 16-byte aligned (std::invalid_argument otherwise).
// m, n, k > 0 (the caller handles empty problems without launching).
struct GemmParams {
  const void* a;  // [m, lda]
  const void* b;  // [n, ldb]
  DType a_dtype, b_dtype, out_dtype;
  int64_t m, n, k, lda, ldb, ldd;
  const float* a_scale_inv;  // device scalar; alpha = *a_scale_inv * *b_scale_inv in the epilogue
  const float* b_scale_inv;  // device scalar
  const float* bias;         // device [n] float32 or nullptr
  void* d;                   // [m, ldd]
  bool fast_accum;  // true: tensor-core accumulation over all of K; false: promote to FP32 every 128
  void* workspace;
  size_t workspace_bytes;
  int swizzle = 0;  // CTA rasterization swizzle (1, 2, 4 or 8 tiles); 0: the launcher's choice
};
size_t gemm_sm90_workspace_size(const GemmParams& p);
void launch_gemm_sm90(const GemmParams& p, cudaStream_t stream);

// Blockwise scaled (DeepSeek-V3 style): per 128-long K block kb, acc += (A_kb @ B_kb^T) *
// sa[m, kb] * sb[n, kb], then D = acc + bias. Same operand/alignment rules as GemmParams, plus,
// for 128x128 B scales, m % 4 == 0 and a_scales 16-byte aligned (CUTLASS loads the A scales with
// TMA in that configuration). D is bfloat16 or float32.
// Scale tensors are float32 and MN-major, as CUTLASS's sm90 blockwise mainloop reads them:
//   a_scales: [kb = ceil(k/128)][m]                      (the transpose of the [m, kb] 1x128 scales)
//   b_scales: [kb][ceil(n/128)] if !b_scales_per_row     (transpose of [nb, kb] 128x128 scales)
//             [kb][n]           if b_scales_per_row      (transpose of [n, kb] 1x128 scales)
struct GemmBlockwiseParams {
  const void* a;
  const void* b;
  DType a_dtype, b_dtype, out_dtype;
  int64_t m, n, k, lda, ldb, ldd;
  const float* a_scales;
  const float* b_scales;
  bool b_scales_per_row;
  const float* bias;  // device [n] float32 or nullptr
  void* d;
  void* workspace;
  size_t workspace_bytes;
  int swizzle = 0;  // as in GemmParams
};
size_t gemm_blockwise_sm90_workspace_size(const GemmBlockwiseParams& p);
void launch_gemm_blockwise_sm90(const GemmBlockwiseParams& p, cudaStream_t stream);

// The problem a logical [m, k] x [n, k] product is given to the sm90 kernels as: TMA needs k and
// each output row (n elements of out_dtype) in whole 16-byte units, and with 128x128 B scales
// the A scales' TMA needs m % 4 == 0. The caller zero-pads the operands (and bias) to this shape
// and crops the result; the host test of CUTLASS's can_implement uses the same rule.
struct Sm90Problem {
  int64_t m, n, k;
};
inline int64_t round_up_to(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }
inline Sm90Problem sm90_padded_problem(int64_t m, int64_t n, int64_t k, DType out_dtype, bool pad_m_to_4) {
  const int64_t per16 = out_dtype == DType::kFloat32 ? 4 : 8;
  return {pad_m_to_4 ? round_up_to(m, 4) : m, round_up_to(n, per16), round_up_to(k, 16)};
}

// True when the CUTLASS sm_90a kernels were compiled into this build.
bool gemm_sm90_available();
// ==== END gemm ====

}  // namespace fp8ops
