// flash_attn_ext: the only torch translation unit.
//
// Declares the six ops (forward, backward, varlen_forward, varlen_backward, fwd_kvcache,
// backward_dsinks; schemas below, docs/DESIGN.md), checks every argument before any
// work (errors name the argument and what was expected), allocates outputs and workspaces,
// fills flash::Flash_fwd_params / Flash_bwd_params (csrc/flash.h) and dispatches:
//   CPU  -> flash::cpu::run_mha_{fwd,bwd}_cpu   (csrc/kernels/cpu/flash_cpu.cpp)
//   CUDA -> flash::run_mha_fwd / run_mha_bwd / run_mha_fwd_kvcache   (csrc/kernels/dispatch.cu)
// Autograd and the fake (meta) kernels are registered in Python: flash_attn_ext/ops.py (the fake
// kernels) and the _ops_* modules it imports (autograd, forward mode, vmap).
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flash.h"
#include "kernels/cpu/flash_cpu.h"

#if __has_include("generated/build_config.h")
#include "generated/build_config.h"  // written by setup.py
#else
#define FLASH_ATTN_EXT_BUILD_ARCHS "unknown"
#define FLASH_ATTN_EXT_BUILD_HDIMS "unknown"
#define FLASH_ATTN_EXT_BUILD_CUDA "unknown"
#define FLASH_ATTN_EXT_BUILD_TORCH "unknown"
#endif

#ifdef FLASH_ATTN_EXT_WITH_CUDA
// c10/cuda only (not ATen/cuda/CUDAContext.h, which pulls in cuBLAS/cuSPARSE headers that a
// minimal CUDA toolkit lacks).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace {

using at::Tensor;

constexpr int kMaxHeadDim = 256;

// ---- Argument checks -------------------------------------------------------------------

struct Sizes {
  int64_t batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim;
};

void check_rank4(const Tensor& t, const char* name, const char* layout) {
  TORCH_CHECK(t.dim() == 4, "flash_attn_ext: ", name, " must be 4-D ", layout, " (BSHD), got ",
              t.dim(), "-D of shape ", t.sizes());
}

void check_same_device(const Tensor& t, const char* name, const Tensor& q) {
  TORCH_CHECK(t.device() == q.device(), "flash_attn_ext: ", name, " is on ", t.device(),
              " but q is on ", q.device(), "; all tensors must be on one device");
}

// A dtype as Python spells it (torch.float32, not c10's Float): the fake kernels' messages print
// torch.dtype, and the two sides' messages are the same text (tests/test_fake_kernels.py).
std::string dtype_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

void check_same_dtype(const Tensor& t, const char* name, const Tensor& q) {
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "flash_attn_ext: ", name, " has dtype ",
              dtype_name(t.scalar_type()), " but q has dtype ", dtype_name(q.scalar_type()), "; they must match");
}

// Whether sum_t a_t x_t == delta has an integer solution with lo_t <= x_t <= hi_t (a_t > 0; with
// `nonzero`, one with some x_t != 0): two strided views of one storage addressing one element (x:
// index differences, or one view's indices and the other's negated). Depth first over the terms by
// decreasing a_t, each level trying only the x_t that leave the rest able to reach delta: one to
// three values for real layouts (each stride past the reach of the smaller ones). Past 2^16 nodes
// it answers kUndecided: a layout it cannot clear is refused as one that may overlap.
// _fake_checks.strides_can_meet is its twin.
struct StrideTerm {
  int64_t a, lo, hi;
};
enum class Meet { kNo, kYes, kUndecided };
Meet strides_can_meet(int64_t delta, std::vector<StrideTerm> terms, bool nonzero) {
  std::sort(terms.begin(), terms.end(), [](const StrideTerm& x, const StrideTerm& y) { return x.a > y.a; });
  const size_t n = terms.size();
  std::vector<__int128> rest_lo(n + 1, 0), rest_hi(n + 1, 0);  // reach of terms t.. (all of them past t - 1)
  for (size_t t = n; t-- > 0;) {
    rest_lo[t] = rest_lo[t + 1] + static_cast<__int128>(terms[t].a) * terms[t].lo;
    rest_hi[t] = rest_hi[t + 1] + static_cast<__int128>(terms[t].a) * terms[t].hi;
  }
  int64_t budget = 1 << 16;
  bool undecided = false;
  auto floor_div = [](__int128 p, int64_t q) { return p >= 0 ? p / q : -((-p + q - 1) / q); };
  std::function<bool(size_t, __int128, bool)> solve = [&](size_t t, __int128 d, bool moved) -> bool {
    if (--budget < 0) return undecided = true;  // (ends the search)
    if (t == n) return d == 0 && (moved || !nonzero);
    const int64_t a = terms[t].a;
    const __int128 first = std::max<__int128>(terms[t].lo, -floor_div(rest_hi[t + 1] - d, a));
    const __int128 last = std::min<__int128>(terms[t].hi, floor_div(d - rest_lo[t + 1], a));
    for (__int128 x = first; x <= last; ++x) {
      if (solve(t + 1, d - a * x, moved || x != 0)) return true;
    }
    return false;
  };
  return !solve(0, delta, false) ? Meet::kNo : undecided ? Meet::kUndecided : Meet::kYes;
}

// Whether two elements of t (a view: any strides) share one address: a stride 0 of a dim of size > 1,
// or an index difference that strides_can_meet finds (none for a dense tensor: the fast path).
Meet has_internal_overlap(const Tensor& t) {
  if (t.is_non_overlapping_and_dense()) return Meet::kNo;
  std::vector<StrideTerm> terms;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) <= 1) continue;
    const int64_t a = std::abs(t.stride(d));
    if (a == 0) return Meet::kYes;
    terms.push_back({a, -(t.size(d) - 1), t.size(d) - 1});
  }
  return strides_can_meet(0, terms, /*nonzero=*/true);
}

// Whether views a and b of one storage (same element size) share an element: a's index sums minus
// b's reach their offsets' difference; terms of one stride merged (their sum takes every value in
// between).
Meet views_meet(const Tensor& a, const Tensor& b) {
  std::vector<StrideTerm> terms;
  auto add = [&](int64_t stride, int64_t lo, int64_t hi) {
    if (lo == hi) return;
    if (stride < 0) std::tie(stride, lo, hi) = std::make_tuple(-stride, -hi, -lo);
    for (auto& term : terms) {
      if (term.a == stride) {
        term.lo += lo;
        term.hi += hi;
        return;
      }
    }
    terms.push_back({stride, lo, hi});
  };
  for (int64_t d = 0; d < a.dim(); ++d) add(a.stride(d), 0, a.size(d) - 1);
  for (int64_t d = 0; d < b.dim(); ++d) add(-b.stride(d), 0, b.size(d) - 1);
  terms.erase(std::remove_if(terms.begin(), terms.end(), [](const StrideTerm& t) { return t.a == 0; }),
              terms.end());  // stride 0: no reach
  return strides_can_meet(b.storage_offset() - a.storage_offset(), terms, /*nonzero=*/false);
}

void check_last_dim_contiguous(const Tensor& t, const char* name, const char* hint = "; call .contiguous() first") {
  TORCH_CHECK(t.stride(-1) == 1, "flash_attn_ext: ", name,
              " must have a contiguous last dimension (stride(-1) == 1), got strides ", t.strides(), hint);
}

// k / v (or the KV cache, named k_name / v_name) on q's device with q's dtype; `cuda` selects the
// dtypes allowed.
void check_devices_dtypes(const Tensor& q, const Tensor& k, const Tensor& v, bool cuda, const char* k_name,
                          const char* v_name) {
  check_same_device(k, k_name, q);
  check_same_device(v, v_name, q);
  const auto dt = q.scalar_type();
  if (cuda) {
    TORCH_CHECK(dt == at::kHalf || dt == at::kBFloat16, "flash_attn_ext: q has dtype ", dtype_name(dt),
                "; CUDA supports float16 and bfloat16");
  } else {
    TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kHalf || dt == at::kBFloat16,
                "flash_attn_ext: q has dtype ", dtype_name(dt),
                "; CPU supports float32, float64, float16 and bfloat16");
  }
  check_same_dtype(k, k_name, q);
  check_same_dtype(v, v_name, q);
}

// Heads and head dims of q (dim 2, 3 of a 4-D tensor) against k / v: equal head dims, nheads a
// multiple of nheads_k, a supported head dim.
void check_heads_headdim(const Tensor& q, const Tensor& k, const Tensor& v, const char* k_name, const char* v_name) {
  const int64_t nheads = q.size(-2), nheads_k = k.size(-2), headdim = q.size(-1);
  TORCH_CHECK(v.size(-2) == nheads_k, "flash_attn_ext: ", v_name, " has ", v.size(-2), " heads but ", k_name,
              " has nheads_k ", nheads_k, "; expected equal");
  TORCH_CHECK(k.size(-1) == headdim && v.size(-1) == headdim, "flash_attn_ext: headdim mismatch: q has headdim ",
              headdim, ", ", k_name, " has ", k.size(-1), ", ", v_name, " has ", v.size(-1), "; expected equal");
  TORCH_CHECK(nheads_k > 0, "flash_attn_ext: nheads_k (", k_name, ".size(", k.dim() - 2, ")) is 0; expected >= 1");
  TORCH_CHECK(nheads <= std::numeric_limits<int>::max(), "flash_attn_ext: nheads (q.size(", q.dim() - 2, ") = ", nheads,
              ") must fit in int32");
  TORCH_CHECK(nheads % nheads_k == 0, "flash_attn_ext: nheads (q.size(", q.dim() - 2, ") = ", nheads,
              ") must be a multiple of nheads_k (", k_name, ".size(", k.dim() - 2, ") = ", nheads_k, ")");
  TORCH_CHECK(headdim > 0 && headdim % 8 == 0 && headdim <= kMaxHeadDim, "flash_attn_ext: headdim ", headdim,
              " is not supported; expected a multiple of 8 in [8, ", kMaxHeadDim, "]");
}

void check_softmax_scale(double softmax_scale) {
  TORCH_CHECK(std::isfinite(softmax_scale) && std::isfinite(float(softmax_scale * M_LOG2E)),
              "flash_attn_ext: softmax_scale must be finite with |softmax_scale| * log2(e) < 3.4e38 (float32; "
              "the kernels scale scores by it), got ", softmax_scale);
}

// Logit soft-capping (flash.h: softcap; Gemma 2, flash-attn's softcap): 0 is none; a cap > 0
// makes the logit of score S softcap * tanh(S * softmax_scale / softcap). The kernels hold it as
// float32 (set_fwd_params rounds it once), so a cap must be a normal float32 (not flushed to 0)
// whose constants softcap * log2(e) and softmax_scale / softcap fit in float32 too.
void check_softcap(double softcap, double softmax_scale) {
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0,
              "flash_attn_ext: softcap must be a finite number >= 0 (0: no soft-capping), got ", softcap);
  if (softcap == 0) return;
  constexpr double kFloatMax = 3.4028234663852886e38;  // FLT_MAX
  bool fits = softcap >= double(std::numeric_limits<float>::min()) && softcap * M_LOG2E < kFloatMax;
  if (fits) {  // then the cast is in range
    const double cap = double(float(softcap));
    fits = cap * M_LOG2E < kFloatMax && std::abs(softmax_scale / cap) < kFloatMax;
  }
  TORCH_CHECK(fits,
              "flash_attn_ext: softcap must be within float32's range (the kernels hold it as float32): softcap >= "
              "1.18e-38, softcap * log2(e) < 3.4e38 and |softmax_scale / softcap| < 3.4e38, got softcap ", softcap,
              " with softmax_scale ", softmax_scale);
}

// The mask of a call: causal (bottom-right aligned) and a sliding window (flash-attn's
// window_size = (window_size_left, window_size_right); -1: no bound on that side). Query i sees
// key j iff i + off - left <= j <= i + off + right, off = seqlen_k - seqlen_q; causal=True is the
// right bound 0 and takes precedence over window_size_right (as flash-attn: causal with
// window_size = (w, w) is (w, 0)).
struct MaskArgs {
  bool causal;
  int window_left, window_right;  // normalized (flash.h): -1 where the bound hides no key
};

// The checked and normalized mask for a call whose longest sequence has seqlen_q queries and
// seqlen_k keys (dense: the tensors'; varlen: max_seqlen_q / max_seqlen_k; KV cache: the cache's
// capacity): a bound that hides no key is none (left >= seqlen_k - 1, right >= seqlen_q - 1; a
// window (w, 0) is causal with left bound w), so such a call runs as the unwindowed one. A window that
// remains needs seqlen_q + seqlen_k <= 2^31 - 512: the kernels' mask sums stay in int32 then
// (kernels/common/mask.cuh).
MaskArgs mask_args(bool causal, int64_t window_size_left, int64_t window_size_right, int64_t seqlen_q,
                   int64_t seqlen_k) {
  TORCH_CHECK(window_size_left >= -1, "flash_attn_ext: window_size_left must be -1 (no left bound) or >= 0, got ",
              window_size_left);
  TORCH_CHECK(window_size_right >= -1, "flash_attn_ext: window_size_right must be -1 (no right bound) or >= 0, got ",
              window_size_right);
  // A window (w, 0) is causal with a left bound w, whatever the lengths: normalized before them, so
  // a packed call (bounded by its longest sequence) and each of its sequences alone run the same
  // kernel row (the sm90 forward picks rows by causal: kernels/sm90/tile_config.h).
  if (window_size_right == 0) causal = true;
  int64_t left = window_size_left >= seqlen_k - 1 ? -1 : window_size_left;
  int64_t right = causal || window_size_right >= seqlen_q - 1 ? -1 : window_size_right;
  TORCH_CHECK((left < 0 && right < 0) || seqlen_q + seqlen_k <= flash::kMaxWindowedSeqlens,
              "flash_attn_ext: a sliding window needs seqlen_q + seqlen_k <= 2^31 - 512 = ", flash::kMaxWindowedSeqlens,
              " (the kernels' mask arithmetic is int32), got seqlen_q ", seqlen_q, " and seqlen_k ", seqlen_k);
  return {causal, int(left), int(right)};
}

