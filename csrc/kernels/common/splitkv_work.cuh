// The work of one CTA of the split-KV forward (FlashDecoding; the KV-cache op), for every arch
// path: which (sequence, kv head, packed row tile, split) blockIdx.x stands for, the rows it owns,
// and the key tiles it visits (FlashAttention-2, Dao 2023, Alg. 1's loop over K/V blocks, cut
// into num_splits contiguous ranges whose partial results common/combine_kernel.cuh merges).
//
// GQA packing: the ratio = h / h_k query heads of kv head bidhk and the seqlen_q queries form
// R = seqlen_q * ratio packed rows, r = i * ratio + g for query i of head bidhk * ratio + g; a
// CTA owns rows [m0, m0 + kBlockM). Every row of the CTA reads the same K/V head, so K/V are
// read once per (sequence, kv head, row tile, split) instead of once per query head.
#pragma once

#include <climits>

#include "flash.h"
#include "kernels/common/mask.cuh"
#include "kernels/common/paged_kv.cuh"
#include "kernels/common/seqlen.cuh"
#include "primitives/cp_async.cuh"

namespace flash {

// ---- Balanced splits (Flash_fwd_params::balance_splits; KV caches whose sequences may differ in
// length). With num_splits = S splits of every sequence, a sequence with twice the keys has CTAs
// twice as long, and a grid of one round waits for its longest sequence (a batch whose
// cache_seqlens spread evenly over [0, Nk] ran 26 % below a full one at B8 Nk 32k, H100,
// docs/PERF_NOTES.md). The host cannot read cache_seqlens without a sync, so the CTAs share the
// work out themselves: the U = b num_splits units (CTAs) of one (kv head, row tile) go to the
// sequences as contiguous key ranges of at most T tiles of 64 keys, T the smallest threshold that
// needs no more than U units (the minimal largest unit of any contiguous cut with <= U pieces):
//   n_b = min(ceil(w_b / T), kMaxSplits),  sum_b n_b <= U,  w_b = ceil(keys_b / 64)
// (keys_b: the keys sequence b sees, at most a sliding window's span; the cap is the combine's
// limit), and sequence b takes units [C_b, C_b + n_b), C_b = sum_{b' < b} n_b'. Units past the
// last run nothing; so does a sequence without keys (n_b = 0: the combine writes its zeros). T lies
// in [ceil(W / U), ceil(2 W / U)] (W = sum w_b; at the top sum n_b <= W / T + b <= U / 2 + b <= U
// for num_splits >= 2): a binary search over it, each warp on its own (shuffles only, no shared
// memory or barrier), in the split kernel and in the combine alike, from the same integers. Equal lengths
// take the unbalanced grid of params.splits_equal splits each (the count the shapes give a full
// cache; the host makes the grid larger, num_splits >= splits_equal, for ragged batches to
// balance over) without the search, its units past that grid idle: a full cache costs one pass
// over cache_seqlens (H100: the search on full caches cost 0.5-2 %). A sequence whose count is 1
// writes its output itself (no partial); the combine skips it.
// FA3 also picks per-sequence split counts on the device (its prepare-scheduler kernel).
// Host condition (dispatch.cu: plan_kvcache_splits): b > 1, a cache_seqlens tensor, num_splits > 1,
// b <= 2^16 (the counts' sums in 32 bits).
struct SplitSlots {
  int first;  // accumulator slot of the row's split 0 (flash.h: oaccum_ptr's leading dimension)
  int step;   // slots between its consecutive splits: b_count unbalanced (slot = split b_count + b), 1 balanced
  int count;  // its splits
  // The accumulator row of split `split` of the row at `r` within a slot of `slot_rows` = h *
  // seqlen_q rows, and the rows between consecutive splits: the one address rule of the split
  // kernel's stores and the combine's loads.
  __device__ __forceinline__ int64_t stride(int64_t slot_rows) const { return int64_t(step) * slot_rows; }
  __device__ __forceinline__ int64_t row(int split, int64_t slot_rows, int64_t r) const {
    return int64_t(first) * slot_rows + split * stride(slot_rows) + r;
  }
};

// w_b: the 64-key tiles sequence b sees, and n_b for threshold t.
__device__ __forceinline__ int balance_tiles(const Flash_fwd_params& p, int bidb) {
  int keys = SeqInfo::kv_seqlen_k(p, bidb);
  if (p.window_left >= 0) keys = min(keys, p.window_left + p.seqlen_q);
  return (keys + 63) / 64;
}
__device__ __forceinline__ int balance_count(int w, int t) { return min((w + t - 1) / t, kMaxSplits); }

// The sequence a unit stands for, its split and the slots of that sequence's partials
// (bidb = -1: a unit no sequence has).
struct BalancedUnit {
  int bidb, split;
  SplitSlots slots;
};

// Every lane of a full warp calls it with the same arguments: the sequence owning `unit` (unit >=
// 0: blockIdx.x's sequence * num_splits + split) or sequence `bidb`'s slots (unit < 0). Equal
// lengths (every w_b the same, the benchmark's full caches) take the unbalanced grid itself, slots
// and all, after one pass.
__device__ __forceinline__ BalancedUnit balanced_units(const Flash_fwd_params& p, const int unit, const int bidb) {
  const int lane = threadIdx.x % 32;
  const int units = p.b * p.num_splits;
  int64_t total = 0;  // W
  int w_min = INT_MAX, w_max = 0;
  for (int b = lane; b < p.b; b += 32) {
    const int w = balance_tiles(p, b);
    total += w, w_min = min(w_min, w), w_max = max(w_max, w);
  }
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) {
    total += __shfl_xor_sync(0xffffffffu, total, o);
    w_min = min(w_min, __shfl_xor_sync(0xffffffffu, w_min, o));
    w_max = max(w_max, __shfl_xor_sync(0xffffffffu, w_max, o));
  }
  if (w_min == w_max) {  // equal lengths (no keys at all included): the unbalanced grid of splits_equal
    const int se = p.splits_equal;
    if (unit >= p.b * se) return BalancedUnit{-1, 0, SplitSlots{0, 1, 0}};
    const int b = unit >= 0 ? unit / se : bidb;
    return BalancedUnit{b, unit >= 0 ? unit % se : 0, SplitSlots{b, p.b, se}};
  }
  // sum_b n_b for threshold t, over the warp.
  const auto units_for = [&](int t) {
    int n = 0;
    for (int b = lane; b < p.b; b += 32) n += balance_count(balance_tiles(p, b), t);
#pragma unroll
    for (int o = 16; o >= 1; o /= 2) n += __shfl_xor_sync(0xffffffffu, n, o);
    return n;
  };
  int lo = int((total + units - 1) / units), hi = int((2 * total + units - 1) / units);
  if (units_for(lo) <= units) hi = lo;
  while (lo < hi) {  // units_for(hi) <= units throughout
    const int mid = lo + (hi - lo) / 2;
    if (units_for(mid) <= units) hi = mid; else lo = mid + 1;
  }
  // C_b: the counts' exclusive prefix in sequence order, 32 sequences at a time.
  int base = 0;
  for (int b0 = 0; b0 < p.b; b0 += 32) {
    const int b = b0 + lane;
    const int n = b < p.b ? balance_count(balance_tiles(p, b), lo) : 0;
    int incl = n;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    const int first = base + incl - n;
    const bool mine = b < p.b && (unit >= 0 ? first <= unit && unit < first + n : b == bidb);
    const unsigned hit = __ballot_sync(0xffffffffu, mine);
    if (hit != 0) {
      const int src = __ffs(hit) - 1;
      const int c = __shfl_sync(0xffffffffu, first, src);
      return BalancedUnit{b0 + src, unit - c, SplitSlots{c, 1, __shfl_sync(0xffffffffu, n, src)}};
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  return BalancedUnit{-1, 0, SplitSlots{0, 1, 0}};  // a unit past the last sequence's
}

// kBalanced: the balanced splits' twin (its own kernel instantiation, so the default kernels keep
// their code); the slots then come from balanced_units.
template <int kBlockM, int kBlockN, bool kBalanced = false>
struct SplitKvWork {
  SeqInfo seq;      // seqlen_k: the keys this sequence sees (cache_seqlens[b] + seqlen_knew, capped; less a leftpad)
  AttnMask mask;    // causal / window: bottom-right aligned against seq.seqlen_k
  KvCacheRows kv;   // where its key rows live (contiguous or paged)
  int bidhk, ratio, split, num_splits;
  SplitSlots slots;  // where the row's splits' partials go (num_splits = slots.count)
  int m0;           // first packed row of the tile
  int rows;         // packed rows of the sequence, R = seqlen_q * ratio
  int n_begin, n_end;    // key tiles [n_begin, n_end) of this split (empty: n_begin >= n_end)
  int n_block_unmasked_lo, n_block_unmasked;  // key tiles [lo, n_block_unmasked) are visible to every row of the tile

  // blockIdx.x = ((bidb * h_k + bidhk) * row_tiles + m_block) * num_splits + split: the splits
  // of one (sequence, kv head, row tile) are neighbours.
  // Balanced splits (above): blockIdx.x's (sequence, split) pair names unit sequence * num_splits +
  // split of its (kv head, row tile) instead, resolve() finds the sequence and split that own it.
  __device__ __forceinline__ SplitKvWork(const Flash_fwd_params& p, int4 c, SplitSlots sl = {})
      : seq(p, c.x), mask(seq, p), kv(p, c.x) {
    bidhk = c.y;
    ratio = p.h_h_k_ratio;
    split = c.w;
    // Plain splits: split s of sequence b in slot s b_count + b (flash.h: oaccum_ptr).
    slots = kBalanced ? sl : SplitSlots{c.x, p.b, p.num_splits};
    num_splits = slots.count;
    m0 = c.z * kBlockM;
    rows = seq.seqlen_q * ratio;
    // Key tiles some valid row of the tile sees: from the key start of its first query to the
    // key limit of its last (the visible keys of a row are an interval, both ends later for later
    // queries; the start is 0 without a sliding window).
    const int q_last = query(min(m0 + kBlockM, rows) - 1);
    const int limit_last = mask.key_limit(q_last);
    const int n_block_max = limit_last <= 0 ? 0 : ceil_div(limit_last, kBlockN);
    const int n_block_min = min(mask.key_start(query(m0)) / kBlockN, n_block_max);
    // Split s gets tiles n_block_min + [s n / S, (s + 1) n / S) of the n = n_block_max -
    // n_block_min: sizes differ by at most one tile, and every split has work while n >= S.
    const int n = n_block_max - n_block_min;
    n_begin = n_block_min + split_first_tile(split, num_splits, n);
    n_end = n_block_min + split_first_tile(split + 1, num_splits, n);
    n_block_unmasked = max(mask.key_limit(query(m0)), 0) / kBlockN;
    n_block_unmasked_lo = ceil_div(mask.key_start(q_last), kBlockN);  // 0 without a left bound
  }
  // kBalanced: decode()'s coordinates with blockIdx.x's unit resolved (every lane of a full warp
  // calls it; unit_empty: a unit no sequence has, which runs nothing), and the slots of the row's
  // partials.
  __device__ __forceinline__ static int4 resolve(const Flash_fwd_params& p, int4 c, SplitSlots& sl, bool& unit_empty) {
    const BalancedUnit r = balanced_units(p, c.x * p.num_splits + c.w, -1);
    sl = r.slots;
    unit_empty = r.bidb < 0;
    return make_int4(max(r.bidb, 0), c.y, c.z, r.split);
  }

  // The first of split s's tiles among n tiles cut into num_splits ranges (s = num_splits: n).
  __device__ __forceinline__ static int split_first_tile(int s, int num_splits, int n) {
    return int(int64_t(s) * n / num_splits);
  }
  __device__ __forceinline__ static int4 decode(const Flash_fwd_params& p) {
    const int row_tiles = num_row_tiles(p);
    const int64_t x = blockIdx.x;
    const int split = int(x % p.num_splits);
    const int64_t t = x / p.num_splits;
    const int m_block = int(t % row_tiles);
    const int64_t bh = t / row_tiles;
    return make_int4(int(bh / p.h_k), int(bh % p.h_k), m_block, split);
  }

  __host__ __device__ __forceinline__ static int num_row_tiles(const Flash_fwd_params& p) {
    return ceil_div(p.seqlen_q * p.h_h_k_ratio, kBlockM);
  }
  // The grid: every (sequence, kv head, packed row tile, split).
  __host__ __device__ __forceinline__ static int64_t grid_size(const Flash_fwd_params& p) {
    return int64_t(p.b) * p.h_k * num_row_tiles(p) * p.num_splits;
  }

  // Packed row r: query r / ratio of query head bidhk * ratio + r % ratio.
  __device__ __forceinline__ int query(int r) const { return r / ratio; }
  __device__ __forceinline__ int head(int r) const { return bidhk * ratio + r % ratio; }
  // kLeft = false: the right bound and seqlen_k only (the kernel's twin without a left bound).
  template <bool kLeft>
  __device__ __forceinline__ bool tile_needs_mask(int n_block) const {
    return n_block >= n_block_unmasked || (kLeft && n_block < n_block_unmasked_lo);
  }

  // Row r of the split accumulators, (num_splits * b slots, h, seqlen_q) for the LSE and the same
  // times d_rounded for O (flash.h: softmax_lseaccum_ptr, oaccum_ptr), in this split's slot.
  __device__ __forceinline__ int64_t accum_row(const Flash_fwd_params& p, int r) const {
    return slots.row(split, int64_t(p.h) * p.seqlen_q, int64_t(head(r)) * p.seqlen_q + query(r));
  }

  // cp.async of the tile's packed Q rows into the shared tile at sQ (Layout: the kernel's shared
  // layout, primitives/tile_copy.cuh); rows >= R and columns >= d zero-filled. 16 B per copy.
  template <typename Element, typename Layout, int kHeadDim, int kThreads>
  __device__ __forceinline__ void copy_q_tile_async(const Flash_fwd_params& p, uint32_t sQ, int tid) const {
    constexpr int kChunksPerRow = kHeadDim / 8, kChunks = kBlockM * kChunksPerRow;
#pragma unroll
    for (int it = 0; it < (kChunks + kThreads - 1) / kThreads; ++it) {
      const int c = it * kThreads + tid;
      if (kChunks % kThreads == 0 || c < kChunks) {
        const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8, r = m0 + row;
        const bool pred = r < rows && col < p.d;
        const Element* src = pred ? seq.template q_row<const Element>(p.q, head(r), query(r)) + col
                                  : static_cast<const Element*>(p.q.ptr);
        cp_async_16(sQ + Layout::offset(row, col), src, pred);
      }
    }
  }
};

}  // namespace flash
