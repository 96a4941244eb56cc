// The FP8AdamW step of one parameter in one pass: one warp per block of 128 values (4 a lane)
// reads the gradient, the parameter and both moments, updates them with the float32 arithmetic
// of fp8ops/ops/adamw.py (every operation correctly rounded, no contraction), requantizes each
// moment block from its new amax and writes the parameter (bfloat16 by stochastic rounding).
#include "adamw.h"
#include "common.cuh"

namespace fp8ops {
namespace {

constexpr int kBlock = 128, kPerLane = 4, kWarps = 4;

template <typename P>
__device__ __forceinline__ void store_param(P* out, int64_t i, float p, RandomWords& words);
template <>
__device__ __forceinline__ void store_param<float>(float* out, int64_t i, float p, RandomWords&) {
  out[i] = p;
}
// the top half of bits(p) + (r >> 16): rounds up with probability low16 / 2^16; NaN as torch
// writes it (0x7FC0)
template <>
__device__ __forceinline__ void store_param<__nv_bfloat16>(__nv_bfloat16* out, int64_t i, float p,
                                                           RandomWords& words) {
  const uint32_t b = float_as_bits(p);
  const uint16_t h = isnan(p) ? uint16_t(0x7FC0) : uint16_t((b + (words(i) >> 16)) >> 16);
  reinterpret_cast<uint16_t*>(out)[i] = h;
}

template <SecondMoment V>
__device__ __forceinline__ float load_v(const AdamWParams& p, int64_t blk, int64_t i, float v_si) {
  if constexpr (V == SecondMoment::kBF16) {
    return i < p.n ? __bfloat162float(static_cast<const __nv_bfloat16*>(p.v)[i]) : 0.0f;
  } else if constexpr (V == SecondMoment::kSqrtE4M3) {
    const float d = mul_rn(fp8_to_float<Fp8::kE4M3>(static_cast<const uint8_t*>(p.v)[i]), v_si);
    return mul_rn(d, d);
  } else {
    return mul_rn(fp8_to_float<Fp8::kE5M2>(static_cast<const uint8_t*>(p.v)[i]), v_si);
  }
}

template <typename P, SecondMoment V>
__global__ void adamw_step_kernel(AdamWParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t blocks = (p.n + kBlock - 1) / kBlock;
  const int64_t blk = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (blk >= blocks) return;  // a whole warp leaves together: the shuffles below stay full
  const int64_t first = blk * kBlock + lane * kPerLane;
  const float m_si = p.m_scale_inv[blk];
  const float v_si = V == SecondMoment::kBF16 ? 0.0f : p.v_scale_inv[blk];
  RandomWords words(p.seed, p.offset);
  float m[kPerLane], stored[kPerLane], v[kPerLane];
  unsigned m_amax = 0, v_amax = 0;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t i = first + k;
    if (i >= p.n) {  // the padding of the last block: zero moments
      m[k] = v[k] = stored[k] = 0.0f;
      continue;
    }
    const float p32 = to_float(static_cast<const P*>(p.param)[i]);
    float g = to_float(static_cast<const P*>(p.grad)[i]);
    if (p.l2 != 0.0f) g = add_rn(g, mul_rn(p32, p.l2));
    const float m_old = mul_rn(fp8_to_float<Fp8::kE4M3>(p.m[i]), m_si);
    const float v_old = load_v<V>(p, blk, i, v_si);
    m[k] = add_rn(mul_rn(m_old, p.beta1), mul_rn(g, p.one_minus_beta1));
    v[k] = add_rn(mul_rn(v_old, p.beta2), mul_rn(mul_rn(g, g), p.one_minus_beta2));
    const float s = __fsqrt_rn(v[k]);
    float u = div_rn(m[k], add_rn(mul_rn(s, p.bias2_rsqrt), p.eps));
    u = mul_rn(s == 0.0f ? 0.0f : u, p.step_size);
    const float kept = p.decay != 1.0f ? mul_rn(p32, p.decay) : p32;
    store_param<P>(static_cast<P*>(p.param), i, sub_rn(kept, u), words);
    stored[k] = V == SecondMoment::kSqrtE4M3 ? s : v[k];
    m_amax = max(m_amax, abs_bits(m[k]));
    v_amax = max(v_amax, abs_bits(stored[k]));
  }
  const BlockScale ms = block_scale<Fp8::kE4M3>(warp_max(m_amax), false);
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) p.m[first + k] = block_quant<Fp8::kE4M3>(m[k], ms);
  if (lane == 0) p.m_scale_inv[blk] = ms.scale_inv;
  if constexpr (V == SecondMoment::kBF16) {
    auto* out = static_cast<__nv_bfloat16*>(p.v);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int64_t i = first + k;
      if (i < p.n) {
        const float x = v[k];
        out[i] = isnan(x) ? __ushort_as_bfloat16(0x7FC0) : __float2bfloat16_rn(x);
      }
    }
  } else {
    constexpr Fp8 F = V == SecondMoment::kSqrtE4M3 ? Fp8::kE4M3 : Fp8::kE5M2;
    const BlockScale vs = block_scale<F>(warp_max(v_amax), false);
    auto* out = static_cast<uint8_t*>(p.v);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) out[first + k] = block_quant<F>(stored[k], vs);
    if (lane == 0) p.v_scale_inv[blk] = vs.scale_inv;
  }
}

template <typename P>
void launch_for(const AdamWParams& p, cudaStream_t stream) {
  const int64_t blocks = (p.n + kBlock - 1) / kBlock;
  const dim3 grid(static_cast<unsigned>((blocks + kWarps - 1) / kWarps)), block(32 * kWarps);
  switch (p.second_moment) {
    case SecondMoment::kSqrtE4M3:
      launch_kernel(adamw_step_kernel<P, SecondMoment::kSqrtE4M3>, grid, block, stream, p);
      break;
    case SecondMoment::kE5M2:
      launch_kernel(adamw_step_kernel<P, SecondMoment::kE5M2>, grid, block, stream, p);
      break;
    case SecondMoment::kBF16:
      launch_kernel(adamw_step_kernel<P, SecondMoment::kBF16>, grid, block, stream, p);
      break;
  }
}

}  // namespace

void launch_adamw_step(const AdamWParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  switch (p.param_dtype) {
    case DType::kFloat32: launch_for<float>(p, stream); break;
    case DType::kBFloat16: launch_for<__nv_bfloat16>(p, stream); break;
    default: throw std::invalid_argument("fp8ops: adamw_step: param must be float32 or bfloat16");
  }
}

}  // namespace fp8ops
