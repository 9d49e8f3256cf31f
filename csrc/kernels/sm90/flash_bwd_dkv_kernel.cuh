// FlashAttention-2 backward, dK/dV kernel on Hopper tensor cores (wgmma): the same algorithm as
// csrc/kernels/sm80/flash_bwd_dkv_kernel.cuh (Dao 2023, Alg. 2 outer loop over K/V blocks j; dQ
// left to the dQ kernel, so no atomics and a deterministic result), with every product a
// warpgroup-wide asynchronous wgmma instead of per-warp mma.sync.
//
// One CTA per (K/V block j of kBlockN rows, batch, kv head); warpgroup wg owns K rows
// [64 wg, 64 wg + 64). K_j, V_j stay in shared memory; for every query head of the GQA group and
// every Q tile i of kBlockM rows that sees block j, Q_i, dO_i, LSE_log2_i (hi + lo), D_i stream in
// through the tile row's kStages stages (BwdStages, smem_layout.cuh: by TMA on full / empty
// mbarriers for calls whose q / dout TMA can describe, the loader's refill issued under the
// next tile's first products; else by cp.async through two), and each warpgroup computes
//   S^T  = K_j Q_i^T                    wgmma SS, B = Q_i K-major         (Alg. 2 line 11)
//   dP^T = V_j dO_i^T                   wgmma SS, B = dO_i K-major        (line 14)
//   P^T  = exp2(S^T scale_log2 - LSE_log2_i)   while dP^T runs            (line 12; masked -> 0)
//   dV_j += P^T dO_i                    wgmma RS, A = P^T from registers, B = dO_i N-major (13)
//   dS^T = P^T o (dP^T - D_i)                                             (line 15)
//   dK_j += dS^T Q_i                    wgmma RS, A = dS^T, B = Q_i N-major  (line 17)
// The transposed products put K rows on the wgmma M axis, so P^T and dS^T are produced as
// accumulators whose k16 slices are the register A operands of the next products: no shared
// memory round trip, and Q_i / dO_i each serve as a K-major and an N-major operand from one copy.
// kSplit > 1 cuts Q_i into parts of kPart rows whose S^T and dP^T products are all issued first
// (the production table uses 1: the tuning harness measured 2 slower, docs/PERF_NOTES.md).
//
// Rows of three warpgroups (d96's long row, 192 keys: 168 registers per thread) cannot hold all of
// the above at once (~190), so their twins (not dropout's) take register diets (tile_shapes.h):
//   DpInS  S^T alone first; once P^T is in its A operands, dP^T = V_j dO_i^T into S^T's registers,
//          and dS^T from the Element-rounded P^T;
//   PSmem  P^T stored (stmatrix) into a swizzled tile per warpgroup, fenced for the async proxy,
//          the warpgroup's four warps meeting at a named barrier; dV_j += P^T dO_i as an SS wgmma
//          (A = P^T K-major, as K_j for S^T); dS^T reloads P^T's bits (ldmatrix) a k16 step at a time.
// Per Q tile then: S^T -> P^T -> [P^T to shared] -> dP^T, dV issued -> dS^T -> dK issued.
//
// Accumulator bookkeeping (thread = 128 wg + 32 w + 4 g + t): S^T acc[h][j][e] of part h holds
//   K row n = n0 + 64 wg + 16 w + g + 8 (e / 2),  Q row m = m0 + h kPart + 8 j + 2 t + (e % 2),
// so hi, lo and D are one float2 per n8 block j. Masks, tile ranges, ragged edges and GQA are
// exactly as in the sm80 kernel (kernels/common/mask.cuh, work.cuh; see its header).
#pragma once

#include "kernels/sm90/smem_layout.cuh"  // with everything an sm90 kernel uses
#include "kernels/sm90/flash_bwd_dkv_roles_kernel.cuh"  // the Roles<> rows' kernel, launched below

