// Softmax numerics of every kernel: the forward's online softmax in registers (FlashAttention-2,
// Dao 2023, Algorithm 1 lines 8-12) and the backward's recompute of P (Algorithm 2 line 12).
//
// Exact at any magnitude. The forward keeps the row max m of the raw scores S and computes
// P = exp2((S - m) * c), c = softmax_scale * log2(e) > 0 (the API makes the scale positive): the
// subtraction of two floats is monotone, so P <= 1 (<= 2^8 between rescales, below) and the max
// itself gets exactly 1. The FFMA S * c - m * c subtracts a rounded m * c from an unrounded S * c:
// harmless while |m c| < 2^10 (the fast copy of the loop), but for |S * c| ~ 1e11 that rounding
// alone (~1e4) overflows exp2 (NaN outputs), so larger rows take the exact form. The LSE leaves
// as two floats in log2 units, (round(m * c), log2 l) (flash.h: row_max / row_log2sum), so the
// backward can recompute P exactly where one float would lose log2 l below m's last bit.
//
// Fragment convention (mma C fragments, primitives/mma.cuh), lane = 4g + t: a warp's score tile is
// s[kMAtoms][kNAtoms][4]; a thread owns rows r = 2 mi + h made of s[mi][ni][2h], s[mi][ni][2h+1];
// the 4 lanes of a quad share those rows (quad_allreduce_*, primitives/math.cuh).
#pragma once

#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "primitives/math.cuh"

namespace flash {

// |m c| (log2 units of the scaled row max) from which P takes the exact form: below it, one FFMA
// S c - (m c) errs by < 2^-14 in the forward and the backward folds LSE_log2 into one float
// (kernels/common/bwd_preprocess.cuh); above it, both keep m and the rest apart.
constexpr float kExactLimit = 1024.f;

// Logit soft-capping (Gemma 2, Team et al. 2024, section 2; flash.h: softcap): a kernel's
// kSoftcap twin maps the scores S of a tile (any float array: fragments, accumulators) in place to
// t = tanh(S softmax_scale / softcap), then runs the softmax on t with c = softcap log2(e), so the
// logits are softcap t. Before the mask: a masked score's -inf must stay -inf (tanh gives -1).
// prescale = params.softcap_prescale = softmax_scale / softcap (primitives/math.cuh: tanh_approx).
template <typename Scores>
__device__ __forceinline__ void softcap_scores(Scores& s, float prescale) {
  constexpr int kN = int(sizeof(Scores) / sizeof(float));
  float* f = reinterpret_cast<float*>(&s);
#pragma unroll
  for (int i = 0; i < kN; ++i) f[i] = tanh_approx(f[i] * prescale);
}

// The backward's soft-capping factor dt/dS' = 1 - t^2 (chain rule through softcap_scores: dS' =
// dS_capped (1 - t^2), then softmax_scale as without capping) for a tile of t, kept for the dS
// step where P is also needed alone (the dK/dV kernels: dV takes P). Element i of the tile (its
// flat index, any fragment layout) is pair i / 2, half i % 2, of fp16 pairs: [0, 1] to 2^-11
// relative, below the rounding of dS itself, in half the registers of fp32.
template <typename Scores>
struct SoftcapGrad {
  static constexpr int kN = int(sizeof(Scores) / sizeof(float));
  uint32_t pairs[kN / 2];
  __device__ __forceinline__ void set(const Scores& t) {
    const float* f = reinterpret_cast<const float*>(&t);
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) {
      const __half2 d = __floats2half2_rn(fmaf(-f[2 * i], f[2 * i], 1.f), fmaf(-f[2 * i + 1], f[2 * i + 1], 1.f));
      pairs[i] = *reinterpret_cast<const uint32_t*>(&d);
    }
  }
  __device__ __forceinline__ float2 pair(int i) const {  // elements 2i, 2i + 1
    return __half22float2(*reinterpret_cast<const __half2*>(&pairs[i]));
  }
};

