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

template <int kBlockM, int kBlockN>
struct SplitKvWork {
  SeqInfo seq;      // seqlen_k: the keys this sequence sees (cache_seqlens[b] + seqlen_knew, capped; less a leftpad)
  AttnMask mask;    // causal / window: bottom-right aligned against seq.seqlen_k
  KvCacheRows kv;   // where its key rows live (contiguous or paged)
  int bidhk, ratio, split, num_splits;
  int m0;           // first packed row of the tile
  int rows;         // packed rows of the sequence, R = seqlen_q * ratio
  int n_begin, n_end;    // key tiles [n_begin, n_end) of this split (empty: n_begin >= n_end)
  int n_block_unmasked_lo, n_block_unmasked;  // key tiles [lo, n_block_unmasked) are visible to every row of the tile

  // blockIdx.x = ((bidb * h_k + bidhk) * row_tiles + m_block) * num_splits + split: the splits
  // of one (sequence, kv head, row tile) are neighbours.
  __device__ __forceinline__ explicit SplitKvWork(const Flash_fwd_params& p) : SplitKvWork(p, decode(p)) {}
  __device__ __forceinline__ SplitKvWork(const Flash_fwd_params& p, int4 c)
      : seq(p, c.x), mask(seq, p), kv(p, c.x) {
    bidhk = c.y;
    ratio = p.h_h_k_ratio;
    split = c.w;
    num_splits = p.num_splits;
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

  // Row r of the split accumulators, (num_splits, b, h, seqlen_q) for the LSE and the same times
  // d_rounded for O (flash.h: softmax_lseaccum_ptr, oaccum_ptr).
  __device__ __forceinline__ int64_t accum_row(const Flash_fwd_params& p, int r) const {
    return ((int64_t(split) * p.b + seq.bidb) * p.h + head(r)) * p.seqlen_q + query(r);
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
