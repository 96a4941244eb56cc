// The grouped FP8 GEMMs of mixture-of-experts layers on Hopper (CUTLASS sm90 ptr-array grouped
// GEMM, TMA + WGMMA, promoted FP32 accumulation): torch-free launcher API. The group sizes stay
// on the device: a setup kernel turns the offsets into CUTLASS's per-group problem shapes,
// operand pointers and scales (grouped_layout.h), so a launch never synchronizes.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "fp8ops.h"

namespace fp8ops {

enum class GroupedProblem : int {
  kRows = 0,   // D [M, N], D_g = A_g B_g^T: A [M, K] rows by group, B [E, N, K]
  kWgrad = 1,  // D [E, N, K], D_g = A_g B_g^T: A [N, M], B [K, M], each group a range of M
};

struct GroupedGemmParams {
  GroupedProblem problem;
  const void* a;  // contiguous FP8
  const void* b;  // contiguous FP8
  void* d;        // contiguous, out_dtype
  DType a_dtype, b_dtype, out_dtype;
  int64_t m;  // rows of the grouped dimension (kRows: A's rows; kWgrad: A's and B's columns)
  int64_t n;  // D's columns (kRows) or rows of each D_g (kWgrad)
  int64_t k;  // the reduction (kRows) or D_g's columns (kWgrad)
  int groups;
  const int32_t* offsets;     // device [groups], cumulative end rows
  const float* a_scale_inv;   // device [groups]
  const float* b_scale_inv;   // device [groups]; D_g = (A_g B_g^T) * (a_scale_inv[g] * b_scale_inv[g])
  void* workspace;            // grouped_gemm_sm90_workspace_size bytes, 256-byte aligned
  size_t workspace_bytes;
};

// Bytes of device scratch a launch needs: the per-group arrays, the packed wgrad operands and
// CUTLASS's own workspace (its tensor maps per SM).
size_t grouped_gemm_sm90_workspace_size(const GroupedGemmParams& p);
// Checks the arguments (throws std::invalid_argument) and launches on `stream`: the setup
// kernel, for kWgrad the packing and the zeroing of empty groups' outputs, for kRows the zeroing
// of the rows past the last group, then the grouped GEMM.
void launch_grouped_gemm_sm90(const GroupedGemmParams& p, cudaStream_t stream);

}  // namespace fp8ops
