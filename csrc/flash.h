// flash_attn_ext: the one parameter block that crosses from the torch-facing API
// (csrc/flash_api.cpp) into the kernels. Plain C++: no torch, no CUDA headers, so every kernel
// translation unit compiles without torch and the CPU build compiles it too.
//
// Layout is BSHD: q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim);
// the last dim is contiguous (stride 1), every other stride is free (in elements, 64-bit). Each
// tensor is a TensorView {ptr, strides}; kernels never compute an offset themselves: the
// per-sequence view of csrc/kernels/common/seqlen.cuh does (today dense, tomorrow from
// cu_seqlens / cache_seqlens / a block table without touching the kernels' bodies).
// softmax_lse is (batch, nheads, seqlen_q) float32, contiguous, natural log.
#pragma once

#include <cstdint>

// Same type as CUDA's own typedef, so this header needs no CUDA include.
typedef struct CUstream_st* cudaStream_t;

namespace flash {

// Long rows (kernels/common/long_rows.cuh): query tiles whose key blocks hold at least
// kLongRowKeys keys move O out of the tensor cores' accumulator every kFlushKeys keys. Below 2^18
// keys the accumulator's rounding stays under a quarter of bf16's (docs/PERF_NOTES.md,
// forty-first session); the API's FLASH_ATTN_EXT_LONG_ROW_KEYS knob lowers the bound for tests
// (the interval: min(bound, kFlushKeys)).
constexpr int kLongRowKeys = 1 << 18;
constexpr int kFlushKeys = 8192;

// One BSHD tensor: element (b, s, h, c) is at ptr + b*batch_stride + s*row_stride + h*head_stride + c.
struct TensorView {
  void* __restrict__ ptr = nullptr;
  int64_t batch_stride = 0, row_stride = 0, head_stride = 0;
};

struct Qkv_params {
  TensorView q, k, v;  // element type given by is_bf16 (else fp16), or float/double on the CPU
  int h = 0;            // nheads (query heads)
  int h_k = 0;          // nheads_k (key/value heads); h % h_k == 0
  int h_h_k_ratio = 1;  // h / h_k: query head hq reads kv head hq / h_h_k_ratio
};

struct Flash_fwd_params : public Qkv_params {
  TensorView o;

  // (b, h, seqlen_q) float32 contiguous, natural log. For a query row that sees no key (causal
  // with seqlen_q > seqlen_k), lse = +inf and out = 0.
  float* __restrict__ softmax_lse_ptr = nullptr;
  // The same LSE as an unevaluated sum in log2 units, exact at any input magnitude (the forward
  // writes it when non-null; the backward reads it when non-null, else derives it from the LSE):
  //   row_max_ptr[r]     = m_r = max_j (softmax_scale * log2(e) * S_rj), as the forward rounded it
  //   row_log2sum_ptr[r] = log2(sum_j exp2(softmax_scale * log2(e) * S_rj - m_r))
  // so LSE_r * log2(e) = m_r + log2sum_r. A row with no visible key has (+inf, 0). Both (b, h,
  // seqlen_q) float32 contiguous: the two planes of the op's softmax_stats output.
  float* __restrict__ row_max_ptr = nullptr;
  float* __restrict__ row_log2sum_ptr = nullptr;
  // Attention sinks (gpt-oss; null: none): (h,) float32, per query head a logit in the units of
  // softmax_scale * S (natural log) of one more key every row sees, whose value is zero. The
  // forward's epilogue adds it to the row's softmax: out *= exp(LSE - LSE'), LSE' = logaddexp(LSE,
  // sink); the statistics keep the row max and add LSE' - LSE (log2 units) to the log2 sum, so the
  // backward recomputes the sink's P from them unchanged. A row without keys: out 0, LSE' = sink,
  // statistics (+inf, 0) (P = 0). A sink of -inf is no sink. The backward reads it on the CPU only
  // (its float64 statistics recompute); the CUDA backward kernels never do.
  const float* __restrict__ sinks_ptr = nullptr;

