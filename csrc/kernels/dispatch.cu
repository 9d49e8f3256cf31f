// The dispatch points of csrc/flash.h: run_mha_fwd and run_mha_bwd pick the arch path
// (select_arch), dtype (params.is_bf16) and compiled head dim (params.d_rounded) from the kernel
// manifest and call the launch template of that (arch, kernel, head dim, dtype), or throw
// std::runtime_error naming what is missing. Everything checkable is checked before the first
// launch.
//
// The manifest (csrc/kernels/generate_kernels.py) is the one list of (arch path, kernel, head dim,
// dtype); setup.py writes the subset this build compiles into csrc/generated/build_config.h as
// X-macros (FLASH_ATTN_EXT_HDIMS, FLASH_ATTN_EXT_SM90_FWD_HDIMS, FLASH_ATTN_EXT_SM90_BWD_HDIMS,
// FLASH_ATTN_EXT_SM90_FWD_SM80_HDIMS, FLASH_ATTN_EXT_SM90_FWD_LONG_HDIMS, FLASH_ATTN_EXT_SM90_FWD_SHORT_HDIMS,
// FLASH_ATTN_EXT_SM90_BWD_DKV_LONG_HDIMS, FLASH_ATTN_EXT_SM90_BWD_DKV_MID_HDIMS,
// FLASH_ATTN_EXT_SM90_BWD_DQ_SHORT_HDIMS) and the flag
// FLASH_ATTN_EXT_WITH_SM90, read here only.
//
// The backward (FlashAttention-2, Dao 2023, Alg. 2) is three launches:
//   1. preprocess: D = rowsum(dO o O), LSE_log2 = hi + lo   (common/bwd_preprocess.cuh)
//   2. dK, dV per K/V block                                  (<arch>/flash_bwd_dkv_kernel.cuh)
//   3. dQ per Q tile                                         (<arch>/flash_bwd_dq_kernel.cuh)
//   (sm90 d192 / d256: flash_bwd_{dkv,dq}_roles_kernel.cuh)
// 1 and 2 on `stream`, 3 on a side stream forked after 1 and joined back (kernels/bwd_fork.h), so 2
// and 3 run side by side (in sequence on `stream` where the fork has no side stream: see there).
// No atomics: every output element is written once by one thread, in a fixed order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "flash.h"
#include "generated/build_config.h"
#include "kernels/arch.h"
#include "kernels/bwd_fork.h"
#include "kernels/common/append_kv.cuh"
#include "kernels/common/bwd_preprocess.cuh"
#include "kernels/common/combine_kernel.cuh"
#include "kernels/common/splitkv_heuristic.h"
#include "kernels/sm80/tile_config.h"
#include "kernels/sm90/tile_config.h"
#include "primitives/tma.cuh"

