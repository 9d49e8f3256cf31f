// FlashAttention forward on Hopper (sm_90a): FlashAttention-2's algorithm (Dao 2023, Alg. 1) with
// FlashAttention-3's machinery (Shah et al. 2024; ../shared/HOPPER.md §1): TMA tile loads completing
// on mbarriers, warp specialization, and warpgroup MMA (wgmma) with P kept in registers.
//
// Persistent grid (FA3, HOPPER.md §1.7): at most one CTA per SM, each looping over the Q tiles
// (kBlockM rows of one batch, head) that common/tile_scheduler.cuh deals it (causal tiles in
// (heavy, light) pairs), in QTileWork's order (common/work.cuh: heavy causal tiles first, the
// tiles of one (batch, head) together for L2). Barrier setup and register reallocation happen once
// per CTA, and the mbarrier rings keep running across tiles, so the next tile's loads overlap this
// tile's last steps and epilogue. Producer and consumers walk the same schedule (a pure function
// of blockIdx.x and the call), so no tile index passes through shared memory (but a varlen tight
// grid's, which warp 0 finds once per CTA: common/work.cuh, varlen_dense_index), except in the
// varlen calls' dynamic walk (tile_scheduler.cuh: dynamic), where the producer warp claims each
// tile from the call's counter and hands its index to the consumers through one shared slot and a
// pair of named barriers (below: tile hand-over); -1 there ends their walk.
// Warpgroups (128 threads each):
//   WG 0 (producer, setmaxnreg down): one thread issues the TMA loads of every tile: K_n and V_n
//        for n = n_block_max - 1 down to n_block_min (0 but for a sliding window's left edge) into
//        kStages-deep rings, and Q (after the first K/V
//        block; with one Q buffer after the first K, before the first V) into a kQStages-deep ring
//        (2 where it fits: d64, d96, d128; else 1); full / empty mbarriers per stage. Its other
//        threads leave at once.
//   WG 1 + c (consumer c, setmaxnreg up): query rows [64 c, 64 c + 64) of the tile. Step i:
//        S_i = Q K^T               wgmma SS (Q and K K-major in shared memory)      Alg. 1 line 8
//        O += P_{i-1} V_{i-1}      wgmma RS (P in registers as 16-bit A fragments; V N-major), issued
//                                  right behind S_i (intra-warpgroup overlap, FA3 §3.2)
//        wait S_i, release K; mask (diagonal / window / seqlen_k edge tiles only); online softmax of S_i
//        (primitives/softmax.cuh: the sm80 kernel's numerics, the same code) while O += P V runs
//                                                                                    Alg. 1 lines 9-10
//        wait O += P V, release V; O *= alpha; P_i = S_i as A fragments (d128: row by row
//        inside the softmax, which goes row by row there, into the other of two P register buffers
//        while O += P_{i-1} V still reads the first: FwdKernelTraits::kSoftmaxOrder, kDoubleBufferP).
//        With 2-3 consumer warpgroups the warpgroups take turns issuing their GEMMs (named
//        barriers, WarpgroupTurns), so one's softmax runs under another's products.
//        d64 / d96 / d192 / d256, d128's 144-key row and the short causal rows
//        (FwdKernelTraits::kWarpgroupKeyRanges): a
//        warpgroup runs only the steps of the key blocks its own rows see (n_wg of the tile's
//        steps: the causal diagonal, rows past seqlen_q, a window's left edge); for the tile's
//        other steps (first n_block_max - n_top, last n_lo - n_block_min) it passes its turn and
//        releases the stage.
//   Epilogue: O / l staged through the warpgroup's own rows of the tile's Q buffer (two Q buffers:
//   d64, d96, d128) or of the V ring (one Q buffer: d192, d256; FwdKernelTraits::kStageOInV), LSE
//   and the two softmax_stats planes written by the row owners, as the sm80 kernel does. One thread
//   of the warpgroup stores its 64 rows by TMA (FA3's epilogue; HOPPER.md §1.8) and waits until
//   the store has read them; the other warps go on to the next tile. Varlen, the warpgroup whose
//   rows hold the sequence's end: 16-byte stores of its rows inside the sequence. Every warp
//   then releases the staging buffer (warp 0 after that wait).
//
// Barrier protocol across tiles (the one to check when a run hangs; mbarrier_wait traps after
// ~8 s instead): every ring position is a PipelineState (primitives/barrier.cuh) that producer and
// consumers advance in the same order, never reset between tiles. A tile past its sequence's end
// (varlen: the scheduler walks tiles of max_seqlen_q rows) is skipped by both before it touches
// any barrier (QTileWork::past_end, a pure function of the tile): no ring position, no turn.
//   Q ring (kQStages): one phase per tile, tiles without keys included. Producer, per tile: K (and
//     V, below) of its first key block, wait q_empty[s] (parity phase ^ 1), then arrive.expect_tx +
//     TMA on q_full[s], or a plain arrive when the tile has no key block. Consumers: wait q_full[s]
//     (phase), ..., O staged in that Q buffer, fence.proxy.async, epilogue barrier; then q_empty[s]
//     gets kConsumerWGs * 4 arrivals (its count), one per consumer warp after its reads of the
//     buffer (a warpgroup's storing thread after cp.async.bulk.wait_group.read).
//     kStageOInV: one arrival per consumer warp before its last P V (its last S is complete), or,
//     in a warpgroup without steps, once its skipped steps' stages have landed (right after the
//     q_full wait in a tile without keys); O goes to the V ring instead. (A window's tail skips
//     come after that arrival: they read no Q.)
//   Tile hand-over (the dynamic walk only; FA3's tile-count barriers): named barriers kTileFull /
//     kTileEmpty of the producer warp and every consumer thread. The consumers arrive on kTileEmpty
//     once before their first tile; per tile the producer warp syncs kTileEmpty (the consumers
//     have read the last index), lane 0 writes the next index (-1 after the last tile) to the
//     slot, the warp arrives on kTileFull, and lane 0 issues the tile's loads; the consumers sync
//     kTileFull, read the slot, and arrive on kTileEmpty unless it read -1 (then they leave).
//   o_free (kStageOInV): one phase per tile, tiles without keys included. Producer, per tile: wait
//     o_free (parity phase ^ 1: the previous tile's O store has read the V ring) after its Q and
//     before V of the first key block, or before the q_full arrival of a tile without keys.
//     Consumers: wait for the tile's last V stage's empty barrier (every warp done with the tile's
//     V; those V loads came after o_free), or in a tile without keys for q_full (after o_free),
//     then O staged from the ring's start and stored as above; each warp's arrival goes to
//     o_free.
//   K and V rings (kStages): one position per key block of a tile with steps, kept by
//     producer and consumers alike (the same tiles in the same order); the producer's K/V
//     loads for tile t+1 wait only on k_empty / v_empty (its first V on o_free too: kStageOInV),
//     so they run during tile t. Arrival counts: full 1 (+ tx bytes), empty kConsumerWGs * 4 (one
//     per warp, per stage use). A warpgroup skipping a key block arrives on its empty barriers
//     too, after waiting for the full ones (an earlier arrival would count towards the stage's
//     previous use).
//   Ping-pong turns (named barriers 4..3 + kConsumerWGs): n_steps + 1 turns per warpgroup per
//     tile (none without keys; a skipped step's turn is passed on empty), continuing across tiles;
//     primed once, drained once at exit (WarpgroupTurns).
//   Epilogue named barriers 1 + c (128 threads, warpgroup c only).
//
// Accumulator layout (primitives/wgmma.cuh): thread 32 w + 4 g + t of a consumer warpgroup holds
// query rows 16 w + g and 16 w + g + 8 of its 64, columns 8 j + 2 t, +1 of every n8 block j: per
// warp exactly an mma.sync m16n8 C tile, so s[1][kBlockN / 8][4] is the sm80 kernel's fragment with
// kMAtoms = 1, and AttnMask::apply / OnlineSoftmax run on it unchanged.
//
// Varlen (flash.h): the tensor maps span the packed tensors (one batch of total_q / total_k rows),
// tiles load at the sequence's row offset (SeqInfo::q_tma_row / k_tma_row), so a tile's rows past
// the sequence's end are the next sequence's: keys there are masked in S (the seqlen_k edge block
// always takes the mask) and their V rows are zeroed before P V (0 * NaN would be NaN); query rows
// there are never stored, and those that share a warp with the sequence's last rows are zeroed
// first (zero_rows_past_end): both as a dense call's out-of-bounds fill leaves them.
//
// Shared memory (1024-byte aligned): kQStages x sQ (kBlockM x d), kStages x sK, kStages x sV
// (kBlockN x d), every tile a SwizzledTile (sm90/smem_layout.cuh) = the TMA 128-byte-swizzle box
// layout, then the mbarriers.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "flash.h"
#include "kernels/common/long_rows.cuh"
#include "kernels/common/tile_scheduler.cuh"
#include "kernels/common/work.cuh"
#include "kernels/sm90/smem_layout.cuh"
#include "kernels/sm90/tile_config.h"
#include "primitives/barrier.cuh"
#include "primitives/cp_async.cuh"
#include "primitives/math.cuh"
#include "primitives/mma.cuh"
#include "primitives/softmax.cuh"
#include "primitives/tma.cuh"
#include "primitives/wgmma.cuh"

#ifndef FLASH_ATTN_EXT_SM90_FWD_PINGPONG
#define FLASH_ATTN_EXT_SM90_FWD_PINGPONG 1
#endif

