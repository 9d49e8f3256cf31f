// FlashAttention-2 backward, preprocessing (Dao 2023, Alg. 2 line 4 and the LSE of line 12), for
// every arch path: per query row i of each (batch, head),
//   D_i = rowsum(dO_i * O_i)   (fp32; = rowsum(P_i * dP_i), the softmax-gradient term)
//   LSE_i * log2(e) = hi_i + lo_i, with lo_i = 0 unless the row needs the exact recompute,
// into the (batch, nheads, seqlen_q_rounded) float32 workspaces of Flash_bwd_params, and one
// precise_rows flag per 128 rows (a CTA's rows): 1 when some row has lo != 0.
//
// hi / lo come from the forward's (row max m, log2 l) when the op has them (flash.h): for
// |m| < 2^10 they fold into hi = m + log2 l (the fold and the FFMA of the fast recompute then err
// by < 2^-13 in the exponent), else hi = m, lo = log2 l exactly. From the LSE alone (a caller's
// own softmax_lse): hi = LSE * log2(e), lo = 0, and rows with |hi| >= 2^10 still take the exact
// path (scores rounded as the forward did, P clamped to <= 1). Rows past seqlen_q and rows that
// see no key (LSE = +inf, forward contract: O = 0) get hi = +inf, lo = 0, D = 0: P = dS = 0.
// Varlen (flash.h): the grid is sized by max_seqlen_q; sequence b's rows past seqlen_q up to its
// rows rounded up to 128 (SeqInfo::ws_rows: what a Q tile can read) get the same (+inf, 0, 0), and
// no row past them is written (the next sequence's region of the workspaces); a 128-row block
// past the sequence's end writes only its flag (0). On a varlen tight grid (work.cuh:
// varlen_tight_grid, 128-row blocks) only the sequences' own blocks run: the flags of the blocks
// past a sequence's end stay unwritten, and no kernel reads them (the dQ and dK/dV kernels read
// the flags of their own Q tiles, which start before the sequence's end).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "flash.h"
#include "kernels/common/mask.cuh"
#include "kernels/common/seqlen.cuh"
#include "kernels/common/work.cuh"
#include "kernels/launch_utils.h"
#include "primitives/mma.cuh"
#include "primitives/softmax.cuh"