  int b = 0;          // batch
  int seqlen_q = 0;
  int seqlen_k = 0;
  int d = 0;          // headdim as given by the user (multiple of 8, <= 256)
  int d_rounded = 0;  // compiled head dim the kernel runs with (>= d); columns
                      // d..d_rounded are zero-padded inside the kernel

  double scale_softmax = 0.0;      // softmax_scale, any finite value (double: exact for the CPU
                                   // float64 path; the CUDA kernels use it as float)
  float scale_softmax_log2 = 0.f;  // softmax_scale * log2(e): scores go through exp2
                                   // (softcap * log2(e) under soft-capping, below)
  // Logit soft-capping (Gemma 2; flash-attn's softcap; 0: none): the logit of score S is
  // softcap * tanh(S * softmax_scale / softcap) instead of S * softmax_scale. The kernels' twin for
  // it (launch picks kSoftcap when softcap > 0) first maps S to t = tanh(S * softcap_prescale),
  // softcap_prescale = softmax_scale / softcap, and then runs the usual softmax on t with
  // scale_softmax_log2 = softcap * log2(e), so row statistics and LSE are those of the capped
  // logits. The backward multiplies dS by dt/dS' = 1 - t^2 before its final softmax_scale
  // (scale_softmax stays softmax_scale). The API sets all three.
  float softcap = 0.f;
  float softcap_prescale = 0.f;

  // Attention dropout (FlashAttention, Dao et al. 2022, Alg. 2 / 4; flash-attn's dropout_p; 0: none):
  // P's element (q, k) of head (b, h) is kept with probability 1 - p and the kept ones scaled by
  // rp = 1 / (1 - p): O = (Z o P) V rp, the LSE that of P itself. Z comes from Philox4x32-10
  // (primitives/philox.cuh: DropoutRng) keyed by the call's rng_state, so the backward regenerates
  // it: dV = (Z o P)^T dO rp, dS = P o (Z o dP rp - D), D = rowsum(dO o O) as without dropout. p is
  // used as the 16-bit threshold resolves it (threshold / 2^16), rp its inverse complement
  // (unbiased). The API sets these; the kernels' kDropout twin (dispatched when dropout_p > 0) and
  // the CPU twin read threshold, rp and rng_state.
  double dropout_p = 0.0;           // p as given (> 0: the dropout twins run)
  uint32_t dropout_threshold = 0;  // an element is dropped iff its 16-bit random < threshold = round(p 2^16)
  float dropout_rp = 1.f;          // 1 / (1 - threshold / 2^16)
  const int64_t* __restrict__ dropout_rng_state = nullptr;  // (seed, offset) int64, on the op's device
  // The sequence index of batch 0 for the mask's positions (the CPU twin runs a varlen call one
  // sequence at a time; the CUDA kernels read the sequence index itself): 0 otherwise.
  int dropout_batch0 = 0;

  // ALiBi (Press et al. 2022, "Train Short, Test Long", section 3; flash-attn's alibi_slopes; null:
  // none): float32 slopes, slope(b, h) = alibi_slopes_ptr[b * alibi_slopes_batch_stride + h] (stride 0:
  // one (h,) row for every batch). The logit of query i and key j of a sequence gets
  //   -slope * |i + seqlen_k - seqlen_q - j|   (the sequence's own lengths: bottom-right aligned)
  // before the mask (never with soft-capping: the API refuses it). Kernels add it to the score S in
  // the units their exp2 scale multiplies: slope * alibi_unit * |i + seqlen_k - seqlen_q - j|,
  // alibi_unit = -1 / softmax_scale (the kernels' scale: the CUDA path's positive one), so row
  // statistics and LSE are those of the biased logits and the backward's recomputed P is too; dS
  // needs nothing more (the bias is a constant of S). The score-unit slope is clamped to float32's
  // range (mask.cuh: alibi_slope; a larger one is an infinitely steep bias: only the nearest key
  // counts). The API sets all three; the kernels' kAlibi twin reads them.
  const float* __restrict__ alibi_slopes_ptr = nullptr;
  int64_t alibi_slopes_batch_stride = 0;
  float alibi_unit = 0.f;

