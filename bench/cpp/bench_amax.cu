// Microbenchmark of launch_amax without Python: GB/s read, against a device-to-device copy of
// the same bytes, on random bf16 data (never zeros), median of many CUDA-event-timed runs.
//   ./bench_amax [n_elements]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common.cuh"

namespace {

__global__ void fill_random(__nv_bfloat16* x, int64_t n, unsigned seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    x[i] = __float2bfloat16((float)(h & 0xffff) / 65536.0f * 8.0f - 4.0f);
  }
}

template <typename F>
float median_ms(F&& f, int iters = 50) {
  cudaEvent_t a, b;
  FP8OPS_CUDA_CHECK(cudaEventCreate(&a));
  FP8OPS_CUDA_CHECK(cudaEventCreate(&b));
  f();  // warm-up
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    FP8OPS_CUDA_CHECK(cudaEventRecord(a));
    f();
    FP8OPS_CUDA_CHECK(cudaEventRecord(b));
    FP8OPS_CUDA_CHECK(cudaEventSynchronize(b));
    float ms;
    FP8OPS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : (int64_t)1 << 28;
  __nv_bfloat16 *x, *y;
  float* amax;
  FP8OPS_CUDA_CHECK(cudaMalloc(&x, n * 2));
  FP8OPS_CUDA_CHECK(cudaMalloc(&y, n * 2));
  FP8OPS_CUDA_CHECK(cudaMalloc(&amax, sizeof(float)));
  fill_random<<<1024, 256>>>(x, n, 1234u);
  FP8OPS_CHECK_LAUNCH();
  float t_amax = median_ms([&] { fp8ops::launch_amax({x, fp8ops::DType::kBFloat16, n, amax}, 0); });
  float t_copy = median_ms([&] { FP8OPS_CUDA_CHECK(cudaMemcpyAsync(y, x, n * 2, cudaMemcpyDeviceToDevice)); });
  double gb = n * 2 / 1e9;
  std::printf("amax bf16 n=%lld: %.1f GB/s read; copy %.1f GB/s (read+write); ratio %.3f\n",
              (long long)n, gb / (t_amax * 1e-3), 2 * gb / (t_copy * 1e-3),
              (gb / t_amax) / (2 * gb / t_copy));
  FP8OPS_CUDA_CHECK(cudaFree(x));
  FP8OPS_CUDA_CHECK(cudaFree(y));
  FP8OPS_CUDA_CHECK(cudaFree(amax));
  return 0;
}