// How update() computes the exact form of P (rows with |m c| >= kExactLimit; both give the same
// bits, round((S - m) c) into exp2):
//   kPrepass     a pass subtracts m from the scores first, then the one exponentiation loop runs
//                with m c = 0 (sm80 kernels: a second copy of the loop split the tile's code at
//                the branch and cost the sm80 forward d64 5 %, d128 1 %);
//   kSecondLoop  a second copy of the exponentiation loop (sm90 forward: its d256 ran 9 %
//                slower with the prepass).
// Tune harness A/B of two trees on the H200 (bf16, N 1k-16k).
enum class ExactForm { kPrepass, kSecondLoop };

// The order in which update() treats a thread's rows:
//   kTogether   every row's max first, then one warp-uniform decision (rescale, exact form) for all of
//               them, then every row's exponentials;
//   kPipelined  row by row, each row index r with its own warp-uniform decisions, and row r + 1's max
//               taken inside row r's exponentiation block: its FMNMX (ALU pipe) fill the issue gaps
//               between row r's MUFU.EX2 (one per 8 cycles per warp) instead of preceding them, so a
//               tile's softmax is shorter by about one row's max (FlashAttention-4's sm90 softmax
//               goes row by row as well). Each row index costs one more vote and two more uniform
//               branches, so it pays only where the softmax's latency, not the SFU's throughput, bounds
//               the loop. sm90 forward with two ping-pong warpgroups (d128; d96 then): +1-6 % per cell
//               (tune harness, 6 rounds, H200); with three (d64, SFU-bound) -2..-5 %; d192 -1 %.
// The same bits for a row whatever the order, given the same decisions (the decisions are per
// warp and row index instead of per warp).
enum class RowOrder { kTogether, kPipelined };

// update_deferred's default row_done: nothing to do when a row's P is complete.
struct NoRowDone {
  __device__ __forceinline__ void operator()(int) const {}
};

// ---- Attention sinks (flash.h: sinks_ptr): one more key per row with logit `sink` (natural log,
// the units of softmax_scale * S) and value 0, added to a finished row. With t = sink log2(e) -
// LSE_log2 (the sink's weight against the keys', log2 units), the row's mass grows by 1 + 2^t:
// O *= scale = 1 / (1 + 2^t), LSE_log2 += log2_gain = log2(1 + 2^t) (computed as t + log2(1 +
// 2^-t) for t > 0, so a dominant sink does not overflow). t < -64 (a -inf sink: no sink) gives
// exactly (1, 0), the same bits as without sinks; a NaN sink gives NaN.
struct SinkShare {
  float scale;
  float log2_gain;
};

__device__ __forceinline__ SinkShare sink_share(float lse_log2, float sink) {
  const float t = sink * 1.4426950408889634f - lse_log2;
  if (t < -64.f) return {1.f, 0.f};
  const float gain = t > 0.f ? t + __log2f(1.f + fast_exp2(-t)) : __log2f(1.f + fast_exp2(t));
  return {fast_exp2(-gain), gain};
}

// The natural-log LSE of a row without keys: the sink's logit, +inf without a sink (-inf).
__device__ __forceinline__ float empty_row_lse(float sink) { return sink == -INFINITY ? INFINITY : sink; }

// The row's sink (natural log) for query head `head`: -inf without sinks.
__device__ __forceinline__ float head_sink(const float* sinks, int head) {
  return sinks == nullptr ? -INFINITY : sinks[head];
}

// Running row state of the online softmax for the 2*kMAtoms rows a thread owns.
// row_sum is kept per thread (partial over the thread's columns) and reduced over the
// quad only once, in finalize(): alpha is equal across the quad, so this is exact.
template <int kMAtoms, ExactForm kForm = ExactForm::kPrepass, RowOrder kOrder = RowOrder::kTogether>
struct OnlineSoftmax {
  static constexpr int kRows = 2 * kMAtoms;
  static_assert(kOrder == RowOrder::kTogether || kForm == ExactForm::kSecondLoop,
                "kPipelined computes the exact form in a second loop");
  float row_max[kRows];   // m: the max P is taken against (lags the true max by <= 8 / c, below)
  float row_sum[kRows];   // l: running sum of P (thread-partial)
  float true_max[kRows];  // the true running max of the raw scores, for the statistics
  bool exact_ = false;    // warp-uniform: some row's |m c| >= kExactLimit (P in the exact form)
  bool exact_row_[kRows] = {};  // kPipelined: the same per row index r (uniform over the warp's rows r)

