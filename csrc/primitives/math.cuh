// Small numeric helpers shared by the kernels: fast exp2 and quad (4-lane) reductions.
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

}  // namespace flash
