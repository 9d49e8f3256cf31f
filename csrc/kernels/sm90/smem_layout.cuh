// Shared-memory tiles of the Hopper (sm90) path: (kRows x kCols) 16-bit elements in the
// 128-byte-swizzle layout that wgmma reads through matrix descriptors (primitives/wgmma.cuh),
// and fp32 accumulators -> shared. Global <-> shared copies are primitives/tile_copy.cuh with
// SwizzledTile as the layout. The one include of the sm90 kernels' headers (work split, mask,
// softmax, primitives, tile table, launch).
//
// Layout: kCols / 64 column blocks of kRows x 64 elements (kRows * 128 bytes each, 1024-byte
// aligned); inside a block, row r takes 128 bytes and its 16-byte chunk c (elements 8c..8c+7)
// sits at chunk position c ^ (r % 8). The same XOR makes the cp.async writes, the accumulator
// stores and the 16-byte reads of the output copies bank-conflict free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "flash.h"
#include "kernels/arch.h"
#include "kernels/common/work.cuh"
#include "kernels/launch_utils.h"
#include "kernels/sm90/tile_config.h"
#include "primitives/cp_async.cuh"
#include "primitives/ldmatrix.cuh"
#include "primitives/math.cuh"
#include "primitives/mma.cuh"
#include "primitives/softmax.cuh"
#include "primitives/tile_copy.cuh"
#include "primitives/wgmma.cuh"

namespace flash {
namespace sm90 {

// The kernel's dynamic shared memory from its first 1024-byte boundary (the swizzle atoms need
// that alignment; the sm90 kernels' kSmemBytes carry 1024 bytes of slack for it).
__device__ __forceinline__ unsigned char* aligned_dynamic_smem() {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_addr = smem_u32addr(smem_raw);
  return smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
}

template <int kRows, int kCols>
struct SwizzledTile {
  static_assert(kCols % 64 == 0, "tiles are whole 64-column (128-byte) swizzle blocks");
  static_assert(kRows % 8 == 0, "tiles are whole 8-row (1024-byte) swizzle atoms");
  static constexpr int kColBlockBytes = kRows * 128;
  static constexpr int kBytes = kColBlockBytes * (kCols / 64);
  // Layout of primitives/tile_copy.cuh: 8 rows (one swizzle atom) further is 1024 bytes further.
  static constexpr int kRowAlign = 8, kRowBytes = 128;

  // Byte offset of element (r, c) from the tile base.
  __device__ __forceinline__ static uint32_t offset(int r, int c) {
    return uint32_t((c / 64) * kColBlockBytes + r * 128 + ((((c % 64) / 8) ^ (r % 8)) * 16) + (c % 8) * 2);
  }

  // Descriptor of the K-major operand made of rows [r0, r0 + 64) (r0 % 8 == 0), columns
  // [16kk, 16kk + 16) as K: "S = Q K^T"-shaped products read A and B this way.
  __device__ __forceinline__ static uint64_t desc_k_major(uint32_t base, int r0, int kk) {
    return make_wgmma_desc(base + (kk / 4) * kColBlockBytes + r0 * 128 + (kk % 4) * 32, 16, 1024);
  }

  // Descriptor of the N-major B operand made of rows [16kk, 16kk + 16) as K and all kCols
  // columns as N: "dV += P^T dO"-shaped products read B this way.
  __device__ __forceinline__ static uint64_t desc_mn_major(uint32_t base, int kk) {
    return make_wgmma_desc(base + kk * 16 * 128, kColBlockBytes, 1024);
  }
};

// What the traits of both sm90 backward kernels share: the tile row's kBlockM x kBlockN, one
// warpgroup per 64 rows of the wgmma M axis (kMRows: K rows for dK/dV, Q rows for dQ), and the
// swizzled Q and K/V tiles.
template <int kHeadDim, typename Tile, int kMRows>
struct BwdTileTraits {
  static constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN;
  static constexpr int kWarpGroups = kMRows / 64;
  static constexpr int kThreads = kWarpGroups * 128;
  using TileQ = SwizzledTile<kBlockM, kHeadDim>;
  using TileKV = SwizzledTile<kBlockN, kHeadDim>;
};

// Writes a warpgroup's fp32 accumulator (64 x kNBlk*8, wgmma layout: warp w, lane 4g + t holds
// rows 16w + g and 16w + g + 8, columns 8j + 2t, +1 of n8 block j) times `scale` into rows
// [row0, row0 + 64) of the swizzled tile at `smem`, converted to Element.
template <int kRows, int kCols, int kNBlk, typename Element>
__device__ __forceinline__ void store_acc_to_smem(unsigned char* smem, const float (&acc)[kNBlk][4], int row0,
                                                  float scale, int tid_in_wg) {
  using Tile = SwizzledTile<kRows, kCols>;
  const int lane = tid_in_wg % 32, g = lane / 4, t = lane % 4;
  const int r = row0 + 16 * (tid_in_wg / 32) + g;
#pragma unroll
  for (int j = 0; j < kNBlk; ++j) {
    *reinterpret_cast<uint32_t*>(smem + Tile::offset(r, 8 * j + 2 * t)) =
        pack2<Element>(acc[j][0] * scale, acc[j][1] * scale);
    *reinterpret_cast<uint32_t*>(smem + Tile::offset(r + 8, 8 * j + 2 * t)) =
        pack2<Element>(acc[j][2] * scale, acc[j][3] * scale);
  }
}

// The (N/8 x 4) accumulator view of the kernels as the flat N/2-register list of Wgmma.
template <int kNBlk>
__device__ __forceinline__ float (&flat(float (&acc)[kNBlk][4]))[kNBlk * 4] {
  return reinterpret_cast<float(&)[kNBlk * 4]>(acc);
}

}  // namespace sm90
}  // namespace flash
