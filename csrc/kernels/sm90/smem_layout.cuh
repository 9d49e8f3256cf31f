// Shared-memory tiles of the Hopper (sm90) path: (kRows x kCols) 16-bit elements in the
// 128-byte-swizzle layout that wgmma reads through matrix descriptors (primitives/wgmma.cuh),
// and fp32 accumulators -> shared. Global <-> shared copies are primitives/tile_copy.cuh with
// SwizzledTile as the layout. The one include of the sm90 kernels' headers (work split, mask,
// softmax, primitives, tile table, launch).
//
// Layout: kCols / 64 column blocks of kRows x 64 elements (kRows * 128 bytes each, 1024-byte
// aligned); inside a block, row r takes 128 bytes and its 16-byte chunk c (elements 8c..8c+7)
// sits at chunk position c ^ (r % 8). The same XOR makes the cp.async writes, the accumulator
// stores and the 16-byte reads of the output copies bank-conflict free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "flash.h"
#include "kernels/arch.h"
#include "kernels/common/work.cuh"
#include "kernels/launch_utils.h"
#include "kernels/sm90/tile_config.h"
#include "primitives/barrier.cuh"
#include "primitives/cp_async.cuh"
#include "primitives/ldmatrix.cuh"
#include "primitives/math.cuh"
#include "primitives/mma.cuh"
#include "primitives/philox.cuh"
#include "primitives/softmax.cuh"
#include "primitives/tile_copy.cuh"
#include "primitives/tma.cuh"
#include "primitives/wgmma.cuh"

namespace flash {
namespace sm90 {

// The kernel's dynamic shared memory from its first 1024-byte boundary (the swizzle atoms need
// that alignment; the sm90 kernels' kSmemBytes carry 1024 bytes of slack for it).
__device__ __forceinline__ unsigned char* aligned_dynamic_smem() {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_addr = smem_u32addr(smem_raw);
  return smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
}

// The N width of the products whose N axis is the head dim (the forward's O += P V, the backward's
// dV, dK and dQ): the head dim itself at d96, where the shared tiles are 128 columns (two 64-column
// swizzle atoms, the second half zeros) but an N-major B operand of 96 columns reads only the first
// atom and half of the second, so the products skip the padding's 25 % of their tensor work and
// registers (accumulators of 12 n8 blocks, not 16); else the padded width (whole atoms).
// -DFLASH_ATTN_EXT_SM90_NARROW_MMA=0 runs d96 on the padded 128 (A/B measurements).
#ifndef FLASH_ATTN_EXT_SM90_NARROW_MMA
#define FLASH_ATTN_EXT_SM90_NARROW_MMA 1
#endif
constexpr int head_dim_mma(int head_dim) {
  return FLASH_ATTN_EXT_SM90_NARROW_MMA && head_dim == 96 ? 96 : (head_dim + 63) / 64 * 64;
}

// The 128-byte-swizzle layout (primitives/tma.cuh: Swizzle128Tile) with the wgmma descriptors of
// its operands.
template <int kRows, int kCols>
struct SwizzledTile : Swizzle128Tile<kRows, kCols> {
  using Swizzle128Tile<kRows, kCols>::kColBlockBytes;

  // A descriptor's address field is (address >> 4) in its low 14 bits, and every shared address
  // is below 2^18: the descriptor of base + bytes is the descriptor of base plus bytes >> 4 (no
  // carry out of the field). So the descriptors below are built once per (base, r0) and step by a
  // constant per k16 step (an add, instead of the masks and shifts of make_wgmma_desc per HGMMA).
  __device__ __forceinline__ static constexpr uint64_t step(int bytes) { return uint64_t(bytes >> 4); }

  // Descriptor of the K-major operand made of rows [r0, r0 + 64) (r0 % 8 == 0), columns
  // [16kk, 16kk + 16) as K: "S = Q K^T"-shaped products read A and B this way.
  __device__ __forceinline__ static uint64_t desc_k_major(uint32_t base, int r0, int kk) {
    return make_wgmma_desc(base + r0 * 128, 16, 1024) + step((kk / 4) * kColBlockBytes + (kk % 4) * 32);
  }

