// flash_attn_ext: the one parameter block that crosses from the torch-facing API
// (csrc/flash_api.cpp) into the kernels. Plain C++: no torch, no CUDA headers, so
// every kernel translation unit compiles without torch and the CPU build compiles
// it too.
//
// Layout is BSHD: q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k,
// nheads_k, headdim); the last dim is contiguous (stride 1), every other stride is
// free (in elements, 64-bit). softmax_lse is (batch, nheads, seqlen_q) float32,
// contiguous, natural log.
#pragma once

#include <cstdint>

// Same type as CUDA's own typedef, so this header needs no CUDA include.
typedef struct CUstream_st* cudaStream_t;

namespace flash {

struct Qkv_params {
  // Base pointers (element type given by is_bf16 / is_fp16 / float).
  void* __restrict__ q_ptr = nullptr;
  void* __restrict__ k_ptr = nullptr;
  void* __restrict__ v_ptr = nullptr;

  // Strides in elements.
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;

  int h = 0;          // nheads (query heads)
  int h_k = 0;        // nheads_k (key/value heads); h % h_k == 0
  int h_h_k_ratio = 1;  // h / h_k: query head hq reads kv head hq / h_h_k_ratio
};

struct Flash_fwd_params : public Qkv_params {
  void* __restrict__ o_ptr = nullptr;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  // (b, h, seqlen_q) float32 contiguous, natural log. For a query row that sees no
  // key (causal with seqlen_q > seqlen_k), lse = +inf and out = 0.
  float* __restrict__ softmax_lse_ptr = nullptr;

  int b = 0;          // batch
  int seqlen_q = 0;
  int seqlen_k = 0;
  int d = 0;          // headdim as given by the user (multiple of 8, <= 256)
  int d_rounded = 0;  // compiled head dim the kernel runs with (>= d); columns
                      // d..d_rounded are zero-padded inside the kernel

  double scale_softmax = 0.0;      // softmax_scale (double: exact for the CPU float64 path;
                                   // the CUDA kernels use it as float)
  float scale_softmax_log2 = 0.f;  // softmax_scale * log2(e): scores go through exp2

  bool is_causal = false;  // bottom-right aligned: query i sees key j <= i + seqlen_k - seqlen_q
  bool is_bf16 = false;    // element type of q/k/v/o: bf16 if true, else fp16

  // Device facts read once by the API (cudaGetDeviceProperties).
  int arch = 0;     // compute capability major*10 + minor (80, 86, 89, 90, ...)
  int num_sms = 0;

  // Roadmap (not implemented yet; a feature = a field here + a kernel file):
  // cu_seqlens_q/k (varlen), window_size_left/right, alibi_slopes, softcap,
  // p_dropout, paged KV block table, split-KV accumulators.
};

struct Flash_bwd_params : public Flash_fwd_params {
  // dO: same shape as out; last dim contiguous (the API makes it so), other strides free
  // (zero strides allowed: out.sum().backward()).
  void* __restrict__ do_ptr = nullptr;
  int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;

  // Gradients: dq like q, dk/dv like k/v (nheads_k heads), written, never accumulated.
  void* __restrict__ dq_ptr = nullptr;
  void* __restrict__ dk_ptr = nullptr;
  void* __restrict__ dv_ptr = nullptr;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;

  // Workspace written by the preprocess kernel, (b, h, seqlen_q_rounded) float32:
  //   dsoftmax_sum[i]      = D_i = rowsum(dO_i * O_i)             (Alg. 2 line 4 of FA2)
  //   softmax_lse_log2[i]  = LSE_i * log2(e), +inf rows mapped so P = 0
  float* __restrict__ dsoftmax_sum_ptr = nullptr;
  float* __restrict__ softmax_lse_log2_ptr = nullptr;
  int seqlen_q_rounded = 0;  // seqlen_q rounded up to a multiple of 128
};

// ---- Dispatch points (one per op). Defined in csrc/kernels/flash_{fwd,bwd}_dispatch.cu.
// They pick the arch path (today: sm80 for every SM >= 8.0), head dim and dtype, and
// throw std::runtime_error on a combination that was not compiled or on a failed launch.
void run_mha_fwd(Flash_fwd_params& params, cudaStream_t stream);
void run_mha_bwd(Flash_bwd_params& params, cudaStream_t stream);

// Head dim the kernels will run a user head dim `d` with (the next compiled one),
// or 0 if none compiled in this build covers it.
int fwd_rounded_headdim(int d);
int bwd_rounded_headdim(int d);

// Compiled head dims, for build_info(); comma separated, e.g. "32,64,96,128,192,256".
const char* compiled_headdims();

}  // namespace flash
