// Which keys a query row sees, and which tiles a kernel visits: the one mask and tile-range layer
// of every kernel (forward, dK/dV, dQ; both arch paths; FA2 mask.h / block_info.h, FA3 mask.h).
//
// Contract (docs/DESIGN.md): with off = seqlen_k - seqlen_q (bottom-right alignment), key j is
// visible to query i iff j < seqlen_k and
//   j <= i + off + right   when the mask has a right bound (causal: right = 0; a window's right
//                          side: window_size[1]), and
//   j >= i + off - left    when it has a left bound (a sliding window's left side: window_size[0]).
// The visible keys of a row are the interval [key_start(i), key_limit(i)), so a mask is two
// compares per element (one without a left bound) and a tile range is a division on each side.
// The API normalizes a bound that hides no key to none (left >= seqlen_k - 1, right >= seqlen_q - 1;
// varlen: the max_seqlen) and refuses a window where seqlen_q + seqlen_k > 2^31 - 512, so every
// sum below stays in int32 (without a window they are the sums of the causal mask alone).
//
// Tiles: a query tile is rows [m0, m0 + kBlockM), a key block rows [n0, n0 + kBlockN). The
// "transposed" view of the dK/dV kernels (one key block, a loop over query tiles) asks the same
// questions from the key side: first_m_block, m_block_end, kv_block_needs_mask.
#pragma once

#include <cfloat>
#include <cmath>

#include "kernels/common/seqlen.cuh"

namespace flash {

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

struct AttnMask {
  static constexpr int kNoLeft = -0x7fffffff - 1;  // off_left without a left bound: key_start 0
  int seqlen_q, seqlen_k;
  int off_right;  // off + right (causal: right = 0); read only with `causal`
  bool causal;    // a right bound: is_causal or a window's right side
  int off_left;   // off - left, or kNoLeft (row + kNoLeft < 0 for every row >= 0)

  __host__ __device__ __forceinline__ AttnMask(const SeqInfo& s, const Flash_fwd_params& p)
      : seqlen_q(s.seqlen_q), seqlen_k(s.seqlen_k),
        off_right(s.seqlen_k - s.seqlen_q + (p.is_causal ? 0 : max(p.window_right, 0))),
        causal(p.is_causal || p.window_right >= 0),
        off_left(p.window_left >= 0 ? s.seqlen_k - s.seqlen_q - p.window_left : kNoLeft) {}
  __host__ __device__ __forceinline__ bool local() const { return off_left != kNoLeft; }  // a left bound

  // Exclusive end of the keys query `row` sees (<= 0: none).
  __host__ __device__ __forceinline__ int key_limit(int row) const {
    return causal ? min(seqlen_k, row + off_right + 1) : seqlen_k;
  }
  // First key query `row` (>= 0) sees (>= key_limit(row): none).
  __host__ __device__ __forceinline__ int key_start(int row) const { return max(0, row + off_left); }
  // kLeft = false checks the right bound only: the masked recompute of a call without a left
  // bound (primitives/softmax.cuh: PMode::kMasked), the code of the causal mask alone.
  template <bool kLeft>
  __host__ __device__ __forceinline__ bool visible(int row, int key) const {
    return key < key_limit(row) && (!kLeft || key >= key_start(row));
  }

  // ---- Query tile [m0, m0 + kBlockM) against key blocks of kBlockN (forward, dQ).
  // Key blocks [n_block_min, n_block_max) hold a key some valid row of the tile sees (empty when
  // n_block_max <= n_block_min: no row sees a key).
  __host__ __device__ __forceinline__ int n_block_max(int m0, int kBlockM, int kBlockN) const {
    const int limit = key_limit(min(m0 + kBlockM, seqlen_q) - 1);
    return limit <= 0 ? 0 : ceil_div(limit, kBlockN);
  }
  __host__ __device__ __forceinline__ int n_block_min(int m0, int kBlockN) const {
    return key_start(m0) / kBlockN;  // the first row starts first
  }
  // Key blocks [n_block_unmasked_lo, n_block_unmasked) are visible to every row of the tile: no
  // mask code there (the left edge: the last row starts last; the right edge: the first row ends first).
  __host__ __device__ __forceinline__ int n_block_unmasked(int m0, int kBlockN) const {
    return max(0, key_limit(m0)) / kBlockN;
  }
  __host__ __device__ __forceinline__ int n_block_unmasked_lo(int m0, int kBlockM, int kBlockN) const {
    return ceil_div(key_start(min(m0 + kBlockM, seqlen_q) - 1), kBlockN);
  }

