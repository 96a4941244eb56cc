// CPU kernels that read FP8 bytes back for the emulation's GEMMs (docs/design.md, "Backends":
// emulated GEMMs upcast exactly): FP8 -> float32, and the MXFP8 dequantize (the value times its
// block's power of two), each in one pass, for one tensor or both operands of a GEMM in one
// parallel region; and the byte transpose of FP8 data. Where the emulation makes about seven
// passes of tensor ops for a conversion (emulation._fp8_to_f32), these make one. Data holding a
// NaN byte is left to torch's conversion (its NaN payloads are the emulation's): the kernels then
// say so and the caller converts.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "cast_cpu.h"
#include "decode_cpu.h"
#include "kernels_cpu.h"

namespace fp8ops_cpu {
namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per task at least
constexpr int64_t kPanel = 64;       // rows of a transposed data put in order at a time

// out[i] = float32 of data[i] for n elements; returns the largest magnitude byte (NaN check).
template <class F>
FP8OPS_ALWAYS_INLINE uint32_t decode_range(const uint8_t* data, float* out, int64_t n) {
  uint32_t top = 0;
  for (int64_t i = 0; i < n; ++i) {
    top = std::max(top, uint32_t(data[i] & 0x7Fu));
    out[i] = from_fp8<F>(data[i]);
  }
  return top;
}
FP8OPS_CPU_CLONES uint32_t decode_e4m3(const uint8_t* data, float* out, int64_t n) {
  return decode_range<E4M3>(data, out, n);
}
FP8OPS_CPU_CLONES uint32_t decode_e5m2(const uint8_t* data, float* out, int64_t n) {
  return decode_range<E5M2>(data, out, n);
}

// E8M0 byte -> 2^(byte - 127), as emulation.e8m0_to_float: byte 0 is the subnormal 2^-127, 0xFF NaN.
FP8OPS_ALWAYS_INLINE float e8m0(uint8_t e) {
  const uint32_t edge = (e == 0 || e == 0xFF) ? 1u : 0u;
  return float_of(uint32_t(e) << 23 | edge << 22);
}

// Rows [r0, r1) of the MX dequantize from rows of bytes (row r at data + (r - r0) * ld):
// out[r, c] = data[r, c] * 2^(scales[r, c / block] - 127), out [R, C] contiguous. Returns the
// largest magnitude byte.
template <class F>
FP8OPS_ALWAYS_INLINE uint32_t dequantize_mx_rows(const uint8_t* data, int64_t ld,
                                                 const uint8_t* scales, int64_t ss0, int64_t ss1,
                                                 int64_t block, float* out, int64_t r0, int64_t r1,
                                                 int64_t C) {
  uint32_t top = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* d = data + (r - r0) * ld;
    float* o = out + r * C;
    for (int64_t c0 = 0; c0 < C; c0 += block) {
      const float m = e8m0(scales[r * ss0 + (c0 / block) * ss1]);
      if (block == 32) {  // the MX block: a constant trip count unrolls into whole vectors
        for (int64_t c = c0; c < c0 + 32; ++c) {
          top = std::max(top, uint32_t(d[c] & 0x7Fu));
          o[c] = from_fp8<F>(d[c]) * m;
        }
      } else {
        for (int64_t c = c0; c < c0 + block; ++c) {
          top = std::max(top, uint32_t(d[c] & 0x7Fu));
          o[c] = from_fp8<F>(d[c]) * m;
        }
      }
    }
  }
  return top;
}
FP8OPS_CPU_CLONES uint32_t dequantize_mx_e4m3(const uint8_t* data, int64_t ld, const uint8_t* scales,
                                              int64_t ss0, int64_t ss1, int64_t block, float* out,
                                              int64_t r0, int64_t r1, int64_t C) {
  return dequantize_mx_rows<E4M3>(data, ld, scales, ss0, ss1, block, out, r0, r1, C);
}
FP8OPS_CPU_CLONES uint32_t dequantize_mx_e5m2(const uint8_t* data, int64_t ld, const uint8_t* scales,
                                              int64_t ss0, int64_t ss1, int64_t block, float* out,
                                              int64_t r0, int64_t r1, int64_t C) {
  return dequantize_mx_rows<E5M2>(data, ld, scales, ss0, ss1, block, out, r0, r1, C);
}

bool is_fp8(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2;
}

uint32_t first_nan(const at::Tensor& data) {
  return data.scalar_type() == at::kFloat8_e4m3fn ? E4M3::kFirstNan : E5M2::kFirstNan;
}

