// Microbenchmark of launch_amax without Python: GB/s read, against a device-to-device copy of
// the same bytes, on random bf16 data (never zeros), L2 flushed, median of CUDA-event-timed runs.
//   ./bench_amax [n_elements]
#include <cstdio>
#include <cstdlib>

#include "bench_util.cuh"

using bench::fill_random;
using bench::median_ms;

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : (int64_t)1 << 28;
  const size_t flush_bytes = size_t(256) << 20;
  __nv_bfloat16 *x, *y;
  float* amax;
  void* flush;
  FP8OPS_CUDA_CHECK(cudaMalloc(&flush, flush_bytes));
  FP8OPS_CUDA_CHECK(cudaMalloc(&x, n * 2));
  FP8OPS_CUDA_CHECK(cudaMalloc(&y, n * 2));
  FP8OPS_CUDA_CHECK(cudaMalloc(&amax, sizeof(float)));
  fill_random<<<1024, 256>>>(x, n, 1234u);
  FP8OPS_CUDA_CHECK(cudaGetLastError());
  float t_amax = median_ms([&] { fp8ops::launch_amax({x, fp8ops::DType::kBFloat16, n, amax}, 0); },
                           flush, flush_bytes);
  float t_copy = median_ms(
      [&] { FP8OPS_CUDA_CHECK(cudaMemcpyAsync(y, x, n * 2, cudaMemcpyDeviceToDevice)); }, flush, flush_bytes);
  double gb = n * 2 / 1e9;
  std::printf("amax bf16 n=%lld: %.1f GB/s read; copy %.1f GB/s (read+write); ratio %.3f\n",
              (long long)n, gb / (t_amax * 1e-3), 2 * gb / (t_copy * 1e-3),
              (gb / t_amax) / (2 * gb / t_copy));
  FP8OPS_CUDA_CHECK(cudaFree(x));
  FP8OPS_CUDA_CHECK(cudaFree(y));
  FP8OPS_CUDA_CHECK(cudaFree(amax));
  FP8OPS_CUDA_CHECK(cudaFree(flush));
  return 0;
}