// The last checks of the dense and varlen ops: contiguous last dims of q / k / v, the scale.
void check_last_dims_scale(const Tensor& q, const Tensor& k, const Tensor& v, double softmax_scale) {
  check_last_dim_contiguous(q, "q");
  check_last_dim_contiguous(k, "k");
  check_last_dim_contiguous(v, "v");
  check_softmax_scale(softmax_scale);
}

// The q/k/v checks of the dense ops, in the order: rank, device, dtype, shapes, headdim,
// strides, scale. `cuda` selects the dtypes allowed.
Sizes check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, double softmax_scale, bool cuda) {
  check_rank4(q, "q", "(batch, seqlen_q, nheads, headdim)");
  check_rank4(k, "k", "(batch, seqlen_k, nheads_k, headdim)");
  check_rank4(v, "v", "(batch, seqlen_k, nheads_k, headdim)");
  check_devices_dtypes(q, k, v, cuda, "k", "v");
  const Sizes s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
  TORCH_CHECK(k.size(0) == s.batch && v.size(0) == s.batch,
              "flash_attn_ext: batch mismatch: q has batch ", s.batch, ", k has ", k.size(0),
              ", v has ", v.size(0), "; expected equal");
  TORCH_CHECK(v.size(1) == s.seqlen_k, "flash_attn_ext: v has seqlen ", v.size(1),
              " but k has seqlen_k ", s.seqlen_k, "; expected equal");
  check_heads_headdim(q, k, v, "k", "v");
  TORCH_CHECK(s.batch <= std::numeric_limits<int>::max() && s.seqlen_q <= flash::kMaxSeqlen &&
                  s.seqlen_k <= flash::kMaxSeqlen,
              "flash_attn_ext: batch must fit in int32 and seqlen_q, seqlen_k be at most 2^31 - 256 = ",
              flash::kMaxSeqlen, " (tile counts are int32), got q shape ", q.sizes(), ", k shape ", k.sizes());
  check_last_dims_scale(q, k, v, softmax_scale);
  return s;
}

// softmax_stats: (2, batch, nheads, seqlen_q) float32 on q's device (the forward's third output).
void check_stats(const Tensor& stats, const Tensor& q, const Sizes& s) {
  check_same_device(stats, "softmax_stats", q);
  TORCH_CHECK(stats.scalar_type() == at::kFloat, "flash_attn_ext: softmax_stats has dtype ",
              dtype_name(stats.scalar_type()), "; expected float32");
  TORCH_CHECK(stats.dim() == 4 && stats.size(0) == 2 && stats.size(1) == s.batch && stats.size(2) == s.nheads &&
                  stats.size(3) == s.seqlen_q,
              "flash_attn_ext: softmax_stats has shape ", stats.sizes(),
              "; expected (2, batch, nheads, seqlen_q) = (2, ", s.batch, ", ", s.nheads, ", ", s.seqlen_q,
              "), the forward's third output");
}

// Backward-only checks: dout/out like q, softmax_lse (batch, nheads, seqlen_q) float32.
void check_bwd_extra(const Tensor& dout, const Tensor& q, const Tensor& out, const Tensor& softmax_lse,
                     const Sizes& s) {
  check_same_device(dout, "dout", q);
  check_same_device(out, "out", q);
  check_same_device(softmax_lse, "softmax_lse", q);
  check_same_dtype(dout, "dout", q);
  check_same_dtype(out, "out", q);
  TORCH_CHECK(dout.sizes() == q.sizes(), "flash_attn_ext: dout has shape ", dout.sizes(),
              "; expected q's shape ", q.sizes());
  TORCH_CHECK(out.sizes() == q.sizes(), "flash_attn_ext: out has shape ", out.sizes(),
              "; expected q's shape ", q.sizes());
  TORCH_CHECK(softmax_lse.scalar_type() == at::kFloat, "flash_attn_ext: softmax_lse has dtype ",
              dtype_name(softmax_lse.scalar_type()), "; expected float32");
  TORCH_CHECK(softmax_lse.dim() == 3 && softmax_lse.size(0) == s.batch && softmax_lse.size(1) == s.nheads &&
                  softmax_lse.size(2) == s.seqlen_q,
              "flash_attn_ext: softmax_lse has shape ", softmax_lse.sizes(), "; expected (batch, nheads, seqlen_q) = (",
              s.batch, ", ", s.nheads, ", ", s.seqlen_q, ")");
  check_last_dim_contiguous(out, "out");
}

// sinks (attention sinks, flash.h: sinks_ptr): None, or (nheads,) float32 (its device: every op's
// first check, check_sinks_device). Returns the checked tensor, contiguous (undefined for None).
Tensor check_sinks(const c10::optional<Tensor>& sinks, int64_t nheads) {
  if (!sinks.has_value() || !sinks->defined()) return Tensor();
  TORCH_CHECK(sinks->scalar_type() == at::kFloat, "flash_attn_ext: sinks has dtype ",
              dtype_name(sinks->scalar_type()), "; expected float32 (flash_attn_func and the other entry points "
              "convert it)");
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == nheads, "flash_attn_ext: sinks has shape ", sinks->sizes(),
              "; expected (nheads,) = (", nheads, ",): one logit per query head");
  return sinks->contiguous();
}

// sinks on q's device, checked first: a sinks tensor on another device can route the call to another
// device's kernel (the dispatcher picks CUDA if any argument is a CUDA tensor), whose own checks would
// otherwise name q's dtype or device instead.
void check_sinks_device(const c10::optional<Tensor>& sinks, const Tensor& q) {
  if (sinks.has_value() && sinks->defined()) check_same_device(*sinks, "sinks", q);
}

const float* sinks_ptr(const Tensor& sinks) { return sinks.defined() ? sinks.data_ptr<float>() : nullptr; }

// Attention dropout (flash.h: dropout_*): dropout_p in [0, 1); with p > 0, rng_state: the call's
// (seed, offset), int64 of shape (2,) on q's device (flash_attn_ext's Python functions draw it from
// torch's generator, and the backward must get the forward's to regenerate its mask). The CUDA
// kernels' dropout twin has no sliding window's left bound and no soft-capping: those combinations
// are refused on every device, so the CPU twin keeps the CUDA path's semantics.
struct DropoutArgs {
  double p = 0.0;
  Tensor rng_state;  // undefined without dropout
};

DropoutArgs check_dropout(double dropout_p, const c10::optional<Tensor>& rng_state, const Tensor& q,
                          const MaskArgs& mask, double softcap) {
  TORCH_CHECK_VALUE(std::isfinite(dropout_p) && dropout_p >= 0.0 && dropout_p < 1.0,
                    "flash_attn_ext: dropout_p must be in [0, 1), got ", dropout_p);
  if (dropout_p == 0.0) return {};
  TORCH_CHECK_VALUE(rng_state.has_value() && rng_state->defined(),
                    "flash_attn_ext: dropout_p = ", dropout_p, " needs rng_state, the call's (seed, offset) as an "
                    "int64 tensor of shape (2,) on q's device (flash_attn_func and the other entry points draw it "
                    "from torch's generator; pass the forward's to the backward)");
  const Tensor& r = *rng_state;
  check_same_device(r, "rng_state", q);
  TORCH_CHECK_VALUE(r.scalar_type() == at::kLong && r.dim() == 1 && r.size(0) == 2,
                    "flash_attn_ext: rng_state has dtype ", dtype_name(r.scalar_type()), " and shape ", r.sizes(),
                    "; expected int64 of shape (2,): (seed, offset)");
  TORCH_CHECK_NOT_IMPLEMENTED(mask.window_left < 0 && softcap == 0.0,
                              "flash_attn_ext: dropout_p > 0 with ",
                              softcap != 0.0 ? "softcap > 0"
                                             : "a sliding window's left bound that hides keys (0 <= window_size[0] < "
                                               "seqlen_k - 1)",
                              " is not supported; dropout runs with causal or full attention, without soft-capping");
  return {dropout_p, r.contiguous()};
}

void set_dropout(flash::Flash_fwd_params& p, const DropoutArgs& dropout) {
  if (dropout.p == 0.0) return;
  p.dropout_p = dropout.p;
  // 16-bit randoms (primitives/philox.cuh): p as a multiple of 2^-16 (at most 1 - 2^-16), and rp from
  // it, so the kept ones' scale makes the output unbiased for the probability actually used.
  p.dropout_threshold = uint32_t(std::min(std::llround(dropout.p * 65536.0), 65535LL));
  p.dropout_rp = float(1.0 / (1.0 - p.dropout_threshold / 65536.0));
  p.dropout_rng_state = dropout.rng_state.data_ptr<int64_t>();
}

// ALiBi (flash.h: alibi_*): None, or float32 slopes of shape (nheads,) or (batch, nheads) on q's
// device (a varlen call's batch: its sequences). The kernels' ALiBi twin has no sliding window's
// left bound, no soft-capping and no dropout: those combinations are refused on every device (the
// CPU twin keeps the CUDA semantics), as is softmax_scale = 0 (the kernels add the bias in units of
// the scaled score). Returns the checked slopes, contiguous (undefined for None).
Tensor check_alibi(const c10::optional<Tensor>& alibi_slopes, const Tensor& q, int64_t batch, int64_t nheads,
                   double softmax_scale, double softcap, double dropout_p, const MaskArgs& mask) {
  if (!alibi_slopes.has_value() || !alibi_slopes->defined()) return Tensor();
  const Tensor& a = *alibi_slopes;
  check_same_device(a, "alibi_slopes", q);
  TORCH_CHECK(a.scalar_type() == at::kFloat &&
                  ((a.dim() == 1 && a.size(0) == nheads) || (a.dim() == 2 && a.size(0) == batch && a.size(1) == nheads)),
              "flash_attn_ext: alibi_slopes has dtype ", dtype_name(a.scalar_type()), " and shape ", a.sizes(),
              "; expected float32 of shape (nheads,) = (", nheads, ",) or (batch, nheads) = (", batch, ", ", nheads, ")");
  TORCH_CHECK_VALUE(softmax_scale != 0.0, "flash_attn_ext: alibi_slopes with softmax_scale = 0 is not supported (the "
                                          "kernels add the bias in units of the scaled score)");
  TORCH_CHECK_NOT_IMPLEMENTED(mask.window_left < 0 && softcap == 0.0 && dropout_p == 0.0,
                              "flash_attn_ext: alibi_slopes with ",
                              softcap != 0.0     ? "softcap > 0"
                              : dropout_p != 0.0 ? "dropout_p > 0"
                                                 : "a sliding window's left bound that hides keys (0 <= "
                                                   "window_size[0] < seqlen_k - 1; a KV cache's seqlen_k: its "
                                                   "capacity, the keys in use being known on the device only)",
                              " is not supported; ALiBi runs with causal or full attention (a window's right bound, "
                              "sinks, GQA)");
  return a.contiguous();
}

// After set_fwd_params: the bias in units of the score the kernels scale by p.scale_softmax (the CUDA
// path's positive scale: positive_scale).
void set_alibi(flash::Flash_fwd_params& p, const Tensor& alibi) {
  if (!alibi.defined()) return;
  p.alibi_slopes_ptr = alibi.data_ptr<float>();
  p.alibi_slopes_batch_stride = alibi.dim() == 2 ? alibi.stride(0) : 0;
  p.alibi_unit = float(-1.0 / p.scale_softmax);
}

// A varlen call's slopes for sequence b run alone (the CPU path): row b of (batch, nheads) ones.
c10::optional<Tensor> alibi_of_sequence(const Tensor& alibi, int64_t b) {
  if (!alibi.defined()) return c10::nullopt;
  return alibi.dim() == 2 ? alibi.narrow(0, b, 1) : alibi;
}

// The sinks' head axis broadcast over a (..., nheads at head_dim, ...) plane of `rank` dims.
Tensor sinks_along(const Tensor& sinks, int64_t rank, int64_t head_dim) {
  std::vector<int64_t> shape(rank, 1);
  shape[head_dim] = sinks.size(0);
  return sinks.view(shape);
}

// softmax_lse of rows that see no key: +inf, or with sinks the head's sink (+inf for a -inf one).
// `head_dim`: the head dimension of lse ((batch, nheads, seqlen_q): 1; (nheads, total_q): 0).
void fill_keyless_lse(Tensor& lse, const Tensor& sinks, int64_t head_dim) {
  const float inf = std::numeric_limits<float>::infinity();
  if (!sinks.defined()) {
    lse.fill_(inf);
    return;
  }
  lse.copy_(sinks_along(at::where(sinks == -inf, inf, sinks), lse.dim(), head_dim).expand_as(lse));
}

// dsinks (the backward ops' optional output buffer for the sinks' gradient): None, or (nheads,) float32
// contiguous on q's device, given with sinks.
void check_dsinks(const c10::optional<Tensor>& dsinks, const Tensor& sinks, const Tensor& q, int64_t nheads) {
  if (!dsinks.has_value() || !dsinks->defined()) return;
  TORCH_CHECK(sinks.defined(), "flash_attn_ext: dsinks (the sinks' gradient buffer) was given without sinks");
  check_same_device(*dsinks, "dsinks", q);
  TORCH_CHECK(dsinks->scalar_type() == at::kFloat && dsinks->dim() == 1 && dsinks->size(0) == nheads &&
                  dsinks->is_contiguous(),
              "flash_attn_ext: dsinks has dtype ", dtype_name(dsinks->scalar_type()), " and shape ", dsinks->sizes(),
              "; expected contiguous float32 (nheads,) = (", nheads, ",)");
}

// The sinks' gradient (FlashAttention-2 Alg. 2's D with the sink as one more key of value 0):
// d sinks[h] = -sum over the rows i of head h of exp(sinks[h] - LSE_i) D_i. p_sink: exp(sinks[h] -
// LSE_i) per row, d: D_i, both with the head along `head_dim` and nothing else per head (rows
// without keys or outside every sequence have D = 0). A torch reduction: deterministic.
void sinks_grad_into(Tensor& dsinks, const Tensor& p_sink, const Tensor& d, int64_t head_dim) {
  std::vector<int64_t> other;
  for (int64_t i = 0; i < d.dim(); ++i) {
    if (i != head_dim) other.push_back(i);
  }
  // D = 0 (out 0: no keys, a +inf sink) gives 0, also where p_sink is NaN or inf there.
  const Tensor term = at::where(d == 0, at::zeros({}, d.options()), p_sink * d);
  dsinks.copy_(term.sum(other).neg());
}