  __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = true_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // A row's running max may lag its true max by up to this many log2 units (P <= 2^8): the
  // accumulator is rescaled only when some row of the warp (kPipelined: of the warp's rows of the
  // same index) grew by more (conditional rescaling, as in FlashAttention-4). Exact: P, l and O
  // all use the same (stale) max, and the final normalization and LSE use it too; P <= 256 keeps
  // bf16/fp16's relative precision.
  static constexpr float kRescaleThreshold = 8.f;

  // One K tile of masked raw scores S (FA2 Alg. 1 lines 9-10): m_new = max(m_old, rowmax(S));
  // P = exp2((S - m_new) * c) in place of S; l = alpha*l + rowsum(P); acc_o *= alpha with
  // alpha = exp2((m_old - m_new) * c). c = softmax_scale * log2(e) > 0.
  template <int kNAtoms, int kDAtoms>
  __device__ __forceinline__ void update(float (&s)[kMAtoms][kNAtoms][4], float (&acc_o)[kMAtoms][kDAtoms][4],
                                         float c) {
    rows(s, c, [&](int r, float alpha) {
#pragma unroll
      for (int di = 0; di < kDAtoms; ++di) {
        acc_o[r / 2][di][2 * (r % 2)] *= alpha;
        acc_o[r / 2][di][2 * (r % 2) + 1] *= alpha;
      }
    });
  }

  // The same step with the rescale of O deferred (for a kernel whose O += P V of the previous tile
  // is still in flight while this tile's softmax runs, sm90/flash_fwd_kernel.cuh): alpha[r] gets
  // row r's factor, 1 where it was not rescaled; returns whether any row was (warp-uniform), so
  // the caller applies rescale_o(acc_o, alpha) once the accumulator is its own again.
  // row_done(r): called once row r of s holds its P (all rows at the end in kTogether order; in
  // kPipelined inside the row's exponentiation block, so the caller's use of it, e.g. its conversion
  // to 16-bit A fragments, fills the next row's SFU gaps).
  template <int kNAtoms, typename RowDone = NoRowDone>
  __device__ __forceinline__ bool update_deferred(float (&s)[kMAtoms][kNAtoms][4], float c, float (&alpha)[kRows],
                                                  RowDone&& row_done = {}) {
    bool rescaled = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) alpha[r] = 1.f;
    rows(
        s, c,
        [&](int r, float a) {
          alpha[r] = a;
          rescaled = true;
        },
        row_done);
    return rescaled;
  }

  template <int kNAtoms, typename RescaleRow, typename RowDone = NoRowDone>
  __device__ __forceinline__ void rows(float (&s)[kMAtoms][kNAtoms][4], float c, RescaleRow&& rescale_row,
                                       RowDone&& row_done = {}) {
    if constexpr (kOrder == RowOrder::kPipelined) {
      update_rows_pipelined(s, c, rescale_row, row_done);
    } else {
      update_rows(s, c, rescale_row);
#pragma unroll
      for (int r = 0; r < kRows; ++r) row_done(r);
    }
  }

  template <int kDAtoms>
  __device__ __forceinline__ static void rescale_o(float (&acc_o)[kMAtoms][kDAtoms][4], const float (&alpha)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int di = 0; di < kDAtoms; ++di) {
        acc_o[r / 2][di][2 * (r % 2)] *= alpha[r];
        acc_o[r / 2][di][2 * (r % 2) + 1] *= alpha[r];
      }
    }
  }

  // The body of update(): rescale_row(r, alpha) multiplies row r of O by alpha (called only when
  // the warp rescales, inside the uniform branch).
  template <int kNAtoms, typename RescaleRow>
  __device__ __forceinline__ void update_rows(float (&s)[kMAtoms][kNAtoms][4], float c, RescaleRow&& rescale_row) {
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
        true_max[r] = fmaxf(true_max[r], tile_max[r]);
        // True when the max moved past the threshold, or from -inf to finite (-inf to -inf is
        // NaN > 8 = false: such a row's P is 0 whatever the max).
        grew |= (tile_max[r] - row_max[r]) * c > kRescaleThreshold;
      }
    }
    // Warp-uniform decision: the whole warp rescales (to the exact new max) or none of it does.
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        // -inf max (no visible key yet): subtract 0 so masked scores give exp2(-inf) = 0;
        // m_old = -inf gives alpha = 0 (row_sum and acc_o are 0 then anyway).
        const float m_new = (tile_max[r] == -INFINITY) ? 0.f : tile_max[r];
        const float alpha = fast_exp2((row_max[r] - m_new) * c);
        row_max[r] = tile_max[r];
        row_sum[r] *= alpha;
        rescale_row(r, alpha);
      }
      // The form of P follows the max: decided here, where the max changes, off the per-tile path.
      bool large = false;