namespace flash {
namespace sm90 {

// The four tensor maps of a forward call (primitives/tma.cuh), one __grid_constant__ parameter.
// o: boxes of 64 rows (one consumer warpgroup's rows of a tile; varlen: only those inside the
// sequence, flash_fwd_kernel's epilogue).
struct FwdTmaMaps {
  CUtensorMap q, k, v, o;
};

// Tile: an FwdTileShape row (tile_config.h).
template <typename Element_, int kHeadDim_, typename Tile_ = FwdTile<kHeadDim_>>
struct FwdKernelTraits {
  using Element = Element_;
  using Tile = Tile_;
  static constexpr int kHeadDim = kHeadDim_;
  // Shared tiles, TMA boxes and O's staging are whole 64-column swizzle blocks: d96 runs 128
  // columns there (the boxes past d read zeros: the tensor maps' extent is the user's d), S only
  // its 6 k16 steps, O += P V and O's accumulators kHeadDimMma = 96 columns.
  static constexpr int kHeadDimPad = (kHeadDim + 63) / 64 * 64;
  static constexpr int kHeadDimMma = head_dim_mma(kHeadDim);  // O's columns (P V at N = 96 for d96)
  static constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN;
  static constexpr int kConsumerWGs = kBlockM / 64;
  static constexpr int kThreads = (kConsumerWGs + 1) * 128;
  // Registers per thread after setmaxnreg (HOPPER.md §1.1; 128 p + 128 c kConsumerWGs <= 65,536,
  // each a multiple of 8): FA3's splits, 24 / 240 for two consumer warpgroups and 32 / 160 for three
  // (the producer warp issues TMA and walks the tile scheduler: 24-32 registers suffice; a third
  // consumer leaves 160 each); one consumer (no row uses it) takes the rest of 56 / 256.
  static constexpr int kProducerRegs = kConsumerWGs == 1 ? 56 : kConsumerWGs == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumerWGs == 1 ? 256 : kConsumerWGs == 2 ? 240 : 160;
  // Inter-warpgroup ping-pong (HOPPER.md §1.5): consumer warpgroups issue their GEMMs in turn, so
  // one's softmax runs under another's products. FA3 uses it up to head dim 128; at d192 / d256
  // it measured +0.6-1 % (tune harness, two runs of 8 rounds; causal N = 1k +2-3 %), the tiles'
  // first softmax no longer running in both warpgroups at once.
  // -DFLASH_ATTN_EXT_SM90_FWD_PINGPONG=0 turns it off (A/B measurements, debugging).
  static constexpr bool kPingPong = FLASH_ATTN_EXT_SM90_FWD_PINGPONG && kConsumerWGs >= 2;
  // The softmax's row order (primitives/softmax.cuh: RowOrder): pipelined where two ping-pong
  // warpgroups leave the softmax's latency on the loop's critical path (d128); d64's and d96's three
  // warpgroups are bound by the SFU's throughput instead, which the pipelined order's extra votes
  // and branches only add to, and d192 / d256 by their products (the pipelined order and the P
  // double buffer measured 0.98-1.02 there).
  static constexpr RowOrder kSoftmaxOrder =
      kPingPong && kConsumerWGs == 2 && kHeadDim <= 128 ? RowOrder::kPipelined : RowOrder::kTogether;
  // P in two register buffers (the loop runs two key blocks per trip): P_i's conversion to A
  // fragments rides in the pipelined softmax, filling the next row's SFU gaps, while O += P_{i-1} V
  // still reads the other buffer. Tune harness (H200, 6 rounds, on top of the pipelined order):
  // d96 (then on 128 x 128 tiles) / d128 +1.7 / +1.9 % more at N >= 4k; with three warpgroups (d64)
  // -4 % on short causal loops.
  // Above 144 keys two P buffers no longer fit beside S and O (d128, 176 keys: 2 x 44 + 88 + 64
  // registers; ptxas serializes the wgmmas, C7512), so such a row keeps one.
  static constexpr bool kDoubleBufferP = kSoftmaxOrder == RowOrder::kPipelined && kBlockN <= 144;
  // Each consumer warpgroup visits only the key blocks its own 64 rows see (the kernel's n_wg):
  // where the tile's warpgroups cross the causal diagonal in different key blocks at every tile
  // (d64 / d96: 192 rows over 128 / 96-key blocks; d192 / d256: 112 / 80 keys), and where the
  // sequence's last tile leaves a warpgroup without rows (d64, d96). Tune harness (H200, 10 rounds, with the
  // scheduler's light units last): causal N = 1k / 2k / 4k d64 +14 / +6 / +5 %, d192 +9 / +4 /
  // +3 %, d256 +9 / +6 / +3 %; d64 non-causal 1k +4 %; N >= 8k within 1.5 %. At d128
  // (128 x 128 tiles) the ranges differ only in such a last tile of <= 64 rows or under a causal
  // offset that is not a multiple of 64; there the per-tile code cost 1-2 % at N <= 2k, so both
  // warpgroups take the tile's range.
  static constexpr bool kWarpgroupKeyRanges = kConsumerWGs > 1 && kConsumerWGs * 64 != kBlockN;

  using TileQ = SwizzledTile<kBlockM, kHeadDimPad>;
  using TileKV = SwizzledTile<kBlockN, kHeadDimPad>;
  // Q ring depth: two Q buffers wherever they fit beside a 2-stage K/V ring (d64, d96, d128 with
  // 128-key tiles), so the next tile's Q loads while this tile runs; else 1 (the next Q waits for
  // this tile's last S products: kStageOInV below). K/V ring depth: as many stages as fit next to
  // them (2..4; one CTA per SM): d64 4, d96/d128 2, d192/d256 2 (FA3: 2 everywhere; TK: 4 at d64).
  // One Q buffer and three K/V stages at d96 / d128 (O then staged in the V ring) measured 1-4 %
  // slower. Barriers (8 bytes each, at most 2 Q + 4 K/V stages + o_free), the varlen tile slot (8
  // bytes), the dynamic walk's buckets (kLptBytes) and 1024 bytes of alignment slack come first.
  static constexpr int kLptBytes = 4 * kLptBuckets + kVarlenTightMaxBatch;
  static constexpr int kBarBytes = 8 * (2 * 2 + 4 * 4 + 1 + 1) + kLptBytes + 1024;
  static constexpr int kQStages = 2 * TileQ::kBytes + 4 * TileKV::kBytes + kBarBytes <= kMaxSmem ? 2 : 1;
  static constexpr int kStagesFit = (kMaxSmem - kQStages * TileQ::kBytes - kBarBytes) / (2 * TileKV::kBytes);
  static constexpr int kStages = kStagesFit < 4 ? kStagesFit : 4;
  static constexpr int kOffK = kQStages * TileQ::kBytes;
  static constexpr int kOffV = kOffK + kStages * TileKV::kBytes;
  static constexpr int kOffBar = kOffV + kStages * TileKV::kBytes;
  // Where the epilogue stages O for its TMA store. Two Q buffers (d64, d96, d128): in the
  // warpgroup's own rows of the tile's Q buffer, released once the store has read them (the next
  // tile's Q is already in the other buffer). One Q buffer (d192, d256): in the V ring, as FA3
  // lays out its shared memory (smem_o over smem_v), so the Q buffer is released after each
  // warpgroup's last S product and the next tile's Q loads under the tile's last P V and its
  // epilogue instead of after it; the producer loads the next tile's first V once the store has
  // read the staged O (barrier o_free).
  static constexpr bool kStageOInV = kQStages == 1;
  // Barriers: per Q stage full, empty; then per K/V stage K full, K empty, V full, V empty; o_free.
  static constexpr int kNumBars = 2 * kQStages + 4 * kStages + 1;
  // After them: a varlen tight grid's tile (int64), found by warp 0 for the whole CTA, or the
  // dynamic walk's next tile (int32; tile_scheduler.cuh: dynamic), handed from producer to consumers.
  static constexpr int kOffTileSlot = kOffBar + 8 * kNumBars;
  // Then the dynamic walk's bucket tile counts and per-sequence buckets (a tight grid's, longest
  // sequences first: common/work.cuh, varlen_lpt_prepare), the producer warp's only.
  static constexpr int kOffLptBuckets = kOffTileSlot + 8;
  static constexpr int kSmemBytes = kOffLptBuckets + kLptBytes + 1024;  // + alignment slack

  static_assert(Tile::kNWarps == 4 * (kConsumerWGs + 1), "tile row: 4 producer warps + 4 per 64 query rows");
  static_assert(kBlockM % 64 == 0 && kConsumerWGs >= 1 && kConsumerWGs <= 3, "1-3 consumer warpgroups of 64 rows");
  static_assert(kBlockN % 16 == 0, "S is one m64nNk16 wgmma (N = kBlockN: a width of primitives/gen_wgmma.py), "
                                   "P V whole k16 steps");
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "head dim: whole k16 steps, <= 256");
  static_assert(kBlockM <= 256 && kBlockN <= 256, "TMA box extents <= 256 rows");
  static_assert(kStages >= 2, "Q and two K/V stages must fit in shared memory");
  static_assert(!kStageOInV || TileQ::kBytes <= kStages * TileKV::kBytes, "O (a Q tile) fits in the V ring");
};

// O += P V for one K/V tile: kBlockN / 16 k16 steps, N = O's columns (head_dim_mma) as wgmma widths
// of wgmma.cuh (64, 96 or 128; d192 = 128 + 64 and d256 = 128 + 128 columns, each a run of 64-column
// swizzle blocks of sV, hence its own descriptor base).
template <typename Element, int kHeadDim, typename TileKV, int kKSteps>
__device__ __forceinline__ void gemm_pv(float (&acc_o)[kHeadDim / 8][4], const uint32_t (&p)[kKSteps][4],
                                        uint32_t sV) {
  float* o = &acc_o[0][0];
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    if constexpr (kHeadDim <= 128) {
      Wgmma<Element, kHeadDim>::template rs<1>(reinterpret_cast<float(&)[kHeadDim / 2]>(*o), p[kk],
                                               TileKV::desc_mn_major(sV, kk), 1);
    } else {
      constexpr int kRest = kHeadDim - 128;
      Wgmma<Element, 128>::template rs<1>(reinterpret_cast<float(&)[64]>(*o), p[kk], TileKV::desc_mn_major(sV, kk),
                                          1);
      Wgmma<Element, kRest>::template rs<1>(reinterpret_cast<float(&)[kRest / 2]>(*(o + 64)), p[kk],
                                            TileKV::desc_mn_major(sV + 2 * TileKV::kColBlockBytes, kk), 1);
    }
  }
}

