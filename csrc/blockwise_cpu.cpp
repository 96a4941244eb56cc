// CPU kernels of the blockwise quantizer (docs/design.md, "Blockwise") for the emulation: the two
// full-size passes of emulation._quantize_blockwise_2d, each in one pass over x: the max |x| of
// each [block_rows, block_cols] tile, and the cast of each element times its tile's multiplier.
// The per-tile scale math between them stays in the emulation's tensor code (tiles are few).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
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

at::Tensor cast_tiles_cpu(const at::Tensor& x, const at::Tensor& mult, int64_t block_rows,
                          int64_t block_cols, at::ScalarType dtype) {
  check_x(x, block_rows, block_cols, "cast_tiles");
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
              "cast_tiles: dtype must be float8_e4m3fn or float8_e5m2");
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
