// Where key row j of sequence b lives in a KV cache, for the KV-cache kernels of every arch path
// (the split-KV forward's K/V tile copies, the append of new keys). flash.h:
//   contiguous  (batch, seqlen_k, h_k, d): row leftpad_k[b] + j of batch b (flash.h; 0 without)
//   paged       (num_blocks, page_size, h_k, d): row j % page_size of block
//               block_table[b * block_table_batch_stride + j / page_size]
// Both end in one pointer formula, ptr + block * batch_stride + head * head_stride + row *
// row_stride, so the copies have one code path. Page sizes are multiples of 16 and tiles start at
// multiples of 16, so an aligned group of 16 rows never straddles two pages: the tile copy looks
// a page up once per group a thread touches (a cached int load), not once per row.
// A table entry outside [0, num_blocks) is never dereferenced: its rows read as zeros and are
// not written (memory safety; the API cannot check the table without a device sync).
#pragma once

#include <cstdint>
#include <numeric>

#include "flash.h"
#include "kernels/common/seqlen.cuh"
#include "primitives/barrier.cuh"
#include "primitives/cp_async.cuh"
#include "primitives/tma.cuh"

namespace flash {

// The K and V caches' tensor maps for the TMA copies (one __grid_constant__ kernel parameter):
// a contiguous cache as (d, seqlen_k, h_k, batch), a paged one as (d, page_size, h_k,
// num_blocks), boxes of (64 columns, box_rows rows); unused by the cp.async copies.
struct KvTmaMaps {
  CUtensorMap k, v;
  int box_rows;
};

// Host: encodes `maps` for tiles of kv_rows rows (the kernel's kBlockN); false if TMA cannot
// describe the caches (the caller then runs the cp.async copies).
inline bool encode_kv_tma_maps(KvTmaMaps& maps, const Flash_fwd_params& p, int kv_rows) {
  const bool paged = p.block_table != nullptr;
  const int batch = paged ? p.num_blocks : p.b, rows = paged ? p.page_size : p.seqlen_k;
  const int box = paged ? std::gcd(p.page_size, kv_rows) : kv_rows;
  maps.box_rows = box;
  // L2 promotion of 128 bytes, the box row itself: 256 (the other maps' setting) fetches the row's
  // other 64-column half with it, which its own box then re-reads (H200 decode: 0-7 % slower).
  constexpr CUtensorMapL2promotion kPromotion = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
  return box >= 8 && box % 8 == 0 && tma_encode_bshd(&maps.k, p.k, batch, rows, p.h_k, p.d, p.is_bf16, box, kPromotion) &&
         tma_encode_bshd(&maps.v, p.v, batch, rows, p.h_k, p.d, p.is_bf16, box, kPromotion);
}

struct KvCacheRows {
  const int* table;  // this sequence's block_table row; null: contiguous cache
  int bidb, page_size, page_shift, num_blocks;  // page_shift: log2(page_size), -1 if not a power of 2
  int row0;          // contiguous: the cache row of key 0 (flash.h: leftpad_k; SeqInfo::kv_leftpad)

  __device__ __forceinline__ KvCacheRows(const Flash_fwd_params& p, int bidb_) : bidb(bidb_) {
    table = p.block_table == nullptr ? nullptr : p.block_table + bidb_ * p.block_table_batch_stride;
    page_size = p.page_size;
    num_blocks = p.num_blocks;
    page_shift = (page_size > 0 && (page_size & (page_size - 1)) == 0) ? __ffs(page_size) - 1 : -1;
    row0 = p.leftpad_k == nullptr || table != nullptr ? 0
                                                      : SeqInfo::kv_leftpad(p, bidb_, SeqInfo::kv_used_rows(p, bidb_));
  }

  // (block, row inside the block) of key row j >= 0 (the sequence's j-th visible key); block -1 for
  // an invalid table entry.
  __device__ __forceinline__ int2 locate(int j) const { return locate_cache_row(row0 + j); }

  // The same for cache row r (the append's destinations: cache_seqlens[b] + i, leftpad or not).
  __device__ __forceinline__ int2 locate_cache_row(int r) const {
    if (table == nullptr) return make_int2(bidb, r);
    const int page = page_shift >= 0 ? r >> page_shift : r / page_size;
    const int block = __ldg(table + page);
    return make_int2(unsigned(block) < unsigned(num_blocks) ? block : -1, r - page * page_size);
  }

  // Row `loc` (from locate, block >= 0) of kv head `head` of a cache tensor (k or v).
  template <typename Element>
  __device__ __forceinline__ static Element* row_ptr(const TensorView& t, int head, int2 loc) {
    return static_cast<Element*>(t.ptr) + int64_t(loc.x) * t.batch_stride + int64_t(head) * t.head_stride +
           int64_t(loc.y) * t.row_stride;
  }