  bool is_causal = false;  // bottom-right aligned: query i sees key j <= i + seqlen_k - seqlen_q
  // Sliding window (local attention; flash-attn's window_size): with off = seqlen_k - seqlen_q,
  // query i sees key j only if i + off - window_left <= j (window_left >= 0) and
  // j <= i + off + window_right (window_right >= 0); -1: no bound on that side. is_causal is the
  // right bound 0 (the API sets window_right = -1 then), so kernels read the bounds through
  // AttnMask (kernels/common/mask.cuh). The API normalizes a bound that hides no key to -1.
  int window_left = -1;
  int window_right = -1;
  bool is_bf16 = false;    // element type of q/k/v/o: bf16 if true, else fp16

  // Device facts read once by the API (cudaGetDeviceProperties).
  int arch = 0;     // compute capability major*10 + minor (80, 86, 89, 90, ...)
  int num_sms = 0;
  int64_t l2_bytes = 0;  // L2 cache size (0: unknown)
  // select_arch (kernels/arch.h) chose the sm90 path for this call (set by dispatch.cu): the
  // split-KV kernel's TMA rows run only then (force_sm80_path turns them off too).
  bool sm90_path = false;
  // Tuning knobs for A/B runs, set by dispatch.cu from the environment (read once):
  //   varlen_tight: varlen grids of the real tiles only where they pay (common/work.cuh:
  //     varlen_tight_grid); FLASH_ATTN_EXT_VARLEN_TIGHT_GRID=0 keeps the grids of max_seqlen.
  //   sm90_bwd_tma: the sm90 backward streams its tiles by TMA where it can (sm90/smem_layout.cuh:
  //     launch_bwd_stages); FLASH_ATTN_EXT_SM90_BWD_TMA=0 copies them by cp.async.
  // Either setting of those two gives the same bits.
  //   fwd_top_shift: the sm90 forward's causal partial Q tile at the top (common/tile_scheduler.cuh:
  //     m_shift; varlen: each sequence's, QTileWork::kShiftPerSequence);
  //     FLASH_ATTN_EXT_SM90_FWD_TOP_SHIFT=0 keeps it at the bottom (the same bits: whole
  //     64-row warpgroup slabs move to another tile and warpgroup, each with its own key blocks in
  //     the same order; tests/test_sm90_forward.py: test_sm90_forward_top_shift_knob).
  bool varlen_tight = true;
  bool sm90_bwd_tma = true;
  bool fwd_top_shift = true;

  // ---- Packed variable-length sequences (varlen; flash_attn_varlen_func). q/o/dq are
  // (total_q, nheads, d) and k/v/dk/dv (total_k, nheads_k, d), given as TensorViews with
  // batch_stride 0; sequence b owns rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of the q side and
  // [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of the k side (common/seqlen.cuh reads them). seqlen_q /
  // seqlen_k then hold the caller's max_seqlen_q / max_seqlen_k (they size the grids and workspaces; a
  // sequence longer than them is cut to its first max rows / keys, its other rows not written:
  // documented, not checkable without a device sync), b the number of sequences. softmax_lse and the softmax_stats planes are (nheads,
  // total_q): row r of sequence b, head h at h * total_q + cu_seqlens_q[b] + r.
  const int* __restrict__ cu_seqlens_q = nullptr;  // (b + 1) int32, device memory; null: dense
  const int* __restrict__ cu_seqlens_k = nullptr;  // (b + 1) int32; set together with cu_seqlens_q
  int total_q = 0;  // rows of the packed q (varlen only)
  int total_k = 0;  // rows of the packed k / v (varlen only)
  // Two int32 in device memory, zero at the launch (the API's, per stream, for varlen forward calls
  // on compute capability 9.x): the sm90 forward's persistent varlen grid claims its tiles from
  // [0] (common/tile_scheduler.cuh: dynamic) and counts its finished CTAs in [1]; the last one to
  // finish sets both to zero again, so the stream's next call needs no memset. null: the varlen
  // forward runs one CTA per tile. (A full pack, total rows = batch x max_seqlen, takes the static
  // walk, which does not read it, and the API passes none: sm90_fwd_schedule below.)
  int* __restrict__ tile_counter = nullptr;