// CPU: D = rowsum(dout o out) in the accumulation type (float64 for float32 / float64 inputs, else
// float32) over BSHD rows; lse_rows: softmax_lse as (batch, seqlen_q, nheads), holding the sink;
// stats_rows: undefined or softmax_stats as (2, batch, seqlen_q, nheads): then the sink's P is
// exp2(sink log2(e) - max - log2sum), exact at any magnitude (the float32 LSE errs by ~|LSE| 2^-24).
void sinks_grad_cpu(Tensor& dsinks, const Tensor& dout, const Tensor& out, const Tensor& lse_rows,
                    const Tensor& stats_rows, const Tensor& sinks) {
  const auto acc = (out.scalar_type() == at::kDouble || out.scalar_type() == at::kFloat) ? at::kDouble : at::kFloat;
  const Tensor d = (dout.to(acc) * out.to(acc)).sum(-1);  // (batch, seqlen_q, nheads)
  const Tensor s = sinks_along(sinks.to(acc), d.dim(), d.dim() - 1);
  const Tensor p_sink = stats_rows.defined()
                            ? at::exp2((s * M_LOG2E - stats_rows[0].to(acc)) - stats_rows[1].to(acc))
                            : at::exp(s - lse_rows.to(acc));
  sinks_grad_into(dsinks, p_sink, d, d.dim() - 1);
}

// ---- Params ----------------------------------------------------------------------------

// A BSHD tensor's {ptr, batch/row/head strides} (flash.h).
flash::TensorView view(const Tensor& t) {
  flash::TensorView v;
  v.ptr = t.data_ptr();
  v.batch_stride = t.stride(0), v.row_stride = t.stride(1), v.head_stride = t.stride(2);
  return v;
}

// stats: the (2, batch, nheads, seqlen_q) float32 contiguous softmax_stats, or undefined.
// softcap: checked (check_softcap); 0 or the logit cap, held as float32 (flash.h).
void set_fwd_params(flash::Flash_fwd_params& p, const Sizes& s, const Tensor& q, const Tensor& k,
                    const Tensor& v, const Tensor& out, const Tensor& softmax_lse, const Tensor& stats,
                    double softmax_scale, double softcap, const MaskArgs& mask) {
  p.q = view(q), p.k = view(k), p.v = view(v), p.o = view(out);
  p.h = int(s.nheads);
  p.h_k = int(s.nheads_k);
  p.h_h_k_ratio = int(s.nheads / s.nheads_k);
  p.softmax_lse_ptr = softmax_lse.data_ptr<float>();
  if (stats.defined()) {
    p.row_max_ptr = stats.data_ptr<float>();
    p.row_log2sum_ptr = p.row_max_ptr + stats.numel() / 2;
  }

  p.b = int(s.batch);
  p.seqlen_q = int(s.seqlen_q);
  p.seqlen_k = int(s.seqlen_k);
  p.d = int(s.headdim);
  p.d_rounded = p.d;  // the CUDA path overrides with the compiled head dim
  p.scale_softmax = softmax_scale;
  p.scale_softmax_log2 = float(softmax_scale * M_LOG2E);
  if (softcap > 0) {
    // Soft-capping (flash.h): t = tanh(S * softcap_prescale), then the softmax of softcap * t, so
    // the exp2 scale is softcap * log2(e). Every constant from the float32 cap, so the CPU twin
    // (which reads p.softcap) and the CUDA kernels use one cap.
    p.softcap = float(softcap);
    p.softcap_prescale = float(softmax_scale / double(p.softcap));
    p.scale_softmax_log2 = float(double(p.softcap) * M_LOG2E);
  }
  p.is_causal = mask.causal;
  p.window_left = mask.window_left;  // normalized by mask_args
  p.window_right = mask.window_right;
  p.is_bf16 = q.scalar_type() == at::kBFloat16;
}

void set_bwd_params(flash::Flash_bwd_params& p, const Sizes& s, const Tensor& dout, const Tensor& q,
                    const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& softmax_lse,
                    const Tensor& stats, const Tensor& dq, const Tensor& dk, const Tensor& dv, double softmax_scale,
                    double softcap, const MaskArgs& mask) {
  set_fwd_params(p, s, q, k, v, out, softmax_lse, stats, softmax_scale, softcap, mask);
  p.dout = view(dout), p.dq = view(dq), p.dk = view(dk), p.dv = view(dv);
}

// ---- Shared op bodies ------------------------------------------------------------------
// Outputs are contiguous BSHD; softmax_lse (batch, nheads, seqlen_q) float32; softmax_stats
// (2, batch, nheads, seqlen_q) float32 (flash.h: row max and log2 row sum, log2 units). Empty
// inputs never reach a kernel: batch or seqlen_q == 0 gives empty outputs; seqlen_k == 0 means no
// query sees a key (out = 0, lse = +inf, stats = (+inf, 0), dq = 0).

using FwdOut = std::tuple<Tensor, Tensor, Tensor>;

FwdOut alloc_fwd(const Tensor& q, const Sizes& s) {
  Tensor out = torch::empty(q.sizes(), q.options());
  Tensor lse = torch::empty({s.batch, s.nheads, s.seqlen_q}, q.options().dtype(at::kFloat));
  Tensor stats = torch::empty({2, s.batch, s.nheads, s.seqlen_q}, q.options().dtype(at::kFloat));
  return {out, lse, stats};
}

// True if the kernel must run; otherwise the outputs are already final.
bool fwd_nonempty(FwdOut& outs, const Sizes& s, const Tensor& sinks) {
  if (s.batch == 0 || s.seqlen_q == 0) return false;
  if (s.seqlen_k == 0) {
    std::get<0>(outs).zero_();
    fill_keyless_lse(std::get<1>(outs), sinks, 1);
    std::get<2>(outs)[0].fill_(std::numeric_limits<float>::infinity());
    std::get<2>(outs)[1].zero_();
    return false;
  }
  return true;
}

// The backward's softmax_stats: the caller's (checked, made contiguous) or undefined.
Tensor bwd_stats(const c10::optional<Tensor>& softmax_stats, const Tensor& q, const Sizes& s) {
  if (!softmax_stats.has_value() || !softmax_stats->defined()) return Tensor();
  check_stats(*softmax_stats, q, s);
  return softmax_stats->contiguous();
}

bool bwd_nonempty(Tensor& dq, Tensor& dk, Tensor& dv, const Sizes& s) {
  if (s.batch == 0 || s.seqlen_q == 0 || s.seqlen_k == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return false;
  }
  return true;
}

// ---- CPU -------------------------------------------------------------------------------

flash::cpu::Dtype cpu_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return flash::cpu::Dtype::kFloat32;
    case at::kDouble: return flash::cpu::Dtype::kFloat64;
    case at::kHalf: return flash::cpu::Dtype::kFloat16;
    case at::kBFloat16: return flash::cpu::Dtype::kBFloat16;
    default: TORCH_CHECK(false, "flash_attn_ext: unsupported CPU dtype ", t);
  }
}

// dropout_batch0: the sequence index of batch 0 for the dropout mask (a varlen call's sequence).
FwdOut forward_cpu_impl(const Tensor& q, const Tensor& k, const Tensor& v, double softmax_scale, bool causal,
                        int64_t window_size_left, int64_t window_size_right, const c10::optional<Tensor>& sinks_in,
                        double softcap, double dropout_p, const c10::optional<Tensor>& rng_state, int dropout_batch0,
                        const c10::optional<Tensor>& alibi_slopes) {
  check_sinks_device(sinks_in, q);
  const Sizes s = check_qkv(q, k, v, softmax_scale, /*cuda=*/false);
  check_softcap(softcap, softmax_scale);
  const MaskArgs mask = mask_args(causal, window_size_left, window_size_right, s.seqlen_q, s.seqlen_k);
  const DropoutArgs dropout = check_dropout(dropout_p, rng_state, q, mask, softcap);
  const Tensor alibi = check_alibi(alibi_slopes, q, s.batch, s.nheads, softmax_scale, softcap, dropout_p, mask);
  const Tensor sinks = check_sinks(sinks_in, s.nheads);
  FwdOut outs = alloc_fwd(q, s);
  if (!fwd_nonempty(outs, s, sinks)) return outs;
  const auto& [out, lse, stats] = outs;
  flash::Flash_fwd_params params;
  set_fwd_params(params, s, q, k, v, out, lse, stats, softmax_scale, softcap, mask);
  params.sinks_ptr = sinks_ptr(sinks);
  set_dropout(params, dropout);
  params.dropout_batch0 = dropout_batch0;
  set_alibi(params, alibi);
  flash::cpu::run_mha_fwd_cpu(params, cpu_dtype(q.scalar_type()));
  return outs;
}

FwdOut forward_cpu(const Tensor& q, const Tensor& k, const Tensor& v, double softmax_scale, bool causal,
                   int64_t window_size_left, int64_t window_size_right, const c10::optional<Tensor>& sinks,
                   double softcap, double dropout_p, const c10::optional<Tensor>& rng_state,
                   const c10::optional<Tensor>& alibi_slopes) {
  return forward_cpu_impl(q, k, v, softmax_scale, causal, window_size_left, window_size_right, sinks, softcap,
                          dropout_p, rng_state, 0, alibi_slopes);
}

std::tuple<Tensor, Tensor, Tensor> backward_cpu(const Tensor& dout_in, const Tensor& q, const Tensor& k,
                                                const Tensor& v, const Tensor& out, const Tensor& softmax_lse,
                                                double softmax_scale, bool causal,
                                                const c10::optional<Tensor>& softmax_stats, int64_t window_size_left,
                                                int64_t window_size_right, const c10::optional<Tensor>& sinks_in,
                                                const c10::optional<Tensor>& dsinks, double softcap, double dropout_p,
                                                const c10::optional<Tensor>& rng_state,
                                                const c10::optional<Tensor>& alibi_slopes, int dropout_batch0 = 0) {
  check_sinks_device(sinks_in, q);
  const Sizes s = check_qkv(q, k, v, softmax_scale, /*cuda=*/false);
  check_rank4(dout_in, "dout", "(batch, seqlen_q, nheads, headdim)");
  check_rank4(out, "out", "(batch, seqlen_q, nheads, headdim)");
  check_bwd_extra(dout_in, q, out, softmax_lse, s);
  const Tensor stats = bwd_stats(softmax_stats, q, s);
  check_softcap(softcap, softmax_scale);
  const Tensor sinks = check_sinks(sinks_in, s.nheads);
  check_dsinks(dsinks, sinks, q, s.nheads);
  if (dsinks.has_value() && dsinks->defined()) {
    Tensor ds = *dsinks;
    sinks_grad_cpu(ds, dout_in, out, softmax_lse.transpose(1, 2), stats.defined() ? stats.transpose(2, 3) : Tensor(),
                   sinks);
  }
  const MaskArgs mask = mask_args(causal, window_size_left, window_size_right, s.seqlen_q, s.seqlen_k);
  const DropoutArgs dropout = check_dropout(dropout_p, rng_state, q, mask, softcap);
  const Tensor alibi = check_alibi(alibi_slopes, q, s.batch, s.nheads, softmax_scale, softcap, dropout_p, mask);
  Tensor dq = torch::empty(q.sizes(), q.options());
  Tensor dk = torch::empty(k.sizes(), k.options());
  Tensor dv = torch::empty(v.sizes(), v.options());
  if (!bwd_nonempty(dq, dk, dv, s)) return {dq, dk, dv};
  // Zero strides are fine (out.sum().backward()); only the last dim must be contiguous.
  const Tensor dout = dout_in.stride(-1) == 1 ? dout_in : dout_in.contiguous();
  const Tensor lse = softmax_lse.contiguous();
  flash::Flash_bwd_params params;
  set_bwd_params(params, s, dout, q, k, v, out, lse, stats, dq, dk, dv, softmax_scale, softcap, mask);
  params.sinks_ptr = sinks_ptr(sinks);  // the float64 statistics recompute adds the sink as the forward did
  set_dropout(params, dropout);
  params.dropout_batch0 = dropout_batch0;
  set_alibi(params, alibi);
  flash::cpu::run_mha_bwd_cpu(params, cpu_dtype(q.scalar_type()));
  return {dq, dk, dv};
}

// ---- Varlen: packed sequences (flash_attn_varlen_func) ---------------------------------
// q (total_q, nheads, d), k/v (total_k, nheads_k, d); sequence b = rows [cu_seqlens_q[b],
// cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k/v; cu_seqlens int32
// (batch + 1,) on q's device. Outputs: out like q; softmax_lse (nheads, total_q) float32;
// softmax_stats (2, nheads, total_q) float32. On CUDA the values of cu_seqlens and max_seqlen are
// not read on the host (no device sync): a sequence longer than max_seqlen is cut to its first
// max_seqlen rows / keys, and cu_seqlens past the tensors read out of bounds; the CPU path checks both.

struct VarlenSizes {
  int64_t batch, total_q, total_k, nheads, nheads_k, headdim;
};

void check_rank3(const Tensor& t, const char* name, const char* layout) {
  TORCH_CHECK(t.dim() == 3, "flash_attn_ext: ", name, " must be 3-D ", layout, " (packed varlen), got ", t.dim(),
              "-D of shape ", t.sizes());
}

void check_cu_seqlens(const Tensor& cu, const char* name, const Tensor& q) {
  check_same_device(cu, name, q);
  TORCH_CHECK(cu.scalar_type() == at::kInt, "flash_attn_ext: ", name, " has dtype ", dtype_name(cu.scalar_type()),
              "; expected int32");
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, "flash_attn_ext: ", name, " has shape ", cu.sizes(),
              "; expected (batch + 1,) with batch >= 0");
  TORCH_CHECK(cu.is_contiguous(), "flash_attn_ext: ", name, " must be contiguous");
}

