// Split-KV combine (FlashDecoding, Dao et al. 2023), arch-neutral: merges the num_splits partial
// results of every query row (batch b, head, query i) by their log-sum-exps,
//   lse = log sum_s exp(lse_s),   out = sum_s exp(lse_s - lse) O_s,
// where O_s is split s's output normalized over its own keys and lse_s its natural-log LSE (flash.h:
// oaccum_ptr (num_splits, b, h, seqlen_q, d_rounded), softmax_lseaccum_ptr (num_splits, b, h,
// seqlen_q), float32; split s of sequence b in slot s * b_count + b of the leading num_splits *
// b_count, or, with balanced splits, the sequence's own count of splits (0 without keys; 1: the
// split kernel wrote the row) in slots [C_b, C_b + count): common/splitkv_work.cuh). A split
// without visible keys has lse_s = -inf: weight 0 (its O_s, written as 0 by the split kernel, adds
// nothing). A row no split saw a key of: out = 0, lse = +inf (the
// forward's contract). Exact up to float32 rounding: the weights sum to 1, every O_s is a convex
// combination of V rows.
//
// One CTA per row, so every split's loads of a row are in flight at once and even batch 1 (32
// rows) spreads over 32 SMs. Thread t owns float4 column chunk t % C of the row (C: the user's
// d / 4 rounded up to a power of two) for the splits s = g, g + G, g + 2G, ... of its group
// g = t / C (G = 128 / C groups); it issues kBatch of those loads before touching any (16 where a
// group has more than 4 splits, else 4: fewer registers, more CTAs per SM), and the first batch is
// in flight while the CTA computes the weights from the LSEs (one split per thread, reduced over
// the CTA). The groups' partial sums then add up in shared memory. Summation order is fixed
// (within a group by s, then by g): the result is deterministic.
// Launched as a programmatic dependent of the split kernel on sm_90+ (kernels/launch_utils.h):
// its CTAs may start once every split CTA has started (the split kernel triggers first thing)
// and wait (grid_dependency_wait) for the split grid's end before the first read.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "flash.h"
#include "kernels/common/seqlen.cuh"
#include "kernels/common/splitkv_work.cuh"
#include "kernels/launch_utils.h"
#include "primitives/barrier.cuh"
#include "primitives/mma.cuh"

namespace flash {

constexpr int kCombineThreads = 128;  // >= kMaxSplits: one split's LSE per thread
constexpr int kCombineWarps = kCombineThreads / 32;
static_assert(kCombineThreads >= kMaxSplits, "one LSE per thread");

// log2 of C, the float4 column chunks of a row rounded up to a power of two (d % 8 == 0, d <= 256:
// 2 <= C <= 64); G = kCombineThreads / C split groups.
__host__ __device__ __forceinline__ int combine_log2_chunks(int d) {
  int log_c = 0;
  while ((1 << log_c) < d / 4) ++log_c;
  return log_c;
}

// kBalanced: the balanced splits' twin (params.balance_splits): each row's slots and count from
// balanced_units, computed on the inputs before the wait.
template <typename Element, int kBatch, bool kBalanced = false>
__global__ void __launch_bounds__(kCombineThreads)
    flash_fwd_splitkv_combine_kernel(const Flash_fwd_params params) {
  __shared__ float s_weight[kMaxSplits];
  __shared__ float s_max[kCombineWarps], s_sum[kCombineWarps];
  __shared__ float4 s_part[kCombineThreads];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  int64_t rows = int64_t(params.b) * params.h * params.seqlen_q;  // = split stride of the LSEs
  const int64_t row = blockIdx.x;                                 // (b, head, i), i fastest
  int num_splits = params.num_splits;
  // The row in split 0's accumulator slot: plain splits, the split kernel's SplitSlots{b, b_count,
  // S} (common/splitkv_work.cuh), whose row(0, h seqlen_q, r) is `row` and stride `rows`.
  int64_t row0 = row;
  if constexpr (kBalanced) {
    // Slots [C_b, C_b + count) of sequence b (common/splitkv_work.cuh), from the same arithmetic as
    // the split kernel's on inputs only, so before the wait; the rows by SplitSlots::row, as the
    // split kernel stores them (consecutive splits step slots of h * seqlen_q rows apart).
    const int64_t hs = int64_t(params.h) * params.seqlen_q;
    const SplitSlots sl = balanced_units(params, -1, int(row / hs)).slots;
    if (sl.count == 1) {  // the split kernel wrote the row itself; the wait keeps this grid from ending first
      grid_dependency_wait();
      return;
    }
    num_splits = sl.count;  // 0: a sequence without keys (out 0, lse +inf below)
    row0 = sl.row(0, hs, row % hs), rows = sl.stride(hs);
  }

  // This thread's column chunk and split group.
  const int chunks = params.d / 4;                                  // float4 chunks of a row (d % 8 == 0)
  const int log_c = combine_log2_chunks(params.d);                  // C = 2^log_c >= chunks, <= 64
  const int groups = kCombineThreads >> log_c;                      // G >= 2
  const int chunk = tid & ((1 << log_c) - 1), group = tid >> log_c;
  const bool col_ok = chunk < chunks;
  const int64_t split_stride = rows * (params.d_rounded / 4);       // in float4
  const float4* o_s = reinterpret_cast<const float4*>(params.oaccum_ptr + row0 * params.d_rounded) + chunk;

  grid_dependency_wait();  // the split kernel's partials are complete and visible

  // O_s of splits s = group + (s0 + u) G, u < kBatch (zeros past num_splits).
  float4 x[kBatch];
  const auto load_batch = [&](int s0) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int s = group + (s0 + u) * groups;
      x[u] = col_ok && s < num_splits ? __ldcs(o_s + s * split_stride) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  const float lse_s = tid < num_splits ? __ldcs(params.softmax_lseaccum_ptr + tid * rows + row0) : -INFINITY;
  load_batch(0);

  // lse = M + log(sum_s exp(lse_s - M)), M = max_s lse_s: over the CTA (warp shuffles, then the
  // warps in order), and the weights w_s = exp(lse_s - lse) into shared memory.
  float m = lse_s;
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) s_max[warp] = m;
  __syncthreads();
  m = s_max[0];
#pragma unroll
  for (int v = 1; v < kCombineWarps; ++v) m = fmaxf(m, s_max[v]);
  float sum = m == -INFINITY ? 0.f : expf(lse_s - m);  // exp(-inf) = 0 for threads >= num_splits
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) s_sum[warp] = sum;
  __syncthreads();
  sum = s_sum[0];
