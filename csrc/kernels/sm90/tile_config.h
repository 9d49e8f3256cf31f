// Tile configuration of the Hopper (sm90: wgmma) path, forward and backward, one row per head dim it
// covers. This is THE sm90 table (shapes: kernels/common/tile_shapes.h): the sm90 launch templates
// (flash_fwd_launch.cuh, the end of flash_bwd_{dkv,dq}_kernel.cuh) read only it.
//
// dK/dV kernel (sm90/flash_bwd_dkv_kernel.cuh), one CTA per K/V tile of kDkvBlockN rows
// (kDkvBlockN / 64 warpgroups); Q_i / dO_i tiles of kDkvBlockM rows stream through kStages
// shared-memory stages (TMA; the cp.async twin uses two), and each is processed as kSplit parts
// whose products are queued together. dQ kernel (sm90/flash_bwd_dq_kernel.cuh), one CTA per Q tile
// of kDqBlockM rows (kDqBlockM / 64 warpgroups); K_j / V_j tiles of kDqBlockN rows stream through
// kStages stages.
//
// Registers per thread (fp32 accumulators): dK/dV kernel d/2 * 2 (dK, dV) + kDkvBlockM/2 * 2
// (S^T, dP^T) + kDkvBlockM/4 (P^T, dS^T as 16-bit A operands), less with the register diets of
// common/tile_shapes.h (DpInS: one of S^T, dP^T; PSmem: no P^T across the products); dQ kernel d/2 +
// kDqBlockN/2 * 2 + kDqBlockN/4. Shared memory, 16-bit elements (d: the padded 64-column width):
//   dkv = 2 * kDkvBlockN * d * 2 B + kStages * (2 * kDkvBlockM * d * 2 B + 12 * kDkvBlockM B)
//         (+ kDkvBlockN * kDkvBlockM * 2 B for P^T in PSmem rows)
//   dq  = 2 * kDqBlockM  * d * 2 B + kStages *  2 * kDqBlockN  * d * 2 B
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

