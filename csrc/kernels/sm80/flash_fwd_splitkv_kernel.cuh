// Split-KV forward (FlashDecoding: Dao, Haziza, Massa, Sizov 2023) for every SM >= 8.0, the
// KV-cache op's attention: mma.sync.m16n8k16 tensor cores, ldmatrix operand loads, a cp.async
// ring of K/V tiles read through the cache's row map (common/paged_kv.cuh: contiguous or paged).
//
// One CTA = one (sequence, kv head, packed row tile, split) (common/splitkv_work.cuh): its 16
// rows are the (query, head) pairs of one GQA group, so decode (seqlen_q = 1, ratio 4-8) fills
// 4-8 of them and K/V are read once per kv head. Decode is memory-bound, so the warps split keys,
// not rows: warp w takes keys [w kWarpKeys, (w + 1) kWarpKeys) of every K/V tile with its own
// online-softmax state (m, l) and O accumulator (FlashAttention-2, Dao 2023, Alg. 1 lines 8-10
// on its key slice), and the warps' partials merge once at the end through shared memory, like
// the splits do in the combine kernel (common/combine_kernel.cuh):
//   M = max_w m_w,  f_w = exp2((m_w - M) c),  l = sum_w f_w l_w,  O = sum_w f_w O_w / l.
// One split (of its row: balanced splits give rows their own counts): the CTA writes out (Element)
// and softmax_lse; else its partial O (float32, normalized) and LSE into the split accumulators
// (flash.h), LSE -inf for a split without keys.
//
// Pipeline: a ring of kStages (K, V) tile pairs. Step t starts with a barrier (every warp is done
// with tile t - 1), issues tile t + kStages - 1 into the buffer tile t - 1 used, and only then
// waits for tile t: kStages tiles are in flight while a CTA waits, kStages - 1 while it computes
// (two barriers per tile buy one more tile in flight than wait-then-issue). cp.async: one commit
// group per step (possibly empty), so wait_group kStages - 1 after the step's commit means "tile t
// landed". TMA (kTma, sm_90+): one mbarrier per stage; thread 0 arrives with the tile's bytes and
// issues its boxes (common/paged_kv.cuh: copy_kv_tiles_tma) into 128-byte-swizzled tiles; tile t
// has landed when the barrier of stage t % kStages completes its phase (t / kStages) & 1 (each
// thread waits on it: no second CTA barrier). K/V reads carry an L2 evict-first policy
// (kEvictFirst) where no other CTA reads the same rows (one row tile).
// Each CTA's first statement lets the combine kernel launch (programmatic dependent launch,
// sm_90+: common/combine_kernel.cuh), which then waits for this grid's end before its first read;
// TMA rows then prefetch the split's first key tile into L2 before reading cache_seqlens (below).
#pragma once

#include <atomic>

#include "kernels/common/splitkv_heuristic.h"
#include "kernels/common/splitkv_work.cuh"
#include "kernels/sm80/kernel_common.cuh"  // everything an sm80 kernel uses
#include "primitives/barrier.cuh"          // mbarriers of the TMA ring, grid dependency control

namespace flash::sm80 {

template <typename Element_, int kHeadDim_, typename Config_ = SplitKvTile<kHeadDim_>>
struct SplitKvKernelTraits : RowTraits<Element_, kHeadDim_, Config_> {  // kBlockM: 16 packed rows; kBlockN keys
  using Base = RowTraits<Element_, kHeadDim_, Config_>;
  using typename Base::Element;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDim, Base::kNWarps, Base::kThreads;
  using Config = Config_;
  static constexpr int kStages = Config::kStages;
  static constexpr bool kEvictFirst = Config::kEvictFirst;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  static constexpr bool kTma = false;  // no TMA below sm_90: the cp.async ring
#else
  static constexpr bool kTma = Config::kTma;
#endif

  static constexpr int kWarpKeys = kBlockN / kNWarps;  // keys of each tile per warp
  static constexpr int kNAtoms = kWarpKeys / 8;        // n8 atoms of a warp's S
  static constexpr int kDAtoms = kHeadDim / 8;         // n8 atoms of O
  static constexpr int kQKSteps = kHeadDim / 16;       // k16 steps of Q K^T
  static constexpr int kPVSteps = kWarpKeys / 16;      // k16 steps of P V