namespace flash {
namespace {

#define FLASH_ATTN_EXT_LIST_ITEM(d) d,
constexpr int kHdims[] = {FLASH_ATTN_EXT_HDIMS(FLASH_ATTN_EXT_LIST_ITEM) 0};  // ascending, 0-terminated
constexpr int kSm90FwdHdims[] = {FLASH_ATTN_EXT_SM90_FWD_HDIMS(FLASH_ATTN_EXT_LIST_ITEM) 0};
constexpr int kSm90BwdHdims[] = {FLASH_ATTN_EXT_SM90_BWD_HDIMS(FLASH_ATTN_EXT_LIST_ITEM) 0};
constexpr int kSm90FwdSm80Hdims[] = {FLASH_ATTN_EXT_SM90_FWD_SM80_HDIMS(FLASH_ATTN_EXT_LIST_ITEM) 0};
constexpr int kSm90FwdLongHdims[] = {FLASH_ATTN_EXT_SM90_FWD_LONG_HDIMS(FLASH_ATTN_EXT_LIST_ITEM) 0};
constexpr int kSm90FwdShortHdims[] = {FLASH_ATTN_EXT_SM90_FWD_SHORT_HDIMS(FLASH_ATTN_EXT_LIST_ITEM) 0};
constexpr int kSm90BwdDkvLongHdims[] = {FLASH_ATTN_EXT_SM90_BWD_DKV_LONG_HDIMS(FLASH_ATTN_EXT_LIST_ITEM) 0};
constexpr int kSm90BwdDkvMidHdims[] = {FLASH_ATTN_EXT_SM90_BWD_DKV_MID_HDIMS(FLASH_ATTN_EXT_LIST_ITEM) 0};
constexpr int kSm90BwdDqShortHdims[] = {FLASH_ATTN_EXT_SM90_BWD_DQ_SHORT_HDIMS(FLASH_ATTN_EXT_LIST_ITEM) 0};
#undef FLASH_ATTN_EXT_LIST_ITEM

template <int N>
constexpr bool contains(const int (&list)[N], int d) {
  for (int x : list) {
    if (x == d && d != 0) return true;
  }
  return false;
}

// Whether the environment variable `name` is set to "0" (the long rows' tuning knobs for A/B runs).
bool env_set_to_zero(const char* name) {
  const char* e = std::getenv(name);
  return e != nullptr && std::string(e) == "0";
}

// FLASH_ATTN_EXT_SM90_FWD_LONG_KEYS=0 (read once) keeps every sm90 forward call on FwdTile, the
// long-key row (sm90/tile_config.h: FwdLongTile) unused.
bool sm90_long_keys_enabled() {
  static const bool enabled = !env_set_to_zero("FLASH_ATTN_EXT_SM90_FWD_LONG_KEYS");
  return enabled;
}

// FLASH_ATTN_EXT_SM90_FWD_SHORT_CAUSAL=0 (read once) keeps every sm90 forward call on FwdTile, the
// short causal row (sm90/tile_config.h: FwdShortTile) unused.
bool sm90_short_causal_enabled() {
  static const bool enabled = !env_set_to_zero("FLASH_ATTN_EXT_SM90_FWD_SHORT_CAUSAL");
  return enabled;
}

// FLASH_ATTN_EXT_SM90_BWD_LONG_ROWS=0 (read once) keeps every sm90 dK/dV call on DkvTile, the
// long-query and middle-length rows (sm90/tile_config.h: DkvLongTile, DkvMidTile) unused. Every
// row gives the same bits.
bool sm90_bwd_long_rows_enabled() {
  static const bool enabled = !env_set_to_zero("FLASH_ATTN_EXT_SM90_BWD_LONG_ROWS");
  return enabled;
}

// FLASH_ATTN_EXT_SM90_BWD_DQ_SHORT=0 (read once) keeps every sm90 dQ call on DqTile, the
// short-sequence row (sm90/tile_config.h: DqShortTile) unused. Either row gives the same bits.
bool sm90_bwd_dq_short_enabled() {
  static const bool enabled = !env_set_to_zero("FLASH_ATTN_EXT_SM90_BWD_DQ_SHORT");
  return enabled;
}

// FLASH_ATTN_EXT_SPLITKV_SPLITS=N (read once; a tuning knob, 1 <= N <= kMaxSplits): every kvcache
// call whose num_splits is 0 (the heuristic's) runs N splits, with the combine after when N > 1
// (where the balanced splits apply, N is their S: plan_kvcache_splits). Unset or 0: the heuristic.
// An integer knob in [0, hi]: `unset` when unset or empty; anything else raises, naming the knob.
int env_int_knob(const char* name, int hi, int unset = 0) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == '\0') return unset;
  char* end = nullptr;
  const long n = std::strtol(e, &end, 10);
  if (*end != '\0' || n < 0 || n > hi) {
    throw std::runtime_error(std::string("flash_attn_ext: ") + name + " must be in [0, " + std::to_string(hi) +
                             "], got '" + e + "'");
  }
  return int(n);
}

int splitkv_forced_splits() {
  static const int forced = env_int_knob("FLASH_ATTN_EXT_SPLITKV_SPLITS", kMaxSplits);
  return forced;
}