// Measured on the H200 with benchmarks/tune_kernels.py (bf16, 16k tokens, 2048/hdim heads, per-kernel
// TFLOP/s at N = 1024 / 4096 / 16384; docs/PERF_NOTES.md has the full table). After the
// 2026-11-29 instruction diet (uniform-branch masks, packed dS, predicate-free whole-tile copies):
//   d64  dK/dV 128x64 (one warpgroup, two CTAs per SM) 474 / 525 / 505 non-causal, 372 / 484 / 497
//        causal; dQ 64x64 (one warpgroup) 471 / 479 / 485 and 379 / 450 / 448, against
//        394 / 396 / 442 and 305 / 334 / 429 for 128x128.
//   d128 dK/dV 64x128 444 / 484 / 502 and 308 / 433 / 492; dQ 128x64 463 / 517 / 516 and
//        314 / 461 / 518. dQ 64x64 measured 516 / 538 / 503 and 372 / 517 / 534 per kernel, but end
//        to end (python -m flash_attn_ext.benchmark, same session) it was +2-5 % only for causal
//        N <= 2048 in bf16, -1 to -2 % at N >= 8192 and -2 to -3 % in fp16: kept 128x64 (now
//        128x128, below).
// Independent one-warpgroup CTAs sharing an SM overlap one CTA's softmax math with the other's
// wgmma; a third buffer cost that second CTA its shared memory and was slower everywhere, and
// split 2 (queueing two parts of the Q tile together) was 3-8 % slower at d64 (docs/PERF_NOTES.md).
// 2026-12-01, the streamed tiles by TMA (BwdStages) with the refill under the next tile's first
// products (tune_kernels.py, per-kernel matmul TFLOP/s at N = 1k / 4k / 8k / 16k, non-causal;
// docs/PERF_NOTES.md): d128 dK/dV 4 stages 453 / 507 / 523 / 530 (2 stages 450 / 487 / 497 / 527;
// cp.async 428 / 465 / 487 / 492), dQ 2 stages 507 / 615 / 606 / 618 (cp.async 442 / 467 / 468 /
// 487; 3 and 4 stages up to 5 % slower); d64 dK/dV 450 / 497 / 480 / 486, dQ 488 / 558 / 542 / 512 (the
// dK/dV rows 64x64 and 64x128 with 3-4 stages 25-35 % slower); d96 dK/dV 3 stages 373 / 410 / 424 /
// 427 (2 stages 372 / 414 / 411 / 423). One CTA per SM at d96/d128 (registers), so the dK/dV stages
// cost nothing; d64's two CTAs per SM leave room for two (those were the 128-key rows, DkvLongTile now).
// 2026-12-04: d96 / d128 dK/dV on d64's shape of CTA, one warpgroup over 64 keys, two CTAs per SM
// (238 registers, 255 in the cp.async twin; 97 KiB of shared memory with two stages), so one CTA's prologue (K_j, V_j and the
// first Q / dO tiles) and epilogue (the dK / dV stores) run under the other's products; the
// 128-key rows measured above are DkvLongTile's now (long sequences: dkv_long_rows). Tune harness (H200, bf16, one
// binary, per-kernel matmul TFLOP/s, 64 x 64 against 64 x 128 / 4 stages; docs/PERF_NOTES.md):
// d128 N = 136 / 512 / 2048 / 8192 / 16384 142 / 428 / 566 / 577 / 617 against 109 / 391 / 552 /
// 575 / 602, causal 87 / 305 / 509 / 568 / 593 against 63 / 268 / 470 / 566 / 614; d96 (against
// 64 x 128 / 3 stages) causal 71 / 253 / 434 / 515 / 509 against 53 / 224 / 417 / 506 / 515,
// non-causal 16384 460 against 527. The same bits (maxdiff 0).
//                                     BLOCK_N BLOCK_M split (sm80: warp rows, fast copy) stages
template <> struct DkvTile<64>  : DkvTileShape< 64,  128,    1> { static constexpr bool kSupported = true; };
template <> struct DkvTile<128> : DkvTileShape< 64,   64,    1,   16,   true,    2> { static constexpr bool kSupported = true; };
// dQ d64: three one-warpgroup CTAs per SM (168 registers per thread at most, no spills). dQ d96 /
// d128: 128-key blocks (2026-12-01, fifteenth session; tune_kernels.py, 4 rounds in one binary,
// per-kernel matmul TFLOP/s at N = 1k / 4k / 8k / 16k): d128 128x128 572 / 652 / 645 / 665, causal
// 426 / 591 / 623 / 673, against 128x64's 525 / 613 / 581 / 603 and 388 / 560 / 556 / 577 (half
// the key steps, each S / dP wgmma twice as wide; 255 registers, no spills in the TMA kernel, 8
// bytes around the loop in its cp.async twin; the same bits: dQ's k16 steps keep their order);
// 64x128 434 / 485 / 494 / 539. d64 keeps 64x64: 575 / 544 / 550 at N >= 4k against 509 / 534 /
// 521 for 128x128.
//                                    BLOCK_M BLOCK_N (warp rows, fast copy: sm80 only) min CTAs/SM
template <> struct DqTile<64>  : DqTileShape< 64,  64,   16, true,                            3> { static constexpr bool kSupported = true; };
template <> struct DqTile<128> : DqTileShape<128, 128> { static constexpr bool kSupported = true; };