  // Descriptor of the N-major B operand made of rows [16kk, 16kk + 16) as K and all kCols
  // columns as N: "dV += P^T dO"-shaped products read B this way.
  __device__ __forceinline__ static uint64_t desc_mn_major(uint32_t base, int kk) {
    return make_wgmma_desc(base, kColBlockBytes, 1024) + step(kk * 16 * 128);
  }
};

// Shared-memory regions of the given byte sizes laid one after another from the aligned base:
// offset(i) is the sum of the sizes before region i, kBytes the sum of all of them.
template <int... kSizes>
struct SmemRegions {
  static constexpr int offset(int i) {
    constexpr int sizes[] = {kSizes...};
    int bytes = 0;
    for (int j = 0; j < i; ++j) bytes += sizes[j];
    return bytes;
  }
  static constexpr int kBytes = offset(sizeof...(kSizes));
};

// What the traits of the sm90 backward kernels share: the tile row's kBlockM x kBlockN, kWarpGroups
// warpgroups (the rows kernels: one per 64 rows of the wgmma M axis, K rows for dK/dV, Q rows for
// dQ; the roles kernels: two), and the swizzled Q and K/V tiles, whole 64-column
// swizzle blocks: d96 runs 128 columns there, as the forward does (the copies zero-fill the
// columns past the user's d, S takes only the head dim's k16 steps, and the outputs' extra
// columns are never stored).
template <int kHeadDim, typename Tile, int kWarpGroups_>
struct BwdTileTraits {
  static constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN;
  static constexpr int kHeadDimPad = (kHeadDim + 63) / 64 * 64;
  static constexpr int kHeadDimMma = head_dim_mma(kHeadDim);  // N of dK, dV, dQ (the rows kernels)
  static constexpr int kWarpGroups = kWarpGroups_;
  static constexpr int kThreads = kWarpGroups * 128;
  using TileQ = SwizzledTile<kBlockM, kHeadDimPad>;
  using TileKV = SwizzledTile<kBlockN, kHeadDimPad>;
};

// Tensor maps of the backward's streamed tiles (primitives/tma.cuh), encoded per call by the launch
// (calls whose inputs TMA can describe; varlen as one batch of the packed rows): q and dout for the
// dK/dV kernel, k and v for the dQ kernel. A __grid_constant__ kernel parameter; unused (zeros) by
// a kernel that copies by cp.async.
struct BwdTmaMaps {
  CUtensorMap a, b;
};

// acc = A B^T over the head dim's k16 steps [0, kSteps): A the 64 rows of a K-major tile at sA, B the
// kN rows of one at sB (the roles kernels' S / dP products and their transposes), issued as one wgmma
// group (the caller waits for it).
template <typename Element, int kN, int kSteps, typename TileA, typename TileB>
__device__ __forceinline__ void gemm_ss(float (&acc)[kN / 2], uint32_t sA, uint32_t sB) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    Wgmma<Element, kN>::template ss<0>(acc, TileA::desc_k_major(sA, 0, kk), TileB::desc_k_major(sB, 0, kk), kk > 0);
  }
  wgmma_commit();
}

// Alg. 2 line 12 on a dQ-kernel (query x key) accumulator: P = exp2(S scale_log2 - LSE_log2) in
// place for a warpgroup's 64 query rows (this thread's: row0, row0 + 8; hi = their LSE_log2's
// leading part, lo_ptr at row0's trailing part, row0 + 8's 8 further) against keys n0 + 8 j + 2 t
// (+1) of kNBlk n8 blocks. The masks (a key past seqlen_k or after the query -> P = 0) and the exact
// recompute are compiled into other copies of the loop that run on the last key block, causal
// diagonal blocks, a sliding window's edge blocks and tiles with large-magnitude rows only (a
// uniform branch). kLocal: the kernel's twin for a window's left bound (mask.cuh: visible<kLocal>).
// kSoftcapGrad: acc holds the soft-capped scores t (softmax.cuh: softcap_scores) and gets P (1 - t^2),
// the dQ kernels' P, which feeds only dS = P o (dP - D) (softmax.cuh: SoftcapGrad).
template <bool kLocal, bool kSoftcapGrad = false, int kNBlk, typename Mask>
__device__ __forceinline__ void recompute_p_rows(float (&acc)[kNBlk][4], const Mask& mask, bool precise,
                                                 bool needs_mask, float scale_log2, const float (&hi)[2],
                                                 const float* lo_ptr, int row0, int n0, int t) {
  with_p_mode(precise, needs_mask, [&](auto mode) {
    constexpr PMode kMode = decltype(mode)::value;
    float lo[2] = {0.f, 0.f};
    if constexpr (kMode == PMode::kExact) {
      lo[0] = lo_ptr[0];
      lo[1] = lo_ptr[8];
    }
#pragma unroll
    for (int j = 0; j < kNBlk; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = recompute_p<kMode>(acc[j][e], scale_log2, hi[e / 2], lo[e / 2],
                                           mask.template visible<kLocal>(row0 + 8 * (e / 2), n0 + 8 * j + 2 * t + (e % 2)));
        acc[j][e] = kSoftcapGrad ? p * fmaf(-acc[j][e], acc[j][e], 1.f) : p;
      }
    }
  });
}

