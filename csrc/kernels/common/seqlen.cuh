// The per-sequence view of one CTA (FA2's BlockInfo, FA3's SeqlenInfo): where the rows of
// (batch bidb, head) live in every tensor, and how many rows each side has. Every kernel takes its
// pointers and lengths from here and never computes an offset itself. Three sources (flash.h):
//   dense   (b, seqlen, heads, d) tensors, every sequence seqlen_q x seqlen_k;
//   varlen  packed (total, heads, d) tensors, sequence b = rows [cu_seqlens[b], cu_seqlens[b + 1])
//           of each side (batch_stride 0), its lengths the differences;
//   KV cache  dense q, a (b, seqlen_k, heads_k, d) cache of which sequence b sees its
//           first cache_seqlens[b] + seqlen_knew rows (with leftpad_k: those from row leftpad_k[b]
//           on). A KV-cache kernel reads the cache's rows through common/paged_kv.cuh
//           (KvCacheRows: the block table, the leftpad), never through k_row below.
#pragma once

#include <cstdint>

#include "flash.h"

namespace flash {

struct SeqInfo {
  int bidb;      // batch index (sequence)
  int seqlen_q;  // query rows of this sequence
  int seqlen_k;  // key rows of this sequence (visible to it: a KV cache's used rows)
  int q_offset;  // first row of this sequence in the q-side tensors (varlen), else 0
  int k_offset;  // first row of this sequence in the k-side tensors (varlen), else 0

  __host__ __device__ __forceinline__ SeqInfo(const Flash_fwd_params& p, int bidb_) : bidb(bidb_) {
    if (p.cu_seqlens_q != nullptr) {
      // Lengths capped at max_seqlen_q / max_seqlen_k (p.seqlen_q / p.seqlen_k): the grids and
      // workspaces cover no more, so a sequence longer than the caller's max is attention over its
      // first max rows, its other rows never computed (flash.h), and no CTA reads past its
      // workspace or block flags.
      q_offset = p.cu_seqlens_q[bidb];
      seqlen_q = min(max(p.cu_seqlens_q[bidb + 1] - q_offset, 0), p.seqlen_q);
      k_offset = p.cu_seqlens_k[bidb];
      seqlen_k = min(max(p.cu_seqlens_k[bidb + 1] - k_offset, 0), p.seqlen_k);
    } else {
      q_offset = 0, k_offset = 0;
      seqlen_q = p.seqlen_q;
      seqlen_k = p.cache_seqlens == nullptr ? p.seqlen_k : kv_seqlen_k(p, bidb);
    }
  }

  // A KV cache (p.cache_seqlens set): the rows sequence b uses, cache_seqlens[b] + seqlen_knew
  // capped to the cache, and the first of them it sees (flash.h: leftpad_k, capped to [0, used];
  // the API cannot check it on the device without a sync; it sets cache_seqlens whenever it sets
  // leftpad_k). Its keys are rows [leftpad, used): seqlen_k = used - leftpad, and KvCacheRows adds
  // the leftpad to a key row.
  // Without overflow for any int32 cache_seqlens (on CUDA it is not read on the host; 2^31 - 1 plus
  // seqlen_knew wrapped negative and hid every key): the sum is formed only where it is below
  // seqlen_k (both sizes are >= 0, so seqlen_k - seqlen_knew cannot overflow).
  __host__ __device__ __forceinline__ static int kv_used_rows(const Flash_fwd_params& p, int bidb) {
    const int cached = p.cache_seqlens[bidb];
    return cached >= p.seqlen_k - p.seqlen_knew ? p.seqlen_k : max(cached + p.seqlen_knew, 0);
  }
  __host__ __device__ __forceinline__ static int kv_leftpad(const Flash_fwd_params& p, int bidb, int used) {
    return p.leftpad_k == nullptr ? 0 : min(max(p.leftpad_k[bidb], 0), used);
  }
  __host__ __device__ __forceinline__ static int kv_seqlen_k(const Flash_fwd_params& p, int bidb) {
    const int used = kv_used_rows(p, bidb);
    return used - kv_leftpad(p, bidb, used);
  }

  // The same view with q_offset / k_offset read again from cu_seqlens (varlen; dense: 0, no load),
  // for code inside or after a kernel's main loop: the compiler would otherwise keep the offsets
  // live in registers across the loop, where an L1-resident load per use is cheaper than a spilled
  // register. `dep`: a value the load is made to depend on (inside a loop its counter, so the load
  // is neither hoisted out of the loop nor its value kept from one iteration to the next). The
  // lengths are this view's.
  __device__ __forceinline__ SeqInfo reload_q_offset(const Flash_fwd_params& p, int dep) const {
    SeqInfo s = *this;
    s.q_offset = p.cu_seqlens_q == nullptr ? 0 : load_dependent(p.cu_seqlens_q + bidb, dep);
    return s;
  }
  __device__ __forceinline__ SeqInfo reload_k_offset(const Flash_fwd_params& p, int dep) const {
    SeqInfo s = *this;
    s.k_offset = p.cu_seqlens_k == nullptr ? 0 : load_dependent(p.cu_seqlens_k + bidb, dep);
    return s;
  }
  // A read-only int load that the compiler treats as a function of (ptr, dep): not volatile (an
  // unused one disappears), but it cannot move out of a loop that changes dep.
  __device__ __forceinline__ static int load_dependent(const int* ptr, int dep) {
    int v;
    asm("ld.global.nc.b32 %0, [%1]; // dep %2\n" : "=r"(v) : "l"(ptr), "r"(dep));
    return v;
  }

