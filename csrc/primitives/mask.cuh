// Attention masks applied to score tiles held as mma.m16n8k16 C fragments (fp32).
//
// Fragment convention used by the sm80 kernels (see primitives/mma.cuh), lane = 4*g + t:
// a warp's score tile is float s[kMAtoms][kNAtoms][4]; element s[mi][ni][e] is
//     row = row0 + mi*16 + g + (e/2)*8        (query index, tile-global)
//     col = col0 + ni*8  + 2*t + (e%2)        (key index, tile-global)
// where row0 is the warp's first query row and col0 the tile's first key column.
//
// Masks (the contract in docs/DESIGN.md):
//   - key padding: col >= seqlen_k is invisible (ragged last K tile);
//   - causal, bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
// Masked scores become -inf, so exp2 gives P = 0 (primitives/softmax.cuh keeps a row
// whose every score is -inf finite: it subtracts 0 instead of -inf).
#pragma once

#include <cmath>

namespace flash {

// True when key `col` is invisible to query `row`. causal_offset = seqlen_k - seqlen_q.
__device__ __forceinline__ bool is_masked(int row, int col, int seqlen_k, bool causal,
                                          int causal_offset) {
  return col >= seqlen_k || (causal && col > row + causal_offset);
}

// Sets masked entries of a warp's score tile to -inf. Only called on tiles that cross
// the causal diagonal or the seqlen_k edge; mask-free tiles skip it entirely.
// Per row, the visible keys are col < limit = min(seqlen_k, row + causal_offset + 1); the
// limit is taken relative to the thread's first column, so each element costs one compare
// against a compile-time constant (keeps the masked step's register footprint small).
template <int kMAtoms, int kNAtoms>
__device__ __forceinline__ void apply_mask(float (&s)[kMAtoms][kNAtoms][4], int row0, int col0,
                                           int seqlen_k, bool causal, int causal_offset) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int col_t = col0 + 2 * t;  // column of s[.][0][0] for this thread
#pragma unroll
  for (int mi = 0; mi < kMAtoms; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + mi * 16 + g + h * 8;
      // Exclusive key limit of this row, relative to col_t.
      const int limit = (causal ? min(seqlen_k, row + causal_offset + 1) : seqlen_k) - col_t;
#pragma unroll
      for (int ni = 0; ni < kNAtoms; ++ni) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          // Same test as is_masked(row, col, ...) with col = col_t + ni*8 + e.
          if (ni * 8 + e >= limit) s[mi][ni][2 * h + e] = -INFINITY;
        }
      }
    }
  }
}

}  // namespace flash
