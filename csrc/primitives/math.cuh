// Small numeric helpers shared by the kernels: fast exp2, quad (4-lane) reductions, division by
// a divisor fixed per CTA.
// In an mma C fragment, the 4 lanes of a quad (lane/4 equal) hold one row's columns,
// so a row max / row sum over a warp tile is a per-thread reduction plus two shuffles.
#pragma once

#include <cstdint>

namespace flash {

// 2^x with the SFU (ex2.approx.ftz): exp2(-inf) = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) with the SFU (tanh.approx.f32: one MUFU op, relative error <= ~2^-11; +-inf -> +-1,
// NaN stays NaN), for logit soft-capping (flash.h: softcap). A logit softcap * t then errs by
// <= softcap * 2^-11, the size of the fp16 rounding of the logit itself (bf16's is 4x larger). The
// exact form 1 - 2 / (1 + 2^(2 x log2 e)) (ex2 + rcp: two MUFU ops) ran the d64 forward at 0.49x
// of the call without the cap (the SFU paces it already: primitives/softmax.cuh) and made its
// consumer warps spill; this form keeps one extra MUFU op per score.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_allreduce_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}

__device__ __forceinline__ float quad_allreduce_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// n / d and n % d for 0 <= n < 2^31 and a divisor 1 <= d < 2^31 fixed for a CTA's lifetime (a
// loop's trip split, e.g. the dK/dV kernel's iteration -> (query head, Q tile)): one multiply-high
// and a shift per division instead of the hardware-less integer division's ~20 instructions.
// Granlund & Montgomery, "Division by invariant integers using multiplication" (PLDI 1994), with
// p = 31 + ceil(log2 d) and magic = ceil(2^p / d) < 2^32: for n < 2^31 the error of magic / 2^p
// against 1 / d stays below 1 / (d n), so floor(n magic / 2^p) = floor(n / d). d = 1 passes n.
struct FastDivmod {
  int d = 1;
  uint32_t magic = 0, shift = 0;
  FastDivmod() = default;
  __host__ __device__ __forceinline__ explicit FastDivmod(int divisor) : d(divisor) {
    if (d > 1) {
#ifdef __CUDA_ARCH__
      const int log2_ceil = 32 - __clz(d - 1);
#else
      int log2_ceil = 0;
      while ((1u << log2_ceil) < uint32_t(d)) ++log2_ceil;
#endif
      magic = uint32_t(((uint64_t(1) << (31 + log2_ceil)) + uint64_t(d) - 1) / uint64_t(d));
      shift = uint32_t(log2_ceil - 1);  // p - 32
    }
  }
  __device__ __forceinline__ int div(int n) const {
    return d == 1 ? n : int(__umulhi(uint32_t(n), magic) >> shift);
  }
  __device__ __forceinline__ int mod(int n) const { return n - div(n) * d; }
};

}  // namespace flash