void fold_max(std::atomic<uint32_t>& top, uint32_t t) {
  uint32_t prev = top.load();
  while (t > prev && !top.compare_exchange_weak(prev, t)) {
  }
}

// One tensor of a decode: its bytes in memory order and where they go.
struct Decode {
  const uint8_t* data;
  float* out;
  int64_t n;
  uint32_t (*fn)(const uint8_t*, float*, int64_t);
  uint32_t first_nan;
  std::atomic<uint32_t> top{0};  // the largest magnitude byte met

  bool decoded() const { return top.load() < first_nan; }
};

void check_decode(const at::Tensor& data, const at::Tensor& out) {
  TORCH_CHECK(data.device().is_cpu() && is_fp8(data) && data.is_non_overlapping_and_dense(),
              "decode_fp8: data must be a dense float8_e4m3fn or float8_e5m2 CPU tensor");
  bool same_layout = out.sizes() == data.sizes();
  // (the stride of a dim of size 1 is moot, and so is every stride of an empty tensor)
  for (int64_t d = 0; same_layout && data.numel() > 0 && d < data.dim(); ++d)
    same_layout = data.size(d) == 1 || out.stride(d) == data.stride(d);
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && same_layout,
              "decode_fp8: out must be a float32 CPU tensor of data's sizes and strides");
  for (int64_t s : data.strides()) TORCH_CHECK(s >= 0, "decode_fp8: negative strides");
}

// One tensor of an MX dequantize: 2-D data at any strides, its scales, the contiguous output.
struct Dequantize {
  const uint8_t* data;
  int64_t sd0, sd1;
  const uint8_t* scales;
  int64_t ss0, ss1, block, R, C;
  float* out;
  uint32_t (*fn)(const uint8_t*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*, int64_t,
                 int64_t, int64_t);
  uint32_t first_nan;
  std::atomic<uint32_t> top{0};  // the largest magnitude byte met

  bool decoded() const { return top.load() < first_nan; }

  // rows [r0, r1): straight from data's rows, or (a transposed data) its columns put in order first
  void rows(int64_t r0, int64_t r1, std::vector<uint8_t>& panel) {
    uint32_t t = 0;
    if (sd1 == 1) {
      t = fn(data + r0 * sd0, sd0, scales, ss0, ss1, block, out, r0, r1, C);
    } else {
      panel.resize(kPanel * C);
      for (int64_t p = r0; p < r1; p += kPanel) {
        const int64_t p1 = std::min(r1, p + kPanel);
        transpose_bytes(data + p * sd0, sd1, sd0, panel.data(), C, C, p1 - p);
        t = std::max(t, fn(panel.data(), C, scales, ss0, ss1, block, out, p, p1, C));
      }
    }
    fold_max(top, t);
  }
};

void check_dequantize(const at::Tensor& data, const at::Tensor& scales, int64_t block_size,
                      const at::Tensor& out) {
  TORCH_CHECK(data.device().is_cpu() && is_fp8(data) && data.dim() == 2,
              "dequantize_mx: data must be a 2-D float8_e4m3fn or float8_e5m2 CPU tensor");
  TORCH_CHECK(block_size > 0 && data.size(1) % block_size == 0,
              "dequantize_mx: the row length must be a multiple of block_size");
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kByte && scales.dim() == 2 &&
                  scales.size(0) == data.size(0) && scales.size(1) == data.size(1) / block_size,
              "dequantize_mx: scales must be uint8 [rows, row length / block_size]");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.sizes() == data.sizes(),
              "dequantize_mx: out must be a contiguous float32 CPU tensor of data's sizes");
}

void set(Decode& job, const at::Tensor& data, const at::Tensor& out) {
  check_decode(data, out);
  job.data = reinterpret_cast<const uint8_t*>(data.const_data_ptr());
  job.out = out.mutable_data_ptr<float>();
  job.n = data.numel();
  job.fn = data.scalar_type() == at::kFloat8_e4m3fn ? &decode_e4m3 : &decode_e5m2;
  job.first_nan = first_nan(data);
}

