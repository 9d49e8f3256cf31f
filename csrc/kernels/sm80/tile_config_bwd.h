// Tile configuration of the sm80 backward path (mma.sync + ldmatrix + cp.async), one row per
// compiled head dim. This is THE backward table: flash_bwd_launch.cuh and the kernels read only it.
//
// dK/dV kernel (flash_bwd_dkv_kernel.cuh), one CTA per K/V tile of kDkvBlockN rows:
//   kDkvBlockN    key/value rows per CTA (K_j, V_j stay resident in shared memory)
//   kDkvBlockM    query rows per streamed Q_i / dO_i tile (2-stage cp.async pipeline)
//   kDkvColSplit  warps sharing one 16-row slice of K_j: each owns kHeadDim/kDkvColSplit columns
//                 of the dK/dV accumulators (1 for d <= 128; 2 above, where 16 rows x d x 2 fp32
//                 accumulators would not fit one warp's registers). Split warps recompute the
//                 same S^T / dP^T slice, so P^T and dS^T never leave registers.
//   kDkvWarpRows  K rows per warp: 16 (one m16 atom) or 32 (two atoms: each Q / dO B fragment
//                 feeds two mma, half the shared-memory traffic per FLOP; dK/dV accumulators take
//                 kDkvWarpRows * d / (16 * kDkvColSplit) registers, so d <= 64 only)
//   warps = kDkvBlockN / kDkvWarpRows * kDkvColSplit
// dQ kernel (flash_bwd_dq_kernel.cuh), one CTA per Q tile of kDqBlockM rows:
//   kDqBlockM     query rows per CTA (Q_i, dO_i resident), warps = kDqBlockM / kDqWarpRows
//   kDqBlockN     key/value rows per streamed K_j / V_j tile (2-stage cp.async pipeline)
//   kDqWarpRows   Q rows per warp: 16 or 32 (two m16 atoms sharing every K / V B fragment; P is
//                 then rounded to the element type before dP, see flash_bwd_dq_kernel.cuh)
//
// Shared memory (rows padded by 8 elements = 16 B, conflict-free ldmatrix), fp16/bf16:
//   dkv = (2*kDkvBlockN + 4*kDkvBlockM) * (d + 8) * 2 B + 16*kDkvBlockM B
//   dq  = (2*kDqBlockM + 4*kDqBlockN)   * (d + 8) * 2 B
//   d32  dkv  31 KB dq  40 KB     d64  dkv  55 KB dq  72 KB     d96  dkv 105 KB dq  78 KB
//   d128 dkv 137 KB dq 102 KB     d192 dkv 151 KB dq 150 KB     d256 dkv 133 KB dq 132 KB
// Registers (ptxas, sm_90a / sm_80, 255 max): the d64 / d128 kernels use 213-255 per thread with
// no spills inside the main loops (the few spilled bytes of d96-d256 sit in prologue/epilogue).
// Every row fits sm_80's 163 KB and sm_90's 227 KB (kMaxSmemSm80 below is asserted).
// kDkvBlockM and kDqBlockM divide 128 so the (b, h, seqlen_q_rounded) workspaces cover every tile.
#pragma once

namespace flash {

template <int kDkvBlockN_, int kDkvBlockM_, int kDkvColSplit_, int kDqBlockM_, int kDqBlockN_,
          int kDkvWarpRows_ = 16, int kDqWarpRows_ = 16, bool kDkvFastCopy_ = true, bool kDqFastCopy_ = true>
struct BwdTileConfig {
  static constexpr int kDkvBlockN = kDkvBlockN_;
  static constexpr int kDkvBlockM = kDkvBlockM_;
  static constexpr int kDkvColSplit = kDkvColSplit_;
  static constexpr int kDqBlockM = kDqBlockM_;
  static constexpr int kDqBlockN = kDqBlockN_;
  static constexpr int kDkvWarpRows = kDkvWarpRows_;
  static constexpr int kDqWarpRows = kDqWarpRows_;
  static constexpr bool kDkvFastCopy = kDkvFastCopy_;  // predicate-free whole-tile copies in the main loop
  static constexpr bool kDqFastCopy = kDqFastCopy_;
};

// Largest opt-in dynamic shared memory per block on sm_80 (A100): 163 KB.
constexpr int kMaxSmemSm80 = 163 * 1024;

template <int kHeadDim>
struct BwdTileConfigSm80;

// Measured on the H200 with benchmarks/tune_kernels.py (bf16, 16k tokens, 2026-11-29): 32 rows per
// warp (every ldmatrix'd B fragment feeds two mma) made the d64 dK/dV kernel 12-17 % faster and the
// dQ kernels 25-30 % faster (d64 128x64, d128 128x32) than 16 rows; at d128 the dK/dV accumulators
// of 32 rows do not fit the registers, and other dK/dV tile shapes were within +-2 %.
// Fast copy (predicate-free whole-tile cp.async in the main loop, primitives/tile_copy.cuh), same
// harness, on vs off at N = 16384 non-causal: dQ d64 +3 %, d128 +6 %, d256 +4 %; dK/dV d256 +3 %;
// dK/dV d32 -6 %, d64 -10 %, d128 -1 % (those kernels sit at 255 registers and the second copy
// loop pushes spills into the main loop), so it is off there. d96 and d192 have no fast path
// (12 and 24 chunks per row do not divide the thread count), so their flags change nothing.
// Columns: dK/dV BLOCK_N, BLOCK_M, colsplit | dQ BLOCK_M, BLOCK_N | warp rows dK/dV, dQ | fast copy dK/dV, dQ
template <> struct BwdTileConfigSm80<32>  : BwdTileConfig<128,  32, 1, 128,  64, 32, 32, false, true> {};
template <> struct BwdTileConfigSm80<64>  : BwdTileConfig<128,  32, 1, 128,  64, 32, 32, false, true> {};
template <> struct BwdTileConfigSm80<96>  : BwdTileConfig<128,  64, 1, 128,  32, 16, 32> {};
template <> struct BwdTileConfigSm80<128> : BwdTileConfig<128,  64, 1, 128,  32, 16, 32, false, true> {};
template <> struct BwdTileConfigSm80<192> : BwdTileConfig< 64,  64, 2,  64,  64> {};
template <> struct BwdTileConfigSm80<256> : BwdTileConfig< 64,  32, 2,  64,  32> {};

}  // namespace flash
