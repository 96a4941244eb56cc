// CUTLASS 3.x Hopper (sm_90a) grouped FP8 GEMM: the ptr-array kernel (TMA + WGMMA,
// warp-specialized, persistent over the tiles of all groups), promoted FP32 accumulation every
// 128 of K, 128x128x128 cooperative tiles. D_g = alpha_g * (A_g B_g^T), alpha_g =
// a_scale_inv[g] * b_scale_inv[g] (one float32 product, as the emulation's per-group gemm).
//
// Per launch a setup kernel (here, since it writes CUTLASS's own stride and shape types) fills
// the per-group arrays from the offsets on the device; gemm_sm90_grouped.cu holds the launcher and
// the plain kernels (packing, zeroing) and sees only the declarations below. The instantiations
// are in gemm_sm90_grouped_<a>.cu, which define FP8OPS_GEMM_SM90_DEFINE.
#pragma once
#include <cstddef>
#include <cstdint>

#include "grouped_gemm.h"

namespace fp8ops::sm90 {

// Where the launcher's scratch lives: per-group spans for the packing and zeroing kernels.
struct GroupedSpans {
  int64_t* start;         // [groups] first row (clamped offsets)
  int64_t* rows;          // [groups] rows of the group
  int64_t* packed_start;  // [groups] first column in the packed wgrad operands
  uint8_t* packed_a;      // kWgrad: [n, packed_length], else null
  uint8_t* packed_b;      // kWgrad: [k, packed_length], else null
  int64_t packed_ld;      // packed_length(m, groups)
};

template <DType A, DType B, DType D>
struct GroupedGemmSm90 {
  // Bytes of the per-group arrays and of CUTLASS's workspace, before the spans.
  static size_t arrays_bytes(int groups, int sm_count);
  // Runs the setup kernel (spans and CUTLASS's arrays), then `between` (the launcher's packing
  // and zeroing, which read the spans), then the GEMM.
  static void run(const GroupedGemmParams& p, const GroupedSpans& spans, void* arrays, size_t arrays_bytes,
                  int sm_count, cudaStream_t stream, void (*between)(const GroupedGemmParams&, const GroupedSpans&,
                                                                    cudaStream_t));
};

}  // namespace fp8ops::sm90

#ifdef FP8OPS_GEMM_SM90_DEFINE

#include "common.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "grouped_layout.h"

namespace fp8ops::sm90 {

template <DType T> struct GroupedElement;
template <> struct GroupedElement<DType::kE4M3> { using type = cutlass::float_e4m3_t; };
template <> struct GroupedElement<DType::kE5M2> { using type = cutlass::float_e5m2_t; };
template <> struct GroupedElement<DType::kBFloat16> { using type = cutlass::bfloat16_t; };
template <> struct GroupedElement<DType::kFloat32> { using type = float; };

template <DType A, DType B, DType D>
struct GroupedGemmSm90Types {
  using EA = typename GroupedElement<A>::type;
  using EB = typename GroupedElement<B>::type;
  using ED = typename GroupedElement<D>::type;
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_128>;
  // One CTA per cluster: a cluster never spans two groups' tiles.
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ED>::value;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor*, kAlignD,  // no C operand
      ED, cutlass::layout::RowMajor*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ED, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      EA, cutlass::layout::RowMajor*, 16,     // A_g [M, K] K-major
      EB, cutlass::layout::ColumnMajor*, 16,  // B_g [N, K] K-major
      float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using SA = typename Kernel::InternalStrideA;
  using SB = typename Kernel::InternalStrideB;
  using SD = typename Kernel::InternalStrideD;

  // The per-group arrays CUTLASS reads, carved from the scratch in this order.
  struct Arrays {
    Shape3* shapes;
    const EA** a;
    const EB** b;
    ED** d;
    SA* sa;
    SB* sb;
    SD* sd;
    float* alpha;
    void* cutlass_workspace;
  };

  static size_t align256(size_t x) { return (x + 255) / 256 * 256; }

  static size_t table_bytes(int groups) {
    size_t g = static_cast<size_t>(groups);
    return align256(g * sizeof(Shape3)) + 3 * align256(g * sizeof(void*)) + align256(g * sizeof(SA)) +
           align256(g * sizeof(SB)) + align256(g * sizeof(SD)) + align256(g * sizeof(float));
  }

  static Arrays carve(void* base, int groups) {
    auto* at = static_cast<uint8_t*>(base);
    size_t g = static_cast<size_t>(groups);
    auto take = [&](size_t bytes) {
      void* p = at;
      at += align256(bytes);
      return p;
    };
    Arrays r;
    r.shapes = static_cast<Shape3*>(take(g * sizeof(Shape3)));
    r.a = static_cast<const EA**>(take(g * sizeof(void*)));
    r.b = static_cast<const EB**>(take(g * sizeof(void*)));
    r.d = static_cast<ED**>(take(g * sizeof(void*)));
    r.sa = static_cast<SA*>(take(g * sizeof(SA)));
    r.sb = static_cast<SB*>(take(g * sizeof(SB)));
    r.sd = static_cast<SD*>(take(g * sizeof(SD)));
    r.alpha = static_cast<float*>(take(g * sizeof(float)));
    r.cutlass_workspace = at;
    return r;
  }