// The 3-D q/k/v of a varlen call as the 4-D dense checks see them, plus cu_seqlens and max_seqlen.
VarlenSizes check_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                         const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                         double softmax_scale, bool cuda) {
  check_rank3(q, "q", "(total_q, nheads, headdim)");
  check_rank3(k, "k", "(total_k, nheads_k, headdim)");
  check_rank3(v, "v", "(total_k, nheads_k, headdim)");
  TORCH_CHECK(v.size(0) == k.size(0), "flash_attn_ext: v has ", v.size(0), " rows but k has total_k = ", k.size(0),
              "; expected equal");
  check_devices_dtypes(q, k, v, cuda, "k", "v");
  check_heads_headdim(q, k, v, "k", "v");
  check_last_dims_scale(q, k, v, softmax_scale);
  check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q);
  check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q);
  TORCH_CHECK(cu_seqlens_q.size(0) == cu_seqlens_k.size(0), "flash_attn_ext: cu_seqlens_q has ",
              cu_seqlens_q.size(0), " entries but cu_seqlens_k has ", cu_seqlens_k.size(0),
              "; expected equal (batch + 1 each)");
  TORCH_CHECK(cu_seqlens_q.size(0) - 1 <= std::numeric_limits<int>::max(),
              "flash_attn_ext: batch (cu_seqlens_q.size(0) - 1) must fit in int32, got ", cu_seqlens_q.size(0) - 1);
  const int64_t max_len = flash::kMaxSeqlen;
  TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_q <= max_len && max_seqlen_k >= 0 && max_seqlen_k <= max_len,
              "flash_attn_ext: max_seqlen_q and max_seqlen_k must be in [0, 2^31 - 256 = ", max_len,
              "] (tile counts are int32), got ", max_seqlen_q, " and ", max_seqlen_k);
  TORCH_CHECK(q.size(0) <= max_len && k.size(0) <= max_len, "flash_attn_ext: total_q and total_k must be at most 2^31 - "
              "256 = ", max_len, " (tile counts are int32), got ", q.size(0), " and ", k.size(0));
  return VarlenSizes{cu_seqlens_q.size(0) - 1, q.size(0), k.size(0), q.size(1), k.size(1), q.size(2)};
}

// The CPU path reads cu_seqlens on the host: from 0, non-decreasing, inside the tensors, within max_seqlen.
std::vector<int> host_cu_seqlens(const Tensor& cu, const char* name, int64_t total, int64_t max_seqlen,
                                 const char* max_name) {
  const auto a = cu.accessor<int, 1>();
  std::vector<int> out(a.size(0));
  for (int64_t i = 0; i < a.size(0); ++i) {
    out[i] = a[i];
    TORCH_CHECK(i > 0 || out[0] == 0, "flash_attn_ext: ", name, "[0] = ", out[0], "; expected 0 (cu_seqlens start at 0)");
    TORCH_CHECK(out[i] >= 0 && out[i] <= total, "flash_attn_ext: ", name, "[", i, "] = ", out[i],
                " is outside [0, ", total, "] (the packed tensor's rows)");
    if (i > 0) {
      TORCH_CHECK(out[i] >= out[i - 1], "flash_attn_ext: ", name, " must be non-decreasing, got ", name, "[", i - 1,
                  "] = ", out[i - 1], " > ", name, "[", i, "] = ", out[i]);
      TORCH_CHECK(out[i] - out[i - 1] <= max_seqlen, "flash_attn_ext: sequence ", i - 1, " has ", out[i] - out[i - 1],
                  " rows (", name, ") but ", max_name, " = ", max_seqlen, "; expected max_seqlen >= every length");
    }
  }
  return out;
}

FwdOut alloc_varlen_fwd(const Tensor& q, const VarlenSizes& s) {
  Tensor out = torch::empty(q.sizes(), q.options());
  Tensor lse = torch::empty({s.nheads, s.total_q}, q.options().dtype(at::kFloat));
  Tensor stats = torch::empty({2, s.nheads, s.total_q}, q.options().dtype(at::kFloat));
  return {out, lse, stats};
}

void check_varlen_bwd_extra(const Tensor& dout, const Tensor& q, const Tensor& out, const Tensor& softmax_lse,
                            const c10::optional<Tensor>& softmax_stats, const VarlenSizes& s) {
  check_same_device(dout, "dout", q);
  check_same_device(out, "out", q);
  check_same_device(softmax_lse, "softmax_lse", q);
  check_same_dtype(dout, "dout", q);
  check_same_dtype(out, "out", q);
  TORCH_CHECK(dout.sizes() == q.sizes(), "flash_attn_ext: dout has shape ", dout.sizes(), "; expected q's shape ",
              q.sizes());
  TORCH_CHECK(out.sizes() == q.sizes(), "flash_attn_ext: out has shape ", out.sizes(), "; expected q's shape ",
              q.sizes());
  check_last_dim_contiguous(out, "out");
  TORCH_CHECK(softmax_lse.scalar_type() == at::kFloat && softmax_lse.dim() == 2 && softmax_lse.size(0) == s.nheads &&
                  softmax_lse.size(1) == s.total_q,
              "flash_attn_ext: softmax_lse has shape ", softmax_lse.sizes(), " and dtype ",
              dtype_name(softmax_lse.scalar_type()),
              "; expected (nheads, total_q) = (", s.nheads, ", ", s.total_q, ") float32");
  if (softmax_stats.has_value() && softmax_stats->defined()) {
    const Tensor& st = *softmax_stats;
    check_same_device(st, "softmax_stats", q);
    TORCH_CHECK(st.scalar_type() == at::kFloat && st.dim() == 3 && st.size(0) == 2 && st.size(1) == s.nheads &&
                    st.size(2) == s.total_q,
                "flash_attn_ext: softmax_stats has shape ", st.sizes(), " and dtype ", dtype_name(st.scalar_type()),
                "; expected (2, nheads, total_q) = (2, ", s.nheads, ", ", s.total_q,
                ") float32, the varlen forward's third output");
  }
}

// Sequence b of a packed tensor as a batch-1 BSHD tensor (the CPU path runs it through the dense kernel).
Tensor seq_slice(const Tensor& t, int begin, int end) { return t.narrow(0, begin, end - begin).unsqueeze(0); }

FwdOut varlen_forward_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                          const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                          bool causal, int64_t window_size_left, int64_t window_size_right,
                          const c10::optional<Tensor>& sinks_in, double softcap, double dropout_p,
                          const c10::optional<Tensor>& rng_state, const c10::optional<Tensor>& alibi_slopes) {
  check_sinks_device(sinks_in, q);
  const VarlenSizes s = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                     /*cuda=*/false);
  check_softcap(softcap, softmax_scale);
  // Before the first sequence, as the CUDA path checks them (the longest sequence's mask).
  const MaskArgs mask = mask_args(causal, window_size_left, window_size_right, max_seqlen_q, max_seqlen_k);
  check_dropout(dropout_p, rng_state, q, mask, softcap);
  const Tensor alibi = check_alibi(alibi_slopes, q, s.batch, s.nheads, softmax_scale, softcap, dropout_p, mask);
  const Tensor sinks = check_sinks(sinks_in, s.nheads);
  const auto cq = host_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", s.total_q, max_seqlen_q, "max_seqlen_q");
  const auto ck = host_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", s.total_k, max_seqlen_k, "max_seqlen_k");
  FwdOut outs = alloc_varlen_fwd(q, s);
  auto& [out, lse, stats] = outs;
  // Rows outside every sequence: out 0, lse +inf (the CUDA path leaves them unwritten).
  out.zero_();
  lse.fill_(std::numeric_limits<float>::infinity());
  stats[0].fill_(std::numeric_limits<float>::infinity());
  stats[1].zero_();
  for (int64_t b = 0; b < s.batch; ++b) {
    if (cq[b + 1] == cq[b]) continue;
    const auto [o_b, lse_b, stats_b] =
        forward_cpu_impl(seq_slice(q, cq[b], cq[b + 1]), seq_slice(k, ck[b], ck[b + 1]), seq_slice(v, ck[b], ck[b + 1]),
                         softmax_scale, causal, window_size_left, window_size_right, sinks, softcap, dropout_p,
                         rng_state, int(b), alibi_of_sequence(alibi, b));
    out.narrow(0, cq[b], cq[b + 1] - cq[b]).copy_(o_b[0]);
    lse.narrow(1, cq[b], cq[b + 1] - cq[b]).copy_(lse_b[0]);
    stats.narrow(2, cq[b], cq[b + 1] - cq[b]).copy_(stats_b.select(1, 0));
  }
  return outs;
}

std::tuple<Tensor, Tensor, Tensor> varlen_backward_cpu(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                       const Tensor& v, const Tensor& out, const Tensor& softmax_lse,
                                                       const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                       int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                                                       bool causal, const c10::optional<Tensor>& softmax_stats,
                                                       int64_t window_size_left, int64_t window_size_right,
                                                       const c10::optional<Tensor>& sinks_in, double softcap,
                                                       double dropout_p, const c10::optional<Tensor>& rng_state,
                                                       const c10::optional<Tensor>& alibi_slopes) {
  check_sinks_device(sinks_in, q);
  const VarlenSizes s = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                     /*cuda=*/false);
  const Tensor sinks = check_sinks(sinks_in, s.nheads);
  check_rank3(dout, "dout", "(total_q, nheads, headdim)");
  check_rank3(out, "out", "(total_q, nheads, headdim)");
  check_varlen_bwd_extra(dout, q, out, softmax_lse, softmax_stats, s);
  check_softcap(softcap, softmax_scale);
  // Before the first sequence.
  const MaskArgs mask = mask_args(causal, window_size_left, window_size_right, max_seqlen_q, max_seqlen_k);
  check_dropout(dropout_p, rng_state, q, mask, softcap);
  const Tensor alibi = check_alibi(alibi_slopes, q, s.batch, s.nheads, softmax_scale, softcap, dropout_p, mask);
  const auto cq = host_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", s.total_q, max_seqlen_q, "max_seqlen_q");
  const auto ck = host_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", s.total_k, max_seqlen_k, "max_seqlen_k");
  const bool has_stats = softmax_stats.has_value() && softmax_stats->defined();
  // Rows outside every sequence get zero gradients (the CUDA path leaves them unwritten).
  Tensor dq = torch::zeros(q.sizes(), q.options());
  Tensor dk = torch::zeros(k.sizes(), k.options());
  Tensor dv = torch::zeros(v.sizes(), v.options());
  for (int64_t b = 0; b < s.batch; ++b) {
    const int q0 = cq[b], q1 = cq[b + 1], k0 = ck[b], k1 = ck[b + 1];
    if (q1 == q0 && k1 == k0) continue;
    c10::optional<Tensor> stats_b;
    if (has_stats) stats_b = softmax_stats->narrow(2, q0, q1 - q0).unsqueeze(1);
    const auto [dq_b, dk_b, dv_b] =
        backward_cpu(seq_slice(dout, q0, q1), seq_slice(q, q0, q1), seq_slice(k, k0, k1), seq_slice(v, k0, k1),
                     seq_slice(out, q0, q1), softmax_lse.narrow(1, q0, q1 - q0).unsqueeze(0), softmax_scale, causal,
                     stats_b, window_size_left, window_size_right, sinks, c10::nullopt, softcap, dropout_p, rng_state,
                     alibi_of_sequence(alibi, b), int(b));
    dq.narrow(0, q0, q1 - q0).copy_(dq_b[0]);
    dk.narrow(0, k0, k1 - k0).copy_(dk_b[0]);
    dv.narrow(0, k0, k1 - k0).copy_(dv_b[0]);
  }
  return {dq, dk, dv};
}

// ---- KV cache (flash_attn_with_kvcache) -------------------------------------------------
// q (batch, seqlen_q, nheads, d); k_cache / v_cache (batch, seqlen_cache, nheads_k, d), or paged
// (num_blocks, page_size, nheads_k, d) with block_table int32 (batch, max_blocks); cache_seqlens
// int32 (batch,) or None (every cache row is used); k / v new (batch, seqlen_new, nheads_k, d)
// written into the cache at rows cache_seqlens[b] + i (in place; the caller advances
// cache_seqlens). Sequence b attends to the first cache_seqlens[b] + seqlen_new cache rows
// (causal: bottom-right aligned against that count); with cache_leftpad int32 (batch,) (contiguous
// caches) only rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new), as a sequence of that many
// keys. Returns out (q's shape) and softmax_lse (batch, nheads, seqlen_q) float32. On CUDA the
// values of cache_seqlens, cache_leftpad and block_table are not read on the host: rows past the
// cache are dropped from the append and from the attention, a leftpad is capped to [0, the rows in
// use], block numbers outside [0, num_blocks) are not checked; the CPU path checks all three.

struct KvcacheSizes {
  Sizes s;  // batch, seqlen_q, seqlen_k (cache capacity per sequence), nheads, nheads_k, headdim
  int64_t seqlen_new = 0, page_size = 0, num_blocks = 0, max_blocks = 0;
  bool paged = false;
};

// One int32 per sequence, contiguous, on q's device (cache_seqlens, cache_leftpad).
void check_per_sequence_int32(const Tensor& t, const char* name, const Tensor& q) {
  check_same_device(t, name, q);
  TORCH_CHECK(t.scalar_type() == at::kInt, "flash_attn_ext: ", name, " has dtype ", dtype_name(t.scalar_type()),
              "; expected int32");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == q.size(0), "flash_attn_ext: ", name, " has shape ", t.sizes(),
              "; expected (batch,) = (", q.size(0), ",)");
  TORCH_CHECK(t.is_contiguous(), "flash_attn_ext: ", name, " must be contiguous");
}