namespace flash::sm90 {

// Tile: a DkvTileShape row (tile_config.h); kSplit: parts of the Q tile whose products are
// queued together (see the main loop).
template <typename Element, int kHeadDim, typename Tile>
struct DkvKernelTraits : BwdTileTraits<kHeadDim, Tile, Tile::kBlockN / 64> {
  using Base = BwdTileTraits<kHeadDim, Tile, Tile::kBlockN / 64>;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDimPad, Base::kHeadDimMma, typename Base::TileQ, typename Base::TileKV;
  static constexpr int kSplit = Tile::kSplit, kStages = Tile::kStages;
  // PSmem rows (common/tile_shapes.h): each warpgroup's P^T (its 64 K rows x kBlockM queries, the
  // A operand of dV += P^T dO) in a swizzled tile of its own, K-major as K_j is for S^T.
  using TileP = SwizzledTile<64, kBlockM>;
  static constexpr int kPBytes = Tile::kPSmem ? Base::kWarpGroups * TileP::kBytes : 0;
  // Shared layout (1024-byte aligned): sK, sV, then kStages x (sQ, sdO), then the warpgroups' P^T
  // tiles (PSmem rows; none else), then kStages x (hi, lo, D) of kBlockM floats each, then the
  // stages' full and empty mbarriers (BwdStages).
  static constexpr int kStatBytes = kStages * kBlockM * 4;
  using Regions = SmemRegions<TileKV::kBytes, TileKV::kBytes, kStages * TileQ::kBytes, kStages * TileQ::kBytes,
                              kPBytes, kStatBytes, kStatBytes, kStatBytes, 2 * kStages * 8>;
  static constexpr int kOffV = Regions::offset(1), kOffQ = Regions::offset(2), kOffDO = Regions::offset(3),
                       kOffP = Regions::offset(4), kOffHi = Regions::offset(5), kOffLo = Regions::offset(6),
                       kOffDsum = Regions::offset(7), kOffBar = Regions::offset(8);
  static constexpr int kSmemBytes = Regions::kBytes + 1024;  // + alignment slack
  // The register diets of common/tile_shapes.h in the kernel's twin: not in the dropout twins
  // (dS^T = P^T o (Z o dP^T rp - D) is formed before Z o P^T, so P^T and dP^T live at once there).
  static constexpr bool dp_in_s(bool dropout) { return Tile::kDpInS && !dropout; }
  static constexpr bool p_smem(bool dropout) { return Tile::kPSmem && !dropout; }
  // dS^T from the Element-rounded P^T (as the sm80 kernel's kPRounded) where the fp32 P^T
  // (kBlockM / 2 registers) would not fit next to dP^T and the dK/dV accumulators, where it is gone
  // (DpInS: its registers hold dP^T; PSmem: dS^T reloads the rounded copy), and in the short row's
  // twins that must give the bits of such a long row (kRoundedPt, tile_shapes.h).
  static constexpr bool p_rounded(bool softcap, bool dropout) {
    return kBlockM >= 128 || dp_in_s(dropout) || p_smem(dropout) || (Tile::kRoundedPt && !softcap && !dropout);
  }
  // dS^T as one packed bf16 multiply of the rounded P^T and bf16(dP^T - D): bf16 has fp32's range,
  // so the extra rounding cannot overflow. Not for fp16: a dP^T - D past 65504 (large dO, e.g.
  // under loss scaling) would round to inf and turn P^T = 0 into NaN; fp16 multiplies in fp32.
  static constexpr bool packed_ds(bool softcap, bool dropout) {
    return p_rounded(softcap, dropout) && std::is_same<Element, __nv_bfloat16>::value;
  }
  static_assert(kBlockN % 64 == 0 && kBlockM % 16 == 0, "64 K rows per warpgroup, k16 steps of Q rows");
  static_assert(kSplit == 1 || !(Tile::kDpInS || Tile::kPSmem), "the register diets take whole Q tiles (kSplit 1)");
  static_assert(!Tile::kPSmem || kBlockM % 64 == 0, "P^T tiles are whole 64-column swizzle blocks");
  static_assert(kBlockM / kSplit == 64 || kBlockM / kSplit == 128, "a part's S^T is one m64nNk16 wgmma wide");
  static_assert(kHeadDimMma == 64 || kHeadDimMma == 96 || kHeadDimMma == 128,
                "dK/dV are one m64nNk16 wgmma wide (N = d, or d padded)");
  static_assert(128 % kBlockM == 0, "Q tiles must tile the 128-rounded workspaces");
};

// The rows kernel's self-contained steps (the kernel below calls them in Alg. 2's order). Each is
// __forceinline__: the kernel compiles as the one function it was (SASS byte-identical to the
// kernel with the steps written out). They declare no arrays of their own: the kernel does, and
// passes them (a dS^T helper with its own P^T step array renumbered the DpInS / PSmem twins'
// registers).

// Alg. 2 line 8: dK_j = dV_j = 0 (this warpgroup's 64 rows x d).
template <int kNBlkD>
__device__ __forceinline__ void zero_dk_dv(float (&acc_dk)[kNBlkD][4], float (&acc_dv)[kNBlkD][4]) {
#pragma unroll
  for (int j = 0; j < kNBlkD; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[j][e] = acc_dv[j][e] = 0.f;
  }
}

// Alg. 2 line 11 or 14, transposed: S^T = K_j Q_i^T (sA = sK, sB = sQ) or dP^T = V_j dO_i^T
// (sA = sV, sB = sdO), over the head dim's k16 steps as one wgmma group (the caller fences first):
// A the warpgroup's 64 rows of K_j or V_j, B the kNBlkP * 8 rows from q0 of Q_i or dO_i.
template <typename Element, int kHeadDim, typename T, int kNBlkP>
__device__ __forceinline__ void issue_kv_q_product(float (&acc)[kNBlkP][4], uint32_t sA, uint32_t sB, int wg, int q0) {
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    Wgmma<Element, kNBlkP * 8>::template ss<0>(flat(acc), T::TileKV::desc_k_major(sA, 64 * wg, kk),
                                               T::TileQ::desc_k_major(sB, q0, kk), kk > 0);
  }
  wgmma_commit();
}

