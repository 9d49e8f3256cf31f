// Append of new keys and values into a KV cache (flash_attn_with_kvcache's k / v), arch-neutral:
// row i of knew / vnew (b, seqlen_knew, h_k, d) goes to cache row cache_seqlens[b] + i of
// sequence b, through the cache's row map (common/paged_kv.cuh: contiguous or paged). Rows that
// would land past the cache (>= seqlen_k, the capacity) or in a block outside [0, num_blocks) are
// dropped, never written out of bounds. K and V in one launch, before the attention on the same
// stream (so the attention sees them); the caller advances cache_seqlens (flash-attn semantics).
// One thread per 16-byte chunk of a (sequence, new row, kv head) row of K and of V.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flash.h"
#include "kernels/common/paged_kv.cuh"
#include "kernels/common/seqlen.cuh"
#include "kernels/launch_utils.h"

namespace flash {

constexpr int kAppendThreads = 256;

template <typename Element>
__global__ void __launch_bounds__(kAppendThreads) flash_append_kv_kernel(const Flash_fwd_params params) {
  const int chunks_per_row = params.d / 8;  // the user's head dim: columns past it are not the cache's
  const int64_t idx = int64_t(blockIdx.x) * kAppendThreads + threadIdx.x;
  const int64_t total = int64_t(params.b) * params.seqlen_knew * params.h_k * chunks_per_row;
  if (idx >= total) return;
  const int col = int(idx % chunks_per_row) * 8;
  int64_t rest = idx / chunks_per_row;
  const int head = int(rest % params.h_k);
  rest /= params.h_k;
  const int i = int(rest % params.seqlen_knew);
  const int bidb = int(rest / params.seqlen_knew);
  const int64_t j = int64_t(params.cache_seqlens[bidb]) + i;  // destination row of the cache
  if (j < 0 || j >= params.seqlen_k) return;
  const int2 loc = KvCacheRows(params, bidb).locate_cache_row(int(j));
  if (loc.x < 0) return;
  // Row i of knew / vnew (b, seqlen_knew, h_k, d): dense, no sequence offset.
  const auto new_row = [&](const TensorView& t) {
    return static_cast<const Element*>(t.ptr) + bidb * t.batch_stride + head * t.head_stride +
           int64_t(i) * t.row_stride;
  };
  const uint4 k = *reinterpret_cast<const uint4*>(new_row(params.knew) + col);
  const uint4 v = *reinterpret_cast<const uint4*>(new_row(params.vnew) + col);
  *reinterpret_cast<uint4*>(KvCacheRows::row_ptr<Element>(params.k, head, loc) + col) = k;
  *reinterpret_cast<uint4*>(KvCacheRows::row_ptr<Element>(params.v, head, loc) + col) = v;
}

// Needs params.cache_seqlens (the API requires it with k / v); nothing to launch without new rows.
template <typename Element>
void run_append_kv(const Flash_fwd_params& params, cudaStream_t stream) {
  if (params.knew.ptr == nullptr || params.seqlen_knew <= 0) return;
  const int64_t total = int64_t(params.b) * params.seqlen_knew * params.h_k * (params.d / 8);
  launch_1d(flash_append_kv_kernel<Element>, (total + kAppendThreads - 1) / kAppendThreads, kAppendThreads, 0,
            "KV-cache append", params.d_rounded, stream, params);
}

}  // namespace flash