  // ---- Long rows (kernels/common/long_rows.cuh): a row whose key blocks hold at least
  // long_row_keys keys moves O from the tensor cores' accumulator to o_flush_ptr every flush_keys
  // keys (their accumulation rounds toward zero: past ~2^20 keys more error than bf16's). The
  // API sets long_rows_alloc (torch's allocator, on the call's stream, the memory alive until the
  // call returns) for calls with such rows only; the forward's launch sizes both workspaces for
  // its grid and asks for them (long_rows.cuh: alloc_long_rows; null: no row flushes), float32:
  //   the sm80 kernel, one slot per query row (a grid of one CTA per tile): o_flush_ptr (h,
  //     o_flush_rows, o_flush_width), o_flush_max_ptr (h, o_flush_rows, 4), o_flush_rows = (dense:
  //     b * seqlen_q; varlen: total_q) + 512 * b;
  //   the sm90 kernel, one slot per CTA (its CTAs run their tiles one after another): (gridDim.x,
  //     o_flush_rows, ...), o_flush_rows = kBlockM.
  // Contents need no init.
  float* (*long_rows_alloc)(void* ctx, int64_t floats) = nullptr;  // never null on return (throws)
  void* long_rows_alloc_ctx = nullptr;
  float* __restrict__ o_flush_ptr = nullptr;
  float* __restrict__ o_flush_max_ptr = nullptr;
  int64_t o_flush_rows = 0;
  int o_flush_width = 0;  // floats per row of o_flush_ptr: the kernel's O accumulator columns
  int long_row_keys = kLongRowKeys;
  int flush_keys = kFlushKeys;

  // ---- KV cache (flash_attn_with_kvcache). Sequence b sees cache rows [0, min(cache_seqlens[b] +
  // seqlen_knew, seqlen_k)) (from row leftpad_k[b] on, below): the cached keys plus the seqlen_knew
  // keys this call appends (knew / vnew, (b, seqlen_knew, nheads_k, d), written into the cache at
  // rows cache_seqlens[b] + i before the attention runs, rows past the cache's seqlen_k dropped).
  // null: all seqlen_k keys.
  const int* __restrict__ cache_seqlens = nullptr;  // (b) int32, device memory
  // Left-padded contiguous caches (flash-attn's cache_leftpad): sequence b's keys start at cache row
  // leftpad_k[b], so it sees rows [leftpad_k[b], min(cache_seqlens[b] + seqlen_knew, seqlen_k)),
  // bottom-right aligned as a sequence of that many keys (common/seqlen.cuh: kv_leftpad); the
  // append still writes at rows cache_seqlens[b] + i. null: 0. Not with block_table; needs
  // cache_seqlens (the API passes the capacity for every sequence when the caller gave none).
  const int* __restrict__ leftpad_k = nullptr;      // (b) int32, device memory
  TensorView knew, vnew;                            // ptr null: nothing to append
  int seqlen_knew = 0;
  // Paged KV: k / v are (num_blocks, page_size, nheads_k, d) (TensorView batch_stride = the block
  // stride); key row r of sequence b is row r % page_size of block
  // block_table[b * block_table_batch_stride + r / page_size]; seqlen_k = max_blocks * page_size.
  const int* __restrict__ block_table = nullptr;  // (b, max_blocks) int32, device memory; null: contiguous
  int64_t block_table_batch_stride = 0;
  int page_size = 0;
  int num_blocks = 0;  // blocks of the paged k / v (bounds of block_table's entries)

