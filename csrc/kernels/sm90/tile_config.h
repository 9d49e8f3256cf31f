// Tile configuration of the Hopper (sm90: wgmma) path, forward and backward, one row per head dim it
// covers (and the extra rows below: FwdLongTile, FwdShortTile, Sm80FwdTile, DkvLongTile, DkvMidTile,
// DqShortTile). This is THE sm90 table (shapes: kernels/common/tile_shapes.h): the sm90 launch
// templates (sm90/flash_fwd*_launch.cuh, sm90/flash_bwd_*_launch.cuh, the ends of
// flash_bwd_{dkv,dq}_kernel.cuh and flash_bwd_{dkv,dq}_roles_kernel.cuh: FLASH_SM90_BWD_LAUNCH) and
// dispatch.cu's row rules read only it.
//
// dK/dV kernel (sm90/flash_bwd_dkv_kernel.cuh), one CTA per K/V tile of the row's kBlockN rows
// (kBlockN / 64 warpgroups); Q_i / dO_i tiles of its kBlockM rows stream through kStages
// shared-memory stages (TMA; the cp.async twin uses two), and each is processed as kSplit parts
// whose products are queued together. dQ kernel (sm90/flash_bwd_dq_kernel.cuh), one CTA per Q tile
// of the row's kBlockM rows (kBlockM / 64 warpgroups); K_j / V_j tiles of its kBlockN rows stream
// through kStages stages.
//
// Registers per thread (fp32 accumulators): dK/dV kernel d/2 * 2 (dK, dV) + kBlockM/2 * 2
// (S^T, dP^T) + kBlockM/4 (P^T, dS^T as 16-bit A operands), less with the register diets of
// common/tile_shapes.h (DpInS: one of S^T, dP^T; PSmem: no P^T across the products); dQ kernel d/2 +
// kBlockN/2 * 2 + kBlockN/4. Shared memory, 16-bit elements (d: the padded 64-column width):
//   dkv = 2 * kBlockN * d * 2 B + kStages * (2 * kBlockM * d * 2 B + 12 * kBlockM B)
//         (+ kBlockN * kBlockM * 2 B for P^T in PSmem rows)
//   dq  = 2 * kBlockM * d * 2 B + kStages *  2 * kBlockN * d * 2 B
// The forward rows' Q-in-regs and minCTAs columns are read by the sm80 kernels only (the shape is
// shared); the sm90 forward launches one CTA per SM (__launch_bounds__(threads, 1)).
#pragma once

#include "kernels/common/tile_shapes.h"

