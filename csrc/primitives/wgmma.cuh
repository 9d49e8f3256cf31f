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

// Wgmma<Element, N>: m64nNk16 with fp32 accumulators (N / 2 registers per thread), for N = 64
// and 128 and Element = __half / __nv_bfloat16:
//   ss<kTransB>: A from shared memory (K-major), B from shared memory
//   rs<kTransB>: A from registers (wgmma A-fragment layout), B from shared memory
//   kTransB = 0: B is K-major (stored [n][k]); 1: B is N-major (stored [k][n]).
//   accumulate = 0 overwrites D (D = A*B), 1 adds (D += A*B).
// The four specializations come from one macro; only the PTX type and the operand numbering
// (which follows the N / 2 accumulator registers) differ.
template <typename Element, int N>
struct Wgmma;

// Accumulator operand lists of the inline asm: "{%0, ..., %(N/2 - 1)}" and their "+f" bindings.
#define FLASH_WGMMA_D_REGS_64 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FLASH_WGMMA_D_OUTS_64 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FLASH_WGMMA_D_REGS_128 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, " \
    "%39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, " \
    "%58, %59, %60, %61, %62, %63}"
#define FLASH_WGMMA_D_OUTS_128 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
// Operands after the accumulators: ss (desc_a, desc_b, accumulate, kTransB) and rs (a[0..3],
// desc_b, accumulate, kTransB), numbered from N / 2.
#define FLASH_WGMMA_SS_TAIL_64 "%32, %33, p, 1, 1, 0, %35", "%34"
#define FLASH_WGMMA_RS_TAIL_64 "{%32, %33, %34, %35}, %36, p, 1, 1, %38", "%37"
#define FLASH_WGMMA_SS_TAIL_128 "%64, %65, p, 1, 1, 0, %67", "%66"
#define FLASH_WGMMA_RS_TAIL_128 "{%64, %65, %66, %67}, %68, p, 1, 1, %70", "%69"
#define FLASH_WGMMA_ASM(N, TYPE, TAIL, PRED)                                                          \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                                 \
  "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " FLASH_WGMMA_D_REGS_##N ", " TAIL \
  ";\n}\n"
#define FLASH_WGMMA_ASM_(ARGS) FLASH_WGMMA_ASM ARGS
#define FLASH_WGMMA_SPECIALIZATION(ELEMENT, TYPE, N)                                                   \
  template <>                                                                                          \
  struct Wgmma<ELEMENT, N> {                                                                           \
    /* D(64xN) (+)= A(64x16, smem, K-major) * B(16xN, smem) */                                         \
    template <int kTransB>                                                                             \
    static __device__ __forceinline__ void ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,     \
                                              int accumulate) {                                        \
      asm volatile(FLASH_WGMMA_ASM_((N, TYPE, FLASH_WGMMA_SS_TAIL_##N))                                \
                   : FLASH_WGMMA_D_OUTS_##N                                                            \
                   : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB));                         \
    }                                                                                                  \
    /* D(64xN) (+)= A(64x16, registers) * B(16xN, smem) */                                             \
    template <int kTransB>                                                                             \
    static __device__ __forceinline__ void rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, \
                                              int accumulate) {                                        \
      asm volatile(FLASH_WGMMA_ASM_((N, TYPE, FLASH_WGMMA_RS_TAIL_##N))                                \
                   : FLASH_WGMMA_D_OUTS_##N                                                            \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate),          \
                     "n"(kTransB));                                                                    \
    }                                                                                                  \
  };

FLASH_WGMMA_SPECIALIZATION(__half, "f16", 64)
FLASH_WGMMA_SPECIALIZATION(__nv_bfloat16, "bf16", 64)
FLASH_WGMMA_SPECIALIZATION(__half, "f16", 128)
FLASH_WGMMA_SPECIALIZATION(__nv_bfloat16, "bf16", 128)

#undef FLASH_WGMMA_SPECIALIZATION
#undef FLASH_WGMMA_ASM_
#undef FLASH_WGMMA_ASM
#undef FLASH_WGMMA_RS_TAIL_128
#undef FLASH_WGMMA_SS_TAIL_128
#undef FLASH_WGMMA_RS_TAIL_64
#undef FLASH_WGMMA_SS_TAIL_64
#undef FLASH_WGMMA_D_OUTS_128
#undef FLASH_WGMMA_D_REGS_128
#undef FLASH_WGMMA_D_OUTS_64
#undef FLASH_WGMMA_D_REGS_64

}  // namespace flash
