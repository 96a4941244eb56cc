// Grouped FP8 GEMM instantiations with E5M2 A operands: the dgrad and wgrad (gradient x weight or input).
// One file per A format so the two build in parallel.
#define FP8OPS_GEMM_SM90_DEFINE
#include "gemm_sm90_grouped.cuh"

namespace fp8ops::sm90 {
template struct GroupedGemmSm90<DType::kE5M2, DType::kE4M3, DType::kBFloat16>;
template struct GroupedGemmSm90<DType::kE5M2, DType::kE4M3, DType::kFloat32>;
}  // namespace fp8ops::sm90