KvcacheSizes check_kvcache(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const c10::optional<Tensor>& k,
                           const c10::optional<Tensor>& v, const c10::optional<Tensor>& cache_seqlens,
                           const c10::optional<Tensor>& block_table, double softmax_scale, int64_t num_splits,
                           bool cuda, const c10::optional<Tensor>& cache_leftpad) {
  check_rank4(q, "q", "(batch, seqlen_q, nheads, headdim)");
  check_rank4(k_cache, "k_cache", "(batch_cache, seqlen_cache, nheads_k, headdim) or paged (num_blocks, page_size, "
                                  "nheads_k, headdim)");
  check_rank4(v_cache, "v_cache", "like k_cache");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "flash_attn_ext: v_cache has shape ", v_cache.sizes(),
              " but k_cache has shape ", k_cache.sizes(), "; expected equal");
  KvcacheSizes ks;
  ks.paged = block_table.has_value() && block_table->defined();
  const int64_t batch = q.size(0);
  if (ks.paged) {
    const Tensor& bt = *block_table;
    check_same_device(bt, "block_table", q);
    TORCH_CHECK(bt.scalar_type() == at::kInt, "flash_attn_ext: block_table has dtype ", dtype_name(bt.scalar_type()),
                "; expected int32");
    TORCH_CHECK(bt.dim() == 2 && bt.size(0) == batch && bt.size(1) >= 1, "flash_attn_ext: block_table has shape ",
                bt.sizes(), "; expected (batch, max_blocks) = (", batch, ", >= 1)");
    TORCH_CHECK(bt.stride(1) == 1, "flash_attn_ext: block_table must have a contiguous last dimension");
    ks.page_size = k_cache.size(1);
    ks.num_blocks = k_cache.size(0);
    ks.max_blocks = bt.size(1);
    TORCH_CHECK(ks.page_size > 0 && ks.page_size % 16 == 0, "flash_attn_ext: paged k_cache has page_size ",
                ks.page_size, " (k_cache.size(1)); expected a positive multiple of 16");
    TORCH_CHECK(ks.num_blocks <= std::numeric_limits<int>::max(), "flash_attn_ext: paged k_cache's num_blocks "
                "(k_cache.size(0)) must be at most 2^31 - 1 (block_table holds int32 block numbers), got ",
                ks.num_blocks);
    TORCH_CHECK(ks.max_blocks * ks.page_size <= flash::kMaxSeqlen,
                "flash_attn_ext: block_table.size(1) * page_size (the longest sequence's cache) must be at most "
                "2^31 - 256 = ", flash::kMaxSeqlen, ", got ", ks.max_blocks, " * ", ks.page_size);
  } else {
    TORCH_CHECK(k_cache.size(0) == batch, "flash_attn_ext: k_cache has batch ", k_cache.size(0), " but q has batch ",
                batch, "; expected equal (or pass block_table for a paged cache)");
  }
  check_devices_dtypes(q, k_cache, v_cache, cuda, "k_cache", "v_cache");
  check_heads_headdim(q, k_cache, v_cache, "k_cache", "v_cache");
  TORCH_CHECK(batch <= std::numeric_limits<int>::max() && k_cache.size(1) <= flash::kMaxSeqlen &&
                  q.size(1) * (q.size(2) / k_cache.size(2)) <= flash::kMaxSeqlen,
              "flash_attn_ext: batch must fit in int32, seqlen_cache and seqlen_q * nheads / nheads_k (the packed "
              "rows of a kv head) be at most 2^31 - 256 = ", flash::kMaxSeqlen, " (tile counts are int32), got q "
              "shape ", q.sizes(), ", k_cache shape ", k_cache.sizes());
  check_last_dim_contiguous(q, "q");
  const char* in_place = "; the cache is written in place, so it cannot be copied: allocate it with a contiguous "
                         "last dimension";
  check_last_dim_contiguous(k_cache, "k_cache", in_place);
  check_last_dim_contiguous(v_cache, "v_cache", in_place);
  check_softmax_scale(softmax_scale);
  ks.s = Sizes{batch, q.size(1), ks.paged ? ks.max_blocks * ks.page_size : k_cache.size(1), q.size(2), k_cache.size(2),
               q.size(3)};
  if (cache_seqlens.has_value() && cache_seqlens->defined()) {
    check_per_sequence_int32(*cache_seqlens, "cache_seqlens", q);
  }
  if (cache_leftpad.has_value() && cache_leftpad->defined()) {
    check_per_sequence_int32(*cache_leftpad, "cache_leftpad", q);
    TORCH_CHECK(!ks.paged, "flash_attn_ext: cache_leftpad with block_table: a paged cache is not left-padded "
                           "(as flash-attn's); pass one of them");
  }
  const bool has_k = k.has_value() && k->defined(), has_v = v.has_value() && v->defined();
  TORCH_CHECK(has_k == has_v, "flash_attn_ext: k and v (the new keys and values) must be given together");
  if (has_k) {
    TORCH_CHECK(cache_seqlens.has_value() && cache_seqlens->defined(),
                "flash_attn_ext: k / v (new keys) need cache_seqlens: they are written at rows cache_seqlens[b] + i");
    for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{*k, "k"}, {*v, "v"}}) {
      check_rank4(t, name, "(batch, seqlen_new, nheads_k, headdim)");
      check_same_device(t, name, q);
      check_same_dtype(t, name, q);
      TORCH_CHECK(t.size(0) == batch && t.size(2) == ks.s.nheads_k && t.size(3) == ks.s.headdim,
                  "flash_attn_ext: ", name, " has shape ", t.sizes(), "; expected (batch, seqlen_new, nheads_k, headdim) = (",
                  batch, ", seqlen_new, ", ks.s.nheads_k, ", ", ks.s.headdim, ")");
      check_last_dim_contiguous(t, name);
    }
    TORCH_CHECK(v->size(1) == k->size(1), "flash_attn_ext: v has seqlen_new ", v->size(1), " but k has ", k->size(1),
                "; expected equal");
    ks.seqlen_new = k->size(1);
    TORCH_CHECK(ks.seqlen_new <= ks.s.seqlen_k, "flash_attn_ext: k's seqlen_new (k.size(1)) must be at most the "
                "cache's rows per sequence (", ks.paged ? "block_table.size(1) * page_size" : "k_cache.size(1)",
                "), got ", ks.seqlen_new, " and ", ks.s.seqlen_k);
    // One memory for both caches (views of one storage with an element in common: views_meet): the
    // append's v rows would overwrite its k rows, unless both are one view and k is v (the same
    // writes). Read-only calls may share it.
    const bool one_view = k_cache.is_alias_of(v_cache) && k_cache.storage_offset() == v_cache.storage_offset() &&
                          k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides();
    const Meet meet = !k_cache.is_alias_of(v_cache) || (one_view && k->is_same(*v)) ? Meet::kNo
                                                                                  : views_meet(k_cache, v_cache);
    TORCH_CHECK(meet == Meet::kNo, "flash_attn_ext: k_cache and v_cache ",
                meet == Meet::kYes ? "share memory" : "may share memory (views of one buffer whose strides the "
                                                      "check could not clear in 2^16 steps)",
                ", so appending k and v would write one over the other; pass caches with memory of their own "
                "(calls without k / v may share it)");
    for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{k_cache, "k_cache"}, {v_cache, "v_cache"}}) {
      for (int64_t d = 0; d < 3; ++d) {
        TORCH_CHECK(t.stride(d) != 0 || t.size(d) <= 1, "flash_attn_ext: ", name, " has stride 0 in dim ", d,
                    " (an expanded view): appending k / v would write one cache row for several; pass a cache "
                    "with its own storage per row");
      }
      const Meet self = has_internal_overlap(t);
      TORCH_CHECK(self == Meet::kNo, "flash_attn_ext: ", name, " has strides ", t.strides(), " for shape ", t.sizes(),
                  self == Meet::kYes ? ", under which two of its elements share memory"
                                     : ", which the check could not clear of shared elements in 2^16 steps",
                  ": appending k / v would write one over the other; pass a cache with its own storage per element");
    }
  }
  TORCH_CHECK(num_splits >= 0 && num_splits <= flash::kMaxSplits, "flash_attn_ext: num_splits must be in [0, ",
              flash::kMaxSplits, "] (0: chosen from the shapes), got ", num_splits);
  return ks;
}

// The cache row pointer of (sequence b, row r): a CPU-side view for the append and the gather.
Tensor cache_rows(const Tensor& cache, const KvcacheSizes& ks, const std::vector<int>& table_row, int64_t b,
                  int64_t rows) {
  if (!ks.paged) return cache[b].narrow(0, 0, rows);
  std::vector<Tensor> pages;
  for (int64_t r = 0; r < rows; r += ks.page_size) pages.push_back(cache[table_row[r / ks.page_size]]);
  return pages.empty() ? cache.narrow(0, 0, 0).flatten(0, 1) : at::cat(pages, 0).narrow(0, 0, rows);
}

// The append's sources and the query where their memory overlaps a cache the append writes (e.g.
// a view of the very rows written): copied first, so that the call reads them as they were
// before it (the append writes rows in parallel and would read some already overwritten). In the
// op, not its Python wrapper, so compiled calls get it too (their tracer does not see a view's
// aliasing, and inductor drops a copy made there). ATen's overlap test on tensors of one storage
// (views it cannot decide, not dense, count as overlapping); other inputs are never copied.
bool overlaps(const Tensor& t, const Tensor& cache) {
  return t.is_alias_of(cache) && at::get_overlap_status(t, cache) != at::MemOverlapStatus::No;
}
struct KvcacheInputs {
  Tensor q;
  c10::optional<Tensor> k, v;
};
KvcacheInputs unaliased_kvcache_inputs(const Tensor& q, const c10::optional<Tensor>& k, const c10::optional<Tensor>& v,
                                       const Tensor& k_cache, const Tensor& v_cache) {
  if (!k.has_value() || !k->defined() || !v.has_value() || !v->defined()) return {q, k, v};
  const auto own = [&](const Tensor& t) {
    return overlaps(t, k_cache) || overlaps(t, v_cache) ? t.clone() : t;
  };
  return {own(q), own(*k), own(*v)};
}

std::tuple<Tensor, Tensor> fwd_kvcache_cpu(const Tensor& q_in, const Tensor& k_cache, const Tensor& v_cache,
                                           const c10::optional<Tensor>& k_in, const c10::optional<Tensor>& v_in,
                                           const c10::optional<Tensor>& cache_seqlens,
                                           const c10::optional<Tensor>& block_table, double softmax_scale, bool causal,
                                           int64_t num_splits, int64_t window_size_left, int64_t window_size_right,
                                           const c10::optional<Tensor>& sinks_in,
                                           const c10::optional<Tensor>& cache_leftpad, double softcap,
                                           const c10::optional<Tensor>& alibi_slopes) {
  check_sinks_device(sinks_in, q_in);
  const KvcacheSizes ks = check_kvcache(q_in, k_cache, v_cache, k_in, v_in, cache_seqlens, block_table, softmax_scale,
                                        num_splits, /*cuda=*/false, cache_leftpad);
  check_softcap(softcap, softmax_scale);
  const auto [q, k, v] = unaliased_kvcache_inputs(q_in, k_in, v_in, k_cache, v_cache);
  // Before the append.
  const MaskArgs mask = mask_args(causal, window_size_left, window_size_right, ks.s.seqlen_q, ks.s.seqlen_k);
  const Tensor alibi = check_alibi(alibi_slopes, q_in, ks.s.batch, ks.s.nheads, softmax_scale, softcap, 0.0, mask);
  const Tensor sinks = check_sinks(sinks_in, ks.s.nheads);
  const Sizes& s = ks.s;
  const bool has_seqlens = cache_seqlens.has_value() && cache_seqlens->defined();
  Tensor out = torch::empty(q.sizes(), q.options());
  Tensor lse = torch::empty({s.batch, s.nheads, s.seqlen_q}, q.options().dtype(at::kFloat));
  // Every value is checked before the first append (an error leaves the cache as it was).
  std::vector<std::vector<int>> table(s.batch);
  std::vector<int64_t> cached(s.batch, s.seqlen_k), leftpad(s.batch, 0);
  const bool has_leftpad = cache_leftpad.has_value() && cache_leftpad->defined();
  for (int64_t b = 0; b < s.batch; ++b) {
    if (has_seqlens) cached[b] = cache_seqlens->accessor<int, 1>()[b];
    TORCH_CHECK(cached[b] >= 0, "flash_attn_ext: cache_seqlens[", b, "] = ", cached[b], "; expected >= 0");
    TORCH_CHECK(cached[b] + ks.seqlen_new <= s.seqlen_k, "flash_attn_ext: cache_seqlens[", b,
                "] = ", cached[b], " plus seqlen_new = ", ks.seqlen_new, " exceeds the cache's ", s.seqlen_k,
                " rows per sequence");
    if (has_leftpad) leftpad[b] = cache_leftpad->accessor<int, 1>()[b];
    TORCH_CHECK(leftpad[b] >= 0 && leftpad[b] <= cached[b] + ks.seqlen_new, "flash_attn_ext: cache_leftpad[", b,
                "] = ", leftpad[b], "; expected in [0, cache_seqlens[b] + seqlen_new = ", cached[b] + ks.seqlen_new,
                "]");
    if (!ks.paged) continue;
    const auto bt = block_table->accessor<int, 2>();
    for (int64_t j = 0; j < ks.max_blocks; ++j) table[b].push_back(bt[b][j]);
    for (int64_t j = 0; j * ks.page_size < cached[b] + ks.seqlen_new; ++j) {
      TORCH_CHECK(table[b][j] >= 0 && table[b][j] < ks.num_blocks, "flash_attn_ext: block_table[", b, ", ", j,
                  "] = ", table[b][j], " is outside [0, num_blocks = ", ks.num_blocks, ")");
    }
  }
  for (int64_t b = 0; b < s.batch; ++b) {
    // Append the new keys / values at rows cached .. cached + seqlen_new (in place).
    for (int64_t i = 0; i < ks.seqlen_new; ++i) {
      const int64_t r = cached[b] + i;
      const int64_t blk = ks.paged ? table[b][r / ks.page_size] : b, row = ks.paged ? r % ks.page_size : r;
      k_cache[blk][row].copy_((*k)[b][i]);
      v_cache[blk][row].copy_((*v)[b][i]);
    }
  }
  for (int64_t b = 0; b < s.batch && s.seqlen_q > 0; ++b) {
    // Sequence b's keys: cache rows [leftpad, cached + seqlen_new), as a sequence of their own.
    const int64_t len_k = cached[b] + ks.seqlen_new, lp = leftpad[b];
    const Tensor k_b = cache_rows(k_cache, ks, table[b], b, len_k).narrow(0, lp, len_k - lp);
    const Tensor v_b = cache_rows(v_cache, ks, table[b], b, len_k).narrow(0, lp, len_k - lp);
    const auto [o_b, lse_b, stats_b] =
        forward_cpu(q.narrow(0, b, 1), k_b.unsqueeze(0), v_b.unsqueeze(0), softmax_scale, causal, window_size_left,
                    window_size_right, sinks, softcap, /*dropout_p=*/0.0, c10::nullopt, alibi_of_sequence(alibi, b));
    out[b].copy_(o_b[0]);
    lse[b].copy_(lse_b[0]);
  }
  return {out, lse};
}