// The ring of stages through which the sm90 backward kernels stream their tiles (Q_i / dO_i and
// their statistics for dK/dV, K_j / V_j for dQ): load(i, stage) copies item i into a stage, and the
// kernel calls start once, acquire(i) before and release(i) after its products of item i, and
// refill(i) after release(i).
//   kTma: kStages_ stages. Thread kLoader loads a stage by TMA, completing on its full mbarrier;
//     every thread arrives on its empty mbarrier once done with it, and the loader refills it with
//     item i + kStages_ once all have. No CTA-wide barrier in the loop (warpgroups run apart by up
//     to kStages_ - 1 items).
//   cp.async: two stages. Every thread copies its share of item i + 1 while item i is computed
//     (primitives/cp_async.cuh: pipeline_step), a CTA barrier before and after each item.
// kLoader is the first thread of the last warpgroup (of the roles kernels: warpgroup 1, whose role
// finishes each item last).
template <bool kTma, int kThreads, int kStages_ = 2>
struct BwdStages {
  // One stage would deadlock: the loader would wait for its own release within the same item.
  static_assert(kStages_ >= 2, "BwdStages needs two stages at least");
  static constexpr int kLoader = kThreads - 128;
  // Stages in use: kStages_ by TMA, two by cp.async (primitives/cp_async.cuh: pipeline_step).
  static constexpr int kStages = kTma ? kStages_ : 2;
  uint32_t bars;  // shared address of the full mbarriers of stages 0 .. kStages_ - 1, then the empty ones

  __device__ __forceinline__ explicit BwdStages(uint32_t bars_) : bars(bars_) {}

  __device__ __forceinline__ static int stage(int i) { return i % kStages; }  // item i's stage
  __device__ __forceinline__ uint32_t full(int s) const { return bars + 8 * s; }
  __device__ __forceinline__ uint32_t empty(int s) const { return bars + 8 * (kStages_ + s); }
  __device__ __forceinline__ uint32_t end() const { return bars + 16 * kStages_; }  // past its barriers

  // The start of the kernel: the barriers (the loader: after any barriers of its own, fenced
  // together), the first items (kTma: the first kStages by TMA; else the first by every thread,
  // cp.async), the caller's own cp.async copies (`resident()`: the tiles that stay), all landed and
  // visible to wgmma at the CTA barrier that ends it (a cp.async ring waits for its items in acquire).
  template <typename Load, typename Resident>
  __device__ __forceinline__ void start(int tid, const BwdTmaMaps& maps, int n, Load&& load,
                                        Resident&& resident) const {
    if (tid == kLoader) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) {
        mbarrier_init(full(s), 1);           // kTma: the loader's arrive.expect_tx; the copies the bytes
        mbarrier_init(empty(s), kThreads);  // kTma: every thread, once done with the stage
      }
      mbarrier_init_fence();
      if constexpr (kTma) {
        fence_proxy_async();  // the inits ordered before this thread's TMA completes bytes on them
        tma_prefetch_map(&maps.a);
        tma_prefetch_map(&maps.b);
        for (int i = 0; i < kStages && i < n; ++i) load(i, i);
      }
    }
    __syncwarp();
    if constexpr (!kTma) {
      if (n > 0) load(0, 0);
    }
    resident();
    cp_async_commit();
    if constexpr (kTma) {
      cp_async_wait<0>();
      fence_proxy_async();
    }
    __syncthreads();
  }
  // Item i in its stage, landed and visible to wgmma.
  template <typename Load>
  __device__ __forceinline__ void acquire(int i, int n, Load&& load) const {
    if constexpr (kTma) {
      mbarrier_wait(full(stage(i)), (i / kStages) % 2);
    } else {
      pipeline_step</*kAsyncProxy=*/true>(i, n, load);  // item i + 1 in flight
    }
  }
  // This thread is done with item i's stage: kTma arrives on its empty barrier (refill reloads it),
  // cp.async waits for every thread at a CTA barrier.
  __device__ __forceinline__ void release(int i) const {
    if constexpr (kTma) {
      mbarrier_arrive(empty(stage(i)));
    } else {
      __syncthreads();
    }
  }
  // kTma: the loader waits until every thread released item i, then loads item i + kStages into its
  // stage (none for i < 0 or past n); the loader's warp converges again before its next
  // warpgroup-wide wgmma. Its warpgroup waits with it: the rows kernels and the dK/dV roles kernel
  // call it in iteration i + kStages - 1 (loading the next item) once they have issued that
  // iteration's first products (the loader's wait and copies then run under them), the dQ roles
  // kernel right after release(i) (measured faster there: its CTA barrier per tile). So the
  // next item is always one tile ahead; stages past two do not prefetch deeper, they let the loader
  // refill a stage released kStages - 1 tiles ago instead of waiting for the other warpgroup.
  // Nothing for cp.async (acquire loads).
  template <typename Load>
  __device__ __forceinline__ void refill(int i, int n, int tid, Load&& load) const {
    if constexpr (kTma) {
      if (tid == kLoader && i >= 0 && i + kStages < n) {
        mbarrier_wait(empty(stage(i)), (i / kStages) % 2);
        load(i + kStages, stage(i));
      }
      __syncwarp();
    }
  }
};

