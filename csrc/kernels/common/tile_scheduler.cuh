// Persistent tile scheduler of the forward (sm90/flash_fwd_kernel.cuh; FlashAttention-3's
// StaticPersistentTileScheduler, ../shared/HOPPER.md §1.7): a grid of at most one CTA per SM, each
// looping over work units u = blockIdx.x, blockIdx.x + gridDim.x, ... A unit is Q tiles of one
// (batch, head), named by their tile index in QTileWork's order (kernels/common/work.cuh: tile
// t = (b * h + head) * num_m + j is Q tile num_m - 1 - j, heavy causal tiles first, the tiles of
// one (batch, head) adjacent so its K/V stay in L2):
//   - one tile per unit (non-causal, or at most one tile per SM): unit u is tile u (up to the
//     light units' place, below);
//   - causal with more tiles than SMs: unit p of a (batch, head) is a heavy tile j = p and a light
//     one, heavy first: j = num_m - 1 - p (Q tiles num_m - 1 - p and p) for an even num_m; for an
//     odd num_m unit 0 is the heaviest tile alone and unit p > 0 pairs j = p with j = num_m - p
//     (Q tiles num_m - 1 - p and p - 1). A causal tile's work grows linearly with its Q index, so
//     every unit costs about the same (num_m + 1, resp. num_m, key blocks at seqlen_q == seqlen_k)
//     and the static round-robin stays balanced. Without pairing, whole CTAs would get only heavy
//     or only light tiles whenever the round-robin stride (the SM count) aliases with num_m
//     (132 SMs, num_m = 8: 12 vs 6 key blocks per two tiles; simulated makespan 1.3-1.8x the
//     ideal at the benchmark's causal shapes, paired 1.03-1.06x).
//   - light units last: when the last Q tile of a sequence leaves a consumer warpgroup without rows
//     (seqlen_q % kBlockM in (0, kBlockM - 64]) and the kernel skips the key blocks a warpgroup's
//     rows do not see, the unit holding that tile (p = 0: the tile alone, or paired with the
//     lightest causal tile) costs less than the others. Those units of every (batch, head) come
//     after all the others, so the full units spread evenly and the light ones fill the tail.
//     Without it the stride aliases again: at N = 1024, 192-row tiles (num_m = 6, 132 SMs), a
//     sixth of the CTAs would get only the light tiles and the rest only full ones.
//   - top-aligned partial tile (m_shift): a causal call whose seqlen_q is not a multiple of kBlockM
//     (dense, no sliding window, paired units, a kernel with per-warpgroup key ranges: hdim 64,
//     96, 192, 256, and the short causal rows of d128 / d256) has its tiles start kBlockM - seqlen_q % kBlockM rows
//     (rounded down to whole warpgroups of 64: a TMA store of a box above row 0 is an illegal
//     instruction, so such warpgroups store nothing and no box may cross row 0) before row 0, so the partial tile holds the first rows, which see the fewest keys, instead
//     of the last ones, which see the most (with the warpgroup key ranges, its warpgroups without
//     rows skip every step). hdim 64 at N = 1024 (192-row tiles): key-block steps per (batch,
//     head) 2 / 3 / 5 / 6 / 8 / 8 (the last tile one warpgroup of three) -> 1 / 2 / 4 / 5 / 7 / 8,
//     and the pairs cost 9 each. No light units then. Varlen causal calls (any walk): each
//     sequence's own shift (QTileWork::kShiftPerSequence), so its partial tile is at its top; at
//     16 x 1024 tokens, causal d64 / d128 (192-row tiles) gave the dynamic walk 0.88-0.90x of the
//     dense op's persistent walk without it.
//   - split tail: the full units fill R rounds of gridDim.x and L = (full units) mod gridDim.x
//     more; those L CTAs would run a whole unit after everyone else. When 2 L + (light units)
//     fits in one round, the last L (batch, head)s' most even pairs (their last unit: Q tiles
//     next to the middle) are dealt as 2 L single tiles after the other full units instead: the
//     tail is then half a unit. Cost model (warpgroup-steps per CTA, 132 SMs): hdim 64 causal
//     N = 8192 / 16384 (L = 24) makespan 1.032 / 1.047x shorter; no shape of 3,000 random ones
//     (hdim, N, batch, heads) longer. Measured (H200, tune harness, 10 rounds): 1.018 / 1.030.
// Varlen calls (their tiles differ in work by sequence lengths the host cannot read) walk their
// tiles (a tight grid's units where it is taken, work.cuh: varlen_tight_grid, one unit per real
// tile; else every (sequence, head) tile of max_seqlen_q rows, those past a sequence's end
// skipped) either one CTA per unit (the hardware's block scheduler balances them) or, `dynamic`
// (FA3's dynamic persistent scheduler; a tight grid's units longest sequences first, as FA3's
// hopper/flash_prepare_scheduler.cu sorts its varlen batches, here by four length buckets found
// in the kernel: work.cuh, varlen_lpt_index), on a persistent grid whose CTAs claim units in order from
// a zeroed counter (Flash_fwd_params::tile_counter): unit blockIdx.x first, then gridDim.x + the
// counter's next value, so every unit is taken exactly once and an idle CTA takes the next one,
// as the block scheduler would, while the barrier setup, register reallocation and the
// pipelines' fill happen once per CTA and the next tile's loads overlap this tile's last steps.
// The producer warp claims and finds the tile and hands its index to the consumers on a pair of
// named barriers before its loads (sm90/flash_fwd_kernel.cuh: tile hand-over). Tiles' results do
// not depend on the CTA that runs them. The counter must be zero at each launch: the last CTA to
// finish zeroes it again, so the API keeps one per stream (a fresh zeroed one per call under CUDA
// graph capture); a stale value would skip units (rows of out left unwritten), not hang. A varlen
// call whose packed rows are batch x max_seqlen, q and k (a full pack: most often every sequence
// max_seqlen long, as in a dense call), takes the static walk instead (kernels/dispatch.cu:
// sm90_fwd_schedule); it deals the tiles past a shorter sequence's end as any others, and
// producer and consumers skip them alike.
#pragma once

