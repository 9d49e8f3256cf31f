// Shared-memory barriers and register reallocation of the Hopper (sm_90) path, through inline PTX:
//   mbarrier  (PTX ISA 9.7.13.15): a 64-bit object in shared memory counting arrivals and, for the
//             TMA, transaction bytes; a phase completes when both reach zero, and waiters test the
//             parity of a completed phase (try_wait.parity), so a ring of stages needs one bit of
//             state per stage: the phase parity flips every time the ring wraps.
//   named barriers (bar.sync / bar.arrive with an id and a thread count): synchronize a subset of
//             the CTA's warps (one warpgroup, or the consumer warpgroups), never the whole CTA once
//             the producer warps have left.
//   setmaxnreg (sm_90a only): moves registers between warpgroups of a warp-specialized kernel
//             (the producer gives its registers to the consumers; __launch_bounds__(n, 1)).
//   griddepcontrol (sm_90+; no-ops below): programmatic dependent launch between two kernels of
//             a stream (the split-KV forward and its combine).
//
// Phase convention of a producer/consumer ring (FlashAttention-3, CUTLASS PipelineTmaAsync):
// iteration i uses stage i % S in round r = i / S. The consumer waits full[stage] with parity r & 1;
// the producer waits empty[stage] with parity (r & 1) ^ 1, which a freshly initialized barrier
// (in phase 0) satisfies at once: round 0 needs no release.
#pragma once

#include <cstdint>

namespace flash {

// ---- mbarrier ----

// Initializes the barrier at shared address `bar` to expect `count` arrivals per phase. One
// thread initializes; mbarrier_init_fence() and a CTA barrier follow before any use.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes initialized barriers visible to the other threads and to the async proxy (TMA).
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival (of the `count` the barrier expects).
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile(
      "{\n.reg .b64 state;\nmbarrier.arrive.release.cta.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar)
      : "memory");
}

// One arrival that also announces `bytes` of transactions (TMA copies completing on this barrier):
// the phase completes when the arrivals and those bytes have all landed.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile(
      "{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.release.cta.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar),
      "r"(bytes)
      : "memory");
}

// Clock cycles after which a blocked mbarrier_wait traps ("unspecified launch failure" at the
// next synchronization) instead of hanging the GPU: a wrong phase parity or a lost arrival shows up
// as an error in seconds. 2^34 cycles is ~8.6 s at 2 GHz, far above any legitimate wait (a tile's
// load, or one tile of a consumer's work, also under compute-sanitizer). 0: no check.
#ifndef FLASH_ATTN_EXT_MBARRIER_TIMEOUT_CYCLES
#define FLASH_ATTN_EXT_MBARRIER_TIMEOUT_CYCLES (1ull << 34)
#endif

// Blocks until the phase of parity `parity` of the barrier has completed. The spin loop is PTX
// (a C++ loop around a try_wait that returns a bool cost the forward kernel registers, and spills); the clock
// is read only once the first try failed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  if constexpr (FLASH_ATTN_EXT_MBARRIER_TIMEOUT_CYCLES > 0) {
    asm volatile(
        "{\n"
        ".reg .pred done, late;\n"
        ".reg .u64 t0, t1;\n"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
        "@done bra DONE_%=;\n"
        "mov.u64 t0, %%clock64;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
        "@done bra DONE_%=;\n"
        "mov.u64 t1, %%clock64;\n"
        "sub.u64 t1, t1, t0;\n"
        "setp.gt.u64 late, t1, %2;\n"
        "@late trap;\n"
        "bra WAIT_%=;\n"
        "DONE_%=:\n"
        "}\n" ::"r"(bar),
        "r"(parity), "l"((unsigned long long)(FLASH_ATTN_EXT_MBARRIER_TIMEOUT_CYCLES))
        : "memory");
  } else {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
  }
}

// Position in a ring of kStages full/empty barrier pairs that keeps running across tiles (a
// persistent kernel): the i-th use from here is stage (base + i) % kStages in phase
// ((base + i) / kStages) & 1. base is kept modulo 2 kStages (the period of (stage, phase)), so it
// never wraps, and one register serves a whole tile's walk (i = its step). Consumers wait
// full[stage] with phase, the producer waits empty[stage] with phase ^ 1 (the convention above).
template <int kStages>
struct PipelineState {
  uint32_t base = 0;
  __device__ __forceinline__ int stage(int i = 0) const { return int((base + uint32_t(i)) % kStages); }
  __device__ __forceinline__ uint32_t phase(int i = 0) const { return ((base + uint32_t(i)) / kStages) & 1; }
  __device__ __forceinline__ void advance(int n = 1) { base = (base + uint32_t(n)) % (2 * kStages); }
};

// ---- programmatic dependent launch (sm_90+; no-ops below, and when the kernel was not launched
// as a dependent: kernels/launch_utils.h, launch_1d_dependent) ----

// Blocks until the grids this one depends on have completed and their memory writes are visible.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the dependent grid launch once every CTA of this grid has run this or exited (it still
// waits for this grid's completion in grid_dependency_wait before reading its results).
__device__ __forceinline__ void grid_dependency_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---- named barriers (ids 1..15; 0 is __syncthreads). `threads` is a multiple of 32. ----

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- register reallocation (sm_90a), executed by every thread of a warpgroup ----

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: 24..256, multiple of 8");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: 24..256, multiple of 8");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

}  // namespace flash
