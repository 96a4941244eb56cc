// Microbenchmark of launch_gemm_sm90 without Python: E4M3 x E4M3 -> bf16, D = alpha * A @ B^T,
// random data filled on the device (never zeros), L2 flushed before every run, median of many
// CUDA-event-timed runs. Fast and promoted accumulation, and the blockwise-scaled GEMM.
//   ./bench_gemm [M N K]        (default 8192 8192 8192)
#include <cstdio>
#include <cstdlib>

#include "bench_util.cuh"

namespace {

__global__ void fill_value(float* x, int64_t n, float v) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    x[i] = v;
}

}  // namespace

using bench::fill_random;
using bench::median_ms;

int main(int argc, char** argv) {
  const int64_t M = argc > 3 ? std::atoll(argv[1]) : 8192;
  const int64_t N = argc > 3 ? std::atoll(argv[2]) : 8192;
  const int64_t K = argc > 3 ? std::atoll(argv[3]) : 8192;
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    std::fprintf(stderr, "bench_gemm: no CUDA device\n");
    return 2;
  }
  FP8OPS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  FP8OPS_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9 || minor != 0) {
    std::fprintf(stderr, "bench_gemm: the CUTLASS FP8 GEMM needs sm_90, this is sm_%d%d\n", major, minor);
    return 2;
  }
  if (K % 16 || N % 8) {
    std::fprintf(stderr, "bench_gemm: K must be a multiple of 16 and N of 8\n");
    return 2;
  }
  const int64_t Kb = (K + 127) / 128, Nb = (N + 127) / 128;
  __nv_fp8_e4m3 *a, *b;
  __nv_bfloat16* d;
  float *scales, *sfa, *sfb;
  void* flush;
  const size_t flush_bytes = size_t(256) << 20;
  FP8OPS_CUDA_CHECK(cudaMalloc(&a, M * K));
  FP8OPS_CUDA_CHECK(cudaMalloc(&b, N * K));
  FP8OPS_CUDA_CHECK(cudaMalloc(&d, M * N * 2));
  FP8OPS_CUDA_CHECK(cudaMalloc(&scales, 2 * sizeof(float)));
  FP8OPS_CUDA_CHECK(cudaMalloc(&sfa, Kb * M * sizeof(float)));
  FP8OPS_CUDA_CHECK(cudaMalloc(&sfb, Kb * Nb * sizeof(float)));
  FP8OPS_CUDA_CHECK(cudaMalloc(&flush, flush_bytes));
  fill_random<<<1024, 256>>>(a, M * K, 1234u);
  FP8OPS_CUDA_CHECK(cudaGetLastError());
  fill_random<<<1024, 256>>>(b, N * K, 5678u);
  FP8OPS_CUDA_CHECK(cudaGetLastError());
  fill_value<<<1, 32>>>(scales, 2, 0.5f);
  FP8OPS_CUDA_CHECK(cudaGetLastError());
  fill_value<<<256, 256>>>(sfa, Kb * M, 0.25f);
  FP8OPS_CUDA_CHECK(cudaGetLastError());
  fill_value<<<64, 256>>>(sfb, Kb * Nb, 0.125f);
  FP8OPS_CUDA_CHECK(cudaGetLastError());

  fp8ops::GemmParams p{};
  p.a = a;
  p.b = b;
  p.a_dtype = p.b_dtype = fp8ops::DType::kE4M3;
  p.out_dtype = fp8ops::DType::kBFloat16;
  p.m = M;
  p.n = N;
  p.k = K;
  p.lda = p.ldb = K;
  p.ldd = N;
  p.a_scale_inv = scales;
  p.b_scale_inv = scales + 1;
  p.d = d;
  size_t ws_bytes = fp8ops::gemm_sm90_workspace_size(p);
  void* ws = nullptr;
  if (ws_bytes) FP8OPS_CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  p.workspace = ws;
  p.workspace_bytes = ws_bytes;

  fp8ops::GemmBlockwiseParams q{};
  q.a = a;
  q.b = b;
  q.a_dtype = q.b_dtype = fp8ops::DType::kE4M3;
  q.out_dtype = fp8ops::DType::kBFloat16;
  q.m = M;
  q.n = N;
  q.k = K;
  q.lda = q.ldb = K;
  q.ldd = N;
  q.a_scales = sfa;
  q.b_scales = sfb;
  q.b_scales_per_row = false;
  q.d = d;
  size_t ws_blk_bytes = fp8ops::gemm_blockwise_sm90_workspace_size(q);
  void* ws_blk = nullptr;
  if (ws_blk_bytes) FP8OPS_CUDA_CHECK(cudaMalloc(&ws_blk, ws_blk_bytes));
  q.workspace = ws_blk;
  q.workspace_bytes = ws_blk_bytes;

  const double tflop = 2.0 * M * N * K / 1e12;
  for (bool fast : {true, false}) {
    p.fast_accum = fast;
    float ms = median_ms([&] { fp8ops::launch_gemm_sm90(p, 0); }, flush, flush_bytes, 50, 5);
    std::printf("gemm_sm90 e4m3 x e4m3 -> bf16 %lldx%lldx%lld, %s accumulation: %.3f ms, %.1f TFLOP/s\n",
                (long long)M, (long long)N, (long long)K, fast ? "fast" : "promoted", ms, tflop / (ms * 1e-3));
  }
  float ms = median_ms([&] { fp8ops::launch_gemm_blockwise_sm90(q, 0); }, flush, flush_bytes, 50, 5);
  std::printf("gemm_blockwise_sm90 (1x128 x 128x128 scales) %lldx%lldx%lld: %.3f ms, %.1f TFLOP/s\n",
              (long long)M, (long long)N, (long long)K, ms, tflop / (ms * 1e-3));
  FP8OPS_CUDA_CHECK(cudaDeviceSynchronize());

  for (void* ptr : {(void*)a, (void*)b, (void*)d, (void*)scales, (void*)sfa, (void*)sfb, flush, ws, ws_blk})
    if (ptr) FP8OPS_CUDA_CHECK(cudaFree(ptr));
  return 0;
}