  // ---- Key block [n0, n0 + kBlockN) against query tiles of kBlockM (dK/dV, transposed).
  // Query tiles [first_m_block, m_block_end) hold a row that sees some key of the block.
  __host__ __device__ __forceinline__ int first_m_block(int n0, int kBlockM) const {
    const int row = n0 - off_right;  // the first row whose keys reach n0
    return causal && row > 0 ? row / kBlockM : 0;
  }
  __host__ __device__ __forceinline__ int m_block_end(int n0, int kBlockN, int kBlockM) const {
    const int num_m = ceil_div(seqlen_q, kBlockM);
    if (!local()) return num_m;
    const int64_t last = int64_t(n0) + kBlockN - 1 - off_left;  // the last row whose keys start by the block's end
    return last < 0 ? 0 : int(min(int64_t(num_m), last / kBlockM + 1));
  }
  // The (query tile m0, key block n0) pair holds pairs the mask hides: the block passes the right
  // end of the tile's first row, or the left start of its last row (m0 + kBlockM - 1) passes n0.
  // Keys past seqlen_k need no mask in the dK/dV kernels: they only feed dK/dV rows that are never
  // stored.
  template <bool kLeft>
  __host__ __device__ __forceinline__ bool kv_block_needs_mask(int m0, int kBlockM, int n0, int kBlockN) const {
    return (causal && n0 + kBlockN - 1 > m0 + off_right) || (kLeft && m0 + (kBlockM - 1) + off_left > n0);
  }

