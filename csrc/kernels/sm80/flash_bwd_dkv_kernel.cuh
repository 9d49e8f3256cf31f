// FlashAttention-2 backward, dK/dV kernel (Dao 2023, Alg. 2 outer loop over K/V blocks j;
// dQ is left to flash_bwd_dq_kernel.cuh instead of atomics, so the result is deterministic).
//
// One CTA per (K/V block j of kBlockN rows, batch, kv head). K_j, V_j stay in shared memory;
// for every query head of the GQA group and every Q tile i of kBlockM rows that sees block j,
// Q_i, dO_i, LSE_log2_i (hi + lo), D_i stream in through a 2-stage cp.async pipeline and
//   S^T  = K_j Q_i^T                                  (Alg. 2 line 11, transposed)
//   P^T  = exp2(S^T * scale_log2 - LSE_log2_i)        (line 12; masked keys -> 0)
//   dV_j += P^T dO_i                                  (line 13)
//   dP^T = V_j dO_i^T                                 (line 14)
//   dS^T = P^T o (dP^T - D_i)                         (line 15)
//   dK_j += dS^T Q_i                                  (line 17; times softmax_scale at the end)
// Transposed products put the K-tile rows on the mma M axis: warp w owns K rows
// [kWarpRows*(w % kRowWarps), +kWarpRows) as kMA = kWarpRows/16 m16 atoms, so P^T and dS^T come
// out as C fragments whose k16 slices are exactly the A fragments of the dV / dK products
// (acc_to_a_frag): no shared-memory round trip. kWarpRows = 32 (d <= 64 only: the dK/dV
// accumulators take kWarpRows*kDW/16 registers) lets every Q / dO B fragment feed two mma.
//
// Fragment bookkeeping (lane = 4g + t, mma.cuh): S^T acc[ma][nb][e] holds
//   K row n = kWarpRows*warp_n + 16*ma + g + 8*(e/2),  Q row m = m0 + 8*nb + 2t + (e%2),
// so hi, lo and D depend only on (nb, t, e%2): one float2 each at tile column 8nb + 2t.
//
// Masks and tile ranges come from kernels/common/mask.cuh (DkvWork): Q tiles before the first
// one that sees block j are skipped, and only (Q tile, K block) pairs crossing the causal diagonal
// run the masked copy of the P loop, and tiles holding large-magnitude rows (flash.h: precise_rows)
// the exact one. Query rows >= seqlen_q are zero-filled with hi = +inf (preprocess), so their
// P = 0. Keys >= seqlen_k only touch dK/dV rows that are never stored.
#pragma once

#include "kernels/sm80/kernel_common.cuh"  // everything an sm80 kernel uses