  static constexpr int kPitch = SmemTile<kHeadDim>::kPitch;  // elements per shared row of Q
  static constexpr int kQBytes = kBlockM * kPitch * int(sizeof(Element));
  // K/V ring tiles: TMA's 128-byte swizzle in whole 64-column blocks (kHeadDimPad columns; the
  // boxes zero-fill those past the user's d), else rows padded to kPitch.
  static constexpr int kHeadDimPad = (kHeadDim + 63) / 64 * 64;
  using KvLayout = std::conditional_t<kTma, Swizzle128Tile<kBlockN, kHeadDimPad>, SmemTile<kHeadDim>>;
  static constexpr int kTileBytes = kBlockN * (kTma ? kHeadDimPad : kPitch) * 2;
  // Shared layout: TMA: the ring from the first 1024-byte boundary (swizzle atoms), then Q;
  // cp.async: Q, then the ring.
  static constexpr int kSmemBytes = Config::smem_bytes(kHeadDim);
  // The merge, over the ring once the loop is done: per warp its 16 x kHeadDim float O (pitch
  // kHeadDim + 8 floats: the float2 fragment stores of 8 rows hit 8 distinct 4-bank groups), and
  // its 16 row maxes and sums.
  static constexpr int kMergePitch = kHeadDim + 8;
  static constexpr int kSmemMergeBytes = kNWarps * kBlockM * (kMergePitch + 2) * 4;

  static_assert(kBlockM == 16, "one m16 atom of packed rows");
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "head dim: multiple of 16, <= 256");
  static_assert(kWarpKeys % 16 == 0, "each warp owns whole k16 steps of keys");
  static_assert(kStages >= 2, "a ring of at least two K/V tile pairs");
  static_assert(kSmemBytes >= (kTma ? 1024 : 0) + 2 * kStages * kTileBytes + kQBytes, "tile_shapes.h smem_bytes out of date");
  static_assert(kSmemMergeBytes <= 2 * kStages * kTileBytes, "merge fits the ring");
};

// ---- The kernel's steps, in algorithm order (each inlined into flash_fwd_splitkv_kernel below).
// The kernel's SASS is byte-identical to that of the single-function kernel these came from; two
// rules kept it so (a break of either shifted the main loop's register allocation): a helper
// declares no arrays of its own (the mma operand fragments are the kernel's, passed in), and an
// address the inline code spelled in place (stage + kTileBytes) is spelled in place here too.

// Launch latency. A small decode step's split grid is one short wave (B1 x Nk 8k: 128 CTAs of
// 8 key tiles), so the chain before its first K/V bytes land is a good part of its span: cache_seqlens
// (the key range depends on it), then the tensor maps, then the tile itself, each a DRAM round
// trip after the benchmark's flush. Before reading cache_seqlens: let the combine grid launch
// (it waits for this grid's end before it reads: grid_dependency_wait; its CTAs launch once
// every CTA of this grid has run this, so they never keep one of ours from an SM), fetch the
// maps into the TMA unit, and, for a contiguous cache without a left pad or a window's left
// bound, prefetch into L2 the first key tile this split gets if the cache is full (a decode
// step's usual case, where balanced splits keep the unbalanced grid; otherwise one K/V tile pair
// per CTA read for nothing).
// H100, decode as CUDA graphs, against none of this: B1 x Nk 8k +2.4 % with one tile, +2.0 % with
// two, +-0 with the maps and the launch alone; B1 128k, B8 32k, B64 8k / 32k within +-0.4 %
// (docs/PERF_NOTES.md, 2026-12-06, twenty-seventh session).
template <typename Traits, bool kLocal, bool kBalanced, typename Work>
__device__ __forceinline__ void splitkv_launch_early(const Flash_fwd_params& params, const KvTmaMaps& maps,
                                                     const int4 coords, const uint64_t kv_policy, const int tid) {
  constexpr int kBlockN = Traits::kBlockN;
  grid_dependency_launch_dependents();
  if constexpr (Traits::kTma) {
    if (tid == 0) {
      tma_prefetch_map(&maps.k);
      tma_prefetch_map(&maps.v);
      if (!kLocal && params.block_table == nullptr && params.leftpad_k == nullptr) {
        // The split's first tile among those of a full cache (Work's ranges with seqlen_k = capacity).
        const int n_cap = ceil_div(params.seqlen_k, kBlockN);
        // Its sequence b and split s of n_splits; balanced splits: the full-cache grid, where unit
        // (sequence * num_splits + split) is split unit % splits_equal of sequence unit /
        // splits_equal (common/splitkv_work.cuh), units past b * splits_equal idle.
        int b = coords.x, s = coords.w, n_splits = params.num_splits;
        if constexpr (kBalanced) {
          const int unit = coords.x * params.num_splits + coords.w;
          n_splits = params.splits_equal, b = unit / n_splits, s = unit % n_splits;
        }
        const int n_spec = Work::split_first_tile(s, n_splits, n_cap);
        if ((!kBalanced || b < params.b) && n_spec < Work::split_first_tile(s + 1, n_splits, n_cap)) {
#pragma unroll
          for (int cb = 0; cb < Traits::kHeadDimPad / 64; ++cb) {
            tma_prefetch_l2_4d(&maps.k, 64 * cb, n_spec * kBlockN, coords.y, b, kv_policy);
            tma_prefetch_l2_4d(&maps.v, 64 * cb, n_spec * kBlockN, coords.y, b, kv_policy);
          }
        }
      }
    }
  }
}

