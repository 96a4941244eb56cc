// A 128x128 tile of FP8 bytes staged in shared memory and written out transposed: the second half
// of the quantize + transpose cast. Each warp store writes one whole 128-byte line of the output.
// The tile's 16-byte chunks are swizzled by row so that both the row-wise writes into it and the
// column reads out of it are free of bank conflicts.
#pragma once
#include "common.cuh"

namespace fp8ops {

constexpr int kByteTile = 128;
constexpr int kByteTileThreads = 256;  // 8 warps: 16 tile columns each, a lane for every 4 rows

// Where byte (r, c) lives: chunk c / 16 of row r is stored as chunk (c / 16) ^ (r / 4 % 8) of the
// row, so the n <= 16 bytes from c (c % n == 0) stay contiguous.
__host__ __device__ __forceinline__ int byte_tile_offset(int r, int c) {
  return r * kByteTile + ((((c >> 4) ^ (r >> 2)) & 7) << 4) + (c & 15);
}

struct alignas(16) ByteTile {
  uint8_t b[kByteTile * kByteTile];
  __device__ __forceinline__ uint8_t* at(int r, int c) { return b + byte_tile_offset(r, c); }
};

// __byte_perm (selectors 0-7 only), also on the host.
__host__ __device__ __forceinline__ uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(x, y, s);
#else
  const uint64_t v = uint64_t(y) << 32 | x;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) r |= uint32_t(v >> (8 * ((s >> (4 * n)) & 7)) & 0xffu) << (8 * n);
  return r;
#endif
}

// A 4x4 byte transpose: byte k of out[i] is byte i of in[k].
__host__ __device__ __forceinline__ void transpose_4x4_bytes(const uint32_t in[4], uint32_t out[4]) {
  const uint32_t lo01 = byte_perm(in[0], in[1], 0x5140), hi01 = byte_perm(in[0], in[1], 0x7362);
  const uint32_t lo23 = byte_perm(in[2], in[3], 0x5140), hi23 = byte_perm(in[2], in[3], 0x7362);
  out[0] = byte_perm(lo01, lo23, 0x5410);
  out[1] = byte_perm(lo01, lo23, 0x7632);
  out[2] = byte_perm(hi01, hi23, 0x5410);
  out[3] = byte_perm(hi01, hi23, 0x7632);
}

// Whether the transposed stores may be 4-byte words: out holds rows of `rows` bytes.
inline bool byte_tile_word_stores(const void* out, int64_t rows) { return aligned(out, 4) && rows % 4 == 0; }

// tile(r, c) -> out[(c0 + c) * rows + r0 + r] for r0 + r < rows, c0 + c < cols. Warp w reads
// columns 16w .. 16w + 15 of rows 4 lane .. 4 lane + 3 (four 16-byte loads), transposes the 4x4
// byte blocks with byte permutes and writes a word to each of 16 output rows.
__device__ __forceinline__ void store_byte_tile_transposed(ByteTile& tile, uint8_t* __restrict__ out, int64_t rows,
                                                           int64_t cols, int64_t r0, int64_t c0, bool words) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint4 a[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) a[q] = *reinterpret_cast<const uint4*>(tile.at(4 * lane + q, 16 * warp));
  const int64_t gr = r0 + 4 * lane;
  if (gr >= rows) return;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    auto word = [&](int q) { return m == 0 ? a[q].x : m == 1 ? a[q].y : m == 2 ? a[q].z : a[q].w; };
    const uint32_t in[4] = {word(0), word(1), word(2), word(3)};
    uint32_t w[4];
    transpose_4x4_bytes(in, w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // w[i]: rows 4 lane .. + 3 of column 16 warp + 4m + i
      const int64_t gc = c0 + 16 * warp + 4 * m + i;
      if (gc >= cols) return;
      uint8_t* dst = out + gc * rows + gr;
      if (words) {  // rows % 4 == 0: the word is wholly in range
        *reinterpret_cast<uint32_t*>(dst) = w[i];
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (gr + k < rows) dst[k] = uint8_t(w[i] >> (8 * k));
      }
    }
  }
}

}  // namespace fp8ops
