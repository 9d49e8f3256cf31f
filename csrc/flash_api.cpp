// flash_attn_ext: the only torch translation unit.
//
// Declares the two ops (schemas below, docs/DESIGN.md), checks every argument before any
// work (errors name the argument and what was expected), allocates outputs and workspaces,
// fills flash::Flash_fwd_params / Flash_bwd_params (csrc/flash.h) and dispatches:
//   CPU  -> flash::cpu::run_mha_{fwd,bwd}_cpu   (csrc/kernels/cpu/flash_cpu.cpp)
//   CUDA -> flash::run_mha_fwd / run_mha_bwd    (csrc/kernels/dispatch.cu)
// Autograd and the fake (meta) kernels are registered in Python: flash_attn_ext/ops.py.
#include <torch/extension.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

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

void check_same_dtype(const Tensor& t, const char* name, const Tensor& q) {
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "flash_attn_ext: ", name, " has dtype ",
              t.scalar_type(), " but q has dtype ", q.scalar_type(), "; they must match");
}

void check_last_dim_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, "flash_attn_ext: ", name,
              " must have a contiguous last dimension (stride(-1) == 1), got strides ",
              t.strides(), "; call .contiguous() first");
}

// The q/k/v checks shared by both ops, in the order: rank, device, dtype, shapes, headdim,
// strides. `cuda` selects the dtypes allowed.
Sizes check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, double softmax_scale, bool cuda) {
  check_rank4(q, "q", "(batch, seqlen_q, nheads, headdim)");
  check_rank4(k, "k", "(batch, seqlen_k, nheads_k, headdim)");
  check_rank4(v, "v", "(batch, seqlen_k, nheads_k, headdim)");
  check_same_device(k, "k", q);
  check_same_device(v, "v", q);

  const auto dt = q.scalar_type();
  if (cuda) {
    TORCH_CHECK(dt == at::kHalf || dt == at::kBFloat16, "flash_attn_ext: q has dtype ", dt,
                "; CUDA supports float16 and bfloat16");
  } else {
    TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kHalf || dt == at::kBFloat16,
                "flash_attn_ext: q has dtype ", dt,
                "; CPU supports float32, float64, float16 and bfloat16");
  }
  check_same_dtype(k, "k", q);
  check_same_dtype(v, "v", q);

  const Sizes s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
  TORCH_CHECK(k.size(0) == s.batch && v.size(0) == s.batch,
              "flash_attn_ext: batch mismatch: q has batch ", s.batch, ", k has ", k.size(0),
              ", v has ", v.size(0), "; expected equal");
  TORCH_CHECK(v.size(1) == s.seqlen_k, "flash_attn_ext: v has seqlen ", v.size(1),
              " but k has seqlen_k ", s.seqlen_k, "; expected equal");
  TORCH_CHECK(v.size(2) == s.nheads_k, "flash_attn_ext: v has ", v.size(2), " heads but k has nheads_k ",
              s.nheads_k, "; expected equal");
  TORCH_CHECK(k.size(3) == s.headdim && v.size(3) == s.headdim,
              "flash_attn_ext: headdim mismatch: q has headdim ", s.headdim, ", k has ", k.size(3),
              ", v has ", v.size(3), "; expected equal");
  TORCH_CHECK(s.nheads_k > 0 && s.nheads % s.nheads_k == 0, "flash_attn_ext: nheads (q.size(2) = ",
              s.nheads, ") must be a multiple of nheads_k (k.size(2) = ", s.nheads_k, ")");
  TORCH_CHECK(s.headdim > 0 && s.headdim % 8 == 0 && s.headdim <= kMaxHeadDim,
              "flash_attn_ext: headdim ", s.headdim, " is not supported; expected a multiple of 8 in [8, ",
              kMaxHeadDim, "]");
  const int64_t int_max = std::numeric_limits<int>::max();
  TORCH_CHECK(s.batch <= int_max && s.seqlen_q <= int_max && s.seqlen_k <= int_max,
              "flash_attn_ext: batch and seqlen must fit in int32, got q shape ", q.sizes(),
              ", k shape ", k.sizes());
  check_last_dim_contiguous(q, "q");
  check_last_dim_contiguous(k, "k");
  check_last_dim_contiguous(v, "v");
  TORCH_CHECK(std::isfinite(softmax_scale) && std::isfinite(float(softmax_scale * M_LOG2E)),
              "flash_attn_ext: softmax_scale must be finite with |softmax_scale| * log2(e) < 3.4e38 (float32; "
              "the kernels scale scores by it), got ", softmax_scale);
  return s;
}

