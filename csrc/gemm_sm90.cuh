// CUTLASS 3.x Hopper (sm_90a) FP8 GEMM templates: TMA + WGMMA, warp-specialized, persistent.
// D[M,N] = alpha * (A[M,K] @ B[N,K]^T) + bias[N], A and B K-major (TN), FP32 accumulation.
// Per-tensor: alpha = (*a_scale_inv) * (*b_scale_inv) read on the device in the epilogue.
// Blockwise: per 128-long K block, acc += partial * (sfa[m,kb] * sfb[n or n/128, kb]) (promotion:
// the two scales multiplied first, as the emulation does).
//
// One template per kernel family, instantiated explicitly in gemm_sm90_<...>.cu (split so the
// heavy instantiations build in parallel); gemm_sm90.cu dispatches to them and sees only the
// declarations (it is built without FP8OPS_GEMM_SM90_DEFINE), so it never instantiates a kernel.
#pragma once
#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "fp8ops.h"

namespace fp8ops::sm90 {

// Tile / cluster / schedule choices (the launcher's heuristic picks one per shape).
enum class TileConfig : int {
  kCooperative128x128,      // promoted accumulation, 2 consumer warpgroups on 128x128x128, cluster 2x1
  kPingpong64x128,          // promoted mainloop, 64x128x128 tiles alternating: small M / few tiles
  kFastPingpong128x128,     // fast accumulation, 128x128x128 tiles alternating, cluster 2x1
  kFastCooperative128x256,  // fast accumulation, 2 warpgroups on 128x256x128, cluster 2x1
};

template <DType A, DType B, DType D, TileConfig C>
struct GemmSm90 {
  static size_t workspace_size(const GemmParams& p, int sm_count);
  static void run(const GemmParams& p, int sm_count, cudaStream_t stream);
};

// kScaleGranN: 128 for 128x128 weight scales [Nb, Kb], 1 for per-row B scales [N, Kb].
template <DType A, DType B, DType D, int kScaleGranN>
struct GemmBlockwiseSm90 {
  static size_t workspace_size(const GemmBlockwiseParams& p, int sm_count);
  static void run(const GemmBlockwiseParams& p, int sm_count, cudaStream_t stream);
};

}  // namespace fp8ops::sm90

// The definitions: only the instantiation files define FP8OPS_GEMM_SM90_DEFINE before including
// this header, so the launcher does not parse CUTLASS at all (it builds in seconds).
#ifdef FP8OPS_GEMM_SM90_DEFINE

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