  // host_shapes: the problems on the host, for CUTLASS's can_implement to check (a host test);
  // null in a launch, where they exist on the device only.
  static typename Gemm::Arguments arguments(const Arrays& r, int groups, int sm_count, int device_id,
                                            const Shape3* host_shapes = nullptr) {
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    // The shapes live on the device only (no host copy): CUTLASS's scheduler reads them there.
    args.problem_shape = {groups, r.shapes, host_shapes};
    args.mainloop.ptr_A = r.a;
    args.mainloop.dA = r.sa;
    args.mainloop.ptr_B = r.b;
    args.mainloop.dB = r.sb;
    args.mainloop.mma_promotion_interval = 4;  // promote to FP32 every 128 of K (4 MMAs of 32)
    auto& fusion = args.epilogue.thread;
    fusion.alpha_ptr = r.alpha;  // alpha of group g: alpha[g]
    fusion.dAlpha = {cute::_0{}, cute::_0{}, 1};
    fusion.beta = 0.0f;
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = nullptr;
    args.epilogue.ptr_D = r.d;
    args.epilogue.dD = r.sd;
    args.hw_info.device_id = device_id;
    args.hw_info.sm_count = sm_count;
    return args;
  }
};

inline int grouped_device() {
  int device_id = 0;
  FP8OPS_CUDA_CHECK(cudaGetDevice(&device_id));
  return device_id;
}

inline void check_status(cutlass::Status st, const char* what) {
  if (st != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("fp8ops grouped_gemm_sm90: CUTLASS ") + what + " (" +
                             cutlassGetStatusString(st) + ")");
}

// One thread per group: its span, its problem and its CUTLASS arrays (grouped_layout.h).
template <class Ty>
__global__ void grouped_setup_kernel(GroupedGemmParams p, GroupedSpans spans, typename Ty::Arrays r) {
  int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= p.groups) return;
  grouped::Span s = grouped::group_span(p.offsets, g, p.m);
  grouped::Problem q;
  if (p.problem == GroupedProblem::kRows) {
    q = grouped::rows_problem(s, g, p.n, p.k);
  } else {
    int64_t at = grouped::packed_start(p.offsets, g, p.m);
    spans.packed_start[g] = at;
    q = grouped::wgrad_problem(s, g, at, p.n, p.k, spans.packed_ld);
  }
  spans.start[g] = s.start;
  spans.rows[g] = s.rows;
  bool rows = p.problem == GroupedProblem::kRows;
  const auto* a = static_cast<const typename Ty::EA*>(rows ? p.a : static_cast<const void*>(spans.packed_a));
  const auto* b = static_cast<const typename Ty::EB*>(rows ? p.b : static_cast<const void*>(spans.packed_b));
  r.shapes[g] = typename Ty::Shape3{q.m, q.n, q.k};
  r.a[g] = a + q.a_offset;
  r.b[g] = b + q.b_offset;
  r.d[g] = static_cast<typename Ty::ED*>(p.d) + q.d_offset;
  r.sa[g] = cute::make_stride(q.lda, cute::Int<1>{}, cute::Int<0>{});
  r.sb[g] = cute::make_stride(q.ldb, cute::Int<1>{}, cute::Int<0>{});
  r.sd[g] = cute::make_stride(q.ldd, cute::Int<1>{}, cute::Int<0>{});
  r.alpha[g] = mul_rn(p.a_scale_inv[g], p.b_scale_inv[g]);
}

template <DType A, DType B, DType D>
size_t GroupedGemmSm90<A, B, D>::arrays_bytes(int groups, int sm_count) {
  using Ty = GroupedGemmSm90Types<A, B, D>;
  typename Ty::Arrays none{};
  size_t cutlass_bytes = Ty::Gemm::get_workspace_size(Ty::arguments(none, groups, sm_count, grouped_device()));
  return Ty::table_bytes(groups) + Ty::align256(cutlass_bytes);
}

template <DType A, DType B, DType D>
void GroupedGemmSm90<A, B, D>::run(const GroupedGemmParams& p, const GroupedSpans& spans, void* arrays,
                                   size_t bytes, int sm_count, cudaStream_t stream,
                                   void (*between)(const GroupedGemmParams&, const GroupedSpans&, cudaStream_t)) {
  using Ty = GroupedGemmSm90Types<A, B, D>;
  typename Ty::Arrays r = Ty::carve(arrays, p.groups);
  launch_kernel(grouped_setup_kernel<Ty>, dim3((p.groups + 127) / 128), dim3(128), stream, p, spans, r);
  between(p, spans, stream);
  const typename Ty::Gemm::Arguments args = Ty::arguments(r, p.groups, sm_count, grouped_device());
  typename Ty::Gemm gemm;
  check_status(gemm.can_implement(args), "cannot run this problem");
  if (Ty::Gemm::get_workspace_size(args) > bytes - Ty::table_bytes(p.groups))
    throw std::invalid_argument("fp8ops grouped_gemm_sm90: the workspace is too small");
  check_status(gemm.initialize(args, r.cutlass_workspace, stream), "initialize failed");
  // CUTLASS checks its launch with cudaGetLastError(), which also returns an earlier,
  // unrelated asynchronous error: name such an error as what it is.
  cudaError_t prior = cudaPeekAtLastError();
  if (prior != cudaSuccess)
    throw std::runtime_error(std::string("fp8ops grouped_gemm_sm90: a CUDA error from earlier work is pending (") +
                             cudaGetErrorString(prior) + "); it was not raised by this GEMM");
  check_status(gemm.run(stream), "run failed");
}

}  // namespace fp8ops::sm90

#endif  // FP8OPS_GEMM_SM90_DEFINE