// Prologue: the Q tile (FA2 Alg. 1 line 4) with tile 0, then tiles 1..kStages-2 (load_tile(t):
// the K and V tiles of step t into ring buffer t % kStages).
template <typename Traits, typename Work, typename LoadTile>
__device__ __forceinline__ void splitkv_prologue(const Flash_fwd_params& params, const Work& w, const uint32_t sQ,
                                                 const uint32_t bar0, const int n_tiles, const int tid,
                                                 const LoadTile& load_tile) {
  constexpr int kStages = Traits::kStages;
  w.template copy_q_tile_async<typename Traits::Element, SmemTile<Traits::kHeadDim>, Traits::kHeadDim,
                               Traits::kThreads>(params, sQ, tid);
  if constexpr (Traits::kTma) {
    cp_async_commit();  // Q alone: waited for before the loop
    if (tid == 0) {
#pragma unroll
      for (int st = 0; st < kStages; ++st) mbarrier_init(bar0 + st * 8, 1);  // thread 0's arrival + the bytes
      mbarrier_init_fence();
    }
    __syncthreads();  // the barriers are initialized before any thread arrives
  }
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < n_tiles) load_tile(t);
    if constexpr (!Traits::kTma) cp_async_commit();
  }
  if constexpr (Traits::kTma) {
    cp_async_wait<0>();  // Q landed (this thread's copies) ...
    __syncthreads();     // ... everyone's
  }
}

// Key ranges of this thread's two packed rows (lane / 4 and lane / 4 + 8 of the tile; the mask
// layer, common/mask.cuh, on the row's query; AttnMask::apply_rows applies them): a key j is
// visible iff start <= j < limit (start 0 without a left bound: the kLocal twin only compares it).
// ALiBi (AttnMask::add_alibi_rows): the row's query i + off (off = seqlen_k - seqlen_q) and its
// head's slope in score units (common/mask.cuh: alibi_slope); packed row r is query r / ratio of
// head bidhk * ratio + r % ratio.
template <bool kLocal, bool kAlibi, typename Work>
__device__ __forceinline__ void splitkv_row_setup(const Flash_fwd_params& params, const Work& w, const int lane,
                                                  int (&limit)[2], int (&start)[2], int (&alibi_q)[2],
                                                  float (&alibi_s)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = w.m0 + lane / 4 + 8 * h;
    const int q = w.query(r);
    limit[h] = w.mask.key_limit(q);
    start[h] = kLocal ? w.mask.key_start(q) : 0;
    if constexpr (kAlibi) {
      alibi_q[h] = q + w.mask.seqlen_k - w.mask.seqlen_q;
      alibi_s[h] = alibi_slope(params, w.seq.bidb, w.bidhk * w.ratio + r % w.ratio);
    }
  }
}

// FA2 Alg. 1 line 7 (load K_t, V_t) as a pipeline: every warp is done with tile t - 1, so its
// buffer takes tile t + kStages - 1; then wait until tile t has landed, for the whole CTA.
template <typename Traits, typename LoadTile>
__device__ __forceinline__ void splitkv_advance_ring(const int t, const int n_tiles, const uint32_t bar0,
                                                     const LoadTile& load_tile) {
  constexpr int kStages = Traits::kStages;
  __syncthreads();  // every warp is done with tile t - 1: its buffer takes tile t + kStages - 1
  if (t + kStages - 1 < n_tiles) load_tile(t + kStages - 1);
  if constexpr (Traits::kTma) {
    mbarrier_wait(bar0 + (t % kStages) * 8, (t / kStages) & 1);  // tile t landed, for everyone
  } else {
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // tile t landed (this thread's copies) ...
    __syncthreads();               // ... everyone's
  }
}

// Alg. 1 line 4's Q as the A operand of every k16 step of Q K^T, into registers (kQInRegs), once
// Q has landed.
template <typename Traits>
__device__ __forceinline__ void splitkv_load_q_frags(uint32_t (&q_frag)[Traits::kQInRegs ? Traits::kQKSteps : 1][4],
                                                     const uint32_t q_addr) {
  if constexpr (Traits::kQInRegs) {
    if constexpr (!Traits::kTma) {
      cp_async_wait<Traits::kStages - 2>();  // Q (with tile 0) landed ...
      __syncthreads();                       // ... for the whole CTA
    }
#pragma unroll
    for (int kk = 0; kk < Traits::kQKSteps; ++kk) ldmatrix_x4(q_frag[kk], q_addr + kk * 32);
  }
}