// Alg. 2 line 10 of the dK/dV kernels: Q_i, dO_i and their row statistics (hi, lo: LSE_log2 = hi +
// lo; D) of iteration it (query head, Q tile) into `stage` of the shared layout of traits T (kOffQ,
// kOffDO: stages of TileQ::kBytes; kOffHi, kOffLo, kOffDsum: stages of kBlockM floats).
//   kTma: by the calling (loader) thread, TMA boxes of whole 64-column blocks (rows past seqlen_q,
//     columns past d read as zeros) and bulk copies, completing their bytes on the stage's full
//     mbarrier `full` (BwdStages::full).
//   else: every thread its share, cp.async (kernels/common/work.cuh).
template <bool kTma, typename Element, typename T, typename Work>
__device__ __forceinline__ void load_dkv_stage(const Work& w, const Flash_bwd_params& params, const BwdTmaMaps& maps,
                                               unsigned char* smem, int it, int stage, uint32_t full, int tid) {
  using TileQ = typename T::TileQ;
  constexpr int kBlockM = T::kBlockM;
  const uint32_t sQ = smem_u32addr(smem + T::kOffQ + stage * TileQ::kBytes);
  const uint32_t sdO = smem_u32addr(smem + T::kOffDO + stage * TileQ::kBytes);
  float* sHi = reinterpret_cast<float*>(smem + T::kOffHi) + stage * kBlockM;
  float* sLo = reinterpret_cast<float*>(smem + T::kOffLo) + stage * kBlockM;
  float* sDsum = reinterpret_cast<float*>(smem + T::kOffDsum) + stage * kBlockM;
  if constexpr (kTma) {
    const int head = w.head(it), row = w.seq.q_tma_row(w.m0(it)), bidb = w.seq.tma_batch(params);
    const uint64_t policy = l2_policy_evict_last();  // read again by the other key blocks' CTAs
    mbarrier_arrive_expect_tx(full, 2 * TileQ::kBytes + 3 * kBlockM * 4);
#pragma unroll
    for (int cb = 0; cb < T::kHeadDimPad / 64; ++cb) {
      tma_load_4d(sQ + cb * TileQ::kColBlockBytes, &maps.a, full, 64 * cb, row, head, bidb, policy);
      tma_load_4d(sdO + cb * TileQ::kColBlockBytes, &maps.b, full, 64 * cb, row, head, bidb, policy);
    }
    const int64_t ws = w.ws_row0(params, it);
    bulk_copy_g2s(smem_u32addr(sHi), params.softmax_lse_log2_ptr + ws, kBlockM * 4, full, policy);
    bulk_copy_g2s(smem_u32addr(sLo), params.softmax_lse_log2_lo_ptr + ws, kBlockM * 4, full, policy);
    bulk_copy_g2s(smem_u32addr(sDsum), params.dsoftmax_sum_ptr + ws, kBlockM * 4, full, policy);
  } else {
    w.template copy_q_tiles_async<Element, TileQ, T::kHeadDimPad, T::kThreads>(params, it, sQ, sdO, tid);
    w.copy_row_stats_async(params, it, sHi, sLo, sDsum, tid);
  }
}