// Alg. 2 lines 11 and 14 (transposed), all issued up front: for each of the kSplit parts of the Q
// tile (kPart rows), S^T = K_j Q_part^T and dP^T = V_j dO_part^T, a wgmma group each (S^T_h's,
// then dP^T_h's). The tensor cores then have the later parts queued while this warpgroup does the
// softmax math of the first.
template <typename Element, int kHeadDim, typename T, int kSplit, int kNBlkP>
__device__ __forceinline__ void issue_s_dp_parts(float (&acc_s)[kSplit][kNBlkP][4], float (&acc_dp)[kSplit][kNBlkP][4],
                                                 uint32_t sK, uint32_t sV, uint32_t sQ, uint32_t sdO, int wg) {
  wgmma_fence();
#pragma unroll
  for (int h = 0; h < kSplit; ++h) {
    issue_kv_q_product<Element, kHeadDim, T>(acc_s[h], sK, sQ, wg, h * kNBlkP * 8);
    issue_kv_q_product<Element, kHeadDim, T>(acc_dp[h], sV, sdO, wg, h * kNBlkP * 8);
  }
}

// Alg. 2 line 12 for the part of the Q tile at m0 from tile column q0: P^T = exp2(S^T scale_log2 -
// LSE_log2) in place (fp32; masked -> 0; smem_layout.cuh: recompute_pt), after soft-capping (S^T
// -> t, and 1 - t^2 kept in dt for dS^T; softmax.cuh) and ALiBi's bias of iteration it's query
// head (mask.cuh: add_alibi, the warpgroup's key rows).
template <bool kLocal, bool kSoftcap, bool kAlibi, int kNBlkP, typename Work>
__device__ __forceinline__ void recompute_part_pt(float (&acc_s)[kNBlkP][4], SoftcapGrad<float[kNBlkP][4]>& dt,
                                                  const Work& w, const Flash_bwd_params& params, float softcap_prescale,
                                                  bool precise, bool needs_mask, const float* sHi, const float* sLo,
                                                  int it, int m0, int q0, int wg, int warp_wg, int key0, int t) {
  if constexpr (kSoftcap) {
    softcap_scores(acc_s, softcap_prescale);
    dt.set(acc_s);
  }
  if constexpr (kAlibi) {
    w.mask.template add_alibi<true>(acc_s, w.n0 + 64 * wg + 16 * warp_wg, m0 + q0,
                                    alibi_slope(params, w.seq.bidb, w.head(it)));
  }
  recompute_pt<kLocal>(acc_s, w.mask, precise, needs_mask, params.scale_softmax_log2, sHi, sLo, m0, q0, key0, t);
}

// Alg. 2 line 13 or 17 from k16 step kk0 of the Q tile on: acc (dV_j or dK_j) += A B, A from
// registers (P^T or dS^T), B = dO_i or Q_i at sB, N-major; one wgmma group.
template <typename Element, typename T, int kNBlkD, int kKSteps>
__device__ __forceinline__ void issue_rs_product(float (&acc)[kNBlkD][4], const uint32_t (&a)[kKSteps][4], uint32_t sB,
                                                 int kk0) {
  wgmma_rs_group<Element, kNBlkD * 8, 1>(flat(acc), a, [&](int kk) { return T::TileQ::desc_mn_major(sB, kk0 + kk); });
}