#include <cstdint>

#include "flash.h"
#include "kernels/common/mask.cuh"
#include "kernels/common/work.cuh"  // varlen_tight_grid
#include "primitives/math.cuh"

namespace flash {

// Built on the host once per call and passed to the kernel as a __grid_constant__ parameter, so
// its fields are constant-bank operands, never registers held across a tile.
template <int kBlockM>
struct FwdTileScheduler {
  uint32_t num_units;  // work units of the call (<= 2^30)
  int num_m;           // Q tiles per (batch, head)
  int paired;          // a unit is a (heavy, light) pair of causal Q tiles
  int persistent;      // grid of <= num_sms CTAs looping over units; else one CTA per tile
  int varlen_tight;    // not persistent, varlen on a tight grid (work.cuh: varlen_tight_grid): unit u is
                       // CTA u, whose tile the kernel finds itself (varlen_dense_index)
  int dynamic;         // varlen tiles claimed by a persistent grid (see the top): 0 no; 1 the tiles in
                       // QTileWork's order (unit = tile); 2 a tight grid's units (kDynamicTight)
  static constexpr int kDynamicTight = 2;
  // The unit ranges, in walk order: [0, tail_begin) full units, (batch, head) bh's K of them
  // (K = units_div.d) for bh < num_bh - split; [tail_begin, split_begin) the last `split`
  // (batch, head)s' first K - 1 units (tail_div.d = K - 1); [split_begin, split_begin + 2 split)
  // their last units as single tiles, heavy then light; [light_begin, num_units) the light units
  // (p = 0) of every (batch, head). Without light units p counts from 0, else from 1.
  uint32_t tail_begin, split_begin, light_begin;
  int num_bh, split, p_first;
  int m_shift;  // rows the tiles start before row 0 (QTileWork's m_shift; see the top), or
                // QTileWork::kShiftPerSequence (varlen)
  // Divisions by K, K - 1, num_m and nheads, their magic numbers computed on the host: a
  // tile's decode is multiplies and shifts (the producer decodes every tile once, each consumer
  // warpgroup twice), not integer divisions (QTileWork(params, tile, m_div, h_div)).
  FastDivmod units_div, tail_div, m_div, h_div;

