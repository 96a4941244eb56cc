// Blockwise scaled FP8 GEMM instantiations, E5M2 x E4M3 (dgrad/wgrad: A is the E5M2 gradient):
// 1x128 A scales with 128x128 (weight) or 1x128 (per-row) B scales; bfloat16 and float32 output
// (the binding makes float16 from float32).
#define FP8OPS_GEMM_SM90_DEFINE
#include "gemm_sm90.cuh"

namespace fp8ops::sm90 {
template struct GemmBlockwiseSm90<DType::kE5M2, DType::kE4M3, DType::kBFloat16, 128>;
template struct GemmBlockwiseSm90<DType::kE5M2, DType::kE4M3, DType::kFloat32, 128>;
template struct GemmBlockwiseSm90<DType::kE5M2, DType::kE4M3, DType::kBFloat16, 1>;
template struct GemmBlockwiseSm90<DType::kE5M2, DType::kE4M3, DType::kFloat32, 1>;
}  // namespace fp8ops::sm90