namespace flash {

constexpr int kPreThreadsPerRow = 8;  // 8 lanes x 16 B per step across a row of O / dO
constexpr int kPreRowsPerPass = 64;
constexpr int kPreRowsPerBlock = 128;  // = one precise_rows flag; two passes of 64 rows
constexpr int kPreThreads = kPreThreadsPerRow * kPreRowsPerPass;  // 512

// Whether a call's preprocess runs on a varlen tight grid (host and device alike).
__host__ __device__ __forceinline__ bool preprocess_tight(const Flash_bwd_params& params) {
  return varlen_tight_grid(params.varlen_tight, params.cu_seqlens_q, params.b, params.total_q,
                           params.seqlen_q_rounded, kPreRowsPerBlock, params.h);
}

// Grid: 1-D, (batch * nheads) x num_row_blocks, row block fastest (64-bit offsets throughout), or
// a varlen tight grid whose CTA finds that index by varlen_dense_index (warp-collective: warp 0
// computes it and shares it through shared memory, which keeps the kernel at main's registers where
// every warp computing it took 64 on sm_80; a CTA past every real block returns).
template <typename Element>
__global__ void __launch_bounds__(kPreThreads)
flash_bwd_preprocess_kernel(const Flash_bwd_params params, int num_row_blocks) {
  unsigned idx = blockIdx.x;  // 32-bit: a grid index, or a tight grid's dense index (< 2^31)
  if (preprocess_tight(params)) {
    // (max_len seqlen_q_rounded: its blocks are num_row_blocks, and a sequence cut to max_seqlen_q
    // has as many blocks either way)
    __shared__ int s_dense;
    if (threadIdx.x < 32) {
      const int64_t dense = varlen_dense_index<kPreRowsPerBlock, false>(
          params.cu_seqlens_q, params.b, params.total_q, params.seqlen_q_rounded, params.h, blockIdx.x);
      if (threadIdx.x == 0) s_dense = int(dense);
    }
    __syncthreads();
    const int dense = s_dense;
    if (dense < 0) return;
    idx = unsigned(dense);
  }
  const int row_block = int(idx % unsigned(num_row_blocks));
  const int bh = int(idx / unsigned(num_row_blocks));
  const SeqInfo seq(params, bh / params.h);
  const int head = bh % params.h;
  const int sub = threadIdx.x % kPreThreadsPerRow;
  const int ws_rows = seq.ws_rows(params);
  bool exact = false;
  if (row_block * kPreRowsPerBlock >= ws_rows) {  // varlen only: a block past the sequence's rows
    if (threadIdx.x == 0) params.precise_rows_ptr[seq.precise_index(params, head, row_block * kPreRowsPerBlock)] = 0;
    return;
  }

#pragma unroll
  for (int pass = 0; pass < kPreRowsPerBlock / kPreRowsPerPass; ++pass) {
    const int row = row_block * kPreRowsPerBlock + pass * kPreRowsPerPass + threadIdx.x / kPreThreadsPerRow;
    // Alg. 2 line 4: D_i = rowsum(dO_i o O_i), fp32 accumulation of the Element products.
    float dsum = 0.f;
    if (row < seq.seqlen_q) {
      const Element* o = seq.q_row<const Element>(params.o, head, row);
      const Element* dout = seq.q_row<const Element>(params.dout, head, row);
      for (int col = sub * 8; col < params.d; col += kPreThreadsPerRow * 8) {
        const uint4 ov = *reinterpret_cast<const uint4*>(o + col);
        const uint4 dv = *reinterpret_cast<const uint4*>(dout + col);
        const uint32_t o_w[4] = {ov.x, ov.y, ov.z, ov.w};
        const uint32_t d_w[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 of = unpack2<Element>(o_w[i]);
          const float2 df = unpack2<Element>(d_w[i]);
          dsum += of.x * df.x + of.y * df.y;
        }
      }
    }
    // The 8 lanes of a row are aligned groups of 8 within the warp.
#pragma unroll
    for (int offset = 1; offset < kPreThreadsPerRow; offset *= 2) {
      dsum += __shfl_xor_sync(0xffffffffu, dsum, offset);
    }

    // The row's LSE_log2 as hi + lo (see the header).
    float hi = INFINITY, lo = 0.f;
    if (row < seq.seqlen_q) {
      const int64_t si = seq.stat_index(params, head, row);
      if (params.row_max_ptr != nullptr) {
        const float m = params.row_max_ptr[si], l2 = params.row_log2sum_ptr[si];
        if (m != INFINITY) {
          const bool apart = !(fabsf(m) < kExactLimit);  // NaN too: it stays NaN on the exact path
          exact |= apart;
          hi = apart ? m : m + l2;
          lo = apart ? l2 : 0.f;
        }
      } else {
        hi = params.softmax_lse_ptr[si] * 1.4426950408889634f;  // +inf stays +inf
        exact |= hi != INFINITY && !(fabsf(hi) < kExactLimit);
      }
    }
    if (sub == 0 && row < ws_rows) {
      const int64_t ws = seq.ws_index(params, head, row);
      params.dsoftmax_sum_ptr[ws] = row < seq.seqlen_q ? dsum : 0.f;
      params.softmax_lse_log2_ptr[ws] = hi;
      params.softmax_lse_log2_lo_ptr[ws] = lo;
    }
  }
  const bool any_exact = __syncthreads_or(exact) != 0;
  if (threadIdx.x == 0) {
    params.precise_rows_ptr[seq.precise_index(params, head, row_block * kPreRowsPerBlock)] = any_exact ? 1 : 0;
  }
}

// Launches the preprocess over every (batch, head, row < seqlen_q_rounded), or over the varlen
// sequences' own 128-row blocks (a tight grid).
template <typename Element>
void run_bwd_preprocess(Flash_bwd_params& params, cudaStream_t stream) {
  const int num_row_blocks = params.seqlen_q_rounded / kPreRowsPerBlock;
  const int64_t blocks = preprocess_tight(params)
                             ? varlen_tight_per_head(params.total_q, params.b, kPreRowsPerBlock) * params.h
                             : int64_t(num_row_blocks) * params.b * params.h;
  launch_1d(flash_bwd_preprocess_kernel<Element>, blocks, kPreThreads, 0, "preprocess", params.d, stream, params,
            num_row_blocks);
}

}  // namespace flash
