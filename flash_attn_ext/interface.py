"""User-facing functions over the ``torch.ops.flash_attn_ext`` ops (autograd included)."""

from __future__ import annotations

import math

import torch

from . import ops  # registers fake kernels, autograd and vmap rules


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    return_lse: bool = False,
):
    """Exact attention ``softmax(softmax_scale * Q K^T) V`` without materialising the scores.

    FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and
    Work Partitioning"): forward = Alg. 1 (tiled online softmax, saves the row softmax
    statistics), backward = Alg. 2 (recomputes the probabilities from the saved statistics).

    Differentiation (w.r.t. q, k, v):
      * reverse mode (``.backward()``, ``torch.autograd.grad``, ``torch.func.grad`` / ``vjp`` /
        ``jacrev``): the FlashAttention-2 backward kernel. Not twice differentiable: double
        backward raises RuntimeError.
      * forward mode (``torch.func.jvp`` / ``jacfwd``, ``torch.autograd.forward_ad``): exact,
        computed with plain torch ops from q, k, v and their tangents (dS = c (dQ K^T + Q dK^T),
        dO = (P * (dS - rowsum(P * dS))) V + P dV). This materialises the probabilities P,
        (batch, nheads, seqlen_q, seqlen_k) in float32 (float64 for float64 inputs), so it costs
        O(seqlen_q * seqlen_k) memory, unlike the forward and backward passes. Forward mode over
        reverse mode (``torch.func.hessian``) raises NotImplementedError.
      * ``torch.vmap`` (also around ``torch.func.grad`` for per-sample gradients): the vmapped
        dimension is folded into the batch, one kernel call for the whole vmapped batch.

    Args:
        q: (batch, seqlen_q, nheads, headdim), BSHD.
        k: (batch, seqlen_k, nheads_k, headdim). nheads must be a multiple of nheads_k
            (nheads_k < nheads: grouped-query / multi-query attention; query head h reads
            key/value head h // (nheads // nheads_k)).
        v: like k.
            q, k, v: one device, one dtype, stride 1 along headdim (other strides free, so
            transposed BHSD tensors and slices of a fused qkv tensor work without a copy).
            dtype: float16 or bfloat16 on CUDA; float32, float64, float16 or bfloat16 on CPU.
            headdim: a multiple of 8, at most 256.
        softmax_scale: multiplies Q K^T before the softmax; default 1 / sqrt(headdim). Any finite
            value (negative and zero included) with |softmax_scale| * log2(e) < 3.4e38.
            Magnitude: outputs and gradients stay finite for any finite inputs whose scores q . k
            and scaled scores softmax_scale * log2(e) * q . k fit in float32 (the softmax keeps
            its max and sum apart, softmax_stats, so ties stay exact at any magnitude). Past that
            (|q . k| > 3.4e38 in float32 accumulation) scores overflow to inf and outputs are NaN;
            float64 CPU inputs compute in float64 but return the LSE in float32 (+inf past its
            range). Gradients of near-tied scores at magnitudes where float32 score rounding is
            coarse (|scaled score| >> 1e4) carry that rounding (on CUDA the backward recomputes the
            scores in another summation order and treats scores within 2-4 float32 ulps of the row
            max as tied), as any recomputing attention backward does.
        causal: mask aligned to the bottom-right corner: query i sees key j iff
            j <= i + seqlen_k - seqlen_q. When seqlen_q > seqlen_k the first query rows see no
            key: their output is 0, their LSE is +inf and their gradients are 0 (never NaN).
        return_lse: also return the log-sum-exp.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype, contiguous.
        softmax_lse (only if return_lse): (batch, nheads, seqlen_q) float32,
            LSE_i = log(sum_j exp(softmax_scale * q_i . k_j)) in natural log (+inf when no key is
            visible). It carries no gradient.

    Raises:
        RuntimeError: before any work, with a message naming the argument, for: tensors on
            different devices; mismatched or unsupported dtypes; rank != 4; batch / seqlen_k /
            nheads_k / headdim mismatches between q, k and v; nheads not divisible by nheads_k;
            headdim not a multiple of 8 or > 256 (or a CUDA head dim not compiled in this build);
            a last dimension that is not contiguous; a softmax_scale that is not finite or whose
            |softmax_scale| * log2(e) overflows float32; double backward.
        NotImplementedError: forward-mode AD through the backward pass (e.g. torch.func.hessian).

    Zero-length batch or seqlen_q gives empty outputs without running a kernel; seqlen_k = 0
    gives out = 0 and LSE = +inf.
    """
    if softmax_scale is None:
        # headdim 0 is rejected by the op with a message naming headdim; don't divide by zero first.
        softmax_scale = 1.0 / math.sqrt(q.shape[-1]) if q.dim() > 0 and q.shape[-1] > 0 else 1.0
    out, softmax_lse, _ = ops.attention_forward(q, k, v, float(softmax_scale), bool(causal))
    return (out, softmax_lse) if return_lse else out

