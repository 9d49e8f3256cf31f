// Tile configuration of the sm80 path (mma.sync + ldmatrix + cp.async), one row per compiled head
// dim and kernel kind (shapes: kernels/common/tile_shapes.h). This is THE sm80 table: the launch
// templates and the kernels read only it. Measurement history: docs/PERF_NOTES.md.
//
// Forward (flash_fwd_kernel.cuh): FlashAttention-2's sm80/sm90 mma.sync choices, narrowed until
// ptxas reports no spills at the 255-register cap (nvcc 13, sm_80 and sm_90a): 4 warps x 32 rows
// keep 2 m16 atoms per warp (K/V fragments reused twice: half the ldmatrix traffic of 16-row
// warps), and kBlockN shrinks where acc_o + S would spill (d128: 128x64 spills 80 B at sm_80 /
// sm_86 with nvcc 13.0, 128x48 none). On sm_90 the kernel runs the sm90 table's Sm80FwdTile row
// instead where there is one (d128: 128x64, no spills in sm_90a code).
// kMinBlocks 2 for 4-warp CTAs costs no registers below 255/thread and lets two CTAs overlap each
// other's softmax and loads. Shared memory = (kBlockM + 2 kBlockN) * (d + 8) * 2 B: d32 20 KB,
// d64 36 KB, d96 39 KB, d128 60 KB, d192 100 KB, d256 132 KB.
//
// dK/dV (flash_bwd_dkv_kernel.cuh), one CTA per K/V block: kSplit warps share one K row slice,
// each owning d / kSplit dK/dV columns (1 for d <= 128; 2 above, where 16 rows x d x 2 fp32
// accumulators would not fit one warp's registers; split warps recompute the same S^T / dP^T
// slice, so P^T and dS^T never leave registers). 32 K rows per warp (two m16 atoms: each Q / dO B
// fragment feeds two mma) fits the registers for d <= 64 only. warps = kBlockN / kWarpRows * kSplit.
// dQ (flash_bwd_dq_kernel.cuh), one CTA per Q tile: warps = kBlockM / kWarpRows; with 32 rows per
// warp P is rounded to the element type before dP.
// Fast copy (predicate-free whole-tile cp.async in the main loop) is off where the kernel sits at
// 255 registers and the second copy loop pushed spills into the main loop (dK/dV d32-d128); d96 and
// d192 have no fast path whatever their flag says (12 and 24 chunks per row do not divide the thread
// count: primitives/tile_copy.cuh compiles the branch out).
// Shared memory (rows padded by 16 B), fp16/bf16:
//   dkv = (2 kBlockN + 4 kBlockM) * (d + 8) * 2 B + 24 kBlockM B,  dq = (2 kBlockM + 4 kBlockN) * (d + 8) * 2 B
// Every row fits sm_80's 163 KB (asserted in the launch templates); kBlockM of the backward
// kernels divides 128 so the (b, h, seqlen_q_rounded) workspaces cover every tile.
#pragma once

#include "kernels/common/tile_shapes.h"