// TMA: the sequence's last tile: its rows past the visible keys came in whole boxes (anything,
// NaN included): zero them in the V tile of the stage so that P = 0 there gives exact zeros in
// P V (S masks them). The kernel passes the stage; the V tile's address is spelled here.
template <typename Traits, typename Work>
__device__ __forceinline__ void splitkv_zero_v_tail(const Work& w, const int t, const uint32_t stage, const int tid) {
  constexpr int kBlockN = Traits::kBlockN;
  if constexpr (Traits::kTma) {
    const int rows_valid = w.seq.seqlen_k - (w.n_begin + t) * kBlockN;
    if (rows_valid < kBlockN) {
      zero_rows<typename Traits::KvLayout, Traits::kHeadDimPad, Traits::kThreads>(stage + Traits::kTileBytes,
                                                                                  max(rows_valid, 0), kBlockN, tid);
      fence_proxy_async();  // generic writes before any later async-proxy use of the buffer
      __syncthreads();
    }
  }
}

// FA2 Alg. 1 line 8: S = Q K_t^T on the warp's kWarpKeys keys of the K tile at sK (unscaled; the
// scale goes into the softmax, primitives/softmax.cuh). Q from registers (kQInRegs) or, per k16
// step, from shared memory at q_addr; K rows of the warp's key slice at (k_row, k_col). a, b: the
// A and B fragments of one mma, the kernel's arrays.
template <typename Traits>
__device__ __forceinline__ void splitkv_qk(float (&s)[1][Traits::kNAtoms][4],
                                           const uint32_t (&q_frag)[Traits::kQInRegs ? Traits::kQKSteps : 1][4],
                                           const uint32_t q_addr, const uint32_t sK, const int k_row, const int k_col,
                                           uint32_t (&a)[1][4], uint32_t (&b)[4]) {
  using Element = typename Traits::Element;
  using KvLayout = typename Traits::KvLayout;
  constexpr int kNAtoms = Traits::kNAtoms;
#pragma unroll
  for (int ni = 0; ni < kNAtoms; ++ni)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[0][ni][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < Traits::kQKSteps; ++kk) {
    if constexpr (Traits::kQInRegs) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a[0][e] = q_frag[kk][e];
    } else {
      ldmatrix_x4(a[0], q_addr + kk * 32);
    }
#pragma unroll
    for (int np = 0; np < kNAtoms / 2; ++np) {
      ldmatrix_x4(b, sK + KvLayout::offset(k_row + np * 16, kk * 16 + k_col));
      mma_m16n16k16<Element>(s, 2 * np, a, b);
    }
  }
}

// Soft-capping, ALiBi and the mask on S of step t (key tile n_begin + t). The mask runs only on
// tiles some row does not see whole (the causal diagonal, a window's left edge, the end of the
// sequence's keys; a CTA-uniform branch): s[0][ni][2h + e] is packed row lane/4 + 8h, key
// (n_begin + t) kBlockN + warp kWarpKeys + 2 (lane % 4) + 8 ni + e.
// Past the sequence's keys S = 0 (cp.async zero-fills those K rows) or anything, NaN included (TMA
// brings whole boxes): the tile holding them always takes this branch (every row's key limit is
// <= seqlen_k) and the -inf replaces the value. (Soft-capping first: softmax.cuh; tanh keeps a NaN
// a NaN, which the mask then replaces.)
// (The thread's first key is spelled out in each call: one variable for both changed the loop's
// register allocation; as written the SASS is the inline loops', byte for byte.)
template <typename Traits, bool kLocal, bool kSoftcap, bool kAlibi, typename Work>
__device__ __forceinline__ void splitkv_mask_scores(float (&s)[1][Traits::kNAtoms][4], const Work& w, const int t,
                                                    const int warp, const int lane, const int (&limit)[2],
                                                    const int (&start)[2], const int (&alibi_q)[2],
                                                    const float (&alibi_s)[2], const float softcap_prescale) {
  constexpr int kBlockN = Traits::kBlockN, kWarpKeys = Traits::kWarpKeys;
  if constexpr (kSoftcap) softcap_scores(s, softcap_prescale);
  if constexpr (kAlibi) {  // + slope |i + off - j|
    AttnMask::add_alibi_rows(s, alibi_q, alibi_s, (w.n_begin + t) * kBlockN + warp * kWarpKeys + 2 * (lane % 4));
  }
  if (w.template tile_needs_mask<kLocal>(w.n_begin + t)) {
    AttnMask::apply_rows<kLocal>(s, limit, start, (w.n_begin + t) * kBlockN + warp * kWarpKeys + 2 * (lane % 4));
  }
}

