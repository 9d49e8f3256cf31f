// Shared-memory tiles of the Hopper (sm90) path: (kRows x kCols) 16-bit elements in the
// 128-byte-swizzle layout that wgmma reads through matrix descriptors (primitives/wgmma.cuh),
// and the tile movement around them (global -> shared by cp.async, fp32 accumulators ->
// shared, shared -> global).
//
// Layout: kCols / 64 column blocks of kRows x 64 elements (kRows * 128 bytes each, 1024-byte
// aligned); inside a block, row r takes 128 bytes and its 16-byte chunk c (elements 8c..8c+7)
// sits at chunk position c ^ (r % 8). The same XOR makes the cp.async writes, the accumulator
// stores and the 16-byte reads below bank-conflict free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "primitives/cp_async.cuh"
#include "primitives/ldmatrix.cuh"
#include "primitives/mma.cuh"
#include "primitives/wgmma.cuh"

namespace flash {
namespace sm90 {

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

template <int kRows, int kCols>
struct SwizzledTile {
  static_assert(kCols % 64 == 0, "tiles are whole 64-column (128-byte) swizzle blocks");
  static_assert(kRows % 8 == 0, "tiles are whole 8-row (1024-byte) swizzle atoms");
  static constexpr int kColBlockBytes = kRows * 128;
  static constexpr int kBytes = kColBlockBytes * (kCols / 64);

  // Byte offset of element (r, c) from the tile base.
  __device__ __forceinline__ static uint32_t offset(int r, int c) {
    return uint32_t((c / 64) * kColBlockBytes + r * 128 + ((((c % 64) / 8) ^ (r % 8)) * 16) + (c % 8) * 2);
  }

  // Descriptor of the K-major operand made of rows [r0, r0 + 64) (r0 % 8 == 0), columns
  // [16kk, 16kk + 16) as K: "S = Q K^T"-shaped products read A and B this way.
  __device__ __forceinline__ static uint64_t desc_k_major(uint32_t base, int r0, int kk) {
    return make_wgmma_desc(base + (kk / 4) * kColBlockBytes + r0 * 128 + (kk % 4) * 32, 16, 1024);
  }

  // Descriptor of the N-major B operand made of rows [16kk, 16kk + 16) as K and all kCols
  // columns as N: "dV += P^T dO"-shaped products read B this way.
  __device__ __forceinline__ static uint64_t desc_mn_major(uint32_t base, int kk) {
    return make_wgmma_desc(base + kk * 16 * 128, kColBlockBytes, 1024);
  }
};

// Asynchronous copy of a (kRows x kCols) tile at `gmem` (row stride `row_stride` elements, may
// be 0) into the swizzled tile at shared address `smem`. Rows >= rows_valid and columns >=
// d_valid (the user's head dim, a multiple of 8) are zero-filled without reading global memory.
template <int kRows, int kCols, int kThreads, typename Element>
__device__ __forceinline__ void load_tile_async(uint32_t smem, const Element* gmem, int64_t row_stride,
                                                int rows_valid, int d_valid, int tid) {
  using Tile = SwizzledTile<kRows, kCols>;
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  // Opaque copy of the stride: stops the compiler from hoisting every chunk's 64-bit row offset
  // out of the main loop into registers that the accumulators need.
  int64_t stride = row_stride;
  asm volatile("" : "+l"(stride));
#pragma unroll
  for (int it = 0; it < ceil_div(kChunks, kThreads); ++it) {
    const int c = it * kThreads + tid;
    if (kChunks % kThreads == 0 || c < kChunks) {
      const int row = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * 8;
      const bool pred = row < rows_valid && col < d_valid;
      const Element* src = pred ? gmem + row * stride + col : gmem;
      cp_async_16(smem + Tile::offset(row, col), src, pred);
    }
  }
}

// Coalesced 16-byte stores of the swizzled tile at `smem` to global memory; only rows <
// rows_valid and columns < d_valid are written.
template <int kRows, int kCols, int kThreads, typename Element>
__device__ __forceinline__ void store_tile(Element* gmem, int64_t row_stride, const unsigned char* smem,
                                           int rows_valid, int d_valid, int tid) {
  using Tile = SwizzledTile<kRows, kCols>;
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
  for (int it = 0; it < ceil_div(kChunks, kThreads); ++it) {
    const int c = it * kThreads + tid;
    if (kChunks % kThreads == 0 || c < kChunks) {
      const int row = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * 8;
      if (row < rows_valid && col < d_valid) {
        *reinterpret_cast<uint4*>(gmem + row * row_stride + col) =
            *reinterpret_cast<const uint4*>(smem + Tile::offset(row, col));
      }
    }
  }
}

// Writes a warpgroup's fp32 accumulator (64 x kNBlk*8, wgmma layout: warp w, lane 4g + t holds
// rows 16w + g and 16w + g + 8, columns 8j + 2t, +1 of n8 block j) times `scale` into rows
// [row0, row0 + 64) of the swizzled tile at `smem`, converted to Element.
template <int kRows, int kCols, int kNBlk, typename Element>
__device__ __forceinline__ void store_acc_to_smem(unsigned char* smem, const float (&acc)[kNBlk][4], int row0,
                                                  float scale, int tid_in_wg) {
  using Tile = SwizzledTile<kRows, kCols>;
  const int lane = tid_in_wg % 32, g = lane / 4, t = lane % 4;
  const int r = row0 + 16 * (tid_in_wg / 32) + g;
#pragma unroll
  for (int j = 0; j < kNBlk; ++j) {
    *reinterpret_cast<uint32_t*>(smem + Tile::offset(r, 8 * j + 2 * t)) =
        pack2<Element>(acc[j][0] * scale, acc[j][1] * scale);
    *reinterpret_cast<uint32_t*>(smem + Tile::offset(r + 8, 8 * j + 2 * t)) =
        pack2<Element>(acc[j][2] * scale, acc[j][3] * scale);
  }
}

// The (N/8 x 4) accumulator view of the kernels as the flat N/2-register list of Wgmma.
template <int kNBlk>
__device__ __forceinline__ float (&flat(float (&acc)[kNBlk][4]))[kNBlk * 4] {
  return reinterpret_cast<float(&)[kNBlk * 4]>(acc);
}

}  // namespace sm90
}  // namespace flash