  // cp.async of key rows [n0, n0 + kRows) of kv head `head` of the K and V caches into the shared
  // tiles at sK / sV (Layout: the kernel's shared layout, primitives/tile_copy.cuh), 16 bytes per
  // copy, the whole CTA issuing. Rows >= rows_valid (past the sequence's visible keys), rows of an
  // invalid block and columns >= d_valid are zero-filled (cp.async src-size 0), so they give exact
  // zeros in Q K^T and P V whatever the cache holds there (e.g. NaN). n0: a multiple of 16 with
  // rows_valid > 0 (row n0 is a visible key); no table entry past the visible rows is read.
  // policy: the reads' L2 priority (primitives/cp_async.cuh: l2_policy_stream).
  template <typename Layout, int kRows, int kCols, int kThreads, typename Element>
  __device__ __forceinline__ void copy_kv_tiles_async(uint32_t sK, uint32_t sV, const Flash_fwd_params& p, int head,
                                                      int n0, int rows_valid, int d_valid, int tid,
                                                      uint64_t policy) const {
    static_assert(kRows % 16 == 0, "K/V tiles: whole 16-row groups");
    constexpr int kChunksPerRow = kCols / 8;
    constexpr int kChunks = kRows * kChunksPerRow;
    constexpr int kRowsPerPass = kThreads / kChunksPerRow;
    const Element* k_base = static_cast<const Element*>(p.k.ptr);
    const Element* v_base = static_cast<const Element*>(p.v.ptr);
    if constexpr (kThreads % kChunksPerRow == 0 && kRowsPerPass <= 16 && 16 % kRowsPerPass == 0) {
      // Every pass moves whole rows, 16 / kRowsPerPass passes per 16-row group: one lookup per group.
      const int r0 = tid / kChunksPerRow, col = (tid % kChunksPerRow) * 8;
      const bool col_ok = col < d_valid;
#pragma unroll
      for (int g = 0; g < kRows / 16; ++g) {
        // A group past the visible keys may lie past the block table's row: look row n0 up
        // instead (visible: the caller copies only tiles holding visible keys).
        const int2 loc = locate(16 * g < rows_valid ? n0 + 16 * g : n0);
        const Element* k_row0 = row_ptr<const Element>(p.k, head, loc) + col;
        const Element* v_row0 = row_ptr<const Element>(p.v, head, loc) + col;
#pragma unroll
        for (int pp = 0; pp < 16 / kRowsPerPass; ++pp) {
          const int r = pp * kRowsPerPass + r0;  // row inside the group
          const bool pred = col_ok && loc.x >= 0 && 16 * g + r < rows_valid;
          const uint32_t off = Layout::offset(16 * g + r, col);
          cp_async_16(sK + off, pred ? k_row0 + int64_t(r) * p.k.row_stride : k_base, pred, policy);
          cp_async_16(sV + off, pred ? v_row0 + int64_t(r) * p.v.row_stride : v_base, pred, policy);
        }
      }
    } else {
      // Generic chunk walk (12 or 24 chunks per row, or several groups per pass): a lookup per chunk.
#pragma unroll
      for (int it = 0; it < (kChunks + kThreads - 1) / kThreads; ++it) {
        const int c = it * kThreads + tid;
        if (kChunks % kThreads == 0 || c < kChunks) {
          const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
          const bool in_range = row < rows_valid && col < d_valid;
          const int2 loc = locate(in_range ? n0 + row : n0);
          const bool pred = in_range && loc.x >= 0;
          const uint32_t off = Layout::offset(row, col);
          cp_async_16(sK + off, pred ? row_ptr<const Element>(p.k, head, loc) + col : k_base, pred, policy);
          cp_async_16(sV + off, pred ? row_ptr<const Element>(p.v, head, loc) + col : v_base, pred, policy);
        }
      }
    }
  }

  // The same tiles by TMA boxes (sm_90+; one thread issues, primitives/tma.cuh) into the
  // Swizzle128Tile layout at sK / sV: per group of maps.box_rows rows (all kRows for a contiguous
  // cache; gcd(page_size, kRows) for a paged one, so a group never straddles two pages) and per
  // 64-column block, one box of K and one of V at (column, row in its block, kv head, block),
  // completing 2 * kRows * kCols * 2 bytes on `bar` (this thread's arrival announces them).
  // Groups past rows_valid and groups of an invalid block are read at block -1: outside the
  // tensor, so zero-filled, and no table entry past the visible rows is read. Rows past rows_valid
  // inside the last visible group are real cache rows (anything, NaN included): the kernel
  // zeroes them in V before P V (primitives/tile_copy.cuh: zero_rows) and masks them in S. n0: a multiple of 16.
  template <int kRows, int kCols>
  __device__ __forceinline__ void copy_kv_tiles_tma(uint32_t sK, uint32_t sV, const KvTmaMaps& maps, int head, int n0,
                                                    int rows_valid, uint32_t bar, uint64_t policy) const {
    using Layout = Swizzle128Tile<kRows, kCols>;
    mbarrier_arrive_expect_tx(bar, 2 * Layout::kBytes);
    for (int r = 0; r < kRows; r += maps.box_rows) {
      const int2 loc = r < rows_valid ? locate(n0 + r) : make_int2(-1, 0);
#pragma unroll
      for (int cb = 0; cb < kCols / 64; ++cb) {
        const uint32_t off = Layout::offset(r, 64 * cb);  // r % 8 == 0: the group starts a swizzle atom
        tma_load_4d(sK + off, &maps.k, bar, 64 * cb, loc.y, head, loc.x, policy);
        tma_load_4d(sV + off, &maps.v, bar, 64 * cb, loc.y, head, loc.x, policy);
      }
    }
  }
};

}  // namespace flash