// S = Q K^T for one K tile: kHeadDim / 16 k16 steps, N = kBlockN; Q rows [q_row0, q_row0 + 64).
template <typename Element, typename TileQ, typename TileKV, int kHeadDim, int kNBlkN>
__device__ __forceinline__ void gemm_qk(float (&s)[kNBlkN][4], uint32_t sQ, int q_row0, uint32_t sK) {
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    Wgmma<Element, kNBlkN * 8>::template ss<0>(flat(s), TileQ::desc_k_major(sQ, q_row0, kk),
                                              TileKV::desc_k_major(sK, 0, kk), kk > 0);
  }
}

// threadIdx.x through a volatile read, where it is used: neither hoisted out of a loop nor kept live
// across one (the persistent kernel's main loop leaves no register for per-thread offsets that the
// compiler would otherwise compute once per CTA and keep, spilled, across every tile).
__device__ __forceinline__ int thread_index_opaque() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}

// Zeroes rows [first, round_up(first, 16)) (0 < first < 64; nothing otherwise) of consumer
// warpgroup c's 64 rows of the Q tile at sQ (TileQ layout, kCols columns), then makes the zeros
// visible to the warpgroup's wgmma (async proxy) and waits for its 128 threads (epilogue barrier
// 1 + c, free at this point of the tile). Rows 16 w .. 16 w + 15 of the 64 are warp w's S rows.
template <typename TileQ, int kCols>
__device__ __forceinline__ void zero_rows_past_end(uint32_t sQ, int first, int c) {
  if (first <= 0 || first % 16 == 0 || first >= 64) return;  // uniform over the warpgroup
  const int row0 = 64 * c + first;
  zero_rows<TileQ, kCols, 128>(sQ, row0, row0 + 16 - first % 16, thread_index_opaque() % 128);
  fence_proxy_async();
  named_barrier_sync(1 + c, 128);
}

// The turn-taking of the consumer warpgroups' GEMM issue (FA3's warp scheduler barriers): named
// barrier kBarrier + c is warpgroup c's turn, complete when c (bar.sync) and its
// predecessor (bar.arrive, after issuing its own GEMMs) have both arrived. Every warpgroup of a CTA
// takes the same number of turns per tile (n_steps + 1, none without keys; every warpgroup
// walks the same tiles), so the order 0, 1, .., 0, 1, .. runs on across tiles. Warpgroup 0 is
// primed once by the last one (prime, before the first tile) and takes one extra turn-start after
// the last tile (drain), which consumes the last warpgroup's final hand-over: no barrier is left
// half-arrived at exit.
// c: the calling thread's consumer warpgroup, warp-uniform (warpgroup_index, read once per CTA), so
// the barrier ids are uniform-register values computed once, not per turn.
template <int kConsumerWGs, bool kEnabled>
struct WarpgroupTurns {
  static constexpr int kBarrier = 4;  // ids 1..3: the epilogue's per-warpgroup barriers
  int own, next;  // this warpgroup's turn barrier and its successor's
  __device__ __forceinline__ explicit WarpgroupTurns(int c)
      : own(kBarrier + c), next(kBarrier + (c + 1) % kConsumerWGs) {}
  __device__ __forceinline__ void prime() const {
    if (kEnabled && own == kBarrier + kConsumerWGs - 1) named_barrier_arrive(kBarrier, 256);
  }
  __device__ __forceinline__ void begin() const {
    if (kEnabled) named_barrier_sync(own, 256);
  }
  __device__ __forceinline__ void end() const {
    if (kEnabled) named_barrier_arrive(next, 256);
  }
  // A turn with nothing to issue (a skipped key block): taken and handed on at once.
  __device__ __forceinline__ void pass() const {
    begin();
    end();
  }
  __device__ __forceinline__ void drain() const {
    if (kEnabled && own == kBarrier) named_barrier_sync(kBarrier, 256);
  }
};

// One CTA of flash_fwd_kernel: what its warpgroups share (the call's parameters, tensor maps and
// tile scheduler; the shared-memory map: Q / K / V buffers, mbarriers, the tile slot), the
// prologue's barrier setup, the producer's role and the consumers' self-contained steps:
//   init_barriers()  the mbarriers' setup (thread 0, before the CTA barrier)
//   producer()       WG 0: the tile walk (static or dynamic); produce_tile(): one tile's TMA loads
//   consumers'       next_tile() (take_tile(): the dynamic walk's hand-over); per tile key_range(),
//   steps            zero_o(), zero_rows_past_ends() (varlen; its V half zero_v_tail()),
//                    skip_step(); the main loop's
//                    first_s(), issue_s_pv(), wait_pv(), to_p(), last_pv(); the epilogue's
//                    store_lse(), o_staging(), wait_v_ring_free(), stage_o(), tma_store_o() /
//                    store_o_rows(), release_o_buffer()
// The consumers' tile walk, main loop (its step lambdas: the softmax, P's buffers, the turns) and
// epilogue stay in flash_fwd_kernel's body, which calls these and reads the shared state from
// here (cta). Every member is __forceinline__: the kernel compiles as the one function it was
// (SASS byte-identical to the kernel with these steps inline: register allocation shifts when
// larger parts, the whole main loop or epilogue, move into functions).
template <typename Traits, bool kLocal>
struct FwdCta {
  using Element = typename Traits::Element;
  using TileQ = typename Traits::TileQ;
  using TileKV = typename Traits::TileKV;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  static constexpr int kHeadDimPad = Traits::kHeadDimPad;
  static constexpr int kStages = Traits::kStages;
  static constexpr int kQStages = Traits::kQStages;
  static constexpr int kConsumerWarps = 4 * Traits::kConsumerWGs;
  using Work = QTileWork<kBlockM, kBlockN>;
  // The calling warp's first row inside the tile (mask, stats), read afresh where it is used.
  __device__ __forceinline__ static int row0() { return thread_index_opaque() / 32 * 16 - 64; }
  using Turns = WarpgroupTurns<Traits::kConsumerWGs, Traits::kPingPong>;
  // Named barrier of all consumer warpgroups for a varlen tile's V rows past its keys (ids: 1..3
  // the epilogue's, WarpgroupTurns::kBarrier.. the turns'; zero_v_tail).
  static constexpr int kConsumerThreads = 128 * Traits::kConsumerWGs;
  static constexpr int kVTailBarrier = Turns::kBarrier + Traits::kConsumerWGs;

  // The dynamic walk's next tile (tile_scheduler.cuh: dynamic; -1: the walk is over; int32: tile
  // indices are < 2^31), in s_varlen_tile's place, handed over on named barriers kTileFull /
  // kTileEmpty of the producer warp and the consumer threads (ids past the turns' and
  // kVTailBarrier, above). The slot is written and read by shared-memory
  // atomics: the barriers order them, and compute-sanitizer racecheck, which reports a plain store
  // and load ordered by these barriers as a race, sees no race between atomics.
  static constexpr int kTileFull = kVTailBarrier + 1;
  static constexpr int kTileEmpty = kTileFull + 1;
  static constexpr int kHandOverThreads = 32 + 128 * Traits::kConsumerWGs;
  static_assert(kTileEmpty < 16, "16 named barriers per CTA");

  const Flash_fwd_params& params;
  const FwdTmaMaps& tma;
  const FwdTileScheduler<kBlockM>& sched;
  unsigned char* smem;
  uint32_t smem_addr, bar0, bar_kv;
  uint32_t o_free;  // Traits::kStageOInV: the staged O was stored
  // Varlen on a tight grid (one CTA per real tile, common/work.cuh: varlen_dense_index): warp 0
  // finds this CTA's tile in the dense numbering before the roles split and publishes it through
  // the CTA barrier (the kernel's prologue); a CTA past every real tile leaves right after it.
  int64_t& s_varlen_tile;
  int* tile_slot;  // the dynamic walk's (above), in the same place

  __device__ __forceinline__ FwdCta(const Flash_fwd_params& params_, const FwdTmaMaps& tma_,
                                    const FwdTileScheduler<kBlockM>& sched_)
      : params(params_),
        tma(tma_),
        sched(sched_),
        smem(aligned_dynamic_smem()),
        smem_addr(smem_u32addr(smem)),
        bar0(smem_addr + Traits::kOffBar),
        bar_kv(bar0 + 8 * (2 * kQStages)),
        o_free(bar_kv + 8 * (4 * kStages)),
        s_varlen_tile(*reinterpret_cast<int64_t*>(smem + Traits::kOffTileSlot)),
        tile_slot(reinterpret_cast<int*>(smem + Traits::kOffTileSlot)) {}