  // Row `row` of head `head` of a q-side tensor (q, out, dout, dq) and of a k-side one (k, v, dk,
  // dv; a contiguous cache), 64-bit offsets throughout.
  template <typename Element>
  __host__ __device__ __forceinline__ Element* q_row(const TensorView& t, int head, int row) const {
    return static_cast<Element*>(t.ptr) + bidb * t.batch_stride + head * t.head_stride +
           (int64_t(q_offset) + row) * t.row_stride;
  }
  template <typename Element>
  __host__ __device__ __forceinline__ Element* k_row(const TensorView& t, int head, int row) const {
    return static_cast<Element*>(t.ptr) + bidb * t.batch_stride + head * t.head_stride +
           (int64_t(k_offset) + row) * t.row_stride;
  }

  // Index of (head, row) in the row statistics (softmax_lse, the softmax_stats planes):
  // (batch, nheads, seqlen_q), or (nheads, total_q) for varlen.
  __host__ __device__ __forceinline__ int64_t stat_index(const Flash_fwd_params& p, int head, int row) const {
    return p.cu_seqlens_q != nullptr ? int64_t(head) * p.total_q + q_offset + row
                                     : (int64_t(bidb) * p.h + head) * seqlen_q + row;
  }

  // Index of (head, row) in the backward workspaces: (batch, nheads, seqlen_q_rounded), or
  // (nheads, varlen_ws_rows) with sequence b from round_up(cu_seqlens_q[b], 4) + kVarlenWsPad * b
  // (flash.h); rows up to seqlen_q rounded up to 128 lie inside either. And of the 128-row block
  // holding it in precise_rows, (batch, nheads, seqlen_q_rounded / 128) in both layouts.
  // ws_index(p, head, row) = ws_index(p, 0, 0) + head * ws_head_stride(p) + row.
  __host__ __device__ __forceinline__ int64_t ws_index(const Flash_bwd_params& p, int head, int row) const {
    if (p.cu_seqlens_q == nullptr) return (int64_t(bidb) * p.h + head) * p.seqlen_q_rounded + row;
    const int64_t start = int64_t(unsigned(q_offset + 3) & ~3u) + int64_t(kVarlenWsPad) * bidb;  // q_offset >= 0
    return int64_t(head) * varlen_ws_rows(p.total_q, p.b) + start + row;
  }
  __host__ __device__ __forceinline__ static int64_t ws_head_stride(const Flash_bwd_params& p) {
    return p.cu_seqlens_q == nullptr ? int64_t(p.seqlen_q_rounded) : varlen_ws_rows(p.total_q, p.b);
  }
  // Rows of the backward workspaces of (this sequence, a head) the preprocess writes: every row a
  // Q tile of <= 128 rows can touch (seqlen_q rounded up to 128; dense: seqlen_q_rounded). Varlen:
  // rows past that belong to the next sequence's region.
  __host__ __device__ __forceinline__ int ws_rows(const Flash_bwd_params& p) const {
    return p.cu_seqlens_q == nullptr ? p.seqlen_q_rounded : (seqlen_q + 127) / 128 * 128;
  }
  __host__ __device__ __forceinline__ int64_t precise_index(const Flash_bwd_params& p, int head, int row) const {
    return (int64_t(bidb) * p.h + head) * (p.seqlen_q_rounded / 128) + row / 128;
  }

  // TMA coordinates (primitives/tma.cuh: a tensor map of (d, rows, heads, batch)) of row `row`:
  // the row and batch coordinates of a q-side and a k-side map. Varlen maps describe the packed
  // tensors as one batch of total_q / total_k rows (dispatch.cu: tma_can_describe_inputs), so the
  // sequence's offset moves the row and the batch coordinate is 0.
  __host__ __device__ __forceinline__ int tma_batch(const Flash_fwd_params& p) const {
    return p.cu_seqlens_q == nullptr ? bidb : 0;
  }
  __host__ __device__ __forceinline__ int q_tma_row(int row) const { return q_offset + row; }
  __host__ __device__ __forceinline__ int k_tma_row(int row) const { return k_offset + row; }
};

}  // namespace flash