// Alg. 2 line 15 for the part of a Q tile from tile column q0: dS^T = P^T o (dP^T - D), D
// broadcast along the K rows (sDsum: D of the tile's columns), softcap: times 1 - t^2 (dt), into
// dS^T's A operands a_ds. With kPRounded, P^T lives only as its Element A operands a_p (the fp32
// copy acc_s is dead while dP^T is pending).
template <typename Element, bool kPackedDs, bool kPRounded, bool kSoftcap, int kNBlkP, int kKSteps, typename Dt>
__device__ __forceinline__ void form_ds_part(uint32_t (&a_ds)[kKSteps][4], float (&acc_dp)[kNBlkP][4],
                                             const uint32_t (&a_p)[kKSteps][4], const float (&acc_s)[kNBlkP][4],
                                             const Dt& dt, const float* sDsum, int q0, int t) {
  if constexpr (kPackedDs) {
    // dS^T = P^T o bf16(dP^T - D): one packed multiply per two elements, no unpacking. The
    // register a_p[..][(j % 2) * 2 + r] holds row r (g or g + 8) of n8 block j.
#pragma unroll
    for (int j = 0; j < kNBlkP; ++j) {
      const float2 dsum2 = *reinterpret_cast<const float2*>(sDsum + q0 + 8 * j + 2 * t);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = (j % 2) * 2 + r;
        float2 d = make_float2(acc_dp[j][2 * r] - dsum2.x, acc_dp[j][2 * r + 1] - dsum2.y);
        if constexpr (kSoftcap) {  // times 1 - t^2 of elements (2r, 2r + 1) of block j
          const float2 c = dt.pair(2 * j + r);
          d = make_float2(d.x * c.x, d.y * c.y);
        }
        a_ds[j / 2][i] = mul2<Element>(a_p[j / 2][i], pack2<Element>(d.x, d.y));
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kNBlkP; ++j) {
      const float2 dsum2 = *reinterpret_cast<const float2*>(sDsum + q0 + 8 * j + 2 * t);
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // r: row g (e = 0,1) or g + 8 (e = 2,3)
        const float2 p = kPRounded ? unpack2<Element>(a_p[j / 2][(j % 2) * 2 + r])
                                   : make_float2(acc_s[j][2 * r], acc_s[j][2 * r + 1]);
        acc_dp[j][2 * r] = p.x * (acc_dp[j][2 * r] - dsum2.x);
        acc_dp[j][2 * r + 1] = p.y * (acc_dp[j][2 * r + 1] - dsum2.y);
        if constexpr (kSoftcap) {  // times 1 - t^2
          const float2 c = dt.pair(2 * j + r);
          acc_dp[j][2 * r] *= c.x;
          acc_dp[j][2 * r + 1] *= c.y;
        }
      }
    }
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) acc_to_a_frag<kNBlkP, Element>(a_ds[kk], acc_dp, kk);
  }
}

// Dropout (primitives/philox.cuh) on the part of the Q tile from tile column q0, once its P^T
// (acc_s) and dP^T (acc_dp) are done: one pass per unit of the mask Z (key rows from key0, query
// columns from col0) puts dS^T = P^T o (Z o dP^T rp - D) into acc_dp (Alg. 2 line 15: it needs P^T
// itself) and Z o P^T into acc_s; then both become A operands, a_ds and a_p (dV's, line 13).
template <typename Element, int kNBlkP, int kKSteps>
__device__ __forceinline__ void dropout_part(uint32_t (&a_p)[kKSteps][4], uint32_t (&a_ds)[kKSteps][4],
                                             float (&acc_s)[kNBlkP][4], float (&acc_dp)[kNBlkP][4],
                                             const DropoutRng& dropout, const Flash_bwd_params& params, uint32_t bh,
                                             int key0, int col0, const float* sDsum, int q0, int t) {
  dropout.template for_each_kept<true, 1, kNBlkP>(bh, key0, col0, [&](int, int j, int e, bool kept) {
    const float p = acc_s[j][e], dsum = sDsum[q0 + 8 * j + 2 * t + e % 2];
    acc_dp[j][e] = p * ((kept ? acc_dp[j][e] * params.dropout_rp : 0.f) - dsum);
    acc_s[j][e] = kept ? p : 0.f;
  });
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    acc_to_a_frag<kNBlkP, Element>(a_ds[kk], acc_dp, kk);
    acc_to_a_frag<kNBlkP, Element>(a_p[kk], acc_s, kk);
  }
}

// The register diets' own steps (DpInS, PSmem: the traits; the kernel's diet branch).

// PSmem, the A operand of Alg. 2 line 13 (dV_j += P^T dO_i, then from shared memory): P^T (its A
// operands a_p) into the warpgroup's tile, each warp its own 16 K rows
// (p_frag_addr(kk): this lane's stmatrix address of k16 step kk), the stores then made visible to
// the async proxy that the wgmma reads through.
template <int kKSteps, typename FragAddr>
__device__ __forceinline__ void store_pt_tile(const uint32_t (&a_p)[kKSteps][4], FragAddr&& p_frag_addr) {
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) stmatrix_x4(p_frag_addr(kk), a_p[kk]);
  fence_proxy_async();
}

