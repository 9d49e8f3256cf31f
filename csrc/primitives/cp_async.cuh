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

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace flash