  // ---- Split-KV (FlashDecoding): the keys of a (sequence, head) split over num_splits CTAs, each
  // writing a partial (O, LSE) in float32 that a combine kernel merges by their LSEs.
  int num_splits = 1;
  // The split-KV launch's estimate of the call's K/V reads, from the cache's capacity (the host
  // cannot read cache_seqlens), exceeds twice the L2: only a quarter of their lines are marked
  // evict-first (primitives/cp_async.cuh: l2_policy_stream). Set for the TMA rows only (measured
  // there; the cp.async rows keep all lines evict-first).
  bool kv_stream_exceeds_l2 = false;
  // Balanced splits (common/splitkv_work.cuh; plan_kvcache_splits sets both): the num_splits * b
  // units (CTAs, and slots of the accumulators' first two dimensions) of a (kv head, row tile)
  // shared out over the sequences by their lengths, splits_equal <= num_splits each when the lengths
  // are equal (the unbalanced grid's count). false: sequence b's split s in slot s * batch + b.
  // Both sit in the padding before oaccum_ptr (splits_equal <= kMaxSplits: 16 bits), so the
  // params' layout, and the code of every kernel that does not read them, is as before.
  bool balance_splits = false;
  int16_t splits_equal = 1;
  float* __restrict__ oaccum_ptr = nullptr;     // (num_splits, b, h, seqlen_q, d_rounded) float32
  float* __restrict__ softmax_lseaccum_ptr = nullptr;  // (num_splits, b, h, seqlen_q) float32

};

struct Flash_bwd_params : public Flash_fwd_params {
  // dO: same shape as out; last dim contiguous (the API makes it so), other strides free
  // (zero strides allowed: out.sum().backward()).
  TensorView dout;
  // Gradients: dq like q, dk/dv like k/v (nheads_k heads), written, never accumulated.
  TensorView dq, dk, dv;

