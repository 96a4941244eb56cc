// CPU kernel of quantize_mx (docs/design.md, "MXFP8") for the emulation: one pass per block (its max
// |x|, the E8M0 exponent, the power-of-two multiply, the saturating round-to-nearest-even cast)
// where fp8ops/ops/emulation.py makes about ten passes of tensor ops. Same bytes as the emulation
// (tests/test_cpu_kernels.py): every step below is the emulation's integer or IEEE float32 step.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cast_cpu.h"
#include "kernels_cpu.h"

namespace fp8ops_cpu {
namespace {

// Elements of contiguous blocks (blocks along the last axis) whose scales are taken before one
// cast of them all: the cast then runs over a long row with a multiplier per element.
constexpr int64_t kRun = 1024;

// emulation._mx_exponent_bits for one block's max |x| (as bits): the E8M0 scale byte, and the
// multiplier 2^-e (NaN for a block holding NaN or inf, which makes all its data NaN).
template <class F>
FP8OPS_ALWAYS_INLINE uint8_t mx_scale(uint32_t amax_bits, bool rceil, float* mult) {
  const int32_t a = int32_t(amax_bits), field = (a >> 23) & 0xFF;
  int32_t e = field - (127 + F::kEmax);
  if (rceil) e += ((a & 0x7FFFFF) + (0x800000 - 0x600001)) >> 23;  // mantissa > 1.75: one more
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  const int32_t bad = (field + 1) >> 8;
  *mult = float_of(uint32_t((127 - e) << 23) | uint32_t(bad * 0x7FC00000));
  return uint8_t((e + 127) | (bad * 0xFF));
}

// Rows [r0, r1) of x viewed as [outer, nblocks * block, inner] (the block axis in the middle),
// scales as [outer, nblocks, inner]. Row r = (o, b) holds `inner` blocks side by side, each
// `block` elements `inner` apart; with inner = 1 a row is one contiguous block. amax and mult:
// room for `inner` values, and mult for kRun * block with inner = 1.
template <class F>
FP8OPS_ALWAYS_INLINE void quantize_mx_rows(const float* x, uint8_t* data, uint8_t* scales, int64_t r0,
                                           int64_t r1, int64_t block, int64_t inner, bool rceil,
                                           uint32_t* amax, float* mult) {
  if (inner == 1) {  // consecutive blocks: the scales of a run of them, then one cast of the run
    const int64_t run = std::max<int64_t>(1, kRun / block);
    for (int64_t b0 = r0; b0 < r1; b0 += run) {
      const int64_t n = std::min(run, r1 - b0);
      for (int64_t b = 0; b < n; ++b) {
        const float* xb = x + (b0 + b) * block;
        float m;
        // the MX block: a constant trip count unrolls into whole vectors
        const uint32_t a = block == 32 ? abs_max_bits(xb, 32) : abs_max_bits(xb, block);
        scales[b0 + b] = mx_scale<F>(a, rceil, &m);
        std::fill(mult + b * block, mult + (b + 1) * block, m);
      }
      scale_and_cast<F, 1>(x + b0 * block, data + b0 * block, mult, n * block);
    }
    return;
  }
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * block * inner;
    uint8_t* dr = data + r * block * inner;
    std::fill(amax, amax + inner, 0u);
    for (int64_t k = 0; k < block; ++k) abs_max_bits_into(xr + k * inner, amax, inner);
    for (int64_t i = 0; i < inner; ++i) scales[r * inner + i] = mx_scale<F>(amax[i], rceil, &mult[i]);
    for (int64_t k = 0; k < block; ++k)
      scale_and_cast<F, 1>(xr + k * inner, dr + k * inner, mult, inner);
  }
}

FP8OPS_CPU_CLONES void quantize_mx_rows_e4m3(const float* x, uint8_t* data, uint8_t* scales, int64_t r0,
                                             int64_t r1, int64_t block, int64_t inner, bool rceil,
                                             uint32_t* amax, float* mult) {
  quantize_mx_rows<E4M3>(x, data, scales, r0, r1, block, inner, rceil, amax, mult);
}
FP8OPS_CPU_CLONES void quantize_mx_rows_e5m2(const float* x, uint8_t* data, uint8_t* scales, int64_t r0,
                                             int64_t r1, int64_t block, int64_t inner, bool rceil,
                                             uint32_t* amax, float* mult) {
  quantize_mx_rows<E5M2>(x, data, scales, r0, r1, block, inner, rceil, amax, mult);
}

}  // namespace

// (data, scales) as emulation.quantize_mx, for a contiguous float32 / bfloat16 / float16 CPU x.
std::tuple<at::Tensor, at::Tensor> quantize_mx_cpu(const at::Tensor& x, at::ScalarType dtype,
                                                   int64_t block_size, int64_t axis, bool rceil) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "quantize_mx_cpu: x must be a contiguous CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "quantize_mx_cpu: x must be float32, bfloat16 or float16");
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
              "quantize_mx_cpu: dtype must be float8_e4m3fn or float8_e5m2");
  const int64_t dim = x.dim();
  TORCH_CHECK(dim >= 1 && axis >= -dim && axis < dim, "quantize_mx_cpu: axis out of range");
  axis = axis < 0 ? axis + dim : axis;
  TORCH_CHECK(block_size > 0 && x.size(axis) % block_size == 0,
              "quantize_mx_cpu: the axis length must be a multiple of block_size");
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < axis; ++d) outer *= x.size(d);
  for (int64_t d = axis + 1; d < dim; ++d) inner *= x.size(d);
  const int64_t nblocks = x.size(axis) / block_size;
  auto sshape = x.sizes().vec();
  sshape[axis] = nblocks;
  at::Tensor data = at::empty(x.sizes(), x.options().dtype(dtype));
  at::Tensor scales = at::empty(sshape, x.options().dtype(at::kByte));
  if (x.numel() == 0) return {data, scales};
  // bfloat16 / float16 -> float32 is exact, as the emulation's first step
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const float* xp = xf.const_data_ptr<float>();
  auto* d = reinterpret_cast<uint8_t*>(data.data_ptr());
  auto* s = scales.data_ptr<uint8_t>();
  const auto rows_fn = dtype == at::kFloat8_e4m3fn ? &quantize_mx_rows_e4m3 : &quantize_mx_rows_e5m2;
  const int64_t grain = std::max<int64_t>(1, 16384 / (block_size * inner));
  at::parallel_for(0, outer * nblocks, grain, [&](int64_t r0, int64_t r1) {
    std::vector<uint32_t> amax(inner);
    std::vector<float> mult(inner == 1 ? std::max<int64_t>(kRun, block_size) : inner);
    rows_fn(xp, d, s, r0, r1, block_size, inner, rceil, amax.data(), mult.data());
  });
  return {data, scales};
}

}  // namespace fp8ops_cpu