// The jobs over one range of all their elements: one parallel region whatever their number.
void run(Decode* jobs, int n) {
  int64_t total = 0;
  for (int j = 0; j < n; ++j) total += jobs[j].n;
  at::parallel_for(0, total, kGrain, [&](int64_t i0, int64_t i1) {
    int64_t base = 0;
    for (int j = 0; j < n; ++j) {
      Decode& job = jobs[j];
      const int64_t lo = std::max<int64_t>(i0 - base, 0), hi = std::min<int64_t>(i1 - base, job.n);
      if (lo < hi) fold_max(job.top, job.fn(job.data + lo, job.out + lo, hi - lo));
      base += job.n;
    }
  });
}

void set(Dequantize& q, const at::Tensor& data, const at::Tensor& scales, int64_t block_size,
         const at::Tensor& out) {
  check_dequantize(data, scales, block_size, out);
  q.data = reinterpret_cast<const uint8_t*>(data.const_data_ptr());
  q.sd0 = data.stride(0), q.sd1 = data.stride(1);
  q.scales = scales.const_data_ptr<uint8_t>();
  q.ss0 = scales.stride(0), q.ss1 = scales.stride(1);
  q.block = block_size, q.R = data.size(1) ? data.size(0) : 0, q.C = data.size(1);
  q.out = out.mutable_data_ptr<float>();
  q.fn = data.scalar_type() == at::kFloat8_e4m3fn ? &dequantize_mx_e4m3 : &dequantize_mx_e5m2;
  q.first_nan = first_nan(data);
}

// The jobs over one range of all their rows: one parallel region whatever their number.
void run(Dequantize* jobs, int n) {
  int64_t total = 0, C = 1;
  for (int j = 0; j < n; ++j) total += jobs[j].R, C = std::max(C, jobs[j].C);
  at::parallel_for(0, total, std::max<int64_t>(kPanel, kGrain / C), [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> panel;
    int64_t base = 0;
    for (int j = 0; j < n; ++j) {
      const int64_t lo = std::max<int64_t>(r0 - base, 0), hi = std::min<int64_t>(r1 - base, jobs[j].R);
      if (lo < hi) jobs[j].rows(lo, hi, panel);
      base += jobs[j].R;
    }
  });
}

}  // namespace

std::pair<bool, bool> decode_fp8_pair(const at::Tensor& a, const at::Tensor& a_out,
                                      const at::Tensor& b, const at::Tensor& b_out) {
  Decode jobs[2];
  set(jobs[0], a, a_out);
  set(jobs[1], b, b_out);
  run(jobs, 2);
  return {jobs[0].decoded(), jobs[1].decoded()};
}

std::pair<bool, bool> dequantize_mx_pair(const at::Tensor& a, const at::Tensor& a_scales,
                                         const at::Tensor& a_out, const at::Tensor& b,
                                         const at::Tensor& b_scales, const at::Tensor& b_out,
                                         int64_t block_size) {
  Dequantize jobs[2];
  set(jobs[0], a, a_scales, block_size, a_out);
  set(jobs[1], b, b_scales, block_size, b_out);
  run(jobs, 2);
  return {jobs[0].decoded(), jobs[1].decoded()};
}

bool decode_fp8_cpu(const at::Tensor& data, const at::Tensor& out) {
  Decode job;
  set(job, data, out);
  run(&job, 1);
  return job.decoded();
}

bool dequantize_mx_cpu(const at::Tensor& data, const at::Tensor& scales, int64_t block_size,
                       const at::Tensor& out) {
  Dequantize job;
  set(job, data, scales, block_size, out);
  run(&job, 1);
  return job.decoded();
}

at::Tensor transpose_bytes_cpu(const at::Tensor& data) {
  TORCH_CHECK(data.device().is_cpu() && data.dim() == 2 && data.element_size() == 1,
              "transpose_bytes: data must be a 2-D CPU tensor of one-byte elements");
  const int64_t R = data.size(0), C = data.size(1);
  at::Tensor out = at::empty({C, R}, data.options());
  if (R == 0 || C == 0) return out;
  const auto* d = reinterpret_cast<const uint8_t*>(data.const_data_ptr());
  auto* o = reinterpret_cast<uint8_t*>(out.mutable_data_ptr());
  const int64_t s0 = data.stride(0), s1 = data.stride(1);
  // tasks of whole panels of rows of data (columns of out)
  const int64_t panels = (R + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, std::max<int64_t>(1, kGrain / (kPanel * C)), [&](int64_t p0, int64_t p1) {
    const int64_t r0 = p0 * kPanel, r1 = std::min(R, p1 * kPanel);
    transpose_bytes(d + r0 * s0, s0, s1, o + r0, R, r1 - r0, C);
  });
  return out;
}

}  // namespace fp8ops_cpu
