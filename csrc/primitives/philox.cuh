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
// columns c, c + 8 of two neighbouring n8 blocks): a unit, named by its corner (q0, k0). One Philox
// call serves two units, the corners (q0, k0) and (q0, k0 + 1) with k0 even (a pair): counter (pair
// index of k0, corner index of q0, batch * nheads + head, offset), key = the call's seed; its 128
// bits are eight 16-bit randoms, words x, y the unit with the even corner, z, w the odd one, and
// in a unit element (q0 + 8 i, k0 + 8 j) takes half j of word i (x low, x high, y low, y high). In
// the S orientation a thread holds both units of its pairs (columns 2t, 2t + 1); in S^T the two
// lanes holding the key corners k0, k0 + 1 each compute one of the two calls their units need and
// swap the other half (for_each_kept). An element is dropped iff its random < threshold =
// round(p 2^16) (at most 2^16 - 1), kept with probability 1 - threshold / 2^16, the kept ones scaled
// by 1 / (1 - threshold / 2^16) (the API sets rp so: the result stays unbiased). Positions are the
// sequence's own (varlen: from its first row and key), so a packed batch drops what each sequence
// run alone as batch b drops.
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
// 16-bit threshold from p.
struct DropoutRng {
  uint32_t key0 = 0, key1 = 0, offset = 0, threshold = 0;

  DropoutRng() = default;  // host and device alike (a defaulted constructor takes no annotation)
  // rng_state: (seed, offset) as two int64 (the op's rng_state tensor).
  FLASH_HOST_DEVICE DropoutRng(const int64_t* rng_state, uint32_t threshold_) : threshold(threshold_) {
    const uint64_t seed = uint64_t(rng_state[0]), off = uint64_t(rng_state[1]);
    key0 = uint32_t(seed);
    key1 = uint32_t(seed >> 32) ^ uint32_t(off >> 32);
    offset = uint32_t(off);
  }
  // A kernel's mask: the call's (flash.h: dropout_rng_state, dropout_threshold) in its kDropout
  // twin, an unused default in the others (which never read the state).
  template <bool kDropout, typename Params>
  FLASH_HOST_DEVICE static DropoutRng of(const Params& p) {
    if constexpr (kDropout) return DropoutRng(p.dropout_rng_state, p.dropout_threshold);
    return DropoutRng();
  }
  // The counter word of sequence (batch) b, query head h of nheads: b * nheads + h.
  FLASH_HOST_DEVICE static uint32_t head_word(int64_t b, int nheads, int h) { return uint32_t(b * nheads + h); }
  // Index of position x (a query row or a key) among the corners of its axis: 8 per 16.
  FLASH_HOST_DEVICE static uint32_t corner_index(int x) { return uint32_t(x >> 4) * 8u + uint32_t(x & 7); }
  // The eight randoms of the pair of units holding (q, k), for head bh = batch * nheads + head.
  FLASH_HOST_DEVICE Philox4 pair(uint32_t bh, int q, int k) const {
    return philox4x32_10(Philox4{corner_index(k) >> 1, corner_index(q), bh, offset}, key0, key1);
  }
  // Whether the element of random half `half` (0: low 16 bits) of word `word` is kept.
  FLASH_HOST_DEVICE bool kept(uint32_t word, int half) const { return ((word >> (16 * half)) & 0xFFFFu) >= threshold; }
  // Whether element (q, k) of head bh is kept (one Philox call per element: the CPU twin).
  FLASH_HOST_DEVICE bool keep(uint32_t bh, int q, int k) const {
    const Philox4 r = pair(bh, q, k);
    const bool odd = corner_index(k) & 1u, i = (q >> 3) & 1;
    const uint32_t word = odd ? (i ? r.w : r.z) : (i ? r.y : r.x);
    return kept(word, (k >> 3) & 1);
  }

  // Visits a thread's C fragments acc[ma][nb][e] of one score tile (kKeyRows = false: rows are
  // queries, the S tile; true: rows are keys, S^T), ma < kMA, nb < kNB, as f(ma, nb, e, kept), pair
  // by pair right after the pair's Philox call (so no tile of flags is held: the kernels run at
  // their register limit). Element (ma, nb, e) sits at row row0 + 16 ma + 8 (e / 2), column col0 + 8
  // nb + (e % 2), with row0 % 16 < 8 and col0 % 16 < 8 even (row0 = tile row + lane / 4, col0 = tile
  // column + 2 (lane % 4); tiles start at multiples of 16). kKeyRows (device code only): the lanes
  // lane and lane ^ 4 hold the key corners 2 u and 2 u + 1 of one pair and share its two calls,
  // one each, and one shuffle of two words (all 32 lanes of the warp must call it together).
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
        const int row = row0 + 16 * ma, col = col0 + 16 * np;
        if constexpr (!kKeyRows) {
          // Rows are queries: this thread's two units (columns col, col + 1) are one pair.
          const Philox4 r = pair(bh, row, col);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
          for (int c = 0; c < 2; ++c) {
            const uint32_t w0 = c ? r.z : r.x, w1 = c ? r.w : r.y;  // rows row (w0), row + 8 (w1)
            f(ma, 2 * np, c, kept(w0, 0));
            f(ma, 2 * np + 1, c, kept(w0, 1));
            f(ma, 2 * np, 2 + c, kept(w1, 0));
            f(ma, 2 * np + 1, 2 + c, kept(w1, 1));
          }
        } else {
#if defined(__CUDA_ARCH__)
          // Rows are keys (corner `row`, odd = its parity), columns the query corners col, col + 1.
          // This lane computes the pair for query corner col + odd, keeps its own unit's two words
          // and sends the partner's (key corner row ^ 1, lane ^ 4); the partner does the same for
          // query corner col + !odd.
          const bool odd = row & 1;
          const Philox4 r = pair(bh, col + odd, row);
          const uint32_t mine0 = odd ? r.z : r.x, mine1 = odd ? r.w : r.y;
          const uint32_t give0 = odd ? r.x : r.z, give1 = odd ? r.y : r.w;
          const uint32_t got0 = __shfl_xor_sync(0xffffffffu, give0, 4), got1 = __shfl_xor_sync(0xffffffffu, give1, 4);
#pragma unroll
          for (int c = 0; c < 2; ++c) {  // query corner col + c: words (rows of the query corner, + 8)
            const uint32_t w0 = c == int(odd) ? mine0 : got0, w1 = c == int(odd) ? mine1 : got1;
            f(ma, 2 * np, c, kept(w0, 0));      // (key row, query col + c)
            f(ma, 2 * np, 2 + c, kept(w0, 1));  // (key row + 8, query col + c)
            f(ma, 2 * np + 1, c, kept(w1, 0));  // (key row, query col + c + 8)
            f(ma, 2 * np + 1, 2 + c, kept(w1, 1));
          }
#else
          static_assert(!kKeyRows, "the S^T orientation is device code only");
#endif
        }
      }
    }
  }
};

}  // namespace flash