  // The mbarriers (Traits::kNumBars) and the ring buffers (Traits' shared-memory layout).
  __device__ __forceinline__ uint32_t q_full(int s) const { return bar0 + 8 * (2 * s); }
  __device__ __forceinline__ uint32_t q_empty(int s) const { return bar0 + 8 * (2 * s + 1); }
  __device__ __forceinline__ uint32_t k_full(int s) const { return bar_kv + 8 * (4 * s); }
  __device__ __forceinline__ uint32_t k_empty(int s) const { return bar_kv + 8 * (4 * s + 1); }
  __device__ __forceinline__ uint32_t v_full(int s) const { return bar_kv + 8 * (4 * s + 2); }
  __device__ __forceinline__ uint32_t v_empty(int s) const { return bar_kv + 8 * (4 * s + 3); }
  __device__ __forceinline__ uint32_t sQ(int s) const { return smem_addr + s * TileQ::kBytes; }
  __device__ __forceinline__ uint32_t sK(int s) const { return smem_addr + Traits::kOffK + s * TileKV::kBytes; }
  __device__ __forceinline__ uint32_t sV(int s) const { return smem_addr + Traits::kOffV + s * TileKV::kBytes; }

  // Thread 0, before the CTA barrier: every ring's mbarriers with their arrival counts (the
  // barrier protocol at the top of the file).
  __device__ __forceinline__ void init_barriers() const {
#pragma unroll
    for (int s = 0; s < kQStages; ++s) {
      mbarrier_init(q_full(s), 1);                 // the producer's arrive(.expect_tx)
      mbarrier_init(q_empty(s), kConsumerWarps);  // per consumer warp, after its epilogue (see above)
    }
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(k_full(s), 1);  // the producer's arrive.expect_tx; TMA completes the bytes
      mbarrier_init(v_full(s), 1);
      mbarrier_init(k_empty(s), kConsumerWarps);  // one arrival per consumer warp
      mbarrier_init(v_empty(s), kConsumerWarps);
    }
    if (Traits::kStageOInV) mbarrier_init(o_free, kConsumerWarps);  // per consumer warp, after the store read
    mbarrier_init_fence();
  }

  // ---- Producer, one tile's loads (lane 0 of warp 0; FA2 Alg. 1 lines 4 and 7): K_n and V_n of
  // its steps, Q after the first key block. The ring positions run on across tiles (q_pipe,
  // kv_pipe, o_pipe: the producer's, advanced here). evict_first / evict_last: the L2 policies of
  // Q (read once) and K / V (read again by the head's other Q tiles).
  __device__ __forceinline__ void produce_tile(int tile, PipelineState<kQStages>& q_pipe,
                                               PipelineState<kStages>& kv_pipe, PipelineState<1>& o_pipe,
                                               const uint64_t evict_first, const uint64_t evict_last) const {
    const int2 bm = Work::decode(tile, sched.m_div, sched.h_div);
    const Work w(params, bm, sched.m_shift);
    // Varlen: no work, no ring position (the consumers skip it too; the dynamic walk never hands
    // such a tile over).
    if (w.past_end()) return;
    // Key blocks [n_block_min, n_block_max): n_steps steps (a sliding window's left bound: the
    // tile's first row's first block; else 0).
    const int n_block_max = w.n_block_max, n_steps = max(n_block_max - (kLocal ? w.n_block_min() : 0), 0);
    const int bidb = w.seq.tma_batch(params);
    // K_n or V_n of step i (n = n_block_max - 1 - i) into its buffer of the next ring stage,
    // once the consumers released it (round 0 passes at once: fresh barriers), completing on its
    // full barrier.
    auto load_tile = [&](int i, uint32_t dst, const CUtensorMap* map, uint32_t full, uint32_t empty) {
      const int n = n_block_max - 1 - i;
      mbarrier_wait(empty, kv_pipe.phase(i) ^ 1);
      mbarrier_arrive_expect_tx(full, TileKV::kBytes);
#pragma unroll
      for (int cb = 0; cb < kHeadDimPad / 64; ++cb) {
        tma_load_4d(dst + cb * TileKV::kColBlockBytes, map, full, 64 * cb, w.seq.k_tma_row(n * kBlockN), w.bidhk,
                    bidb, evict_last);
      }
    };
    auto load_k = [&](int i) { const int s = kv_pipe.stage(i); load_tile(i, sK(s), &tma.k, k_full(s), k_empty(s)); };
    auto load_v = [&](int i) { const int s = kv_pipe.stage(i); load_tile(i, sV(s), &tma.v, v_full(s), v_empty(s)); };
    // The first key block before Q: Q waits for the consumers to release the buffer (q_empty),
    // K/V need not. With O staged in the V ring (kStageOInV), V_0 comes after Q and waits for
    // the previous tile's O store to have read the ring (o_free; every tile takes one phase).
    if (n_steps > 0) load_k(0);
    if (!Traits::kStageOInV && n_steps > 0) load_v(0);
    const int qs = q_pipe.stage();
    mbarrier_wait(q_empty(qs), q_pipe.phase() ^ 1);
    if (n_steps > 0) {
      mbarrier_arrive_expect_tx(q_full(qs), TileQ::kBytes);
#pragma unroll
      for (int cb = 0; cb < kHeadDimPad / 64; ++cb) {
        tma_load_4d(sQ(qs) + cb * TileQ::kColBlockBytes, &tma.q, q_full(qs), 64 * cb, w.seq.q_tma_row(w.m0),
                    w.bidh, bidb, evict_first);
      }
    } else {
      // No key: hand the empty buffer over for O = 0. With O staged in the V ring, only once the
      // previous tile's O store has read the ring: no V load orders this tile's O writes after
      // that store, so the consumers' q_full wait must.
      if constexpr (Traits::kStageOInV) mbarrier_wait(o_free, o_pipe.phase() ^ 1);
      mbarrier_arrive(q_full(qs));
    }
    q_pipe.advance();
    if constexpr (Traits::kStageOInV) {
      if (n_steps > 0) {
        mbarrier_wait(o_free, o_pipe.phase() ^ 1);
        load_v(0);
      }
      o_pipe.advance();
    }
#pragma unroll 1
    for (int i = 1; i < n_steps; ++i) {
      load_k(i);
      load_v(i);
    }
    kv_pipe.advance(n_steps);
  }

  // ---- Producer (FA2 Alg. 1 lines 4 and 7: load Q_i, then K_j, V_j), one thread (warp 0's
  // lane 0; in the dynamic walk its warp finds the tiles). The whole of warpgroup 0 calls it, after
  // the prologue; its other warps leave at once.
  __device__ __forceinline__ void producer(const int tid) const {
    setmaxnreg_dec<Traits::kProducerRegs>();
    if (tid < 32) {
      if (tid == 0) {
        tma_prefetch_map(&tma.q);
        tma_prefetch_map(&tma.k);
        tma_prefetch_map(&tma.v);
      }
      const uint64_t evict_first = l2_policy_evict_first(), evict_last = l2_policy_evict_last();
      PipelineState<kQStages> q_pipe;
      PipelineState<kStages> kv_pipe;
      PipelineState<1> o_pipe;  // Traits::kStageOInV: one o_free phase per tile
      // One tile's loads (lane 0).
      auto produce = [&](int tile) { produce_tile(tile, q_pipe, kv_pipe, o_pipe, evict_first, evict_last); };
      if (!sched.dynamic) {
        if (tid == 0) {
          auto tiles = sched.begin();
#pragma unroll 1
          for (int64_t tile; tiles.next(sched, tile);) {
            produce(int(sched.varlen_tight ? s_varlen_tile : tile));  // tight: its one tile (the walk has one unit)
          }
        }
      } else {
        // The dynamic walk: unit blockIdx.x, then gridDim.x + the counter's next value, until the
        // units run out. A unit is a tile in QTileWork's order (one past its sequence's end is
        // neither handed over nor loaded), or a tight grid's unit, tile-major (unit = u * h + head:
        // the heads of one tile together, a GQA group's K / V shared in L2; u counts the real
        // tiles longest sequences first, so the light ones fill the walk's tail: common/work.cuh,
        // varlen_lpt_index), so the first unit past the real tiles ends the walk (every later one
        // lies past them too). The next unit
        // is claimed once this tile's loads are issued (the consumers still have the ring's
        // stages of work, so the claim and the next tile's search stay off their path); nothing
        // else stays live across a tile (the producer has 24 registers at d128).
        // A tight grid's units go longest sequences first (common/work.cuh: varlen_lpt_index): the
        // buckets' tile counts and each sequence's bucket, found once by this warp, sit in shared
        // memory after the tile slot.
        int* lpt_bucket_tiles = reinterpret_cast<int*>(smem + Traits::kOffLptBuckets);
        uint8_t* lpt_buckets = smem + Traits::kOffLptBuckets + 4 * kLptBuckets;
        if (sched.dynamic == FwdTileScheduler<kBlockM>::kDynamicTight) {
          varlen_lpt_prepare<kBlockM>(params.cu_seqlens_q, params.cu_seqlens_k, params.b, params.seqlen_q,
                                      params.seqlen_k, lpt_buckets, lpt_bucket_tiles);
        }
        // hand_over: tile t (-1: the end) to the consumers (the tile hand-over at the top).
        auto hand_over = [&](int t) {
          named_barrier_sync(kTileEmpty, kHandOverThreads);
          if (tid == 0) atomicExch(tile_slot, t);
          __syncwarp();  // converged for the aligned barrier
          named_barrier_arrive(kTileFull, kHandOverThreads);
        };
#pragma unroll 1
        for (int unit = blockIdx.x; unit < int(sched.num_units);) {
          int tile = unit;
          if (sched.dynamic == FwdTileScheduler<kBlockM>::kDynamicTight) {
            const int u = sched.h_div.div(unit), head = unit - u * sched.h_div.d;
            // The tile in the dense numbering, from its place u among the head's real tiles, longest
            // sequences first.
            const int64_t t = varlen_lpt_index<kBlockM>(params.cu_seqlens_q, params.b, params.seqlen_q, params.h,
                                                        head, u, lpt_buckets, lpt_bucket_tiles);
            if (t < 0) break;  // uniform over the warp
            tile = int(t);
          } else {
            const int2 bm = QTileWork<kBlockM, kBlockN>::decode(tile, sched.m_div, sched.h_div);
            const QTileWork<kBlockM, kBlockN> w(params, bm, sched.m_shift);  // the consumers' view
            if (w.past_end()) tile = -1;  // not handed over, nothing loaded (uniform over the warp)
          }
          if (tile >= 0) hand_over(tile);
          int claim = 0;
          if (tid == 0) {
            if (tile >= 0) produce(tile);
            claim = atomicAdd(params.tile_counter, 1);
          }
          __syncwarp();
          unit = int(gridDim.x) + __shfl_sync(0xffffffffu, claim, 0);
        }
        hand_over(-1);
        // The counter back to zero for the stream's next call (flash.h: tile_counter): the CTA that
        // counts itself done last resets it. Every claim came before its CTA's count (the fences:
        // release before the count, acquire after it), so none can follow the reset.
        if (tid == 0) {
          __threadfence();
          if (atomicAdd(params.tile_counter + 1, 1) == int(gridDim.x) - 1) {
            __threadfence();
            atomicExch(params.tile_counter, 0);
            atomicExch(params.tile_counter + 1, 0);
          }
        }
      }
    }
  }

  // ---- Consumers (flash_fwd_kernel's body runs their tile walk; every consumer thread calls
  // these, per warp or warpgroup as said). The tile walk:

  // The dynamic walk's next tile (the tile hand-over at the top): the index the producer warp left
  // in the slot, the slot then handed back (kTileEmpty); false, the slot kept, where it is -1
  // (the walk is over).
  __device__ __forceinline__ bool take_tile(int64_t& tile) const {
    named_barrier_sync(kTileFull, kHandOverThreads);
    int slot = 0;
    if (threadIdx.x % 32 == 0) slot = atomicAdd(tile_slot, 0);  // one read per warp
    tile = __shfl_sync(0xffffffffu, slot, 0);
    if (tile < 0) return false;
    named_barrier_arrive(kTileEmpty, kHandOverThreads);
    return true;
  }

  // The consumers' next tile: the dynamic walk's from the producer (take_tile), else the static
  // walk's (tiles: sched.begin()); false: the walk is over.
  template <typename Tiles>
  __device__ __forceinline__ bool next_tile(Tiles& tiles, int64_t& tile_index) const {
    if (sched.dynamic) return take_tile(tile_index);
    return tiles.next(sched, tile_index);
  }

  // ---- Per tile, before its steps:

  // Consumer warpgroup cw's own key range (Alg. 1 line 6's j, as the
  // warpgroup's rows see it) where Traits::kWarpgroupKeyRanges (else the tile's, [n_block_min,
  // n_block_max)): its 64 rows see keys of blocks [n_lo, n_top) only, so the tile's first
  // n_block_max - n_top steps (the causal diagonal crosses the tile, or its rows lie past
  // seqlen_q in the tile that ends the sequence) and its last n_lo - n_block_min ones (a sliding
  // window's left edge) hold no key any of its rows sees: it skips them, passing its turns and
  // releasing the stages. n_wg = n_top - n_lo steps of its own (0: it passes every turn). Blocks
  // [n_unmasked_lo, n_unmasked) need no mask for its rows.
  __device__ __forceinline__ void key_range(const Work& w, const int cw, const int n_block_max, const int n_block_min,
                                            int& n_top, int& n_wg, int& n_unmasked, int& n_unmasked_lo) const {
    const int r0 = w.m0 + 64 * cw;  // this warpgroup's first row
    // (r0 < 0: a warpgroup above row 0 in the shifted first tile, FwdTileScheduler::m_shift, whole
    // warpgroups: its rows are no rows, though with seqlen_k > seqlen_q their key range is not empty.)
    const bool own_range = Traits::kWarpgroupKeyRanges && 64 * cw < w.rows_q && r0 >= 0;
    n_top = !Traits::kWarpgroupKeyRanges ? n_block_max : own_range ? w.mask.n_block_max(r0, 64, kBlockN) : 0;
    int n_lo = !kLocal || !Traits::kWarpgroupKeyRanges ? n_block_min : own_range ? w.mask.n_block_min(r0, kBlockN) : 0;
    if (kLocal && n_top <= n_lo) n_top = n_lo = n_block_min;  // no key: every step skipped (at the front)
    n_wg = n_top - n_lo;
    n_unmasked = Traits::kWarpgroupKeyRanges ? w.mask.n_block_unmasked(r0, kBlockN) : w.n_block_unmasked;
    n_unmasked_lo = !kLocal                      ? 0
                    : Traits::kWarpgroupKeyRanges ? w.mask.n_block_unmasked_lo(r0, 64, kBlockN)
                                                  : w.mask.n_block_unmasked_lo(w.m0, kBlockM, kBlockN);
  }

  // O's accumulators (float[1][head_dim_mma / 8][4], the accumulator
  // layout at the top of the file) zeroed: FA2 Alg. 1 line 5, O = 0.
  template <int kNBlkD>
  __device__ __forceinline__ static void zero_o(float (&acc_o)[1][kNBlkD][4]) {
#pragma unroll
    for (int j = 0; j < kNBlkD; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[0][j][e] = 0.f;
    }
  }

  // Varlen, before a tile's first step (n_steps > 0; every consumer thread): the rows its TMA
  // boxes brought from past the sequence's end, zeroed where they would reach an output. sQ_t:
  // the tile's Q buffer; cw: this thread's consumer warpgroup; kv_pipe: the tile's step 0.
  __device__ __forceinline__ void zero_rows_past_ends(const Work& w, const uint32_t sQ_t, const int cw,
                                                      const int n_block_max,
                                                      const PipelineState<kStages>& kv_pipe) const {
    // Q: the TMA box brought the next sequence's rows past this one's end. Those that share a
    // warp with its last rows are zeroed, as a dense call's out-of-bounds fill leaves them: the
    // online softmax decides rescales and the exact form per warp (or per warp and row index), so
    // the tile then computes what the dense op computes on the sequence alone, bit for bit (rows
    // in warps without a valid row feed only outputs that are never stored).
    if (params.cu_seqlens_q != nullptr) zero_rows_past_end<TileQ, kHeadDimPad>(sQ_t, w.rows_q - 64 * cw, cw);
    // V of the last key block (step 0): its rows past the sequence's keys are the next
    // sequence's (or past cu_seqlens_k[-1]). P is 0 there, but 0 * NaN is NaN in P V, so they are
    // zeroed as a dense call's out-of-bounds fill leaves them (K needs nothing: the mask sets S to
    // -inf by select). Every consumer warpgroup reads the stage: they share the rows and meet on
    // barrier kVTailBarrier, before the tile's first turn (no wait on WarpgroupTurns inside).
    if (params.cu_seqlens_k != nullptr) zero_v_tail(w, n_block_max, kv_pipe);
  }

  // zero_rows_past_ends' V rows: those of the last key block's stage past the sequence's keys.
  __device__ __forceinline__ void zero_v_tail(const Work& w, const int n_block_max,
                                              const PipelineState<kStages>& kv_pipe) const {
    const int keys_in_last = w.seq.seqlen_k - (n_block_max - 1) * kBlockN;  // uniform over the CTA
    if (keys_in_last < kBlockN) {
      // With O staged in the V ring, a CTA's previous tile stored O from these rows: every
      // consumer warp is past that store (the producer's o_free wait ordered this stage's V
      // load after it). A consumers' barrier states it where compute-sanitizer racecheck sees
      // it (with only the dynamic walk's kTileFull between them, it reported these writes
      // against that store); one CTA per tile has no previous tile.
      if (Traits::kStageOInV && (sched.persistent || sched.dynamic)) {
        named_barrier_sync(kVTailBarrier, kConsumerThreads);
      }
      mbarrier_wait(v_full(kv_pipe.stage(0)), kv_pipe.phase(0));
      zero_rows<TileKV, kHeadDimPad, kConsumerThreads>(sV(kv_pipe.stage(0)), keys_in_last, kBlockN,
                                                       thread_index_opaque() - 128);
      fence_proxy_async();
      named_barrier_sync(kVTailBarrier, kConsumerThreads);
    }
  }

  // Step i of a tile skipped (no row of this warpgroup sees its key block; kv_pipe: the tile's
  // step 0): the turn passes on at once, and the stage is released once it has landed (an
  // arrival before that would count towards the stage's previous use).
  __device__ __forceinline__ void skip_step(const Turns& turns, const PipelineState<kStages>& kv_pipe, const int i,
                                            const int lane) const {
    const int stage = kv_pipe.stage(i);
    turns.pass();
    mbarrier_wait(k_full(stage), kv_pipe.phase(i));
    __syncwarp();
    if (lane == 0) mbarrier_arrive(k_empty(stage));
    mbarrier_wait(v_full(stage), kv_pipe.phase(i));
    __syncwarp();
    if (lane == 0) mbarrier_arrive(v_empty(stage));
  }

  // ---- The main loop's steps (FA2 Alg. 1 lines 8-10; FA3's intra-warpgroup overlap, the kernel's
  // step lambdas); s: S, p_*: P as A fragments, acc_o: O (the accumulator layout at the top):

  // Step 0 of consumer warpgroup cw's steps, Alg. 1 line 8: S = Q K^T of its first key block
  // (ring position kv_wg; Q in sQ_t) in its turn, complete on return, and this warp's release of
  // the K stage.
  template <int kNBlkN>
  __device__ __forceinline__ void first_s(float (&s)[1][kNBlkN][4], const Turns& turns,
                                          const PipelineState<kStages>& kv_wg, const uint32_t sQ_t, const int cw,
                                          const int lane) const {
    turns.begin();
    mbarrier_wait(k_full(kv_wg.stage(0)), kv_wg.phase(0));
    wgmma_fence();
    gemm_qk<Element, TileQ, TileKV, Traits::kHeadDim>(s[0], sQ_t, 64 * cw, sK(kv_wg.stage(0)));
    wgmma_commit();
    turns.end();
    wgmma_wait<0>();
    wgmma_fence_operands(flat(s[0]));
    __syncwarp();
    if (lane == 0) mbarrier_arrive(k_empty(kv_wg.stage(0)));  // this warp is done with K
  }

  // Step i >= 1 of consumer warpgroup cw's steps (ring position kv_wg + i), its products in its
  // turn: Alg. 1 line 8, S = Q K_n^T (unscaled: the scale goes into the softmax; Q in sQ_t), and
  // line 10 of the previous step, O += P_{i-1} V_{n+1} (P_{i-1} in p_in), issued back to back, with
  // n = n_top - 1 - i the caller's key block; stage, prev: kv_wg.stage(i), kv_wg.stage(i - 1), the
  // ring stages of K_n and V_{n+1}. On return S is complete (and this warp has released the K
  // stage), O += P V still running.
  template <int kNBlkN, int kNBlkD, int kKSteps>
  __device__ __forceinline__ void issue_s_pv(float (&s)[1][kNBlkN][4], float (&acc_o)[1][kNBlkD][4],
                                             uint32_t (&p_in)[kKSteps][4], const Turns& turns,
                                             const PipelineState<kStages>& kv_wg, const int i, const int stage,
                                             const int prev, const uint32_t sQ_t, const int cw,
                                             const int lane) const {
    turns.begin();
    mbarrier_wait(k_full(stage), kv_wg.phase(i));
    wgmma_fence();
    gemm_qk<Element, TileQ, TileKV, Traits::kHeadDim>(s[0], sQ_t, 64 * cw, sK(stage));
    wgmma_commit();
    mbarrier_wait(v_full(prev), kv_wg.phase(i - 1));
    wgmma_fence();
    gemm_pv<Element, Traits::kHeadDimMma, TileKV>(acc_o[0], p_in, sV(prev));
    wgmma_commit();
    turns.end();
    wgmma_wait<1>();  // S_i is complete, O += P V still running
    wgmma_fence_operands(flat(s[0]));
    __syncwarp();
    if (lane == 0) mbarrier_arrive(k_empty(stage));  // this warp is done with K_n
  }

  // issue_s_pv's O += P_{i-1} V (V in ring stage prev) waited for: O and p_in are the thread's
  // again (p_in live up to here: the product read it; S kept in registers across the wait), and
  // this warp releases the V stage.
  template <int kNBlkN, int kNBlkD, int kKSteps>
  __device__ __forceinline__ void wait_pv(float (&acc_o)[1][kNBlkD][4], uint32_t (&p_in)[kKSteps][4],
                                          float (&s)[1][kNBlkN][4], const int prev, const int lane) const {
    wgmma_wait<0>();
    wgmma_fence_operands(flat(acc_o[0]));
    wgmma_fence_operands(p_in);
    wgmma_fence_operands(flat(s[0]));
    __syncwarp();
    if (lane == 0) mbarrier_arrive(v_empty(prev));  // this warp is done with V_{n+1}
  }

  // P = S (after the softmax: exp2 values) as 16-bit wgmma A fragments, k16 step kk in p[kk]
  // (FA2 Alg. 1 line 10's P, kept in registers for O += P V: FA3).
  template <int kNBlkN, int kKSteps>
  __device__ __forceinline__ static void to_p(uint32_t (&p)[kKSteps][4], float (&s)[1][kNBlkN][4]) {
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) acc_to_a_frag<kNBlkN, Element>(p[kk], s[0], kk);
  }

  // The last of consumer warpgroup cw's n_wg steps, Alg. 1 line 10: O += P V of its last key
  // block (P in p_last; ring position kv_wg + n_wg - 1) in its turn, complete on return, and this
  // warp's release of the V stage.
  template <int kNBlkD, int kKSteps>
  __device__ __forceinline__ void last_pv(float (&acc_o)[1][kNBlkD][4], uint32_t (&p_last)[kKSteps][4],
                                          const Turns& turns, const PipelineState<kStages>& kv_wg, const int n_wg,
                                          const int lane) const {
    const int last = kv_wg.stage(n_wg - 1);
    turns.begin();
    mbarrier_wait(v_full(last), kv_wg.phase(n_wg - 1));
    wgmma_fence();
    gemm_pv<Element, Traits::kHeadDimMma, TileKV>(acc_o[0], p_last, sV(last));
    wgmma_commit();
    turns.end();
    wgmma_wait<0>();
    wgmma_fence_operands(flat(acc_o[0]));
    wgmma_fence_operands(p_last);
    __syncwarp();
    if (lane == 0) mbarrier_arrive(v_empty(last));
  }

  // ---- Epilogue (Alg. 1 lines 12-15; O_i = diag(l)^-1 O_i and L_i = m + log l themselves are
  // OnlineSoftmax::finalize's):

  // Epilogue, Alg. 1 line 15 (L_i of line 13): LSE (and its two parts: softmax_stats, flash.h) of
  // the thread's two rows (accumulator layout at the top of the file), written by the rows' owners
  // (lane % 4 == 0) as the sm80 kernel does. wo: the tile's decode.
  __device__ __forceinline__ void store_lse(const Work& wo, const float (&lse)[2], const float (&row_max)[2],
                                            const float (&row_log2sum)[2], const int lane) const {
    if (lane % 4 == 0) {
      const int64_t stat0 = wo.seq.stat_index(params, wo.bidh, wo.m0);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0() + lane / 4 + 8 * r;
        if (row < wo.rows_q && wo.m0 + row >= 0) {  // (rows above row 0: the shifted first tile)
          params.softmax_lse_ptr[stat0 + row] = lse[r];
          if (params.row_max_ptr != nullptr) {
            params.row_max_ptr[stat0 + row] = row_max[r];
            params.row_log2sum_ptr[stat0 + row] = row_log2sum[r];
          }
        }
      }
    }
  }

  // Epilogue: the shared address of O's staging buffer for the tile whose Q is in stage qs, a
  // Q-tile layout (consumer warpgroup c's rows 64 c + r lie 64 c * 128 bytes past rows r: whole
  // swizzle atoms, so they are themselves a TMA box): the tile's Q buffer (its S
  // products, the only readers, are complete; the Q tile landed before them), or with
  // Traits::kStageOInV the V ring from its start. The address is opaque per tile, as the thread
  // index.
  __device__ __forceinline__ uint32_t o_staging(const int qs) const {
    uint32_t sO_addr = Traits::kStageOInV ? smem_addr + Traits::kOffV : sQ(qs);
    asm volatile("" : "+r"(sO_addr));
    return sO_addr;
  }

  // Epilogue, Traits::kStageOInV: waits until the V ring is free for the tile's O. The ring is
  // free once every consumer warp has released the tile's last key block (the stage's empty
  // barrier completes the phase; the earlier stages were released before it): the tile's V loads
  // came after the previous tile's O store had read the ring (o_free), and the producer loads no
  // further V before this tile's o_free. A tile without keys has no V: its q_full came after
  // o_free. wo: the tile's decode; kv_next: the next tile's first K/V ring position.
  __device__ __forceinline__ void wait_v_ring_free(const Work& wo, const PipelineState<kStages>& kv_next) const {
    if (wo.n_block_max > (kLocal ? wo.n_block_min() : 0)) {  // the tile had steps (V loads)
      PipelineState<kStages> last = kv_next;  // the tile's last key block: one position before the next tile's first
      last.advance(2 * kStages - 1);
      mbarrier_wait(v_empty(last.stage()), last.phase());
    }
  }

  // Epilogue, O_i of Alg. 1 line 12 staged for line 14's write: O = acc_o * scale (acc_o already
  // divided by l: OnlineSoftmax::finalize; scale: dropout's 1 / (1 - p), else 1) as 16-bit values
  // into consumer warpgroup c's 64 rows of the staging buffer (generic address sO, a Q-tile layout; tid_wg: the thread's index
  // in the warpgroup), then the warpgroup's epilogue barrier: the rows are complete.
  template <int kNBlkD>
  __device__ __forceinline__ void stage_o(unsigned char* sO, float (&acc_o)[1][kNBlkD][4], const float scale,
                                          const int c, const int tid_wg) const {
    store_acc_to_smem<kBlockM, kHeadDimPad, kNBlkD, Element>(sO, acc_o[0], 64 * c, scale, tid_wg);
    // The generic-proxy writes before the async proxy's next use of the buffer (the TMA store,
    // or the producer's next Q load).
    fence_proxy_async();
    named_barrier_sync(1 + c, 128);
  }

  // Epilogue, Alg. 1 line 14 (write O_i) by TMA (FA3's epilogue; one thread): consumer warpgroup c's
  // 64 rows of O, staged at sO_addr in a Q-tile layout, to the output; returns once the store has
  // read them. wo: the tile's decode.
  __device__ __forceinline__ void tma_store_o(const Work& wo, const uint32_t sO_addr, const int c) const {
#pragma unroll
    for (int cb = 0; cb < kHeadDimPad / 64; ++cb) {
      if (wo.m0 + 64 * c < 0) break;  // a warpgroup above row 0 (the shifted first tile): nothing to store
      tma_store_4d(&tma.o, sO_addr + cb * TileQ::kColBlockBytes + 64 * c * 128, 64 * cb,
                   wo.seq.q_tma_row(wo.m0 + 64 * c), wo.bidh, wo.seq.tma_batch(params));
    }
    tma_store_commit();
    tma_store_wait_read<0>();
  }

  // Epilogue, Alg. 1 line 14 (write O_i) by 16-byte stores (primitives/tile_copy.cuh; every thread of
  // warpgroup c, tid_wg its index there): the warpgroup's rows of O inside the sequence, staged at
  // sO (generic address) in a Q-tile layout. wo: the tile's decode.
  __device__ __forceinline__ void store_o_rows(const Work& wo, unsigned char* sO, const int c,
                                               const int tid_wg) const {
    store_tile<TileQ, 64, kHeadDimPad, 128>(wo.seq.template q_row<Element>(params.o, wo.bidh, wo.m0 + 64 * c),
                                            params.o.row_stride, sO + 64 * c * 128, wo.rows_q - 64 * c, params.d,
                                            tid_wg);
    fence_proxy_async();  // these generic reads before the producer's next TMA write
  }

  // Epilogue, last: this warp's release of O's staging buffer (the tile's Q buffer, stage qs, or
  // with Traits::kStageOInV the V ring: o_free) once its reads of it are done (warp 0: once the
  // TMA store has read the warpgroup's rows); the phase completes with the last warp's arrival.
  __device__ __forceinline__ void release_o_buffer(const int qs, const int lane) const {
    __syncwarp();
    if (lane == 0) mbarrier_arrive(Traits::kStageOInV ? o_free : q_empty(qs));
  }
};