// d96 runs d128's rows with 128-column shared tiles (S over its 6 k16 steps; as the forward does)
// and 96-column dK, dV and dQ products (smem_layout.cuh: head_dim_mma; tune harness, 8 rounds
// against the 128-column products: dK/dV +6.1 % (N <= 2k) / +7.2 % (N >= 4k), dQ +1.7 / +1.0 %).
// Its dQ runs 128-key blocks as d128's: 513 / 594 / 583 at N = 1k / 4k / 16k, causal 375 / 533 /
// 597, against 412 / 502 / 464 and 313 / 424 / 482 for 128x64 (with the 96-column products); the
// dK/dV stages 2 / 3 / 4 within 4 % of each other.
// d192 / d256: dK and dV of 64 K rows (d registers per thread) leave no room for S^T and dP^T in
// one warpgroup, so both kernels split their two warpgroups by role over a 64 x 64 tile pair
// (Roles<>, flash_bwd_{dkv,dq}_roles_kernel.cuh): one holds dV (or dQ's first columns),
// the other dK (dQ's last columns), d / 2 registers each. Shared memory at d256: dK/dV K, V and two
// stages of Q, dO (64 x d each) 192 KB + 2 x 16 KB (P^T) + 1.5 KB (row statistics) = 225.5 KB; dQ
// Q, dO and two stages of K, V 192 KB + 8 KB (dS) + 16 KB (P) = 216 KB. Measured (tune_kernels.py,
// bf16, N = 1024 / 4096 / 16384, per-kernel matmul TFLOP/s; docs/PERF_NOTES.md): d256 dK/dV
// 439 / 477 / 498, causal 348 / 452 / 469; dQ 427 / 492 / 493, causal 336 / 425 / 477 (TMA stages;
// their cp.async twins, which strides TMA cannot describe run (varlen calls did until
// smem_layout.cuh's zero_stage_tail), 8-19 % slower). 2026-12-01, the dK/dV refill under
// the S^T / dP^T products: 447 / 486 / 521, causal 368 / 463 / 502.
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
// overlap another's products. Tune harness (H200, bf16, one binary, 4 rounds, median per-kernel
// matmul TFLOP/s at N = 1k / 4k / 8k / 16k; docs/PERF_NOTES.md, fifteenth session): 468 / 564 /
// 567 / 574, causal 344 / 503 / 554 / 576, against DkvTile<64>'s 499 / 543 / 546 / 532 and 362 /
// 526 / 517 / 531. The same bits (maxdiff 0): each K row's sum over the Q tiles runs in the same
// order in either row. End to end (seventeenth session, the benchmark with
// FLASH_ATTN_EXT_SM90_BWD_LONG_ROWS=0 and unset, 3 rounds each): the backward +2.9-4.7 % at N = 8k
// / 16k / 32k. Three Q / dO stages read +3-5 % over two at 8k / 16k in the harness (504 / 531 / 564
// / 567 / 568 at N = 2k..32k, causal 425 / 475 / 524 / 563 / 577, against 515 / 523 / 549 / 538 /
// 572 and 427 / 470 / 504 / 550 / 570), but their end-to-end gain over the short row was 1-2 points
// smaller (+2.1-3.4 %, another machine). Both timed in one session (twenty-first, scripts/gpu_ab.sh,
// 3 rounds, bf16 hd64 backward 8k / 16k, causal both): three stages over two 0.993-1.007, median
// 1.000: two stages kept.
// d128: the 128-key row that was DkvTile's until 2026-12-04 (two warpgroups of 64 K rows, one CTA
// per SM, four stages), within +-3 % of the 64-key row at 8192 and 16384 queries.
// d96: 192 keys on three warpgroups of 64 K rows (384 threads, 168 registers per thread at one CTA
// per SM), 64-query tiles, two stages, with both register diets of tile_shapes.h (DpInS: dP^T in
// S^T's registers; PSmem: P^T through a shared tile per warpgroup, dV as an SS product): 158-168
// registers, no spills; ~190 would be needed with S^T, dP^T, P^T and dS^T live beside dK and dV.
// Each warpgroup's softmax math then runs under two others' products, and a Q / dO tile serves
// 192 keys. Shared memory: K, V 2 x 48 KB (128-column tiles), 2 stages of Q, dO 64 KB, P^T 3 x 8 KB,
// statistics 1.5 KB: 185.5 KB. Tune harness (twenty-eighth session, H100, bf16, one binary,
// sustained 300 ms x 3 rounds, per-kernel matmul TFLOP/s at N = 4k / 8k / 16k; docs/PERF_NOTES.md),
// the best of the 64 x 64 row and the previous long row (64 x 128, 3 stages) -> this row:
// non-causal 511.8 -> 504.9 / 513.7 -> 533.5 / 523.9 -> 540.1, causal 452.4 -> 460.9 / 485.1 ->
// 498.6 / 506.0 -> 523.5 (the previous long row with 3 stages: 522.6 at non-causal 4k); at 2k
// (one run) causal 449 -> 403, non-causal 518 -> 535: dkv_long_min_seqlen is 4096. Its soft-capping
// twins spill (64-72 bytes) and its dropout twins serialize their wgmmas (C7512) and spill on 168
// registers, so those calls stay on DkvTile<96> (kSoftcapDropout = false; dispatch.cu).
template <int kHeadDim> struct DkvLongTile { static constexpr bool kSupported = false; };
template <> struct DkvLongTile<64>  : DkvTileShape<128, 128, 1> { static constexpr bool kSupported = true; };
template <> struct DkvLongTile<96>  : PSmem<DpInS<DkvTileShape<192, 64, 1, 16, true, 2>>> {
  static constexpr bool kSupported = true;
  static constexpr bool kSoftcapDropout = false;
};
template <> struct DkvLongTile<128> : DkvTileShape<128,  64, 1, 16, true, 4> { static constexpr bool kSupported = true; };

