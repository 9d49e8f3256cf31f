// FlashDecoding's split count from shapes alone (host arithmetic, no device sync: a decode step
// stays CUDA-graph capturable), for a split-KV tile row of block_n keys per tile, smem_bytes of
// shared memory and at most min_blocks CTAs per SM. dispatch.cu's num_splits_heuristic calls it
// with the production row (sm80/tile_config.h: SplitKvTile); the tuning harness
// (benchmarks/tune_kernels.cu) with the row it times. Host only; no CUDA or torch headers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "flash.h"

namespace flash {

// Shared memory per SM that blocks can use, by compute capability (CUDA C Programming Guide,
// "Technical Specifications per Compute Capability"); a conservative 100 KB for unknown ones.
inline int splitkv_smem_per_sm(int arch) {
  switch (arch) {
    case 80: case 87: return 164 * 1024;
    case 90: case 100: case 103: return 228 * 1024;
    default: return 100 * 1024;
  }
}

// A "slot" is a CTA the GPU runs at once: num_sms x CTAs per SM (by shared memory, 1 KB per CTA
// reserved by the runtime, at most the row's min_blocks). The kernel streams K and V, and an SM's
// CTAs share what that SM can load, so with T = ctas * s CTAs (s splits) the efficiency of s is
//   T <= num_sms:           T / num_sms                      (SMs without a CTA idle)
//   num_sms < T <= slots:   T / (num_sms * ceil(T / num_sms)) (one round: an SM with one CTA more
//                                                              than another finishes later)
//   T > slots:              rounds / ceil(rounds), rounds = T / slots (a last, partial round)
// and the choice is the smallest s within 5 % of the best over [1, max_splits] (FA2's rule,
// tighter), 1 outright when the unsplit grid is >= 2 rounds (its tail is small). Splitting costs
// on its own (a split's prologue and drain, the partials, the combine): H200, hd128 GQA 32:8, one
// query (tune_kernels.py, 2026-12-03, 12 split counts): B32 x Nk 8k ran 4.20 TB/s unsplit (256 CTAs
// on 132 SMs) against 4.09 at the 3 splits the slots-only rule chose, B16 8k 3.94 against 3.83,
// B8 8k 3.36 at 2 splits (128 CTAs) against 3.27 at 3 (192: one CTA on some SMs, two on others),
// B128 8k 4.45 unsplit against 4.36 at 3; B64 (512 CTAs, 1.3 rounds unsplit) 4.09 unsplit, 4.27-4.30
// at 2-4 splits.
// A paged cache whose pages are shorter than a key tile is loaded in boxes of a page's rows,
// several per tile, and one CTA per SM no longer draws that SM's share of the bandwidth (page 16:
// B1 Nk 128k at 16 splits 2.67 TB/s against 3.86 contiguous; B8 32k at 2 splits and B16 8k unsplit
// 0.65-0.67 of contiguous): there every T counts in rounds of slots, 1 outright from 4 rounds,
// which fills every slot (48 / 6 / 3 splits there: 0.93-0.96 of contiguous).
// max_splits: kMaxSplits, the key tiles of the longest possible sequence (params.seqlen_k, or a
// sliding window's span: more splits get no keys), and >= 8 key tiles per split (a split's
// prologue, merge and the combine must pay for themselves: B1 Nk 8k ran at 1.57 TB/s with 48
// splits of 2-3 tiles, 1.67 with 16 of 8). docs/PERF_NOTES.md has the sweeps.
// One row for every grid: a smaller sm_90 row (32-key tiles, two warps, four CTAs per SM) that ran
// the grids filling 95-100 % of its slots unsplit in one round (B64 x GQA 8 kv heads) was 0.7 %
// faster on full caches at Nk 8k, 0.4 % slower at 32k, and 11-16 % slower on caches half full on
// average (ragged: a one-round grid cannot even out the lengths; H200, CUDA graph replays,
// 2026-12-06, docs/PERF_NOTES.md), so it was removed.
// CTAs of the unsplit grid (sequence, kv head, 16-row packed tile), and the GPU's CTA slots.
inline int64_t splitkv_unsplit_ctas(const Flash_fwd_params& params) {
  const int64_t ratio = std::max(params.h / std::max(params.h_k, 1), 1);
  return int64_t(params.b) * params.h_k * ((int64_t(params.seqlen_q) * ratio + 15) / 16);
}
inline int64_t splitkv_slots(const Flash_fwd_params& params, int smem_bytes, int min_blocks) {
  const int per_sm = std::max(1, std::min(min_blocks, splitkv_smem_per_sm(params.arch) / (smem_bytes + 1024)));
  return int64_t(params.num_sms) * per_sm;
}

// The keys one row tile visits: the cache's capacity, or a sliding window's: its left bound plus
// the span of the tile's queries (its 16 packed rows hold at most 16 queries; all of them where
// the right side is unbounded) and the right bound (causal: 0), and a key tile of misalignment on
// each side.
inline int64_t splitkv_row_keys(const Flash_fwd_params& params, int block_n) {
  int64_t keys = params.seqlen_k;
  if (params.window_left >= 0) {
    const bool right_bounded = params.is_causal || params.window_right >= 0;
    const int64_t right = params.is_causal ? 0 : params.window_right;
    const int64_t span = right_bounded ? std::min<int64_t>(params.seqlen_q, 16) + right : params.seqlen_q;
    keys = std::min<int64_t>(keys, int64_t(params.window_left) + span + 2 * block_n);
  }
  return keys;
}

// The fewest splits that keep every fp32 accumulator of the split kernel within the forward's
// long-row bound (flash.h: kLongRowKeys; kernels/common/long_rows.cuh: the tensor cores' additions
// round toward zero, past ~2^20 keys more error than bf16's): its kWarps warps each accumulate
// 1 / kWarps of every key tile, so a split of S keys puts S / kWarps keys into one accumulator, and
// splits of at most kWarps * kLongRowKeys keys keep those below the bound. 1 for caches of up to
// 2^20 keys (at 4 warps); at most kMaxSplits (caches of up to 2^27 keys).
inline int splitkv_long_rows_min_splits(const Flash_fwd_params& params, int block_n, int warps) {
  const int64_t per_split = int64_t(warps) * kLongRowKeys;
  const int64_t splits = (splitkv_row_keys(params, block_n) + per_split - 1) / per_split;
  return int(std::min<int64_t>(kMaxSplits, std::max<int64_t>(1, splits)));
}

inline int num_splits_by_occupancy(const Flash_fwd_params& params, int block_n, int smem_bytes, int min_blocks) {
  if (params.b <= 0 || params.h_k <= 0 || params.seqlen_q <= 0 || params.num_sms <= 0) return 1;
  const int64_t ctas = splitkv_unsplit_ctas(params);
  const int64_t slots = splitkv_slots(params, smem_bytes, min_blocks);
  // Pages shorter than a key tile: several boxes per tile, so fill the slots (see above).
  const bool small_pages = params.block_table != nullptr && params.page_size < block_n;
  if (ctas >= (small_pages ? 4 : 2) * slots) return 1;
  const int64_t key_tiles = (splitkv_row_keys(params, block_n) + block_n - 1) / block_n;
  const int64_t max_splits =
      std::max<int64_t>(1, std::min<int64_t>({kMaxSplits, key_tiles / 8}));
  const int64_t sms = params.num_sms;
  const auto efficiency = [&](int64_t s) {
    const int64_t t = ctas * s;
    if (!small_pages && t <= sms) return double(t) / double(sms);
    if (!small_pages && t <= slots) return double(t) / double(sms * ((t + sms - 1) / sms));
    const double rounds = double(t) / double(slots);
    return rounds / std::ceil(rounds);
  };
  double best = 0.0;
  for (int64_t s = 1; s <= max_splits; ++s) best = std::max(best, efficiency(s));
  for (int64_t s = 1; s <= max_splits; ++s) {
    if (efficiency(s) >= 0.95 * best) return int(s);
  }
  return 1;
}

// The split count of a row of `warps` warps: the occupancy rule's, at least
// splitkv_long_rows_min_splits.
inline int num_splits_for_row(const Flash_fwd_params& params, int block_n, int smem_bytes, int min_blocks, int warps) {
  return std::max(num_splits_by_occupancy(params, block_n, smem_bytes, min_blocks),
                  splitkv_long_rows_min_splits(params, block_n, warps));
}

// The balanced splits' units per sequence (common/splitkv_work.cuh; dispatch.cu:
// plan_kvcache_splits) of a KV-cache call whose sequences may differ in length (cache_seqlens, b >
// 1), for grid factor `factor` (FLASH_ATTN_EXT_SPLITKV_BALANCE) and the count `equal` the shapes
// give a full cache, or the caller's `requested` > 0 as is; 0 where the call is not balanced:
// factor 0, no cache_seqlens, one sequence (or more than 2^16), the split kernel's twins with a
// window's left bound, softcap or ALiBi (the balanced twin is the plain one), and grids of more
// than one CTA per SM unsplit (a prefill chunk through the KV-cache call: the occupancy rule's 1
// outright, the hardware evens the CTAs out, and the accumulators would be large; at B32 Nk 8k,
// hd128 GQA 32:8, 1.9 CTAs per SM, the balanced grid ran full caches 4.6 % and caches half full on
// average 2.3 % slower, H100, docs/PERF_NOTES.md, thirty-fourth session). A full cache's split
// keeps >= 8 tiles of 64 keys, as the heuristic's rule.
inline int balanced_splits_units(const Flash_fwd_params& params, int equal, int requested, int factor) {
  if (factor == 0 || params.cache_seqlens == nullptr || params.b < 2 || params.b > (1 << 16) ||
      params.window_left >= 0 || params.softcap > 0.f || params.alibi_slopes_ptr != nullptr ||
      splitkv_unsplit_ctas(params) > int64_t(params.num_sms)) {
    return 0;
  }
  const int64_t max_units = std::min<int64_t>(kMaxSplits, std::max<int64_t>(equal, int64_t(params.seqlen_k) / 512));
  const int64_t units = requested > 0 ? requested : std::min<int64_t>(max_units, std::max(2, factor * equal));
  return units >= 2 ? int(units) : 0;
}

}  // namespace flash
