// Attention dropout's random numbers: Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel
// random numbers: as easy as 1, 2, 3", SC 2011, section 3.2), a counter-based generator: the
// random bits of an element are a function of (key, counter) alone, so the forward, the dK/dV and
// the dQ kernels and the CPU twin each regenerate the same keep mask from the element's position,
// nothing stored between them (FlashAttention, Dao et al. 2022, section 3.1 and Alg. 2 / 4: the
// backward regenerates the dropout mask from the forward's RNG state).
//
// Host and device code (the CPU twin includes it too): no CUDA header needed.
//
// The unit of the mask. The kernels hold a score tile as mma / wgmma C fragments in either
// orientation, S (rows = queries: the forward, dQ) or S^T (rows = keys: dK/dV). A thread's elements
// differ between the two, but in both a thread holds, for some (q0, k0) with q0 % 16 < 8 and
// k0 % 16 < 8, the four elements {q0, q0 + 8} x {k0, k0 + 8} (rows r, r + 8 of an m16 atom, and
// columns c, c + 8 of two neighbouring n8 blocks). That 2 x 2 unit is one Philox call: counter
// (unit column, unit row, batch * nheads + head, offset), key = the call's seed, its four 32-bit
// outputs the four elements' randoms, in the order (q0, k0), (q0, k0 + 8), (q0 + 8, k0), (q0 + 8,
// k0 + 8). An element is dropped iff its random < threshold = round(p 2^32) (at most 2^32 - 1), kept
// with probability 1 - threshold / 2^32, the kept ones scaled by the inverse of that (the API sets
// rp so: unbiased for the probability used). Positions are the sequence's own (varlen: from its first row and key), so a packed batch
// drops what each sequence run alone as batch b drops.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLASH_HOST_DEVICE inline
#endif

namespace flash {

struct Philox4 {
  uint32_t x, y, z, w;
};

// Philox4x32-10: ten rounds of the two 32 x 32 -> 64-bit products, the key bumped by the Weyl
// constants between rounds (the paper's section 3.2; Random123's known answers are checked by
// tests/test_dropout.py through the CPU op).
FLASH_HOST_DEVICE Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // key increments (golden ratio, sqrt(3) - 1)
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(kM0) * c.x, p1 = uint64_t(kM1) * c.z;
    const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0), hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    c = Philox4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

// The dropout mask of one call (flash.h: dropout_*): the seed and offset from its rng_state, the
// threshold from p.
struct DropoutRng {
  uint32_t key0 = 0, key1 = 0, offset = 0, threshold = 0;

  FLASH_HOST_DEVICE DropoutRng() = default;
  // rng_state: (seed, offset) as two int64 (the op's rng_state tensor).
  FLASH_HOST_DEVICE DropoutRng(const int64_t* rng_state, uint32_t threshold_) : threshold(threshold_) {
    const uint64_t seed = uint64_t(rng_state[0]), off = uint64_t(rng_state[1]);
    key0 = uint32_t(seed);
    key1 = uint32_t(seed >> 32) ^ uint32_t(off >> 32);
    offset = uint32_t(off);
  }
  // Index of position x (a query row or a key) among the corners of its axis: 8 per 16.
  FLASH_HOST_DEVICE static uint32_t corner_index(int x) { return uint32_t(x >> 4) * 8u + uint32_t(x & 7); }
  // The four randoms of the unit holding (q, k), for head bh = batch * nheads + head.
  FLASH_HOST_DEVICE Philox4 unit(uint32_t bh, int q, int k) const {
    return philox4x32_10(Philox4{corner_index(k), corner_index(q), bh, offset}, key0, key1);
  }
  // Whether element (q, k) of head bh is kept (one Philox call per element: the CPU twin).
  FLASH_HOST_DEVICE bool keep(uint32_t bh, int q, int k) const {
    const Philox4 r = unit(bh, q, k);
    const int which = ((q >> 3) & 1) * 2 + ((k >> 3) & 1);
    const uint32_t x = which == 0 ? r.x : which == 1 ? r.y : which == 2 ? r.z : r.w;
    return x >= threshold;
  }

  // Visits a thread's C fragments acc[ma][nb][e] of one score tile (kKeyRows = false: rows are
  // queries, the S tile; true: rows are keys, S^T), ma < kMA, nb < kNB, as f(ma, nb, e, kept), unit
  // by unit right after the unit's Philox call (so no tile of flags is held: the kernels run at their
  // register limit). Element (ma, nb, e) sits at row row0 + 16 ma + 8 (e / 2), column col0 + 8 nb +
  // (e % 2), with row0 % 16 < 8 and col0 % 16 < 2 (row0 = tile row + lane / 4, col0 = tile column +
  // 2 (lane % 4); tiles start at multiples of 16).
  template <bool kKeyRows, int kMA, int kNB, typename F>
  FLASH_HOST_DEVICE void for_each_kept(uint32_t bh, int row0, int col0, F&& f) const {
    static_assert(kNB % 2 == 0, "n8 blocks pair up into the units' 16 columns");
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int ma = 0; ma < kMA; ++ma) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int np = 0; np < kNB / 2; ++np) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
        for (int c = 0; c < 2; ++c) {
          const int row = row0 + 16 * ma, col = col0 + 16 * np + c;
          const Philox4 r = kKeyRows ? unit(bh, col, row) : unit(bh, row, col);
          // (row, col) is the unit's corner; col + 8 is block 2 np + 1, row + 8 is e + 2.
          f(ma, 2 * np, c, r.x >= threshold);
          f(ma, 2 * np + 1, c, (kKeyRows ? r.z : r.y) >= threshold);
          f(ma, 2 * np, 2 + c, (kKeyRows ? r.y : r.z) >= threshold);
          f(ma, 2 * np + 1, 2 + c, r.w >= threshold);
        }
      }
    }
  }
};

}  // namespace flash