namespace fp8ops::sm90 {

template <DType T> struct CutlassType;
template <> struct CutlassType<DType::kE4M3> { using type = cutlass::float_e4m3_t; };
template <> struct CutlassType<DType::kE5M2> { using type = cutlass::float_e5m2_t; };
template <> struct CutlassType<DType::kBFloat16> { using type = cutlass::bfloat16_t; };
template <> struct CutlassType<DType::kFloat16> { using type = cutlass::half_t; };
template <> struct CutlassType<DType::kFloat32> { using type = float; };

template <TileConfig C> struct TileTraits;
// Cluster (2,1,1): the two CTAs of a cluster sit at neighbouring M tiles of the same N tile, so
// CUTLASS multicasts the shared B tile to both (each loads its own A tile).
template <> struct TileTraits<TileConfig::kCooperative128x128> {
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
  // Promoted FP8 mainloop: the promotion interval is a runtime argument (every 128 of K).
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
template <> struct TileTraits<TileConfig::kPingpong64x128> {
  using Tile = cute::Shape<cute::_64, cute::_128, cute::_128>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};
// Fast accumulation: the tensor cores accumulate over all of K with no promotion copies, which
// halves the accumulator registers and lets a warpgroup own a whole 128-wide tile.
template <> struct TileTraits<TileConfig::kFastPingpong128x128> {
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};
template <> struct TileTraits<TileConfig::kFastCooperative128x256> {
  using Tile = cute::Shape<cute::_128, cute::_256, cute::_128>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};

// Fast-accumulation mainloops take no promotion interval; the promoted ones take it last.
template <TileConfig C>
constexpr bool kFastAccumTile = C == TileConfig::kFastPingpong128x128 || C == TileConfig::kFastCooperative128x256;

// Epilogue visitor tree: D = convert((acc * (s0 * s1)) + bias[n]). s0/s1 are read through device
// pointers (no host sync); a null bias pointer reads as 0. Products in float32 like the emulation.
template <class ElementD, class Tile>
using EpilogueEVT = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, ElementD, float,
                                           cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90EVT<
        cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float,
                                               cutlass::FloatRoundStyle::round_to_nearest>,
        cutlass::epilogue::fusion::Sm90AccFetch,
        cutlass::epilogue::fusion::Sm90ScalarBroadcast<float, cute::Stride<cute::_0, cute::_0, cute::_0>, 2>>,
    // Element-wise guarded scalar loads: any N, any 4-byte-aligned bias pointer.
    cutlass::epilogue::fusion::Sm90RowBroadcast<0, Tile, float, float>>;

template <class EVT>
typename EVT::Arguments epilogue_args(const float* s0, const float* s1, const float* bias) {
  // Children first, then the node's own (empty) arguments.
  return {{{}, {{1.0f, 1.0f}, {s0, s1}, {}}, {}}, {bias, 0.0f, {}}, {}};
}

template <class Args>
std::array<int, 3> m_n_k(const Args& args) {
  return {cute::get<0>(args.problem_shape), cute::get<1>(args.problem_shape), cute::get<2>(args.problem_shape)};
}

template <class Gemm>
void run_cutlass(Gemm& gemm, const typename Gemm::Arguments& args, void* workspace,
                 size_t workspace_bytes, cudaStream_t stream, const char* what) {
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess)
    throw std::invalid_argument(std::string("fp8ops ") + what + ": CUTLASS cannot run this problem (" +
                                cutlassGetStatusString(st) + "): m, n, k = " + std::to_string(m_n_k(args)[0]) +
                                ", " + std::to_string(m_n_k(args)[1]) + ", " + std::to_string(m_n_k(args)[2]) +
                                " (TMA needs k and n * sizeof(out) multiples of 16 bytes; the binding pads them)");
  size_t need = Gemm::get_workspace_size(args);
  if (need > workspace_bytes)
    throw std::invalid_argument(std::string("fp8ops ") + what + ": workspace of " +
                                std::to_string(workspace_bytes) + " bytes, needs " + std::to_string(need));
  st = gemm.initialize(args, workspace, stream);
  if (st != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("fp8ops ") + what + ": CUTLASS initialize failed (" +
                             cutlassGetStatusString(st) + ")");
  // CUTLASS checks its launch with cudaGetLastError(), which also returns an earlier, unrelated
  // asynchronous error: name such an error as what it is rather than as a failure of this GEMM.
  cudaError_t prior = cudaPeekAtLastError();
  if (prior != cudaSuccess)
    throw std::runtime_error(std::string("fp8ops ") + what + ": a CUDA error from earlier work is pending (" +
                             cudaGetErrorString(prior) + "); it was not raised by this GEMM");
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("fp8ops ") + what + ": CUTLASS run failed (" +
                             cutlassGetStatusString(st) + ": " + cudaGetErrorString(cudaGetLastError()) + ")");
}

inline cutlass::KernelHardwareInfo hw_info(int sm_count, int device_id) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device_id;
  hw.sm_count = sm_count;  // cached by the launcher; CUTLASS would otherwise query it per call
  return hw;
}

inline int current_device() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) throw std::runtime_error("fp8ops: cudaGetDevice failed");
  return dev;
}