  // How a call's tiles are dealt (flash.h / kernels/dispatch.cu: sm90_fwd_schedule): one CTA per
  // tile, the static persistent walk, or (varlen) the dynamic one.
  enum Schedule { kTile = kSm90FwdTile, kPersistent = kSm90FwdPersistent, kDynamic = kSm90FwdDynamic };

  // The units of `params`, or num_units = 0 when they exceed 2^30 (the caller refuses the call).
  // kTile: one CTA per tile in QTileWork's order, left to the hardware's block scheduler (heavy
  // causal tiles first), as a non-persistent kernel. kDynamic: varlen calls with a tile_counter
  // (else kTile); dense calls take kPersistent.
  // skips_empty_warpgroups: the kernel skips a warpgroup's key blocks its rows do not see
  // (sm90 FwdKernelTraits::kWarpgroupKeyRanges), so a tile with a warpgroup without rows is light.
  __host__ static FwdTileScheduler make(const Flash_fwd_params& params, Schedule schedule,
                                        bool skips_empty_warpgroups) {
    FwdTileScheduler s;
    s.num_m = ceil_div(params.seqlen_q, kBlockM);
    const int64_t bh = int64_t(params.b) * params.h;
    const bool tight = QTileWork<kBlockM, 64>::tight(params);  // (kBlockN does not enter it)
    const bool varlen = params.cu_seqlens_q != nullptr;
    if (schedule == kDynamic && !varlen) schedule = kPersistent;
    s.dynamic = schedule == kDynamic && params.tile_counter != nullptr && params.num_sms > 0
                    ? (tight ? kDynamicTight : 1) : 0;
    s.persistent = schedule == kPersistent && params.num_sms > 0;
    s.paired = s.persistent && params.is_causal && s.num_m >= 2 && bh * s.num_m > int64_t(params.num_sms);
    const int units_per_bh = s.paired ? (s.num_m + 1) / 2 : s.num_m;
    const int64_t units = bh * units_per_bh;
    const int rows_last = params.seqlen_q % kBlockM;
    // (Whole warpgroups: no O box crosses row 0. Only where the kernel skips a warpgroup's empty
    // key range: d128 takes the tile's range, so the shift would only double the masked
    // diagonal blocks there. Never with a window's left bound: mask.cuh's key_start assumes rows
    // >= 0 without one and the kLocal twin is not shifted.)
    s.m_shift = skips_empty_warpgroups && s.paired && rows_last > 0 && !varlen && params.window_left < 0 &&
                        params.fwd_top_shift
                    ? QTileWork<kBlockM, 64>::top_shift(params.seqlen_q) : 0;
    // Varlen, causal: every sequence's partial tile at its top (each sequence's own shift; any
    // walk: a tile's cost no longer depends on where its sequence ends).
    if (skips_empty_warpgroups && varlen && params.is_causal && params.window_left < 0 && params.fwd_top_shift) {
      s.m_shift = QTileWork<kBlockM, 64>::kShiftPerSequence;
    }
    const bool light = skips_empty_warpgroups && s.persistent && units_per_bh >= 2 && rows_last > 0 &&
                       rows_last <= kBlockM - 64 && s.m_shift == 0;
    const int k = light ? units_per_bh - 1 : units_per_bh;  // full units per (batch, head)
    const int64_t full = bh * k, sms = params.num_sms;
    const int64_t light_units = light ? bh : 0;
    // The split tail (see the top): paired units only (k >= 2, so the split unit has p >= 1 and
    // two tiles), more full units than SMs, and the split tiles and light units in one round.
    const int64_t rest = sms > 0 ? full % sms : 0;
    const bool split = s.paired && k >= 2 && full > sms && rest > 0 && rest <= bh && 2 * rest + light_units <= sms;
    s.split = split ? int(rest) : 0;
    s.varlen_tight = !s.persistent && !s.dynamic && tight;
    const int64_t total = s.varlen_tight || s.dynamic == kDynamicTight
                              ? varlen_tight_per_head(params.total_q, params.b, kBlockM) * params.h
                              : units + s.split;  // each split unit becomes two
    s.num_units = total <= (int64_t(1) << 30) ? uint32_t(total) : 0;  // so tile indices < 2^31
    // (With num_units = 0 the walk ends at once and the fields below are never read.)
    s.num_bh = int(bh);
    s.p_first = light ? 1 : 0;
    s.tail_begin = uint32_t(full - int64_t(s.split) * k);
    s.split_begin = uint32_t(full - s.split);
    s.light_begin = s.varlen_tight || s.dynamic ? s.num_units : uint32_t(full + s.split);  // tight: one tile per unit
    s.units_div = FastDivmod(k > 0 ? k : 1);
    s.tail_div = FastDivmod(k > 1 ? k - 1 : 1);
    s.m_div = FastDivmod(s.num_m > 0 ? s.num_m : 1);
    s.h_div = FastDivmod(params.h > 0 ? params.h : 1);
    return s;
  }
  __host__ int64_t tiles(const Flash_fwd_params& params) const { return int64_t(params.b) * params.h * num_m; }