// ---- CUDA ------------------------------------------------------------------------------
#ifdef FLASH_ATTN_EXT_WITH_CUDA

// The kernels load rows with 16-byte vector copies of 16-bit elements: the base pointer and every
// stride but the last must be multiples of 8 elements (16 bytes), the last stride 1. Any rank:
// BSHD (batch, seqlen, heads, d) and packed (total, heads, d) tensors alike.
bool cuda_aligned(const Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0 || t.stride(-1) != 1) return false;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    if (t.stride(i) % 8 != 0) return false;
  }
  return true;
}

// Any other view is copied once, into a fresh allocation: clone, not contiguous(), which returns
// a contiguous view with a misaligned base (e.g. buffer[1:].view(...)) as it is.
Tensor aligned_for_cuda(const Tensor& t) { return cuda_aligned(t) ? t : t.clone(at::MemoryFormat::Contiguous); }

// The CUDA kernels take softmax_scale > 0 (their softmax keeps the row max of the raw scores,
// primitives/softmax.cuh). Scores only enter as softmax_scale * q.k, so a negative scale runs as
// |scale| on -q, and a zero scale (every visible key weighs the same) as scale 1 on q = 0; the
// backward maps dq back (dq = -dq' and dq = 0; dk and dv need nothing: scale' q' = scale q).
std::pair<Tensor, double> positive_scale(const Tensor& q, double softmax_scale) {
  if (softmax_scale > 0) return {q, softmax_scale};
  if (softmax_scale < 0) return {q.neg(), -softmax_scale};
  return {torch::zeros_like(q), 1.0};
}

void set_device_facts(flash::Flash_fwd_params& p, int device) {
  int major = 0, minor = 0, num_sms = 0, l2_bytes = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  p.arch = major * 10 + minor;
  p.num_sms = num_sms;
  p.l2_bytes = l2_bytes;
}

// Runs a dispatch point (flash.h) on the current stream; its std::runtime_error (a check or a
// failed launch) becomes a RuntimeError with the same message.
template <typename Params>
void run_on_stream(void (*dispatch)(Params&, cudaStream_t), Params& params) {
  try {
    dispatch(params, c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
}

// The compiled head dim and the device's facts into params, then run_on_stream.
template <typename Params>
void launch_on_device(void (*dispatch)(Params&, cudaStream_t), Params& params, int d_rounded, int device) {
  params.d_rounded = d_rounded;
  set_device_facts(params, device);
  run_on_stream(dispatch, params);
}

// The backward's workspaces (flash.h; FA2 Alg. 2 line 5, written by the preprocess kernel): D,
// LSE_log2 = hi + lo as three float32 planes of shape `plane`, and one precise_rows flag per 128
// rows, (batch, nheads, seqlen_q_rounded / 128) int32. Returned to keep them alive over the launch.
std::pair<Tensor, Tensor> set_bwd_workspaces(flash::Flash_bwd_params& p, at::IntArrayRef plane, int64_t batch,
                                             int64_t nheads, int64_t seqlen_q_rounded, const Tensor& q) {
  std::vector<int64_t> shape{3};
  shape.insert(shape.end(), plane.begin(), plane.end());
  Tensor ws = torch::empty(shape, q.options().dtype(at::kFloat));
  Tensor precise_rows = torch::empty({batch, nheads, seqlen_q_rounded / 128}, q.options().dtype(at::kInt));
  p.dsoftmax_sum_ptr = ws[0].data_ptr<float>();
  p.softmax_lse_log2_ptr = ws[1].data_ptr<float>();
  p.softmax_lse_log2_lo_ptr = ws[2].data_ptr<float>();
  p.precise_rows_ptr = precise_rows.data_ptr<int>();
  p.seqlen_q_rounded = int(seqlen_q_rounded);
  return {ws, precise_rows};
}

// dq of the caller's softmax_scale from the kernels' positive one (positive_scale).
void scale_dq_back(Tensor& dq, double softmax_scale) {
  if (softmax_scale < 0) dq.neg_();
  if (softmax_scale == 0) dq.zero_();
}

int cuda_rounded_headdim(int d) {
  const int d_rounded = flash::rounded_headdim(d);
  TORCH_CHECK(d_rounded > 0, "flash_attn_ext: headdim ", d, " is not compiled in this build (compiled head dims: ",
              flash::compiled_headdims(), "); rebuild with FLASH_ATTN_EXT_HDIMS including a head dim >= ", d);
  return d_rounded;
}

// The long rows' workspaces (flash.h: long_rows_alloc; kernels/common/long_rows.cuh) for a call
// where some row can reach params.long_row_keys keys (a row's key blocks run past seqlen_k by less
// than 256 keys): the forward's launch sizes them for its grid and allocates them here, float32
// tensors on q's device and the current stream, held by the LongRowsWorkspace until the call
// returns. No init: each thread writes its rows before it reads them.
struct LongRowsWorkspace {
  at::TensorOptions options;
  std::vector<Tensor> held;
  static float* alloc(void* self, int64_t floats) {
    auto* w = static_cast<LongRowsWorkspace*>(self);
    w->held.push_back(torch::empty({floats}, w->options));
    return w->held.back().data_ptr<float>();
  }
};

void set_long_rows(flash::Flash_fwd_params& p, LongRowsWorkspace& workspace, const Tensor& q, int64_t max_seqlen_k) {
  try {
    p.long_row_keys = flash::long_row_keys();  // the knob's error (run_on_stream's wording)
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
  p.flush_keys = std::min(p.long_row_keys, flash::kFlushKeys);
  if (max_seqlen_k + 256 <= p.long_row_keys) return;
  workspace.options = q.options().dtype(at::kFloat);
  p.long_rows_alloc = &LongRowsWorkspace::alloc;
  p.long_rows_alloc_ctx = &workspace;
}

FwdOut forward_cuda(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, double softmax_scale, bool causal,
                    int64_t window_size_left, int64_t window_size_right, const c10::optional<Tensor>& sinks_in,
                    double softcap, double dropout_p, const c10::optional<Tensor>& rng_state,
                    const c10::optional<Tensor>& alibi_slopes) {
  check_sinks_device(sinks_in, q_in);
  const Sizes s = check_qkv(q_in, k_in, v_in, softmax_scale, /*cuda=*/true);
  check_softcap(softcap, softmax_scale);
  const MaskArgs mask = mask_args(causal, window_size_left, window_size_right, s.seqlen_q, s.seqlen_k);
  const DropoutArgs dropout = check_dropout(dropout_p, rng_state, q_in, mask, softcap);
  const Tensor alibi = check_alibi(alibi_slopes, q_in, s.batch, s.nheads, softmax_scale, softcap, dropout_p, mask);
  TORCH_CHECK(q_in.is_cuda(), "flash_attn_ext: q is on ", q_in.device(), "; expected a CUDA device");
  const Tensor sinks = check_sinks(sinks_in, s.nheads);
  const int d_rounded = cuda_rounded_headdim(int(s.headdim));
  const c10::cuda::CUDAGuard guard(q_in.device());
  FwdOut outs = alloc_fwd(q_in, s);
  if (!fwd_nonempty(outs, s, sinks)) return outs;
  const auto& [out, lse, stats] = outs;
  const auto [q_pos, scale] = positive_scale(q_in, softmax_scale);
  const Tensor q = aligned_for_cuda(q_pos), k = aligned_for_cuda(k_in), v = aligned_for_cuda(v_in);

  flash::Flash_fwd_params params;
  set_fwd_params(params, s, q, k, v, out, lse, stats, scale, softcap, mask);
  params.sinks_ptr = sinks_ptr(sinks);
  set_dropout(params, dropout);
  set_alibi(params, alibi);
  LongRowsWorkspace long_rows;
  set_long_rows(params, long_rows, q, s.seqlen_k);
  launch_on_device(flash::run_mha_fwd, params, d_rounded, q.get_device());
  return outs;
}

// dsinks from the backward's workspace (set_bwd_workspaces: D and LSE_log2 = hi + lo, the preprocess's,
// one plane each, in the same row layout; rows past a sequence have D = 0 and hi = +inf):
// p_sink = exp2(sinks log2(e) - hi - lo). No extra pass over dout / out.
void sinks_grad_from_workspace(Tensor dsinks, const Tensor& ws, const Tensor& sinks, int64_t head_dim) {
  const Tensor d = ws[0], hi = ws[1], lo = ws[2];
  const Tensor s2 = sinks_along(sinks * M_LOG2E, d.dim(), head_dim);
  const Tensor p_sink = at::exp2((s2 - hi) - lo);
  sinks_grad_into(dsinks, p_sink, d, head_dim);
}

std::tuple<Tensor, Tensor, Tensor> backward_cuda(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in,
                                                 const Tensor& v_in, const Tensor& out_in,
                                                 const Tensor& softmax_lse, double softmax_scale, bool causal,
                                                 const c10::optional<Tensor>& softmax_stats, int64_t window_size_left,
                                                 int64_t window_size_right, const c10::optional<Tensor>& sinks_in,
                                                 const c10::optional<Tensor>& dsinks, double softcap, double dropout_p,
                                                 const c10::optional<Tensor>& rng_state, const c10::optional<Tensor>& alibi_slopes) {
  check_sinks_device(sinks_in, q_in);
  const Sizes s = check_qkv(q_in, k_in, v_in, softmax_scale, /*cuda=*/true);
  TORCH_CHECK(q_in.is_cuda(), "flash_attn_ext: q is on ", q_in.device(), "; expected a CUDA device");
  check_rank4(dout_in, "dout", "(batch, seqlen_q, nheads, headdim)");
  check_rank4(out_in, "out", "(batch, seqlen_q, nheads, headdim)");
  check_bwd_extra(dout_in, q_in, out_in, softmax_lse, s);
  const Tensor stats = bwd_stats(softmax_stats, q_in, s);
  check_softcap(softcap, softmax_scale);
  // The kernels' P comes from the LSE, which holds the sink: sinks only feed dsinks here.
  const Tensor sinks = check_sinks(sinks_in, s.nheads);
  check_dsinks(dsinks, sinks, q_in, s.nheads);
  const bool want_dsinks = dsinks.has_value() && dsinks->defined();
  const MaskArgs mask = mask_args(causal, window_size_left, window_size_right, s.seqlen_q, s.seqlen_k);
  const DropoutArgs dropout = check_dropout(dropout_p, rng_state, q_in, mask, softcap);
  const Tensor alibi = check_alibi(alibi_slopes, q_in, s.batch, s.nheads, softmax_scale, softcap, dropout_p, mask);
  const int d_rounded = cuda_rounded_headdim(int(s.headdim));
  const c10::cuda::CUDAGuard guard(q_in.device());
  Tensor dq = torch::empty(q_in.sizes(), q_in.options());
  Tensor dk = torch::empty(k_in.sizes(), k_in.options());
  Tensor dv = torch::empty(v_in.sizes(), v_in.options());
  if (!bwd_nonempty(dq, dk, dv, s)) {
    if (want_dsinks) dsinks->zero_();  // every row's out is 0 (or there is none): D = 0
    return {dq, dk, dv};
  }

  const auto [q_pos, scale] = positive_scale(q_in, softmax_scale);
  const Tensor q = aligned_for_cuda(q_pos), k = aligned_for_cuda(k_in), v = aligned_for_cuda(v_in);
  const Tensor out = aligned_for_cuda(out_in);
  // dout from out.sum().backward() has all-zero strides: fine, except a non-unit last stride.
  const Tensor dout = aligned_for_cuda(dout_in);
  const Tensor lse = softmax_lse.contiguous();
  flash::Flash_bwd_params params;
  set_bwd_params(params, s, dout, q, k, v, out, lse, stats, dq, dk, dv, scale, softcap, mask);
  set_dropout(params, dropout);
  set_alibi(params, alibi);
  // Workspaces (b, h, seqlen_q rounded up to 128) per plane.
  const int64_t seqlen_q_rounded = (s.seqlen_q + 127) / 128 * 128;
  const auto workspaces = set_bwd_workspaces(params, {s.batch, s.nheads, seqlen_q_rounded}, s.batch, s.nheads,
                                             seqlen_q_rounded, q);
  launch_on_device(flash::run_mha_bwd, params, d_rounded, q.get_device());
  scale_dq_back(dq, softmax_scale);
  if (want_dsinks) sinks_grad_from_workspace(*dsinks, workspaces.first, sinks, 1);
  return {dq, dk, dv};
}

// True if the kernels must run. No sequence has a query (max_seqlen_q = 0 or no rows) or none has
// a key: the outputs are final here (out = 0, lse = +inf, stats (+inf, 0)).
bool varlen_fwd_nonempty(FwdOut& outs, const VarlenSizes& s, int64_t max_seqlen_q, int64_t max_seqlen_k,
                         const Tensor& sinks) {
  if (s.batch > 0 && s.total_q > 0 && max_seqlen_q > 0 && s.total_k > 0 && max_seqlen_k > 0) return true;
  std::get<0>(outs).zero_();
  fill_keyless_lse(std::get<1>(outs), sinks, 0);
  std::get<2>(outs)[0].fill_(std::numeric_limits<float>::infinity());
  std::get<2>(outs)[1].zero_();
  return false;
}

// A packed (total, heads, d) tensor as a TensorView of the varlen params (batch_stride 0).
flash::TensorView view_packed(const Tensor& t) {
  flash::TensorView v;
  v.ptr = t.data_ptr();
  v.batch_stride = 0, v.row_stride = t.stride(0), v.head_stride = t.stride(1);
  return v;
}

// The varlen fields of params (flash.h) over packed q/k/v, on top of set_fwd_params' dense ones.
void set_varlen_params(flash::Flash_fwd_params& p, const VarlenSizes& s, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& out, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                       int64_t max_seqlen_q, int64_t max_seqlen_k) {
  p.q = view_packed(q), p.k = view_packed(k), p.v = view_packed(v), p.o = view_packed(out);
  p.b = int(s.batch);
  p.seqlen_q = int(max_seqlen_q);
  p.seqlen_k = int(max_seqlen_k);
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int>();
  p.cu_seqlens_k = cu_seqlens_k.data_ptr<int>();
  p.total_q = int(s.total_q);
  p.total_k = int(s.total_k);
}

// The sm90 varlen forward's tile counter (flash.h: tile_counter): two int32 per (device, stream),
// zeroed once on the stream. Each launch leaves them zero again, and a stream runs its calls in
// order, so its calls share them without a memset launch each; calls on two streams get two. Their
// memory is the runtime's (cudaMalloc'd slabs, never freed), not torch's caching allocator, whose
// current pool can be a CUDA graph's private one outside a capture too (torch.compile's
// "reduce-overhead" warms up eagerly into it) and be reset or freed under the cache. A fresh zeroed
// pair per call (`fresh`, torch's, freed after the call) while the stream captures a graph (its
// memset a node of the graph) and on cudaStreamPerThread (one handle, a stream per host thread).
int* varlen_tile_counter(const Tensor& q, Tensor& fresh) {
  const int device = q.get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone || stream == cudaStreamPerThread) {
    fresh = torch::zeros({2}, q.options().dtype(at::kInt));
    return fresh.data_ptr<int>();
  }
  // A pair per 128-byte line (no two streams' atomics on one line), 256 per slab.
  constexpr int kPairStride = 32, kPairsPerSlab = 256;
  constexpr size_t kSlabBytes = sizeof(int) * kPairStride * kPairsPerSlab;
  static std::mutex mutex;
  // Never destroyed (nor the slabs): the process's lifetime.
  static auto* counters = new std::map<std::pair<int, cudaStream_t>, int*>();
  static auto* slabs = new std::map<int, std::pair<int*, int>>();  // device: (slab, pairs handed out)
  const std::lock_guard<std::mutex> lock(mutex);
  int*& counter = (*counters)[{device, stream}];
  if (counter == nullptr) {
    auto& [slab, used] = (*slabs)[device];
    if (slab == nullptr || used == kPairsPerSlab) {
      // Relaxed capture mode for the calls, as torch's own cudaMalloc: another thread's capture in
      // global mode would refuse them. Out of memory: once more after torch frees its cached blocks.
      int* new_slab = nullptr;
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
      cudaError_t err = cudaMalloc(&new_slab, kSlabBytes);
      if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        c10::cuda::CUDACachingAllocator::emptyCache();
        err = cudaMalloc(&new_slab, kSlabBytes);
      }
      C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
      C10_CUDA_CHECK(err);
      slab = new_slab;
      used = 0;
    }
    int* pair = slab + kPairStride * used;
    C10_CUDA_CHECK(cudaMemsetAsync(pair, 0, 2 * sizeof(int), stream));
    ++used;
    counter = pair;
  }
  return counter;
}

FwdOut varlen_forward_cuda(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& cu_seqlens_q,
                           const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                           double softmax_scale, bool causal, int64_t window_size_left, int64_t window_size_right,
                           const c10::optional<Tensor>& sinks_in, double softcap, double dropout_p,
                           const c10::optional<Tensor>& rng_state, const c10::optional<Tensor>& alibi_slopes) {
  check_sinks_device(sinks_in, q_in);
  const VarlenSizes s = check_varlen(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     softmax_scale, /*cuda=*/true);
  check_softcap(softcap, softmax_scale);
  const MaskArgs mask = mask_args(causal, window_size_left, window_size_right, max_seqlen_q, max_seqlen_k);
  const DropoutArgs dropout = check_dropout(dropout_p, rng_state, q_in, mask, softcap);
  const Tensor alibi = check_alibi(alibi_slopes, q_in, s.batch, s.nheads, softmax_scale, softcap, dropout_p, mask);
  TORCH_CHECK(q_in.is_cuda(), "flash_attn_ext: q is on ", q_in.device(), "; expected a CUDA device");
  const Tensor sinks = check_sinks(sinks_in, s.nheads);
  const int d_rounded = cuda_rounded_headdim(int(s.headdim));
  const c10::cuda::CUDAGuard guard(q_in.device());
  FwdOut outs = alloc_varlen_fwd(q_in, s);
  if (!varlen_fwd_nonempty(outs, s, max_seqlen_q, max_seqlen_k, sinks)) return outs;
  const auto& [out, lse, stats] = outs;
  const auto [q_pos, scale] = positive_scale(q_in, softmax_scale);
  const Tensor q = aligned_for_cuda(q_pos), k = aligned_for_cuda(k_in), v = aligned_for_cuda(v_in);

  flash::Flash_fwd_params params;
  const Sizes dense{s.batch, max_seqlen_q, max_seqlen_k, s.nheads, s.nheads_k, s.headdim};
  set_fwd_params(params, dense, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0), lse, stats, scale,
                 softcap, mask);
  set_varlen_params(params, s, q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  params.sinks_ptr = sinks_ptr(sinks);
  set_dropout(params, dropout);
  set_alibi(params, alibi);
  params.d_rounded = d_rounded;
  set_device_facts(params, q.get_device());
  LongRowsWorkspace long_rows;
  set_long_rows(params, long_rows, q, max_seqlen_k);
  // The sm90 forward's dynamic walk claims its tiles from a counter that is zero at the launch
  // (flash.h: tile_counter); compute capability 9.x only, and not for a full pack (the static walk).
  Tensor fresh_counter;  // where varlen_tile_counter gives a fresh one: alive until the launch
  params.tile_counter = params.arch / 10 == 9 && flash::sm90_fwd_schedule(params) == flash::kSm90FwdDynamic
                            ? varlen_tile_counter(q, fresh_counter)
                            : nullptr;
  run_on_stream(flash::run_mha_fwd, params);
  return outs;
}

std::tuple<Tensor, Tensor, Tensor> varlen_backward_cuda(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in,
                                                        const Tensor& v_in, const Tensor& out_in,
                                                        const Tensor& softmax_lse, const Tensor& cu_seqlens_q,
                                                        const Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                                        int64_t max_seqlen_k, double softmax_scale, bool causal,
                                                        const c10::optional<Tensor>& softmax_stats, int64_t window_size_left,
                                                        int64_t window_size_right, const c10::optional<Tensor>& sinks,
                                                        double softcap, double dropout_p,
                                                        const c10::optional<Tensor>& rng_state, const c10::optional<Tensor>& alibi_slopes) {
  check_sinks_device(sinks, q_in);
  const VarlenSizes s = check_varlen(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     softmax_scale, /*cuda=*/true);
  TORCH_CHECK(q_in.is_cuda(), "flash_attn_ext: q is on ", q_in.device(), "; expected a CUDA device");
  check_sinks(sinks, s.nheads);  // checked only: the kernels' P comes from the LSE, which holds the sink
  check_rank3(dout_in, "dout", "(total_q, nheads, headdim)");
  check_rank3(out_in, "out", "(total_q, nheads, headdim)");
  check_varlen_bwd_extra(dout_in, q_in, out_in, softmax_lse, softmax_stats, s);
  check_softcap(softcap, softmax_scale);
  const MaskArgs mask = mask_args(causal, window_size_left, window_size_right, max_seqlen_q, max_seqlen_k);
  const DropoutArgs dropout = check_dropout(dropout_p, rng_state, q_in, mask, softcap);
  const Tensor alibi = check_alibi(alibi_slopes, q_in, s.batch, s.nheads, softmax_scale, softcap, dropout_p, mask);
  const int d_rounded = cuda_rounded_headdim(int(s.headdim));
  const c10::cuda::CUDAGuard guard(q_in.device());
  Tensor dq = torch::empty(q_in.sizes(), q_in.options());
  Tensor dk = torch::empty(k_in.sizes(), k_in.options());
  Tensor dv = torch::empty(v_in.sizes(), v_in.options());
  if (s.batch == 0 || s.total_q == 0 || s.total_k == 0 || max_seqlen_q == 0 || max_seqlen_k == 0) {
    dq.zero_(), dk.zero_(), dv.zero_();
    return {dq, dk, dv};
  }
  const auto [q_pos, scale] = positive_scale(q_in, softmax_scale);
  const Tensor q = aligned_for_cuda(q_pos), k = aligned_for_cuda(k_in), v = aligned_for_cuda(v_in);
  const Tensor out = aligned_for_cuda(out_in);
  const Tensor dout = aligned_for_cuda(dout_in);
  const Tensor lse = softmax_lse.contiguous();
  const Tensor stats =
      softmax_stats.has_value() && softmax_stats->defined() ? softmax_stats->contiguous() : Tensor();
  flash::Flash_bwd_params params;
  const Sizes dense{s.batch, max_seqlen_q, max_seqlen_k, s.nheads, s.nheads_k, s.headdim};
  set_bwd_params(params, dense, dout.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0),
                 lse, stats, dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0), scale, softcap, mask);
  set_varlen_params(params, s, q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  params.dout = view_packed(dout), params.dq = view_packed(dq), params.dk = view_packed(dk), params.dv = view_packed(dv);
  set_dropout(params, dropout);
  set_alibi(params, alibi);
  // Workspaces (flash.h): (nheads, varlen_ws_rows) per plane; precise_rows per 128 rows of
  // max_seqlen_q per (sequence, head).
  const int64_t seqlen_q_rounded = (max_seqlen_q + 127) / 128 * 128;
  const auto workspaces = set_bwd_workspaces(params, {s.nheads, flash::varlen_ws_rows(s.total_q, s.batch)}, s.batch,
                                             s.nheads, seqlen_q_rounded, q);
  launch_on_device(flash::run_mha_bwd, params, d_rounded, q.get_device());
  scale_dq_back(dq, softmax_scale);
  return {dq, dk, dv};
}

