// The per-sequence view of one CTA (FA2's BlockInfo, FA3's SeqlenInfo): where the rows of
// (batch bidb, head) live in every tensor, and how many rows each side has. Every kernel takes its
// pointers and lengths from here and never computes an offset itself, so a varlen path (row
// offsets and lengths from cu_seqlens_q/k), a KV cache (seqlen_k from cache_seqlens) or a paged
// source (rows through a block table) is a new constructor here, not an edit of the kernels.
#pragma once

#include <cstdint>

#include "flash.h"

namespace flash {

struct SeqInfo {
  int bidb;      // batch index
  int seqlen_q;  // query rows of this sequence
  int seqlen_k;  // key rows of this sequence

  __host__ __device__ __forceinline__ SeqInfo(const Flash_fwd_params& p, int bidb_)
      : bidb(bidb_), seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k) {}

  // Row `row` of head `head` of tensor t (64-bit offsets throughout).
  template <typename Element>
  __host__ __device__ __forceinline__ Element* row_ptr(const TensorView& t, int head, int row) const {
    return static_cast<Element*>(t.ptr) + bidb * t.batch_stride + head * t.head_stride +
           int64_t(row) * t.row_stride;
  }

  // Index of (head, row) in the (batch, nheads, seqlen_q) row statistics (softmax_lse, stats).
  __host__ __device__ __forceinline__ int64_t stat_index(const Flash_fwd_params& p, int head, int row) const {
    return (int64_t(bidb) * p.h + head) * seqlen_q + row;
  }

  // Index of (head, row) in the (batch, nheads, seqlen_q_rounded) backward workspaces, and of the
  // 128-row block holding it in precise_rows.
  __host__ __device__ __forceinline__ int64_t ws_index(const Flash_bwd_params& p, int head, int row) const {
    return (int64_t(bidb) * p.h + head) * p.seqlen_q_rounded + row;
  }
  __host__ __device__ __forceinline__ int64_t precise_index(const Flash_bwd_params& p, int head, int row) const {
    return (int64_t(bidb) * p.h + head) * (p.seqlen_q_rounded / 128) + row / 128;
  }
};

}  // namespace flash