  // Sets the invisible scores of a warp's mma-C-fragment tile to -inf (rows = queries):
  // s[mi][ni][e] is query row0 + 16 mi + g + 8 (e / 2), key col0 + 8 ni + 2 t + (e % 2),
  // lane = 4 g + t (primitives/mma.cuh). The limits are taken relative to the thread's first
  // column, so each element costs one compare against a compile-time constant per bound.
  // kLeft = false: the right bound and seqlen_k only, the code of the causal mask alone (the
  // kernels' twins for calls without a window's left bound); true: the left bound too (kLocal).
  template <bool kLeft, int kMAtoms, int kNAtoms>
  __device__ __forceinline__ void apply(float (&s)[kMAtoms][kNAtoms][4], int row0, int col0) const {
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, col_t = col0 + 2 * (lane % 4);
#pragma unroll
    for (int mi = 0; mi < kMAtoms; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + mi * 16 + g + h * 8;
        const int limit = key_limit(row) - col_t, start = kLeft ? key_start(row) - col_t : 0;
#pragma unroll
        for (int ni = 0; ni < kNAtoms; ++ni) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (ni * 8 + e >= limit || (kLeft && ni * 8 + e < start)) s[mi][ni][2 * h + e] = -INFINITY;
          }
        }
      }
    }
  }

  // ALiBi (flash.h: alibi_*): adds slope_u * |i + seqlen_k - seqlen_q - j| to the score of query i,
  // key j of a warp's mma-C-fragment tile, laid out as apply's (kKeyRows = false: rows are queries,
  // s[mi][ni][e] is row row0 + 16 mi + g + 8 (e / 2), column col0 + 8 ni + 2 t + (e % 2)) or
  // transposed (kKeyRows: rows are keys, columns queries: the dK/dV kernels' S^T). slope_u: the
  // head's slope in score units (alibi_slope). Every tile, masked or not (the mask comes after:
  // -inf stays -inf). Each distance is the thread's first one (row row0 + g, column col_t) plus a
  // compile-time integer (exact in float32 below 2^24): one FADD and one FFMA (|.| is an operand
  // modifier), the FADD shared by every element at the same distance (a thread's row h = 1 sees
  // row h = 0's distances shifted by one 8-column atom: 34 FADDs for 64 scores of a 128-key tile).
  template <bool kKeyRows, int kMAtoms, int kNAtoms>
  __device__ __forceinline__ void add_alibi(float (&s)[kMAtoms][kNAtoms][4], int row0, int col0, float slope_u) const {
    const int lane = threadIdx.x % 32;
    const int row_t = row0 + lane / 4, col_t = col0 + 2 * (lane % 4), off = seqlen_k - seqlen_q;
    // i + off - j at the thread's first element (queries as rows: i = row; keys as rows: j = row).
    const float dist_t = kKeyRows ? float(col_t + off - row_t) : float(row_t + off - col_t);
#pragma unroll
    for (int mi = 0; mi < kMAtoms; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int ni = 0; ni < kNAtoms; ++ni) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int rows = mi * 16 + h * 8, cols = ni * 8 + e;
            const float dist = dist_t + float(kKeyRows ? cols - rows : rows - cols);
            s[mi][ni][2 * h + e] = fmaf(slope_u, fabsf(dist), s[mi][ni][2 * h + e]);
          }
        }
      }
    }
  }
  // The same for a warpgroup's wgmma accumulator acc[kNBlk][4] (one m16 row slab per warp: row0 is
  // the warp's first row).
  template <bool kKeyRows, int kNBlk>
  __device__ __forceinline__ void add_alibi(float (&acc)[kNBlk][4], int row0, int col0, float slope_u) const {
    add_alibi<kKeyRows, 1, kNBlk>(reinterpret_cast<float (&)[1][kNBlk][4]>(acc), row0, col0, slope_u);
  }

  // ---- One m16 slab of rows that are not consecutive queries (the split-KV kernel's packed GQA
  // rows: packed row r is query r / ratio of its own head). The thread's two rows h = 0, 1 (lane / 4
  // and lane / 4 + 8) come with what apply / add_alibi derive from a row index, computed once per
  // CTA: limit[h] = key_limit(query), start[h] = key_start(query) (read with kLeft only); for ALiBi
  // pos[h] = query + seqlen_k - seqlen_q and the head's slope[h]. s[0][ni][e] is row e / 2, key
  // col_t + 8 ni + (e % 2), col_t being the thread's first key (the slab's first + 2 (lane % 4)).
  template <bool kLeft, int kNAtoms>
  __device__ __forceinline__ static void apply_rows(float (&s)[1][kNAtoms][4], const int (&limit)[2],
                                                    const int (&start)[2], int col_t) {
#pragma unroll
    for (int ni = 0; ni < kNAtoms; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = col_t + ni * 8 + (e % 2);
        if (key >= limit[e / 2] || (kLeft && key < start[e / 2])) s[0][ni][e] = -INFINITY;
      }
  }
  template <int kNAtoms>
  __device__ __forceinline__ static void add_alibi_rows(float (&s)[1][kNAtoms][4], const int (&pos)[2],
                                                        const float (&slope)[2], int col_t) {
#pragma unroll
    for (int ni = 0; ni < kNAtoms; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float dist = float(pos[e / 2] - (col_t + ni * 8 + (e % 2)));
        s[0][ni][e] = fmaf(slope[e / 2], fabsf(dist), s[0][ni][e]);
      }
  }
};

// ALiBi's slope of sequence (batch) b, head h in score units (flash.h: alibi_unit; 0 without ALiBi),
// an overflow to +-inf clamped to +-FLT_MAX: inf would make the distance-0 key's bias inf * 0 = NaN
// (a slope past float32's range keeps only the nearest key, as the exact bias does). A NaN slope
// stays NaN.
template <typename Params>
__device__ __forceinline__ float alibi_slope(const Params& p, int b, int h) {
  if (p.alibi_slopes_ptr == nullptr) return 0.f;
  const float s = p.alibi_slopes_ptr[int64_t(b) * p.alibi_slopes_batch_stride + h] * p.alibi_unit;
  return isinf(s) ? copysignf(FLT_MAX, s) : s;
}

}  // namespace flash
