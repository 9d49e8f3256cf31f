// Tensor-core matrix multiply-accumulate through inline PTX (sm_80+):
//   mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4*g + t:
//   A (16x16, row-major): a[0] = A[g   ][2t..2t+1]   a[1] = A[g+8][2t..2t+1]
//                         a[2] = A[g   ][2t+8..+9]   a[3] = A[g+8][2t+8..+9]
//   B (16x8,  k x n)    : b[0] = B[2t..2t+1][g]      b[1] = B[2t+8..+9][g]
//   C (16x8,  fp32)     : c[0..1] = C[g][2t..2t+1]   c[2..3] = C[g+8][2t..2t+1]
// Each 32-bit register holds two 16-bit elements, lower address in the low half.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

namespace flash {

// D = A * B + D, fp32 accumulators; Element is __half or __nv_bfloat16.
#define FLASH_MMA_M16N8K16(TYPE)                                                            \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "              \
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                    \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                            \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))
template <typename Element>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  static_assert(std::is_same<Element, __half>::value || std::is_same<Element, __nv_bfloat16>::value,
                "mma_m16n8k16: Element is __half or __nv_bfloat16");
  if constexpr (std::is_same<Element, __half>::value) {
    FLASH_MMA_M16N8K16("f16");
  } else {
    FLASH_MMA_M16N8K16("bf16");
  }
}
#undef FLASH_MMA_M16N8K16

// acc[ma][n], acc[ma][n + 1] += a[ma] * (the two n8 blocks of B that one ldmatrix x4 loaded into
// b: b[0..1] and b[2..3]) for every m16 atom ma: the inner step of every ldmatrix-fed product.
template <typename Element, int kMA, int kN>
__device__ __forceinline__ void mma_m16n16k16(float (&acc)[kMA][kN][4], int n, const uint32_t (&a)[kMA][4],
                                              const uint32_t (&b)[4]) {
  const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
  for (int ma = 0; ma < kMA; ++ma) {
    mma_m16n8k16<Element>(acc[ma][n], a[ma], b0);
    mma_m16n8k16<Element>(acc[ma][n + 1], a[ma], b1);
  }
}

// Two fp32 values -> one register of two 16-bit elements (lo = x, hi = y).
template <typename Element>
__device__ __forceinline__ uint32_t pack2(float x, float y);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float x, float y) {
  __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float x, float y) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&h);
}

// One register of two 16-bit elements -> two fp32 values.
template <typename Element>
__device__ __forceinline__ float2 unpack2(uint32_t r);

template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t r) {
  return __half22float2(*reinterpret_cast<__half2*>(&r));
}

template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t r) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&r));
}

// Elementwise product of two registers of two 16-bit elements, rounded once to Element
// (fma with a -0 addend: exact sign of zero, one rounding; sm_80+ for both types).
template <typename Element>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b);

template <>
__device__ __forceinline__ uint32_t mul2<__half>(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

template <>
__device__ __forceinline__ uint32_t mul2<__nv_bfloat16>(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// A fragment (16 x 16) of the k16 step kk from a warp's fp32 C-fragment tile x[kNBlk][4]
// (16 x kNBlk*8), rounded to Element: columns 16kk..16kk+15 are n8 blocks 2kk and 2kk+1, and
// a[0] = X[g][16kk+2t..], a[1] = X[g+8][16kk+2t..], a[2] = X[g][16kk+8+2t..], a[3] = X[g+8][..]
// are exactly those blocks' c[0..1], c[2..3] (layouts above). No shuffles, no shared memory.
// The same holds per warp for wgmma's accumulator and register-A layouts (wgmma.cuh).
template <int kNBlk, typename Element>
__device__ __forceinline__ void acc_to_a_frag(uint32_t (&a)[4], const float (&x)[kNBlk][4], int kk) {
  a[0] = pack2<Element>(x[2 * kk][0], x[2 * kk][1]);
  a[1] = pack2<Element>(x[2 * kk][2], x[2 * kk][3]);
  a[2] = pack2<Element>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
  a[3] = pack2<Element>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
}

// Row h (0: g, 1: g + 8) of acc_to_a_frag for every k16 step: the A registers that hold that row's
// values (a[0], a[2] row g; a[1], a[3] row g + 8), so a row can be converted as soon as it is final.
template <int kNBlk, typename Element>
__device__ __forceinline__ void to_a_frag_row(uint32_t (&a)[kNBlk / 2][4], const float (&x)[kNBlk][4], int h) {
#pragma unroll
  for (int kk = 0; kk < kNBlk / 2; ++kk) {
    a[kk][h] = pack2<Element>(x[2 * kk][2 * h], x[2 * kk][2 * h + 1]);
    a[kk][2 + h] = pack2<Element>(x[2 * kk + 1][2 * h], x[2 * kk + 1][2 * h + 1]);
  }
}

}  // namespace flash
