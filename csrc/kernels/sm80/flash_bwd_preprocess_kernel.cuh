// FlashAttention-2 backward, preprocessing (Dao 2023, Alg. 2 line 4 and the LSE of line 11):
//   D_i        = rowsum(dO_i * O_i)      (fp32, = rowsum(P_i * dP_i), the softmax-gradient term)
//   lse_log2_i = LSE_i * log2(e)         (so P = exp2(S * scale * log2(e) - lse_log2))
// into the (batch, nheads, seqlen_q_rounded) float32 workspaces of Flash_bwd_params.
// Rows [seqlen_q, seqlen_q_rounded) get D = 0 and lse_log2 = +inf: the dK/dV and dQ kernels
// load whole 32/64/128-row tiles of the workspaces unpredicated, and +inf makes P = 0 there.
// A row that sees no key has LSE = +inf (forward contract) and O = 0: lse_log2 = +inf, D = 0,
// so its P and dS are exactly 0.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "flash.h"
#include "kernels/cuda_check.h"
#include "kernels/launch_utils.h"
#include "kernels/sm80/flash_bwd_common.cuh"
#include "primitives/mma.cuh"

namespace flash {
namespace bwd {

constexpr int kPreThreadsPerRow = 8;  // 8 lanes x 16 B per step across a row of O / dO
constexpr int kPreRowsPerBlock = 32;
constexpr int kPreThreads = kPreThreadsPerRow * kPreRowsPerBlock;  // 256

// Grid: 1-D, (batch * nheads) x num_row_blocks, row block fastest (64-bit offsets throughout).
template <typename Element>
__global__ void __launch_bounds__(kPreThreads)
flash_bwd_preprocess_kernel(const Flash_bwd_params params, int num_row_blocks) {
  const int row_block = blockIdx.x % num_row_blocks;
  const int bh = blockIdx.x / num_row_blocks;
  const int bidb = bh / params.h, bidh = bh % params.h;
  const int row = row_block * kPreRowsPerBlock + threadIdx.x / kPreThreadsPerRow;
  const int sub = threadIdx.x % kPreThreadsPerRow;

  // Alg. 2 line 4: D_i = rowsum(dO_i o O_i), fp32 accumulation of the Element products.
  float dsum = 0.f;
  if (row < params.seqlen_q) {
    const Element* o = reinterpret_cast<const Element*>(params.o_ptr) + bidb * params.o_batch_stride +
                       row * params.o_row_stride + bidh * params.o_head_stride;
    const Element* dout = reinterpret_cast<const Element*>(params.do_ptr) +
                          bidb * params.do_batch_stride + row * params.do_row_stride +
                          bidh * params.do_head_stride;
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

  if (sub == 0 && row < params.seqlen_q_rounded) {
    const int64_t ws = (int64_t(bidb) * params.h + bidh) * params.seqlen_q_rounded + row;
    float lse_log2 = INFINITY;
    if (row < params.seqlen_q) {
      const float lse = params.softmax_lse_ptr[(int64_t(bidb) * params.h + bidh) * params.seqlen_q + row];
      lse_log2 = lse * 1.4426950408889634f;  // +inf stays +inf
    }
    params.dsoftmax_sum_ptr[ws] = row < params.seqlen_q ? dsum : 0.f;
    params.softmax_lse_log2_ptr[ws] = lse_log2;
  }
}

// Launches the preprocess over every (batch, head, row < seqlen_q_rounded).
template <typename Element>
void run_bwd_preprocess(Flash_bwd_params& params, cudaStream_t stream) {
  const int num_row_blocks = ceil_div(params.seqlen_q_rounded, kPreRowsPerBlock);
  const int64_t blocks = int64_t(num_row_blocks) * params.b * params.h;
  launch_1d(flash_bwd_preprocess_kernel<Element>, blocks, kPreThreads, 0, "preprocess", params.d, stream, params,
            num_row_blocks);
}

}  // namespace bwd
}  // namespace flash
