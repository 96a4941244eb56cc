// Host-only checks of the scalar device math in csrc/common.cuh (no GPU needed): the test
// tests/test_csrc_host.py compiles this with nvcc, feeds it vectors on stdin and compares the
// answers bit for bit with fp8ops/ops/emulation.py.
//
// Usage: host_check MODE < input > output. Input and output are whitespace-separated tokens;
// floats travel as their 32-bit patterns in hex, so nothing is lost in printing.
//   philox                 records: c0 c1 c2 c3 k0 k1 (hex)        -> 4 hex words
//   words  seed offset     records: i (decimal int64)               -> word (hex)
//   sr     fmt seed offset records: i x_bits scale_bits             -> bits of stochastic_value(x * scale)
//   mx     fmt rceil       records: amax_bits                       -> byte, bits of 2^-e
//   e8m0                   records: byte (decimal)                  -> bits of the scale
//   bw     fmt pow2        records: amax_bits                       -> scale bits, scale_inv bits
//   sfa    fp8max_bits margin_bits pow2   records: amax_bits prev_bits -> scale bits
//   dsu    (one update per record, see run_dsu)                    -> history, scale, scale_inv, rep, pending
//   cvt    fmt             records: a_bits b_bits  -> to_fp8(a), to_fp8(b), to_fp8x2(a, b) (cuda_fp8.hpp host path)
//   up     fmt             records: byte (decimal) -> bits of fp8_to_float (cuda_fp8.hpp host path)
//   pairplan               records: rows cols elem_bytes (decimal) -> tiles_r tiles_c smem_bytes
//                          (the launch of the blockwise pair cast, fp8ops.h plan_blockwise_pair)
//   tileoff                records: r c (decimal)  -> byte_tile_offset(r, c) (byte_tile.cuh)
//   t4x4                   records: 4 words (hex)  -> transpose_4x4_bytes of them, 4 words (hex)
// fmt is 0 for E4M3, 1 for E5M2.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "byte_tile.cuh"
#include "common.cuh"
#include "grouped_layout.h"

using namespace fp8ops;