// FLASH_ATTN_EXT_BWD_CONCURRENT=0 (read once) runs the backward's dK/dV and dQ kernels one after
// the other on the caller's stream instead of side by side (kernels/bwd_fork.h).
bool bwd_concurrent_enabled() {
  static const bool enabled = !env_set_to_zero("FLASH_ATTN_EXT_BWD_CONCURRENT");
  return enabled;
}

// The run-time tuning knobs of params (flash.h: varlen_tight, sm90_bwd_tma, fwd_top_shift), read once.
void set_tuning_knobs(Flash_fwd_params& params) {
  static const bool tight = !env_set_to_zero("FLASH_ATTN_EXT_VARLEN_TIGHT_GRID");
  static const bool bwd_tma = !env_set_to_zero("FLASH_ATTN_EXT_SM90_BWD_TMA");
  static const bool top_shift = !env_set_to_zero("FLASH_ATTN_EXT_SM90_FWD_TOP_SHIFT");
  params.varlen_tight = tight;
  params.sm90_bwd_tma = bwd_tma;
  params.fwd_top_shift = top_shift;
}

std::string arch_name(int arch) { return std::to_string(arch / 10) + "." + std::to_string(arch % 10); }

// Calls f(std::integral_constant<int, d>{}) for the compiled head dim d == params.d_rounded, with
// Element the params' dtype; throws if that head dim is not compiled or d does not fit it.
template <typename F>
void dispatch(const Flash_fwd_params& params, const char* op, F&& f) {
  if (params.arch < 80) {
    throw std::runtime_error(std::string("flash_attn_ext ") + op + ": CUDA kernels need compute capability >= 8.0, got " +
                             arch_name(params.arch));
  }
  if (params.d <= 0 || params.d % 8 != 0 || params.d > params.d_rounded || rounded_headdim(params.d) != params.d_rounded) {
    throw std::runtime_error(std::string("flash_attn_ext ") + op + ": headdim " + std::to_string(params.d) +
                             " (run as " + std::to_string(params.d_rounded) +
                             ") is not covered by a compiled head dim; compiled head dims: [" + compiled_headdims() +
                             "] (rebuild with FLASH_ATTN_EXT_HDIMS covering it)");
  }
  if (params.h_k <= 0 || params.h % params.h_k != 0 || params.h / params.h_k != params.h_h_k_ratio) {
    throw std::runtime_error(std::string("flash_attn_ext ") + op + ": nheads must be a multiple of nheads_k");
  }
  auto with_dtype = [&](auto element) {
    using Element = typename decltype(element)::type;
#define FLASH_ATTN_EXT_CASE(d) \
  case d: return f(Element{}, std::integral_constant<int, d>{});
    switch (params.d_rounded) {
      FLASH_ATTN_EXT_HDIMS(FLASH_ATTN_EXT_CASE)
      default: break;
    }
#undef FLASH_ATTN_EXT_CASE
  };
  if (params.is_bf16) {
    with_dtype(std::common_type<__nv_bfloat16>{});
  } else {
    with_dtype(std::common_type<__half>{});
  }
}

}  // namespace

// FLASH_ATTN_EXT_LONG_ROW_KEYS=N (read once; for tests, 1 <= N): query tiles whose key blocks hold
// at least N keys move O out of the tensor cores' accumulator every min(N, kFlushKeys) keys
// (kernels/common/long_rows.cuh; N = 1: every tile at every key block). Unset or 0: kLongRowKeys.
int long_row_keys() {
  static const int n = env_int_knob("FLASH_ATTN_EXT_LONG_ROW_KEYS", kMaxSeqlen);
  return n == 0 ? kLongRowKeys : n;
}

// -1: not read yet; then 0 / 1. Read from the environment once, set by force_sm80_path after.
std::atomic<int> g_force_sm80{-1};

bool force_sm80_path(bool force) {
  select_arch(90);  // reads the environment first, if nothing did yet
  return g_force_sm80.exchange(force ? 1 : 0) == 1;
}

