// Per-tensor scaled FP8 GEMM instantiations, E4M3 x E4M3 (forward: input x weight):
// fast accumulation, 128x128x128 ping-pong. One file per configuration so they build in parallel.
#define FP8OPS_GEMM_SM90_DEFINE
#include "gemm_sm90.cuh"

namespace fp8ops::sm90 {
template struct GemmSm90<DType::kE4M3, DType::kE4M3, DType::kBFloat16, TileConfig::kFastPingpong128x128>;
template struct GemmSm90<DType::kE4M3, DType::kE4M3, DType::kFloat16, TileConfig::kFastPingpong128x128>;
template struct GemmSm90<DType::kE4M3, DType::kE4M3, DType::kFloat32, TileConfig::kFastPingpong128x128>;
}  // namespace fp8ops::sm90