// softmax_stats: (2, batch, nheads, seqlen_q) float32 on q's device (the forward's third output).
void check_stats(const Tensor& stats, const Tensor& q, const Sizes& s) {
  check_same_device(stats, "softmax_stats", q);
  TORCH_CHECK(stats.scalar_type() == at::kFloat, "flash_attn_ext: softmax_stats has dtype ", stats.scalar_type(),
              "; expected float32");
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
              softmax_lse.scalar_type(), "; expected float32");
  TORCH_CHECK(softmax_lse.dim() == 3 && softmax_lse.size(0) == s.batch && softmax_lse.size(1) == s.nheads &&
                  softmax_lse.size(2) == s.seqlen_q,
              "flash_attn_ext: softmax_lse has shape ", softmax_lse.sizes(), "; expected (batch, nheads, seqlen_q) = (",
              s.batch, ", ", s.nheads, ", ", s.seqlen_q, ")");
  check_last_dim_contiguous(out, "out");
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
void set_fwd_params(flash::Flash_fwd_params& p, const Sizes& s, const Tensor& q, const Tensor& k,
                    const Tensor& v, const Tensor& out, const Tensor& softmax_lse, const Tensor& stats,
                    double softmax_scale, bool causal) {
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
  p.is_causal = causal;
  p.is_bf16 = q.scalar_type() == at::kBFloat16;
}

