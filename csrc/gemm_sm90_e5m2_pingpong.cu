// Per-tensor scaled FP8 GEMM instantiations, E5M2 x E4M3 (gradients: grad_output x weight or input):
// 64x128x128 ping-pong (promoted mainloop; small M or few tiles). One file per configuration so they build in parallel.
#define FP8OPS_GEMM_SM90_DEFINE
#include "gemm_sm90.cuh"

namespace fp8ops::sm90 {
template struct GemmSm90<DType::kE5M2, DType::kE4M3, DType::kBFloat16, TileConfig::kPingpong64x128>;
template struct GemmSm90<DType::kE5M2, DType::kE4M3, DType::kFloat16, TileConfig::kPingpong64x128>;
template struct GemmSm90<DType::kE5M2, DType::kE4M3, DType::kFloat32, TileConfig::kPingpong64x128>;
}  // namespace fp8ops::sm90
