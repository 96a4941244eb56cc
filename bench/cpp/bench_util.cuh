// Shared by the C++ microbenchmarks: random device fills (never zeros) and the median of
// CUDA-event timings, each run after an L2 flush (a memset of a buffer larger than L2).
#pragma once
#include <algorithm>
#include <vector>

#include "common.cuh"

namespace bench {

// Hash-based uniform values in [-4, 4) shifted off zero: cheap, deterministic, no cuRAND needed.
template <typename T>
__global__ void fill_random(T* x, int64_t n, unsigned seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = T((float)(h & 0xffff) / 65536.0f * 8.0f - 4.0f + 1e-3f);
  }
}

template <typename F>
float median_ms(F&& f, void* flush, size_t flush_bytes, int iters = 30, int warmup = 3) {
  cudaEvent_t a, b;
  FP8OPS_CUDA_CHECK(cudaEventCreate(&a));
  FP8OPS_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) f();
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    FP8OPS_CUDA_CHECK(cudaMemsetAsync(flush, i & 0xff, flush_bytes));
    FP8OPS_CUDA_CHECK(cudaEventRecord(a));
    f();
    FP8OPS_CUDA_CHECK(cudaEventRecord(b));
    FP8OPS_CUDA_CHECK(cudaEventSynchronize(b));
    float ms;
    FP8OPS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  FP8OPS_CUDA_CHECK(cudaEventDestroy(a));
  FP8OPS_CUDA_CHECK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace bench
