// Persistent tile scheduler of the forward (sm90/flash_fwd_kernel.cuh; FlashAttention-3's
// StaticPersistentTileScheduler, ../shared/HOPPER.md §1.7): a grid of at most one CTA per SM, each
// looping over work units u = blockIdx.x, blockIdx.x + gridDim.x, ... A unit is Q tiles of one
// (batch, head), named by their tile index in QTileWork's order (kernels/common/work.cuh: tile
// t = (b * h + head) * num_m + j is Q tile num_m - 1 - j, heavy causal tiles first, the tiles of
// one (batch, head) adjacent so its K/V stay in L2):
//   - one tile per unit (non-causal, or at most one tile per SM): unit u is tile u;
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
//     (seqlen_q % kBlockM in (0, kBlockM - 64]), the unit holding it (p = 0: that tile alone, or
//     paired with the lightest causal tile) costs less than the others, since the kernel skips a
//     warpgroup's key blocks its rows do not see. Those units of every (batch, head) come after
//     all the others, so the full units spread evenly and the light ones fill the tail. Without
//     it the stride aliases again: at N = 1024, 192-row tiles (num_m = 6, 132 SMs), a sixth of
//     the CTAs would get only the light tiles and the rest only full ones.
#pragma once

#include <cstdint>

#include "flash.h"
#include "kernels/common/mask.cuh"
#include "primitives/math.cuh"

namespace flash {

// Built on the host once per call and passed to the kernel as a __grid_constant__ parameter, so
// its fields are constant-bank operands, never registers held across a tile.
template <int kBlockM>
struct FwdTileScheduler {
  uint32_t num_units;  // work units of the call (<= 2^30)
  int num_m;           // Q tiles per (batch, head)
  int units_per_bh;    // units per (batch, head): num_m, or ceil(num_m / 2) when paired
  int paired;          // a unit is a (heavy, light) pair of causal Q tiles
  int persistent;      // grid of <= num_sms CTAs looping over units; else one CTA per tile
  uint32_t full_units; // units before the light ones (unit p = 0 of each (batch, head)); num_units
                       // when no unit is light
  // Divisions by the full units per (batch, head) (units_per_bh, or units_per_bh - 1 with light
  // units), num_m and nheads, their magic numbers computed on the host: a
  // tile's decode is multiplies and shifts (the producer decodes every tile once, each consumer
  // warpgroup twice), not integer divisions (QTileWork(params, tile, m_div, h_div)).
  FastDivmod units_div, m_div, h_div;

  // The units of `params`, or num_units = 0 when they exceed 2^30 (the caller refuses the call).
  // persistent = false: one CTA per tile in QTileWork's order, left to the hardware's block
  // scheduler (heavy causal tiles first), as a non-persistent kernel.
  // skips_empty_warpgroups: the kernel skips a warpgroup's key blocks its rows do not see
  // (sm90 FwdKernelTraits::kWarpgroupKeyRanges), so a tile with a warpgroup without rows is light.
  __host__ static FwdTileScheduler make(const Flash_fwd_params& params, bool persistent = true,
                                        bool skips_empty_warpgroups = true) {
    FwdTileScheduler s;
    s.num_m = ceil_div(params.seqlen_q, kBlockM);
    const int64_t bh = int64_t(params.b) * params.h;
    s.persistent = persistent && params.num_sms > 0;
    s.paired = s.persistent && params.is_causal && s.num_m >= 2 && bh * s.num_m > int64_t(params.num_sms);
    s.units_per_bh = s.paired ? (s.num_m + 1) / 2 : s.num_m;
    const int64_t units = bh * s.units_per_bh;
    s.num_units = units <= (int64_t(1) << 30) ? uint32_t(units) : 0;  // so tile indices < 2^31
    const int rows_last = params.seqlen_q % kBlockM;
    const bool light = skips_empty_warpgroups && s.persistent && s.units_per_bh >= 2 && rows_last > 0 &&
                       rows_last <= kBlockM - 64;
    s.full_units = light ? uint32_t(bh * (s.units_per_bh - 1)) : s.num_units;
    s.units_div = FastDivmod(light ? s.units_per_bh - 1 : s.units_per_bh > 0 ? s.units_per_bh : 1);
    s.m_div = FastDivmod(s.num_m > 0 ? s.num_m : 1);
    s.h_div = FastDivmod(params.h > 0 ? params.h : 1);
    return s;
  }
  __host__ int64_t tiles(const Flash_fwd_params& params) const { return int64_t(params.b) * params.h * num_m; }

  // The persistent grid: one CTA per SM, fewer when there are fewer units (not persistent, or
  // num_sms unknown (0): one CTA per unit).
  __host__ int grid_size(const Flash_fwd_params& params) const {
    return persistent && num_units > uint32_t(params.num_sms) ? params.num_sms : int(num_units);
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
      const bool light_last = s.full_units != s.num_units;
      if (!s.paired && !light_last) {
        tile = unit;
        pos = unit + gridDim.x;
        return true;
      }
      // (batch, head) bh and its unit p: the full units p = 1 .. first when some are light.
      int bh, p;
      if (unit < s.full_units) {
        bh = s.units_div.div(int(unit));
        p = int(unit) - bh * s.units_div.d + (light_last ? 1 : 0);
      } else {
        bh = int(unit - s.full_units);
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
      const bool second = (pos & kSecond) != 0;
      tile = int64_t(bh) * s.num_m + (second ? light : p);
      pos = !second && has_light ? unit | kSecond : unit + gridDim.x;
      return true;
    }
  };
  __device__ __forceinline__ Iterator begin() const { return Iterator{blockIdx.x}; }
};

}  // namespace flash
