// The work of one CTA, for every kernel of every arch path: which (batch, head, tile) blockIdx.x
// stands for (scheduling order), its per-sequence view (seqlen.cuh) and mask (mask.cuh), and the
// range of the other operand's tiles its loop visits (FlashAttention-2, Dao 2023: Alg. 1's loop
// over K/V blocks for the forward; Alg. 2's outer loop over K/V blocks j for dK/dV, and the loop
// over K/V blocks for dQ). The persistent sm90 forward decodes an explicit tile index of the same
// numbering instead of blockIdx.x (QTileWork(params, tile), common/tile_scheduler.cuh).
#pragma once

#include "flash.h"
#include "kernels/common/mask.cuh"
#include "kernels/common/seqlen.cuh"
#include "primitives/cp_async.cuh"
#include "primitives/ldmatrix.cuh"
#include "primitives/math.cuh"
#include "primitives/tile_copy.cuh"

namespace flash {

// ---- Varlen grids of the real tiles only (as FlashAttention-4's varlen tile scheduler). A varlen
// grid sized by max_seqlen runs ceil(max_seqlen / kBlock) CTAs per (sequence, head), and on skewed
// lengths most of them start past their sequence's end and exit at once (past_end), after their
// launch and setup. The host cannot read cu_seqlens (no device sync) but knows the packed rows
// `total`: a sequence of len rows has ceil(len / kBlock) <= len / kBlock + 1 tiles, so
// ceil(total / kBlock) + batch CTAs per head cover every real tile, and each CTA finds its
// (sequence, tile) by a prefix sum of the tile counts over cu_seqlens (varlen_dense_index, 32
// sequences per warp step). Taken where it at least halves the grid, the batch keeps the scan
// short, and the dense numbering fits the kernels' int decodes (< 2^31 tiles: a max_seqlen far
// above total would otherwise wrap them; the dense grid of such a call is refused at launch);
// host and device evaluate varlen_tight_grid on the same params, so they agree (`enabled`: the
// FLASH_ATTN_EXT_VARLEN_TIGHT_GRID knob, flash.h: varlen_tight). The bound needs
// non-decreasing cu_seqlens inside the tensors (the CUDA path cannot check them without a sync:
// README, "What CUDA cannot check"); past it, tiles beyond the bound are not computed.
constexpr int kVarlenTightMaxBatch = 512;

__host__ __device__ __forceinline__ int64_t varlen_tight_per_head(int total, int batch, int block) {
  return int64_t(ceil_div(total, block)) + batch;
}
__host__ __device__ __forceinline__ bool varlen_tight_grid(bool enabled, const int* cu_seqlens, int batch, int total,
                                                           int max_len, int block, int heads) {
  const int64_t dense_per_head = int64_t(ceil_div(max_len, block)) * batch;
  return enabled && cu_seqlens != nullptr && batch <= kVarlenTightMaxBatch &&
         2 * varlen_tight_per_head(total, batch, block) <= dense_per_head &&
         dense_per_head * heads < (int64_t(1) << 31);
}

// Sequence b's length from cu_seqlens, clamped to [0, max_len] as SeqInfo clamps it.
__device__ __forceinline__ int varlen_clamped_len(const int* cu_seqlens, int b, int max_len) {
  return min(max(cu_seqlens[b + 1] - cu_seqlens[b], 0), max_len);
}

// The index, in the dense numbering (b * heads + head) * num + p with num = ceil(max_len / kBlock)
// tiles per (sequence, head), of the u-th real tile of head `head` among the sequences `take`
// accepts (take(b): a warp-uniform call per lane's sequence b < batch), counting them in sequence
// order, or -1 where u lies past them. Tile j of sequence b, which has n_b = ceil(min(len_b,
// max_len) / kBlock) tiles (SeqInfo clamps len_b to max_len), is p = num - n_b + j with kReverse
// (Q tiles: the sequence's last tile first, heavy first under causal, as the dense order), else
// p = j (key blocks in order). Warp-collective: every lane of a converged warp calls it and gets
// the same value.
template <int kBlock, bool kReverse, typename Take>
__device__ __forceinline__ int64_t varlen_scan_index(const int* cu_seqlens, int batch, int max_len, int heads,
                                                     int head, int u, Take take) {
  const int lane = threadIdx.x % 32, num = ceil_div(max_len, kBlock);
  int base = 0;  // the real tiles of the sequences before this step's 32
  for (int b0 = 0; b0 < batch; b0 += 32) {
    const int b = b0 + lane;
    const int len = b < batch ? varlen_clamped_len(cu_seqlens, b, max_len) : 0;
    const int n = b < batch && take(b) ? ceil_div(len, kBlock) : 0;
    int incl = n;  // inclusive prefix sum over the lanes
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    const unsigned hit = __ballot_sync(0xffffffffu, base + incl > u);  // uniform over the warp
    if (hit != 0) {
      const int l = __ffs(int(hit)) - 1;
      const int n_b = __shfl_sync(0xffffffffu, n, l);
      const int j = u - base - (__shfl_sync(0xffffffffu, incl, l) - n_b);
      return (int64_t(b0 + l) * heads + head) * num + (kReverse ? num - n_b + j : j);
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  return -1;
}

// The index (varlen_scan_index's numbering) of CTA `cta` of a tight grid (cta = head * per_head +
// u, u counting the real tiles of sequences 0, 1, ... in order), or -1 where u lies past them.
template <int kBlock, bool kReverse>
__device__ __forceinline__ int64_t varlen_dense_index(const int* cu_seqlens, int batch, int total, int max_len,
                                                      int heads, int64_t cta) {
  const int64_t per_head = varlen_tight_per_head(total, batch, kBlock);
  const int head = int(cta / per_head);
  return varlen_scan_index<kBlock, kReverse>(cu_seqlens, batch, max_len, heads, head,
                                             int(cta - int64_t(head) * per_head), [](int) { return true; });
}

// Longest sequences first (the sm90 forward's dynamic walk on a tight grid; common/
// tile_scheduler.cuh): the sequences fall into k = kLptBuckets buckets by their keys (SeqInfo's
// clamped seqlen_k: bucket min(k - 1, (len_k - 1) / ceil(max_len_k / k)), 0 without keys; the
// longest in k - 1), and the walk deals the buckets from the longest down, each in sequence
// order, so the heavy tiles go first and the light ones fill the tail, as
// longest-processing-time-first scheduling would (scripts/varlen_walk_model.py on the benchmark's
// 64 sequences of 128..1024: makespan / ideal 1.07 -> 1.03 at d128 causal, 1.06 -> 1.03 at d256,
// 1.13 -> 1.04 at d256 causal; docs/PERF_NOTES.md, tenth session).
constexpr int kLptBuckets = 4;
__device__ __forceinline__ int varlen_lpt_bucket(const int* cu_seqlens_k, int b, int max_len_k) {
  const int len = varlen_clamped_len(cu_seqlens_k, b, max_len_k);
  return len == 0 ? 0 : min(kLptBuckets - 1, (len - 1) / ceil_div(max_len_k, kLptBuckets));
}

// A tight grid's sequences' buckets into buckets[b] (b < batch <= kVarlenTightMaxBatch) and each
// bucket's real Q tiles per head into bucket_tiles[kLptBuckets], both in shared memory (integer
// sums: the same in every CTA whatever the atomics' order). Warp-collective: every lane of a
// converged warp calls it; the warp reads both after it.
template <int kBlock>
__device__ __forceinline__ void varlen_lpt_prepare(const int* cu_seqlens_q, const int* cu_seqlens_k, int batch,
                                                   int max_len_q, int max_len_k, uint8_t* buckets,
                                                   int* bucket_tiles) {
  const int lane = threadIdx.x % 32;
  if (lane < kLptBuckets) bucket_tiles[lane] = 0;
  __syncwarp();
  for (int b = lane; b < batch; b += 32) {
    const int len = varlen_clamped_len(cu_seqlens_q, b, max_len_q);
    const int bucket = varlen_lpt_bucket(cu_seqlens_k, b, max_len_k);
    buckets[b] = uint8_t(bucket);
    atomicAdd(&bucket_tiles[bucket], ceil_div(len, kBlock));
  }
  __syncwarp();
}

// The index (varlen_scan_index's numbering) of the u-th real tile of head `head` in the
// longest-first order (above): u counts the tiles of bucket kLptBuckets - 1 first, in sequence
// order, then the next bucket's, and so on; -1 past them. buckets, bucket_tiles:
// varlen_lpt_prepare's. Warp-collective.
template <int kBlock>
__device__ __forceinline__ int64_t varlen_lpt_index(const int* cu_seqlens_q, int batch, int max_len_q, int heads,
                                                    int head, int u, const uint8_t* buckets,
                                                    const int* bucket_tiles) {
  int bucket = kLptBuckets - 1;
  for (; bucket >= 0 && u >= bucket_tiles[bucket]; --bucket) u -= bucket_tiles[bucket];
  if (bucket < 0) return -1;
  return varlen_scan_index<kBlock, true>(cu_seqlens_q, batch, max_len_q, heads, head, u,
                                         [&](int b) { return buckets[b] == bucket; });
}

// Forward / dQ CTA: Q tile of kBlockM rows from m0 of (batch, head bidh; kv head bidhk).
// blockIdx.x runs the Q tiles fastest and in reverse, so the heavy (late, under causal) tiles go
// first and the CTAs of one (batch, head) run together and share K / V in L2. The loop visits
// the key blocks [n_block_min, n_block_max) (n_block_min: 0 but for a sliding window); blocks
// [n_block_unmasked_lo, n_block_unmasked) need no mask.
// kTightVarlen: varlen calls may run on a tight grid (varlen_tight_grid); false keeps the grid of
// max_seqlen_q (the sm80 forward: its 128 x 64 row for sm_90a sits at 255 registers, and a decode
// that cannot be recomputed from blockIdx.x cost it 80 bytes of spills).
template <int kBlockM, int kBlockN, bool kTightVarlen = true>
struct QTileWork {
  SeqInfo seq;
  AttnMask mask;
  int bidh, bidhk, m0, rows_q, n_block_max, n_block_unmasked;

  __device__ __forceinline__ explicit QTileWork(const Flash_fwd_params& params) : QTileWork(params, decode(params)) {}
  // bm = decode(params), computed once (its 64-bit divisions are the CTA's costliest setup).
  // m_shift: the tiles start m_shift rows before row 0 (FwdTileScheduler::m_shift: the sm90
  // forward's causal calls put a partial tile at the top, where the causal rows are lightest),
  // so the first tile's rows below m_shift are not rows of the sequence (m0 + row < 0).
  // kShiftPerSequence (varlen): each sequence's own shift, the partial tile's missing rows
  // rounded down to whole 64-row warpgroups (0 when its length is a multiple of kBlockM); its
  // tile count stays ceil(seqlen_q / kBlockM), so past_end() marks the same tiles.
  static constexpr int kShiftPerSequence = -1;
  // The top shift of a causal sequence of seqlen_q rows: its partial tile's missing rows, rounded
  // down to whole 64-row warpgroups (a TMA box never crosses row 0); 0 without a partial tile.
  __host__ __device__ __forceinline__ static int top_shift(int seqlen_q) {
    const int rows_last = seqlen_q % kBlockM;
    return rows_last > 0 ? (kBlockM - rows_last) / 64 * 64 : 0;
  }
  __device__ __forceinline__ QTileWork(const Flash_fwd_params& params, int2 bm, int m_shift = 0)
      : seq(params, bm.x), mask(seq, params) {
    bidh = bm.y % params.h;
    bidhk = bidh / params.h_h_k_ratio;  // GQA/MQA: shared K/V head, never copied
    if (m_shift == kShiftPerSequence) m_shift = top_shift(seq.seqlen_q);
    m0 = (bm.y / params.h) * kBlockM - m_shift;
    rows_q = min(kBlockM, seq.seqlen_q - m0);
    n_block_max = mask.n_block_max(m0, kBlockM, kBlockN);
    n_block_unmasked = mask.n_block_unmasked(m0, kBlockN);
  }
  // Whether `params` runs on a varlen tight grid (varlen_tight_grid: host and device alike).
  __host__ __device__ __forceinline__ static bool tight(const Flash_fwd_params& params) {
    return kTightVarlen &&
           varlen_tight_grid(params.varlen_tight, params.cu_seqlens_q, params.b, params.total_q, params.seqlen_q,
                             kBlockM, params.h);
  }
  // (batch, m_block * h + head) of blockIdx.x = (b*h + head) * num_m + (num_m - 1 - m_block); on a
  // varlen tight grid of the dense index varlen_dense_index finds (warp-collective: every thread of
  // the CTA constructs its QTileWork at the kernel's start), a CTA past every real tile getting a
  // tile past sequence 0's end (past_end()).
  __device__ __forceinline__ static int2 decode(const Flash_fwd_params& params) {
    const int num_m = ceil_div(params.seqlen_q, kBlockM);
    int64_t idx = blockIdx.x;
    if (tight(params)) {
      idx = varlen_dense_index<kBlockM, true>(params.cu_seqlens_q, params.b, params.total_q, params.seqlen_q,
                                              params.h, blockIdx.x);
      if (idx < 0) return make_int2(0, num_m * params.h);  // m0 = num_m * kBlockM >= every seqlen_q
    }
    const int64_t bh = idx / num_m;
    const int m_block = num_m - 1 - int(idx % num_m);
    return make_int2(int(bh / params.h), m_block * params.h + int(bh % params.h));
  }
  // The tile of an explicit index in blockIdx.x's numbering (a persistent CTA's loop over tiles,
  // common/tile_scheduler.cuh), with the divisions by num_m (m_div.d) and nheads (h_div.d) by the
  // scheduler's precomputed FastDivmods (tile < 2^31).
  __device__ __forceinline__ QTileWork(const Flash_fwd_params& params, int64_t tile, const FastDivmod& m_div,
                                       const FastDivmod& h_div, int m_shift = 0)
      : QTileWork(params, decode(int(tile), m_div, h_div), m_shift) {}
  __device__ __forceinline__ static int2 decode(int tile, const FastDivmod& m_div, const FastDivmod& h_div) {
    const int bh = m_div.div(tile), j = tile - bh * m_div.d;
    const int bidb = h_div.div(bh), head = bh - bidb * h_div.d;
    return make_int2(bidb, (m_div.d - 1 - j) * h_div.d + head);
  }
  // The left end of the ranges (0 without a sliding window), computed where used rather than
  // kept: the sm80 forward's sm_90a row sits at 255 registers across its key loop.
  __device__ __forceinline__ int n_block_min() const { return mask.n_block_min(m0, kBlockN); }
  // kLeft = false: the right bound and seqlen_k only (the kernels' twins without a left bound).
  template <bool kLeft>
  __device__ __forceinline__ bool block_needs_mask(int n_block) const {
    return n_block >= n_block_unmasked || (kLeft && n_block < mask.n_block_unmasked_lo(m0, kBlockM, kBlockN));
  }
  // The tile starts at or past its sequence's last query row (varlen: the grid is sized by
  // max_seqlen_q): nothing to compute or store. Never for a dense call.
  __device__ __forceinline__ bool past_end() const { return m0 >= seq.seqlen_q; }
  // Writes this CTA's tile of a Q-shaped output (O, dQ) from shared memory (Layout, as staged by the
  // kernel) to tensor `out`; rows >= seqlen_q and columns >= d are not written.
  template <typename Element, typename Layout, int kHeadDim, int kThreads>
  __device__ __forceinline__ void store_q_tile(const Flash_fwd_params& params, const TensorView& out, const void* smem,
                                               int tid) const {
    store_tile<Layout, kBlockM, kHeadDim, kThreads>(seq.template q_row<Element>(out, bidh, m0), out.row_stride, smem,
                                                    rows_q, params.d, tid);
  }
  // The grid of such CTAs: every (batch, head, Q tile), or a varlen tight grid; blockIdx.x decodes
  // as in decode().
  __host__ __device__ __forceinline__ static int64_t grid_size(const Flash_fwd_params& params) {
    if (tight(params)) return varlen_tight_per_head(params.total_q, params.b, kBlockM) * params.h;
    return int64_t(ceil_div(params.seqlen_q, kBlockM)) * params.b * params.h;
  }
};

// dK/dV CTA: key block n0 of kBlockN rows of (batch, kv head bidhk). blockIdx.x runs the key
// blocks fastest, so the heavy (early, under causal) key blocks go first and the CTAs of one
// (batch, kv head) run together and share Q / dO in L2. The CTA loops over n_iter = ratio * num_m
// iterations: every query head bidhk * ratio + it / num_m of the GQA group, and for each the Q
// tiles m_block_min + it % num_m of kBlockM rows that see some key of the block.
template <int kBlockM, int kBlockN>
struct DkvWork {
  SeqInfo seq;
  AttnMask mask;
  int bidhk, n0, m_block_min, num_m, ratio, n_iter;
  FastDivmod num_m_div;  // it -> (it / num_m, it % num_m) without a division per iteration
  int64_t ws0;           // seq.ws_index(params, 0, 0)

  // blockIdx.x = (b * h_k + kv head) * num_n + key block, num_n from params.seqlen_k (the grid's
  // key blocks: max_seqlen_k for varlen), not from the sequence's own length; on a varlen tight
  // grid the index varlen_dense_index finds (warp-collective: every thread constructs its DkvWork
  // at the kernel's start), a CTA past every real key block getting one past sequence 0's end.
  __device__ __forceinline__ explicit DkvWork(const Flash_bwd_params& params) : DkvWork(params, cta_index(params)) {}
  __host__ __device__ __forceinline__ static bool tight(const Flash_fwd_params& params) {
    return varlen_tight_grid(params.varlen_tight, params.cu_seqlens_k, params.b, params.total_k, params.seqlen_k,
                             kBlockN, params.h_k);
  }
  __device__ __forceinline__ static int64_t cta_index(const Flash_bwd_params& params) {
    if (!tight(params)) return blockIdx.x;
    return varlen_dense_index<kBlockN, false>(params.cu_seqlens_k, params.b, params.total_k, params.seqlen_k,
                                              params.h_k, blockIdx.x);
  }
  // idx: the dense index, or -1 (no key block: sequence 0, kv head 0, key block num_n).
  __device__ __forceinline__ DkvWork(const Flash_bwd_params& params, int64_t idx)
      : seq(params, idx < 0 ? 0 : int(idx / ceil_div(params.seqlen_k, kBlockN)) / params.h_k),
        mask(seq, params) {
    const int num_n_blocks = ceil_div(params.seqlen_k, kBlockN);
    bidhk = idx < 0 ? 0 : int(idx / num_n_blocks) % params.h_k;
    n0 = (idx < 0 ? num_n_blocks : int(idx % num_n_blocks)) * kBlockN;
    m_block_min = mask.first_m_block(n0, kBlockM);
    const int m_block_max = mask.m_block_end(n0, kBlockN, kBlockM);
    num_m = m_block_max > m_block_min ? m_block_max - m_block_min : 0;
    ratio = params.h_h_k_ratio;
    n_iter = num_m * ratio;
    num_m_div = FastDivmod(num_m > 0 ? num_m : 1);
    ws0 = seq.ws_index(params, 0, 0);
  }
  // The grid of such CTAs: every (batch, kv head, key block), key block fastest, or a varlen tight
  // grid.
  __host__ __device__ __forceinline__ static int64_t grid_size(const Flash_fwd_params& params) {
    if (tight(params)) return varlen_tight_per_head(params.total_k, params.b, kBlockN) * params.h_k;
    return int64_t(ceil_div(params.seqlen_k, kBlockN)) * params.b * params.h_k;
  }
  // The key block starts at or past its sequence's last key (varlen: the grid is sized by
  // max_seqlen_k): no dK/dV rows to write. Never for a dense call. (A block with no Q tile to
  // visit, n_iter = 0, is not past the end: it stores dK = dV = 0.)
  __device__ __forceinline__ bool past_end() const { return n0 >= seq.seqlen_k; }
  __device__ __forceinline__ int head(int it) const { return bidhk * ratio + num_m_div.div(it); }  // query head
  // Writes this CTA's tile of a K-shaped output (dK, dV) from shared memory (Layout) to tensor
  // `out`; rows >= seqlen_k and columns >= d are not written.
  template <typename Element, typename Layout, int kHeadDim, int kThreads>
  __device__ __forceinline__ void store_kv_tile(const Flash_bwd_params& params, const TensorView& out, const void* smem,
                                                int tid) const {
    store_tile<Layout, kBlockN, kHeadDim, kThreads>(seq.reload_k_offset(params, 0).template k_row<Element>(out, bidhk, n0),
                                                    out.row_stride, smem, seq.seqlen_k - n0, params.d, tid);
  }
  __device__ __forceinline__ int m0(int it) const { return (m_block_min + num_m_div.mod(it)) * kBlockM; }  // first Q row
  // Iteration it needs the exact P recompute where it holds a masked pair or a large-magnitude row
  // (flash.h: precise_rows). The flag is a global load: kernels read it one iteration ahead.
  // kLeft = false: the right bound only (the kernels' twins without a left bound).
  template <bool kLeft>
  __device__ __forceinline__ bool needs_mask(int it) const {
    return mask.template kv_block_needs_mask<kLeft>(m0(it), kBlockM, n0, kBlockN);
  }
  __device__ __forceinline__ bool precise(const Flash_bwd_params& params, int it) const {
    return it < n_iter && params.precise_rows_ptr[seq.precise_index(params, head(it), m0(it))] != 0;
  }

  // Alg. 2 line 10: Q_i and dO_i of iteration it (query head, Q tile) by cp.async into the shared
  // tiles at sQ / sdO (Layout: the kernel's shared layout, primitives/tile_copy.cuh).
  template <typename Element, typename Layout, int kHeadDim, int kThreads, bool kFastCopy = true>
  __device__ __forceinline__ void copy_q_tiles_async(const Flash_bwd_params& params, int it, uint32_t sQ, uint32_t sdO,
                                                     int tid) const {
    const int bidh = head(it), row0 = m0(it);
    const SeqInfo s = seq.reload_q_offset(params, it);
    copy_tile_async<Layout, kBlockM, kHeadDim, kThreads, kFastCopy>(
        sQ, s.template q_row<const Element>(params.q, bidh, row0), params.q.row_stride, seq.seqlen_q - row0,
        params.d, tid);
    copy_tile_async<Layout, kBlockM, kHeadDim, kThreads, kFastCopy>(
        sdO, s.template q_row<const Element>(params.dout, bidh, row0), params.dout.row_stride,
        seq.seqlen_q - row0, params.d, tid);
  }

  // Alg. 2 line 7: K_j and V_j of this CTA's key block by cp.async into the shared tiles at sK / sV
  // (Layout, kCols columns: primitives/tile_copy.cuh).
  template <typename Element, typename Layout, int kCols, int kThreads>
  __device__ __forceinline__ void copy_kv_tiles_async(const Flash_bwd_params& params, uint32_t sK, uint32_t sV,
                                                      int tid) const {
    copy_tile_async<Layout, kBlockN, kCols, kThreads>(sK, seq.template k_row<const Element>(params.k, bidhk, n0),
                                                      params.k.row_stride, seq.seqlen_k - n0, params.d, tid);
    copy_tile_async<Layout, kBlockN, kCols, kThreads>(sV, seq.template k_row<const Element>(params.v, bidhk, n0),
                                                      params.v.row_stride, seq.seqlen_k - n0, params.d, tid);
  }

  // Index of iteration it's first Q row in the backward workspaces (hi, lo, D).
  __device__ __forceinline__ int64_t ws_row0(const Flash_bwd_params& params, int it) const {
    return ws0 + head(it) * SeqInfo::ws_head_stride(params) + m0(it);
  }

  // Alg. 2 line 10, the row statistics of iteration it: hi, lo (LSE_log2 = hi + lo) and D of its
  // kBlockM rows into sHi / sLo / sDsum by cp.async, 16 bytes per thread of the first 3 kBlockM / 4
  // threads. Whole tiles lie inside the workspaces (rows rounded up to 128).
  __device__ __forceinline__ void copy_row_stats_async(const Flash_bwd_params& params, int it, float* sHi,
                                                       float* sLo, float* sDsum, int tid) const {
    const int64_t ws = ws_row0(params, it);
    constexpr int kChunks = kBlockM / 4;  // 16 B = 4 floats
    if (tid < kChunks) {
      cp_async_16(smem_u32addr(sHi + tid * 4), params.softmax_lse_log2_ptr + ws + tid * 4, true);
    } else if (tid < 2 * kChunks) {
      cp_async_16(smem_u32addr(sLo + (tid - kChunks) * 4), params.softmax_lse_log2_lo_ptr + ws + (tid - kChunks) * 4,
                  true);
    } else if (tid < 3 * kChunks) {
      cp_async_16(smem_u32addr(sDsum + (tid - 2 * kChunks) * 4), params.dsoftmax_sum_ptr + ws + (tid - 2 * kChunks) * 4,
                  true);
    }
  }
};

// dQ CTA: the forward's Q tile decomposition (QTileWork), plus whether the tile holds a
// large-magnitude row (every key block then takes the exact P recompute).
template <int kBlockM, int kBlockN>
struct DqWork : QTileWork<kBlockM, kBlockN> {
  bool precise;
  __device__ __forceinline__ explicit DqWork(const Flash_bwd_params& params)
      : QTileWork<kBlockM, kBlockN>(params),  // past_end: no flag (its tile may lie past the flags)
        precise(!this->past_end() &&
                params.precise_rows_ptr[this->seq.precise_index(params, this->bidh, this->m0)] != 0) {}

  // Alg. 2 line 10: this CTA's Q_i and dO_i (resident) by cp.async into the shared tiles at sQ / sdO
  // (Layout, kCols columns: primitives/tile_copy.cuh).
  template <typename Element, typename Layout, int kCols, int kThreads>
  __device__ __forceinline__ void copy_q_tiles_async(const Flash_bwd_params& params, uint32_t sQ, uint32_t sdO,
                                                     int tid) const {
    const SeqInfo& s = this->seq;
    const int bidh = this->bidh, m0 = this->m0, rows = this->rows_q;
    copy_tile_async<Layout, kBlockM, kCols, kThreads>(sQ, s.template q_row<const Element>(params.q, bidh, m0),
                                                      params.q.row_stride, rows, params.d, tid);
    copy_tile_async<Layout, kBlockM, kCols, kThreads>(sdO, s.template q_row<const Element>(params.dout, bidh, m0),
                                                      params.dout.row_stride, rows, params.d, tid);
  }

  // Alg. 2 line 7: K_j and V_j of key block n_block by cp.async into the shared tiles at sK / sV
  // (Layout: the kernel's shared layout, primitives/tile_copy.cuh).
  template <typename Element, typename Layout, int kHeadDim, int kThreads, bool kFastCopy = true>
  __device__ __forceinline__ void copy_kv_tiles_async(const Flash_bwd_params& params, int n_block, uint32_t sK,
                                                      uint32_t sV, int tid) const {
    const int n0 = n_block * kBlockN, rows = this->seq.seqlen_k - n0;
    const SeqInfo s = this->seq.reload_k_offset(params, n_block);
    copy_tile_async<Layout, kBlockN, kHeadDim, kThreads, kFastCopy>(
        sK, s.template k_row<const Element>(params.k, this->bidhk, n0), params.k.row_stride, rows, params.d, tid);
    copy_tile_async<Layout, kBlockN, kHeadDim, kThreads, kFastCopy>(
        sV, s.template k_row<const Element>(params.v, this->bidhk, n0), params.v.row_stride, rows, params.d, tid);
  }
};

}  // namespace flash
