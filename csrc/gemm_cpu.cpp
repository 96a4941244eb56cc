// CPU kernels of the emulation's GEMMs (emulation.gemm, gemm_blockwise, gemm_mx; docs/design.md,
// "Backends": the FP8 operands upcast exactly, float32 accumulation): both operands read back
// in one parallel region (decode_cpu.h), the products by torch.mm on the same float32 operands
// as the emulation's (so the same sums), and the scaling, promotion and bias in as few passes as
// the arithmetic allows, each float32 operation the emulation's, in its order.
//
// NaN payloads: x86 returns the first operand's NaN when both are NaN, and the compiler may
// order the operands of a commutative operation either way. Where the emulation's tensor code
// could meet two NaNs with different payloads in one operation (a NaN scale or bias, NaN FP8
// bytes in the blockwise promotion), these kernels take its torch ops or decline.
#include <ATen/Parallel.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cast_cpu.h"
#include "decode_cpu.h"
#include "kernels_cpu.h"

namespace fp8ops_cpu {
namespace {

constexpr int64_t kBlock = 128;  // the blockwise GEMM's K block

int64_t row_grain(int64_t N) {
  return std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(N, 1));
}

// Rows [m0, m1) of acc [M, N]: acc * alpha (when scale) + bias (when given).
FP8OPS_CPU_CLONES void epilogue_rows(float* acc, bool scale, float alpha, const float* bias,
                                     int64_t m0, int64_t m1, int64_t N) {
  for (int64_t m = m0; m < m1; ++m) {
    float* row = acc + m * N;
    if (scale && bias != nullptr) {
      for (int64_t n = 0; n < N; ++n) row[n] = row[n] * alpha + bias[n];
    } else if (scale) {
      for (int64_t n = 0; n < N; ++n) row[n] = row[n] * alpha;
    } else if (bias != nullptr) {
      for (int64_t n = 0; n < N; ++n) row[n] = row[n] + bias[n];
    }
  }
}

// Rows [m0, m1) of the blockwise promotion of K blocks [k0, k1): for each block in order,
// acc = acc * s + 0 for the first (the sum from zeros: 0 + v is v with -0 made +0), else
// acc = acc + partial * s, s = sa[m, k] * sb[k][n] one float32 product; then + bias when given.
// partial k of row m: parts[k - k0] + m * N (the first block's is acc itself).
FP8OPS_CPU_CLONES void promote_rows(float* acc, float* const* parts, const float* sa,
                                    int64_t sa_s0, int64_t sa_s1, const float* sb, int64_t k0,
                                    int64_t k1, const float* bias, int64_t m0, int64_t m1, int64_t N) {
  for (int64_t m = m0; m < m1; ++m) {
    float* row = acc + m * N;
    for (int64_t k = k0; k < k1; ++k) {
      const float a = sa[m * sa_s0 + k * sa_s1];
      const float* b = sb + (k - k0) * N;
      if (k == 0) {
        for (int64_t n = 0; n < N; ++n) row[n] = row[n] * (a * b[n]) + 0.0f;
      } else {
        const float* p = parts[k - k0] + m * N;
        for (int64_t n = 0; n < N; ++n) row[n] = row[n] + p[n] * (a * b[n]);
      }
    }
    if (bias != nullptr)
      for (int64_t n = 0; n < N; ++n) row[n] = row[n] + bias[n];
  }
}

bool any_nan(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const float* p = c.const_data_ptr<float>();
  bool nan = false;
  for (int64_t i = 0; i < c.numel(); ++i) nan = nan || std::isnan(p[i]);
  return nan;
}

// The bias as float32 (the emulation's _f32), or undefined without one.
at::Tensor f32_bias(const c10::optional<at::Tensor>& bias, int64_t N, const char* op) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N, op,
              ": bias must be a CPU tensor [N]");
  return bias->to(at::kFloat).contiguous();
}

