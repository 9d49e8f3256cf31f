// Tile configuration of the sm80 forward path (mma.sync + ldmatrix + cp.async), one row per
// compiled head dim. This is THE table: the launch template and the kernel read only it.
// (Backward tiles live in tile_config_bwd.h in the same format.)
//
//   kBlockM     query rows per CTA (the Q tile, loaded once)
//   kBlockN     key/value rows per K/V tile streamed through shared memory
//   kNWarps     warps per CTA; warp w owns query rows [w*kBlockM/kNWarps, (w+1)*kBlockM/kNWarps),
//               i.e. kBlockM/kNWarps/16 m16 mma atoms
//   kStages     K/V pipeline: 1 = FA2 scheme (the one implemented): one K and one V buffer,
//               loads interleaved (V_j lands while S = Q K_j^T runs, K_{j-1} while O += P V_j)
//   kQInRegs    Q's mma A fragments are loaded from shared memory once and kept in registers
//               (only where registers allow; else re-read by ldmatrix each K tile)
//   kMinBlocks  __launch_bounds__ min CTAs per SM (2 for 4-warp CTAs: costs no registers
//               below 255/thread and lets two CTAs overlap each other's softmax and loads)
//
// Starting point: FlashAttention-2's sm80/sm90 mma.sync choices, then narrowed until ptxas
// reports no spills at the 255-register cap (nvcc 13, sm_80 and sm_90a): 4 warps x 32 rows keep
// 2 m16 atoms per warp (K/V fragments reused twice: half the ldmatrix traffic of 16-row warps),
// and kBlockN shrinks where acc_o + S would spill (d128: 128x64 spills 8 B, 128x48 none).
// Measured on the H200 with benchmarks/tune_kernels.py (bf16, 16k tokens, TFLOP/s at N=1024/4096/16384,
// non-causal, 2026-11-29): d128 128x32 305/338/349, 128x48 313/347/362, 128x64 301/328/352;
// d64 128x64 283/314/325, 128x64 Q-in-regs 289/324/329, 128x128 Q-in-regs 272/290/301.
// Shared memory per CTA = (kBlockM + 2*kBlockN) * (kHeadDim + 8) * 2 bytes (rows padded by
// 16 B, no bank conflicts): d32 20 KB, d64 36 KB, d96 39 KB, d128 60 KB, d192 100 KB, d256 132 KB.
#pragma once

namespace flash {

template <int kBlockM_, int kBlockN_, int kNWarps_, int kStages_, bool kQInRegs_, int kMinBlocks_>
struct TileConfig {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kStages = kStages_;
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr int kMinBlocks = kMinBlocks_;
};

template <int kHeadDim>
struct FwdTileConfigSm80;

//                                                  BLOCK_M BLOCK_N warps stages Q-in-regs minCTAs
template <> struct FwdTileConfigSm80<32>  : TileConfig<128,     64,    4,    1,     true,     2> {};
template <> struct FwdTileConfigSm80<64>  : TileConfig<128,     64,    4,    1,     true,     2> {};
template <> struct FwdTileConfigSm80<96>  : TileConfig<128,     32,    4,    1,     false,    2> {};
template <> struct FwdTileConfigSm80<128> : TileConfig<128,     48,    4,    1,     false,    2> {};
template <> struct FwdTileConfigSm80<192> : TileConfig<128,     64,    8,    1,     false,    1> {};
template <> struct FwdTileConfigSm80<256> : TileConfig<128,     64,    8,    1,     false,    1> {};

}  // namespace flash