// FA2 Alg. 1 line 10: O += P V_t (the warp's key slice of the stage's V tile, rows from v_row). S's C
// fragments of n8 atoms 2kk, 2kk+1 are the A fragment of k16 step kk (primitives/mma.cuh:
// acc_to_a_frag). a, b: the A and B fragments of one mma, the kernel's arrays.
template <typename Traits>
__device__ __forceinline__ void splitkv_pv(float (&acc_o)[1][Traits::kDAtoms][4],
                                           const float (&s)[1][Traits::kNAtoms][4],
                                           const uint32_t stage, const int v_row, const int v_col, uint32_t (&a)[1][4],
                                           uint32_t (&b)[4]) {
  using Element = typename Traits::Element;
  using KvLayout = typename Traits::KvLayout;
#pragma unroll
  for (int kk = 0; kk < Traits::kPVSteps; ++kk) {
    acc_to_a_frag<Traits::kNAtoms, Element>(a[0], s[0], kk);
#pragma unroll
    for (int dp = 0; dp < Traits::kDAtoms / 2; ++dp) {
      ldmatrix_x4_trans(b, stage + Traits::kTileBytes + KvLayout::offset(v_row + kk * 16, dp * 16 + v_col));
      mma_m16n16k16<Element>(acc_o, 2 * dp, a, b);
    }
  }
}

// The warps' merge (the header's combine rule over the warps' key slices), first half. m_w: the
// max this warp's P and O were taken against (-inf: no visible key); l_w its sum. Then
// f_w = exp2((m_w - M) c) for the rows' max M over the warps: O_w *= f_w into shared memory
// (sO [warp][16][kMergePitch], sMax and sSum [warp][16], over the ring); a barrier after each.
template <typename Traits, typename Softmax>
__device__ __forceinline__ void splitkv_merge_warps(float* sO, float* sMax, float* sSum, const Softmax& softmax,
                                                    const float (&acc_o)[1][Traits::kDAtoms][4],
                                                    const float scale_log2, const int warp, const int lane) {
  constexpr int kBlockM = Traits::kBlockM, kNWarps = Traits::kNWarps, kDAtoms = Traits::kDAtoms;
  const int g = lane / 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_allreduce_sum(softmax.row_sum[h]);
    if (lane % 4 == 0) {
      sMax[warp * kBlockM + g + 8 * h] = softmax.row_max[h];
      sSum[warp * kBlockM + g + 8 * h] = l;
    }
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float m_all = -INFINITY;
#pragma unroll
    for (int v = 0; v < kNWarps; ++v) m_all = fmaxf(m_all, sMax[v * kBlockM + g + 8 * h]);
    const float m_w = sMax[warp * kBlockM + g + 8 * h];
    const float f = m_w == -INFINITY ? 0.f : fast_exp2((m_w - m_all) * scale_log2);
#pragma unroll
    for (int di = 0; di < kDAtoms; ++di) {
      float* p = sO + (warp * kBlockM + g + 8 * h) * Traits::kMergePitch + di * 8 + 2 * (lane % 4);
      *reinterpret_cast<float2*>(p) = make_float2(acc_o[0][di][2 * h] * f, acc_o[0][di][2 * h + 1] * f);
    }
  }
  __syncthreads();
}

// FA2 Alg. 1 lines 14-15 for several splits: one 8-column chunk o (normalized) of packed row r,
// columns col..col+7, as the split's partial O (float32), and its LSE (given in log2 units, stored
// as natural log; -inf when empty: the row saw no visible key) into the split accumulators (flash.h).
template <typename Work>
__device__ __forceinline__ void splitkv_store_partial(const Flash_fwd_params& params, const Work& w, const int r,
                                                      const int col, const float (&o)[8], const float lse_log2,
                                                      const bool empty) {
  const int64_t ar = w.accum_row(params, r);
  float* dst = params.oaccum_ptr + ar * params.d_rounded + col;
  *reinterpret_cast<float4*>(dst) = make_float4(o[0], o[1], o[2], o[3]);
  *reinterpret_cast<float4*>(dst + 4) = make_float4(o[4], o[5], o[6], o[7]);
  if (col == 0) params.softmax_lseaccum_ptr[ar] = empty ? -INFINITY : lse_log2 * 0.69314718055994530942f;
}



