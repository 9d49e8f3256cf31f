// Global -> shared asynchronous copies (sm_80+): cp.async, 16 bytes per thread.
// Used to stream K/V (and Q) tiles into a multi-stage shared-memory pipeline:
//   issue copies for stage s+1, cp_async_commit(), compute on stage s,
//   cp_async_wait<N>() + __syncthreads() before reading the next stage.
#pragma once

#include <cstdint>

namespace flash {

// Copy 16 bytes global -> shared; if !pred, write 16 zero bytes instead (src-size 0),
// which is how ragged tile edges and padded head-dim columns are zero-filled.
// gmem_ptr must be valid memory even when !pred (pass the tensor's base pointer).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem_ptr, bool pred) {
  const int src_size = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem_ptr),
               "r"(src_size));
}

// cp_async_16 with an L2 eviction priority: `policy` from l2_policy_stream (createpolicy, sm_80+).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem_ptr, bool pred, uint64_t policy) {
  const int src_size = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_addr),
               "l"(gmem_ptr), "r"(src_size), "l"(policy));
}

// The L2 policy of a stream of reads: evict first (data read once: its lines are the first the L2
// replaces, before other data and before dirty lines that would cost a write-back) or evict normal
// (the default priority, for data other CTAs read again soon). `mostly_unchanged`: only a quarter
// of the evict-first stream's lines get that priority, the others keep the priority they would
// have (evict_unchanged): for streams much larger than the L2 (H200 decode, K+V reads of 0.5-8.6
// GB: 1-5 % faster than all evict-first; of 34 MB: 5 % slower; docs/PERF_NOTES.md).
__device__ __forceinline__ uint64_t l2_policy_stream(bool evict_first, bool mostly_unchanged = false) {
  uint64_t first, quarter_first, normal;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(first));
  asm volatile("createpolicy.fractional.L2::evict_first.L2::evict_unchanged.b64 %0, 0.25;\n" : "=l"(quarter_first));
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(normal));
  return evict_first ? (mostly_unchanged ? quarter_first : first) : normal;
}

// Bulk copy (sm_90+: cp.async.bulk, done by the TMA unit, no tensor map) of `bytes` bytes (a
// multiple of 16; both addresses 16-byte aligned) global -> shared, completing `bytes` of
// transactions on the mbarrier at shared address `bar` (primitives/barrier.cuh). Traps below sm_90.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t smem_addr, const void* gmem_ptr, uint32_t bytes, uint32_t bar,
                                              uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;\n" ::"r"(smem_addr),
      "l"(gmem_ptr), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Orders this thread's earlier generic-proxy shared-memory writes (st.shared, cp.async) before
// later async-proxy reads (wgmma operands, sm_90); follow it with a barrier.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Head of step `step` of a two-buffer cp.async pipeline of n_steps steps: starts the copies of
// step + 1 (load(step + 1, buffer)) into the buffer step - 1 used, freed by the barrier that
// ended step - 1, then waits until step's copies have landed for the whole CTA. One commit group
// per step, possibly empty, so wait_group 1 always means "all but the prefetch".
// kAsyncProxy: the tiles are read by wgmma (the async proxy) next.
template <bool kAsyncProxy = false, typename Load>
__device__ __forceinline__ void pipeline_step(int step, int n_steps, Load&& load) {
  if (step + 1 < n_steps) load(step + 1, (step + 1) % 2);
  cp_async_commit();
  cp_async_wait<1>();
  if constexpr (kAsyncProxy) fence_proxy_async();
  __syncthreads();
}

}  // namespace flash
