// CPU kernels of the blockwise quantizer (docs/design.md, "Blockwise") for the emulation:
// emulation._quantize_blockwise_2d whole (the max |x| of each [block_rows, block_cols] tile, its
// scale and multiplier, the cast of each element times its tile's multiplier), or its two
// full-size passes alone; and the pair of fused.quantize_blockwise_pair (x in 1x128 blocks along
// the rows and x^T in 1x128 blocks along its rows) from one read of each 128-row panel of x.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cast_cpu.h"
#include "kernels_cpu.h"

namespace fp8ops_cpu {
namespace {

// Tiles narrower than this take the element-wise loops below (a tile of the transposed
// quantization is 128 x 1): one call per tile would not vectorize.
constexpr int64_t kNarrow = 16;

// amax[rb, cb] (as |x| bits) for the tile rows [rb0, rb1) of x [R, C]; partial tiles at the
// edges cover what exists (the emulation pads them with zeros, which never raise a max).
// row: room for C values.
FP8OPS_CPU_CLONES void tile_amax_rows(const float* x, uint32_t* amax, int64_t rb0, int64_t rb1,
                                      int64_t R, int64_t C, int64_t br, int64_t bc, uint32_t* row) {
  const int64_t Cb = (C + bc - 1) / bc;
  for (int64_t rb = rb0; rb < rb1; ++rb) {
    uint32_t* a = amax + rb * Cb;
    const int64_t r_end = std::min(R, rb * br + br);
    if (bc < kNarrow) {  // max over the tile's rows element-wise, then over each tile's columns
      std::fill(row, row + C, 0u);
      for (int64_t r = rb * br; r < r_end; ++r) abs_max_bits_into(x + r * C, row, C);
      for (int64_t cb = 0; cb < Cb; ++cb)
        a[cb] = *std::max_element(row + cb * bc, row + std::min(C, cb * bc + bc));
      continue;
    }
    std::fill(a, a + Cb, 0u);
    for (int64_t r = rb * br; r < r_end; ++r)
      for (int64_t cb = 0; cb < Cb; ++cb)
        a[cb] = std::max(a[cb], abs_max_bits(x + r * C + cb * bc, std::min(bc, C - cb * bc)));
  }
}

// data[r, c] = FP8 of clamp(x[r, c] * mult[r / br, c / bc]) for the rows [r0, r1). row: room
// for C multipliers.
template <class F>
FP8OPS_ALWAYS_INLINE void cast_rows(const float* x, const float* mult, uint8_t* data, int64_t r0,
                                    int64_t r1, int64_t C, int64_t br, int64_t bc, float* row) {
  const int64_t Cb = (C + bc - 1) / bc;
  int64_t expanded = -1;  // the tile row whose multipliers `row` holds, one per column
  for (int64_t r = r0; r < r1; ++r) {
    const float* m = mult + (r / br) * Cb;
    if (bc < kNarrow) {
      if (r / br != expanded) {
        for (int64_t c = 0; c < C; ++c) row[c] = m[c / bc];
        expanded = r / br;
      }
      scale_and_cast<F, 1>(x + r * C, data + r * C, row, C);
      continue;
    }
    for (int64_t cb = 0; cb < Cb; ++cb) {
      const int64_t c = cb * bc;
      scale_and_cast<F, 0>(x + r * C + c, data + r * C + c, m + cb, std::min(bc, C - c));
    }
  }
}
FP8OPS_CPU_CLONES void cast_rows_e4m3(const float* x, const float* mult, uint8_t* data, int64_t r0,
                                      int64_t r1, int64_t C, int64_t br, int64_t bc, float* row) {
  cast_rows<E4M3>(x, mult, data, r0, r1, C, br, bc, row);
}
FP8OPS_CPU_CLONES void cast_rows_e5m2(const float* x, const float* mult, uint8_t* data, int64_t r0,
                                      int64_t r1, int64_t C, int64_t br, int64_t bc, float* row) {
  cast_rows<E5M2>(x, mult, data, r0, r1, C, br, bc, row);
}

// The multipliers (and scale_inv) of tiles [t0, t1) from their amax bits, in place: amax holds
// the bits, mult receives the multipliers.
template <class F>
void tile_scales(const uint32_t* amax, float* mult, float* scale_inv, int64_t t0, int64_t t1,
                 bool power_of_two) {
  for (int64_t t = t0; t < t1; ++t) block_scale<F>(amax[t], power_of_two, &mult[t], &scale_inv[t]);
}

// One panel of rows [p0, p1) (at most 128) of the pair: x's rows cast in 1x128 blocks into data
// [M, K] with scale_inv [M, Kb] stored as [Kb, M]; the panel's columns cast in 128x1 blocks into
// data_t [K, M] (x^T in 1x128 blocks) with scale_inv_t [K, Mb] stored as [Mb, K]. colmax and
// colmult: room for K values; panel: for (p1 - p0) x K bytes.
template <class F>
FP8OPS_ALWAYS_INLINE void pair_panel(const float* x, int64_t M, int64_t K, int64_t p0, int64_t p1,
                                     bool power_of_two, uint8_t* data, float* scale_inv,
                                     uint8_t* data_t, float* scale_inv_t, uint32_t* colmax,
                                     float* colmult, uint8_t* panel) {
  constexpr int64_t kB = 128;
  const int64_t Kb = (K + kB - 1) / kB;
  std::fill(colmax, colmax + K, 0u);
  for (int64_t r = p0; r < p1; ++r) {
    const float* xr = x + r * K;
    abs_max_bits_into(xr, colmax, K);
    for (int64_t kb = 0; kb < Kb; ++kb) {
      const int64_t c = kb * kB, n = std::min(kB, K - c);
      float m;
      block_scale<F>(abs_max_bits(xr + c, n), power_of_two, &m, &scale_inv[kb * M + r]);
      scale_and_cast<F, 0>(xr + c, data + r * K + c, &m, n);
    }
  }
  float* sit = scale_inv_t + (p0 / kB) * K;
  for (int64_t c = 0; c < K; ++c) block_scale<F>(colmax[c], power_of_two, &colmult[c], &sit[c]);
  for (int64_t r = p0; r < p1; ++r)
    scale_and_cast<F, 1>(x + r * K, panel + (r - p0) * K, colmult, K);
  transpose_bytes(panel, K, 1, data_t + p0, M, p1 - p0, K);
}
FP8OPS_CPU_CLONES void pair_panel_e4m3(const float* x, int64_t M, int64_t K, int64_t p0, int64_t p1,
                                       bool power_of_two, uint8_t* data, float* scale_inv,
                                       uint8_t* data_t, float* scale_inv_t, uint32_t* colmax,
                                       float* colmult, uint8_t* panel) {
  pair_panel<E4M3>(x, M, K, p0, p1, power_of_two, data, scale_inv, data_t, scale_inv_t, colmax,
                   colmult, panel);
}
FP8OPS_CPU_CLONES void pair_panel_e5m2(const float* x, int64_t M, int64_t K, int64_t p0, int64_t p1,
                                       bool power_of_two, uint8_t* data, float* scale_inv,
                                       uint8_t* data_t, float* scale_inv_t, uint32_t* colmax,
                                       float* colmult, uint8_t* panel) {
  pair_panel<E5M2>(x, M, K, p0, p1, power_of_two, data, scale_inv, data_t, scale_inv_t, colmax,
                   colmult, panel);
}

void check_dtype(at::ScalarType dtype, const char* op) {
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, op,
              ": dtype must be float8_e4m3fn or float8_e5m2");
}

void check_x(const at::Tensor& x, int64_t br, int64_t bc, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              op, ": x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(br > 0 && bc > 0, op, ": block sizes must be positive");
}

}  // namespace