// kLocal: the call has a sliding window's left bound (params.window_left >= 0; launch_fwd picks):
// the tiles' key ranges start at the window's first block. The kernel without it is the causal
// mask's code alone (n_block_min = 0, no left-edge masks or tail skips). kSoftcap: logit
// soft-capping (params.softcap > 0; primitives/softmax.cuh: softcap_scores on every S tile).
// kDropout: attention dropout (params.dropout_p > 0; flash.h): after a step's softmax (l sums P
// itself) P's dropped elements are zeroed before its P V (FlashAttention, Dao et al. 2022, Alg. 2
// line 11: Z o P; the mask from primitives/philox.cuh), O scaled by 1 / (1 - p) in the epilogue; P
// is converted after the softmax (no early, row-by-row conversion: kDoubleBufferP's). kAlibi: ALiBi
// (params.alibi_slopes_ptr; flash.h): every S tile gains the bias before the mask (common/mask.cuh:
// add_alibi).
template <typename Traits, bool kLocal = false, bool kSoftcap = false, bool kDropout = false, bool kAlibi = false>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_fwd_kernel(const __grid_constant__ Flash_fwd_params params, const __grid_constant__ FwdTmaMaps tma,
                     const __grid_constant__ FwdTileScheduler<Traits::kBlockM> sched) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // What runs where: after the prologue (warp 0: a varlen tight grid's tile; thread 0:
  // FwdCta::init_barriers) and the CTA barrier, warpgroup 0 runs the producer, FwdCta::producer
  // (TMA loads), and returns; the consumer warpgroups run the rest of this body (the tile walk,
  // main loop and epilogue, their steps FwdCta's), with the shared state (barriers, buffers, tile
  // slot) from cta.
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kQStages = Traits::kQStages;
  constexpr int kNBlkN = kBlockN / 8;      // n8 blocks of S (keys)
  constexpr int kNBlkD = Traits::kHeadDimMma / 8;  // n8 blocks of O (smem_layout.cuh: head_dim_mma)

  using Cta = FwdCta<Traits, kLocal>;
  const Cta cta(params, tma, sched);

  const int tid = threadIdx.x;
  const int wg = tid / 128;

  // Prologue. Varlen on a tight grid: warp 0 finds this CTA's tile (FwdCta::s_varlen_tile) and
  // publishes it through the CTA barrier below; a CTA past every real tile leaves right after it.
  if (sched.varlen_tight && tid < 32) {
    const int64_t t = varlen_dense_index<kBlockM, true>(params.cu_seqlens_q, params.b, params.total_q,
                                                        params.seqlen_q, params.h, blockIdx.x);
    if (tid == 0) cta.s_varlen_tile = t;
  }
  if (tid == 0) cta.init_barriers();
  __syncthreads();  // the last CTA-wide barrier: the producer's other warps leave below
  if (sched.varlen_tight && cta.s_varlen_tile < 0) return;  // uniform over the CTA

  // The producer and the consumers walk this CTA's tiles (common/tile_scheduler.cuh) in the same
  // order and each decode them (QTileWork): no tile index passes through shared memory (but a
  // varlen tight grid's, FwdCta::s_varlen_tile, and the dynamic walk's, FwdCta::tile_slot).
  // Both after their register reallocation (nothing live across setmaxnreg).
  // No steps (n_block_max <= n_block_min, which a window alone never makes: key_start < key_limit
  // wherever key_limit > 0): no row of the tile sees a key (causal, seqlen_q > seqlen_k; varlen, a
  // sequence without keys): no K/V, no Q load, but one Q-ring phase all the same (the consumers
  // stage O = 0 through the buffer). A tile past its sequence's end: skipped by both sides.
  if (wg == 0) {
    cta.producer(tid);
    return;
  }

  // ---- Consumers: warpgroup c owns query rows [64 c, 64 c + 64) of every tile.
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const float scale_log2 = params.scale_softmax_log2;
  const float softcap_prescale = kSoftcap ? params.softcap_prescale : 0.f;
  const DropoutRng dropout = DropoutRng::of<kDropout>(params);
  using Turns = typename Cta::Turns;
  PipelineState<kQStages> q_pipe;
  PipelineState<kStages> kv_next;  // the K/V ring position of the next tile's first key block
  // This thread's consumer warpgroup, warp-uniform (read once): the turns' barrier ids and the Q
  // rows of its S products (64 cw) then live in uniform registers, so the Q descriptors are built
  // on the uniform datapath instead of in vector registers moved by R2UR before every HGMMA.
  const int cw = warpgroup_index(threadIdx.x) - 1;
  const Turns turns(cw);
  turns.prime();
  if (sched.dynamic) named_barrier_arrive(Cta::kTileEmpty, Cta::kHandOverThreads);  // the slot is free (tile hand-over)
  auto tiles = sched.begin();
