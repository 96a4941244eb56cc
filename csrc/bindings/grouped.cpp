// Torch bindings of the grouped FP8 GEMMs on Hopper (gemm_sm90_grouped*.cu): grouped_gemm_sm90
// (forward and dgrad, groups along A's rows) and grouped_gemm_wgrad_sm90 (groups along the
// reduction). fp8ops/ops/grouped.py routes grouped_gemm / grouped_gemm_wgrad here when the
// operands suit the kernel and keeps the emulation for the rest.
#include "common.h"

#include "../grouped_gemm.h"

namespace {
using namespace fp8ops_bind;

void check_operands(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets, const at::Tensor& sa,
                    const at::Tensor& sb, at::ScalarType out_dtype, int64_t b_dim, const char* op) {
  check_cuda(a, "a");
  check_same_device(a, b, "a", "b");
  check_same_device(a, offsets, "a", "offsets");
  check_same_device(a, sa, "a", "a_scale_inv");
  check_same_device(a, sb, "a", "b_scale_inv");
  FP8OPS_CHECK(a.dim() == 2 && b.dim() == b_dim, "fp8ops.", op, ": a must be 2-D and b ", b_dim, "-D, got ",
               shape_str(a), " and ", shape_str(b));
  FP8OPS_CHECK((a.scalar_type() == at::kFloat8_e4m3fn || a.scalar_type() == at::kFloat8_e5m2) &&
                   b.scalar_type() == at::kFloat8_e4m3fn,
               "fp8ops.", op, ": operands must be (float8_e4m3fn or float8_e5m2, float8_e4m3fn), got ",
               dtype_str(a.scalar_type()), " and ", dtype_str(b.scalar_type()));
  FP8OPS_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat, "fp8ops.", op,
               ": out_dtype must be bfloat16 or float32, got ", dtype_str(out_dtype));
  FP8OPS_CHECK(offsets.scalar_type() == at::kInt && offsets.dim() == 1 && offsets.size(0) > 0, "fp8ops.", op,
               ": offsets must be a non-empty 1-D int32 tensor, got ", dtype_str(offsets.scalar_type()), " ",
               shape_str(offsets));
  const int64_t groups = offsets.size(0);
  for (const at::Tensor* s : {&sa, &sb})
    FP8OPS_CHECK(s->scalar_type() == at::kFloat && s->dim() == 1 && s->size(0) == groups, "fp8ops.", op,
                 ": scales must be float32 [", groups, "] (one per group), got ", dtype_str(s->scalar_type()), " ",
                 shape_str(*s));
}

fp8ops::GroupedGemmParams params(fp8ops::GroupedProblem problem, const at::Tensor& a, const at::Tensor& b,
                                 const at::Tensor& offsets, const at::Tensor& sa, const at::Tensor& sb,
                                 const at::Tensor& out, int64_t m, int64_t n, int64_t k) {
  fp8ops::GroupedGemmParams p{};
  p.problem = problem;
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.d = out.data_ptr();
  p.a_dtype = to_dtype(a.scalar_type());
  p.b_dtype = to_dtype(b.scalar_type());
  p.out_dtype = to_dtype(out.scalar_type());
  p.m = m;
  p.n = n;
  p.k = k;
  p.groups = static_cast<int>(offsets.size(0));
  p.offsets = offsets.data_ptr<int32_t>();
  p.a_scale_inv = sa.data_ptr<float>();
  p.b_scale_inv = sb.data_ptr<float>();
  return p;
}

void launch(fp8ops::GroupedGemmParams& p, const at::Tensor& like) {
  try {
    size_t bytes = fp8ops::grouped_gemm_sm90_workspace_size(p);
    // one allocation per call for the per-group tables (the caching allocator serves it)
    at::Tensor ws = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
    p.workspace = ws.data_ptr();
    p.workspace_bytes = bytes;
    fp8ops::launch_grouped_gemm_sm90(p, stream_of(like));
  } catch (const std::exception& e) {
    FP8OPS_CHECK(false, e.what());
  }
}

// Y [M, N], Y_g = (A_g B_g^T) * a_scale_inv[g] * b_scale_inv[g]; a [M, K], b [E, N, K].
at::Tensor grouped_gemm_sm90_cuda(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& offsets,
                                  const at::Tensor& sa, const at::Tensor& sb, at::ScalarType out_dtype) {
  check_operands(a_in, b_in, offsets, sa, sb, out_dtype, 3, "grouped_gemm_sm90");
  FP8OPS_CHECK(a_in.size(1) == b_in.size(2) && b_in.size(0) == offsets.size(0), "fp8ops.grouped_gemm_sm90: ",
               "a [M, K] and b [E, N, K] disagree: ", shape_str(a_in), ", ", shape_str(b_in), " with ",
               offsets.size(0), " groups");
  c10::cuda::CUDAGuard guard(a_in.device());
  const int64_t M = a_in.size(0), N = b_in.size(1), K = a_in.size(1);
  at::Tensor out = at::empty({M, N}, a_in.options().dtype(out_dtype));
  if (M == 0) return out;
  // locals: the launch reads their pointers, so any contiguous copy must outlive it
  at::Tensor a = a_in.contiguous(), b = b_in.contiguous(), offs = offsets.contiguous();
  at::Tensor sa_c = sa.contiguous(), sb_c = sb.contiguous();
  fp8ops::GroupedGemmParams p = params(fp8ops::GroupedProblem::kRows, a, b, offs, sa_c, sb_c, out, M, N, K);
  launch(p, a);
  return out;
}

// dW [E, N, K], dW_g = (A_g B_g^T) * a_scale_inv[g] * b_scale_inv[g]; a [N, M], b [K, M], the
// groups ranges of M.
at::Tensor grouped_gemm_wgrad_sm90_cuda(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& offsets,
                                        const at::Tensor& sa, const at::Tensor& sb, at::ScalarType out_dtype) {
  check_operands(a_in, b_in, offsets, sa, sb, out_dtype, 2, "grouped_gemm_wgrad_sm90");
  FP8OPS_CHECK(a_in.size(1) == b_in.size(1), "fp8ops.grouped_gemm_wgrad_sm90: a [N, M] and b [K, M] disagree: ",
               shape_str(a_in), ", ", shape_str(b_in));
  c10::cuda::CUDAGuard guard(a_in.device());
  const int64_t E = offsets.size(0), N = a_in.size(0), K = b_in.size(0), M = a_in.size(1);
  if (M == 0) return at::zeros({E, N, K}, a_in.options().dtype(out_dtype));
  at::Tensor out = at::empty({E, N, K}, a_in.options().dtype(out_dtype));
  at::Tensor a = a_in.contiguous(), b = b_in.contiguous(), offs = offsets.contiguous();
  at::Tensor sa_c = sa.contiguous(), sb_c = sb.contiguous();
  fp8ops::GroupedGemmParams p = params(fp8ops::GroupedProblem::kWgrad, a, b, offs, sa_c, sb_c, out, M, N, K);
  launch(p, a);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8ops, CUDA, m) {
  m.impl("grouped_gemm_sm90", &grouped_gemm_sm90_cuda);
  m.impl("grouped_gemm_wgrad_sm90", &grouped_gemm_wgrad_sm90_cuda);
}