ArchPath select_arch(int arch) {
  if (g_force_sm80.load() < 0) {
    const char* off = std::getenv("FLASH_ATTN_EXT_DISABLE_SM90");
    int expected = -1;
    g_force_sm80.compare_exchange_strong(expected, off != nullptr && off[0] != 0 && !(off[0] == '0' && off[1] == 0));
  }
#ifdef FLASH_ATTN_EXT_WITH_SM90
  return arch == 90 && g_force_sm80.load() == 0 ? ArchPath::kSm90 : ArchPath::kSm80;
#else
  (void)arch;
  return ArchPath::kSm80;
#endif
}

// The sm90 forward loads Q/K/V by TMA, which needs 16-byte-aligned bases and strides
// (primitives/tma.cuh); any other input (e.g. an odd storage offset into a fused qkv buffer) runs
// the sm80 kernel. Varlen inputs are described as they are encoded (sm90/flash_fwd_launch.cuh):
// the packed tensors as one batch of total_q / total_k rows (an empty one: the sm80 kernel). Host
// arithmetic only: decided before anything is launched.
static bool tma_can_describe_inputs(const Flash_fwd_params& params) {
  const bool varlen = params.cu_seqlens_q != nullptr;
  const int batch = varlen ? 1 : params.b;
  const int rows_q = varlen ? params.total_q : params.seqlen_q, rows_k = varlen ? params.total_k : params.seqlen_k;
  return tma_can_describe(params.q, batch, rows_q, params.h, params.d, 2) &&
         tma_can_describe(params.k, batch, rows_k, params.h_k, params.d, 2) &&
         tma_can_describe(params.v, batch, rows_k, params.h_k, params.d, 2);
}

void run_mha_fwd(Flash_fwd_params& params, cudaStream_t stream) {
  if (params.block_table != nullptr) {
    throw std::runtime_error("flash_attn_ext forward: a paged KV cache (block_table) runs through run_mha_fwd_kvcache");
  }
  if ((params.cu_seqlens_q == nullptr) != (params.cu_seqlens_k == nullptr)) {
    throw std::runtime_error("flash_attn_ext forward: cu_seqlens_q and cu_seqlens_k are set together");
  }
  const ArchPath path = select_arch(params.arch);
  set_tuning_knobs(params);
  // The sm90 forward reads whole K/V tiles by TMA: past a KV cache's visible length (cache_seqlens)
  // those rows may hold anything, NaN included, which masking cannot undo in P V (0 * NaN); the
  // sm80 kernel's predicated loads zero-fill them. Varlen rows past a sequence's end are the next
  // sequence's keys (or rows past cu_seqlens_k[-1]): masked in S, and their V rows zeroed in shared
  // memory before P V (sm90/flash_fwd_kernel.cuh), since 0 * NaN would be NaN.
  // A sliding window (flash.h: window_left / window_right) runs here too: the sm90 forward's
  // per-warpgroup key ranges skip the steps outside a window (and the backward's kernels loop over
  // the window's tiles: common/work.cuh, DkvWork / DqWork).
  // Attention dropout (flash.h: dropout_p): each tile row's kDropout twin (the backward's: below).
  const bool sm90_ok = path == ArchPath::kSm90 && params.cache_seqlens == nullptr;
  dispatch(params, "forward", [&](auto element, auto hdim) {
    using Element = decltype(element);
    constexpr int kHeadDim = decltype(hdim)::value;
    if constexpr (contains(kSm90FwdHdims, kHeadDim)) {
      if (sm90_ok && tma_can_describe_inputs(params)) {
        // Long dense non-causal calls: the long-key tile row where the head dim has one.
        if constexpr (contains(kSm90FwdLongHdims, kHeadDim)) {
          if (sm90_long_keys_enabled() &&
              sm90::fwd_long_keys(params.cu_seqlens_q == nullptr, params.is_causal, params.seqlen_k,
                                  sm90::FwdTile<kHeadDim>::kBlockN, sm90::FwdLongTile<kHeadDim>::kBlockN)) {
            run_mha_fwd_long_<Element, kHeadDim>(Sm90{}, params, stream);
            return;
          }
        }
        // Short causal calls (dense or varlen, by max_seqlen_q): the short causal tile row where
        // the head dim has one.
        if constexpr (contains(kSm90FwdShortHdims, kHeadDim)) {
          if (sm90_short_causal_enabled() && sm90::fwd_short_causal(params.is_causal, params.seqlen_q)) {
            run_mha_fwd_short_<Element, kHeadDim>(Sm90{}, params, stream);
            return;
          }
        }
        run_mha_fwd_<Element, kHeadDim>(Sm90{}, params, stream);
        return;
      }
    }
    // The sm80 kernel on an sm_90 GPU (inputs TMA cannot describe, a KV cache, the forced sm80
    // path): its sm_90 row where the sm90 table has one (sm_90a code runs on compute capability
    // 9.0 only).
    if constexpr (contains(kSm90FwdSm80Hdims, kHeadDim)) {
      if (params.arch == 90) {
        run_mha_fwd_sm80_<Element, kHeadDim>(Sm90{}, params, stream);
        return;
      }
    }
    run_mha_fwd_<Element, kHeadDim>(Sm80{}, params, stream);
  });
}

