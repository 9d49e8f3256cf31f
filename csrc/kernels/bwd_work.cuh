// The work of one backward CTA, shared by the dK/dV and dQ kernels of every arch path
// (sm80/, sm90/): which (batch, head, tile) blockIdx.x stands for, and the range of the other
// operand's tiles its loop visits (FlashAttention-2, Dao 2023, Alg. 2: the outer loop over K/V
// blocks j for dK/dV, the loop over K/V blocks for dQ). Causal masking is bottom-right aligned:
// query row i sees keys [0, i + off], off = seqlen_k - seqlen_q.
#pragma once

#include "flash.h"
#include "primitives/cp_async.cuh"
#include "primitives/ldmatrix.cuh"

namespace flash {

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// dK/dV CTA: key block n_block of kBlockN rows of (batch bidb, kv head bidhk). blockIdx.x runs
// n_block fastest, so the heavy (early, under causal) key blocks go first and the CTAs of one
// (batch, kv head) run together and share Q / dO in L2. The CTA loops over n_iter = ratio * num_m
// iterations: every query head bidhk * ratio + it / num_m of the GQA group, and for each the Q
// tiles m_block_min + it % num_m of kBlockM rows that see some key of the block.
template <int kBlockM, int kBlockN>
struct DkvWork {
  int bidb, bidhk, n0, off, m_block_min, num_m, ratio, n_iter;

  __device__ __forceinline__ explicit DkvWork(const Flash_bwd_params& params) {
    const int num_n_blocks = ceil_div(params.seqlen_k, kBlockN);
    const int bh = blockIdx.x / num_n_blocks;
    bidb = bh / params.h_k;
    bidhk = bh % params.h_k;
    n0 = int(blockIdx.x % num_n_blocks) * kBlockN;
    off = params.seqlen_k - params.seqlen_q;
    // Causal: rows i < n0 - off see none of keys [n0, n0 + kBlockN).
    m_block_min = params.is_causal && n0 - off > 0 ? (n0 - off) / kBlockM : 0;
    const int m_block_max = ceil_div(params.seqlen_q, kBlockM);
    num_m = m_block_max > m_block_min ? m_block_max - m_block_min : 0;
    ratio = params.h_h_k_ratio;
    n_iter = num_m * ratio;
  }
  __device__ __forceinline__ int head(int it) const { return bidhk * ratio + it / num_m; }  // query head
  __device__ __forceinline__ int m0(int it) const { return (m_block_min + it % num_m) * kBlockM; }  // first Q row

  // Alg. 2 line 10, the row statistics of iteration it: lse_log2 and D of its kBlockM rows into
  // sLse / sDsum by cp.async, 16 bytes per thread of the first kBlockM / 2 threads. Whole tiles lie
  // inside the workspaces (rows rounded up to 128).
  __device__ __forceinline__ void copy_row_stats_async(const Flash_bwd_params& params, int it, float* sLse,
                                                       float* sDsum, int tid) const {
    const int64_t ws = (int64_t(bidb) * params.h + head(it)) * params.seqlen_q_rounded + m0(it);
    constexpr int kChunks = kBlockM / 4;  // 16 B = 4 floats
    if (tid < kChunks) {
      cp_async_16(smem_u32addr(sLse + tid * 4), params.softmax_lse_log2_ptr + ws + tid * 4, true);
    } else if (tid < 2 * kChunks) {
      cp_async_16(smem_u32addr(sDsum + (tid - kChunks) * 4), params.dsoftmax_sum_ptr + ws + (tid - kChunks) * 4, true);
    }
  }
};

// dQ CTA: Q tile of kBlockM rows from m0 of (batch bidb, head bidh; kv head bidhk). blockIdx.x
// runs the Q tiles fastest and in reverse, so the heavy (late, under causal) tiles go first and
// the CTAs of one (batch, head) run together and share K / V in L2. The CTA loops over the key
// blocks [0, n_block_max) of kBlockN rows that some of its rows see.
template <int kBlockM, int kBlockN>
struct DqWork {
  int bidb, bidh, bidhk, m0, off, n_block_max;

  __device__ __forceinline__ explicit DqWork(const Flash_bwd_params& params) {
    const int num_m_blocks = ceil_div(params.seqlen_q, kBlockM);
    const int bh = blockIdx.x / num_m_blocks;
    bidb = bh / params.h;
    bidh = bh % params.h;
    bidhk = bidh / params.h_h_k_ratio;
    m0 = (num_m_blocks - 1 - int(blockIdx.x % num_m_blocks)) * kBlockM;
    off = params.seqlen_k - params.seqlen_q;
    n_block_max = ceil_div(params.seqlen_k, kBlockN);
    if (params.is_causal) {
      const int keys_seen = m0 + kBlockM + off;  // keys [0, keys_seen) are visible to some row
      n_block_max = keys_seen <= 0 ? 0 : min(n_block_max, ceil_div(keys_seen, kBlockN));
    }
  }
};

}  // namespace flash
