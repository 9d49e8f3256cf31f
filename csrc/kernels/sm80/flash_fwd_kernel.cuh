// FlashAttention-2 forward kernel (Dao 2023, "FlashAttention-2", Algorithm 1) for every SM >= 8.0:
// mma.sync.m16n8k16 tensor cores, ldmatrix operand loads, cp.async K/V streaming.
//
// One CTA = one (query tile of kBlockM rows, batch, head). Warp w owns kBlockM/kNWarps query
// rows (kMAtoms m16 atoms) and all head-dim columns of the output, so the online softmax of a
// row never leaves its quad of lanes and P goes from the S accumulators straight into the A
// operand of P·V (no shared-memory round trip).
//
// Shared memory: Q [kBlockM][kHeadDim+8], K [kBlockN][kHeadDim+8], V [kBlockN][kHeadDim+8];
// the +8 element (16 B) row padding puts the 8 rows of every ldmatrix 8x8 matrix on 8 distinct
// 4-bank groups (row pitch = 4 mod 32 words, or 20 mod 32 for d 32/96): conflict-free.
//
// Pipeline (FA2 scheme, cp.async groups always drained with wait_group 0):
//   prologue      : issue Q, K_last                                   [1 group]
//   per K tile j  : wait + barrier  (K_j landed, every warp done with V_{j+1})
//                   issue V_j                                         [1 group]
//                   S = Q K_j^T            (overlaps V_j's load)
//                   wait + barrier  (V_j landed, every warp done with K_j)
//                   issue K_{j-1}                                     [1 group, if j > 0]
//                   softmax, O += P V_j    (overlaps K_{j-1}'s load)
// K tiles run from the last to the first, so the tiles that need a mask (crossing the causal
// diagonal or the seqlen_k edge) come first; the rest skip the mask code (a CTA-uniform branch:
// one loop body keeps the register footprint spill-free, see tile_config.h).
#pragma once

#include "kernels/sm80/kernel_common.cuh"  // everything an sm80 kernel uses

namespace flash::sm80 {

// Config defaults to the production row of tile_config.h; the tuning harness
// (benchmarks/tune_kernels.cu) instantiates other TileConfigs to compare them in one binary.
template <typename Element_, int kHeadDim_, typename Config_ = FwdTile<kHeadDim_>>
struct FwdKernelTraits : RowTraits<Element_, kHeadDim_, Config_> {
  using Base = RowTraits<Element_, kHeadDim_, Config_>;
  using typename Base::Element;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDim, Base::kNWarps, Base::kThreads;

  static constexpr int kWarpRows = kBlockM / kNWarps;  // query rows per warp
  static constexpr int kMAtoms = kWarpRows / 16;       // m16 atoms per warp
  static constexpr int kNAtoms = kBlockN / 8;          // n8 atoms of S (keys)
  static constexpr int kDAtoms = kHeadDim / 8;         // n8 atoms of O (head dim)
  static constexpr int kQKSteps = kHeadDim / 16;       // k16 steps of Q K^T
  static constexpr int kPVSteps = kBlockN / 16;        // k16 steps of P V

  static constexpr int kSmemStride = kHeadDim + 8;  // elements per padded smem row
  static constexpr int kSmemQ = kBlockM * kSmemStride;
  static constexpr int kSmemKV = kBlockN * kSmemStride;
  static constexpr int kSmemBytes = (kSmemQ + 2 * kSmemKV) * int(sizeof(Element));
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks per row

  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "head dim: multiple of 16, <= 256");
  static_assert(kWarpRows % 16 == 0 && kMAtoms >= 1, "each warp owns whole m16 atoms");
  static_assert(kBlockN % 16 == 0, "BLOCK_N: multiple of 16");
  static_assert((kBlockM * kChunksPerRow) % kThreads == 0, "Q tile: whole chunks per thread");
  static_assert((kBlockN * kChunksPerRow) % kThreads == 0, "K/V tile: whole chunks per thread");
};

