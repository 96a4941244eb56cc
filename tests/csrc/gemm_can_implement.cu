// CUTLASS's own acceptance check, on the host (no GPU): for each problem on stdin, the padded
// problem that the binding passes (fp8ops::sm90_padded_problem) is offered to every sm90 GEMM
// configuration fp8ops instantiates, with the leading dimensions and 16-byte aligned pointers the
// binding uses. Input lines: "M N K out mode" (out: bf16 | f32; mode: padded, or raw to offer the
// problem unpadded, which shows that the check can fail). Output per line and configuration:
// "<config> ok" or "<config> FAIL <status>". Pointers are never dereferenced.
#define FP8OPS_GEMM_SM90_DEFINE
#include <cstdio>
#include <iostream>
#include <string>

#include "gemm_sm90.cuh"

using namespace fp8ops;
using namespace fp8ops::sm90;

namespace {

constexpr int kSms = 132;
void* fake(uintptr_t addr) { return reinterpret_cast<void*>(addr); }  // 16-byte aligned, unread

GemmParams per_tensor(const Sm90Problem& q, DType out) {
  GemmParams p{};
  p.a = fake(0x100000);
  p.b = fake(0x200000);
  p.a_dtype = p.b_dtype = DType::kE4M3;
  p.out_dtype = out;
  p.m = q.m, p.n = q.n, p.k = q.k;
  p.lda = p.ldb = q.k;
  p.ldd = q.n;
  p.a_scale_inv = p.b_scale_inv = static_cast<const float*>(fake(0x300000));
  p.bias = static_cast<const float*>(fake(0x300100));
  p.d = fake(0x400000);
  p.swizzle = 4;
  return p;
}

GemmBlockwiseParams blockwise(const Sm90Problem& q, DType out, bool per_row) {
  GemmBlockwiseParams p{};
  p.a = fake(0x100000);
  p.b = fake(0x200000);
  p.a_dtype = p.b_dtype = DType::kE4M3;
  p.out_dtype = out;
  p.m = q.m, p.n = q.n, p.k = q.k;
  p.lda = p.ldb = q.k;
  p.ldd = q.n;
  p.a_scales = static_cast<const float*>(fake(0x300000));
  p.b_scales = static_cast<const float*>(fake(0x500000));
  p.b_scales_per_row = per_row;
  p.bias = static_cast<const float*>(fake(0x600000));
  p.d = fake(0x400000);
  p.swizzle = 4;
  return p;
}

template <class Ty, class P>
void check(const char* name, const P& p) {
  cutlass::Status st = Ty::Gemm::can_implement(Ty::arguments(p, kSms, 0));
  if (st == cutlass::Status::kSuccess)
    std::printf("%s ok\n", name);
  else
    std::printf("%s FAIL %s\n", name, cutlassGetStatusString(st));
}

template <DType D>
void all_configs(int64_t m, int64_t n, int64_t k, bool raw) {
  const Sm90Problem q = raw ? Sm90Problem{m, n, k} : sm90_padded_problem(m, n, k, D, false);
  const GemmParams p = per_tensor(q, D);
  check<GemmSm90Types<DType::kE4M3, DType::kE4M3, D, TileConfig::kCooperative128x128>>("coop128", p);
  check<GemmSm90Types<DType::kE4M3, DType::kE4M3, D, TileConfig::kPingpong64x128>>("pingpong64", p);
  check<GemmSm90Types<DType::kE4M3, DType::kE4M3, D, TileConfig::kFastPingpong128x128>>("fast_pingpong128", p);
  check<GemmSm90Types<DType::kE4M3, DType::kE4M3, D, TileConfig::kFastCooperative128x256>>("fast_coop256", p);
  const Sm90Problem q128 = raw ? Sm90Problem{m, n, k} : sm90_padded_problem(m, n, k, D, true);
  check<GemmBlockwiseSm90Types<DType::kE4M3, DType::kE4M3, D, 128>>("blockwise_b128x128", blockwise(q128, D, false));
  check<GemmBlockwiseSm90Types<DType::kE4M3, DType::kE4M3, D, 1>>("blockwise_b1x128", blockwise(q, D, true));
}

}  // namespace

int main() {
  int64_t m, n, k;
  std::string out, mode;
  while (std::cin >> m >> n >> k >> out >> mode) {
    std::printf("problem %lld %lld %lld %s %s\n", static_cast<long long>(m), static_cast<long long>(n),
                static_cast<long long>(k), out.c_str(), mode.c_str());
    const bool raw = mode == "raw";
    if (out == "bf16")
      all_configs<DType::kBFloat16>(m, n, k, raw);
    else if (out == "f32")
      all_configs<DType::kFloat32>(m, n, k, raw);
    else
      return 2;
  }
  return 0;
}
