"""Math reference for attention, used by the tests and the benchmark.

Standard attention, materialising the (seqlen_q, seqlen_k) score matrix:
    S = softmax_scale * Q K^T,  P = softmax(S) (row-wise),  O = P V,  LSE = logsumexp(S)
(Vaswani et al. 2017, eq. 1). Same conventions as the kernels: BSHD layout, GQA/MQA by
repeating K/V heads, causal masks aligned to the bottom-right corner, and a query row that
sees no key gives O = 0 and LSE = +inf.

``attention_ref(..., upcast=True)`` is the accuracy reference (computed in float64 by default);
``upcast=False`` computes in the inputs' own dtype: the "torch same-dtype math" baseline of the
accuracy criterion  max|ours - ref| <= 2 * max|baseline - ref|  (FlashAttention's test rule).
"""

from __future__ import annotations

import math

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) mask, True where query i may see key j:
    j <= i + seqlen_k - seqlen_q (bottom-right aligned)."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return j <= i + (seqlen_k - seqlen_q)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    upcast: bool = True,
    ref_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention on BSHD tensors.

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        k, v: (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0.
        softmax_scale: defaults to 1 / sqrt(headdim).
        causal: bottom-right aligned causal mask.
        upcast: compute in ``ref_dtype`` (float64 by default) if True, else in q's dtype.
    Returns:
        out: (batch, seqlen_q, nheads, headdim) in the compute dtype (differentiable).
        lse: (batch, nheads, seqlen_q) float32 natural-log logsumexp of the scaled scores
             (+inf for rows that see no key).
    """
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    dtype = ref_dtype if upcast else q.dtype
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    nheads, nheads_k = q.shape[2], k.shape[2]
    if nheads != nheads_k:
        kf = kf.repeat_interleave(nheads // nheads_k, dim=2)
        vf = vf.repeat_interleave(nheads // nheads_k, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * softmax_scale
    if causal:
        mask = causal_mask(q.shape[1], k.shape[1], device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores.float() if dtype != torch.float64 else scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    # Rows with no visible key: softmax of all -inf is NaN; the convention is P = 0.
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return out, lse.float()


def attention_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int,
                    causal: bool, mode: str = "fwd") -> float:
    """Matmul FLOPs by the standard count (the one FlashAttention's
    benchmarks use): forward 4·B·H·Nq·Nk·d, halved when causal; backward 2.5 × forward;
    "fwd_bwd" 3.5 × forward."""
    f = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim * (0.5 if causal else 1.0)
    return {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode] * f