void set_bwd_params(flash::Flash_bwd_params& p, const Sizes& s, const Tensor& dout, const Tensor& q,
                    const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& softmax_lse,
                    const Tensor& stats, const Tensor& dq, const Tensor& dk, const Tensor& dv, double softmax_scale,
                    bool causal) {
  set_fwd_params(p, s, q, k, v, out, softmax_lse, stats, softmax_scale, causal);
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
bool fwd_nonempty(FwdOut& outs, const Sizes& s) {
  if (s.batch == 0 || s.seqlen_q == 0) return false;
  if (s.seqlen_k == 0) {
    std::get<0>(outs).zero_();
    std::get<1>(outs).fill_(std::numeric_limits<float>::infinity());
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

FwdOut forward_cpu(const Tensor& q, const Tensor& k, const Tensor& v, double softmax_scale, bool causal) {
  const Sizes s = check_qkv(q, k, v, softmax_scale, /*cuda=*/false);
  FwdOut outs = alloc_fwd(q, s);
  if (!fwd_nonempty(outs, s)) return outs;
  const auto& [out, lse, stats] = outs;
  flash::Flash_fwd_params params;
  set_fwd_params(params, s, q, k, v, out, lse, stats, softmax_scale, causal);
  flash::cpu::run_mha_fwd_cpu(params, cpu_dtype(q.scalar_type()));
  return outs;
}

std::tuple<Tensor, Tensor, Tensor> backward_cpu(const Tensor& dout_in, const Tensor& q, const Tensor& k,
                                                const Tensor& v, const Tensor& out, const Tensor& softmax_lse,
                                                double softmax_scale, bool causal,
                                                const c10::optional<Tensor>& softmax_stats) {
  const Sizes s = check_qkv(q, k, v, softmax_scale, /*cuda=*/false);
  check_rank4(dout_in, "dout", "(batch, seqlen_q, nheads, headdim)");
  check_rank4(out, "out", "(batch, seqlen_q, nheads, headdim)");
  check_bwd_extra(dout_in, q, out, softmax_lse, s);
  const Tensor stats = bwd_stats(softmax_stats, q, s);
  Tensor dq = torch::empty(q.sizes(), q.options());
  Tensor dk = torch::empty(k.sizes(), k.options());
  Tensor dv = torch::empty(v.sizes(), v.options());
  if (!bwd_nonempty(dq, dk, dv, s)) return {dq, dk, dv};
  // Zero strides are fine (out.sum().backward()); only the last dim must be contiguous.
  const Tensor dout = dout_in.stride(-1) == 1 ? dout_in : dout_in.contiguous();
  const Tensor lse = softmax_lse.contiguous();
  flash::Flash_bwd_params params;
  set_bwd_params(params, s, dout, q, k, v, out, lse, stats, dq, dk, dv, softmax_scale, causal);
  flash::cpu::run_mha_bwd_cpu(params, cpu_dtype(q.scalar_type()));
  return {dq, dk, dv};
}

// ---- CUDA ------------------------------------------------------------------------------
#ifdef FLASH_ATTN_EXT_WITH_CUDA

// The kernels load rows with 16-byte vector copies: the base pointer and the batch/row/head
// strides must be multiples of 8 elements (16 bytes). Any other view is copied once.
Tensor aligned_for_cuda(const Tensor& t) {
  const bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 &&
                  t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0 && t.stride(3) == 1;
  return ok ? t : t.contiguous();
}

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
  int major = 0, minor = 0, num_sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  p.arch = major * 10 + minor;
  p.num_sms = num_sms;
}

int cuda_rounded_headdim(int d) {
  const int d_rounded = flash::rounded_headdim(d);
  TORCH_CHECK(d_rounded > 0, "flash_attn_ext: headdim ", d, " is not compiled in this build (compiled head dims: ",
              flash::compiled_headdims(), "); rebuild with FLASH_ATTN_EXT_HDIMS including a head dim >= ", d);
  return d_rounded;
}

FwdOut forward_cuda(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, double softmax_scale, bool causal) {
  const Sizes s = check_qkv(q_in, k_in, v_in, softmax_scale, /*cuda=*/true);
  TORCH_CHECK(q_in.is_cuda(), "flash_attn_ext: q is on ", q_in.device(), "; expected a CUDA device");
  const int d_rounded = cuda_rounded_headdim(int(s.headdim));
  const c10::cuda::CUDAGuard guard(q_in.device());
  FwdOut outs = alloc_fwd(q_in, s);
  if (!fwd_nonempty(outs, s)) return outs;
  const auto& [out, lse, stats] = outs;
  const auto [q_pos, scale] = positive_scale(q_in, softmax_scale);
  const Tensor q = aligned_for_cuda(q_pos), k = aligned_for_cuda(k_in), v = aligned_for_cuda(v_in);

  flash::Flash_fwd_params params;
  set_fwd_params(params, s, q, k, v, out, lse, stats, scale, causal);
  params.d_rounded = d_rounded;
  set_device_facts(params, q.get_device());
  try {
    flash::run_mha_fwd(params, c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
  return outs;
}

std::tuple<Tensor, Tensor, Tensor> backward_cuda(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in,
                                                 const Tensor& v_in, const Tensor& out_in,
                                                 const Tensor& softmax_lse, double softmax_scale, bool causal,
                                                 const c10::optional<Tensor>& softmax_stats) {
  const Sizes s = check_qkv(q_in, k_in, v_in, softmax_scale, /*cuda=*/true);
  TORCH_CHECK(q_in.is_cuda(), "flash_attn_ext: q is on ", q_in.device(), "; expected a CUDA device");
  check_rank4(dout_in, "dout", "(batch, seqlen_q, nheads, headdim)");
  check_rank4(out_in, "out", "(batch, seqlen_q, nheads, headdim)");
  check_bwd_extra(dout_in, q_in, out_in, softmax_lse, s);
  const Tensor stats = bwd_stats(softmax_stats, q_in, s);
  const int d_rounded = cuda_rounded_headdim(int(s.headdim));
  const c10::cuda::CUDAGuard guard(q_in.device());
  Tensor dq = torch::empty(q_in.sizes(), q_in.options());
  Tensor dk = torch::empty(k_in.sizes(), k_in.options());
  Tensor dv = torch::empty(v_in.sizes(), v_in.options());
  if (!bwd_nonempty(dq, dk, dv, s)) return {dq, dk, dv};

  const auto [q_pos, scale] = positive_scale(q_in, softmax_scale);
  const Tensor q = aligned_for_cuda(q_pos), k = aligned_for_cuda(k_in), v = aligned_for_cuda(v_in);
  const Tensor out = aligned_for_cuda(out_in);
  // dout from out.sum().backward() has all-zero strides: fine, except a non-unit last stride.
  const Tensor dout = aligned_for_cuda(dout_in.stride(-1) == 1 ? dout_in : dout_in.contiguous());
  const Tensor lse = softmax_lse.contiguous();
  // FA2 Alg. 2 line 5 workspaces (written by the preprocess kernel), rows rounded up to 128: D,
  // LSE_log2 = hi + lo, and one precise_rows flag per 128 rows (flash.h).
  const int64_t seqlen_q_rounded = (s.seqlen_q + 127) / 128 * 128;
  Tensor ws = torch::empty({3, s.batch, s.nheads, seqlen_q_rounded}, q.options().dtype(at::kFloat));
  Tensor precise_rows = torch::empty({s.batch, s.nheads, seqlen_q_rounded / 128}, q.options().dtype(at::kInt));

  flash::Flash_bwd_params params;
  set_bwd_params(params, s, dout, q, k, v, out, lse, stats, dq, dk, dv, scale, causal);
  params.d_rounded = d_rounded;
  params.dsoftmax_sum_ptr = ws[0].data_ptr<float>();
  params.softmax_lse_log2_ptr = ws[1].data_ptr<float>();
  params.softmax_lse_log2_lo_ptr = ws[2].data_ptr<float>();
  params.precise_rows_ptr = precise_rows.data_ptr<int>();
  params.seqlen_q_rounded = int(seqlen_q_rounded);
  set_device_facts(params, q.get_device());
  try {
    flash::run_mha_bwd(params, c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
  if (softmax_scale < 0) dq.neg_();
  if (softmax_scale == 0) dq.zero_();
  return {dq, dk, dv};
}

#else  // CPU-only build: CUDA tensors get a clear error instead of the dispatcher's.

void no_cuda() {
  TORCH_CHECK(false, "flash_attn_ext: this build has no CUDA kernels (built with FLASH_ATTN_EXT_CUDA_ARCHS=none "
                     "or without nvcc / a CUDA-enabled torch); rebuild with CUDA to run on a GPU");
}
FwdOut forward_cuda(const Tensor& q, const Tensor& k, const Tensor& v, double, bool) {
  check_same_device(k, "k", q);  // a mixed CPU/CUDA call is a device error first
  check_same_device(v, "v", q);
  no_cuda();
  return {};
}
std::tuple<Tensor, Tensor, Tensor> backward_cuda(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                 const Tensor& v, const Tensor& out, const Tensor& softmax_lse,
                                                 double, bool, const c10::optional<Tensor>&) {
  check_same_device(dout, "dout", q);
  check_same_device(k, "k", q);
  check_same_device(v, "v", q);
  check_same_device(out, "out", q);
  check_same_device(softmax_lse, "softmax_lse", q);
  no_cuda();
  return {};
}

#endif  // FLASH_ATTN_EXT_WITH_CUDA

}  // namespace

TORCH_LIBRARY(flash_attn_ext, m) {
  // Fake kernels and autograd live in this Python module; torch imports it on demand.
  m.set_python_module("flash_attn_ext.ops");
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal) -> (Tensor out, Tensor softmax_lse, "
      "Tensor softmax_stats)");
  m.def(
      "backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, float softmax_scale, "
      "bool causal, Tensor? softmax_stats=None) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(flash_attn_ext, CPU, m) {
  m.impl("forward", &forward_cpu);
  m.impl("backward", &backward_cpu);
}

TORCH_LIBRARY_IMPL(flash_attn_ext, CUDA, m) {
  m.impl("forward", &forward_cuda);
  m.impl("backward", &backward_cuda);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_attn_ext C++ extension: registers torch.ops.flash_attn_ext.{forward,backward}";
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
