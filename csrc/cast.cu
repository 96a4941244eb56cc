// Per-tensor cast kernels: amax (more kernels: issue 3).
#include "common.cuh"

namespace fp8ops {
namespace {

// Grid-stride max |x|; one atomicMax of the ordered bits per block.
template <typename T>
__global__ void amax_kernel(const T* __restrict__ x, int64_t n, unsigned* __restrict__ out) {
  unsigned m = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    m = max(m, abs_bits(to_float(x[i])));
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  __shared__ unsigned warp_max[32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0u;
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (threadIdx.x == 0) atomicMax(out, m);
  }
}

}  // namespace

void launch_amax(const AmaxParams& p, cudaStream_t stream) {
  FP8OPS_CUDA_CHECK(cudaMemsetAsync(p.amax, 0, sizeof(float), stream));
  if (p.n == 0) return;
  constexpr int kThreads = 256;
  dispatch_input(p.x_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    amax_kernel<T><<<grid_for(p.n, kThreads, 1024), kThreads, 0, stream>>>(
        static_cast<const T*>(p.x), p.n, reinterpret_cast<unsigned*>(p.amax));
    FP8OPS_CHECK_LAUNCH();
  });
}

}  // namespace fp8ops