// ---- per-tensor scaled ---------------------------------------------------------------------
template <DType A, DType B, DType D, TileConfig C>
struct GemmSm90Types {
  using EA = typename CutlassType<A>::type;
  using EB = typename CutlassType<B>::type;
  using ED = typename CutlassType<D>::type;
  using T = TileTraits<C>;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ED>::value;
  using EVT = EpilogueEVT<ED, typename T::Tile>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename T::Tile, typename T::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, kAlignD,  // no C operand: bias comes through the EVT
      ED, cutlass::layout::RowMajor, kAlignD, typename T::Epilogue, EVT>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      EA, cutlass::layout::RowMajor, 16,     // A [M,K] K-major
      EB, cutlass::layout::ColumnMajor, 16,  // B [N,K] K-major (CUTLASS's B is KxN)
      float, typename T::Tile, typename T::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename T::Mainloop>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(const GemmParams& p, int sm_count, int device_id) {
    using SA = typename Kernel::StrideA;
    using SB = typename Kernel::StrideB;
    using SD = typename Kernel::StrideD;
    SA sa = cute::make_stride(p.lda, cute::Int<1>{}, p.m * p.lda);
    SB sb = cute::make_stride(p.ldb, cute::Int<1>{}, p.n * p.ldb);
    SD sd = cute::make_stride(p.ldd, cute::Int<1>{}, p.m * p.ldd);
    // Promotion interval counts 32-deep MMAs: 4 = every 128 of K (promoted accumulation);
    // fast_accum: never promote before the end, i.e. plain tensor-core accumulation.
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), 1},
                                  {static_cast<const EA*>(p.a), sa, static_cast<const EB*>(p.b), sb},
                                  {epilogue_args<EVT>(p.a_scale_inv, p.b_scale_inv, p.bias), nullptr, sd,
                                   static_cast<ED*>(p.d), sd},
                                  hw_info(sm_count, device_id)};
    if constexpr (!kFastAccumTile<C>) args.mainloop.mma_promotion_interval = p.fast_accum ? (1u << 30) : 4u;
    args.scheduler.max_swizzle_size = p.swizzle;
    return args;
  }
};

template <DType A, DType B, DType D, TileConfig C>
size_t GemmSm90<A, B, D, C>::workspace_size(const GemmParams& p, int sm_count) {
  using Ty = GemmSm90Types<A, B, D, C>;
  return Ty::Gemm::get_workspace_size(Ty::arguments(p, sm_count, current_device()));
}

template <DType A, DType B, DType D, TileConfig C>
void GemmSm90<A, B, D, C>::run(const GemmParams& p, int sm_count, cudaStream_t stream) {
  using Ty = GemmSm90Types<A, B, D, C>;
  typename Ty::Gemm gemm;
  run_cutlass(gemm, Ty::arguments(p, sm_count, current_device()), p.workspace, p.workspace_bytes, stream, "gemm_sm90");
}

// ---- blockwise scaled (software promotion with per-block scales, as in CUTLASS example 67) ----
template <DType A, DType B, DType D, int kScaleGranN>
struct GemmBlockwiseSm90Types {
  using EA = typename CutlassType<A>::type;
  using EB = typename CutlassType<B>::type;
  using ED = typename CutlassType<D>::type;
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using Cluster = cute::Shape<cute::_1, cute::_2, cute::_1>;
  // 1x128 activation scales, 1x128 or 128x128 weight scales; CUTLASS's sm90 path takes the scale
  // tensors M-/N-major ([Kb][M], [Kb][N or Nb]); the binding transposes ours ([M,Kb], [N|Nb, Kb]).
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleGranN, 128>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ED>::value;
  using EVT = EpilogueEVT<ED, Tile>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, kAlignD,
      ED, cutlass::layout::RowMajor, kAlignD, cutlass::epilogue::TmaWarpSpecializedCooperative,
      EVT>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      EA, cute::tuple<cutlass::layout::RowMajor, LayoutSFA>, 16,
      EB, cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, 16,
      float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(const GemmBlockwiseParams& p, int sm_count, int device_id) {
    using SA = typename Kernel::StrideA;
    using SB = typename Kernel::StrideB;
    using SD = typename Kernel::StrideD;
    SA sa = cute::make_stride(p.lda, cute::Int<1>{}, p.m * p.lda);
    SB sb = cute::make_stride(p.ldb, cute::Int<1>{}, p.n * p.ldb);
    SD sd = cute::make_stride(p.ldd, cute::Int<1>{}, p.m * p.ldd);
    auto shape = cute::make_shape(static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), 1);
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  shape,
                                  {static_cast<const EA*>(p.a), sa, static_cast<const EB*>(p.b), sb,
                                   p.a_scales, ScaleConfig::tile_atom_to_shape_SFA(shape),
                                   p.b_scales, ScaleConfig::tile_atom_to_shape_SFB(shape)},
                                  {epilogue_args<EVT>(nullptr, nullptr, p.bias), nullptr, sd,
                                   static_cast<ED*>(p.d), sd},
                                  hw_info(sm_count, device_id)};
    args.scheduler.max_swizzle_size = p.swizzle;
    return args;
  }
};

