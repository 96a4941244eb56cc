// Microbenchmark of launch_quantize (nearest, stochastic, + transpose) without Python: GB/s read +
// written against cudaMemcpy of the same bytes, random bf16 data (never zeros), L2 flushed by a
// 256 MB write before each run, median of CUDA-event-timed runs.
//   ./bench_cast [rows] [cols]
#include <cstdio>
#include <cstdlib>

#include "bench_util.cuh"

using bench::fill_random;
using bench::median_ms;

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 32768, cols = argc > 2 ? std::atoll(argv[2]) : 8192;
  const int64_t n = rows * cols;
  const size_t flush_bytes = size_t(256) << 20;
  __nv_bfloat16 *x, *y;
  uint8_t *q, *qt;
  float *scale, *amax;
  void* flush;
  FP8OPS_CUDA_CHECK(cudaMalloc(&x, n * 2));
  FP8OPS_CUDA_CHECK(cudaMalloc(&y, n * 2));
  FP8OPS_CUDA_CHECK(cudaMalloc(&q, n));
  FP8OPS_CUDA_CHECK(cudaMalloc(&qt, n));
  FP8OPS_CUDA_CHECK(cudaMalloc(&scale, sizeof(float)));
  FP8OPS_CUDA_CHECK(cudaMalloc(&amax, sizeof(float)));
  FP8OPS_CUDA_CHECK(cudaMalloc(&flush, flush_bytes));
  fill_random<<<1024, 256>>>(x, n, 1234u);
  FP8OPS_CUDA_CHECK(cudaGetLastError());
  const float s = 100.0f;
  FP8OPS_CUDA_CHECK(cudaMemcpy(scale, &s, sizeof(float), cudaMemcpyHostToDevice));

  auto quant = [&](bool stochastic, bool transpose) {
    fp8ops::QuantizeParams p{};
    p.x = x;
    p.x_dtype = fp8ops::DType::kBFloat16;
    p.n = n;
    p.cols = cols;
    p.scale = scale;
    p.out_dtype = fp8ops::DType::kE4M3;
    p.data = q;
    p.data_t = transpose ? qt : nullptr;
    p.amax = amax;
    p.stochastic = stochastic;
    p.seed = 1;
    p.offset = 2;
    fp8ops::launch_quantize(p, 0);
  };
  const float t_copy = median_ms([&] { FP8OPS_CUDA_CHECK(cudaMemcpyAsync(y, x, n * 2, cudaMemcpyDeviceToDevice)); },
                                 flush, flush_bytes);
  const double copy_gbs = 4.0 * n / (t_copy * 1e6);
  std::printf("bf16 [%lld, %lld] (%.0f MB), L2 flushed, median of 30\n", (long long)rows, (long long)cols,
              n * 2 / 1048576.0);
  std::printf("| op | ms | GB/s | vs copy |\n| --- | ---: | ---: | ---: |\n");
  std::printf("| cudaMemcpy d2d | %.4f | %.0f | 1.00 |\n", t_copy, copy_gbs);
  struct Case { const char* name; bool stoch, trans; double bytes; };
  for (Case c : {Case{"quantize+amax", false, false, 3.0 * n}, Case{"quantize+amax stochastic", true, false, 3.0 * n},
                 Case{"quantize+transpose+amax", false, true, 4.0 * n},
                 Case{"quantize+transpose+amax stochastic", true, true, 4.0 * n}}) {
    const float t = median_ms([&] { quant(c.stoch, c.trans); }, flush, flush_bytes);
    const double gbs = c.bytes / (t * 1e6);
    std::printf("| %s | %.4f | %.0f | %.2f |\n", c.name, t, gbs, gbs / copy_gbs);
  }
  for (void* p : {(void*)x, (void*)y, (void*)q, (void*)qt, (void*)scale, (void*)amax, flush})
    FP8OPS_CUDA_CHECK(cudaFree(p));
  return 0;
}
