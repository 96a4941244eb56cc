// The transpose of a row-major byte matrix (FP8 data): the dgrad copy of a weight that arrives
// already cast (gathered in FP8 by FSDP2, or cast blockwise), where torch's strided copy moves one
// byte per thread and reaches a few percent of copy bandwidth.
#include "common.cuh"

namespace fp8ops {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 64;

// One 64x64 tile per block: rows read R bytes per thread, staged in shared memory, written out
// along the rows of out [cols, rows] W bytes per thread.
template <int R, int W>
__global__ void __launch_bounds__(kThreads) transpose_bytes_kernel(TransposeBytesParams p, int64_t tiles_c) {
  __shared__ alignas(16) uint8_t tile[kTile][kTile + 4];  // +4: fewer bank conflicts reading columns
  const int64_t r0 = (blockIdx.x / tiles_c) * kTile, c0 = (blockIdx.x % tiles_c) * kTile;

  constexpr int kReadersPerRow = kTile / R;
  const int tc = (threadIdx.x % kReadersPerRow) * R;
  for (int r = threadIdx.x / kReadersPerRow; r < kTile; r += kThreads / kReadersPerRow) {
    const int64_t gr = r0 + r, gc = c0 + tc;
    if (gr >= p.rows || gc >= p.cols) continue;  // with R > 1, cols % R == 0: whole vector in range
    const Pack<uint8_t, R> a = *reinterpret_cast<const Pack<uint8_t, R>*>(p.x + gr * p.cols + gc);
#pragma unroll
    for (int k = 0; k < R; ++k) tile[r][tc + k] = a.v[k];
  }
  __syncthreads();

  constexpr int kWritersPerRow = kTile / W;
  const int tr = (threadIdx.x % kWritersPerRow) * W;
  for (int c = threadIdx.x / kWritersPerRow; c < kTile; c += kThreads / kWritersPerRow) {
    const int64_t gc = c0 + c, gr = r0 + tr;
    if (gc >= p.cols || gr >= p.rows) continue;  // with W > 1, rows % W == 0: whole vector in range
    Pack<uint8_t, W> o;
#pragma unroll
    for (int k = 0; k < W; ++k) o.v[k] = tile[tr + k][c];
    *reinterpret_cast<Pack<uint8_t, W>*>(p.out + gc * p.rows + gr) = o;
  }
}

}  // namespace

void launch_transpose_bytes(const TransposeBytesParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.cols < 0) throw std::invalid_argument("fp8ops: transpose: negative size");
  if (p.rows == 0 || p.cols == 0) return;
  const int64_t tiles_c = (p.cols + kTile - 1) / kTile, tiles = (p.rows + kTile - 1) / kTile * tiles_c;
  if (tiles > 0x7fffffff) throw std::invalid_argument("fp8ops: transpose: tensor too large");
  const bool read16 = aligned(p.x, 16) && p.cols % 16 == 0;
  const int write = aligned(p.out, 16) && p.rows % 16 == 0 ? 16 : aligned(p.out, 4) && p.rows % 4 == 0 ? 4 : 1;
  auto go = [&](auto kernel) { launch_kernel(kernel, unsigned(tiles), kThreads, stream, p, tiles_c); };
  if (read16)
    write == 16 ? go(transpose_bytes_kernel<16, 16>) : write == 4 ? go(transpose_bytes_kernel<16, 4>)
                                                                 : go(transpose_bytes_kernel<16, 1>);
  else
    write == 16 ? go(transpose_bytes_kernel<1, 16>) : write == 4 ? go(transpose_bytes_kernel<1, 4>)
                                                                : go(transpose_bytes_kernel<1, 1>);
}

}  // namespace fp8ops