// Alg. 2 line 7 of the dQ kernels: K_j, V_j of key block n_block into `stage` of the shared layout
// of traits T (kOffK, kOffV: stages of TileKV::kBytes); kTma by the loader thread (keys past
// seqlen_k read as zeros; the mask hides them), completing on the stage's full mbarrier `full`, else
// by every thread.
template <bool kTma, typename Element, typename T, typename Work>
__device__ __forceinline__ void load_dq_stage(const Work& w, const Flash_bwd_params& params, const BwdTmaMaps& maps,
                                              unsigned char* smem, int n_block, int stage, uint32_t full, int tid) {
  using TileKV = typename T::TileKV;
  const uint32_t sK = smem_u32addr(smem + T::kOffK + stage * TileKV::kBytes);
  const uint32_t sV = smem_u32addr(smem + T::kOffV + stage * TileKV::kBytes);
  if constexpr (kTma) {
    const int row = w.seq.k_tma_row(n_block * T::kBlockN), bidb = w.seq.tma_batch(params);
    const uint64_t policy = l2_policy_evict_last();  // read again by the head's other Q tiles
    mbarrier_arrive_expect_tx(full, 2 * TileKV::kBytes);
#pragma unroll
    for (int cb = 0; cb < T::kHeadDimPad / 64; ++cb) {
      tma_load_4d(sK + cb * TileKV::kColBlockBytes, &maps.a, full, 64 * cb, row, w.bidhk, bidb, policy);
      tma_load_4d(sV + cb * TileKV::kColBlockBytes, &maps.b, full, 64 * cb, row, w.bidhk, bidb, policy);
    }
  } else {
    w.template copy_kv_tiles_async<Element, TileKV, T::kHeadDimPad, T::kThreads>(params, n_block, sK, sV, tid);
  }
}

// Launches a backward kernel (tma_kernel / cp_kernel: its two instantiations, taking (params,
// maps)) over Work's grid: by TMA where allowed and the driver encodes maps of tensors a and b
// (rows x heads, boxes of box_rows rows; varlen: the packed tensors as one batch of total_rows
// rows, as the forward encodes them), else by cp.async. Varlen tiles by TMA zero their rows past
// the sequence's end themselves (zero_stage_tail below).
template <typename Traits, typename Work, typename Kernel>
void launch_bwd_stages(Kernel tma_kernel, Kernel cp_kernel, const TensorView& a, const TensorView& b, int rows,
                       int total_rows, int heads, int box_rows, const char* what, Flash_bwd_params& params,
                       cudaStream_t stream, bool allow_tma) {
  static_assert(Traits::kSmemBytes <= kMaxSmem, "backward tile row exceeds sm90 shared memory");
  BwdTmaMaps maps{};
  const bool varlen = params.cu_seqlens_q != nullptr;
  const int batch = varlen ? 1 : params.b, map_rows = varlen ? total_rows : rows;
  const bool tma = allow_tma && params.sm90_bwd_tma &&
                   tma_encode_bshd(&maps.a, a, batch, map_rows, heads, params.d, params.is_bf16, box_rows) &&
                   tma_encode_bshd(&maps.b, b, batch, map_rows, heads, params.d, params.is_bf16, box_rows);
  launch_1d(tma ? tma_kernel : cp_kernel, Work::grid_size(params), Traits::kThreads, Traits::kSmemBytes, what,
            params.d_rounded, stream, params, maps);
}

