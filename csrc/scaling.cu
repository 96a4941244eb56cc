// Delayed-scaling update: one block, no host sync, CUDA-graph safe. Bit-exact with
// fp8ops.ops.emulation.delayed_scale_update (roll the history, reduce it by algo, new scale).
#include "common.cuh"

namespace fp8ops {
namespace {

constexpr int kThreads = kMaxHistory;  // one history slot per thread

__global__ void __launch_bounds__(kThreads) delayed_scale_kernel(DelayedScaleParams p) {
  __shared__ uint32_t keys[kThreads];
  __shared__ float red[kThreads / 32];
  const int t = threadIdx.x, L = p.history_len;
  const int64_t step = *p.step + (p.step_inout != nullptr);
  const UpdateStep us = update_step(step, p.interval);  // Python floor division / modulo
  const int64_t n_updates = us.n_updates;
  const bool update = us.update;

  // rolled history: slot 0 = pending amax, slot k = old slot k - 1
  const float h = t < L ? (t == 0 ? *p.pending_amax : p.amax_history[t - 1]) : 0.0f;
  const float kept = t < L ? p.amax_history[t] : 0.0f;
  const float h0 = *p.pending_amax, rep_prev = *p.amax_rep, prev_scale = *p.scale;
  __syncthreads();  // every input read before any output is written: the outputs may alias them
  if (t < L) p.out_history[t] = update ? h : kept;

  float rep = 0.0f;
  switch (p.algo) {
    case AmaxAlgo::kMostRecent: rep = h0; break;
    case AmaxAlgo::kEma:
      rep = ema_amax(p.ema_a, p.ema_b, h0, rep_prev, n_updates);
      break;
    case AmaxAlgo::kMax: {
      float m = t < L ? h : -INFINITY;
      for (int o = 16; o > 0; o >>= 1) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (t % 32 == 0) red[t / 32] = m;
      __syncthreads();
      m = red[0];
      for (int w = 1; w < kThreads / 32; ++w) m = nan_max(m, red[w]);
      rep = m;
      break;
    }
    case AmaxAlgo::kPercentile: {
      // bitonic sort of the L slots (padding sorts last), then nearest rank over the top n
      keys[t] = t < L ? sort_key(h) : 0xffffffffu;
      __syncthreads();
      for (int size = 2; size <= kThreads; size <<= 1) {
        for (int stride = size / 2; stride > 0; stride >>= 1) {
          const int u = t ^ stride;
          if (u > t) {
            const uint32_t a = keys[t], b = keys[u];
            if ((a > b) == ((t & size) == 0)) keys[t] = b, keys[u] = a;
          }
          __syncthreads();
        }
      }
      rep = from_sort_key(keys[percentile_index(n_updates, L, p.percentile_q)]);
      break;
    }
  }
  if (t != 0) return;
  const float s = update ? scale_from_amax(rep, prev_scale, p.fp8_max, p.margin, p.power_of_two) : prev_scale;
  *p.out_scale = s;
  *p.out_scale_inv = rcp_rn(s);
  *p.out_amax_rep = update ? rep : rep_prev;
  *p.out_pending = update ? 0.0f : h0;
  if (p.step_inout != nullptr) *p.step_inout = step;
}

__global__ void cast_scale_kernel(CastScaleParams p) {
  const float s = p.amax != nullptr ? scale_from_amax(*p.amax, 1.0f, p.fp8_max, p.margin, p.power_of_two) : *p.scale;
  *p.out_scale = s;
  *p.out_scale_inv = rcp_rn(s);
}

__global__ void record_amax_kernel(RecordAmaxParams p) {
  const float a = *p.amax;
  if (isfinite(a)) {
    *p.pending_amax = fmaxf(*p.pending_amax, a);
  } else {
    *p.nonfinite_count += 1;
  }
}

}  // namespace

void launch_delayed_scale_update(const DelayedScaleParams& p, cudaStream_t stream) {
  if (p.history_len < 1 || p.history_len > kMaxHistory)
    throw std::invalid_argument("fp8ops: delayed_scale_update: history length must be in [1, 1024]");
  if (p.interval == 0) throw std::invalid_argument("fp8ops: delayed_scale_update: interval must be nonzero");
  launch_kernel(delayed_scale_kernel, 1, kThreads, stream, p);
}

void launch_cast_scale(const CastScaleParams& p, cudaStream_t stream) {
  launch_kernel(cast_scale_kernel, 1, 1, stream, p);
}

void launch_record_amax(const RecordAmaxParams& p, cudaStream_t stream) {
  launch_kernel(record_amax_kernel, 1, 1, stream, p);
}

}  // namespace fp8ops