#pragma unroll
  for (int v = 1; v < kCombineWarps; ++v) sum += s_sum[v];
  const bool empty = m == -INFINITY || !(sum > 0.f);
  // The row's query head, for its sink (flash.h: sinks_ptr): one more split with lse = sink and O
  // = 0, so lse = logaddexp(lse over the keys, sink) and the weights shrink with it. A row without
  // keys: lse = sink (+inf without a sink), O = 0.
  const int i = int(row % params.seqlen_q);
  const int64_t bh = row / params.seqlen_q;
  const int head = int(bh % params.h);
  float lse = empty ? INFINITY : m + logf(sum);
  if (params.sinks_ptr != nullptr) {
    const float sink = params.sinks_ptr[head];
    if (empty) {
      lse = sink == -INFINITY ? INFINITY : sink;
    } else if (sink != -INFINITY) {
      const float hi = lse > sink ? lse : sink, lo = lse > sink ? sink : lse;  // a NaN sink: NaN
      lse = hi + log1pf(expf(lo - hi));
    }
  }
  if (tid < num_splits) s_weight[tid] = empty ? 0.f : expf(lse_s - lse);
  __syncthreads();

  // out = sum_s w_s O_s: this group's splits in order, a batch of loads at a time.
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const int per_group = (num_splits - group + groups - 1) / groups;  // splits of this group
#pragma unroll 1
  for (int s0 = 0; s0 < per_group; s0 += kBatch) {
    if (s0 > 0) load_batch(s0);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int s = group + (s0 + u) * groups;
      const float w = s < num_splits ? s_weight[s] : 0.f;
      if (w > 0.f) {
        acc.x = fmaf(w, x[u].x, acc.x), acc.y = fmaf(w, x[u].y, acc.y);
        acc.z = fmaf(w, x[u].z, acc.z), acc.w = fmaf(w, x[u].w, acc.w);
      }
    }
  }
  s_part[tid] = acc;
  __syncthreads();

  // The groups' sums in order, into row (b, head, i) of out and softmax_lse (the views of
  // common/seqlen.cuh).
  if (group != 0) return;
  const SeqInfo seq(params, int(bh / params.h));
  if (col_ok) {
    float4 o = s_part[chunk];
    for (int g = 1; g < groups; ++g) {
      const float4 y = s_part[(g << log_c) + chunk];
      o.x += y.x, o.y += y.y, o.z += y.z, o.w += y.w;
    }
    uint2 packed;
    packed.x = pack2<Element>(o.x, o.y);
    packed.y = pack2<Element>(o.z, o.w);
    *reinterpret_cast<uint2*>(seq.q_row<Element>(params.o, head, i) + chunk * 4) = packed;
  }
  if (tid == 0) params.softmax_lse_ptr[seq.stat_index(params, head, i)] = lse;
}

// One CTA per (b, head, query) row; nothing to launch for an empty output. A programmatic
// dependent of the split kernel where the GPU has it (sm_90+).
template <typename Element>
void run_splitkv_combine(const Flash_fwd_params& params, cudaStream_t stream) {
  const int64_t rows = int64_t(params.b) * params.h * params.seqlen_q;
  const int groups = kCombineThreads >> combine_log2_chunks(params.d);
  // More than 4 splits per group (balanced splits: on average; a row with more loops over batches).
  const bool wide = (params.num_splits + groups - 1) / groups > 4;
  const auto kernel = params.balance_splits
                          ? (wide ? flash_fwd_splitkv_combine_kernel<Element, 16, true>
                                  : flash_fwd_splitkv_combine_kernel<Element, 4, true>)
                          : (wide ? flash_fwd_splitkv_combine_kernel<Element, 16>
                                  : flash_fwd_splitkv_combine_kernel<Element, 4>);
  launch_1d_dependent(params.arch >= 90, kernel, rows, kCombineThreads, 0, "split-KV combine", params.d_rounded, stream,
                      params);
}

}  // namespace flash