namespace flash::sm80 {

// Tile: a DkvTileShape row (tile_config.h); kSplit is the column split, kWarpRows 16 or 32.
template <typename Element, int kHeadDim, typename Tile>
struct DkvKernelTraits {
  static constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kColSplit = Tile::kSplit;
  static constexpr int kWarpRows = Tile::kWarpRows;
  static constexpr int kMA = kWarpRows / 16;  // m16 atoms per warp
  static constexpr int kRowWarps = kBlockN / kWarpRows;
  static constexpr int kNWarps = kRowWarps * kColSplit;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kPitch = SmemTile<kHeadDim>::kPitch;
  static constexpr int kDW = kHeadDim / kColSplit;  // dK/dV columns per warp
  static constexpr int kNBlkM = kBlockM / 8;        // n8 blocks of S^T (Q rows)
  static constexpr int kNBlkD = kDW / 8;            // n8 blocks of a warp's dK/dV slice
  // dS^T from the Element-rounded P^T where the dK/dV accumulators (kMA * kDW fp32 per thread)
  // leave no room for an fp32 copy of P^T next to dP^T (kMA * kDW >= 128).
  static constexpr bool kPRounded = kMA * kDW >= 128;
  // Shared layout: sK, sV (kBlockN rows), then 2 stages of sQ, sdO (kBlockM rows), then
  // 2 stages of hi, lo and D (kBlockM floats each).
  static constexpr int kTileKV = kBlockN * kPitch;
  static constexpr int kTileQ = kBlockM * kPitch;
  static constexpr int kSmemBytes =
      (2 * kTileKV + 4 * kTileQ) * int(sizeof(Element)) + 6 * kBlockM * int(sizeof(float));
  static_assert(kWarpRows == 16 || kWarpRows == 32, "a warp owns one or two m16 atoms");
  static_assert(kBlockN % kWarpRows == 0 && kBlockM % 16 == 0, "tiles are multiples of the warp / k16 atom");
  static_assert(kDW % 16 == 0, "a warp's dK/dV slice is a multiple of 16 columns");
  static_assert(128 % kBlockM == 0, "Q tiles must tile the 128-rounded workspaces");
  static_assert(kBlockM / 4 * 3 <= kThreads, "one thread per 16 B of the hi/lo/D tiles");
};

// Tile::kFastCopy: predicate-free copies of whole Q / dO tiles (primitives/tile_copy.cuh), used
// where the registers allow it (tile_config.h).
// kLocal: the call has a sliding window's left bound (the launch picks: launch_utils.h,
// FLASH_BWD_LAUNCH_TEMPLATE); without it the kernel is the causal mask's code alone. kSoftcap: logit
// soft-capping (params.softcap > 0): S^T -> t first, dS^T times 1 - t^2 (softmax.cuh). kDropout:
// attention dropout (params.dropout_p > 0; flash.h): dV_j += (Z o P)^T dO_i, dS^T = P^T o (Z o dP^T
// rp - D) (rp = 1 / (1 - p); the mask regenerated from primitives/philox.cuh), dV times rp at the
// end; dS^T then takes P^T from its fp32 copy, not the Element fragments (those are Z o P^T).
// kAlibi: ALiBi (params.alibi_slopes_ptr; flash.h): S^T gains the bias before P^T is recomputed
// (common/mask.cuh: add_alibi, key rows); dS^T needs nothing more.
template <typename Element, int kHeadDim, typename TileShape, bool kLocal = false, bool kSoftcap = false,
          bool kDropout = false, bool kAlibi = false>
__global__ void __launch_bounds__(DkvKernelTraits<Element, kHeadDim, TileShape>::kThreads, 1)
flash_bwd_dkv_kernel(const Flash_bwd_params params) {
#if defined(__CUDA_ARCH__)  // device code only: the host pass needs just the stub
  using T = DkvKernelTraits<Element, kHeadDim, TileShape>;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kWarpRows = T::kWarpRows;
  constexpr int kMA = T::kMA, kPitch = T::kPitch, kThreads = T::kThreads;
  constexpr bool kFastCopy = TileShape::kFastCopy;
  constexpr bool kPRounded = T::kPRounded && !kDropout;

  extern __shared__ __align__(128) unsigned char flash_bwd_smem[];
  Element* sK = reinterpret_cast<Element*>(flash_bwd_smem);
  Element* sV = sK + T::kTileKV;
  Element* sQ0 = sV + T::kTileKV;  // stage s: sQ0 + s * kTileQ
  Element* sdO0 = sQ0 + 2 * T::kTileQ;
  float* sHi0 = reinterpret_cast<float*>(sdO0 + 2 * T::kTileQ);  // stage s: + s * kBlockM
  float* sLo0 = sHi0 + 2 * kBlockM;
  float* sDsum0 = sLo0 + 2 * kBlockM;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int warp_n = warp % T::kRowWarps;  // K rows [kWarpRows*warp_n, +kWarpRows)
  const int warp_d = warp / T::kRowWarps;  // dK/dV columns [kDW*warp_d, +kDW)
  const int g = lane / 4, t = lane % 4;

  // This CTA's key block, batch, kv head and the Q tiles that see the block (see the header).
  const DkvWork<kBlockM, kBlockN> w(params);
  if (w.past_end()) return;  // varlen: a key block past its sequence's end (work.cuh: past_end)

  // Alg. 2 line 10: the cp.async copies of iteration `it` (query head, Q tile) into `stage`.
  auto load_q_tile = [&](int it, int stage) {
    w.template copy_q_tiles_async<Element, SmemTile<kHeadDim>, kHeadDim, kThreads, kFastCopy>(
        params, it, smem_u32addr(sQ0 + stage * T::kTileQ), smem_u32addr(sdO0 + stage * T::kTileQ), tid);
    w.copy_row_stats_async(params, it, sHi0 + stage * kBlockM, sLo0 + stage * kBlockM, sDsum0 + stage * kBlockM,
                           tid);
  };

  // Alg. 2 line 7: load K_j, V_j (resident for the whole CTA), with the first Q tile.
  w.template copy_kv_tiles_async<Element, SmemTile<kHeadDim>, kHeadDim, kThreads>(params, smem_u32addr(sK),
                                                                                smem_u32addr(sV), tid);
  if (w.n_iter > 0) load_q_tile(0, 0);
  cp_async_commit();

  // Alg. 2 line 8: dK_j = dV_j = 0 (this warp's kWarpRows rows x kDW columns).
  float acc_dk[kMA][T::kNBlkD][4], acc_dv[kMA][T::kNBlkD][4];
  zero_acc(acc_dk);
  zero_acc(acc_dv);

  const DropoutRng dropout = DropoutRng::of<kDropout>(params);

  bool precise_next = w.precise(params, 0);  // large-magnitude rows in the next Q tile (one load ahead)
  for (int it = 0; it < w.n_iter; ++it) {
    const int stage = it % 2;
    const bool precise = precise_next;
    precise_next = w.precise(params, it + 1);
    pipeline_step(it, w.n_iter, load_q_tile);  // Q_{it+1}, dO_{it+1} in flight; Q_it, dO_it landed

    const Element* sQ = sQ0 + stage * T::kTileQ;
    const Element* sdO = sdO0 + stage * T::kTileQ;
    const float* sHi = sHi0 + stage * kBlockM;
    const float* sLo = sLo0 + stage * kBlockM;
    const float* sDsum = sDsum0 + stage * kBlockM;
    const int m0 = w.m0(it);

    // Alg. 2 line 11 (transposed): S^T = K_j Q_i^T, this warp's kWarpRows K rows x kBlockM Q rows.
    float acc_s[kMA][T::kNBlkM][4];
    zero_acc(acc_s);
    gemm_abt_smem<kMA, T::kNBlkM, kHeadDim>(acc_s, sK, kWarpRows * warp_n, sQ, lane);
    // Soft-capping: S^T -> t, and 1 - t^2 kept for dS^T (softmax.cuh).
    [[maybe_unused]] SoftcapGrad<float[kMA][T::kNBlkM][4]> dt;
    if constexpr (kSoftcap) {
      softcap_scores(acc_s, params.softcap_prescale);
      dt.set(acc_s);
    }
    if constexpr (kAlibi) {  // S^T + ALiBi's bias of the query head of this iteration (mask.cuh)
      w.mask.template add_alibi<true>(acc_s, w.n0 + kWarpRows * warp_n, m0, alibi_slope(params, w.seq.bidb, w.head(it)));
    }

    // Alg. 2 line 12: P^T = exp2(S^T scale_log2 - LSE_log2) in place (fp32; masked pairs -> 0),
    // primitives/softmax.cuh. The masked and exact copies of the loop run on the tiles that need
    // them only: the branch is uniform over the CTA.
    with_p_mode(precise, w.template needs_mask<kLocal>(it), [&](auto mode) {
      constexpr PMode kMode = decltype(mode)::value;
#pragma unroll
      for (int nb = 0; nb < T::kNBlkM; ++nb) {
        const int mc = nb * 8 + 2 * t;  // tile column (Q row) of e = 0; e = 1 is mc + 1
        const float2 hi2 = *reinterpret_cast<const float2*>(sHi + mc);
        float2 lo2 = make_float2(0.f, 0.f);
        if constexpr (kMode == PMode::kExact) lo2 = *reinterpret_cast<const float2*>(sLo + mc);
#pragma unroll
        for (int ma = 0; ma < kMA; ++ma) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = w.n0 + kWarpRows * warp_n + g + 8 * (e / 2) + 16 * ma;
            const bool visible = w.mask.template visible<kLocal>(m0 + mc + (e % 2), key);
            acc_s[ma][nb][e] = recompute_p<kMode>(acc_s[ma][nb][e], params.scale_softmax_log2, (e % 2) ? hi2.y : hi2.x,
                                                  (e % 2) ? lo2.y : lo2.x, visible);
          }
        }
      }
    });
    // P^T as Element A fragments (k16 slices of Q rows, per atom) for dV += P^T dO (the dropout
    // twin: after dP^T, below).
    uint32_t a_p[kBlockM / 16][kMA][4];
    auto p_fragments = [&] {
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
#pragma unroll
        for (int ma = 0; ma < kMA; ++ma) acc_to_a_frag<T::kNBlkM, Element>(a_p[kk][ma], acc_s[ma], kk);
      }
    };
    if constexpr (!kDropout) p_fragments();

    // Alg. 2 line 14 (transposed): dP^T = V_j dO_i^T.
    float acc_dp[kMA][T::kNBlkM][4];
    zero_acc(acc_dp);
    gemm_abt_smem<kMA, T::kNBlkM, kHeadDim>(acc_dp, sV, kWarpRows * warp_n, sdO, lane);

    if constexpr (kDropout) {
      // Dropout, one pass per unit of the mask (rows: keys; columns: the Q tile's rows): dS^T = P^T o
      // (Z o dP^T rp - D) into acc_dp, then Z o P^T into acc_s, whose fragments feed dV.
      const uint32_t bh = DropoutRng::head_word(w.seq.bidb, params.h, w.head(it));
      dropout.template for_each_kept<true, kMA, T::kNBlkM>(
          bh, w.n0 + kWarpRows * warp_n + g, m0 + 2 * t, [&](int ma, int nb, int e, bool kept) {
            const float p = acc_s[ma][nb][e], dsum = sDsum[nb * 8 + 2 * t + e % 2];
            acc_dp[ma][nb][e] = p * ((kept ? acc_dp[ma][nb][e] * params.dropout_rp : 0.f) - dsum);
            acc_s[ma][nb][e] = kept ? p : 0.f;
          });
      p_fragments();
    } else {
      // Alg. 2 line 15: dS^T = P^T o (dP^T - D) in place (D broadcast along the K rows). With
      // kPRounded, P^T is read back from its Element fragments (what the baseline's softmax
      // backward also uses) so the fp32 copy is dead during the dP^T product: 16 fewer registers.
#pragma unroll
      for (int nb = 0; nb < T::kNBlkM; ++nb) {
        const float2 dsum2 = *reinterpret_cast<const float2*>(sDsum + nb * 8 + 2 * t);
#pragma unroll
        for (int ma = 0; ma < kMA; ++ma) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // h: row g (e = 0,1) or g + 8 (e = 2,3)
            float2 p;
            if constexpr (kPRounded) {
              p = unpack2<Element>(a_p[nb / 2][ma][(nb % 2) * 2 + h]);
            } else {
              p = make_float2(acc_s[ma][nb][2 * h], acc_s[ma][nb][2 * h + 1]);
            }
            acc_dp[ma][nb][2 * h] = p.x * (acc_dp[ma][nb][2 * h] - dsum2.x);
            acc_dp[ma][nb][2 * h + 1] = p.y * (acc_dp[ma][nb][2 * h + 1] - dsum2.y);
            if constexpr (kSoftcap) {  // times 1 - t^2 of elements (2h, 2h + 1): flat pair (ma kNBlkM + nb) 2 + h
              const float2 c = dt.pair((ma * T::kNBlkM + nb) * 2 + h);
              acc_dp[ma][nb][2 * h] *= c.x;
              acc_dp[ma][nb][2 * h + 1] *= c.y;
            }
          }
        }
      }
    }

    // Alg. 2 lines 13 and 17: dV_j += P^T dO_i, dK_j += dS^T Q_i, with P^T / dS^T as
    // register A fragments (k = Q rows) and dO_i / Q_i as ldmatrix.trans B fragments.
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      uint32_t a_ds[kMA][4];
#pragma unroll
      for (int ma = 0; ma < kMA; ++ma) acc_to_a_frag<T::kNBlkM, Element>(a_ds[ma], acc_dp[ma], kk);
      gemm_ab_trans_smem<kMA, T::kNBlkD, kPitch>(acc_dv, a_p[kk], sdO, 16 * kk, T::kDW * warp_d, lane);
      gemm_ab_trans_smem<kMA, T::kNBlkD, kPitch>(acc_dk, a_ds, sQ, 16 * kk, T::kDW * warp_d, lane);
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }

  // Alg. 2 line 19: write dK_j (times softmax_scale: S was scaled) and dV_j, staged through the
  // K/V buffers (no copy may still be writing them) for coalesced 16-byte stores.
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int ma = 0; ma < kMA; ++ma) {
    store_acc_to_smem<T::kNBlkD, kPitch>(sK, acc_dk[ma], kWarpRows * warp_n + 16 * ma, T::kDW * warp_d,
                                         float(params.scale_softmax), lane);
    store_acc_to_smem<T::kNBlkD, kPitch>(sV, acc_dv[ma], kWarpRows * warp_n + 16 * ma, T::kDW * warp_d,
                                         kDropout ? params.dropout_rp : 1.f, lane);
  }
  __syncthreads();
  w.template store_kv_tile<Element, SmemTile<kHeadDim>, kHeadDim, kThreads>(params, params.dk, sK, tid);
  w.template store_kv_tile<Element, SmemTile<kHeadDim>, kHeadDim, kThreads>(params, params.dv, sV, tid);
#endif
}

}  // namespace flash::sm80

FLASH_BWD_LAUNCH_TEMPLATE(Sm80, sm80, Dkv, dkv, "dK/dV")