namespace flash {
namespace sm80 {

// Largest opt-in dynamic shared memory per block on sm_80 (A100): 163 KB.
constexpr int kMaxSmem = 163 * 1024;

template <int kHeadDim> struct FwdTile;
template <int kHeadDim> struct DkvTile;
template <int kHeadDim> struct DqTile;

//                                      BLOCK_M BLOCK_N warps Q-in-regs minCTAs
template <> struct FwdTile<32>  : FwdTileShape<128,  64,    4,   true,    2> {};
template <> struct FwdTile<64>  : FwdTileShape<128,  64,    4,   true,    2> {};
template <> struct FwdTile<96>  : FwdTileShape<128,  32,    4,   false,   2> {};
template <> struct FwdTile<128> : FwdTileShape<128,  48,    4,   false,   2> {};
template <> struct FwdTile<192> : FwdTileShape<128,  64,    8,   false,   1> {};
template <> struct FwdTile<256> : FwdTileShape<128,  64,    8,   false,   1> {};

// The forward's attention-dropout twin (params.dropout_p > 0; flash_fwd_launch.cuh), on every GPU:
// one m16 atom per warp (64-row tiles), so the mask's Philox calls (primitives/philox.cuh: one per two
// 2 x 2 units) fit beside S and O in registers: with 32-bit randoms (one call per unit) the 128 x 64
// row's dropout twin spilled 408 B at d128 (sm_90a), the 128 x 48 one 164 B (sm_80).
template <int kHeadDim>
struct FwdDropoutTile : FwdTileShape<64, (kHeadDim > 128 ? 32 : 64), 4, (kHeadDim <= 64), 2> {};

//                                      BLOCK_N BLOCK_M split warp-rows fast-copy
template <> struct DkvTile<32>  : DkvTileShape<128,  32,    1,    32,    false> {};
template <> struct DkvTile<64>  : DkvTileShape<128,  32,    1,    32,    false> {};
template <> struct DkvTile<96>  : DkvTileShape<128,  64,    1,    16,    true> {};
template <> struct DkvTile<128> : DkvTileShape<128,  64,    1,    16,    false> {};
template <> struct DkvTile<192> : DkvTileShape< 64,  64,    2,    16,    true> {};
template <> struct DkvTile<256> : DkvTileShape< 64,  32,    2,    16,    true> {};

//                                     BLOCK_M BLOCK_N warp-rows fast-copy
template <> struct DqTile<32>  : DqTileShape<128,  64,    32,    true> {};
template <> struct DqTile<64>  : DqTileShape<128,  64,    32,    true> {};
template <> struct DqTile<96>  : DqTileShape<128,  32,    32,    true> {};
template <> struct DqTile<128> : DqTileShape<128,  32,    32,    true> {};
template <> struct DqTile<192> : DqTileShape< 64,  64,    16,    true> {};
template <> struct DqTile<256> : DqTileShape< 64,  32,    16,    true> {};

// Split-KV forward (flash_fwd_splitkv_kernel.cuh; decode and short query chunks against a KV
// cache): memory-bound, so a row is sized by bytes in flight per SM, not by FLOPs. 4 warps, each
// kBlockN / 4 keys of every tile (16 or 32). A tile carries ~32 KB of K+V (d64: 128 keys, d128:
// 64), kStages tiles in flight per CTA while it waits (kStages - 1 while it computes); with
// d <= 128 a CTA fits 99 KB (the sm_86/89 opt-in limit) and three fit an H100/H200 SM (228 KB;
// d96's 81 KB CTAs two, as its row says), so several CTAs per SM hide each other's pipeline fill
// and merge. K/V reads are L2 evict-first (read once: they replace their own lines, not other data
// or dirty lines), a quarter of the lines only where the reads exceed twice the L2
// (params.kv_stream_exceeds_l2). On sm_90 the d64 / d128 / d256 rows load by TMA boxes into
// 128-byte-swizzled tiles, with the maps' L2 promotion at 128 bytes (sm_80 builds, and inputs TMA
// cannot describe, run the cp.async twin): with the evict-first quarter, issue 14's decode cases
// +1-13 % over cp.async at d128; 3-4 stages, 32- or 128-key tiles, 2 or 8 warps, per-row bulk
// copies: within 3 % or slower. d32 / d96 / d192 keep cp.async (TMA would pad their tiles to
// 64-column blocks; by analogy, not measured). Numbers: docs/PERF_NOTES.md, "Tile-table logs".
// Shared memory = (16 + 2 kStages kBlockN) (d + 8) 2 B (a TMA row: the larger of that and its
// swizzled ring + 1 KB of alignment): d32 61 KB, d64 74 KB, d96 81 KB, d128 72 KB, d192 106 KB,
// d256 140 KB.
template <int kHeadDim> struct SplitKvTile;

//                                              BLOCK_N warps stages Q-in-regs minCTAs evict-first TMA
template <> struct SplitKvTile<32>  : SplitKvTileShape<128,   4,    3,    true,     3,     true,    false> {};
template <> struct SplitKvTile<64>  : SplitKvTileShape<128,   4,    2,    true,     3,     true,    true> {};
template <> struct SplitKvTile<96>  : SplitKvTileShape< 64,   4,    3,    false,    2,     true,    false> {};
template <> struct SplitKvTile<128> : SplitKvTileShape< 64,   4,    2,    false,    3,     true,    true> {};
template <> struct SplitKvTile<192> : SplitKvTileShape< 64,   4,    2,    false,    2,     true,    false> {};
template <> struct SplitKvTile<256> : SplitKvTileShape< 64,   4,    2,    false,    1,     true,    true> {};

}  // namespace sm80
}  // namespace flash