// kLocal: the call has a sliding window's left bound (params.window_left >= 0; launch_fwd_splitkv
// picks): its masked tiles check the left bound too. The kernel without it is the causal mask's code.
// kSoftcap: logit soft-capping (params.softcap > 0; primitives/softmax.cuh: softcap_scores).
// kAlibi: ALiBi (params.alibi_slopes_ptr; flash.h): every S tile gains slope * |i + off - j| before
// the mask, the slope and query i of each of the thread's two packed rows (their heads differ:
// GQA packing) read once.
// kBalanced: the balanced splits' twin (params.balance_splits; common/splitkv_work.cuh), without a
// window's left bound, soft-capping or ALiBi (plan_kvcache_splits does not balance those calls).
template <typename Traits, bool kLocal = false, bool kSoftcap = false, bool kAlibi = false, bool kBalanced = false>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks)
    flash_fwd_splitkv_kernel(const Flash_fwd_params params, const __grid_constant__ KvTmaMaps maps) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using Element = typename Traits::Element;
  using Tile = SmemTile<kHeadDim>;
  constexpr int kNWarps = Traits::kNWarps, kThreads = Traits::kThreads, kStages = Traits::kStages;
  constexpr int kNAtoms = Traits::kNAtoms, kDAtoms = Traits::kDAtoms, kWarpKeys = Traits::kWarpKeys;
  constexpr int kPitchBytes = Traits::kPitch * int(sizeof(Element));
  constexpr int kTileBytes = Traits::kTileBytes;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t stage_full[kStages];  // the TMA ring's barriers (kTma)
  const uint32_t smem_base = smem_u32addr(smem_raw);
  // Stage s: K at sRing + 2s tiles, V after it.
  const uint32_t sRing = Traits::kTma ? (smem_base + 1023u) & ~1023u : smem_base + Traits::kQBytes;
  const uint32_t sQ = Traits::kTma ? sRing + 2 * kStages * kTileBytes : smem_base;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  using Work = SplitKvWork<kBlockM, kBlockN, kBalanced>;
  const int4 coords = Work::decode(params);  // (sequence, kv head, row tile, split): blockIdx.x alone
  // Evict-first only where no other CTA reads these K/V rows (one packed row tile per kv head).
  const uint64_t kv_policy =
      l2_policy_stream(Traits::kEvictFirst && Work::num_row_tiles(params) == 1, params.kv_stream_exceeds_l2);

  // ---- Launch latency: PDL, the tensor maps, the split's first key tile into L2.
  splitkv_launch_early<Traits, kLocal, kBalanced, Work>(params, maps, coords, kv_policy, tid);

  // ---- Balanced splits (common/splitkv_work.cuh): the sequence and split this CTA's unit stands for.
  SplitSlots slots{};
  int4 unit = coords;
  if constexpr (kBalanced) {
    bool unit_empty;
    unit = Work::resolve(params, coords, slots, unit_empty);
    if (unit_empty) return;  // no sequence's: no keys, no partial (the combine reads none)
  }
  const Work w(params, unit, slots);
  const int n_tiles = w.n_end > w.n_begin ? w.n_end - w.n_begin : 0;
  const float scale_log2 = params.scale_softmax_log2;
  const float softcap_prescale = kSoftcap ? params.softcap_prescale : 0.f;
  const uint32_t bar0 = smem_u32addr(&stage_full[0]);

  // K and V tiles of step t (0-based within the split) into ring buffer t % kStages.
  auto load_tile = [&](int t) {
    const uint32_t sK = sRing + (t % kStages) * 2 * kTileBytes;
    const int n0 = (w.n_begin + t) * kBlockN;
    if constexpr (Traits::kTma) {
      if (tid == 0) {
        w.kv.template copy_kv_tiles_tma<kBlockN, Traits::kHeadDimPad>(
            sK, sK + kTileBytes, maps, w.bidhk, n0, w.seq.seqlen_k - n0, bar0 + (t % kStages) * 8, kv_policy);
      }
    } else {
      w.kv.template copy_kv_tiles_async<Tile, kBlockN, kHeadDim, kThreads, Element>(
          sK, sK + kTileBytes, params, w.bidhk, n0, w.seq.seqlen_k - n0, params.d, tid, kv_policy);
    }
  };

  // ---- Prologue: the Q tile (FA2 Alg. 1 line 4) with tile 0, then tiles 1..kStages-2.
  splitkv_prologue<Traits>(params, w, sQ, bar0, n_tiles, tid, load_tile);

  float acc_o[1][kDAtoms][4];  // FA2 Alg. 1 line 5: O = 0 (this warp's key slice)
#pragma unroll
  for (int di = 0; di < kDAtoms; ++di)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[0][di][e] = 0.f;
  OnlineSoftmax<1> softmax;  // m = -inf, l = 0

  // Per-row mask bounds and ALiBi terms of this thread's two packed rows.
  int limit[2], start[2];
  [[maybe_unused]] int alibi_q[2];
  [[maybe_unused]] float alibi_s[2];
  splitkv_row_setup<kLocal, kAlibi>(params, w, lane, limit, start, alibi_q, alibi_s);

  // Per-lane ldmatrix addresses (primitives/ldmatrix.cuh recipes), relative to the tile bases.
  // Q as the A operand: row = lane % 16, col = (lane / 16) * 8.
  const uint32_t q_addr = sQ + (lane % 16) * kPitchBytes + (lane / 16) * 16;
  // K rows of this warp's key slice as the [n][k] B operand: n = (lane / 16) * 8 + lane % 8,
  // k = ((lane / 8) % 2) * 8; V rows of the slice as the [k][n] B operand (.trans): k = lane % 16,
  // n = (lane / 16) * 8. Every row index is lane % 8 modulo 8 (the swizzle's row phase).
  const int k_row = warp * kWarpKeys + (lane / 16) * 8 + lane % 8, k_col = ((lane / 8) % 2) * 8;
  const int v_row = warp * kWarpKeys + lane % 16, v_col = (lane / 16) * 8;

  uint32_t q_frag[Traits::kQInRegs ? Traits::kQKSteps : 1][4];
  splitkv_load_q_frags<Traits>(q_frag, q_addr);

  // ---- FA2 Alg. 1 lines 6-11 over this split's key tiles; each warp on its own key slice.