// kLocal: the call has a sliding window's left bound (params.window_left >= 0; launch_fwd picks):
// the key loop starts at the window's first block and the left edge's tiles are masked too. The
// kernel without it is the causal mask's code alone (its registers: 255 in the sm_90 row).
// kSoftcap: logit soft-capping (params.softcap > 0; primitives/softmax.cuh: softcap_scores).
// kDropout: attention dropout (params.dropout_p > 0; flash.h): after the softmax of a tile (l sums P
// itself), P's dropped elements are zeroed before O += P V (FlashAttention, Dao et al. 2022,
// Alg. 2 line 11: Z o P; the mask from primitives/philox.cuh), O scaled by 1 / (1 - p) at the end.
// kAlibi: ALiBi (params.alibi_slopes_ptr; flash.h): the bias added to every S tile before the mask
// (common/mask.cuh: add_alibi).
template <typename Traits, bool kLocal = false, bool kSoftcap = false, bool kDropout = false, bool kAlibi = false>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks)
    flash_fwd_kernel(const Flash_fwd_params params) {
  using Element = typename Traits::Element;
  using Tile = SmemTile<Traits::kHeadDim>;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kMAtoms = Traits::kMAtoms, kNAtoms = Traits::kNAtoms, kDAtoms = Traits::kDAtoms;
  constexpr int kStride = Traits::kSmemStride, kThreads = Traits::kThreads;
  constexpr int kStrideBytes = kStride * int(sizeof(Element));

  extern __shared__ __align__(16) unsigned char smem_raw[];
  Element* sQ = reinterpret_cast<Element*>(smem_raw);
  Element* sK = sQ + Traits::kSmemQ;
  Element* sV = sK + Traits::kSmemKV;

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int warp_row0 = warp * Traits::kWarpRows;  // warp's first row inside the Q tile

  // This CTA's Q tile, its sequence view, mask and key-block range (kernels/common/work.cuh):
  // the heaviest causal tiles start first; 64-bit offsets throughout.
  const QTileWork<kBlockM, kBlockN, /*kTightVarlen=*/false> w(params);  // (work.cuh: its registers)
  if (w.past_end()) return;  // varlen: a Q tile past its sequence's end (grid sized by max_seqlen_q)
  const int d = params.d;
  const Element* gQ = w.seq.template q_row<const Element>(params.q, w.bidh, w.m0);
  const Element* gK = w.seq.template k_row<const Element>(params.k, w.bidhk, 0);
  const Element* gV = w.seq.template k_row<const Element>(params.v, w.bidhk, 0);
  const int seqlen_k = w.seq.seqlen_k;
  // Key blocks [n_block_min, n_block_max); empty: no row sees a key (causal with seqlen_q >
  // seqlen_k, a window past the keys).
  const int n_block_min = kLocal ? w.n_block_min() : 0, n_block_max = w.n_block_max;

  float acc_o[kMAtoms][kDAtoms][4];  // FA2 Alg. 1 line 5: O = 0
#pragma unroll
  for (int mi = 0; mi < kMAtoms; ++mi)
#pragma unroll
    for (int di = 0; di < kDAtoms; ++di)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mi][di][e] = 0.f;
  OnlineSoftmax<kMAtoms> softmax;  // m = -inf, l = 0
  const float scale_log2 = params.scale_softmax_log2;
  const float softcap_prescale = kSoftcap ? params.softcap_prescale : 0.f;
  // The dropout mask's key and head (the sequence's own positions: rows from m0, keys from 0).
  const DropoutRng dropout = DropoutRng::of<kDropout>(params);
  const uint32_t dropout_bh = DropoutRng::head_word(w.seq.bidb, params.h, w.bidh);
  const float alibi_slope_u = kAlibi ? alibi_slope(params, w.seq.bidb, w.bidh) : 0.f;  // ALiBi's, in score units

  if (n_block_max > n_block_min) {
    // ---- Prologue: Q tile (loaded once, FA2 Alg. 1 line 4) and the first K tile, one group.
    copy_tile_async<Tile, kBlockM, kHeadDim, kThreads>(smem_u32addr(sQ), gQ, params.q.row_stride, w.rows_q, d, tid);
    {
      const int n = n_block_max - 1;
      copy_tile_async<Tile, kBlockN, kHeadDim, kThreads>(smem_u32addr(sK), gK + int64_t(n) * kBlockN * params.k.row_stride,
                                                         params.k.row_stride, seqlen_k - n * kBlockN, d, tid);
    }
    cp_async_commit();

    // Per-lane ldmatrix addresses (primitives/ldmatrix.cuh recipes).
    // Q, A operand of a 16x16 block: row = lane%16, col = (lane/16)*8.
    const uint32_t q_addr =
        smem_u32addr(sQ + (warp_row0 + lane % 16) * kStride + (lane / 16) * 8);
    // K as the [n][k] B operand, two n8 blocks: n = (lane/16)*8 + lane%8, k = ((lane/8)%2)*8.
    const uint32_t k_addr =
        smem_u32addr(sK + ((lane / 16) * 8 + lane % 8) * kStride + ((lane / 8) % 2) * 8);
    // V as the [k][n] B operand (.trans), two n8 blocks: k = lane%16, n = (lane/16)*8.
    const uint32_t v_addr = smem_u32addr(sV + (lane % 16) * kStride + (lane / 16) * 8);

    // Q A-fragments kept in registers when the table says so (small head dims).
    uint32_t q_frag[Traits::kQInRegs ? kMAtoms : 1][Traits::kQInRegs ? Traits::kQKSteps : 1][4];
    if constexpr (Traits::kQInRegs) {
      cp_async_wait<0>();
      __syncthreads();
#pragma unroll
      for (int mi = 0; mi < kMAtoms; ++mi) {
#pragma unroll
        for (int kk = 0; kk < Traits::kQKSteps; ++kk) {
          ldmatrix_x4(q_frag[mi][kk], q_addr + mi * 16 * kStrideBytes + kk * 32);
        }
      }
    }

    // FA2 Alg. 1 lines 6-11: loop over K/V tiles, last to first (the masked tiles come first).
#pragma unroll 1
    for (int n = n_block_max - 1; n >= n_block_min; --n) {
      float s[kMAtoms][kNAtoms][4];
#pragma unroll
      for (int mi = 0; mi < kMAtoms; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNAtoms; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mi][ni][e] = 0.f;

      cp_async_wait<0>();  // K_n landed (this thread's copies) ...
      __syncthreads();     // ... everyone's; and every warp finished P V_{n+1}: V buffer free
      copy_tile_async<Tile, kBlockN, kHeadDim, kThreads>(smem_u32addr(sV), gV + int64_t(n) * kBlockN * params.v.row_stride,
                                                         params.v.row_stride, seqlen_k - n * kBlockN, d, tid);
      cp_async_commit();

      // Alg. 1 line 8: S = Q K_n^T (unscaled: the scale goes into the softmax, primitives/softmax.cuh).
#pragma unroll
      for (int kk = 0; kk < Traits::kQKSteps; ++kk) {
        uint32_t a[kMAtoms][4];
#pragma unroll
        for (int mi = 0; mi < kMAtoms; ++mi) {
          if constexpr (Traits::kQInRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[mi][e] = q_frag[mi][kk][e];
          } else {
            ldmatrix_x4(a[mi], q_addr + mi * 16 * kStrideBytes + kk * 32);
          }
        }
#pragma unroll
        for (int np = 0; np < kNAtoms / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, k_addr + np * 16 * kStrideBytes + kk * 32);
          mma_m16n16k16<Element>(s, 2 * np, a, b);
        }
      }

      // The mask (common/mask.cuh): only tiles crossing the causal diagonal, a window's left edge or
      // the seqlen_k edge run mask code; the branch is uniform over the CTA, so tiles below the diagonal pay nothing.
      // (The soft-capping twin: both after the next K tile's copy is issued, below.)
      if constexpr (!kSoftcap) {
        if constexpr (kAlibi) w.mask.template add_alibi<false>(s, w.m0 + warp_row0, n * kBlockN, alibi_slope_u);
        if (w.template block_needs_mask<kLocal>(n)) w.mask.template apply<kLocal>(s, w.m0 + warp_row0, n * kBlockN);
      }

      cp_async_wait<0>();  // V_n landed ...
      __syncthreads();     // ... everyone's; and every warp finished reading K_n: K buffer free
      if (n > n_block_min) {
        copy_tile_async<Tile, kBlockN, kHeadDim, kThreads>(
            smem_u32addr(sK), gK + int64_t(n - 1) * kBlockN * params.k.row_stride, params.k.row_stride,
            seqlen_k - (n - 1) * kBlockN, d, tid);
        cp_async_commit();
      }

      if constexpr (kSoftcap) {  // soft-capping before the mask (softmax.cuh)
        softcap_scores(s, softcap_prescale);
        if (w.template block_needs_mask<kLocal>(n)) w.mask.template apply<kLocal>(s, w.m0 + warp_row0, n * kBlockN);
      }

      // Alg. 1 lines 9-10: m, P = exp2((S - m) * scale_log2), l, O *= alpha.
      softmax.update(s, acc_o, scale_log2);

      // Dropout (kDropout): Z o P, the row sums l above being of P itself.
      if constexpr (kDropout) {
        dropout.template for_each_kept<false, kMAtoms, kNAtoms>(
            dropout_bh, w.m0 + warp_row0 + lane / 4, n * kBlockN + 2 * (lane % 4),
            [&](int mi, int ni, int e, bool kept) { s[mi][ni][e] = kept ? s[mi][ni][e] : 0.f; });
      }

      // Alg. 1 line 10: O += P V_n. The S accumulator of n8 atoms 2kk, 2kk+1 is exactly the
      // A fragment of k16 step kk: a0 = P[g][2t..], a1 = P[g+8][2t..], a2/a3 the same 8 keys on.
#pragma unroll
      for (int kk = 0; kk < Traits::kPVSteps; ++kk) {
        uint32_t a[kMAtoms][4];
#pragma unroll
        for (int mi = 0; mi < kMAtoms; ++mi) {
          a[mi][0] = pack2<Element>(s[mi][2 * kk][0], s[mi][2 * kk][1]);
          a[mi][1] = pack2<Element>(s[mi][2 * kk][2], s[mi][2 * kk][3]);
          a[mi][2] = pack2<Element>(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
          a[mi][3] = pack2<Element>(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < kDAtoms / 2; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_addr + kk * 16 * kStrideBytes + dp * 32);
          mma_m16n16k16<Element>(acc_o, 2 * dp, a, b);
        }
      }

      // Long rows (common/long_rows.cuh): O out of the accumulator every `every` key blocks.
      const int done = n_block_max - n, every = long_rows_every(params, n_block_max - n_block_min, kBlockN);
      if (every > 0 && done % every == 0 && n > n_block_min) {
        LongRows(params, w.seq, w.bidh, w.m0 + warp_row0 + lane / 4, lane)
            .flush(acc_o, softmax.row_max, scale_log2, done == every);
      }
    }
  }

  // ---- Epilogue (Alg. 1 lines 12-13): O = acc_o / l, LSE = m + log2(l) (and its two parts).
  // A tile whose rows see no key (an empty block range) gets O = 0, LSE = +inf.
  {
    float lse[2 * kMAtoms], row_max[2 * kMAtoms], row_log2sum[2 * kMAtoms];
    const int every = long_rows_every(params, n_block_max - n_block_min, kBlockN);
    if (every > 0 && n_block_max - n_block_min > every) {  // some flush ran: its copy back into O
      LongRows(params, w.seq, w.bidh, w.m0 + warp_row0 + lane / 4, lane).merge(acc_o, softmax.row_max, scale_log2);
    }
    softmax.finalize(acc_o, scale_log2, head_sink(params.sinks_ptr, w.bidh), lse, row_max, row_log2sum);
    if (lane % 4 == 0) {
      const int64_t stat0 = w.seq.stat_index(params, w.bidh, w.m0);
#pragma unroll
      for (int r = 0; r < 2 * kMAtoms; ++r) {
        const int row = warp_row0 + (r / 2) * 16 + lane / 4 + (r % 2) * 8;
        if (row < w.rows_q) {
          params.softmax_lse_ptr[stat0 + row] = lse[r];
          if (params.row_max_ptr != nullptr) {
            params.row_max_ptr[stat0 + row] = row_max[r];
            params.row_log2sum_ptr[stat0 + row] = row_log2sum[r];
          }
        }
      }
    }
  }

  cp_async_wait<0>();
  __syncthreads();  // every warp is done reading Q/K/V smem: reuse sQ to stage O
#pragma unroll
  for (int mi = 0; mi < kMAtoms; ++mi) {
    store_acc_to_smem<kDAtoms, kStride>(sQ, acc_o[mi], warp_row0 + mi * 16, 0, kDropout ? params.dropout_rp : 1.f, lane);
  }
  __syncthreads();
  w.template store_q_tile<Element, Tile, kHeadDim, kThreads>(params, params.o, sQ, tid);
}

}  // namespace flash::sm80
