// CUTLASS's own acceptance check of the grouped GEMM, on the host (no GPU): for each case on
// stdin, every group's problem as the setup kernel makes it (grouped_layout.h, run here on the
// host) is offered, with the host copy of the problem shapes that a launch leaves out, to the
// grouped kernel types fp8ops instantiates. Input lines:
//   "<rows|wgrad> <out: bf16|f32> M N K E o_1 ... o_E"
// Output per line: "<a_format> ok" or "<a_format> FAIL <status>". Pointers are never read.
#define FP8OPS_GEMM_SM90_DEFINE
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "gemm_sm90_grouped.cuh"

using namespace fp8ops;
using namespace fp8ops::sm90;

namespace {

constexpr int kSms = 132;

template <DType A, DType D>
void check(const char* name, bool rows, int64_t m, int64_t n, int64_t k, const std::vector<int32_t>& offsets) {
  using Ty = GroupedGemmSm90Types<A, DType::kE4M3, D>;
  const int groups = static_cast<int>(offsets.size());
  const int64_t ld = grouped::packed_length(m, groups);
  std::vector<typename Ty::Shape3> shapes;
  for (int g = 0; g < groups; ++g) {
    const grouped::Span s = grouped::group_span(offsets.data(), g, m);
    const grouped::Problem q = rows ? grouped::rows_problem(s, g, n, k)
                                    : grouped::wgrad_problem(s, g, grouped::packed_start(offsets.data(), g, m), n,
                                                             k, ld);
    shapes.push_back(typename Ty::Shape3{q.m, q.n, q.k});
  }
  typename Ty::Arrays fake{};
  fake.shapes = reinterpret_cast<typename Ty::Shape3*>(0x100000);  // device arrays: never read here
  cutlass::Status st = Ty::Gemm::can_implement(Ty::arguments(fake, groups, kSms, 0, shapes.data()));
  if (st == cutlass::Status::kSuccess)
    std::printf("%s ok\n", name);
  else
    std::printf("%s FAIL %s\n", name, cutlassGetStatusString(st));
}

template <DType D>
void both(bool rows, int64_t m, int64_t n, int64_t k, const std::vector<int32_t>& offsets) {
  check<DType::kE4M3, D>("e4m3", rows, m, n, k, offsets);
  check<DType::kE5M2, D>("e5m2", rows, m, n, k, offsets);
}

}  // namespace

int main() {
  std::string kind, out;
  int64_t m, n, k, e;
  while (std::cin >> kind >> out >> m >> n >> k >> e) {
    std::vector<int32_t> offsets(static_cast<size_t>(e));
    for (auto& o : offsets) std::cin >> o;
    std::printf("case\n");
    const bool rows = kind == "rows";
    if (out == "bf16")
      both<DType::kBFloat16>(rows, m, n, k, offsets);
    else if (out == "f32")
      both<DType::kFloat32>(rows, m, n, k, offsets);
    else
      return 2;
  }
  return 0;
}