// Middle lengths at d96 (sm90/flash_bwd_dkv_mid_launch.cuh; dispatch.cu takes it by dkv_long_rows
// with this row's kBlockN and kDkvMidMinSeqlen, where DkvLongTile is not taken): the 128-key row
// that was DkvLongTile<96>'s until the 192-key row (two warpgroups of 64 K rows sharing each
// 64-query Q / dO tile, one CTA per SM, three stages), so that calls of 2048..4095 queries and keys
// keep it: its gain over the short row from 2048 is the fourteenth session's (below: 1.013 / 0.999
// at 2k, a second run 1.025 / 1.017), and with it gone the twenty-ninth session's end-to-end A/B
// against main (H100, bf16 d96 backward; the 192-key row from 4096) read 2k -3.7 % / causal -1.8 %
// (those calls on the short row), against 4k +6.4 / +4.3 %, 8k +2.1 / +1.5 %, 16k +7.4 / +6.5 %;
// with this row back, 2k against main 1.024 / 0.984 (the same row, P^T now rounded; spreads 1-4 %).
// From 4096 it takes the calls whose grid has fewer than 2 of DkvLongTile<96>'s 192-key CTAs per SM
// but 2 of these, and the soft-capping and dropout calls (DkvLongTile<96> has no such twins; here
// they are main's long-row twins, SASS unchanged). kRoundedPt as DkvTile<96>: dS^T from the rounded
// P^T in the plain / window / ALiBi twins, the fp32 P^T in the soft-capping and dropout twins (as
// DkvTile<96>'s), so all three rows give the same bits. ptxas (sm_90a, bf16 / fp16, TMA / cp.async
// twins): 191-253 registers of 255, no spills, no serialized wgmmas (C7512 / C7515), the
// soft-capping and dropout twins included.
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
// would leave half of an H200's SMs without one). The minimum per head dim, end to end (2026-12-04,
// fourteenth session: a build whose rule starts at 1024, the benchmark with
// FLASH_ATTN_EXT_SM90_BWD_LONG_ROWS=0 and unset, 2 rounds each, bf16, long / short row at N = 1k /
// 2k / 4k, non-causal and causal): d64 0.987 / 1.004 / 1.022 and 0.986 / 1.018 / 1.023 (4096); d96
// 1.003 / 1.013 / 1.018 and 0.973 / 0.999 / 1.016, in a second run at 2k / 4k / 8k 1.025 / 1.023 /
// 1.019 and 1.017 / 1.009 / 1.034 (2048); d128 0.994 / 0.986 / 1.000 and 0.976 / 0.992 / 1.010
// (8192, where the tune harness had it within 3 %). Varlen packs of two 16384-token sequences: d96
// +2.8 / +3.5 %, d128 +0.6 / +3.1 % (the 128-key d96 row then). d96's 192-key row (twenty-eighth
// session's harness, above): +2-4 % over the previous rows' best at 8k and 16k and causal 4k
// (non-causal 4k -1 %), but 10 % behind at causal 2k, so 4096 (end to end: DkvMidTile's comment
// above), the 128-key row keeping 2048..4095 (DkvMidTile). Every row of a head dim gives the same
// bits.
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
// queries the wider tile's products win. Tune harness (H200, bf16, one binary, per-kernel matmul
// TFLOP/s, 64 x 64 against 128 x 128; 2026-12-04, docs/PERF_NOTES.md): d128 causal N = 136 / 256 /
// 512 / 1024 / 2048 90 / 209 / 317 / 424 / 493 against 61 / 194 / 305 / 430 / 539, non-causal 141 /
// 320 / 424 / 527 against 105 / 339 / 459 / 571; d96 causal 136 / 512 72 / 260 against 49 / 257.
// The same bits (maxdiff 0: each dQ row's k16 steps over the keys keep their order).
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
// d96 on 192 x 96 (2026-12-03, one binary, 3 rounds, median TFLOP/s at N = 1k / 4k / 8k / 16k):
// 460 / 623 / 596 / 601 non-causal, 308 / 537 / 574 / 594 causal, against 128 x 128's 462 / 578 /
// 539 / 562 and 293 / 478 / 511 / 514 (192 x 112 and 192 x 80 in between). Three warpgroups take
// turns over 64-row products, so each hides its softmax under two others' instead of one. The
// same shape at d128 (192 x 80; P and S beside O's 64 registers leave no wider tile within 160
// registers: 192 x 96 serializes its wgmmas) lost 5-11 % to 128 x 128 at non-causal 4k / 16k and
// causal 8k / 16k, won 5-6 % at non-causal 8k and causal 4k, even at 1k: not taken.
//                                     BLOCK_M BLOCK_N warps Q-in-regs minCTAs
template <> struct FwdTile<64>  : FwdTileShape<192,  128,   16,  false,    1> { static constexpr bool kSupported = true; };
template <> struct FwdTile<96>  : FwdTileShape<192,   96,   16,  false,    1> { static constexpr bool kSupported = true; };
template <> struct FwdTile<128> : FwdTileShape<128,  128,   12,  false,    1> { static constexpr bool kSupported = true; };
template <> struct FwdTile<192> : FwdTileShape<128,  112,   12,  false,    1> { static constexpr bool kSupported = true; };
template <> struct FwdTile<256> : FwdTileShape<128,   80,   12,  false,    1> { static constexpr bool kSupported = true; };