at::Tensor tile_amax_cpu(const at::Tensor& x, int64_t block_rows, int64_t block_cols) {
  check_x(x, block_rows, block_cols, "tile_amax");
  const int64_t R = x.size(0), C = x.size(1);
  const int64_t Rb = (R + block_rows - 1) / block_rows, Cb = (C + block_cols - 1) / block_cols;
  at::Tensor amax = at::empty({Rb, Cb}, x.options());
  if (amax.numel() == 0) return amax;
  const float* xp = x.const_data_ptr<float>();
  auto* ap = reinterpret_cast<uint32_t*>(amax.data_ptr<float>());  // |x| bits are |x| itself
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, block_rows * C));
  at::parallel_for(0, Rb, grain, [&](int64_t rb0, int64_t rb1) {
    std::vector<uint32_t> row(block_cols < kNarrow ? C : 0);
    tile_amax_rows(xp, ap, rb0, rb1, R, C, block_rows, block_cols, row.data());
  });
  return amax;
}

std::tuple<at::Tensor, at::Tensor> quantize_tiles_cpu(const at::Tensor& x, at::ScalarType dtype,
                                                      int64_t block_rows, int64_t block_cols,
                                                      bool power_of_two) {
  check_x(x, block_rows, block_cols, "quantize_tiles");
  check_dtype(dtype, "quantize_tiles");
  at::Tensor amax = tile_amax_cpu(x, block_rows, block_cols);
  at::Tensor mult = at::empty_like(amax), scale_inv = at::empty_like(amax);
  const auto* ap = reinterpret_cast<const uint32_t*>(amax.const_data_ptr<float>());
  const auto scales = dtype == at::kFloat8_e4m3fn ? &tile_scales<E4M3> : &tile_scales<E5M2>;
  scales(ap, mult.mutable_data_ptr<float>(), scale_inv.mutable_data_ptr<float>(), 0, amax.numel(),
         power_of_two);
  return {cast_tiles_cpu(x, mult, block_rows, block_cols, dtype), scale_inv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_blockwise_pair_cpu(
    const at::Tensor& x, at::ScalarType dtype, bool power_of_two) {
  check_x(x, 1, 128, "quantize_blockwise_pair");
  check_dtype(dtype, "quantize_blockwise_pair");
  constexpr int64_t kB = 128;
  const int64_t M = x.size(0), K = x.size(1), Mb = (M + kB - 1) / kB, Kb = (K + kB - 1) / kB;
  at::Tensor data = at::empty({M, K}, x.options().dtype(dtype));
  at::Tensor data_t = at::empty({K, M}, x.options().dtype(dtype));
  // the scales with their rows contiguous (fused.mn_major): [blocks, rows] buffers, transposed
  at::Tensor scale_inv = at::empty({Kb, M}, x.options());
  at::Tensor scale_inv_t = at::empty({Mb, K}, x.options());
  if (M > 0 && K > 0) {
    const float* xp = x.const_data_ptr<float>();
    auto* d = reinterpret_cast<uint8_t*>(data.mutable_data_ptr());
    auto* dt = reinterpret_cast<uint8_t*>(data_t.mutable_data_ptr());
    float* si = scale_inv.mutable_data_ptr<float>();
    float* sit = scale_inv_t.mutable_data_ptr<float>();
    const auto fn = dtype == at::kFloat8_e4m3fn ? &pair_panel_e4m3 : &pair_panel_e5m2;
    at::parallel_for(0, Mb, 1, [&](int64_t b0, int64_t b1) {
      std::vector<uint32_t> colmax(K);
      std::vector<float> colmult(K);
      std::vector<uint8_t> panel(kB * K);
      for (int64_t b = b0; b < b1; ++b)
        fn(xp, M, K, b * kB, std::min(M, b * kB + kB), power_of_two, d, si, dt, sit, colmax.data(),
           colmult.data(), panel.data());
    });
  }
  return {data, scale_inv.t(), data_t, scale_inv_t.t()};
}

at::Tensor cast_tiles_cpu(const at::Tensor& x, const at::Tensor& mult, int64_t block_rows,
                          int64_t block_cols, at::ScalarType dtype) {
  check_x(x, block_rows, block_cols, "cast_tiles");
  check_dtype(dtype, "cast_tiles");
  const int64_t R = x.size(0), C = x.size(1);
  const int64_t Rb = (R + block_rows - 1) / block_rows, Cb = (C + block_cols - 1) / block_cols;
  TORCH_CHECK(mult.device().is_cpu() && mult.scalar_type() == at::kFloat && mult.is_contiguous() &&
                  mult.dim() == 2 && mult.size(0) == Rb && mult.size(1) == Cb,
              "cast_tiles: mult must be a contiguous float32 CPU tensor of one value per tile");
  at::Tensor data = at::empty({R, C}, x.options().dtype(dtype));
  if (data.numel() == 0) return data;
  const float* xp = x.const_data_ptr<float>();
  const float* mp = mult.const_data_ptr<float>();
  auto* dp = reinterpret_cast<uint8_t*>(data.data_ptr());
  const auto rows_fn = dtype == at::kFloat8_e4m3fn ? &cast_rows_e4m3 : &cast_rows_e5m2;
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, C)), [&](int64_t r0, int64_t r1) {
    std::vector<float> row(block_cols < kNarrow ? C : 0);
    rows_fn(xp, mp, dp, r0, r1, C, block_rows, block_cols, row.data());
  });
  return data;
}

}  // namespace fp8ops_cpu
