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
// work out themselves: the U = b S units (CTAs) of one (kv head, row tile) go to the sequences by
// their keys, sequence b taking units [C_b, C_{b+1}) with
//   C_b = b + floor((U - b_count) P_b / W),   w_b = 1 + ceil(keys_b / 64),   P_b = sum_{b' < b} w_b',
// W = P_{b_count} (keys_b: the keys the sequence sees, at most a sliding window's span). Every
// sequence gets at least one unit and the rest go by keys (FA3 decides per-sequence split counts on
// the device too: its prepare-scheduler kernel); equal lengths give C_b = b S, the unbalanced grid
// exactly. A sequence's splits are capped at kMaxSplits (the combine's limit): its units past the
// cap run nothing. Split kernel and combine compute the same C_b from the same integers.
// Host condition (dispatch.cu: splitkv_balance): b > 1, a cache_seqlens tensor, num_splits > 1 and
// (U - b) W < 2^62 for every possible W.
struct SplitSlots {
  int first;  // accumulator slot of the row's split 0 (flash.h: oaccum_ptr's leading dimension)
  int step;   // slots between its consecutive splits: b_count unbalanced (slot = split b_count + b), 1 balanced
  int count;  // its splits
  __device__ __forceinline__ int slot(int s) const { return first + s * step; }
};

__device__ __forceinline__ int64_t balance_weight(const Flash_fwd_params& p, int bidb) {
  int keys = SeqInfo::kv_seqlen_k(p, bidb);
  if (p.window_left >= 0) keys = min(keys, p.window_left + p.seqlen_q);
  return 1 + (int64_t(keys) + 63) / 64;
}

// Every thread of the CTA (kThreads of them) calls it with the same arguments; it returns (b, C_b,
// C_{b+1}) of the sequence b that owns `unit` (unit >= 0), or of sequence `bidb` (unit < 0).
// s_warp: kThreads / 32 int64 of shared memory, s_found one int3.
template <int kThreads>
__device__ __forceinline__ int3 balanced_units(const Flash_fwd_params& p, const int unit, const int bidb,
                                               int64_t* s_warp, int3* s_found, const int tid) {
  constexpr int kWarps = kThreads / 32;
  const int warp = tid / 32, lane = tid % 32;
  const int per = (p.b + kThreads - 1) / kThreads;  // this thread's sequences [b0, b1)
  const int b0 = min(tid * per, p.b), b1 = min(b0 + per, p.b);
  int64_t mine = 0;
  for (int b = b0; b < b1; ++b) mine += balance_weight(p, b);
  // Exclusive prefix of `mine` over the CTA (warp shuffles, then the warps' totals in order).
  int64_t incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int64_t y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  int64_t prefix = incl - mine, total = 0;
#pragma unroll
  for (int v = 0; v < kWarps; ++v) {
    const int64_t t = s_warp[v];
    if (v < warp) prefix += t;
    total += t;
  }
  const int64_t extra = int64_t(p.b) * (p.num_splits - 1);  // U - b_count
  for (int b = b0; b < b1; ++b) {
    const int lo = b + int(extra * prefix / total);
    prefix += balance_weight(p, b);
    const int hi = b + 1 + int(extra * prefix / total);
    if (unit >= 0 ? (lo <= unit && unit < hi) : b == bidb) *s_found = make_int3(b, lo, hi);
  }
  __syncthreads();
  return *s_found;
}

template <int kBlockM, int kBlockN>
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
  __device__ __forceinline__ SplitKvWork(const Flash_fwd_params& p, int4 c, SplitSlots sl)
      : seq(p, c.x), mask(seq, p), kv(p, c.x) {
    bidhk = c.y;
    ratio = p.h_h_k_ratio;
    split = c.w;
    slots = sl;
    num_splits = sl.count;
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
  // decode()'s coordinates with blockIdx.x's unit resolved (balanced splits: every thread of the
  // CTA calls it; unit_empty: a unit past its sequence's kMaxSplits cap, which runs nothing), and
  // the slots of the row's partials.
  template <int kThreads>
  __device__ __forceinline__ static int4 resolve(const Flash_fwd_params& p, int4 c, SplitSlots& sl, bool& unit_empty,
                                                 int64_t* s_warp, int3* s_found, int tid) {
    unit_empty = false;
    if (!p.balance_splits) {
      sl = SplitSlots{c.x, p.b, p.num_splits};
      return c;
    }
    const int unit = c.x * p.num_splits + c.w;
    const int3 r = balanced_units<kThreads>(p, unit, -1, s_warp, s_found, tid);
    sl = SplitSlots{r.y, 1, min(r.z - r.y, kMaxSplits)};
    unit_empty = unit - r.y >= sl.count;
    return make_int4(r.x, c.y, c.z, unit - r.y);
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
  // times d_rounded for O (flash.h: softmax_lseaccum_ptr, oaccum_ptr); this split's slot.
  __device__ __forceinline__ int64_t accum_row(const Flash_fwd_params& p, int r) const {
    return (int64_t(slots.slot(split)) * p.h + head(r)) * p.seqlen_q + query(r);
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
