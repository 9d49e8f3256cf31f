// Tensor Memory Accelerator (TMA, sm_90): tiles of a BSHD tensor from global into shared memory by
// one thread, completing on an mbarrier (primitives/barrier.cuh), in the 128-byte-swizzle layout
// that wgmma reads (kernels/sm90/smem_layout.cuh: SwizzledTile); and back, tiles of that layout
// from shared into global memory (tma_store_4d, a bulk async group of the issuing thread).
//
// Host: a tensor map (CUtensorMap, 128 bytes) per tensor, encoded once per call by the driver's
// cuTensorMapEncodeTiled, reached through the runtime (cudaGetDriverEntryPointByVersion): no libcuda
// link. The map travels to the kernel by value in a __grid_constant__ parameter. A BSHD tensor is
// described as 4-D (headdim, seqlen, heads, batch) with the tensor's own strides, so any strides
// TMA accepts work (BHSD-transposed views too) and rows past seqlen or columns past the user's head
// dim read as zeros (out-of-bounds fill), never the next head's rows.
// Box: (64 columns = 128 bytes, kRows rows, 1, 1): one 64-column block of a SwizzledTile per copy.
//
// TMA's limits (cuTensorMapEncodeTiled): base address 16-byte aligned, every stride a multiple of
// 16 bytes below 2^40, every extent in [1, 2^32], box extents <= 256. tma_can_describe checks them
// on the host before anything is launched; inputs that fail (an odd storage offset into a fused
// qkv buffer, say) run the sm80 path.
//
// Device (PTX ISA 9.7.9.27 cp.async.bulk.tensor): the copy writes the whole box (zero fill
// included) and completes box bytes of transactions on the barrier, so the expected byte count
// of a tile is its full size whatever its overlap with the tensor.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "flash.h"

namespace flash {

// ---- Device side ----

// The shared layout a box copy with the 128-byte swizzle writes, for a tile of kRows x kCols
// 16-bit elements: 64-column (128-byte) blocks of kRows rows each, one after the other; inside a
// block, row r at r * 128 bytes with its 16-byte chunks permuted by chunk ^ (r % 8). The tile
// base is 1024-byte aligned (one 8-row swizzle atom). A Layout of primitives/tile_copy.cuh; the
// sm90 kernels' SwizzledTile (kernels/sm90/smem_layout.cuh) adds wgmma descriptors to it.
template <int kRows, int kCols>
struct Swizzle128Tile {
  static_assert(kCols % 64 == 0, "tiles are whole 64-column (128-byte) swizzle blocks");
  static_assert(kRows % 8 == 0, "tiles are whole 8-row (1024-byte) swizzle atoms");
  static constexpr int kColBlockBytes = kRows * 128;
  static constexpr int kBytes = kColBlockBytes * (kCols / 64);
  // 8 rows (one swizzle atom) further is 1024 bytes further.
  static constexpr int kRowAlign = 8, kRowBytes = 128;

  // Byte offset of element (r, c) from the tile base.
  __host__ __device__ __forceinline__ static constexpr uint32_t offset(int r, int c) {
    return uint32_t((c / 64) * kColBlockBytes + r * 128 + ((((c % 64) / 8) ^ (r % 8)) * 16) + (c % 8) * 2);
  }
};

// Fetches the tensor map (a __grid_constant__ parameter) into the TMA unit's cache.
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Box at coordinates (c0..c3) of `map` fetched into L2 only (no shared memory, no barrier): a hint
// that a later tma_load_4d of the same box finds its lines on chip or on their way.
__device__ __forceinline__ void tma_prefetch_l2_4d(const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                                   uint64_t l2_policy) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile.L2::cache_hint [%0, {%1, %2, %3, %4}], %5;\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "l"(l2_policy)
               : "memory");
}

// L2 eviction priorities of TMA reads (createpolicy): Q is read once per CTA (evict first), K/V
// by every Q tile of the head (evict last).
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint64_t l2_policy_evict_last() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// Box at coordinates (c0 = column, c1 = row, c2 = head, c3 = batch) of `map` into shared memory
// at `smem_dst` (1024-byte aligned for the 128-byte swizzle), completing on barrier `bar`.
__device__ __forceinline__ void tma_load_4d(uint32_t smem_dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2, int c3, uint64_t l2_policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5, %6}], [%2], %7;\n" ::"r"(smem_dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "l"(l2_policy)
      : "memory");
}

