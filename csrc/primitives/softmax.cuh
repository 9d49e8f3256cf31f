// Online softmax in registers (FlashAttention-2, Dao 2023, Algorithm 1 lines 8-12),
// plus the recompute form the backward pass uses (FA2 Algorithm 2 line 13).
//
// Fragment convention: see primitives/mask.cuh. A thread of a warp holding
// s[kMAtoms][kNAtoms][4] (scores) and acc_o[kMAtoms][kDAtoms][4] (output accumulator)
// owns 2*kMAtoms rows; its row r = 2*mi + h is made of the elements s[mi][ni][2h], s[mi][ni][2h+1]
// (all ni). The 4 lanes of a quad (same lane/4) share those rows, so a full-row reduction
// is a per-thread reduction plus quad_allreduce_{max,sum} (primitives/math.cuh).
//
// Scores stay unscaled in registers; the scale is applied once inside exp2:
//     P = exp2(S * scale_log2 - m * scale_log2),   scale_log2 = softmax_scale * log2(e).
// A row whose running max is still -inf (every key masked so far) uses 0 as the subtrahend,
// so P = exp2(-inf) = 0 and no (-inf) - (-inf) = NaN ever appears.
#pragma once

#include <cmath>

#include "primitives/math.cuh"

namespace flash {

// Running row state of the online softmax for the 2*kMAtoms rows a thread owns.
// row_sum is kept per thread (partial over the thread's columns) and reduced over the
// quad only once, in finalize(): alpha is equal across the quad, so this is exact.
template <int kMAtoms>
struct OnlineSoftmax {
  static constexpr int kRows = 2 * kMAtoms;
  float row_max[kRows];  // m: running max of the raw (unscaled) scores
  float row_sum[kRows];  // l: running sum of P (thread-partial)

  __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // A row's running max may lag its true max by up to this many log2 units (P <= 2^8): the
  // accumulator is rescaled only when some row of the warp grew by more (conditional rescaling,
  // as in FlashAttention-4). Exact: P, l and O all use the same (stale) max, and the final
  // normalization and LSE use it too; P <= 256 keeps bf16/fp16's relative precision.
  static constexpr float kRescaleThreshold = 8.f;

  // One K tile (FA2 Alg. 1 lines 9-10): m_new = max(m_old, rowmax(S)); P = exp2(S*c - m_new*c)
  // in place of S; l = alpha*l + rowsum(P); acc_o *= alpha with alpha = exp2((m_old - m_new)*c).
  template <int kNAtoms, int kDAtoms>
  __device__ __forceinline__ void update(float (&s)[kMAtoms][kNAtoms][4],
                                         float (&acc_o)[kMAtoms][kDAtoms][4], float scale_log2) {
    float tile_max[kRows];
    bool grew = false;
#pragma unroll
    for (int mi = 0; mi < kMAtoms; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 2 * mi + h;
        float m = row_max[r];
#pragma unroll
        for (int ni = 0; ni < kNAtoms; ++ni) {
          m = fmaxf(m, fmaxf(s[mi][ni][2 * h], s[mi][ni][2 * h + 1]));
        }
        tile_max[r] = quad_allreduce_max(m);
        // True when the max moved past the threshold, or from -inf to finite (-inf to -inf is
        // NaN > 8 = false: such a row's P is 0 whatever the max).
        grew |= (tile_max[r] - row_max[r]) * scale_log2 > kRescaleThreshold;
      }
    }
    // Warp-uniform decision: the whole warp rescales (to the exact new max) or none of it does.
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        // -inf max (no visible key yet): subtract 0 so masked scores give exp2(-inf) = 0;
        // m_old = -inf gives alpha = 0 (row_sum and acc_o are 0 then anyway).
        const float m_scaled = (tile_max[r] == -INFINITY) ? 0.f : tile_max[r] * scale_log2;
        const float alpha = fast_exp2(row_max[r] * scale_log2 - m_scaled);
        row_max[r] = tile_max[r];
        row_sum[r] *= alpha;
#pragma unroll
        for (int di = 0; di < kDAtoms; ++di) {
          acc_o[r / 2][di][2 * (r % 2)] *= alpha;
          acc_o[r / 2][di][2 * (r % 2) + 1] *= alpha;
        }
      }
    }
#pragma unroll
    for (int mi = 0; mi < kMAtoms; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 2 * mi + h;
        const float m_scaled = (row_max[r] == -INFINITY) ? 0.f : row_max[r] * scale_log2;
        float sum = 0.f;
#pragma unroll
        for (int ni = 0; ni < kNAtoms; ++ni) {
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            s[mi][ni][e] = fast_exp2(fmaf(s[mi][ni][e], scale_log2, -m_scaled));
            sum += s[mi][ni][e];
          }
        }
        row_sum[r] += sum;
      }
    }
  }

  // FA2 Alg. 1 lines 12-13: O = acc_o / l (0 for a row with l == 0, i.e. no visible key)
  // and LSE = m*softmax_scale + log(l) in natural log, +inf when l == 0.
  // lse[r] receives row r's value (identical on the 4 lanes of the quad).
  template <int kDAtoms>
  __device__ __forceinline__ void finalize(float (&acc_o)[kMAtoms][kDAtoms][4], float scale_log2,
                                           float (&lse)[kRows]) {
#pragma unroll
    for (int mi = 0; mi < kMAtoms; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 2 * mi + h;
        const float l = quad_allreduce_sum(row_sum[r]);
        const bool empty = !(l > 0.f);  // also catches a NaN l, never producing NaN output
        const float inv_l = empty ? 0.f : 1.f / l;
        // log2-domain LSE converted to natural log: (m*c + log2(l)) * ln(2).
        lse[r] = empty ? INFINITY
                       : (row_max[r] * scale_log2 + __log2f(l)) * 0.69314718055994530942f;
#pragma unroll
        for (int di = 0; di < kDAtoms; ++di) {
          acc_o[mi][di][2 * h] *= inv_l;
          acc_o[mi][di][2 * h + 1] *= inv_l;
        }
      }
    }
  }
};

// Backward recompute (FA2 Alg. 2 line 13): P = exp2(S*scale_log2 - lse_log2[row]) in place,
// where lse_log2 = LSE*log2(e) for the thread's rows (r = 2*mi + h). A row with LSE = +inf
// (no visible key) must be passed as lse_log2 = +inf: every P of it becomes exp2(-inf) = 0
// (masked scores are -inf too: -inf - inf = -inf, still 0).
template <int kMAtoms, int kNAtoms>
__device__ __forceinline__ void scale_apply_exp2(float (&s)[kMAtoms][kNAtoms][4],
                                                 const float (&lse_log2)[2 * kMAtoms],
                                                 float scale_log2) {
#pragma unroll
  for (int mi = 0; mi < kMAtoms; ++mi) {
#pragma unroll
    for (int ni = 0; ni < kNAtoms; ++ni) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[mi][ni][e] = fast_exp2(fmaf(s[mi][ni][e], scale_log2, -lse_log2[2 * mi + e / 2]));
      }
    }
  }
}

}  // namespace flash
