// Hopper warpgroup matrix multiply-accumulate through inline PTX (sm_90a only):
//   wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16}
// issued by a warpgroup (4 consecutive warps, the first one's index divisible by 4).
// PTX ISA 9.7.15 "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions".
//
// Usage: wgmma_fence(); Wgmma<Element, N>::ss/rs(...) for each k16 step; wgmma_commit();
// ... independent work ...; wgmma_wait<n>() before the accumulators (or register A operands)
// are read or written by ordinary code. Shared memory written by ordinary stores or cp.async
// that a wgmma reads next needs fence_proxy_async() (cp_async.cuh) in each writing thread before
// the barrier.
//
// Register layouts (PTX ISA 9.7.15.5.1.1), thread = 32*w + 4*g + t of the warpgroup:
//   accumulator D (64 x N, fp32, N/2 registers): d[4j + 0..1] = D[16w + g    ][8j + 2t .. +1]
//                                                d[4j + 2..3] = D[16w + g + 8][8j + 2t .. +1]
//     i.e. for every n8 block j exactly the mma.sync m16n8 C fragment of warp w's 16 rows;
//   A in registers (64 x 16): warp w's 16 rows in the mma.sync m16n8k16 A-fragment order.
// So an fp32 accumulator tile converts to the A operand of the next product with the same
// acc_to_a_frag as the sm80 path, and kernels view d[N/2] as acc[N/8][4].
//
// Shared-memory operands are described by a 64-bit matrix descriptor (PTX ISA 9.7.15.5.1.2.2):
// bits 0-13 start address >> 4, 16-29 leading-dimension byte offset (LBO) >> 4, 32-45
// stride-dimension byte offset (SBO) >> 4, 62-63 swizzle mode (1 = 128-byte swizzle). This
// project uses only the 128-byte swizzle on 16-bit tiles, stored as column blocks of 64
// elements: block b holds columns [64b, 64b+64) of every row, rows 128 B apart, and the 16-byte
// chunk c of row r sits at chunk position c ^ (r % 8) (csrc/kernels/sm90/smem_layout.cuh).
//   K-major operand (rows = M or N, columns = K): SBO = 1024 (next 8 rows), LBO unused; the
//     k16 step kk starts at block kk/4, byte 32*(kk%4) of the row.
//   MN-major B operand (rows = K, columns = N): LBO = bytes between column blocks (next 64 N
//     elements), SBO = 1024 (next 8 K rows); the k16 step starts 16 rows further (2048 B).
// Every column block starts on a 1024-byte boundary, so the descriptor's base offset is 0.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "primitives/cp_async.cuh"

namespace flash {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most N committed wgmma groups of this warpgroup are still pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across an in-flight wgmma.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for register A operands (P fragments): live, unchanged, up to this point.
template <int M, int N>
__device__ __forceinline__ void wgmma_fence_operands(uint32_t (&a)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

// Warpgroup index of thread `tid`, read from lane 0 so the compiler knows it is warp-uniform: the
// wgmma descriptors derived from it then live in uniform registers, not in vector registers moved
// by R2UR before every HGMMA (sm90 dK/dV d128: 92 -> 34 R2UR; dK/dV +1-5 %, dQ +0-3 % measured).
__device__ __forceinline__ int warpgroup_index(int tid) { return __shfl_sync(0xffffffffu, tid / 128, 0); }

// 128-byte-swizzle descriptor of the operand starting at shared address `smem_addr`.
__device__ __forceinline__ uint64_t make_wgmma_desc(uint32_t smem_addr, uint32_t lbo_bytes,
                                                    uint32_t sbo_bytes) {
  uint64_t desc = 0;
  desc |= uint64_t((smem_addr & 0x3FFFF) >> 4);
  desc |= uint64_t((lbo_bytes & 0x3FFFF) >> 4) << 16;
  desc |= uint64_t((sbo_bytes & 0x3FFFF) >> 4) << 32;
  desc |= uint64_t(1) << 62;  // 128-byte swizzle
  return desc;
}

// Wgmma<Element, N>: m64nNk16 with fp32 accumulators (N / 2 registers per thread), Element =
// __half / __nv_bfloat16, N = the widths of csrc/primitives/gen_wgmma.py (64, 80, 96, 112, 128, 144,
// 176, 192, 256), whose specializations it writes into csrc/generated/wgmma_ops.cuh at build time:
//   ss<kTransB>: A from shared memory (K-major), B from shared memory
//   rs<kTransB>: A from registers (wgmma A-fragment layout), B from shared memory
//   kTransB = 0: B is K-major (stored [n][k]); 1: B is N-major (stored [k][n]).
//   accumulate = 0 overwrites D (D = A*B), 1 adds (D += A*B).
template <typename Element, int N>
struct Wgmma;

}  // namespace flash

#include "generated/wgmma_ops.cuh"

namespace flash {

// One group of register-A products: D (+)= sum over kk < kSteps of A_kk B_kk, A_kk = a[kk] (wgmma
// A fragments), B_kk at descriptor desc_b(kk); fenced before, committed after (wgmma_wait<n> waits).
template <typename Element, int N, int kTransB, int kSteps, typename DescB>
__device__ __forceinline__ void wgmma_rs_group(float (&d)[N / 2], const uint32_t (&a)[kSteps][4], DescB desc_b) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) Wgmma<Element, N>::template rs<kTransB>(d, a[kk], desc_b(kk), 1);
  wgmma_commit();
}

}  // namespace flash