// Long key sequences, non-causal (sm90/flash_fwd_long_launch.cuh; fwd_long_keys below says when):
// 144-key tiles, 11 % fewer key steps than FwdTile's 128, so fewer per-step barrier waits, turns
// and row-max reductions per key. Tune harness (H200, bf16, 6 runs each, median TFLOP/s 128 x 128
// -> 128 x 144): non-causal N = 8k 708 -> 727, 16k 674 -> 693 (a run before: 691 -> 709, 677 ->
// 690; a third, noisier run read 678 -> 651, 664 -> 656), but 4k 695 -> 679 and 1k 561 -> 512,
// where the last key block's padding grows (4096 keys in 29 x 144 = 4176) and a tile has fewer
// steps to spread its own costs over; causal within noise (8k 666 -> 658). End to end (python -m
// flash_attn_ext.benchmark, one build, FLASH_ATTN_EXT_SM90_FWD_LONG_KEYS=0 and unset alternated
// three times): 8k 683 -> 719 (+5 %), 16k 660 -> 662. Two Q buffers and two K/V stages, as
// FwdTile<128>; unlike it, the per-warpgroup key ranges (FwdKernelTraits::kWarpgroupKeyRanges:
// 144 keys are not the two warpgroups' 128 rows), measured with them.
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
// and O 64 per thread), so each warpgroup's softmax runs under two others' products. Tune harness
// (H200, bf16, one binary, 3 rounds, median TFLOP/s; docs/PERF_NOTES.md, 2026-12-03 second
// session): causal N = 1k 381 against FwdTile's 353 (+8 %), 4k 582 / 588, 8k 543 / 641 (-15 %);
// non-causal 1k 486 / 483, 4k 520 / 622. Causal N = 512 / 1024 / 1536 / 2048 / 3072 (2026-12-03,
// third session, 2 runs): 252 / 378 / 470 / 522 / 582 against 246 / 369 / 445 / 506 / 575 (+2.5 / +2.4
// / +5.6 / +3.2 / +1.2 %); end to end with the knob (bf16 and fp16, 2 rounds) +2 to +5 % at N <= 2048.
// Varlen (issue 14's 64 causal sequences of 128..1024, max_seqlen_q 1024; knob 0 -> on, two rounds,
// 2026-12-03, fourth session): 147 / 146 -> 175 / 175 TFLOP/s (+19 %).
// d256: FwdTile's 128 rows over 64-key tiles instead of 80 (fewer masked keys on the diagonal,
// more key steps). Tune harness (2026-12-03, third session, 2 runs): causal N = 512 / 1024 / 1536 /
// 2048 / 3072 292-295 / 435-437 / 495 / 591-594 / 610-612 against 287-290 / 418-421 / 472-488 /
// 585-587 / 611-616 (+1 to +4 % at N <= 2048, even past it); non-causal even or lower. End to end
// (knob 0 -> on, two rounds, bf16 / fp16): causal N = 512 +5 %, 1024 +3-5 %, 1536 / 2048 +1-2 %,
// 3072 (past the bound) even; varlen causal 192 -> 200 (+4 %).
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