#pragma unroll 1
  for (int t = 0; t < n_tiles; ++t) {
    splitkv_advance_ring<Traits>(t, n_tiles, bar0, load_tile);  // tile t landed, for everyone
    const uint32_t stage = sRing + (t % kStages) * 2 * kTileBytes;
    splitkv_zero_v_tail<Traits>(w, t, stage, tid);  // TMA: V rows past the keys = 0

    // Alg. 1 line 8: S = Q K_t^T on the warp's kWarpKeys keys.
    float s[1][kNAtoms][4];
    uint32_t a[1][4], b[4];  // the A (Q) and B (K) fragments of one mma
    splitkv_qk<Traits>(s, q_frag, q_addr, stage, k_row, k_col, a, b);

    // Soft-capping, ALiBi, and the mask where some row does not see the whole tile.
    splitkv_mask_scores<Traits, kLocal, kSoftcap, kAlibi>(s, w, t, warp, lane, limit, start, alibi_q, alibi_s,
                                                          softcap_prescale);

    // Alg. 1 lines 9-10: m, P = exp2((S - m) c), l, O *= alpha (this warp's rows state).
    softmax.update(s, acc_o, scale_log2);

    // Alg. 1 line 10: O += P V_t (the warp's key slice of V).
    uint32_t pa[1][4], vb[4];  // the A (P) and B (V) fragments of one mma
    splitkv_pv<Traits>(acc_o, s, stage, v_row, v_col, pa, vb);
  }

  // ---- Merge the warps' partials (the combine rule on the warps' key slices), over the ring.
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the ring (and no copy is in flight)
  float* sO = reinterpret_cast<float*>(smem_raw + (sRing - smem_base));               // [warp][16][pitch]
  float* sMax = sO + kNWarps * kBlockM * Traits::kMergePitch;                         // [warp][16]
  float* sSum = sMax + kNWarps * kBlockM;                                             // [warp][16]
  splitkv_merge_warps<Traits>(sO, sMax, sSum, softmax, acc_o, scale_log2, warp, lane);

  // ---- FA2 Alg. 1 lines 12-13 on the merged rows: O = sum_w f_w O_w / l, LSE = M c + log2 l (natural
  // log out), one 8-column chunk of one packed row per thread and pass; rows >= R and columns >= d
  // are not written. A row with no visible key: O = 0, LSE +inf (-inf in the split accumulators).
  constexpr int kChunksPerRow = kHeadDim / 8;
  // kBalanced: the row's own count (1: the output is written here, the combine skips the row).
  const bool split = kBalanced ? w.num_splits > 1 : params.num_splits > 1;
#pragma unroll 1
  for (int c = tid; c < kBlockM * kChunksPerRow; c += kThreads) {
    const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8, r = w.m0 + row;
    if (r >= w.rows || col >= params.d) continue;
    float m_all = -INFINITY;
#pragma unroll
    for (int v = 0; v < kNWarps; ++v) m_all = fmaxf(m_all, sMax[v * kBlockM + row]);
    float l = 0.f;
#pragma unroll
    for (int v = 0; v < kNWarps; ++v) {
      const float m_w = sMax[v * kBlockM + row];
      l += m_w == -INFINITY ? 0.f : sSum[v * kBlockM + row] * fast_exp2((m_w - m_all) * scale_log2);
    }
    const bool empty = !(l > 0.f);
    const float inv_l = empty ? 0.f : 1.f / l;
    float o[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = 0.f;
#pragma unroll
    for (int v = 0; v < kNWarps; ++v) {
      const float* p = sO + (v * kBlockM + row) * Traits::kMergePitch + col;
      const float4 x = *reinterpret_cast<const float4*>(p), y = *reinterpret_cast<const float4*>(p + 4);
      o[0] += x.x, o[1] += x.y, o[2] += x.z, o[3] += x.w, o[4] += y.x, o[5] += y.y, o[6] += y.z, o[7] += y.w;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] *= inv_l;
    const float lse_log2 = fmaf(m_all, scale_log2, __log2f(l));
    if (split) {
      splitkv_store_partial(params, w, r, col, o, lse_log2, empty);
    } else {
      // One split: the sink (flash.h: sinks_ptr) here; split calls add it in the combine.
      const int head = w.head(r), i = w.query(r);
      const float sink = head_sink(params.sinks_ptr, head);
      const SinkShare sh = empty ? SinkShare{1.f, 0.f} : sink_share(lse_log2, sink);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] *= sh.scale;
      uint4 packed;
      packed.x = pack2<Element>(o[0], o[1]);
      packed.y = pack2<Element>(o[2], o[3]);
      packed.z = pack2<Element>(o[4], o[5]);
      packed.w = pack2<Element>(o[6], o[7]);
      *reinterpret_cast<uint4*>(w.seq.template q_row<Element>(params.o, head, i) + col) = packed;
      if (col == 0) {
        params.softmax_lse_ptr[w.seq.stat_index(params, head, i)] =
            empty ? empty_row_lse(sink) : (lse_log2 + sh.log2_gain) * 0.69314718055994530942f;
      }
    }
  }
}