// Box of shared memory at `smem_src` (the same swizzled box layout) to coordinates (c0..c3) of
// `map`, as one bulk async-group operation of the issuing thread; TMA writes only the elements
// inside the tensor's bounds (rows past seqlen, columns past d are dropped). The thread then
// commits the group (tma_store_commit), waits before the shared memory is written again
// (tma_store_wait_read<0>) and before it exits (tma_store_wait<0>).
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t smem_src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most N committed store groups of this thread are still reading shared memory.
template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Until at most N committed store groups of this thread are still incomplete (writes included).
template <int N>
__device__ __forceinline__ void tma_store_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- Host side ----

// The BSHD tensor view (elem_bytes-byte elements, extents batch x seqlen x heads x d) meets TMA's
// encoding rules: base 16-byte aligned; every stride of an extent > 1 a nonzero multiple of 16
// bytes below 2^40 (strides of extent-1 dimensions are replaced, tma_encode_bshd); extents >= 1.
inline bool tma_can_describe(const TensorView& t, int batch, int seqlen, int heads, int d, int elem_bytes) {
  if (t.ptr == nullptr || reinterpret_cast<uintptr_t>(t.ptr) % 16 != 0) return false;
  if (batch < 1 || seqlen < 1 || heads < 1 || d < 1) return false;
  if ((int64_t(d) * elem_bytes) % 16 != 0) return false;
  const int64_t extents[3] = {seqlen, heads, batch};
  const int64_t strides[3] = {t.row_stride, t.head_stride, t.batch_stride};
  for (int i = 0; i < 3; ++i) {
    if (extents[i] == 1) continue;
    const int64_t bytes = strides[i] * elem_bytes;
    if (strides[i] <= 0 || bytes % 16 != 0 || bytes >= (int64_t(1) << 40)) return false;
  }
  return true;
}

// cuTensorMapEncodeTiled from the driver, resolved once through the runtime (nullptr if the driver
// lacks it: the caller then runs the sm80 forward).
inline PFN_cuTensorMapEncodeTiled_v12000 tma_encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t prior = cudaPeekAtLastError();  // the caller's, left as it is
#if CUDART_VERSION >= 12050
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status);
#else  // CUDA 12.0-12.4: the unversioned lookup (the 12.0 ABI of the symbol, the one named above)
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr, cudaEnableDefault, &status);
#endif
    if (err != cudaSuccess || status != cudaDriverEntryPointSuccess) {
      if (prior == cudaSuccess) (void)cudaGetLastError();  // the failed lookup's error is not the next launch's
      ptr = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// Encodes `map` for boxes of (64 columns, box_rows rows) of the BSHD view (16-bit elements:
// `bf16` or fp16), 128-byte swizzle, zero fill out of bounds, L2 sector promotion `promotion` (a
// read of a box row brings that many bytes into L2: 256 for the dense kernels, whose dQ kernel ran
// up to 4 % slower with 128 at hd128; the KV-cache maps take 128, common/paged_kv.cuh). False if
// the driver refuses (the caller then takes another path) or tma_can_describe fails.
inline bool tma_encode_bshd(CUtensorMap* map, const TensorView& t, int batch, int seqlen, int heads, int d,
                            bool bf16, int box_rows,
                            CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  constexpr int kElemBytes = 2;
  if (!tma_can_describe(t, batch, seqlen, heads, d, kElemBytes) || box_rows < 1 || box_rows > 256) return false;
  const auto encode = tma_encode_fn();
  if (encode == nullptr) return false;
  cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(seqlen), cuuint64_t(heads), cuuint64_t(batch)};
  // Strides in bytes of dims 1..3; an extent-1 dimension is never stepped, so its stride (any
  // value in a torch view) is replaced by the packed one.
  cuuint64_t strides[3] = {cuuint64_t(t.row_stride) * kElemBytes, cuuint64_t(t.head_stride) * kElemBytes,
                           cuuint64_t(t.batch_stride) * kElemBytes};
  const cuuint64_t packed_row = ((cuuint64_t(d) * kElemBytes + 15) / 16) * 16;
  if (seqlen == 1) strides[0] = packed_row;
  if (heads == 1) strides[1] = strides[0] * cuuint64_t(seqlen);
  if (batch == 1) strides[2] = strides[1] * cuuint64_t(heads);
  for (int i = 0; i < 3; ++i) {
    if (strides[i] >= (cuuint64_t(1) << 40)) return false;
  }
  cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, t.ptr,
                            dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

}  // namespace flash