#pragma unroll
      for (int r = 0; r < kRows; ++r) large |= fabsf(row_max[r] * c) >= kExactLimit && row_max[r] != -INFINITY;
      exact_ = __any_sync(0xffffffffu, large);
    }
    // P = exp2((S - m) c), one FFMA and the exp2 per score: fma(S, c, -(m c)) while every row of
    // the warp has |m c| < 2^10 (m c rounded: an error < 2^-14); else (a uniform branch, rare) the
    // exact round((S - m) c), in the form kForm says.
    auto exponentiate = [&](auto exact, bool m_zero) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) exponentiate_row<decltype(exact)::value>(s, r, c, m_zero);
    };
    if constexpr (kForm == ExactForm::kPrepass) {
      if (exact_) {  // S - m in place, rounded; the loop's fma(S - m, c, -0) is then round((S - m) c)
#pragma unroll
        for (int mi = 0; mi < kMAtoms; ++mi)
#pragma unroll
          for (int ni = 0; ni < kNAtoms; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float m = row_max[2 * mi + e / 2];
              s[mi][ni][e] = __fsub_rn(s[mi][ni][e], m == -INFINITY ? 0.f : m);
            }
      }
      exponentiate(std::false_type{}, exact_);
    } else if (exact_) {
      exponentiate(std::true_type{}, true);
    } else {
      exponentiate(std::false_type{}, false);
    }
  }

  // Row r's P = exp2((S - m) c) in place of its scores, and l += rowsum(P) (this thread's part):
  // kExact the rounded (S - m) c, else one FFMA S c - (m c) (m c = 0 where m_zero: S - m was
  // subtracted already, ExactForm::kPrepass).
  template <bool kExact, int kNAtoms>
  __device__ __forceinline__ void exponentiate_row(float (&s)[kMAtoms][kNAtoms][4], int r, float c, bool m_zero) {
    const int mi = r / 2, h = r % 2;
    const float m = (row_max[r] == -INFINITY) ? 0.f : row_max[r];
    const float m_scaled = m_zero ? 0.f : m * c;
    float sum = 0.f;
#pragma unroll
    for (int ni = 0; ni < kNAtoms; ++ni) {
#pragma unroll
      for (int e = 2 * h; e < 2 * h + 2; ++e) {
        s[mi][ni][e] = fast_exp2(kExact ? __fmul_rn(s[mi][ni][e] - m, c) : fmaf(s[mi][ni][e], c, -m_scaled));
        sum += s[mi][ni][e];
      }
    }
    row_sum[r] += sum;
  }

  // Row r's max over the thread's scores, from init (m_old): four independent FMNMX chains.
  template <int kNAtoms>
  __device__ __forceinline__ static float thread_row_max(const float (&s)[kMAtoms][kNAtoms][4], int r, float init) {
    const int mi = r / 2, e = 2 * (r % 2);
    float a[4] = {fmaxf(init, s[mi][0][e]), s[mi][0][e + 1], -INFINITY, -INFINITY};
    if constexpr (kNAtoms > 1) {
      a[2] = s[mi][1][e];
      a[3] = s[mi][1][e + 1];
    }
#pragma unroll
    for (int ni = 2; ni < kNAtoms; ++ni) {
      a[2 * (ni % 2)] = fmaxf(a[2 * (ni % 2)], s[mi][ni][e]);
      a[2 * (ni % 2) + 1] = fmaxf(a[2 * (ni % 2) + 1], s[mi][ni][e + 1]);
    }
    return fmaxf(fmaxf(a[0], a[1]), fmaxf(a[2], a[3]));
  }

  // update_rows in RowOrder::kPipelined: the same steps for each row index r on its own (rescale
  // and exact form decided over the warp's rows r), row r + 1's max inside row r's exponentials.
  template <int kNAtoms, typename RescaleRow, typename RowDone>
  __device__ __forceinline__ void update_rows_pipelined(float (&s)[kMAtoms][kNAtoms][4], float c,
                                                        RescaleRow&& rescale_row, RowDone&& row_done) {
    float next = quad_allreduce_max(thread_row_max(s, 0, row_max[0]));
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float tile_max = next;  // max(m_old, rowmax(S)) over the quad
      true_max[r] = fmaxf(true_max[r], tile_max);
      // As update_rows, for the warp's rows r: rescale to the new max when one of them grew past the
      // threshold (or from -inf to finite), and decide the form of P where the max changes.
      if (__any_sync(0xffffffffu, (tile_max - row_max[r]) * c > kRescaleThreshold)) {
        const float m_new = (tile_max == -INFINITY) ? 0.f : tile_max;
        const float alpha = fast_exp2((row_max[r] - m_new) * c);
        row_max[r] = tile_max;
        row_sum[r] *= alpha;
        rescale_row(r, alpha);
        exact_row_[r] = __any_sync(0xffffffffu, fabsf(row_max[r] * c) >= kExactLimit && row_max[r] != -INFINITY);
      }
      // P = exp2((S - m) c) of row r (the fast FFMA or, uniform branch, the exact form), and the
      // next row's max while the MUFU works through this one.
      auto exponentiate = [&](auto exact) {
        exponentiate_row<decltype(exact)::value>(s, r, c, false);
        row_done(r);
        if (r + 1 < kRows) next = quad_allreduce_max(thread_row_max(s, r + 1, row_max[r + 1]));
      };
      if (exact_row_[r]) {
        exponentiate(std::true_type{});
      } else {
        exponentiate(std::false_type{});
      }
    }
  }

  // FA2 Alg. 1 lines 12-13: O = acc_o / l (0 for a row with l == 0, i.e. no visible key), the
  // LSE's two parts in log2 units against the true row max M (max[r] = round(M c), log2sum[r] =
  // log2 l + (m - M) c, the sum as if taken against M; +inf and 0 when l == 0) and the natural-log
  // LSE = (m c + log2 l) ln 2 (+inf when l == 0). Row r's values are identical on the 4 lanes of
  // its quad. sink: the row's attention sink (natural log, flash.h: sinks_ptr; -inf: none), added
  // by sink_share: O and the LSE as the softmax over the keys and the sink, the max kept; a row
  // without keys gets LSE = sink (O 0, statistics +inf / 0 as without it).
  template <int kDAtoms>
  __device__ __forceinline__ void finalize(float (&acc_o)[kMAtoms][kDAtoms][4], float c, float sink, float (&lse)[kRows],
                                           float (&max)[kRows], float (&log2sum)[kRows]) {
#pragma unroll
    for (int mi = 0; mi < kMAtoms; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 2 * mi + h;
        const float l = quad_allreduce_sum(row_sum[r]);
        const bool empty = !(l > 0.f);  // also catches a NaN l, never producing NaN output
        const float log2_l = __log2f(l);
        const float lse_log2 = fmaf(row_max[r], c, log2_l);
        const SinkShare sh = empty ? SinkShare{1.f, 0.f} : sink_share(lse_log2, sink);
        const float inv_l = empty ? 0.f : sh.scale / l;
        max[r] = empty ? INFINITY : __fmul_rn(true_max[r], c);
        log2sum[r] = empty ? 0.f : fmaf(row_max[r] - true_max[r], c, log2_l) + sh.log2_gain;
        lse[r] = empty ? empty_row_lse(sink) : (lse_log2 + sh.log2_gain) * 0.69314718055994530942f;
#pragma unroll
        for (int di = 0; di < kDAtoms; ++di) {
          acc_o[mi][di][2 * h] *= inv_l;
          acc_o[mi][di][2 * h + 1] *= inv_l;
        }
      }
    }
  }
};