// Varlen calls by TMA: a stage's two tiles (a, b: Q_i and dO_i of the dK/dV kernels, K_j and V_j
// of the dQ kernels; Tile layout, kCols columns) were read as whole TMA boxes of the packed
// tensors, so their rows [valid, kRows) past the sequence's end hold the next sequence's rows (or
// whatever lies past cu_seqlens[-1], NaN included). P (or P^T) is 0 there, but 0 * NaN is NaN in
// the products that take these rows as an operand (dV += P^T dO, dK += dS^T Q, dQ += dS K, and dS
// through dP), so they are zeroed, as a dense call's out-of-bounds fill leaves them: the tile then
// computes what the dense op computes on the sequence alone, bit for bit. Every thread of the CTA,
// after acquire (the stage landed) and before the stage's products; `valid` is uniform over the
// CTA, and only a sequence's last tile has valid < kRows (one CTA barrier there; the dK/dV
// kernels visit it once per query head of the GQA group).
template <typename Tile, int kRows, int kCols, int kThreads>
__device__ __forceinline__ void zero_stage_tail(uint32_t a, uint32_t b, int valid, int tid) {
  if (valid >= kRows) return;
  valid = valid > 0 ? valid : 0;  // (the kernels visit tiles with a row or key only: valid >= 1)
  zero_rows<Tile, kCols, kThreads>(a, valid, kRows, tid);
  zero_rows<Tile, kCols, kThreads>(b, valid, kRows, tid);
  fence_proxy_async();  // the zeros visible to the wgmmas (async proxy) that read the stage
  __syncthreads();
}

// Alg. 2 line 12 on a transposed (key x query) accumulator, the dK/dV kernels' S^T: P^T =
// exp2(S^T scale_log2 - LSE_log2) in place (primitives/softmax.cuh: recompute_p) for a warpgroup's
// 64 key rows (this thread's: key0, key0 + 8) and kNBlk n8 blocks of query columns from tile
// column q0 of the Q tile at m0, whose LSE_log2 = hi + lo sit in shared memory (sHi, sLo: one float
// per tile column). The mask (a key after the query or past seqlen_k -> P^T = 0) and the exact
// recompute are compiled into other copies of the loop that run on diagonal tiles and
// large-magnitude rows only (a window's edge tiles too; kLocal as recompute_p_rows): the branch is
// uniform, so the other tiles pay nothing for them.
template <bool kLocal, int kNBlk, typename Mask>
__device__ __forceinline__ void recompute_pt(float (&acc)[kNBlk][4], const Mask& mask, bool precise, bool needs_mask,
                                             float scale_log2, const float* sHi, const float* sLo, int m0, int q0,
                                             int key0, int t) {
  with_p_mode(precise, needs_mask, [&](auto mode) {
    constexpr PMode kMode = decltype(mode)::value;
#pragma unroll
    for (int j = 0; j < kNBlk; ++j) {
      const int mc = q0 + 8 * j + 2 * t;  // tile column (query) of e = 0; e = 1 is mc + 1
      const float2 hi2 = *reinterpret_cast<const float2*>(sHi + mc);
      float2 lo2 = make_float2(0.f, 0.f);
      if constexpr (kMode == PMode::kExact) lo2 = *reinterpret_cast<const float2*>(sLo + mc);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc[j][e] = recompute_p<kMode>(acc[j][e], scale_log2, (e % 2) ? hi2.y : hi2.x, (e % 2) ? lo2.y : lo2.x,
                                       mask.template visible<kLocal>(m0 + mc + (e % 2), key0 + 8 * (e / 2)));
      }
    }
  });
}

// Writes a warpgroup's fp32 accumulator (64 x kNBlk*8, wgmma layout: warp w, lane 4g + t holds
// rows 16w + g and 16w + g + 8, columns 8j + 2t, +1 of n8 block j) times `scale` into rows
// [row0, row0 + 64) of the swizzled tile at `smem`, converted to Element.
template <int kRows, int kCols, int kNBlk, typename Element>
__device__ __forceinline__ void store_acc_to_smem(unsigned char* smem, const float (&acc)[kNBlk][4], int row0,
                                                  float scale, int tid_in_wg) {
  using Tile = SwizzledTile<kRows, kCols>;
  const int lane = tid_in_wg % 32, g = lane / 4, t = lane % 4;
  const int r = row0 + 16 * (tid_in_wg / 32) + g;
#pragma unroll
  for (int j = 0; j < kNBlk; ++j) {
    *reinterpret_cast<uint32_t*>(smem + Tile::offset(r, 8 * j + 2 * t)) =
        pack2<Element>(acc[j][0] * scale, acc[j][1] * scale);
    *reinterpret_cast<uint32_t*>(smem + Tile::offset(r + 8, 8 * j + 2 * t)) =
        pack2<Element>(acc[j][2] * scale, acc[j][3] * scale);
  }
}

// The (N/8 x 4) accumulator view of the kernels as the flat N/2-register list of Wgmma.
template <int kNBlk>
__device__ __forceinline__ float (&flat(float (&acc)[kNBlk][4]))[kNBlk * 4] {
  return reinterpret_cast<float(&)[kNBlk * 4]>(acc);
}

}  // namespace sm90
}  // namespace flash