// The order of the promotion's float32 operations. CUTLASS's sm90 blockwise mainloop
// (gemm/collective/sm90_mma_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp, promoting
// through GmmaFP8Accumulation in gemm/collective/fp8_accumulation.hpp) with 128x128 weight
// scales (one B scale per tile along N) first multiplies each row's A scale by the tile's B
// scale and then promotes with scale_core(scale): accum += partial * scale, which nvcc fuses
// into one FFMA. With per-row B scales (scales along both M and N) it would call
// scale_core(scaleA, scaleB): accum += partial * scaleA * scaleB, whose first product
// overflows float32 where the result does not (activations near 1e37 times small weights). The
// specialization below makes that path combine the two scales first as well, so both paths and
// the emulation (emulation.gemm_blockwise) compute acc += partial * (sa * sb).
//
// The accumulator type GmmaFP8Accumulation wraps: the kernel allocates it as
// partition_fragment_C(TiledMma, tile (M, N)) and hands it to the mainloop.
template <class Types>
using BlockwiseAccum = decltype(cute::partition_fragment_C(
    typename Types::Mainloop::TiledMma{}, cute::take<0, 2>(typename Types::Tile{})));
// Every blockwise instantiation has this accumulator type (a static_assert in run() checks it),
// so the one specialization covers them all.
using PromotedAccum = BlockwiseAccum<GemmBlockwiseSm90Types<DType::kE4M3, DType::kE4M3, DType::kBFloat16, 1>>;

}  // namespace fp8ops::sm90

// Device code only: the host pass never runs it, and GCC 12 rejects the member's class as
// cudafe++ spells it for the host compiler (a variable template in a template argument).
#ifdef __CUDA_ARCH__
namespace cutlass::gemm::collective {
template <>
template <class EngineScaleA, class LayoutScaleA, class EngineScaleB, class LayoutScaleB>
CUTLASS_DEVICE void
GmmaFP8Accumulation<fp8ops::sm90::PromotedAccum::engine_type, fp8ops::sm90::PromotedAccum::layout_type>::scale_core(
    const cute::Tensor<EngineScaleA, LayoutScaleA>& scaleA, const cute::Tensor<EngineScaleB, LayoutScaleB>& scaleB) {
  using LayoutAcc = typename TensorAccum::layout_type;
  static_assert(LayoutAcc{}.shape() == LayoutScaleA{}.shape(), "accumulator and scaleA differ in shape");
  static_assert(LayoutAcc{}.shape() == LayoutScaleB{}.shape(), "accumulator and scaleB differ in shape");
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < cute::size(accum_); ++i) {
    ElementAccumulator scale = scaleA(i) * scaleB(i);  // one float32 product, then the promotion
    accum_(i) += accum_temp_(i) * scale;
  }
}
}  // namespace cutlass::gemm::collective
#endif  // __CUDA_ARCH__

namespace fp8ops::sm90 {

template <DType A, DType B, DType D, int G>
size_t GemmBlockwiseSm90<A, B, D, G>::workspace_size(const GemmBlockwiseParams& p, int sm_count) {
  using Ty = GemmBlockwiseSm90Types<A, B, D, G>;
  return Ty::Gemm::get_workspace_size(Ty::arguments(p, sm_count, current_device()));
}

template <DType A, DType B, DType D, int G>
void GemmBlockwiseSm90<A, B, D, G>::run(const GemmBlockwiseParams& p, int sm_count, cudaStream_t stream) {
  using Ty = GemmBlockwiseSm90Types<A, B, D, G>;
  static_assert(std::is_same_v<BlockwiseAccum<Ty>, PromotedAccum>,
                "this blockwise GEMM's accumulator type has no scale-combining promotion (see PromotedAccum)");
  typename Ty::Gemm gemm;
  run_cutlass(gemm, Ty::arguments(p, sm_count, current_device()), p.workspace, p.workspace_bytes, stream, "gemm_blockwise_sm90");
}

}  // namespace fp8ops::sm90

#endif  // FP8OPS_GEMM_SM90_DEFINE
