// Which keys a query row sees, and which tiles a kernel visits: the one mask and tile-range layer
// of every kernel (forward, dK/dV, dQ; both arch paths; FA2 mask.h / block_info.h, FA3 mask.h).
//
// Contract (docs/DESIGN.md): key j is visible to query i iff j < seqlen_k and, when causal
// (bottom-right aligned, off = seqlen_k - seqlen_q), j <= i + off. The visible keys of a row are
// the prefix [0, key_limit(i)), so a mask is one compare per element and a tile range is a
// division. A sliding window becomes a lower limit here (key_start(i)) and a first block.
//
// Tiles: a query tile is rows [m0, m0 + kBlockM), a key block rows [n0, n0 + kBlockN). The
// "transposed" view of the dK/dV kernels (one key block, a loop over query tiles) asks the same
// questions from the key side: first_m_block, kv_block_needs_mask.
#pragma once

#include <cmath>

#include "kernels/common/seqlen.cuh"

namespace flash {

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

struct AttnMask {
  int seqlen_q, seqlen_k, off;
  bool causal;

  __host__ __device__ __forceinline__ AttnMask(const SeqInfo& s, bool causal_)
      : seqlen_q(s.seqlen_q), seqlen_k(s.seqlen_k), off(s.seqlen_k - s.seqlen_q), causal(causal_) {}

  // Exclusive end of the keys query `row` sees (<= 0: none).
  __host__ __device__ __forceinline__ int key_limit(int row) const {
    return causal ? min(seqlen_k, row + off + 1) : seqlen_k;
  }
  __host__ __device__ __forceinline__ bool visible(int row, int key) const { return key < key_limit(row); }

  // ---- Query tile [m0, m0 + kBlockM) against key blocks of kBlockN (forward, dQ).
  // Key blocks [0, n_block_max) hold a key some valid row of the tile sees (0: none).
  __host__ __device__ __forceinline__ int n_block_max(int m0, int kBlockM, int kBlockN) const {
    const int limit = key_limit(min(m0 + kBlockM, seqlen_q) - 1);
    return limit <= 0 ? 0 : ceil_div(limit, kBlockN);
  }
  // Key blocks [0, n_block_unmasked) are visible to every row of the tile: no mask code there.
  __host__ __device__ __forceinline__ int n_block_unmasked(int m0, int kBlockN) const {
    const int full = seqlen_k / kBlockN;
    return causal ? min(full, max(0, m0 + off + 1) / kBlockN) : full;
  }

  // ---- Key block [n0, n0 + kBlockN) against query tiles of kBlockM (dK/dV, transposed).
  // Query tiles before first_m_block see none of the block's keys.
  __host__ __device__ __forceinline__ int first_m_block(int n0, int kBlockM) const {
    return causal && n0 - off > 0 ? (n0 - off) / kBlockM : 0;
  }
  // The (query tile m0, key block n0) pair holds pairs the causal diagonal hides. Keys past
  // seqlen_k need no mask in the dK/dV kernels: they only feed dK/dV rows that are never stored.
  __host__ __device__ __forceinline__ bool kv_block_needs_mask(int m0, int n0, int kBlockN) const {
    return causal && n0 + kBlockN - 1 > m0 + off;
  }

  // Sets the invisible scores of a warp's mma-C-fragment tile to -inf (rows = queries):
  // s[mi][ni][e] is query row0 + 16 mi + g + 8 (e / 2), key col0 + 8 ni + 2 t + (e % 2),
  // lane = 4 g + t (primitives/mma.cuh). The limit is taken relative to the thread's first column,
  // so each element costs one compare against a compile-time constant.
  template <int kMAtoms, int kNAtoms>
  __device__ __forceinline__ void apply(float (&s)[kMAtoms][kNAtoms][4], int row0, int col0) const {
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, col_t = col0 + 2 * (lane % 4);
#pragma unroll
    for (int mi = 0; mi < kMAtoms; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int limit = key_limit(row0 + mi * 16 + g + h * 8) - col_t;
#pragma unroll
        for (int ni = 0; ni < kNAtoms; ++ni) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (ni * 8 + e >= limit) s[mi][ni][2 * h + e] = -INFINITY;
          }
        }
      }
    }
  }
};

}  // namespace flash
