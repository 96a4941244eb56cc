// Microbenchmark of launch_quantize (nearest, stochastic, + transpose) without Python: GB/s read +
// written against cudaMemcpy of the same bytes, random bf16 data (never zeros), L2 flushed by a
// 256 MB write before each run, median of CUDA-event-timed runs.
//   ./bench_cast [rows] [cols]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common.cuh"

namespace {

__global__ void fill_random(__nv_bfloat16* x, int64_t n, unsigned seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    x[i] = __float2bfloat16((float)(h & 0xffff) / 65536.0f * 8.0f - 4.0f + 1e-3f);
  }
}

template <typename F>
float median_ms(F&& f, void* flush, size_t flush_bytes, int iters = 30) {
  cudaEvent_t a, b;
  FP8OPS_CUDA_CHECK(cudaEventCreate(&a));
  FP8OPS_CUDA_CHECK(cudaEventCreate(&b));
  f();  // warm-up
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    FP8OPS_CUDA_CHECK(cudaMemsetAsync(flush, i, flush_bytes));
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

}  // namespace

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
  FP8OPS_CHECK_LAUNCH();
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