#pragma unroll 1
  for (int64_t tile_index;;) {
    // The next tile (the producer's, in the same order): wait for its Q (a tile without keys: for
    // the buffer). The dynamic walk hands the index over on kTileFull (-1: the walk is over); the
    // static walks compute it. The index is opaque from here on: what derives from it is
    // recomputed in the epilogue instead of held live across the main loop.
    if (!cta.next_tile(tiles, tile_index)) break;
    int64_t tile = sched.varlen_tight ? cta.s_varlen_tile : tile_index;  // varlen tight grid: its one tile
    asm volatile("" : "+l"(tile));
    const QTileWork<kBlockM, kBlockN> w(params, tile, sched.m_div, sched.h_div, sched.m_shift);
    // Varlen: a tile past its sequence's end, skipped by the producer too (the dynamic walk hands
    // over none).
    if (!sched.dynamic && w.past_end()) continue;
    // The head's attention sink for the epilogue (flash.h: sinks_ptr), loaded here so its latency
    // hides under the main loop (at the epilogue it stalled every tile: +3-5 % at d128 N = 1k-4k).
    const float sink = head_sink(params.sinks_ptr, w.bidh);
    [[maybe_unused]] const uint32_t dropout_bh = DropoutRng::head_word(w.seq.bidb, params.h, w.bidh);
    [[maybe_unused]] const float alibi_slope_u = kAlibi ? alibi_slope(params, w.seq.bidb, w.bidh) : 0.f;
    const int qs = q_pipe.stage();
    mbarrier_wait(cta.q_full(qs), q_pipe.phase());
    const int n_block_max = w.n_block_max, n_block_min = kLocal ? w.n_block_min() : 0;
    const int n_steps = max(n_block_max - n_block_min, 0);  // the tile's steps (key blocks)
    // This warpgroup's own key blocks [n_top - n_wg, n_top) (key_range): the tile's first
    // n_block_max - n_top steps and its steps from i0 + n_wg on (a window's left edge) are skipped; blocks [n_unmasked_lo,
    // n_unmasked) need no mask for its rows.
    int n_top, n_wg, n_unmasked, n_unmasked_lo;
    cta.key_range(w, cw, n_block_max, n_block_min, n_top, n_wg, n_unmasked, n_unmasked_lo);
    const int i0 = n_block_max - n_top;  // this warpgroup's first step
    const uint32_t sQ_t = cta.sQ(qs);
    // Step i of the tile: S_i reads K at kv_pipe.stage(i), P_{i-1} V at kv_pipe.stage(i - 1).
    const PipelineState<kStages> kv_pipe = kv_next;
    kv_next.advance(n_steps);
    // The thread's indices, read afresh for every tile and again in the epilogue (an opaque read
    // of %tid.x): the compiler would otherwise hoist the row- and thread-derived mask, stats and
    // store terms out of the tile loop and keep them live (spilled) across the main loop.
    const int lane = thread_index_opaque() % 32;

    float acc_o[1][kNBlkD][4];
    Cta::zero_o(acc_o);  // FA2 Alg. 1 line 5: O = 0
    OnlineSoftmax<1, ExactForm::kSecondLoop, Traits::kSoftmaxOrder> softmax;  // m = -inf, l = 0 (softmax.cuh)

    if (n_steps > 0) {
      cta.zero_rows_past_ends(w, sQ_t, cw, n_block_max, kv_pipe);  // varlen: Q and V rows past the sequence

      // Steps before i0 (key blocks no row of this warpgroup sees) are skipped. A warpgroup without
      // keys (n_wg = 0) passes the tile's last turn too, and its rows get O = 0, LSE = +inf. (Steps
      // past its range at a window's left edge: after its own, below.)
#pragma unroll 1
      for (int i = 0; i < i0; ++i) cta.skip_step(turns, kv_pipe, i, lane);
      if (n_wg == 0) turns.pass();
    }
    // O staged in the V ring (Traits::kStageOInV): the Q buffer's last readers are this
    // warpgroup's S products, so it is released before the tile's last P V (without a step of its
    // own: here, after the skipped stages landed), and the producer loads the next tile's Q during
    // that product and the epilogue.
    auto release_q = [&] {
      if constexpr (Traits::kStageOInV) {
        __syncwarp();
        if (lane == 0) mbarrier_arrive(cta.q_empty(qs));
      }
    };
    if (n_wg == 0) release_q();

    if (n_wg > 0) {
      // Intra-warpgroup overlap (FA3 §3.2, HOPPER.md §1.5): step i issues S_i = Q K_i^T and
      // O += P_{i-1} V_{i-1} back to back, then runs the softmax of S_i while the second product is
      // still on the tensor cores; O's rescale for S_i waits until that product is complete.
      uint32_t p[kBlockN / 16][4];  // P_{i-1} as 16-bit A fragments (FA2 Alg. 1 line 10)
      float s[1][kNBlkN][4];
      // The ring position of this warpgroup's first step; its steps i = 0 .. n_wg - 1 visit key
      // blocks n = n_top - 1 - i (the tile's steps i0 + i).
      PipelineState<kStages> kv_wg = kv_pipe;
      kv_wg.advance(i0);

      // Step 0 (key block n_top - 1, the last this warpgroup sees): S_0, its softmax and P_0 (O = 0 yet).
      cta.first_s(s, turns, kv_wg, sQ_t, cw, lane);
      if constexpr (kSoftcap) softcap_scores(s, softcap_prescale);
      if constexpr (kAlibi) w.mask.template add_alibi<false>(s, w.m0 + Cta::row0(), (n_top - 1) * kBlockN, alibi_slope_u);
      if (n_top - 1 >= n_unmasked || (kLocal && n_top - 1 < n_unmasked_lo)) {
        w.mask.template apply<kLocal>(s, w.m0 + Cta::row0(), (n_top - 1) * kBlockN);
      }
      softmax.update(s, acc_o, scale_log2);
      // Dropout (kDropout): Z o P of key block n, the row sums l above being of P itself.
      auto drop = [&](int n) {
        if constexpr (kDropout) {
          dropout.template for_each_kept<false, 1, kNBlkN>(
              dropout_bh, w.m0 + Cta::row0() + lane / 4, n * kBlockN + 2 * (lane % 4),
              [&](int, int nb, int e, bool kept) { s[0][nb][e] = kept ? s[0][nb][e] : 0.f; });
        }
      };
      drop(n_top - 1);
      Cta::to_p(p, s);

      // Step i of the loop (i >= 1, key block n = n_top - 1 - i): S_i, then O += P_{i-1} V
      // from p_in; P_i into p_out. early (Traits::kDoubleBufferP, p_out != p_in): P_i is converted
      // row by row inside the softmax while O += P_{i-1} V still reads p_in; else after that product.
      auto step = [&](int i, uint32_t (&p_in)[kBlockN / 16][4], uint32_t (&p_out)[kBlockN / 16][4], bool early) {
        const int n = n_top - 1 - i, stage = kv_wg.stage(i), prev = kv_wg.stage(i - 1);
        // Alg. 1 line 8: S_i = Q K_n^T, and line 10 of the previous step: O += P_{i-1} V_{n+1}.
        cta.issue_s_pv(s, acc_o, p_in, turns, kv_wg, i, stage, prev, sQ_t, cw, lane);

        // The mask (common/mask.cuh) only on tiles crossing the causal diagonal, a window's left edge
        // or the seqlen_k edge (a warpgroup-uniform branch); then Alg. 1 lines 9-10: m, P = exp2((S -
        // m) c), l; alpha for O. (Soft-capping or ALiBi's bias first: softmax.cuh, mask.cuh.)
        if constexpr (kSoftcap) softcap_scores(s, softcap_prescale);
        if constexpr (kAlibi) w.mask.template add_alibi<false>(s, w.m0 + Cta::row0(), n * kBlockN, alibi_slope_u);
        if (n >= n_unmasked || (kLocal && n < n_unmasked_lo)) w.mask.template apply<kLocal>(s, w.m0 + Cta::row0(), n * kBlockN);
        float alpha[2];
        bool rescaled;
        if (early) {
          rescaled = softmax.update_deferred(s, scale_log2, alpha,
                                             [&](int r) { to_a_frag_row<kNBlkN, Element>(p_out, s[0], r); });
        } else {
          rescaled = softmax.update_deferred(s, scale_log2, alpha);
        }

        cta.wait_pv(acc_o, p_in, s, prev, lane);  // O += P_{i-1} V complete: O and p_in are ours again
        if (rescaled) decltype(softmax)::rescale_o(acc_o, alpha);
        if (!early) {
          drop(n);
          Cta::to_p(p_out, s);
        }
        // Long rows (common/long_rows.cuh): O (key blocks of steps 0 .. i - 1) out of the
        // accumulator every `every` steps of this warpgroup.
        const int every = long_rows_every(params, n_wg, kBlockN);
        if (every > 0 && i % every == 0) {
          LongRows(params, Cta::row0() + lane / 4, lane)
              .flush(acc_o, softmax.row_max, scale_log2, i == every);
        }
      };
      // The last step's O += P V (key block n_top - n_wg; then the tail skips, which read no Q).
      auto last_pv = [&](uint32_t (&p_last)[kBlockN / 16][4]) {
        release_q();  // the last S product (in the step before) is complete
        cta.last_pv(acc_o, p_last, turns, kv_wg, n_wg, lane);
      };
      if constexpr (Traits::kDoubleBufferP && !kDropout) {
        // Two steps per trip, so both buffers are fixed registers: P_i in p for even i, p2 for odd.
        uint32_t p2[kBlockN / 16][4];
        int i = 1;
#pragma unroll 1
        for (; i + 1 < n_wg; i += 2) {
          step(i, p, p2, true);
          step(i + 1, p2, p, true);
        }
        if (i < n_wg) {
          step(i, p, p2, true);
          last_pv(p2);
        } else {
          last_pv(p);
        }
      } else {
#pragma unroll 1
        for (int i = 1; i < n_wg; ++i) step(i, p, p, false);
        last_pv(p);
      }
      // The tile's steps after this warpgroup's (key blocks before its rows' window): skipped, so
      // every warpgroup takes the tile's n_steps + 1 turns and releases every stage.
      if constexpr (kLocal) {
#pragma unroll 1
        for (int i = i0 + n_wg; i < n_steps; ++i) cta.skip_step(turns, kv_pipe, i, lane);
      }
    }

    // ---- Epilogue (Alg. 1 lines 12-13): O = acc_o / l, LSE = m + log2(l) (and its two parts), as
    // the sm80 kernel. A tile whose rows see no key (no steps) gets O = 0, LSE = +inf.
    // The tile's decode once more: cheaper than holding the output offsets live, spilled, across
    // the main loop.
    {
      const QTileWork<kBlockM, kBlockN> wo(params, tile, sched.m_div, sched.h_div, sched.m_shift);
      const int tid_e = thread_index_opaque();
      const int c = tid_e / 128 - 1, tid_wg = tid_e % 128, lane = tid_e % 32;
      float lse[2], row_max[2], row_log2sum[2];
      const int every = long_rows_every(params, n_wg, kBlockN);
      if (every > 0 && n_wg > every) {  // some flush ran: its copy back into O
        LongRows(params, Cta::row0() + lane / 4, lane)
            .merge(acc_o, softmax.row_max, scale_log2);
      }
      softmax.finalize(acc_o, scale_log2, sink, lse, row_max, row_log2sum);
      cta.store_lse(wo, lse, row_max, row_log2sum, lane);
      // O through this warpgroup's own 64 rows of its staging buffer (FwdCta::o_staging), with
      // Traits::kStageOInV once the V ring is free (wait_v_ring_free).
      const uint32_t sO_addr = cta.o_staging(qs);
      if constexpr (Traits::kStageOInV) cta.wait_v_ring_free(wo, kv_next);
      unsigned char* sO = static_cast<unsigned char*>(__cvta_shared_to_generic(sO_addr));
      cta.stage_o(sO, acc_o, kDropout ? params.dropout_rp : 1.f, c, tid_wg);
      if (params.cu_seqlens_q == nullptr || wo.rows_q - 64 * c >= 64) {
        // Dense (FA3's epilogue), and a varlen warpgroup whose 64 rows all lie inside its sequence
        // (their box stays there): one thread stores the warpgroup's 64 rows by TMA (rows past
        // seqlen_q and columns past d are clipped by the tensor map) and waits until the store
        // has read them; the other warps go on at once.
        if (tid_wg == 0) cta.tma_store_o(wo, sO_addr, c);
      } else {
        // Varlen, the warpgroup that holds the sequence's end: a box would run into the next
        // sequence's rows; 16-byte stores of the rows inside this one (primitives/tile_copy.cuh).
        cta.store_o_rows(wo, sO, c, tid_wg);
      }
      cta.release_o_buffer(qs, lane);
    }
    q_pipe.advance();
  }
  turns.drain();
  if (thread_index_opaque() % 128 == 0) tma_store_wait<0>();  // O written
#endif
}

}  // namespace sm90
}  // namespace flash