  // The persistent grid: one CTA per SM, fewer when there are fewer units (not persistent, or
  // num_sms unknown (0): one CTA per unit).
  __host__ int grid_size(const Flash_fwd_params& params) const {
    return (persistent || dynamic) && num_units > uint32_t(params.num_sms) ? params.num_sms : int(num_units);
  }

  // This CTA's walk over its tiles: auto it = sched.begin(); for (int64_t tile; it.next(sched, tile);).
  // One register: the current unit (bits 0..30; unit + gridDim.x < 2^31 as num_units <= 2^30) and
  // whether the light tile of a paired unit is next (bit 31).
  struct Iterator {
    uint32_t pos;
    static constexpr uint32_t kSecond = 1u << 31;

    // The next tile index of this CTA (QTileWork(params, tile) decodes it); false when done.
    __device__ __forceinline__ bool next(const FwdTileScheduler& s, int64_t& tile) {
      const uint32_t unit = pos & ~kSecond;
      if (unit >= s.num_units) return false;
      if (!s.paired && s.light_begin == s.num_units) {  // one tile per unit, in tile order
        tile = unit;
        pos = unit + gridDim.x;
        return true;
      }
      // The unit's (batch, head) bh and its p (ranges: the fields' comment); half: which tile of a
      // split unit (-1: a whole unit).
      int bh, p, half = -1;
      if (unit < s.tail_begin) {
        bh = s.units_div.div(int(unit));
        p = int(unit) - bh * s.units_div.d + s.p_first;
      } else if (unit < s.split_begin) {
        const int u = int(unit - s.tail_begin), b = s.tail_div.div(u);
        bh = s.num_bh - s.split + b;
        p = u - b * s.tail_div.d + s.p_first;
      } else if (unit < s.light_begin) {
        const int u = int(unit - s.split_begin);
        bh = s.num_bh - s.split + u / 2;
        p = s.units_div.d - 1 + s.p_first;
        half = u & 1;
      } else {
        bh = int(unit - s.light_begin);
        p = 0;
      }
      if (!s.paired) {
        tile = int64_t(bh) * s.num_m + p;
        pos = unit + gridDim.x;
        return true;
      }
      const bool odd = (s.num_m & 1) != 0;
      const int light = odd ? s.num_m - p : s.num_m - 1 - p;  // the unit's light tile (j)
      const bool has_light = !odd || p > 0;                    // unit 0 of an odd num_m: alone
      const bool second = half >= 0 ? half == 1 : (pos & kSecond) != 0;
      tile = int64_t(bh) * s.num_m + (second ? light : p);
      pos = half < 0 && !second && has_light ? unit | kSecond : unit + gridDim.x;
      return true;
    }
  };
  __device__ __forceinline__ Iterator begin() const { return Iterator{blockIdx.x}; }
};

}  // namespace flash