void check_operands(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && a.dim() == 2 && b.dim() == 2 &&
                  a.size(1) == b.size(1),
              op, ": a [M, K] and b [N, K] must be 2-D CPU tensors with one K");
}

void check_acc(const at::Tensor& acc, int64_t M, int64_t N, const char* op) {
  TORCH_CHECK(acc.device().is_cpu() && acc.scalar_type() == at::kFloat && acc.is_contiguous() &&
                  acc.dim() == 2 && acc.size(0) == M && acc.size(1) == N,
              op, ": acc must be a contiguous float32 CPU tensor [M, N]");
}

// acc (+)= bias after the product: one pass for a bias without NaN, else torch's add_.
void add_bias(const at::Tensor& acc, const at::Tensor& bias) {
  if (!bias.defined()) return;
  if (any_nan(bias)) {
    const_cast<at::Tensor&>(acc).add_(bias);
    return;
  }
  const int64_t M = acc.size(0), N = acc.size(1);
  float* accp = acc.mutable_data_ptr<float>();
  const float* bp = bias.const_data_ptr<float>();
  at::parallel_for(0, M, row_grain(N), [&](int64_t m0, int64_t m1) {
    epilogue_rows(accp, false, 1.f, bp, m0, m1, N);
  });
}

}  // namespace

at::Tensor gemm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& alpha,
                    const c10::optional<at::Tensor>& bias, const at::Tensor& af,
                    const at::Tensor& bf) {
  check_operands(a, b, "gemm");
  TORCH_CHECK(alpha.device().is_cpu() && alpha.scalar_type() == at::kFloat && alpha.numel() == 1,
              "gemm: alpha must be one float32 CPU value");
  const at::Tensor bias32 = f32_bias(bias, b.size(0), "gemm");
  // NaN bytes: torch's conversion (data.float(), the same kernel as copy_), for its payloads
  const auto decoded = decode_fp8_pair(a, af, b, bf);
  if (!decoded.first) const_cast<at::Tensor&>(af).copy_(a);
  if (!decoded.second) const_cast<at::Tensor&>(bf).copy_(b);
  at::Tensor acc = at::mm(af, bf.t());
  const float alpha_v = alpha.item<float>();
  if (std::isnan(alpha_v) || (bias32.defined() && any_nan(bias32))) {
    acc.mul_(alpha);  // the emulation's own ops
    if (bias32.defined()) acc.add_(bias32);
    return acc;
  }
  const int64_t M = acc.size(0), N = acc.size(1);
  float* accp = acc.mutable_data_ptr<float>();
  const float* bp = bias32.defined() ? bias32.const_data_ptr<float>() : nullptr;
  at::parallel_for(0, M, row_grain(N), [&](int64_t m0, int64_t m1) {
    epilogue_rows(accp, true, alpha_v, bp, m0, m1, N);
  });
  return acc;
}