void run_mha_bwd(Flash_bwd_params& params, cudaStream_t stream) {
  if (params.seqlen_q_rounded % 128 != 0 || params.seqlen_q_rounded < params.seqlen_q) {
    throw std::runtime_error("flash_attn_ext backward: seqlen_q_rounded must be seqlen_q rounded up to 128");
  }
  if ((params.cu_seqlens_q == nullptr) != (params.cu_seqlens_k == nullptr)) {
    throw std::runtime_error("flash_attn_ext backward: cu_seqlens_q and cu_seqlens_k are set together");
  }
  if (params.cache_seqlens != nullptr || params.block_table != nullptr) {
    throw std::runtime_error("flash_attn_ext backward: no backward through a KV cache");
  }
  const ArchPath path = select_arch(params.arch);
  set_tuning_knobs(params);
  dispatch(params, "backward", [&](auto element, auto hdim) {
    using Element = decltype(element);
    constexpr int kHeadDim = decltype(hdim)::value;
    run_bwd_preprocess<Element>(params, stream);
    // dK/dV on `stream`, dQ on the fork's side stream (kernels/bwd_fork.h), joined back after both
    // launches (or, if a launch throws, by the fork's destructor).
    BwdFork fork(stream, bwd_concurrent_enabled());
    const cudaStream_t dq_stream = fork.dq_stream();
    auto launch_dkv_and_dq = [&] {
      if constexpr (contains(kSm90BwdHdims, kHeadDim)) {
        // Attention dropout (flash.h: dropout_p): each row's kDropout twin (rows and Roles<> kernels).
        if (path == ArchPath::kSm90) {
          // Sequence lengths per call for the rows' rules: a dense call's, a varlen call's means
          // (total / batch; shapes only, no device sync).
          const bool varlen = params.cu_seqlens_q != nullptr;
          const int64_t batch = std::max(params.b, 1);
          const int64_t mean_seqlen_q = varlen ? params.total_q / batch : params.seqlen_q;
          const int64_t mean_seqlen_k = varlen ? params.total_k / batch : params.seqlen_k;
          // dK/dV: the long-query row, else the middle-length row (d96), where the head dim has one
          // and the call's lengths and grid take it, else DkvTile. A row without soft-capping and
          // dropout twins (d96's long row) leaves those calls to the next row down.
          const bool plain_twin = params.softcap <= 0.f && params.dropout_p <= 0.0;
          bool dkv_long = false, dkv_mid = false;
          if constexpr (contains(kSm90BwdDkvLongHdims, kHeadDim)) {
            using Long = sm90::DkvLongTile<kHeadDim>;
            dkv_long = sm90_bwd_long_rows_enabled() && (Long::kSoftcapDropout || plain_twin) &&
                       sm90::dkv_long_rows(mean_seqlen_q, mean_seqlen_k, batch * params.h_k, params.num_sms,
                                           Long::kBlockN, sm90::dkv_long_min_seqlen(kHeadDim));
            if (dkv_long) run_mha_bwd_dkv_long_<Element, kHeadDim>(Sm90{}, params, stream);
          }
          if constexpr (contains(kSm90BwdDkvMidHdims, kHeadDim)) {
            using Mid = sm90::DkvMidTile<kHeadDim>;
            dkv_mid = !dkv_long && sm90_bwd_long_rows_enabled() && (Mid::kSoftcapDropout || plain_twin) &&
                      sm90::dkv_long_rows(mean_seqlen_q, mean_seqlen_k, batch * params.h_k, params.num_sms,
                                          Mid::kBlockN, sm90::kDkvMidMinSeqlen);
            if (dkv_mid) run_mha_bwd_dkv_mid_<Element, kHeadDim>(Sm90{}, params, stream);
          }
          if (!dkv_long && !dkv_mid) run_mha_bwd_dkv_<Element, kHeadDim>(Sm90{}, params, stream);
          bool dq_short = false;  // short sequences: the short dQ row where the head dim has one
          if constexpr (contains(kSm90BwdDqShortHdims, kHeadDim)) {
            dq_short = sm90_bwd_dq_short_enabled() &&
                       sm90::dq_short_rows(params.is_causal, mean_seqlen_q, mean_seqlen_k);
            if (dq_short) run_mha_bwd_dq_short_<Element, kHeadDim>(Sm90{}, params, dq_stream);
          }
          if (!dq_short) run_mha_bwd_dq_<Element, kHeadDim>(Sm90{}, params, dq_stream);
          return;
        }
      }
      run_mha_bwd_dkv_<Element, kHeadDim>(Sm80{}, params, stream);
      run_mha_bwd_dq_<Element, kHeadDim>(Sm80{}, params, dq_stream);
    };
    launch_dkv_and_dq();
    fork.join();
  });
}