// Backward recompute of one probability (FA2 Alg. 2 line 12): P = exp2(S * scale_log2 - LSE_log2)
// with the row's LSE_log2 = hi + lo as the preprocess wrote it (flash.h: softmax_lse_log2/_lo).
// Three copies of a kernel's P loop, picked per tile by a uniform branch (with_p_mode):
//   kFast   tiles without masked pairs or large-magnitude rows (lo == 0 there): one FFMA and the
//           exp2; `visible` is ignored (true on such tiles).
//   kMasked the same for tiles crossing the causal diagonal, a sliding window's edge or the
//           seqlen_k edge: invisible -> 0 (`visible` from the kernel's mask: its kLocal twin
//           checks the window's left bound too, mask.cuh visible<kLocal>).
//   kExact  tiles holding a large-magnitude row: the scaled score rounded first (as the forward's
//           row max, hi = round(M c)), then hi and lo subtracted, so the max of a row gets exactly
//           2^-lo at any magnitude (ties included). A recomputed score is a sum in another order
//           than the forward's and may differ from it in its last bits, which at |hi| >> 2^10 are
//           whole log2 units: a score within that noise of the row max (kTieTolerance |hi|, 2-4
//           float32 ulps) counts as the max (x = 0), so no P exceeds 1 and a one-hot row stays
//           one-hot instead of turning 1 ulp of noise into exp2(-2^k) = 0. The price: a P within
//           that distance of the max errs by < 2^(2^-22 |hi|) - 1 (0.2 % at |hi| = 1e4, the point
//           where score rounding itself is that coarse). Invisible -> 0.
// Rows without keys have hi = +inf: P = 0 in every mode.
enum class PMode { kFast, kMasked, kExact };
constexpr float kTieTolerance = 1.f / (1 << 22);