bool gemm_blockwise_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                        const at::Tensor& b_scale_inv, const c10::optional<at::Tensor>& bias,
                        const at::Tensor& acc, const at::Tensor& af, const at::Tensor& bf,
                        const at::Tensor& part) {
  check_operands(a, b, "gemm_blockwise");
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1), Kb = (K + kBlock - 1) / kBlock;
  TORCH_CHECK(M > 0 && N > 0 && K > 0, "gemm_blockwise: empty operands take the tensor code");
  TORCH_CHECK(a_scale_inv.device().is_cpu() && a_scale_inv.scalar_type() == at::kFloat &&
                  a_scale_inv.dim() == 2 && a_scale_inv.size(0) == M && a_scale_inv.size(1) == Kb,
              "gemm_blockwise: a_scale_inv must be a float32 CPU tensor [M, K blocks]");
  const bool per_row = b_scale_inv.size(0) == N;
  TORCH_CHECK(b_scale_inv.device().is_cpu() && b_scale_inv.scalar_type() == at::kFloat &&
                  b_scale_inv.dim() == 2 && b_scale_inv.size(1) == Kb &&
                  (per_row || b_scale_inv.size(0) == (N + kBlock - 1) / kBlock),
              "gemm_blockwise: b_scale_inv must be a float32 CPU tensor [N or N blocks, K blocks]");
  check_acc(acc, M, N, "gemm_blockwise");
  TORCH_CHECK(part.device().is_cpu() && part.scalar_type() == at::kFloat && part.is_contiguous() &&
                  part.dim() == 3 && part.size(1) == M && part.size(2) == N && (Kb == 1 || part.size(0) > 0),
              "gemm_blockwise: part must be a contiguous float32 CPU tensor [G, M, N], G > 0 "
              "for more than one K block");
  if (any_nan(a_scale_inv) || any_nan(b_scale_inv)) return false;
  const auto decoded = decode_fp8_pair(a, af, b, bf);
  if (!decoded.first || !decoded.second) return false;
  const at::Tensor bias32 = f32_bias(bias, N, "gemm_blockwise");
  const bool fuse_bias = bias32.defined() && !any_nan(bias32);
  const int64_t G = part.size(0);
  float* accp = acc.mutable_data_ptr<float>();
  const float* sa = a_scale_inv.const_data_ptr<float>();
  const float* sbp = b_scale_inv.const_data_ptr<float>();
  std::vector<float> sb;          // each K block's B scale per output column
  std::vector<float*> parts;      // each K block's partial sums
  // groups of K blocks: their partial sums (the first block's into acc) by torch.mm, the
  // emulation's very calls on the same views, then one promotion pass over the group
  for (int64_t k0 = 0; k0 < Kb;) {
    const int64_t k1 = std::min(Kb, k0 + G + (k0 == 0 ? 1 : 0));
    sb.resize((k1 - k0) * N);
    parts.assign(k1 - k0, nullptr);
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t c0 = k * kBlock, kl = std::min(kBlock, K - c0);
      at::Tensor out = k == 0 ? acc : part.select(0, k - k0 - (k0 == 0 ? 1 : 0));
      at::mm_out(out, af.narrow(1, c0, kl), bf.narrow(1, c0, kl).t());
      parts[k - k0] = out.mutable_data_ptr<float>();
      const float* sbk = sbp + k * b_scale_inv.stride(1);
      for (int64_t n = 0; n < N; ++n)
        sb[(k - k0) * N + n] = sbk[(per_row ? n : n / kBlock) * b_scale_inv.stride(0)];
    }
    const float* bp = (k1 == Kb && fuse_bias) ? bias32.const_data_ptr<float>() : nullptr;
    at::parallel_for(0, M, row_grain(N), [&](int64_t m0, int64_t m1) {
      promote_rows(accp, parts.data(), sa, a_scale_inv.stride(0), a_scale_inv.stride(1), sb.data(), k0,
                   k1, bp, m0, m1, N);
    });
    k0 = k1;
  }
  if (bias32.defined() && !fuse_bias) const_cast<at::Tensor&>(acc).add_(bias32);
  return true;
}

bool gemm_mx_cpu(const at::Tensor& a, const at::Tensor& a_scales, const at::Tensor& b,
                 const at::Tensor& b_scales, int64_t block_size, const c10::optional<at::Tensor>& bias,
                 const at::Tensor& acc, const at::Tensor& ad, const at::Tensor& bd) {
  check_operands(a, b, "gemm_mx");
  check_acc(acc, a.size(0), b.size(0), "gemm_mx");
  const at::Tensor bias32 = f32_bias(bias, b.size(0), "gemm_mx");
  const auto decoded = dequantize_mx_pair(a, a_scales, ad, b, b_scales, bd, block_size);
  if (!decoded.first || !decoded.second) return false;
  at::mm_out(const_cast<at::Tensor&>(acc), ad, bd.t());
  add_bias(acc, bias32);
  return true;
}

}  // namespace fp8ops_cpu