// Launches flash_fwd_splitkv_kernel<Traits> (any tile row: the production one from
// run_mha_fwd_splitkv_ below) on a 1-D grid over (sequence, kv head, row tile, split).
// Rows above sm_80's shared memory (tuning rows for sm_90) fail at launch with launch_1d's error
// on a GPU that lacks it. A TMA row (kTma) runs only on the sm90 path (params.sm90_path:
// select_arch, so force_sm80_path turns it off) with caches TMA can describe (common/paged_kv.cuh:
// encode_kv_tma_maps); other calls run its cp.async twin (Config::WithoutTma).
template <typename Traits>
void launch_fwd_splitkv(Flash_fwd_params& params, cudaStream_t stream) {
  using Config = typename Traits::Config;
  KvTmaMaps maps{};
  params.kv_stream_exceeds_l2 = false;
  if constexpr (Config::kTma) {
    if (!params.sm90_path || !encode_kv_tma_maps(maps, params, Traits::kBlockN)) {
      using Twin = SplitKvKernelTraits<typename Traits::Element, Traits::kHeadDim, typename Config::WithoutTma>;
      launch_fwd_splitkv<Twin>(params, stream);
      return;
    }
    // 16-bit K and V of every sequence's whole cache: an upper bound of what the call reads.
    const int64_t kv_bytes = 4 * int64_t(params.b) * params.h_k * params.seqlen_k * params.d;
    params.kv_stream_exceeds_l2 = params.l2_bytes > 0 && kv_bytes > 2 * params.l2_bytes;
  }
  // All of the unified L1 / shared memory as shared memory, so kMinBlocks CTAs fit an SM (the
  // K/V copies bypass L1: cp.async.cg; only the block table goes through it). Once per device,
  // for every twin (a sliding window's left bound, soft-capping: launch_utils.h pick_twin; ALiBi).
  static std::atomic<uint64_t> carveout_set{0};  // bit i: done on device i
  int device = 0;
  FLASH_CHECK_CUDA(cudaGetDevice(&device));
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (bit == 0 || !(carveout_set.load(std::memory_order_relaxed) & bit)) {
    for (auto twin : {flash_fwd_splitkv_kernel<Traits, false, false>, flash_fwd_splitkv_kernel<Traits, true, false>,
                      flash_fwd_splitkv_kernel<Traits, false, true>, flash_fwd_splitkv_kernel<Traits, true, true>,
                      flash_fwd_splitkv_kernel<Traits, false, false, true>,
                      flash_fwd_splitkv_kernel<Traits, false, false, false, true>}) {
      FLASH_CHECK_CUDA(cudaFuncSetAttribute(twin, cudaFuncAttributePreferredSharedMemoryCarveout,
                                            cudaSharedmemCarveoutMaxShared));
    }
    carveout_set.fetch_or(bit, std::memory_order_relaxed);
  }
  // The call's twin (ALiBi's has neither a window's left bound nor softcap: the API refuses those;
  // the balanced one has none of the three: plan_kvcache_splits).
  launch_1d(params.balance_splits            ? &flash_fwd_splitkv_kernel<Traits, false, false, false, true>
            : params.alibi_slopes_ptr != nullptr
                ? &flash_fwd_splitkv_kernel<Traits, false, false, true>
                : pick_twin(params,
                            [](auto local, auto softcap) {
                              return &flash_fwd_splitkv_kernel<Traits, decltype(local)::value, decltype(softcap)::value>;
                            }),
            SplitKvWork<Traits::kBlockM, Traits::kBlockN>::grid_size(params), Traits::kThreads, Traits::kSmemBytes,
            "split-KV forward", params.d_rounded, stream, params, maps);
}

}  // namespace flash::sm80

namespace flash {

// The launch template of kernels/arch.h; dispatch.cu's run_mha_fwd_kvcache runs the append
// before it and the combine after it. dispatch.cu picked the kernel whose kHeadDim is
// params.d_rounded.
template <typename Element, int kHeadDim>
void run_mha_fwd_splitkv_(Sm80, Flash_fwd_params& params, cudaStream_t stream) {
  using Traits = sm80::SplitKvKernelTraits<Element, kHeadDim>;
  static_assert(Traits::kSmemBytes <= sm80::kMaxSmem, "split-KV tile row exceeds sm_80 shared memory");
  sm80::launch_fwd_splitkv<Traits>(params, stream);
}

}  // namespace flash