// Defines flash::sm90::launch_bwd_<kind>(params, stream, allow_tma) for tile row Tile (the roles
// kernel for a Roles<> row, else the rows kernel; either by TMA where launch_bwd_stages can, tensors
// a / b: rows x heads, varlen total x heads, boxes of Traits::box rows) and flash::run_mha_bwd_<kind>_(Sm90, ...), the
// launch the generated instantiations compile with the production row <Kind>Tile<d>; the call's
// twins of the kernels by pick_attention_twin (launch_utils.h: a window's left bound, soft-capping,
// attention dropout, ALiBi). Used at
// global scope after both kernels; the tuning harness calls launch_bwd_<kind> with other rows.
#define FLASH_SM90_BWD_LAUNCH(Kind, kind, what, a, b, rows, total, heads, box)                                   \
  namespace flash::sm90 {                                                                                       \
  template <typename Traits, typename Kernel>                                                                   \
  void launch_bwd_##kind##_with(Kernel tma_kernel, Kernel cp_kernel, Flash_bwd_params& params,                  \
                                cudaStream_t stream, bool allow_tma) {                                          \
    launch_bwd_stages<Traits, Kind##Work<Traits::kBlockM, Traits::kBlockN>>(                                    \
        tma_kernel, cp_kernel, params.a, params.b, params.rows, params.total, params.heads, Traits::box, what,   \
        params, stream, allow_tma);                                                                             \
  }                                                                                                             \
  template <typename Element, int kHeadDim, typename Tile, bool kLocal, bool kSoftcap, bool kDropout,            \
            bool kAlibi>                                                                                        \
  void launch_bwd_##kind##_twin(Flash_bwd_params& params, cudaStream_t stream, bool allow_tma) {                \
    if constexpr (Tile::kRoles) {                                                                               \
      launch_bwd_##kind##_with<Kind##RolesKernelTraits<Element, kHeadDim, Tile>>(                               \
          flash_bwd_##kind##_roles_kernel<Element, kHeadDim, Tile, true, kLocal, kSoftcap, kDropout, kAlibi>,   \
          flash_bwd_##kind##_roles_kernel<Element, kHeadDim, Tile, false, kLocal, kSoftcap, kDropout, kAlibi>,  \
          params, stream, allow_tma);                                                                           \
    } else {                                                                                                    \
      launch_bwd_##kind##_with<Kind##KernelTraits<Element, kHeadDim, Tile>>(                                    \
          flash_bwd_##kind##_kernel<Element, kHeadDim, Tile, true, kLocal, kSoftcap, kDropout, kAlibi>,         \
          flash_bwd_##kind##_kernel<Element, kHeadDim, Tile, false, kLocal, kSoftcap, kDropout, kAlibi>, params, \
          stream, allow_tma);                                                                                   \
    }                                                                                                           \
  }                                                                                                             \
  template <typename Element, int kHeadDim, typename Tile>                                                      \
  void launch_bwd_##kind(Flash_bwd_params& params, cudaStream_t stream, bool allow_tma = true) {                \
    pick_attention_twin(params, [&](auto local, auto softcap, auto dropout, auto alibi) {                       \
      constexpr bool kSoftcap = decltype(softcap)::value, kDropout = decltype(dropout)::value;                 \
      if constexpr ((kSoftcap || kDropout) && !Tile::kSoftcapDropout) {                                         \
        throw std::runtime_error("flash_attn_ext: this " what " row has no soft-capping or dropout twin");     \
      } else {                                                                                                  \
        launch_bwd_##kind##_twin<Element, kHeadDim, Tile, decltype(local)::value, kSoftcap, kDropout,           \
                                 decltype(alibi)::value>(params, stream, allow_tma);                            \
      }                                                                                                         \
      return 0;                                                                                                 \
    });                                                                                                         \
  }                                                                                                             \
  }                                                                                                             \
  template <typename Element, int kHeadDim>                                                                     \
  void flash::run_mha_bwd_##kind##_(flash::Sm90, flash::Flash_bwd_params& params, cudaStream_t stream) {        \
    flash::sm90::launch_bwd_##kind<Element, kHeadDim, flash::sm90::Kind##Tile<kHeadDim>>(params, stream);       \
  }
