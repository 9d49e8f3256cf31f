// Long rows: the forward's O accumulator in two levels.
//
// The tensor cores add each 16-key product P V into O's fp32 accumulator rounding toward zero, so
// a row over N keys loses up to an ulp of |O| per 16-key step: about N / 16 * 2^-25 of |O| on
// average, a bias, not noise. From ~2^20 keys that is more than bf16's own rounding and the
// accuracy rule fails (docs/PERF_NOTES.md, forty-first session: out 1.5x and dq 3.8x the
// same-dtype baseline at 2^20 keys on both arch paths; the error is the forward's O, carried into
// dq / dk by D = rowsum(dO o O)). The remedy is the one of DeepSeek-V3's FP8 GEMMs (section 3.3.2,
// "increasing accumulation precision"): promote a partial accumulator to CUDA-core fp32 at an
// interval. Here, rows whose key blocks hold >= params.long_row_keys keys move O to a global
// fp32 copy every flush_keys keys (round-to-nearest FFMA) and start the tensor-core accumulator
// at 0 again, so no accumulator sees more than flush_keys keys; the epilogue adds the copy back
// before the normalization (FA2 Alg. 1 line 12).
//
// The copy, params.o_flush_ptr, and params.o_flush_max_ptr, the max each thread's copy is relative
// to (one slot per lane of the row's quad, so every thread reads back only what it wrote itself:
// no ordering between threads), are sized by the launch for its grid (alloc_long_rows below, only
// for calls whose rows can be that long) in one of two layouts (width: o_flush_width, the
// kernel's O columns):
//   per row (the sm80 kernel's grid of one CTA per tile): (nheads, o_flush_rows, width) and
//     (nheads, o_flush_rows, 4) float32; query row i of sequence b at
//     row (its first q row: dense b * seqlen_q, varlen cu_seqlens_q[b]) + 512 b + 256 + i, so each
//     sequence has room for its query tiles' rows from 256 before row 0 (a causal tile shifted to
//     the top) to 256 past seqlen_q (o_flush_rows = total rows + 512 * batch);
//   per CTA (the sm90 kernel, whose CTAs run their tiles one after another, each thread's rows
//     of one tile flushed and merged before its next tile's):
//     (gridDim.x, kBlockM, width) and (gridDim.x, kBlockM, 4), row (blockIdx.x, row in the
//     tile): on the persistent grid 9 MB at d128 on 132 SMs (18 at d256), where the per-row
//     layout takes twice a bf16 output.
// The thread's accumulator holds rows r = 2 mi + h (h = 0, 1: +8 rows) of the mma fragment layout
// (primitives/mma.cuh; wgmma's accumulator is the same per warp): row row0 + 16 mi + 8 h, columns
// 8 j + 2 (lane % 4) + {0, 1}.
//
// Whether and when a tile's rows flush is a function of the key blocks they walk (sm80: the
// tile's; sm90: the warpgroup's own range) alone: long_rows_every, the blocks times their keys
// against the bound. So a sequence runs the same steps in a varlen call as alone
// (flash_attn_varlen_func's bitwise contract); tiles whose blocks hold fewer keys than the bound
// run as without any of this (a causal tile's first rows see up to kBlockM - 1 keys fewer than
// its blocks hold, so they may flush a little below the bound).
#pragma once

#include "flash.h"
#include "kernels/common/seqlen.cuh"
#include "primitives/math.cuh"

namespace flash {

// Steps (key blocks of block_n keys) between flushes for a row of `steps` steps; 0: it never
// flushes (no copy, or fewer keys than params.long_row_keys).
__device__ __forceinline__ int long_rows_every(const Flash_fwd_params& p, int steps, int block_n) {
  if (p.o_flush_ptr == nullptr || int64_t(steps) * block_n < p.long_row_keys) return 0;
  return max(p.flush_keys / block_n, 1);
}

struct LongRows {
  float* o;  // (row0, column 2 (lane % 4)) of the thread's copy
  float* m;  // (row0, lane % 4) of its maxima
  int64_t stride;  // o_flush_width: floats per row of o

  // Per row (the sm80 kernel): row0, the thread's first row in its sequence (the tile's m0 plus
  // the row in the tile).
  __device__ __forceinline__ LongRows(const Flash_fwd_params& p, const SeqInfo& seq, int bidh, int row0, int lane)
      : stride(p.o_flush_width) {
    const int64_t start = (p.cu_seqlens_q != nullptr ? int64_t(seq.q_offset) : int64_t(seq.bidb) * p.seqlen_q) +
                          512 * int64_t(seq.bidb) + 256;
    at(p, int64_t(bidh) * p.o_flush_rows + start + row0, lane);
  }
  // Per CTA (the sm90 kernel): row, the thread's first row in the tile.
  __device__ __forceinline__ LongRows(const Flash_fwd_params& p, int row, int lane) : stride(p.o_flush_width) {
    at(p, int64_t(blockIdx.x) * p.o_flush_rows + row, lane);
  }

