// Philox4x32-10 and the per-element random words of stochastic rounding (docs/design.md, "Stochastic rounding").
// Torch-free and CUDA-free: the CUDA cast kernels (through common.cuh) and the CPU kernels
// (stochastic_cpu.cpp, built by a plain C++ compiler) share this one definition.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FP8OPS_HD __host__ __device__ __forceinline__
#else
#define FP8OPS_HD inline
#endif

namespace fp8ops {

struct PhiloxBlock {
  uint32_t x, y, z, w;
};

// Counter c (x = lowest word), key (k0, k1).
FP8OPS_HD PhiloxBlock philox4x32_10(PhiloxBlock c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    if (r) k0 += kW0, k1 += kW1;
    const uint64_t p0 = uint64_t(c.x) * kM0, p1 = uint64_t(c.z) * kM1;
    c = {uint32_t(p1 >> 32) ^ c.y ^ k0, uint32_t(p1), uint32_t(p0 >> 32) ^ c.w ^ k1, uint32_t(p0)};
  }
  return c;
}

// Philox block j of the stream (seed, offset): counter (j low, j high, offset low, offset high),
// key (seed low, seed high). Flat element i takes word i % 4 of block i / 4.
FP8OPS_HD PhiloxBlock philox_block(int64_t j, uint64_t seed, uint64_t offset) {
  return philox4x32_10({uint32_t(j), uint32_t(uint64_t(j) >> 32), uint32_t(offset),
                        uint32_t(offset >> 32)},
                       uint32_t(seed), uint32_t(seed >> 32));
}

// The random word of flat element i. Caches the last block, so a thread walking consecutive
// elements pays one Philox per four.
struct RandomWords {
  uint64_t seed, offset;
  int64_t j = -1;
  PhiloxBlock r{};
  FP8OPS_HD RandomWords(uint64_t seed_, uint64_t offset_) : seed(seed_), offset(offset_) {}
  FP8OPS_HD uint32_t operator()(int64_t i) {
    if ((i >> 2) != j) {
      j = i >> 2;
      r = philox_block(j, seed, offset);
    }
    const int w = int(i & 3);
    return w == 0 ? r.x : w == 1 ? r.y : w == 2 ? r.z : r.w;
  }
};

}  // namespace fp8ops
