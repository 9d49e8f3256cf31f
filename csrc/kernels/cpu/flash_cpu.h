// flash_attn_ext CPU path: the same tiled algorithm as the CUDA kernels, in plain C++.
//   forward  = FlashAttention-2 Alg. 1 (Dao 2023): online softmax over K/V tiles, LSE out.
//   backward = FlashAttention-2 Alg. 2: recomputation from the LSE; a dK/dV pass (K/V tile
//              fixed, loop over Q tiles) and a dQ pass (Q tile fixed, loop over K/V tiles).
// Extra memory is O(seqlen): per-tile scratch and one D = rowsum(dO * O) vector.
// No torch here: flash_api.cpp checks the arguments, allocates the outputs and fills the
// params (csrc/flash.h). The workspace pointers of Flash_bwd_params are not used.
#pragma once

#include "flash.h"

namespace flash {
namespace cpu {

// Element type of q/k/v/out/dout/dq/dk/dv. Accumulation is float32 for 16-bit inputs, float64 for
// kFloat32 and kFloat64.
enum class Dtype { kFloat32, kFloat64, kFloat16, kBFloat16 };

// Writes params.o (BSHD), params.softmax_lse_ptr ((b, h, seqlen_q) float32, natural log; +inf
// and out = 0 for a row that sees no key) and, when non-null, row_max_ptr / row_log2sum_ptr (the
// LSE's two parts in log2 units, flash.h). Needs b, seqlen_q, seqlen_k >= 1; uses params.d (any
// multiple of 8 up to 256), ignores d_rounded. params.softcap > 0: the soft-capped logits
// (flash.h), computed from params.softcap and scale_softmax in the accumulation type.
void run_mha_fwd_cpu(const Flash_fwd_params& params, Dtype dtype);

// Writes dq/dk/dv (never accumulates) from dout, q, k, v, o and the LSE: row_max_ptr /
// row_log2sum_ptr when non-null (exact at any magnitude), else softmax_lse. params.softcap > 0:
// dS gains the factor 1 - t^2 (flash.h).
void run_mha_bwd_cpu(const Flash_bwd_params& params, Dtype dtype);

}  // namespace cpu
}  // namespace flash