  // After a flush interval: copy = copy * exp2((m_copy - m) c) + O (the copy is 0 at the first
  // flush), m_copy = m, O = 0. row_max: the online softmax's m, which O is relative to.
  template <int kMAtoms, int kDAtoms>
  __device__ __forceinline__ void flush(float (&acc_o)[kMAtoms][kDAtoms][4], const float (&row_max)[2 * kMAtoms],
                                        float c, bool first) const {
#pragma unroll
    for (int r = 0; r < 2 * kMAtoms; ++r) {
      const int64_t off = (r / 2) * 16 + (r % 2) * 8;
      float* orow = o + off * stride;
      const float m_copy = first ? -INFINITY : m[off * 4];
      // A copy of a row that saw no key yet (m = -inf) is zero: nothing to keep.
      const bool keep = m_copy != -INFINITY;
      const float f = keep ? fast_exp2((m_copy - row_max[r]) * c) : 0.f;
#pragma unroll
      for (int j = 0; j < kDAtoms; ++j) {
        float2* q = reinterpret_cast<float2*>(orow + 8 * j);
        const float2 old = keep ? *q : make_float2(0.f, 0.f);
        float* a = &acc_o[r / 2][j][2 * (r % 2)];
        *q = make_float2(fmaf(old.x, f, a[0]), fmaf(old.y, f, a[1]));
        a[0] = a[1] = 0.f;
        // At most four columns' loads in flight: no spills where acc_o is large (d256: 128
        // registers) beside the key loop's own (the flush is rare; the wait costs nothing).
        if (j % 4 == 3) __syncwarp();
      }
      m[off * 4] = row_max[r];
    }
  }

  __device__ __forceinline__ void at(const Flash_fwd_params& p, int64_t row, int lane) {
    o = p.o_flush_ptr + row * stride + 2 * (lane % 4);
    m = p.o_flush_max_ptr + row * 4 + lane % 4;
  }

  // The epilogue, before the normalization: O += copy * exp2((m_copy - m) c).
  template <int kMAtoms, int kDAtoms>
  __device__ __forceinline__ void merge(float (&acc_o)[kMAtoms][kDAtoms][4], const float (&row_max)[2 * kMAtoms],
                                        float c) const {
#pragma unroll
    for (int r = 0; r < 2 * kMAtoms; ++r) {
      const int64_t off = (r / 2) * 16 + (r % 2) * 8;
      const float m_copy = m[off * 4];
      if (m_copy == -INFINITY) continue;
      const float f = fast_exp2((m_copy - row_max[r]) * c);
#pragma unroll
      for (int j = 0; j < kDAtoms; ++j) {
        const float2 old = *reinterpret_cast<const float2*>(o + off * stride + 8 * j);
        float* a = &acc_o[r / 2][j][2 * (r % 2)];
        a[0] = fmaf(old.x, f, a[0]);
        a[1] = fmaf(old.y, f, a[1]);
      }
    }
  }
};

// The launch's side (host): the workspaces for a grid of `slots` CTAs of rows_per_slot rows each
// (per CTA: the sm90 kernel) or, slots == 0, per row (the sm80 kernel), rows of `width` floats
// (the kernel's O accumulator columns: d_rounded, or the sm90 d96's 128 in a build with
// FLASH_ATTN_EXT_SM90_NARROW_MMA=0), when long_rows_alloc is set (the call may have long rows;
// flash.h). Nothing for other calls (o_flush_ptr stays null).
// A dense grid of one CTA per tile, or a varlen one of real tiles only (the tight grid), takes
// about as much per CTA as per row (without the per-row layout's 512 rows a sequence); a
// persistent one (<= one CTA per SM) a few MB. (The sm90 launch never asks for slots of a varlen
// grid of one CTA per max_seqlen_q tile, mostly empty.)
inline void alloc_long_rows(Flash_fwd_params& p, int slots, int rows_per_slot, int width) {
  if (p.long_rows_alloc == nullptr) return;
  p.o_flush_width = width;
  p.o_flush_rows = slots > 0 ? rows_per_slot
                             : (p.cu_seqlens_q != nullptr ? int64_t(p.total_q) : int64_t(p.b) * p.seqlen_q) +
                                   512 * int64_t(p.b);
  const int64_t rows = (slots > 0 ? int64_t(slots) : int64_t(p.h)) * p.o_flush_rows;
  p.o_flush_ptr = p.long_rows_alloc(p.long_rows_alloc_ctx, rows * width);
  p.o_flush_max_ptr = p.long_rows_alloc(p.long_rows_alloc_ctx, rows * 4);
}

}  // namespace flash