// PSmem (Alg. 2 line 13 from shared memory): dV_j += P^T dO_i as SS wgmmas, A = P^T K-major in
// the warpgroup's tile sP as K_j is for S^T (M: the warpgroup's 64 K rows, K: 16 queries), B = dO_i
// N-major, once the warpgroup's four warps have stored their rows (named barrier `barrier`).
template <typename Element, typename T, int kKSteps, int kNBlkD>
__device__ __forceinline__ void issue_dv_from_pt_tile(float (&acc_dv)[kNBlkD][4], uint32_t sP, uint32_t sdO,
                                                      int barrier) {
  named_barrier_sync(barrier, 128);  // the warpgroup's four warps stored their rows
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    Wgmma<Element, kNBlkD * 8>::template ss<1>(flat(acc_dv), T::TileP::desc_k_major(sP, 0, kk),
                                              T::TileQ::desc_mn_major(sdO, kk), 1);
  }
  wgmma_commit();
}

// The register diets' Alg. 2 line 15 at k16 step kk: dS^T = P^T o (dP^T - D) into the A operand
// a_ds from p, the rounded P^T's A operand of the step; softcap: times 1 - t^2 (dt).
template <typename Element, bool kPackedDs, bool kSoftcap, int kNBlkP, typename Dt>
__device__ __forceinline__ void form_ds_step(uint32_t (&a_ds)[4], const uint32_t (&p)[4],
                                             const float (&acc_dp)[kNBlkP][4], int kk, const Dt& dt, const float* sDsum,
                                             int t) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // p[i]: row g + 8 (i % 2) of n8 block j = 2 kk + i / 2
    const int j = 2 * kk + i / 2, r = i % 2;
    const float2 dsum2 = *reinterpret_cast<const float2*>(sDsum + 8 * j + 2 * t);
    float2 d = make_float2(acc_dp[j][2 * r] - dsum2.x, acc_dp[j][2 * r + 1] - dsum2.y);
    if constexpr (kPackedDs) {  // as form_ds_part: one packed multiply, 1 - t^2 first
      if constexpr (kSoftcap) {
        const float2 c = dt.pair(2 * j + r);
        d = make_float2(d.x * c.x, d.y * c.y);
      }
      a_ds[i] = mul2<Element>(p[i], pack2<Element>(d.x, d.y));
    } else {  // fp16: in fp32, 1 - t^2 last
      const float2 pf = unpack2<Element>(p[i]);
      d = make_float2(pf.x * d.x, pf.y * d.y);
      if constexpr (kSoftcap) {
        const float2 c = dt.pair(2 * j + r);
        d = make_float2(d.x * c.x, d.y * c.y);
      }
      a_ds[i] = pack2<Element>(d.x, d.y);
    }
  }
}

// Alg. 2 line 19: dK_j (times softmax_scale: S was scaled) and dV_j (dropout: times rp), staged
// through the K/V tiles (no copy may still be writing them) for coalesced 16-byte stores.
template <typename Element, typename T, bool kDropout, int kNBlkD, typename Work>
__device__ __forceinline__ void store_dk_dv(const Work& w, const Flash_bwd_params& params, unsigned char* smem,
                                            const float (&acc_dk)[kNBlkD][4], const float (&acc_dv)[kNBlkD][4],
                                            int wg, int tid_wg, int tid) {
  using TileKV = typename T::TileKV;
  constexpr int kBlockN = T::kBlockN, kHeadDimPad = T::kHeadDimPad, kThreads = T::kThreads;
  cp_async_wait<0>();
  __syncthreads();
  store_acc_to_smem<kBlockN, kHeadDimPad, kNBlkD, Element>(smem, acc_dk, 64 * wg, float(params.scale_softmax), tid_wg);
  store_acc_to_smem<kBlockN, kHeadDimPad, kNBlkD, Element>(smem + T::kOffV, acc_dv, 64 * wg,
                                                           kDropout ? params.dropout_rp : 1.f, tid_wg);
  __syncthreads();
  w.template store_kv_tile<Element, TileKV, kHeadDimPad, kThreads>(params, params.dk, smem, tid);
  w.template store_kv_tile<Element, TileKV, kHeadDimPad, kThreads>(params, params.dv, smem + T::kOffV, tid);
}

// kLocal: the call has a sliding window's left bound (the launch picks: smem_layout.cuh,
// FLASH_SM90_BWD_LAUNCH); without it the kernel is the causal mask's code alone. kSoftcap: logit
// soft-capping (params.softcap > 0): S^T -> t first, dS^T times 1 - t^2 (softmax.cuh). kDropout:
// attention dropout (params.dropout_p > 0; flash.h): per part, dS^T = P^T o (Z o dP^T rp - D) first
// (it needs P^T itself), then Z o P^T as dV's A operand, dV times rp at the end (the mask from
// primitives/philox.cuh, as the sm80 kernel's twin).
// kAlibi: ALiBi (params.alibi_slopes_ptr; flash.h): S^T gains the bias before P^T is recomputed
// (common/mask.cuh: add_alibi, key rows); dS^T needs nothing more.
template <typename Element, int kHeadDim, typename TileShape, bool kTma, bool kLocal = false, bool kSoftcap = false,
          bool kDropout = false, bool kAlibi = false>
