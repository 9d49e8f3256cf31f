// The tile-config shapes, one per kernel kind, shared by every arch path: an arch's table
// (csrc/kernels/<arch>/tile_config.h) is one row of each shape per head dim, and the kernels and
// launch templates are templated on the row (the tuning harness, benchmarks/tune_kernels.cu,
// passes other rows of the same shapes).
#pragma once

namespace flash {

// Forward: one CTA per Q tile of kBlockM rows, K/V tiles of kBlockN rows streamed.
//   kNWarps     warps per CTA (sm80: warp w owns rows [w kBlockM/kNWarps, +kBlockM/kNWarps))
//   kQInRegs    Q's mma A fragments kept in registers across the K/V loop
//   kMinBlocks  __launch_bounds__ minimum CTAs per SM
template <int kBlockM_, int kBlockN_, int kNWarps_, bool kQInRegs_, int kMinBlocks_>
struct FwdTileShape {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr int kMinBlocks = kMinBlocks_;
};

// dK/dV: one CTA per K/V block of kBlockN rows (resident), Q / dO tiles of kBlockM rows streamed.
//   kSplit      sm80: warps sharing one K row slice, each owning kHeadDim / kSplit dK/dV columns;
//               sm90: parts of the Q tile whose products are queued together
//   kWarpRows   sm80: K rows per warp (16 or 32)
//   kFastCopy   sm80: predicate-free whole-tile copies in the main loop
//   kRoles      sm90: false for a row of this shape; Roles<row> sets it (below)
//   kStages     sm90: Q / dO stages of the TMA ring (the cp.async twin uses two)
// and, set by the wrappers below or by a table row itself (sm90 rows kernel only):
//   kDpInS, kPSmem   DpInS<row>, PSmem<row> (below)
//   kRoundedPt       dS^T = P^T o (dP^T - D) takes the Element-rounded P^T (dV's A operand) in the
//                    twins without soft-capping and dropout, as a DpInS / PSmem row of the same head
//                    dim computes it: set on the short row whose long row is one (and on a row
//                    between them), so that a call on either side of the rows' thresholds gives
//                    the same bits
//   kSoftcapDropout  the row runs the soft-capping and dropout twins; false: the dispatch leaves
//                    those calls to the head dim's next row down (and this row's twins are not
//                    compiled)
template <int kBlockN_, int kBlockM_, int kSplit_ = 1, int kWarpRows_ = 16, bool kFastCopy_ = true, int kStages_ = 2>
struct DkvTileShape {
  static constexpr int kBlockN = kBlockN_, kBlockM = kBlockM_, kSplit = kSplit_, kWarpRows = kWarpRows_;
  static constexpr bool kFastCopy = kFastCopy_;
  static constexpr int kStages = kStages_;
  static constexpr bool kRoles = false;
  static constexpr bool kDpInS = false, kPSmem = false, kRoundedPt = false, kSoftcapDropout = true;
};

// Register diets of the sm90 dK/dV rows kernel (sm90/flash_bwd_dkv_kernel.cuh) for rows of three
// warpgroups (384 threads at one CTA per SM: 168 registers per thread), where dK and dV (d / 2
// fp32 registers each), S^T, dP^T (kBlockM / 2 each) and P^T, dS^T (kBlockM / 4 each as 16-bit A
// operands) do not all fit (d96, 64-query tiles: ~190 with the addresses):
//   DpInS<row>  dP^T is issued into S^T's registers once P^T has been converted to its 16-bit A
//               operands: S^T and dP^T never live at once (dS^T then takes the rounded P^T);
//   PSmem<row>  P^T goes through a swizzled shared tile per warpgroup, dV += P^T dO reads it as an
//               SS product, dS^T reloads it (ldmatrix): P^T's registers are free while dP^T and
//               the products are in flight (+ kBlockN * kBlockM * 2 bytes of shared memory).
// Neither applies to the dropout twins (which keep the plain code: dS^T needs P^T and dP^T at once
// there); kSplit must be 1.
template <typename Shape>
struct DpInS : Shape {
  static constexpr bool kDpInS = true;
};
template <typename Shape>
struct PSmem : Shape {
  static constexpr bool kPSmem = true;
};

// dQ: one CTA per Q tile of kBlockM rows (resident), K/V tiles of kBlockN rows streamed.
//   kWarpRows   sm80: Q rows per warp (16 or 32);  kFastCopy as above
//   kMinBlocks  sm90: __launch_bounds__ minimum CTAs per SM (caps the registers per thread)
//   kRoles      as for DkvTileShape
//   kStages     sm90: K / V stages of the TMA ring (the cp.async twin uses two)
template <int kBlockM_, int kBlockN_, int kWarpRows_ = 16, bool kFastCopy_ = true, int kMinBlocks_ = 1,
          int kStages_ = 2>
struct DqTileShape {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kWarpRows = kWarpRows_;
  static constexpr bool kFastCopy = kFastCopy_;
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kStages = kStages_;
  static constexpr bool kRoles = false;
  static constexpr bool kSoftcapDropout = true;  // as DkvTileShape's: every dQ row runs every twin
};

// An sm90 backward row (DkvTileShape / DqTileShape) whose kernel splits the work between its two
// consumer warpgroups by role instead of by rows (sm90/flash_bwd_{dkv,dq}_roles_kernel.cuh): one
// computes S and P, the other dP and dS, over the same 64 x 64 tile pair. For head dims whose
// dK/dV or dQ accumulator (d / 2 registers per thread for 64 rows) leaves no room for S and dP.
template <typename Shape>
struct Roles : Shape {
  static constexpr bool kRoles = true;
};

// Split-KV (KV-cache) forward: one CTA per (sequence, kv head, packed row tile, split). Its
// kBlockM = 16 rows are the (query, head) pairs of one GQA group (packed row r = query i * ratio +
// head g), so K/V are read once per kv head; the keys of each K/V tile of kBlockN rows are split
// over the warps (kBlockN / kNWarps each, a multiple of 16), whose partial (m, l, O) merge once at
// the end through shared memory.
//   kStages     K/V tile pairs in the copy ring (all in flight while the CTA waits, one less
//               while it computes)
//   kQInRegs    Q's mma A fragments kept in registers across the K/V loop
//   kMinBlocks  __launch_bounds__ minimum CTAs per SM (caps the registers per thread)
//   kEvictFirst K/V reads marked L2 evict-first (createpolicy) when no other CTA reads them
//               (one packed row tile per kv head): a read-once stream then replaces its own lines,
//               not other data (nor dirty lines whose write-back costs DRAM bandwidth)
//   kTma        sm_90+: K/V tiles copied by TMA boxes (cp.async.bulk.tensor, one thread issuing,
//               128-byte swizzle, completing on an mbarrier per stage) instead of 16-byte
//               cp.async; sm_80-89 keep cp.async
template <int kBlockN_, int kNWarps_, int kStages_, bool kQInRegs_, int kMinBlocks_, bool kEvictFirst_ = true,
          bool kTma_ = false>
struct SplitKvTileShape {
  static constexpr int kBlockM = 16, kBlockN = kBlockN_, kNWarps = kNWarps_, kStages = kStages_;
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr bool kEvictFirst = kEvictFirst_, kTma = kTma_;
  // The same row with cp.async copies (the launch picks it where TMA does not pay or cannot run).
  using WithoutTma = SplitKvTileShape<kBlockN_, kNWarps_, kStages_, kQInRegs_, kMinBlocks_, kEvictFirst_, false>;
  // Dynamic shared memory of the kernel for 16-bit elements: the Q tile and kStages (K, V) tile
  // pairs, rows padded to head_dim + 8 elements (sm80/kernel_common.cuh: SmemTile); a TMA row's
  // ring is in the 128-byte swizzle (64-column blocks, 1024 bytes of alignment slack) and the
  // larger of the two layouts is reserved (a TMA row compiled below sm_90 has the padded layout
  // and cp.async copies). Host code (the split heuristic) sizes CTAs per SM from it; the kernel's
  // traits assert that it fits.
  static constexpr int padded_smem_bytes(int head_dim) { return (kBlockM + 2 * kStages * kBlockN) * (head_dim + 8) * 2; }
  static constexpr int tma_smem_bytes(int head_dim) {
    return 1024 + 2 * kStages * kBlockN * ((head_dim + 63) / 64 * 64) * 2 + kBlockM * (head_dim + 8) * 2;
  }
  static constexpr int smem_bytes(int head_dim) {
    return kTma && tma_smem_bytes(head_dim) > padded_smem_bytes(head_dim) ? tma_smem_bytes(head_dim)
                                                                          : padded_smem_bytes(head_dim);
  }
};

}  // namespace flash