// ---- KV cache (flash_attn_with_kvcache): append, split-KV forward, combine; three launches on
// `stream`, every check before the first (the append writes the cache in place).
//   1. knew / vnew into the cache at cache_seqlens[b] + i        (common/append_kv.cuh)
//   2. attention of the packed GQA rows over num_splits key ranges (sm80/flash_fwd_splitkv_kernel.cuh;
//      the sm80 kernel on every GPU, the H200 included: decode is memory-bound)
//   3. num_splits > 1: the partials merged by their LSEs         (common/combine_kernel.cuh)
void run_mha_fwd_kvcache(Flash_fwd_params& params, cudaStream_t stream) {
  const auto fail = [](const std::string& what) { throw std::runtime_error("flash_attn_ext kvcache forward: " + what); };
  if (params.num_splits < 1 || params.num_splits > kMaxSplits) {
    fail("num_splits must be in [1, " + std::to_string(kMaxSplits) + "], got " + std::to_string(params.num_splits));
  }
  if (params.balance_splits && (params.num_splits < 2 || params.splits_equal < 1 ||
                                params.splits_equal > params.num_splits || params.b > (1 << 16))) {
    fail("balanced splits need 1 <= splits_equal <= num_splits, num_splits >= 2 and b <= 2^16 (plan_kvcache_splits)");
  }
  if (params.num_splits > 1 && params.seqlen_q > 0 &&
      (params.oaccum_ptr == nullptr || params.softmax_lseaccum_ptr == nullptr)) {
    fail("num_splits > 1 needs the oaccum / softmax_lseaccum workspaces");
  }
  if (params.cu_seqlens_q != nullptr) fail("q must be dense (batch, seqlen_q, nheads, headdim), not varlen");
  if (params.knew.ptr != nullptr && params.seqlen_knew > 0 && (params.vnew.ptr == nullptr || params.cache_seqlens == nullptr)) {
    fail("appending k needs v and cache_seqlens");
  }
  if (params.leftpad_k != nullptr && (params.cache_seqlens == nullptr || params.block_table != nullptr)) {
    fail("leftpad_k needs cache_seqlens and a contiguous cache (flash.h)");
  }
  if (params.block_table != nullptr && (params.page_size <= 0 || params.page_size % 16 != 0 ||
                                        int64_t(params.seqlen_k) % params.page_size != 0)) {
    fail("page_size must be a positive multiple of 16 and seqlen_k = max_blocks * page_size, got page_size " +
         std::to_string(params.page_size) + ", seqlen_k " + std::to_string(params.seqlen_k));
  }
  if (int64_t(params.seqlen_q) * params.h_h_k_ratio > kMaxSeqlen) {
    fail("seqlen_q * nheads / nheads_k must be at most 2^31 - 256 (flash.h: kMaxSeqlen)");
  }
  dispatch(params, "kvcache forward", [&](auto element, auto hdim) {
    using Element = decltype(element);
    constexpr int kHeadDim = decltype(hdim)::value;
    // The split-KV kernel's shared memory, checked against the device before the append writes anything.
    constexpr int smem = sm80::SplitKvTile<kHeadDim>::smem_bytes(kHeadDim);
    int device = 0, max_optin = 0;
    FLASH_CHECK_CUDA(cudaGetDevice(&device));
    FLASH_CHECK_CUDA(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (smem > max_optin) {
      fail("the split-KV kernel for head dim " + std::to_string(kHeadDim) + " needs " + std::to_string(smem) +
           " bytes of shared memory per block; this GPU allows " + std::to_string(max_optin));
    }
    // An error that earlier work left pending would be reported by the append's launch check,
    // after it wrote the cache: reported here instead, before anything is written.
    FLASH_CHECK_CUDA(cudaPeekAtLastError());
    run_append_kv<Element>(params, stream);
    params.sm90_path = select_arch(params.arch) == ArchPath::kSm90;  // the split-KV TMA rows' condition
    run_mha_fwd_splitkv_<Element, kHeadDim>(Sm80{}, params, stream);
    if (params.num_splits > 1) run_splitkv_combine<Element>(params, stream);
  });
}

// FLASH_ATTN_EXT_SM90_FWD_SCHEDULE (read once; a tuning knob): "tile" runs one CTA per tile,
// "persistent" the static persistent grid, "dynamic" the dynamic one for every varlen call (dense
// calls: the static one); unset or "auto": the static persistent grid for dense calls (faster or
// equal at every shape of the benchmark, docs/PERF_NOTES.md) and the dynamic one for varlen calls,
// whose tiles differ in work by the sequence lengths (unknown on the host): a static round-robin
// leaves CTAs idle there (H200, 64 sequences of 128..1024, 16k tokens, non-causal: hd64 93 TFLOP/s
// against 168 for one CTA per tile, hd128 194 against 234), claiming the next tile does not (hd64
// 192 -> 248, hd128 244 -> 295 against one CTA per tile; causal +30-40 %; docs/PERF_NOTES.md). But
// a varlen call whose packed rows are exactly batch x max_seqlen, q and k alike, has every
// sequence max_seqlen long (unless rows go unused: past cu_seqlens[-1], or those of a sequence
// longer than max_seqlen; the walk is exact there too, only less balanced): its tiles cost the
// same, as a dense call's, and the static walk runs them 3-7 % faster than the dynamic one (H200,
// 16 x 1024, hd128 / hd256, causal both; docs/PERF_NOTES.md, tenth session). A caller whose
// buffers are batch x max_seqlen rows with skewed lengths in them would lose up to half (the
// numbers above): "dynamic" keeps such calls on the dynamic walk.
Sm90FwdSchedule sm90_fwd_schedule(const Flash_fwd_params& params) {
  static const int forced = [] {
    const char* e = std::getenv("FLASH_ATTN_EXT_SM90_FWD_SCHEDULE");
    if (e == nullptr || std::string(e).empty() || std::string(e) == "auto") return -1;
    if (std::string(e) == "persistent") return int(kSm90FwdPersistent);
    if (std::string(e) == "tile") return int(kSm90FwdTile);
    if (std::string(e) == "dynamic") return int(kSm90FwdDynamic);
    throw std::runtime_error(std::string("flash_attn_ext: FLASH_ATTN_EXT_SM90_FWD_SCHEDULE must be auto, persistent, "
                                         "dynamic or tile, got '") + e + "'");
  }();
  const bool varlen = params.cu_seqlens_q != nullptr;
  if (forced == kSm90FwdTile) return kSm90FwdTile;
  if (forced == kSm90FwdPersistent || !varlen) return kSm90FwdPersistent;
  if (forced == kSm90FwdDynamic) return kSm90FwdDynamic;
  const bool full_pack = int64_t(params.b) * params.seqlen_q == params.total_q &&
                         int64_t(params.b) * params.seqlen_k == params.total_k;
  return full_pack ? kSm90FwdPersistent : kSm90FwdDynamic;
}

// FlashDecoding's split choice from shapes alone (common/splitkv_heuristic.h: the rule), with the
// split-KV row of the head dim (sm80/tile_config.h: SplitKvTile).
int num_splits_heuristic(const Flash_fwd_params& params) {
  int block_n = 64, smem = 0, min_blocks = 1, warps = 4;
#define FLASH_ATTN_EXT_CASE(d)                                  \
  case d:                                                       \
    block_n = sm80::SplitKvTile<d>::kBlockN;                    \
    smem = sm80::SplitKvTile<d>::smem_bytes(d);                 \
    min_blocks = sm80::SplitKvTile<d>::kMinBlocks;              \
    warps = sm80::SplitKvTile<d>::kNWarps;                      \
    break;
  switch (params.d_rounded) {
    FLASH_ATTN_EXT_HDIMS(FLASH_ATTN_EXT_CASE)
    default: break;
  }
#undef FLASH_ATTN_EXT_CASE
  if (splitkv_forced_splits() > 0) return splitkv_forced_splits();
  return num_splits_for_row(params, block_n, smem, min_blocks, warps);
}

// Balanced splits (common/splitkv_work.cuh) for a KV-cache call whose sequences may differ in length
// (cache_seqlens given, b > 1): the split CTAs share the keys out by the sequences' lengths on the
// device, and a full cache keeps the count S the shapes give (splits_equal). Where the call allows it
// (splitkv_heuristic.h: balanced_splits_units, which CI tests on the host), the grid has F S units
// per sequence, at least 2 (F = FLASH_ATTN_EXT_SPLITKV_BALANCE, read once, 0..8, default 2): a
// ragged batch then balances over more, smaller units, and one the heuristic leaves unsplit
// (S = 1) can still be split where it is ragged (its units past the full-cache grid, and the
// combine's rows of one split, do nothing). A requested num_splits is the units per sequence
// itself. The balanced kernels are twins (kBalanced) of the plain split kernel and combine, which
// F = 0 runs (every sequence S splits; both store through SplitSlots, splitkv_work.cuh). F = 2 ran lengths spread over [0, Nk]
// +13-23 % at B4 / B8 / B16 and full caches 0-1.7 % slower (H100, hd128 GQA 32:8,
// docs/PERF_NOTES.md, thirty-fourth and thirty-fifth sessions).
void plan_kvcache_splits(Flash_fwd_params& params, int requested) {
  static const int factor = env_int_knob("FLASH_ATTN_EXT_SPLITKV_BALANCE", 8, /*unset=*/2);
  const int equal = requested > 0 ? requested : num_splits_heuristic(params);
  params.num_splits = equal, params.splits_equal = int16_t(equal), params.balance_splits = false;
  const int units = balanced_splits_units(params, equal, requested, factor);  // splitkv_heuristic.h: the rule
  if (units > 0) params.num_splits = units, params.balance_splits = true;
}

// Smallest compiled head dim >= d (the kernels zero-pad columns d..d_rounded), 0 if none.
int rounded_headdim(int d) {
  if (d <= 0) return 0;
  for (int h : kHdims) {
    if (h >= d) return h;
  }
  return 0;
}

const char* compiled_headdims() {
  static const std::string names = [] {
    std::string s;
    for (int h : kHdims) {
      if (h == 0) continue;
      if (!s.empty()) s += ",";
      s += std::to_string(h);
    }
    return s;
  }();
  return names.c_str();
}

}  // namespace flash