namespace flash {
namespace sm90 {

// Largest opt-in dynamic shared memory per block on sm_90 (H100/H200): 227 KB.
constexpr int kMaxSmem = 227 * 1024;

// Head dims without a row here run the sm80 kernels on sm_90 too (kernels/dispatch.cu: the manifest).
template <int kHeadDim> struct FwdTile { static constexpr bool kSupported = false; };
template <int kHeadDim> struct DkvTile { static constexpr bool kSupported = false; };
template <int kHeadDim> struct DqTile { static constexpr bool kSupported = false; };

// dK/dV (d64, and d96 / d128 below): one warpgroup over 64 keys, two CTAs per SM, so one CTA's
// prologue (K_j, V_j, the first Q / dO tiles), softmax math and dK / dV stores run under the
// other's wgmmas (a third buffer cost the second CTA its shared memory; split 2 was 3-8 % slower
// at d64). Q / dO stream by TMA (BwdStages), each refill issued under the next tile's first
// products; d128 keeps two stages (238 registers, 97 KiB). The 128-key rows are DkvLongTile's
// (long sequences). Tune-harness numbers: docs/PERF_NOTES.md, "Tile-table logs".
//                                     BLOCK_N BLOCK_M split (sm80: warp rows, fast copy) stages
template <> struct DkvTile<64>  : DkvTileShape< 64,  128,    1> { static constexpr bool kSupported = true; };
template <> struct DkvTile<128> : DkvTileShape< 64,   64,    1,   16,   true,    2> { static constexpr bool kSupported = true; };
// dQ d64: 64 x 64, three one-warpgroup CTAs per SM (168 registers at most, no spills). d96 / d128:
// 128 x 128, half the key steps of 128 x 64 and each S / dP wgmma twice as wide (255 registers, no
// spills in the TMA kernel; the same bits: dQ's k16 steps keep their order). Numbers: "Tile-table logs".
//                                    BLOCK_M BLOCK_N (warp rows, fast copy: sm80 only) min CTAs/SM
template <> struct DqTile<64>  : DqTileShape< 64,  64,   16, true,                            3> { static constexpr bool kSupported = true; };
template <> struct DqTile<128> : DqTileShape<128, 128> { static constexpr bool kSupported = true; };

// d96 runs d128's rows with 128-column shared tiles (S over its 6 k16 steps; as the forward does)
// and 96-column dK, dV and dQ products (smem_layout.cuh: head_dim_mma; +6-7 % dK/dV, +1-2 % dQ
// over 128-column products).
// d192 / d256: dK and dV of 64 K rows (d registers per thread) leave no room for S^T and dP^T in
// one warpgroup, so both kernels split their two warpgroups by role over a 64 x 64 tile pair
// (Roles<>, flash_bwd_{dkv,dq}_roles_kernel.cuh): one holds dV (or dQ's first columns),
// the other dK (dQ's last columns), d / 2 registers each. Shared memory at d256: dK/dV K, V and two
// stages of Q, dO (64 x d each) 192 KB + 2 x 16 KB (P^T) + 1.5 KB (row statistics) = 225.5 KB; dQ
// Q, dO and two stages of K, V 192 KB + 8 KB (dS) + 16 KB (P) = 216 KB. Their cp.async twins (for
// strides TMA cannot describe) run 8-19 % slower. Numbers: "Tile-table logs".
// kRoundedPt: dS^T from the rounded P^T in the twins DkvLongTile<96> runs (its rows need it, below;
// DkvMidTile<96> takes it too), so d96's three rows keep giving the same bits.
template <> struct DkvTile<96>  : DkvTileShape< 64,   64,    1,   16,   true,    2> {
  static constexpr bool kSupported = true;
  static constexpr bool kRoundedPt = true;
};
template <> struct DqTile<96>   : DqTileShape<128, 128> { static constexpr bool kSupported = true; };
template <> struct DkvTile<192> : Roles<DkvTileShape<64, 64>> { static constexpr bool kSupported = true; };
template <> struct DkvTile<256> : Roles<DkvTileShape<64, 64>> { static constexpr bool kSupported = true; };
template <> struct DqTile<192>  : Roles<DqTileShape<64, 64>> { static constexpr bool kSupported = true; };
template <> struct DqTile<256>  : Roles<DqTileShape<64, 64>> { static constexpr bool kSupported = true; };

// Long query sequences (sm90/flash_bwd_dkv_long_launch.cuh; dkv_long_rows below says when): d64's
// dK/dV on 128-key tiles, two warpgroups of 64 K rows sharing each streamed Q / dO tile (one CTA
// per SM, 224 registers), instead of DkvTile<64>'s two one-warpgroup CTAs per SM that each stream
// their own. Half the Q / dO traffic per key, but one CTA's prologue and dK / dV stores no longer
// overlap another's products: +3-5 % end to end at N = 8k-32k; two Q / dO stages (three measured
// even, 0.993-1.007). The same bits as DkvTile (each K row's sum over the Q tiles keeps its order).
// d128: the 128-key row (two warpgroups of 64 K rows, one CTA per SM, four stages), within +-3 % of
// the 64-key row at 8192 and 16384 queries.
// d96: 192 keys on three warpgroups of 64 K rows (384 threads, 168 registers per thread at one CTA
// per SM), 64-query tiles, two stages, with both register diets of tile_shapes.h (DpInS: dP^T in
// S^T's registers; PSmem: P^T through a shared tile per warpgroup, dV as an SS product): 158-168
// registers, no spills; ~190 would be needed with S^T, dP^T, P^T and dS^T live beside dK and dV.
// Each warpgroup's softmax math then runs under two others' products, and a Q / dO tile serves
// 192 keys. Shared memory: K, V 2 x 48 KB (128-column tiles), 2 stages of Q, dO 64 KB, P^T 3 x 8 KB,
// statistics 1.5 KB: 185.5 KB. +2-4 % over the previous rows' best at 8k / 16k and causal 4k
// (non-causal 4k -1 %), 10 % behind at causal 2k (so dkv_long_min_seqlen 4096). Its soft-capping twins spill (64-72 bytes) and its
// dropout twins serialize their wgmmas (C7512) and spill on 168 registers, so those calls stay on
// DkvTile<96> (kSoftcapDropout = false; dispatch.cu). Numbers: "Tile-table logs".
template <int kHeadDim> struct DkvLongTile { static constexpr bool kSupported = false; };
template <> struct DkvLongTile<64>  : DkvTileShape<128, 128, 1> { static constexpr bool kSupported = true; };
template <> struct DkvLongTile<96>  : PSmem<DpInS<DkvTileShape<192, 64, 1, 16, true, 2>>> {
  static constexpr bool kSupported = true;
  static constexpr bool kSoftcapDropout = false;
};
template <> struct DkvLongTile<128> : DkvTileShape<128,  64, 1, 16, true, 4> { static constexpr bool kSupported = true; };

// Middle lengths at d96 (sm90/flash_bwd_dkv_mid_launch.cuh; dispatch.cu takes it by dkv_long_rows
// with this row's kBlockN and kDkvMidMinSeqlen, where DkvLongTile is not taken): two warpgroups of
// 64 K rows sharing each 64-query Q / dO tile, one CTA per SM, three stages, for calls of
// 2048..4095 queries and keys (without it they lost 1.8-3.7 % on the short row), and from 4096 for the
// calls whose grid has fewer than 2 of DkvLongTile<96>'s 192-key CTAs per SM but 2 of these, and
// the soft-capping and dropout calls (DkvLongTile<96> has no such twins). kRoundedPt as
// DkvTile<96>: dS^T from the rounded P^T in the plain / window / ALiBi twins, the fp32 P^T in the
// soft-capping and dropout twins (as DkvTile<96>'s), so all three rows give the same bits. ptxas
// (sm_90a, bf16 / fp16, TMA / cp.async twins): 191-253 registers of 255, no spills, no serialized
// wgmmas (C7512 / C7515). Numbers: "Tile-table logs".
template <int kHeadDim> struct DkvMidTile { static constexpr bool kSupported = false; };
template <> struct DkvMidTile<96> : DkvTileShape<128, 64, 1, 16, true, 3> {
  static constexpr bool kSupported = true;
  static constexpr bool kRoundedPt = true;
};
constexpr int kDkvMidMinSeqlen = 2048;

// Whether a backward call takes DkvLongTile (or, with its numbers, DkvMidTile) for its dK/dV
// kernel: at least min_seqlen queries and keys per sequence (dkv_long_min_seqlen, kDkvMidMinSeqlen;
// a dense call's seqlen_q / seqlen_k, a varlen call's total_q / batch and total_k / batch: its
// max_seqlen says little about a packed batch) and at least two CTAs of it per SM (its CTAs are one
// per SM, DkvTile's two: the measured grids had >= 1,000 long CTAs; MQA at batch 1 and 8192 keys
// would leave half of an H200's SMs without one). The minimum per head dim is where the long row
// stopped losing end to end (d64 4096, d96 4096 with DkvMidTile from 2048, d128 8192; "Tile-table
// logs"). Every row of a head dim gives the same bits.
constexpr int dkv_long_min_seqlen(int head_dim) { return head_dim == 64 ? 4096 : head_dim == 96 ? 4096 : 8192; }
inline bool dkv_long_rows(int64_t mean_seqlen_q, int64_t mean_seqlen_k, int64_t batch_kv_heads, int num_sms,
                          int long_block_n, int min_seqlen) {
  const int64_t long_ctas = (mean_seqlen_k + long_block_n - 1) / long_block_n * batch_kv_heads;
  return mean_seqlen_q >= min_seqlen && mean_seqlen_k >= min_seqlen && long_ctas >= 2 * int64_t(num_sms);
}

// Short sequences at d96 / d128 (sm90/flash_bwd_dq_short_launch.cuh; dq_short_rows below says when):
// dQ on 64 x 64 tiles, one warpgroup, two CTAs per SM (181-203 registers, 97 KiB of shared memory),
// instead of DqTile's 128 x 128 at one CTA per SM: a short sequence's Q tile has few key blocks, so
// each CTA's prologue and dQ store are a large part of it, and a second CTA's products hide them;
// its last Q tile pads fewer rows (a 136-row sequence: 2 x 128 against 3 x 64). Past a few hundred
// queries the wider tile's products win (the bound below; numbers: "Tile-table logs"). The same
// bits (maxdiff 0: each dQ row's k16 steps over the keys keep their order).
//                                                   BLOCK_M BLOCK_N (warp rows, fast copy) min CTAs/SM
template <int kHeadDim> struct DqShortTile { static constexpr bool kSupported = false; };
template <> struct DqShortTile<96>  : DqTileShape< 64,  64,   16, true,                       2> { static constexpr bool kSupported = true; };
template <> struct DqShortTile<128> : DqTileShape< 64,  64,   16, true,                       2> { static constexpr bool kSupported = true; };

// Whether a backward call takes DqShortTile for its dQ kernel: sequences of at most 512 queries and
// 512 keys on average when causal, 256 when not (a dense call's seqlen_q / seqlen_k; a varlen call's
// total_q / batch and total_k / batch, rounded down: its max_seqlen says little about a packed
// batch of mostly short sequences). The keys too: a dQ CTA visits every key block of its sequence,
// so a few queries against many keys (cross-attention) make long CTAs, where the wide row's products
// win; every measured case had as many keys as queries. Shapes only: no device sync. Either row
// gives the same bits, so a packed call and its sequences alone may differ here.
inline bool dq_short_rows(bool causal, int64_t mean_seqlen_q, int64_t mean_seqlen_k) {
  const int64_t bound = causal ? 512 : 256;
  return mean_seqlen_q <= bound && mean_seqlen_k <= bound;
}

// Forward (sm90/flash_fwd_kernel.cuh): one producer warpgroup (TMA) + kBlockM / 64 consumer
// warpgroups of 64 query rows each (kNWarps = 4 (producer) + kBlockM / 16); FlashAttention-3's
// shapes (../shared/HOPPER.md §1.1; S widths 80 and 112 from primitives/gen_wgmma.py): 3
// consumer warpgroups (32/160 registers) at d64 and d96, 2 (24/240) above. Shared memory (227 KB):
// two Q buffers where they fit beside two K/V stages, then as many K/V stages (2..4) as fit:
// d64 2 x 24 + 4 x 32 KB, d96 2 x 48 + 2 x 48 KB, d128 2 x 32 + 2 x 64 KB, d192 48 + 2 x 84 KB,
// d256 64 + 2 x 80 KB (the kernel's traits compute it). d96 keeps 128-column shared tiles (FA3:
// 192 x 144 with 96 columns; the 128-byte swizzle atom is 64 columns wide), S over its 6 k16 steps
// only, O += P V 96 columns wide (smem_layout.cuh: head_dim_mma); its rows are d64's shape, three
// consumer warpgroups of 64 rows, over 96-key tiles.
// Swept with benchmarks/tune_kernels.py (H200, bf16, N = 1k..16k, causal both;
// docs/PERF_NOTES.md): these rows are the fastest or within 3 % at N >= 2k; d128 non-causal runs
// 128 x 128, not FA3's 128 x 176 (2-5 % slower at every N: one Q buffer instead of two).
// d96 on 192 x 96: three warpgroups take turns over 64-row products, so each hides its softmax
// under two others' instead of one (+7-16 % over 128 x 128 at N >= 4k). The same shape at d128
// (192 x 80: no wider tile within 160 registers) lost 5-11 % at some N, won 5-6 % at others: not taken.
//                                     BLOCK_M BLOCK_N warps Q-in-regs minCTAs
template <> struct FwdTile<64>  : FwdTileShape<192,  128,   16,  false,    1> { static constexpr bool kSupported = true; };
template <> struct FwdTile<96>  : FwdTileShape<192,   96,   16,  false,    1> { static constexpr bool kSupported = true; };
template <> struct FwdTile<128> : FwdTileShape<128,  128,   12,  false,    1> { static constexpr bool kSupported = true; };
template <> struct FwdTile<192> : FwdTileShape<128,  112,   12,  false,    1> { static constexpr bool kSupported = true; };
template <> struct FwdTile<256> : FwdTileShape<128,   80,   12,  false,    1> { static constexpr bool kSupported = true; };

// Long key sequences, non-causal (sm90/flash_fwd_long_launch.cuh; fwd_long_keys below says when):
// 144-key tiles, 11 % fewer key steps than FwdTile's 128, so fewer per-step barrier waits, turns
// and row-max reductions per key: +5 % end to end at non-causal 8k, even at 16k; slower below 8k,
// where the last key block's padding grows and a tile has fewer steps to spread its own costs over.
// Two Q buffers and two K/V stages, as FwdTile<128>; unlike it, the per-warpgroup key ranges
// (FwdKernelTraits::kWarpgroupKeyRanges: 144 keys are not the two warpgroups' 128 rows). Numbers:
// docs/PERF_NOTES.md, "Tile-table logs".
template <int kHeadDim> struct FwdLongTile { static constexpr bool kSupported = false; };
template <> struct FwdLongTile<128> : FwdTileShape<128,  144,   12,  false,    1> { static constexpr bool kSupported = true; };

// Whether a forward call takes FwdLongTile instead of FwdTile: dense (a varlen call's sequences
// are shorter than its max_seqlen_k), non-causal, at least 8192 keys, and the long tiles' key
// padding (the last block's unused keys) at most 0.5 % more than the short ones' (8192, 16384,
// 32768: 0.2 %; 12288: 0.8 %, no).
inline bool fwd_long_keys(bool dense, bool causal, int seqlen_k, int short_block_n, int long_block_n) {
  if (!dense || causal || seqlen_k < 8192) return false;
  const int64_t padded_short = (int64_t(seqlen_k) + short_block_n - 1) / short_block_n * short_block_n;
  const int64_t padded_long = (int64_t(seqlen_k) + long_block_n - 1) / long_block_n * long_block_n;
  return padded_long * 1000 <= padded_short * 1005;
}

// Short causal calls at d128 and d256 (sm90/flash_fwd_short_launch.cuh; fwd_short_causal below says when).
// d128: three consumer warpgroups over 64-key tiles (d64's / d96's shape; 32 / 160 registers: S 32, P 16
// and O 64 per thread), so each warpgroup's softmax runs under two others' products: +2-5 % end to
// end at causal N <= 2048, +19 % on varlen causal sequences of 128..1024; -15 % at causal 8k (the
// bound below). d256: FwdTile's 128 rows over 64-key tiles instead of 80 (fewer masked keys on the
// diagonal, more key steps): +1-5 % at causal N <= 2048, even past it. Numbers: "Tile-table logs".
template <int kHeadDim> struct FwdShortTile { static constexpr bool kSupported = false; };
template <> struct FwdShortTile<128> : FwdTileShape<192,   64,   16,  false,    1> { static constexpr bool kSupported = true; };
template <> struct FwdShortTile<256> : FwdTileShape<128,   64,   12,  false,    1> { static constexpr bool kSupported = true; };
constexpr int kFwdShortCausalMaxSeqlen = 2048;

// Whether a forward call takes FwdShortTile instead of FwdTile: causal, at most
// kFwdShortCausalMaxSeqlen queries: a dense call's seqlen_q, a varlen call's max_seqlen_q. Varlen
// calls take the rule too so that a packed call whose max_seqlen_q is within the bound and each of
// its sequences alone run the same row, bit for bit (flash_attn_varlen_func's contract; 64-key
// tiles round the row sums differently from 128-key ones).
inline bool fwd_short_causal(bool causal, int seqlen_q) {
  return causal && seqlen_q <= kFwdShortCausalMaxSeqlen;
}

// The sm80 forward kernel (sm80/flash_fwd_kernel.cuh) on an sm_90 GPU: the inputs the forward
// above does not take (strides or bases TMA cannot describe, a KV cache) and the forced sm80
// path. Its sm_90a code has more room than its sm_80 / sm_86 code: at d128, 128 x
// 64 had no spills in sm_90a SASS (80 bytes of spills at sm_80 and sm_86, whose row stays 128 x
// 48; since the window's bounds, 8 bytes: one reload per key block in the K prefetch), and
// it ran 2-8 % faster than 128 x 48 on the H200 (docs/PERF_NOTES.md, ninth and eleventh
// sessions). Compiled for sm_90a only (the manifest's
// fwd_sm80 kind, sm90/flash_fwd_sm80_launch.cuh); dispatch.cu takes it on compute capability 9.0.
//                                          BLOCK_M BLOCK_N warps Q-in-regs minCTAs
template <int kHeadDim> struct Sm80FwdTile { static constexpr bool kSupported = false; };
template <> struct Sm80FwdTile<128> : FwdTileShape<128,   64,    4,  false,    2> { static constexpr bool kSupported = true; };

}  // namespace sm90
}  // namespace flash