__global__ void __launch_bounds__(DkvKernelTraits<Element, kHeadDim, TileShape>::kThreads, 1)
flash_bwd_dkv_kernel(const __grid_constant__ Flash_bwd_params params, const __grid_constant__ BwdTmaMaps maps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = DkvKernelTraits<Element, kHeadDim, TileShape>;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kSplit = T::kSplit;
  using TileKV = typename T::TileKV;
  using TileQ = typename T::TileQ;
  constexpr int kThreads = T::kThreads, kPart = kBlockM / kSplit;  // kPart: Q rows per part
  constexpr int kHeadDimPad = T::kHeadDimPad;                      // shared tiles' columns
  constexpr int kHeadDimMma = T::kHeadDimMma;                      // dK's and dV's columns (smem_layout.cuh)
  constexpr int kNBlkP = kPart / 8, kNBlkD = kHeadDimMma / 8;     // n8 blocks of a part's S^T, of dK / dV
  // This twin's register diets (common/tile_shapes.h: DpInS, PSmem) and dS^T's form (the traits).
  constexpr bool kDpInS = T::dp_in_s(kDropout), kPSmem = T::p_smem(kDropout);
  constexpr bool kPRounded = T::p_rounded(kSoftcap, kDropout), kPackedDs = T::packed_ds(kSoftcap, kDropout);
  // Named barrier 1 + wg: warpgroup wg's P^T tile written (PSmem; 0 is __syncthreads, the
  // stages wait on mbarriers: no other named barrier in this kernel).
  constexpr int kPtStoredBarrier = 1;

  unsigned char* smem = aligned_dynamic_smem();
  const uint32_t smem_addr = smem_u32addr(smem);
  const uint32_t sK = smem_addr, sV = smem_addr + T::kOffV;
  float* sHi0 = reinterpret_cast<float*>(smem + T::kOffHi);  // stage s: + s * kBlockM
  float* sLo0 = reinterpret_cast<float*>(smem + T::kOffLo);
  float* sDsum0 = reinterpret_cast<float*>(smem + T::kOffDsum);

  // Thread = 128 wg + 32 warp_wg + 4 g + t (see the header).
  const int tid = threadIdx.x, wg = warpgroup_index(tid), tid_wg = tid % 128, warp_wg = tid_wg / 32;
  const int lane = tid % 32, g = lane / 4, t = lane % 4;
  // PSmem: this warpgroup's P^T tile (T::TileP), and where this lane's stmatrix / ldmatrix address
  // of k16 step kk points: row 16 warp_wg + lane % 16, column 16 kk + 8 (lane / 16) (ldmatrix.cuh's
  // A-fragment recipe: warp w stores and reloads its own 16 K rows).
  const uint32_t sP = smem_addr + T::kOffP + wg * T::TileP::kBytes;
  auto p_frag_addr = [&](int kk) { return sP + T::TileP::offset(16 * warp_wg + lane % 16, 16 * kk + 8 * (lane / 16)); };

  // This CTA's key block, batch, kv head and the Q tiles that see the block (kernels/common/work.cuh).
  const DkvWork<kBlockM, kBlockN> w(params);
  if (w.past_end()) return;  // varlen: a key block past its sequence's end (work.cuh: past_end)

  // Alg. 2 line 10: Q_i, dO_i, hi, lo, D of iteration `it` (query head, Q tile) into `stage`
  // (smem_layout.cuh). Line 7: K_j, V_j (resident, cp.async), with the first Q tiles.
  const BwdStages<kTma, kThreads, T::kStages> stages(smem_addr + T::kOffBar);
  auto load_q_tile = [&](int it, int s) {
    load_dkv_stage<kTma, Element, T>(w, params, maps, smem, it, s, stages.full(s), tid);
  };
  stages.start(tid, maps, w.n_iter, load_q_tile,
               [&] { w.template copy_kv_tiles_async<Element, TileKV, kHeadDimPad, kThreads>(params, sK, sV, tid); });

  float acc_dk[kNBlkD][4], acc_dv[kNBlkD][4];
  zero_dk_dv(acc_dk, acc_dv);  // Alg. 2 line 8

  const DropoutRng dropout = DropoutRng::of<kDropout>(params);

  bool precise_next = w.precise(params, 0);  // large-magnitude rows in the next Q tile (one load ahead)
  for (int it = 0; it < w.n_iter; ++it) {
    const int stage = stages.stage(it);
    const bool precise = precise_next;
    precise_next = w.precise(params, it + 1);
    stages.acquire(it, w.n_iter, load_q_tile);  // Q_it, dO_it and their statistics landed

    const uint32_t sQ = smem_addr + T::kOffQ + stage * TileQ::kBytes;
    const uint32_t sdO = smem_addr + T::kOffDO + stage * TileQ::kBytes;
    const float* sHi = sHi0 + stage * kBlockM;
    const float* sLo = sLo0 + stage * kBlockM;
    const float* sDsum = sDsum0 + stage * kBlockM;
    const int m0 = w.m0(it);
    // Varlen by TMA: the rows of a sequence's last Q tile past its end, zeroed (smem_layout.cuh).
    if (kTma && params.cu_seqlens_q != nullptr) {
      zero_stage_tail<TileQ, kBlockM, kHeadDimPad, kThreads>(sQ, sdO, w.seq.seqlen_q - m0, tid);
    }

    if constexpr (kDpInS || kPSmem) {
      // The register diets (common/tile_shapes.h; kSplit 1: the whole Q tile is one part). Three
      // warpgroups leave 168 registers per thread; dK and dV take 96 at d96, S^T and dP^T 32 each,
      // P^T and dS^T 16 each as A operands: ~190 with the addresses if all were live at once.
      // Alg. 2 line 11 (transposed): S^T = K_j Q_i^T; line 14, dP^T = V_j dO_i^T, now unless it
      // goes into S^T's registers (DpInS), which it can once P^T is out of them (below).
      float acc_s[kNBlkP][4];
      [[maybe_unused]] float acc_dp_own[kNBlkP][4];
      auto& acc_dp = kDpInS ? acc_s : acc_dp_own;
      wgmma_fence();
      issue_kv_q_product<Element, kHeadDim, T>(acc_s, sK, sQ, wg, 0);
      if constexpr (!kDpInS) issue_kv_q_product<Element, kHeadDim, T>(acc_dp, sV, sdO, wg, 0);
      stages.refill(it + 1 - stages.kStages, w.n_iter, tid, load_q_tile);  // as below: under the products

      const bool needs_mask = w.template needs_mask<kLocal>(it);
      const int key0 = w.n0 + 64 * wg + 16 * warp_wg + g;
      wgmma_wait<kDpInS ? 0 : 1>();  // S^T is done (dP^T, if issued, may still run)
      // Alg. 2 line 12: P^T = exp2(S^T scale_log2 - LSE_log2) (soft-capping, ALiBi first), then its
      // Element A operands.
      [[maybe_unused]] SoftcapGrad<float[kNBlkP][4]> dt;
      recompute_part_pt<kLocal, kSoftcap, kAlibi>(acc_s, dt, w, params, params.softcap_prescale, precise, needs_mask,
                                                  sHi, sLo, it, m0, 0, wg, warp_wg, key0, t);
      uint32_t a_p[kPart / 16][4];
#pragma unroll
      for (int kk = 0; kk < kPart / 16; ++kk) acc_to_a_frag<kNBlkP, Element>(a_p[kk], acc_s, kk);
      if constexpr (kPSmem) {
        // P^T into this warpgroup's tile. The tile's last reader, the previous iteration's dV
        // product, completed at that iteration's wgmma_wait<0> (every warp waits before it gets
        // here), so the overwrite is safe.
        store_pt_tile(a_p, p_frag_addr);
      }
      if constexpr (kDpInS) {  // Alg. 2 line 14 into S^T's registers: P^T is out of them
        wgmma_fence();
        issue_kv_q_product<Element, kHeadDim, T>(acc_dp, sV, sdO, wg, 0);
      }
      // Alg. 2 line 13: dV_j += P^T dO_i.
      if constexpr (kPSmem) {
        issue_dv_from_pt_tile<Element, T, kPart / 16>(acc_dv, sP, sdO, kPtStoredBarrier + wg);
      } else {
        issue_rs_product<Element, T>(acc_dv, a_p, sdO, 0);
      }

      // Alg. 2 line 15: dS^T = P^T o (dP^T - D) from the rounded P^T (reloaded by PSmem: the bits the
      // tile holds are a_p's), one k16 step of A operands at a time (4 registers of P^T live).
      wgmma_wait<1>();  // dP^T is done (dV may still run)
      uint32_t a_ds[kPart / 16][4];
#pragma unroll
      for (int kk = 0; kk < kPart / 16; ++kk) {
        uint32_t p[4];
        if constexpr (kPSmem) {
          ldmatrix_x4(p, p_frag_addr(kk));
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) p[i] = a_p[kk][i];
        }
        form_ds_step<Element, kPackedDs, kSoftcap>(a_ds[kk], p, acc_dp, kk, dt, sDsum, t);
      }

      // Alg. 2 line 17: dK_j += dS^T Q_i.
      issue_rs_product<Element, T>(acc_dk, a_ds, sQ, 0);
      wgmma_wait<0>();     // (so no product reads the P^T tile when the next iteration writes it)
      stages.release(it);  // this thread is done with the stage
      continue;
    }

    // Alg. 2 lines 11 and 14 (transposed) for every part of the Q tile, all issued up front.
    float acc_s[kSplit][kNBlkP][4], acc_dp[kSplit][kNBlkP][4];
    issue_s_dp_parts<Element, kHeadDim, T>(acc_s, acc_dp, sK, sV, sQ, sdO, wg);
    // Iteration it + 1 into the stage an earlier iteration released (kTma: the loader's wait and
    // copies run under the products just issued).
    stages.refill(it + 1 - stages.kStages, w.n_iter, tid, load_q_tile);

    const bool needs_mask = w.template needs_mask<kLocal>(it);
    const int key0 = w.n0 + 64 * wg + 16 * warp_wg + g;
    const float softcap_prescale = kSoftcap ? params.softcap_prescale : 0.f;
    uint32_t a_p[kSplit][kPart / 16][4], a_ds[kSplit][kPart / 16][4];
#pragma unroll
    for (int h = 0; h < kSplit; ++h) {
      // wgmma groups complete in order and 2 * kSplit - 1 are younger than S^T of part h (the
      // other products of the parts, and dV / dK of the earlier parts): S^T_h is done.
      wgmma_wait<2 * kSplit - 1>();
      const int q0 = h * kPart;  // first tile row of part h
      // Alg. 2 line 12: P^T = exp2(S^T scale_log2 - LSE_log2) (fp32; masked -> 0), soft-capping
      // (1 - t^2 kept in dt for dS^T) and ALiBi first.
      [[maybe_unused]] SoftcapGrad<float[kNBlkP][4]> dt;
      recompute_part_pt<kLocal, kSoftcap, kAlibi>(acc_s[h], dt, w, params, softcap_prescale, precise, needs_mask, sHi,
                                                  sLo, it, m0, q0, wg, warp_wg, key0, t);
      if constexpr (kDropout) {
        // Dropout: dP^T_h first (no dV product in flight yet: 2 kSplit - 2 younger groups), then
        // dS^T and Z o P^T in one pass over the mask; dV and dK then as below.
        wgmma_wait<2 * kSplit - 2>();
        const uint32_t bh = DropoutRng::head_word(w.seq.bidb, params.h, w.head(it));
        dropout_part<Element>(a_p[h], a_ds[h], acc_s[h], acc_dp[h], dropout, params, bh, key0, m0 + q0 + 2 * t, sDsum,
                              q0, t);
        issue_rs_product<Element, T>(acc_dv, a_p[h], sdO, q0 / 16);
        issue_rs_product<Element, T>(acc_dk, a_ds[h], sQ, q0 / 16);
        continue;
      }
#pragma unroll
      for (int kk = 0; kk < kPart / 16; ++kk) acc_to_a_frag<kNBlkP, Element>(a_p[h][kk], acc_s[h], kk);

      // Alg. 2 line 13: dV_j += P^T dO_part.
      issue_rs_product<Element, T>(acc_dv, a_p[h], sdO, q0 / 16);

      // Alg. 2 line 15: dS^T = P^T o (dP^T - D).
      wgmma_wait<2 * kSplit - 1>();  // dP^T_h is done
      form_ds_part<Element, kPackedDs, kPRounded, kSoftcap>(a_ds[h], acc_dp[h], a_p[h], acc_s[h], dt, sDsum, q0, t);

      // Alg. 2 line 17: dK_j += dS^T Q_part.
      issue_rs_product<Element, T>(acc_dk, a_ds[h], sQ, q0 / 16);
    }
    wgmma_wait<0>();
    stages.release(it);  // this thread is done with the stage
  }

  store_dk_dv<Element, T, kDropout>(w, params, smem, acc_dk, acc_dv, wg, tid_wg, tid);  // Alg. 2 line 19
#endif
}

}  // namespace flash::sm90

// The sm90 dK/dV launch: the roles kernel (flash_bwd_dkv_roles_kernel.cuh) for a Roles<> row, the
// rows kernel above for other rows; q / dout by TMA for calls whose tensors TMA can describe,
// else by cp.async (smem_layout.cuh: FLASH_SM90_BWD_LAUNCH).
FLASH_SM90_BWD_LAUNCH(Dkv, dkv, "dK/dV", q, dout, seqlen_q, total_q, h, kBlockM)