std::tuple<Tensor, Tensor> fwd_kvcache_cuda(const Tensor& q_in, const Tensor& k_cache, const Tensor& v_cache,
                                            const c10::optional<Tensor>& k_in, const c10::optional<Tensor>& v_in,
                                            const c10::optional<Tensor>& cache_seqlens,
                                            const c10::optional<Tensor>& block_table, double softmax_scale,
                                            bool causal, int64_t num_splits, int64_t window_size_left, int64_t window_size_right,
                                            const c10::optional<Tensor>& sinks_in,
                                            const c10::optional<Tensor>& cache_leftpad, double softcap,
                                            const c10::optional<Tensor>& alibi_slopes) {
  check_sinks_device(sinks_in, q_in);
  const KvcacheSizes ks = check_kvcache(q_in, k_cache, v_cache, k_in, v_in, cache_seqlens, block_table, softmax_scale,
                                        num_splits, /*cuda=*/true, cache_leftpad);
  check_softcap(softcap, softmax_scale);
  const MaskArgs mask = mask_args(causal, window_size_left, window_size_right, ks.s.seqlen_q, ks.s.seqlen_k);
  const Tensor alibi = check_alibi(alibi_slopes, q_in, ks.s.batch, ks.s.nheads, softmax_scale, softcap, 0.0, mask);
  const Sizes& s = ks.s;
  TORCH_CHECK(q_in.is_cuda(), "flash_attn_ext: q is on ", q_in.device(), "; expected a CUDA device");
  const Tensor sinks = check_sinks(sinks_in, s.nheads);
  // A cache that new k / v are appended to is written in place: it must already be 16-byte aligned
  // (no copy can stand in for it). One that is only read is copied when it is not (as q is).
  const bool appends = ks.seqlen_new > 0;
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{k_cache, "k_cache"}, {v_cache, "v_cache"}}) {
    TORCH_CHECK(!appends || cuda_aligned(t),
                "flash_attn_ext: ", name, " must have a 16-byte aligned base and strides that are multiples of 8 "
                "elements when k / v are appended to it (it is written in place, so it cannot be copied), got "
                "strides ", t.strides());
  }
  const Tensor k_cache_r = appends ? k_cache : aligned_for_cuda(k_cache);
  const Tensor v_cache_r = appends ? v_cache : aligned_for_cuda(v_cache);
  const int d_rounded = cuda_rounded_headdim(int(s.headdim));
  const c10::cuda::CUDAGuard guard(q_in.device());
  Tensor out = torch::empty(q_in.sizes(), q_in.options());
  Tensor lse = torch::empty({s.batch, s.nheads, s.seqlen_q}, q_in.options().dtype(at::kFloat));
  if (s.batch == 0) return {out, lse};
  const auto [q_own, k_new, v_new] = unaliased_kvcache_inputs(q_in, k_in, v_in, k_cache, v_cache);
  const auto [q_pos, scale] = positive_scale(q_own, softmax_scale);
  const Tensor q = aligned_for_cuda(q_pos);

  flash::Flash_fwd_params params;
  set_fwd_params(params, s, q, k_cache_r, v_cache_r, out, lse, Tensor(), scale, softcap, mask);
  params.sinks_ptr = sinks_ptr(sinks);
  set_alibi(params, alibi);
  params.d_rounded = d_rounded;
  set_device_facts(params, q.get_device());
  if (cache_seqlens.has_value() && cache_seqlens->defined()) params.cache_seqlens = cache_seqlens->data_ptr<int>();
  Tensor all_rows;  // leftpad_k needs cache_seqlens (flash.h): every row in use when none was given
  if (cache_leftpad.has_value() && cache_leftpad->defined()) {
    params.leftpad_k = cache_leftpad->data_ptr<int>();
    if (params.cache_seqlens == nullptr) {
      all_rows = torch::full({s.batch}, s.seqlen_k, q.options().dtype(at::kInt));
      params.cache_seqlens = all_rows.data_ptr<int>();
    }
  }
  Tensor k_app, v_app;
  if (ks.seqlen_new > 0) {
    k_app = aligned_for_cuda(*k_new), v_app = aligned_for_cuda(*v_new);
    params.knew = view(k_app), params.vnew = view(v_app);
    params.seqlen_knew = int(ks.seqlen_new);
  }
  if (ks.paged) {
    params.block_table = block_table->data_ptr<int>();
    params.block_table_batch_stride = block_table->stride(0);
    params.page_size = int(ks.page_size);
    params.num_blocks = int(ks.num_blocks);
  }
  // Nothing to split without output rows (nheads = 0 or seqlen_q = 0); the append still runs.
  if (out.numel() == 0) {
    params.num_splits = 1;
  } else {
    flash::plan_kvcache_splits(params, int(num_splits));
  }
  Tensor oaccum, lseaccum;
  if (params.num_splits > 1 && s.seqlen_q > 0) {
    oaccum = torch::empty({params.num_splits, s.batch, s.nheads, s.seqlen_q, d_rounded}, q.options().dtype(at::kFloat));
    lseaccum = torch::empty({params.num_splits, s.batch, s.nheads, s.seqlen_q}, q.options().dtype(at::kFloat));
    params.oaccum_ptr = oaccum.data_ptr<float>();
    params.softmax_lseaccum_ptr = lseaccum.data_ptr<float>();
  }
  run_on_stream(flash::run_mha_fwd_kvcache, params);
  return {out, lse};
}

