// The FP8AdamW step in one pass: one warp per block of 128 values (4 a lane) reads the gradient,
// the parameter and both moments, updates them with the float32 arithmetic of
// fp8ops/ops/adamw.py (every operation correctly rounded, no contraction), requantizes each
// moment block from its new amax and writes the parameter (bfloat16 by stochastic rounding).
// The single-parameter kernel and the multi-tensor one (a list of parameters in one launch, each
// warp finding its tensor in a table) run the same per-block code, step_block.
#include <type_traits>

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

// Block blk of parameter p, by one whole warp (its shuffles need every lane).
template <typename P, SecondMoment V>
__device__ __forceinline__ void step_block(const AdamWParams& p, int64_t blk, int lane) {
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

template <typename P, SecondMoment V>
__global__ void adamw_step_kernel(AdamWParams p) {
  const int64_t blocks = (p.n + kBlock - 1) / kBlock;
  const int64_t blk = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (blk >= blocks) return;  // a whole warp leaves together: the shuffles stay full
  step_block<P, V>(p, blk, threadIdx.x & 31);
}

// The tensor that global block `blk` belongs to: the last one whose first block is <= blk (an
// empty tensor starts where the next one does, and so is never found).
__device__ __forceinline__ int64_t tensor_of(const AdamWTensor* tensors, int64_t count, int64_t blk) {
  int64_t lo = 0, hi = count;  // tensors[lo].first_block <= blk < tensors[hi].first_block
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (tensors[mid].first_block <= blk) lo = mid;
    else hi = mid;
  }
  return lo;
}

// AdamWParams of tensor i of a multi-tensor step.
__device__ __forceinline__ AdamWParams params_of(const AdamWMultiParams& mp, int64_t i) {
  const AdamWTensor& t = mp.tensors[i];
  const float* s = mp.scalars + i * kAdamWScalars;
  AdamWParams p;
  p.param = t.param;
  p.grad = t.grad;
  p.param_dtype = mp.param_dtype;
  p.n = t.n;
  p.m = t.m;
  p.m_scale_inv = t.m_scale_inv;
  p.v = t.v;
  p.v_scale_inv = t.v_scale_inv;
  p.second_moment = mp.second_moment;
  p.beta1 = s[0];
  p.one_minus_beta1 = s[1];
  p.beta2 = s[2];
  p.one_minus_beta2 = s[3];
  p.eps = s[4];
  p.step_size = s[5];
  p.bias2_rsqrt = s[6];
  p.decay = s[7];
  p.l2 = s[8];
  p.seed = uint64_t(mp.rng[2 * i]);
  p.offset = uint64_t(mp.rng[2 * i + 1]);
  return p;
}

template <typename P, SecondMoment V>
__global__ void adamw_step_multi_kernel(AdamWMultiParams mp) {
  const int64_t blk = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (blk >= mp.total_blocks) return;  // a whole warp leaves together
  const int64_t i = tensor_of(mp.tensors, mp.count, blk);
  step_block<P, V>(params_of(mp, i), blk - mp.tensors[i].first_block, threadIdx.x & 31);
}

template <typename T>
struct TypeTag {
  using type = T;
};
template <SecondMoment V>
using FormTag = std::integral_constant<SecondMoment, V>;

// f(TypeTag<P>, FormTag<V>) for the kernels' template arguments of a param dtype and v format.
template <typename F>
void dispatch(DType param_dtype, SecondMoment form, const char* op, F&& f) {
  auto with_form = [&](auto param_tag) {
    switch (form) {
      case SecondMoment::kSqrtE4M3: f(param_tag, FormTag<SecondMoment::kSqrtE4M3>{}); break;
      case SecondMoment::kE5M2: f(param_tag, FormTag<SecondMoment::kE5M2>{}); break;
      case SecondMoment::kBF16: f(param_tag, FormTag<SecondMoment::kBF16>{}); break;
    }
  };
  switch (param_dtype) {
    case DType::kFloat32: with_form(TypeTag<float>{}); break;
    case DType::kBFloat16: with_form(TypeTag<__nv_bfloat16>{}); break;
    default: throw std::invalid_argument(std::string("fp8ops: ") + op + ": param must be float32 or bfloat16");
  }
}

// The grid of one warp per block, kWarps warps a CTA.
dim3 grid_of(int64_t blocks, const char* op) {
  const int64_t ctas = (blocks + kWarps - 1) / kWarps;
  if (ctas > 0x7FFFFFFF) throw std::invalid_argument(std::string("fp8ops: ") + op + ": too many values for one launch");
  return dim3(static_cast<unsigned>(ctas));
}

}  // namespace

void launch_adamw_step(const AdamWParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  const dim3 grid = grid_of((p.n + kBlock - 1) / kBlock, "adamw_step"), block(32 * kWarps);
  dispatch(p.param_dtype, p.second_moment, "adamw_step", [&](auto param_tag, auto form_tag) {
    using P = typename decltype(param_tag)::type;
    launch_kernel(adamw_step_kernel<P, decltype(form_tag)::value>, grid, block, stream, p);
  });
}

void launch_adamw_step_multi(const AdamWMultiParams& p, cudaStream_t stream) {
  if (p.total_blocks == 0) return;
  const dim3 grid = grid_of(p.total_blocks, "adamw_step_multi"), block(32 * kWarps);
  dispatch(p.param_dtype, p.second_moment, "adamw_step_multi", [&](auto param_tag, auto form_tag) {
    using P = typename decltype(param_tag)::type;
    launch_kernel(adamw_step_multi_kernel<P, decltype(form_tag)::value>, grid, block, stream, p);
  });
}

}  // namespace fp8ops
