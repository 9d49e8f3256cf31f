// Global <-> shared copies of (kRows x kCols) tiles of 16-bit elements by 16-byte chunks, for
// any shared layout; every kernel of both arch paths uses them, except for the sm90 forward's
// TMA loads (sm80: padded pitch, sm80/kernel_common.cuh; sm90: 128-byte swizzle,
// sm90/smem_layout.cuh). A Layout gives
//   static uint32_t offset(int r, int c)   byte offset of element (r, c), c a multiple of 8;
//   kRowAlign, kRowBytes                   offset(r + k * kRowAlign, c) = offset(r, c) +
//                                          k * kRowAlign * kRowBytes for every r, c.
// Rows >= rows_valid and columns >= d_valid (the user's head dim, a multiple of 8) are never
// read (zero-filled) or written, so ragged tile edges and padded head-dim columns contribute
// exact zeros to every product.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "primitives/cp_async.cuh"

namespace flash {

// kFastPath: whole tiles take a predicate-free path (fewer instructions per copy, but a second
// copy of the loop that costs registers: kernels without registers to spare turn it off).
template <typename Layout, int kRows, int kCols, int kThreads, bool kFastPath = true, typename Element>
__device__ __forceinline__ void copy_tile_async(uint32_t smem, const Element* gmem, int64_t row_stride,
                                                int rows_valid, int d_valid, int tid) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  constexpr int kPasses = (kChunks + kThreads - 1) / kThreads;
  // Opaque copy of the stride: inside a loop over tiles the compiler would otherwise hoist the
  // 64-bit row offsets (loop-invariant) into registers for the whole loop, next to the
  // accumulators; an add per tile is cheaper.
  int64_t stride = row_stride;
  asm volatile("" : "+l"(stride));
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  if constexpr (kThreads % kChunksPerRow == 0 && kRowsPerPass % Layout::kRowAlign == 0) {
    // Every pass moves whole rows: the thread keeps its column, and pass `it` moves its source by
    // kRowsPerPass rows (one 64-bit step) and its destination by a constant.
    const int row = tid / kChunksPerRow, col = (tid % kChunksPerRow) * 8;
    const Element* src = gmem + row * stride + col;
    const int64_t step = kRowsPerPass * stride;
    const uint32_t dst = smem + Layout::offset(row, col);
    if (kFastPath && rows_valid >= kRows && d_valid >= kCols) {
      // Whole tile in range (every tile but a ragged last one): no predicates.
#pragma unroll
      for (int it = 0; it < kPasses; ++it) {
        cp_async_16(dst + it * kRowsPerPass * Layout::kRowBytes, src, true);
        src += step;
      }
      return;
    }
    const bool col_ok = col < d_valid;
#pragma unroll
    for (int it = 0; it < kPasses; ++it) {
      if (kChunks % kThreads == 0 || row + it * kRowsPerPass < kRows) {
        const bool pred = col_ok && row + it * kRowsPerPass < rows_valid;
        // A predicated-off copy reads nothing; the tile base (row 0 is always in range) keeps
        // the address valid anyway.
        cp_async_16(dst + it * kRowsPerPass * Layout::kRowBytes, pred ? src : gmem, pred);
      }
      src += step;
    }
  } else {
#pragma unroll
    for (int it = 0; it < kPasses; ++it) {
      const int c = it * kThreads + tid;
      if (kChunks % kThreads == 0 || c < kChunks) {
        const int row = c / kChunksPerRow;
        const int col = (c % kChunksPerRow) * 8;
        const bool pred = row < rows_valid && col < d_valid;
        const Element* src = pred ? gmem + row * stride + col : gmem;
        cp_async_16(smem + Layout::offset(row, col), src, pred);
      }
    }
  }
}

// Zeroes rows [row_begin, row_end) (kCols columns) of the shared tile at `smem` (any Layout), the
// kThreads threads (tid in [0, kThreads)) storing 16-byte chunks: rows a copy filled with data
// that must not reach a product.
template <typename Layout, int kCols, int kThreads>
__device__ __forceinline__ void zero_rows(uint32_t smem, int row_begin, int row_end, int tid) {
  constexpr int kChunksPerRow = kCols / 8;
#pragma unroll 1
  for (int c = row_begin * kChunksPerRow + tid; c < row_end * kChunksPerRow; c += kThreads) {
    const uint32_t dst = smem + Layout::offset(c / kChunksPerRow, (c % kChunksPerRow) * 8);
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0) : "memory");
  }
}

// Coalesced 16-byte stores of the shared tile at `smem` to global memory.
template <typename Layout, int kRows, int kCols, int kThreads, typename Element>
__device__ __forceinline__ void store_tile(Element* gmem, int64_t row_stride, const void* smem, int rows_valid,
                                           int d_valid, int tid) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
  for (int it = 0; it < (kChunks + kThreads - 1) / kThreads; ++it) {
    const int c = it * kThreads + tid;
    if (kChunks % kThreads == 0 || c < kChunks) {
      const int row = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * 8;
      if (row < rows_valid && col < d_valid) {
        *reinterpret_cast<uint4*>(gmem + row * row_stride + col) =
            *reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(smem) + Layout::offset(row, col));
      }
    }
  }
}

}  // namespace flash