#else  // CPU-only build: CUDA tensors get a clear error instead of the dispatcher's.

// A mixed CPU/CUDA call is a device error first (naming the tensor), then the build's.
void no_cuda(const Tensor& q, std::initializer_list<std::pair<const Tensor&, const char*>> others) {
  for (const auto& [t, name] : others) check_same_device(t, name, q);
  TORCH_CHECK(false, "flash_attn_ext: this build has no CUDA kernels (built with FLASH_ATTN_EXT_CUDA_ARCHS=none "
                     "or without nvcc / a CUDA-enabled torch); rebuild with CUDA to run on a GPU");
}
FwdOut forward_cuda(const Tensor& q, const Tensor& k, const Tensor& v, double, bool, int64_t, int64_t,
                    const c10::optional<Tensor>& sinks, double, double, const c10::optional<Tensor>&,
                    const c10::optional<Tensor>&) {
  check_sinks_device(sinks, q);
  no_cuda(q, {{k, "k"}, {v, "v"}});
  return {};
}
std::tuple<Tensor, Tensor, Tensor> backward_cuda(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                 const Tensor& v, const Tensor& out, const Tensor& softmax_lse,
                                                 double, bool, const c10::optional<Tensor>&, int64_t, int64_t,
                                                 const c10::optional<Tensor>& sinks, const c10::optional<Tensor>&,
                                                 double, double, const c10::optional<Tensor>&,
                                                 const c10::optional<Tensor>&) {
  check_sinks_device(sinks, q);
  no_cuda(q, {{dout, "dout"}, {k, "k"}, {v, "v"}, {out, "out"}, {softmax_lse, "softmax_lse"}});
  return {};
}
FwdOut varlen_forward_cuda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                           const Tensor& cu_seqlens_k, int64_t, int64_t, double, bool, int64_t, int64_t,
                           const c10::optional<Tensor>& sinks, double, double, const c10::optional<Tensor>&,
                           const c10::optional<Tensor>&) {
  check_sinks_device(sinks, q);
  no_cuda(q, {{k, "k"}, {v, "v"}, {cu_seqlens_q, "cu_seqlens_q"}, {cu_seqlens_k, "cu_seqlens_k"}});
  return {};
}
std::tuple<Tensor, Tensor, Tensor> varlen_backward_cuda(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                        const Tensor& v, const Tensor& out, const Tensor& softmax_lse,
                                                        const Tensor&, const Tensor&, int64_t, int64_t, double, bool,
                                                        const c10::optional<Tensor>&, int64_t, int64_t,
                                                        const c10::optional<Tensor>& sinks, double, double,
                                                        const c10::optional<Tensor>&, const c10::optional<Tensor>&) {
  check_sinks_device(sinks, q);
  no_cuda(q, {{dout, "dout"}, {k, "k"}, {v, "v"}, {out, "out"}, {softmax_lse, "softmax_lse"}});
  return {};
}
std::tuple<Tensor, Tensor> fwd_kvcache_cuda(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                            const c10::optional<Tensor>&, const c10::optional<Tensor>&,
                                            const c10::optional<Tensor>&, const c10::optional<Tensor>&, double, bool,
                                            int64_t, int64_t, int64_t, const c10::optional<Tensor>& sinks,
                                            const c10::optional<Tensor>&, double, const c10::optional<Tensor>&) {
  check_sinks_device(sinks, q);
  no_cuda(q, {{k_cache, "k_cache"}, {v_cache, "v_cache"}});
  return {};
}

#endif  // FLASH_ATTN_EXT_WITH_CUDA

// The backward ops over the bodies above: without the sinks' gradient (backward, varlen_backward)
// and with it (backward_dsinks: a fresh (nheads,) float32 dsinks).
using Grads = std::tuple<Tensor, Tensor, Tensor>;
using GradsDsinks = std::tuple<Tensor, Tensor, Tensor, Tensor>;

Tensor new_dsinks(const Tensor& sinks) { return torch::empty({sinks.numel()}, sinks.options().dtype(at::kFloat)); }

#define FLASH_ATTN_EXT_BACKWARD_OPS(suffix)                                                                        \
  Grads backward_op_##suffix(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,              \
                             const Tensor& out, const Tensor& lse, double scale, bool causal,                    \
                             const c10::optional<Tensor>& stats, int64_t wl, int64_t wr,                         \
                             const c10::optional<Tensor>& sinks, double softcap, double dropout_p,               \
                             const c10::optional<Tensor>& rng_state, const c10::optional<Tensor>& alibi) {       \
    return backward_##suffix(dout, q, k, v, out, lse, scale, causal, stats, wl, wr, sinks, c10::nullopt, softcap, \
                             dropout_p, rng_state, alibi);                                                       \
  }                                                                                                              \
  GradsDsinks backward_dsinks_##suffix(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,     \
                                       const Tensor& out, const Tensor& lse, double scale, bool causal,          \
                                       const c10::optional<Tensor>& stats, int64_t wl, int64_t wr,               \
                                       const Tensor& sinks, double softcap, double dropout_p,                    \
                                       const c10::optional<Tensor>& rng_state,                                   \
                                       const c10::optional<Tensor>& alibi) {                                     \
    TORCH_CHECK(sinks.defined(), "flash_attn_ext: backward_dsinks needs sinks (the forward's (nheads,) float32); " \
                                 "without sinks call backward");                                                 \
    Tensor ds = new_dsinks(sinks);                                                                               \
    auto [dq, dk, dv] = backward_##suffix(dout, q, k, v, out, lse, scale, causal, stats, wl, wr, sinks, ds, softcap, \
                                          dropout_p, rng_state, alibi);                                          \
    return {dq, dk, dv, ds};                                                                                     \
  }                                                                                                              \
  Grads varlen_backward_op_##suffix(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,       \
                                    const Tensor& out, const Tensor& lse, const Tensor& cq, const Tensor& ck,    \
                                    int64_t mq, int64_t mk, double scale, bool causal,                           \
                                    const c10::optional<Tensor>& stats, int64_t wl, int64_t wr,                  \
                                    const c10::optional<Tensor>& sinks, double softcap, double dropout_p,        \
                                    const c10::optional<Tensor>& rng_state, const c10::optional<Tensor>& alibi) { \
    return varlen_backward_##suffix(dout, q, k, v, out, lse, cq, ck, mq, mk, scale, causal, stats, wl, wr, sinks,  \
                                    softcap, dropout_p, rng_state, alibi);                                       \
  }
FLASH_ATTN_EXT_BACKWARD_OPS(cpu)
FLASH_ATTN_EXT_BACKWARD_OPS(cuda)
#undef FLASH_ATTN_EXT_BACKWARD_OPS

}  // namespace

TORCH_LIBRARY(flash_attn_ext, m) {
  // Fake kernels and autograd live in this Python module; torch imports it on demand.
  m.set_python_module("flash_attn_ext.ops");
  // softcap: logit soft-capping (flash.h; check_softcap), 0.0 = none. dropout_p, rng_state: attention
  // dropout (flash.h; check_dropout), 0.0 = none; the forward and the backward of one call share rng_state.
  // alibi_slopes: ALiBi (flash.h; check_alibi), None = none; the forward and the backward share it.
  // max_seqlen_q / max_seqlen_k are SymInt (the C++ kernels take int64_t): under torch.compile a value
  // that changes between calls stays symbolic (one graph for every packed batch, not one per value),
  // and one read from a tensor (.item(), capture_scalar_outputs) compiles with fullgraph=True.
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, int window_size_left=-1, "
      "int window_size_right=-1, Tensor? sinks=None, float softcap=0.0, float dropout_p=0.0, Tensor? rng_state=None, "
      "Tensor? alibi_slopes=None) "
      "-> (Tensor out, Tensor softmax_lse, Tensor softmax_stats)");
  m.def(
      "backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, float softmax_scale, "
      "bool causal, Tensor? softmax_stats=None, int window_size_left=-1, int window_size_right=-1, "
      "Tensor? sinks=None, float softcap=0.0, float dropout_p=0.0, Tensor? rng_state=None, "
      "Tensor? alibi_slopes=None) -> (Tensor dq, Tensor dk, "
      "Tensor dv)");
  m.def(
      "varlen_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
      "SymInt max_seqlen_k, float softmax_scale, bool causal, int window_size_left=-1, int window_size_right=-1, "
      "Tensor? sinks=None, float softcap=0.0, float dropout_p=0.0, Tensor? rng_state=None, "
      "Tensor? alibi_slopes=None) -> (Tensor out, "
      "Tensor softmax_lse, Tensor softmax_stats)");
  m.def(
      "varlen_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale, "
      "bool causal, Tensor? softmax_stats=None, int window_size_left=-1, int window_size_right=-1, "
      "Tensor? sinks=None, float softcap=0.0, float dropout_p=0.0, Tensor? rng_state=None, "
      "Tensor? alibi_slopes=None) -> (Tensor dq, Tensor dk, "
      "Tensor dv)");
  m.def(
      "fwd_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor? cache_seqlens, "
      "Tensor? block_table, float softmax_scale, bool causal, int num_splits, int window_size_left=-1, "
      "int window_size_right=-1, Tensor? sinks=None, Tensor? cache_leftpad=None, float softcap=0.0, "
      "Tensor? alibi_slopes=None) -> (Tensor out, Tensor softmax_lse)");
  // backward that also returns the sinks' gradient, from the backward's own workspace on CUDA (D and
  // the LSE of the preprocess: no extra pass over dout / out). (The varlen backward's workspace
  // leaves rows between sequences unwritten; its sinks' gradient is ops.sinks_grad's for now.)
  m.def(
      "backward_dsinks(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "float softmax_scale, bool causal, Tensor? softmax_stats, int window_size_left, int window_size_right, "
      "Tensor sinks, float softcap=0.0, float dropout_p=0.0, Tensor? rng_state=None, "
      "Tensor? alibi_slopes=None) -> (Tensor dq, Tensor dk, "
      "Tensor dv, Tensor dsinks)");
}

// Every op's kernel for one dispatch key: the CPU and CUDA functions differ by their suffix only.
#define FLASH_ATTN_EXT_IMPLS(KEY, suffix)                      \
  TORCH_LIBRARY_IMPL(flash_attn_ext, KEY, m) {                 \
    m.impl("forward", &forward_##suffix);                      \
    m.impl("backward", &backward_op_##suffix);                 \
    m.impl("varlen_forward", &varlen_forward_##suffix);        \
    m.impl("varlen_backward", &varlen_backward_op_##suffix);   \
    m.impl("fwd_kvcache", &fwd_kvcache_##suffix);              \
    m.impl("backward_dsinks", &backward_dsinks_##suffix);      \
  }
FLASH_ATTN_EXT_IMPLS(CPU, cpu)
FLASH_ATTN_EXT_IMPLS(CUDA, cuda)
#undef FLASH_ATTN_EXT_IMPLS

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "flash_attn_ext C++ extension: registers torch.ops.flash_attn_ext.{forward, backward, varlen_forward, "
      "varlen_backward, fwd_kvcache, backward_dsinks}";
  m.def(
      "build_info",
      []() {
        pybind11::dict info;
        info["cuda_archs"] = std::string(FLASH_ATTN_EXT_BUILD_ARCHS);
#ifdef FLASH_ATTN_EXT_WITH_CUDA
        info["with_cuda"] = true;
        info["head_dims"] = std::string(flash::compiled_headdims());
#else
        info["with_cuda"] = false;
        info["head_dims"] = std::string(FLASH_ATTN_EXT_BUILD_HDIMS);
#endif
        info["cuda_version"] = std::string(FLASH_ATTN_EXT_BUILD_CUDA);
        info["torch_version"] = std::string(FLASH_ATTN_EXT_BUILD_TORCH);
        info["cpu"] = true;
        return info;
      },
      "Build facts: CUDA archs and head dims compiled, the CUDA and torch versions built against.");
  m.def(
      "force_sm80_path",
      [](bool force) {
#ifdef FLASH_ATTN_EXT_WITH_CUDA
        return flash::force_sm80_path(force);
#else
        (void)force;
        return false;
#endif
      },
      "Forces (True) or releases (False) the sm80 kernels on GPUs where another arch path would run; "
      "returns the previous setting. The initial setting is FLASH_ATTN_EXT_DISABLE_SM90 (read once).");
}
