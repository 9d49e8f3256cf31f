// Shared memory -> registers in mma fragment order: ldmatrix (sm_75+); and back: stmatrix (sm_90+).
//
// ldmatrix.x4 loads four 8x8 matrices of 16-bit elements. Lanes 8i..8i+7 give the
// shared-memory addresses of the 8 rows (16 bytes each) of matrix i; register i of
// every lane then holds row lane/4, columns 2*(lane%4)..+1 of matrix i (with .trans:
// row 2*(lane%4)..+1, column lane/4, i.e. the transposed matrix).
//
// Address recipes for row-major shared tiles (element (r, c) at base + r*stride + c):
//   A fragment of a 16x16 block at (r0, c0):          r = r0 + lane%16, c = c0 + (lane/16)*8
//   B fragments of K-like tiles ([n][k], two n8 blocks x k16 at (n0, k0)):
//        x4 -> {b0,b1} of n-block n0 and {b0,b1} of n-block n0+8:
//                                                     n = n0 + (lane/16)*8 + lane%8,
//                                                     k = k0 + ((lane/8)%2)*8
//   B fragments of V-like tiles ([k][n], k16 x two n8 blocks) with .trans:
//        x4 -> {b0,b1} of n-block n0 and {b0,b1} of n-block n0+8:
//                                                     k = k0 + ((lane/8)%2)*8 + lane%8,
//                                                     n = n0 + (lane/16)*8
//
// stmatrix.x4 is ldmatrix.x4's inverse: the same lane addresses, register i of every lane written to
// row lane/4, columns 2*(lane%4)..+1 of matrix i. So an A fragment of a 16x16 block (mma.sync
// m16n8k16 / wgmma register-A order) stored with the A recipe above is read back by ldmatrix_x4
// with the same addresses, and a K-major wgmma descriptor reads the block in place.
#pragma once

#include <cstdint>

namespace flash {

__device__ __forceinline__ uint32_t smem_u32addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// sm_90+ only: the sm90 kernels call it (their bodies compile for sm_90a only); no code below.
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, const uint32_t (&r)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(smem_addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
#endif
}

}  // namespace flash