namespace {

uint32_t rd_hex() {
  unsigned long long v;
  if (scanf("%llx", &v) != 1) exit(3);
  return uint32_t(v);
}
bool try_hex(uint32_t* out) {
  unsigned long long v;
  if (scanf("%llx", &v) != 1) return false;
  *out = uint32_t(v);
  return true;
}
uint64_t rd_u64() {
  unsigned long long v;
  if (scanf("%llx", &v) != 1) exit(3);
  return uint64_t(v);
}
int64_t rd_i64() {
  long long v;
  if (scanf("%lld", &v) != 1) exit(3);
  return int64_t(v);
}
float rd_f() { return bits_as_float(rd_hex()); }
void wr_f(float f) { printf("%08x", float_as_bits(f)); }

template <Fp8 F>
void run_sr(uint64_t seed, uint64_t offset) {
  RandomWords rw(seed, offset);
  long long i;
  while (scanf("%lld", &i) == 1) {
    const float x = rd_f(), s = rd_f();
    wr_f(stochastic_value<F>(mul_rn(x, s), rw(i)));  // quant_one: y = __fmul_rn(x, s)
    printf("\n");
  }
}

template <Fp8 F>
void run_mx(bool rceil) {
  uint32_t a;
  while (try_hex(&a)) {
    const MxScale s = mx_scale<F>(a, rceil);
    printf("%u ", unsigned(s.byte));
    wr_f(s.mul);
    printf(" %d\n", int(s.bad));
  }
}

template <Fp8 F>
void run_bw(bool pow2) {
  uint32_t a;
  while (try_hex(&a)) {
    const BlockScale s = block_scale<F>(a, pow2);
    wr_f(s.scale);
    printf(" ");
    wr_f(s.scale_inv);
    printf(" %d\n", int(s.bad));
  }
}

template <Fp8 F>
void run_cvt() {
  uint32_t a, b;
  while (try_hex(&a)) {
    b = rd_hex();
    const float fa = bits_as_float(a), fb = bits_as_float(b);
    printf("%u %u %u\n", unsigned(to_fp8<F>(fa)), unsigned(to_fp8<F>(fb)), unsigned(to_fp8x2<F>(fa, fb)));
  }
}

template <Fp8 F>
void run_up() {
  int b;
  while (scanf("%d", &b) == 1) {
    wr_f(fp8_to_float<F>(uint8_t(b)));
    printf("\n");
  }
}

// One delayed_scale_update, composed from the shared scalar cores exactly as delayed_scale_kernel
// composes them (the kernel's parallel reductions replaced by a loop and std::sort of the keys).
// Record: L interval algo ema_a ema_b q(double bits, hex) pow2 fp8_max margin step
//         hist[L] scale rep pending
void run_dsu() {
  int L;
  while (scanf("%d", &L) == 1) {
    const int64_t interval = rd_i64();
    const int algo = int(rd_i64());
    const float ema_a = rd_f(), ema_b = rd_f();
    const uint64_t qb = rd_u64();
    double q;
    memcpy(&q, &qb, 8);
    const bool pow2 = rd_i64() != 0;
    const float fp8_max = rd_f(), margin = rd_f();
    const int64_t step = rd_i64();
    std::vector<float> hist(L);
    for (auto& h : hist) h = rd_f();
    const float scale = rd_f(), rep_prev = rd_f(), pending = rd_f();

    const UpdateStep us = update_step(step, interval);
    std::vector<float> rolled(L);
    for (int t = 0; t < L; ++t) rolled[t] = t == 0 ? pending : hist[t - 1];
    float rep = 0.0f;
    switch (AmaxAlgo(algo)) {
      case AmaxAlgo::kMostRecent: rep = pending; break;
      case AmaxAlgo::kEma: rep = ema_amax(ema_a, ema_b, pending, rep_prev, us.n_updates); break;
      case AmaxAlgo::kMax: {
        float m = -INFINITY;
        for (float h : rolled) m = nan_max(m, h);
        rep = m;
        break;
      }
      case AmaxAlgo::kPercentile: {
        std::vector<uint32_t> keys(L);
        for (int t = 0; t < L; ++t) keys[t] = sort_key(rolled[t]);
        std::sort(keys.begin(), keys.end());
        rep = from_sort_key(keys[percentile_index(us.n_updates, L, q)]);
        break;
      }
    }
    const float s = us.update ? scale_from_amax(rep, scale, fp8_max, margin, pow2) : scale;
    for (int t = 0; t < L; ++t) {
      wr_f(us.update ? rolled[t] : hist[t]);
      printf(" ");
    }
    wr_f(s);
    printf(" ");
    wr_f(rcp_rn(s));
    printf(" ");
    wr_f(us.update ? rep : rep_prev);
    printf(" ");
    wr_f(us.update ? 0.0f : pending);
    printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: host_check MODE < input\n");
    return 2;
  }
  const char* mode = argv[1];
  if (!strcmp(mode, "philox")) {
    uint32_t c0;
    while (try_hex(&c0)) {
      const uint32_t c1 = rd_hex(), c2 = rd_hex(), c3 = rd_hex(), k0 = rd_hex(), k1 = rd_hex();
      const PhiloxBlock r = philox4x32_10({c0, c1, c2, c3}, k0, k1);
      printf("%08x %08x %08x %08x\n", r.x, r.y, r.z, r.w);
    }
  } else if (!strcmp(mode, "words")) {
    const uint64_t seed = rd_u64(), offset = rd_u64();
    RandomWords rw(seed, offset);
    long long i;
    while (scanf("%lld", &i) == 1) printf("%08x\n", rw(int64_t(i)));
  } else if (!strcmp(mode, "sr")) {
    const int fmt = int(rd_i64());
    const uint64_t seed = rd_u64(), offset = rd_u64();
    fmt ? run_sr<Fp8::kE5M2>(seed, offset) : run_sr<Fp8::kE4M3>(seed, offset);
  } else if (!strcmp(mode, "mx")) {
    const int fmt = int(rd_i64());
    const bool rceil = rd_i64() != 0;
    fmt ? run_mx<Fp8::kE5M2>(rceil) : run_mx<Fp8::kE4M3>(rceil);
  } else if (!strcmp(mode, "e8m0")) {
    int b;
    while (scanf("%d", &b) == 1) {
      wr_f(e8m0_to_float(uint8_t(b)));
      printf("\n");
    }
  } else if (!strcmp(mode, "bw")) {
    const int fmt = int(rd_i64());
    const bool pow2 = rd_i64() != 0;
    fmt ? run_bw<Fp8::kE5M2>(pow2) : run_bw<Fp8::kE4M3>(pow2);
  } else if (!strcmp(mode, "sfa")) {
    const float fp8_max = rd_f(), margin = rd_f();
    const bool pow2 = rd_i64() != 0;
    uint32_t a;
    while (try_hex(&a)) {
      const float prev = rd_f();
      wr_f(scale_from_amax(bits_as_float(a), prev, fp8_max, margin, pow2));
      printf("\n");
    }
  } else if (!strcmp(mode, "dsu")) {
    run_dsu();
  } else if (!strcmp(mode, "cvt")) {
    const int fmt = int(rd_i64());
    fmt ? run_cvt<Fp8::kE5M2>() : run_cvt<Fp8::kE4M3>();
  } else if (!strcmp(mode, "pairplan")) {
    long long rows, cols, elem;
    while (scanf("%lld %lld %lld", &rows, &cols, &elem) == 3) {
      const BlockwisePairPlan plan = plan_blockwise_pair(rows, cols, int(elem));
      printf("%lld %lld %zu\n", (long long)plan.tiles_r, (long long)plan.tiles_c, plan.smem_bytes);
    }
  } else if (!strcmp(mode, "tileoff")) {
    int r, c;
    while (scanf("%d %d", &r, &c) == 2) printf("%d\n", byte_tile_offset(r, c));
  } else if (!strcmp(mode, "t4x4")) {
    uint32_t in[4], out[4];
    while (try_hex(&in[0])) {
      for (int k = 1; k < 4; ++k) in[k] = rd_hex();
      transpose_4x4_bytes(in, out);
      printf("%08x %08x %08x %08x\n", out[0], out[1], out[2], out[3]);
    }
  } else if (!strcmp(mode, "grouped")) {
    // header: rows_kind (1 rows, 0 wgrad) total n k groups; then the offsets. One line per group:
    // start rows packed_start | m n k | a_off b_off d_off | lda ldb ldd | tiles; then packed_length.
    const bool rows = rd_i64() != 0;
    const int64_t total = rd_i64(), n = rd_i64(), k = rd_i64();
    const int groups = int(rd_i64());
    std::vector<int32_t> offsets(groups);
    for (auto& o : offsets) o = int32_t(rd_i64());
    const int64_t ld = fp8ops::grouped::packed_length(total, groups);
    for (int g = 0; g < groups; ++g) {
      const fp8ops::grouped::Span s = fp8ops::grouped::group_span(offsets.data(), g, total);
      const int64_t at = fp8ops::grouped::packed_start(offsets.data(), g, total);
      const fp8ops::grouped::Problem q = rows ? fp8ops::grouped::rows_problem(s, g, n, k)
                                              : fp8ops::grouped::wgrad_problem(s, g, at, n, k, ld);
      printf("%lld %lld %lld %d %d %d %lld %lld %lld %lld %lld %lld %lld\n", (long long)s.start,
             (long long)s.rows, (long long)at, q.m, q.n, q.k, (long long)q.a_offset, (long long)q.b_offset,
             (long long)q.d_offset, (long long)q.lda, (long long)q.ldb, (long long)q.ldd,
             (long long)fp8ops::grouped::tiles(q));
    }
    printf("%lld\n", (long long)ld);
  } else if (!strcmp(mode, "rowgroup")) {
    // header: groups rows; then the offsets. One line: each row's group.
    const int groups = int(rd_i64());
    const int64_t rows = rd_i64();
    std::vector<int32_t> offsets(groups);
    for (auto& o : offsets) o = int32_t(rd_i64());
    for (int64_t r = 0; r < rows; ++r) printf("%d ", fp8ops::grouped::row_group(offsets.data(), groups, r));
    printf("\n");
  } else if (!strcmp(mode, "up")) {
    const int fmt = int(rd_i64());
    fmt ? run_up<Fp8::kE5M2>() : run_up<Fp8::kE4M3>();
  } else {
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
  }
  return 0;
}