template <PMode kMode>
__device__ __forceinline__ float recompute_p(float s, float scale_log2, float hi, float lo, bool visible) {
  if constexpr (kMode == PMode::kExact) {
    float x = __fsub_rn(__fmul_rn(s, scale_log2), hi);
    x = x > -kTieTolerance * fabsf(hi) ? 0.f : x;  // not fmaxf/fminf: a NaN score must stay NaN
    return fast_exp2(visible ? x - lo : -INFINITY);
  } else {
    const float x = fmaf(s, scale_log2, -hi);
    return fast_exp2(kMode == PMode::kFast || visible ? x : -INFINITY);
  }
}

// Calls f(std::integral_constant<PMode, mode>{}) for the tile's mode: kExact where the tile holds
// a large-magnitude row, else kMasked where it holds masked pairs, else kFast. Both flags must be
// uniform over the threads that share the tile (a branch, not a select).
template <typename F>
__device__ __forceinline__ void with_p_mode(bool precise, bool needs_mask, F&& f) {
  if (precise) {
    f(std::integral_constant<PMode, PMode::kExact>{});
  } else if (needs_mask) {
    f(std::integral_constant<PMode, PMode::kMasked>{});
  } else {
    f(std::integral_constant<PMode, PMode::kFast>{});
  }
}

}  // namespace flash