  // Workspaces written by the preprocess kernel (kernels/common/bwd_preprocess.cuh),
  // (b, h, seqlen_q_rounded) float32, and one flag per 128 query rows:
  //   dsoftmax_sum[i]      = D_i = rowsum(dO_i * O_i)                        (FA2 Alg. 2 line 4)
  //   softmax_lse_log2[i]  = hi_i, softmax_lse_log2_lo[i] = lo_i: LSE_i * log2(e) = hi_i + lo_i
  //                          (+inf, 0 for rows without keys and rows past seqlen_q: P = 0)
  //   precise_rows[(b*h + head) * (seqlen_q_rounded / 128) + i / 128] = 1 when a row of the block
  //                          needs the exact P recompute (lo_i != 0: large-magnitude scores),
  //                          else 0: lo is 0 there and P = exp2(S * scale_log2 - hi) in one FFMA.
  float* __restrict__ dsoftmax_sum_ptr = nullptr;
  float* __restrict__ softmax_lse_log2_ptr = nullptr;
  float* __restrict__ softmax_lse_log2_lo_ptr = nullptr;
  int* __restrict__ precise_rows_ptr = nullptr;
  int seqlen_q_rounded = 0;  // seqlen_q rounded up to a multiple of 128
  // Varlen: the three workspaces are (nheads, varlen_ws_rows(total_q, b)) instead, sequence b's
  // rows from a 16-byte-aligned offset with room for its rows rounded up to 128 (SeqInfo::ws_index);
  // precise_rows stays (b, nheads, seqlen_q_rounded / 128) with seqlen_q = max_seqlen_q.
};

// Rows per head of the varlen backward workspaces: sequence b starts at round_up(cu_seqlens_q[b],
// 4) + kVarlenWsPad * b, so its rows rounded up to 128 fit before sequence b + 1's start
// (round_up(c, 4) <= c + 3, rows rounded up to 128 add <= 127, 3 + 127 <= kVarlenWsPad) and
// every start is 16-byte aligned.
constexpr int kVarlenWsPad = 132;
constexpr int64_t varlen_ws_rows(int64_t total_q, int64_t batch) {  // constexpr: device code calls it too
  return (total_q + kVarlenWsPad * batch + 3) / 4 * 4;
}

// ---- Dispatch points (one per op). Defined in csrc/kernels/dispatch.cu.
// They pick the arch path (kernels/arch.h: select_arch), head dim and dtype, and throw
// std::runtime_error on a combination that was not compiled or on a failed launch.
void run_mha_fwd(Flash_fwd_params& params, cudaStream_t stream);
// The bound of long rows (flash.h: long_row_keys): kLongRowKeys, or FLASH_ATTN_EXT_LONG_ROW_KEYS.
int long_row_keys();
void run_mha_bwd(Flash_bwd_params& params, cudaStream_t stream);

// Largest sequence length (seqlen_q, seqlen_k, max_seqlen_q / _k, total_q / _k, the packed GQA rows
// seqlen_q * nheads / nheads_k of a KV-cache call) the kernels take: 2^31 - 256, so that tile counts
// ceil(n / kBlock) (kBlock <= 256) and 128-row roundings of n stay in int32. flash_api.cpp refuses
// longer ones by name.
constexpr int kMaxSeqlen = 2147483647 - 255;
// The longest seqlen_q + seqlen_k of a call with a sliding window (flash_api.cpp: mask_args), so
// that the window's mask sums stay in int32 (kernels/common/mask.cuh).
constexpr int64_t kMaxWindowedSeqlens = 2147483647 - 511;

// The KV-cache forward (flash_attn_with_kvcache; params with cache_seqlens and/or block_table,
// seqlen_q >= 1): appends knew / vnew into the cache, then runs the split-KV kernel with
// params.num_splits splits (>= 1; > 1 needs oaccum_ptr / softmax_lseaccum_ptr) and, when split,
// the combine kernel. Defined in csrc/kernels/dispatch.cu.
void run_mha_fwd_kvcache(Flash_fwd_params& params, cudaStream_t stream);

// How the sm90 forward deals a call's tiles (kernels/common/tile_scheduler.cuh: FwdTileScheduler,
// whose Schedule has these values): one CTA per tile, the static persistent walk, or the dynamic
// walk, which claims tiles from params.tile_counter (varlen calls only; so the API fetches a
// counter only for those). Host arithmetic on params' sizes (b, seqlen_q / _k, total_q / _k,
// cu_seqlens_q) and the knob FLASH_ATTN_EXT_SM90_FWD_SCHEDULE, read once (throws on a value it
// does not know). Defined in csrc/kernels/dispatch.cu, which gives the rule's reasons.
enum Sm90FwdSchedule { kSm90FwdTile = 0, kSm90FwdPersistent = 1, kSm90FwdDynamic = 2 };
Sm90FwdSchedule sm90_fwd_schedule(const Flash_fwd_params& params);

// num_splits for a KV-cache call from its shapes and params.num_sms alone (host arithmetic, no
// device sync, so a decode step stays CUDA-graph capturable): 1 when the (sequence, kv head, query
// tile) CTAs already fill the GPU, else enough splits to fill it, at most kMaxSplits.
constexpr int kMaxSplits = 128;
int num_splits_heuristic(const Flash_fwd_params& params);
// A KV-cache call's split plan (host arithmetic): num_splits (requested > 0, else the heuristic's),
// and for a batch whose lengths may differ (cache_seqlens, b > 1) the balanced splits' grid:
// num_splits = the units per sequence, splits_equal = the count of equal lengths. Defined in
// csrc/kernels/dispatch.cu, which gives the rule.
void plan_kvcache_splits(Flash_fwd_params& params, int requested);

// Head dim the kernels run a user head dim `d` with (the smallest compiled one >= d), or 0 if
// none compiled in this build covers it. One rule for the forward and the backward.
int rounded_headdim(int d);

// Forces (true) or releases (false) the sm80 path on GPUs where select_arch (kernels/arch.h) would
// pick another; returns the previous setting. The environment variable FLASH_ATTN_EXT_DISABLE_SM90
// gives the initial setting, read once. For tests and comparisons (flash_attn_ext.force_sm80_path).
bool force_sm80_path(bool force);

// Compiled head dims, for build_info(); comma separated, e.g. "32,64,96,128,192,256".
const char* compiled_headdims();

}  // namespace flash
