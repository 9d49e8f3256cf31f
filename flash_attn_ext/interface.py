"""User-facing functions over the ``torch.ops.flash_attn_ext`` ops (autograd included)."""

from __future__ import annotations

import torch

from . import _fake_checks
from . import ops  # registers fake kernels, autograd and vmap rules
# The dense functions are defined here; the argument helpers, the varlen and the KV-cache functions
# live in _args.py, varlen.py and kvcache.py, re-exported here (flash_attn_ext.interface.X as before).
from ._args import (_as_bool, _as_int, _check_tensors, _cut, _dropout_args, _dropout_p,  # noqa: F401
                    _flash_attn_keywords, _is_numpy_bool, _kernel_layout, _maybe_contiguous, _real, _scale, _sinks,
                    _softcap, _unpack, _window, _with_attn_probs, dropout_rng_state)
from .kvcache import _cache_batch_idx_as_block_table, _rotary_for_kvcache, flash_attn_with_kvcache  # noqa: F401
from .varlen import (_paged_varlen, flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,  # noqa: F401
                     flash_attn_varlen_qkvpacked_func)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
):
    """Exact attention ``softmax(softmax_scale * Q K^T) V`` without materialising the scores
    (optionally with the logits soft-capped: ``softcap``).

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
        v: like k, its head dim possibly another (headdim_v: multi-head latent attention, e.g.
            DeepSeek-V3's 192 / 128, FlashAttention-3's hdim_v; both run padded to the larger).
            q, k, v: one device, one dtype; any strides (transposed BHSD tensors and slices of a
            fused qkv tensor run without a copy while the stride along headdim is 1; another is
            copied contiguous first, as flash-attn does).
            dtype: float16 or bfloat16 on CUDA; float32, float64, float16 or bfloat16 on CPU.
            Used as given: ``torch.autocast`` does not cast them here (the nn modules and
            ``flash_attn_ext.sdpa`` apply it); cast float32 activations yourself for CUDA.
            headdim: at most 256; one that is not a multiple of 8 is zero-padded to the next
            (a copy of q, k, v; the output cut back), as flash-attn does; softmax_scale's
            default stays 1 / sqrt(headdim).
        Positional order after v: flash-attn's (>= 2.6: dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, return_attn_probs), so calls
            ported from it, positional ones included, run unchanged; return_lse and sinks
            (not flash-attn's) are keyword-only.
        softmax_scale: multiplies Q K^T before the softmax; default 1 / sqrt(headdim). A real
            number (not a bool or a string), finite (negative and zero included), with
            |softmax_scale| * log2(e) < 3.4e38.
            Magnitude: outputs and gradients stay finite for any finite inputs whose scores q . k
            and scaled scores softmax_scale * log2(e) * q . k fit in float32 (the softmax keeps
            its max and sum apart, softmax_stats, so ties stay exact at any magnitude). Past that
            (|q . k| > 3.4e38 in float32 accumulation) CUDA scores overflow to inf and outputs
            are NaN; the CPU twin accumulates float32 inputs in float64 (finite outputs there)
            and float64 inputs in float64, but returns the LSE in float32: +inf or -inf past its
            range (its sign; +inf otherwise marks a row without visible keys), so there only a
            backward given softmax_stats (as autograd's is) stays right: the raw backward without
            them recomputes P from that LSE (-inf: infinite gradients). Gradients of near-tied
            scores at magnitudes where float32 score rounding is
            coarse (|scaled score| >> 1e4) carry that rounding (on CUDA the backward recomputes the
            scores in another summation order and treats scores within 2-4 float32 ulps of the row
            max as tied), as any recomputing attention backward does.
        causal: mask aligned to the bottom-right corner: query i sees key j iff
            j <= i + seqlen_k - seqlen_q. When seqlen_q > seqlen_k the first query rows see no
            key: their output is 0, their LSE is +inf and their gradients are 0 (never NaN).
        window_size: (left, right) sliding window (local attention, as flash-attn's; Beltagy et
            al. 2020, "Longformer"): query i sees key j only if i + off - left <= j <= i + off +
            right, off = seqlen_k - seqlen_q (bottom-right aligned); -1 leaves that side unbounded
            (the default (-1, -1): full attention). With causal=True the right side is 0 whatever
            window_size[1] says (flash-attn's rule, so ``causal=True, window_size=(w, w)`` is
            ``(w, 0)``). Unlike flash-attn's kernels, each side is what it says: flash-attn drops
            a right bound >= seqlen_k, and with a left bound turns a right -1 into seqlen_k (they
            differ only where seqlen_q > seqlen_k + 1; README.md, window_size). Rows whose window holds no
            key give out 0, LSE +inf, zero gradients. A window that hides keys needs seqlen_q +
            seqlen_k <= 2^31 - 512 (RuntimeError).
        return_lse: also return the log-sum-exp.
        sinks: attention sinks (gpt-oss, "learnable sinks"; Xiao et al. 2024, "Efficient
            Streaming Language Models with Attention Sinks", as one logit per head): None, or
            (nheads,) of any floating dtype on q's device (used as float32). Per query head h a
            logit sinks[h], in the units of softmax_scale * q.k (natural log), of one more key
            that every row sees and whose value is zero: P_ij = exp(S_ij - LSE_i) with LSE_i =
            log(exp(sinks[h]) + sum_j exp(S_ij)); the sink's own probability is dropped, so a
            row's weights sum to less than 1. Differentiable: d sinks[h] = -sum_{b,i}
            exp(sinks[h] - LSE_i) D_i, D = rowsum(dout * out) (FlashAttention-2 Alg. 2's D). The
            kernels add the sink in their epilogue (the backward kernels need nothing: P comes
            from the LSE, which includes it). -inf for a head is no sink. A sink is a logit as
            given: softcap does not cap it.
        softcap: logit soft-capping (Gemma 2: Gemma Team et al. 2024, "Gemma 2: Improving Open
            Language Models at a Practical Size", section 2, "Logit soft-capping"; flash-attn >= 2.6's
            ``softcap``): a real number >= 0 (a Python float; ints, NumPy scalars and 0-dim
            tensors are taken too), 0.0 (the default) meaning none. With softcap > 0 the logit of
            score S_ij = q_i . k_j is
                softcap * tanh(S_ij * softmax_scale / softcap)     instead of     S_ij * softmax_scale,
            in the units of softmax_scale * q.k (natural log), so every logit lies in [-softcap,
            softcap]: Gemma 2 uses 50.0 (``config.attn_logit_softcapping``). The kernels map S to
            t = tanh(S * softmax_scale / softcap) and run the usual softmax on softcap * t; the
            backward multiplies dS by 1 - t^2 (FlashAttention-2 Alg. 2's dS = P (dP - D), then the
            chain rule through the cap) before the usual softmax_scale. softmax_lse is that of the
            capped logits. The cap is used as float32 (a value that float32 cannot hold exactly
            is rounded once, on every device). Differentiable in q, k, v (reverse and forward
            mode), not in softcap (a constant). Composes with causal, window_size, sinks and GQA.
        dropout_p: attention dropout probability in [0, 1) (FlashAttention, Dao et al. 2022,
            section 3.1 and Algorithms 2 / 4; flash-attn's dropout_p), 0.0 (the default) none: each
            element of P is dropped with probability p and the kept ones are scaled by 1 / (1 - p),
            so out = (Z o P) V / (1 - p); softmax_lse stays that of P. p is dropout_p as 16-bit
            randoms resolve it, round(dropout_p 2^16) / 2^16 (at most 1 - 2^-16), so the output
            stays unbiased (e.g. 0.99999 drops with p = 65535 / 65536). The mask
            comes from a counter-based generator (Philox4x32-10) keyed by a state drawn from torch's
            generator on q's device per call (``dropout_rng_state``: torch.manual_seed makes it
            reproducible, CUDA graphs and torch.compile capture it); the backward regenerates it,
            nothing of size seqlen_q x seqlen_k is stored. Pass 0.0 in evaluation (flash-attn's
            convention: the caller decides, e.g. ``dropout_p if self.training else 0.0``). On CUDA the
            kDropout twins of the kernels the call would run without it (H100 / H200: the sm90
            forward and backward); not with softcap or a window's left bound
            (NotImplementedError).
        alibi_slopes: ALiBi (Press et al. 2022, "Train Short, Test Long", section 3; flash-attn's
            alibi_slopes): None, or float32 slopes of shape (nheads,) or (batch, nheads) on q's
            device; the logit of query i and key j gets -slope[b, h] * |i + seqlen_k - seqlen_q - j|
            (bottom-right aligned, as causal), so softmax_lse is that of the biased logits.
            Fixed slopes in reverse mode: no gradient (as flash-attn), so slopes that require grad
            (with grad enabled) raise NotImplementedError; forward mode (torch.func.jvp, forward_ad
            dual slopes) carries their tangent. Not with softcap,
            dropout_p > 0 or a window's left bound that hides keys (window_size[0] < seqlen_k - 1;
            NotImplementedError); softmax_scale = 0 raises ValueError; another dtype, shape or
            device: RuntimeError naming alibi_slopes; not a tensor: TypeError. The values are not
            checked (that would need a host sync): a NaN slope gives that head NaN outputs, and
            slope * distance beyond float32's range (~3.4e38) undefined ones.
            (``reference.alibi_bias`` materialises the bias.)
        deterministic: flash-attn's keyword, accepted as any bool, or None (the backward is always
            deterministic: no atomics, with dropout too).
        return_attn_probs: a bool; True returns flash-attn's triple (below), the way code
            written for flash-attn obtains softmax_lse.

    Returns:
        out: (batch, seqlen_q, nheads, headdim_v), q's dtype, contiguous.
        softmax_lse (only if return_lse): (batch, nheads, seqlen_q) float32,
            LSE_i = log(sum_j exp(softmax_scale * q_i . k_j)) in natural log (+inf when no key is
            visible; with softcap the capped logits in place of softmax_scale * q_i . k_j); with
            sinks the sink's exp is in the sum (a row without keys: LSE = sinks[h], out 0). It
            carries no gradient.
        With return_attn_probs=True (whatever return_lse): (out, softmax_lse, None), in the place of
            flash-attn's (out, softmax_lse, S_dmask): its S_dmask, the dropout pattern for its
            tests, is an empty tensor without dropout in flash-attn >= 2.7 (None before); here it
            is None with dropout too; the probabilities are never materialised.

    Raises:
        RuntimeError: before any work, with a message naming the argument, for: tensors on
            different devices; mismatched or unsupported dtypes; rank != 4; batch / seqlen_k /
            nheads_k mismatches between q, k and v, a headdim mismatch between q and k (v's may
            differ); nheads not divisible by nheads_k;
            headdim > 256 (or a CUDA head dim not compiled in this build); a softmax_scale that is not finite or whose
            |softmax_scale| * log2(e) overflows float32; a softcap > 0 outside float32's range (below
            1.18e-38, softcap * log2(e) or |softmax_scale / softcap| above 3.4e38); seqlen_q or
            seqlen_k above 2^31 - 256 (tile counts are int32); double backward.
        ValueError: softcap negative, NaN or infinite (the message names softcap), before any work
            (under torch.compile: the op's RuntimeError naming softcap, from its fake kernel);
            dropout_p outside [0, 1).
        NotImplementedError: forward-mode AD through the backward pass (e.g. torch.func.hessian);
            nested (jagged) tensors (pack them and call flash_attn_varlen_func); dropout_p > 0 or
            alibi_slopes with softcap > 0 or a window's left bound (that hides keys), dropout_p > 0
            with alibi_slopes, dropout_p > 0 under forward-mode AD; alibi_slopes that require grad.
        TypeError: q, k or v not a torch.Tensor; causal or return_lse that is not a bool (or
            0 / 1); softmax_scale that is not a real number, or a tensor that requires grad (the
            scale gets no gradient); window_size that is not a pair of ints; dropout_p or softcap
            that is not a real number (a bool or None included), deterministic or
            return_attn_probs that is not a bool;
            more than 11 positional arguments; sinks that is not a tensor or None. (A window
            side below -1, and sinks of another shape or device or not floating, are RuntimeErrors
            naming them.)

    Zero-length batch or seqlen_q gives empty outputs without running a kernel; seqlen_k = 0
    gives out = 0 and LSE = +inf.
    """
    _check_tensors(q=q, k=k, v=v)
    softcap, probs, dropout = _flash_attn_keywords(dropout_p, softcap, alibi_slopes, deterministic, return_attn_probs)
    scale = _scale("softmax_scale", softmax_scale, q)  # from the caller's head dim
    want_lse, causal = _as_bool("return_lse", return_lse), _as_bool("causal", causal)
    window, sinks = _window(window_size), _sinks(sinks)
    q, k, v, d = _kernel_layout(q, k, v)
    if dropout > 0.0:  # the op's checks before the draw: a refused call draws no random numbers
        _fake_checks.check_forward(q, k, v, scale, causal, *window, sinks, softcap, dropout, None, alibi_slopes,
                                   rng_drawn_after=True)
    out, softmax_lse, _ = ops.attention_forward(q, k, v, scale, causal, *window, sinks, softcap,
                                                *_dropout_args(dropout, q), alibi_slopes)
    return _with_attn_probs(_cut(out, d), softmax_lse, want_lse, probs)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
):
    """``flash_attn_func`` on q, k, v packed in one tensor (flash-attn's name and layout), e.g. the
    output of one fused QKV projection.

    Args:
        qkv: (batch, seqlen, 3, nheads, headdim): q = qkv[:, :, 0], k = qkv[:, :, 1],
            v = qkv[:, :, 2] (views: no copy where headdim is a multiple of 8). Other arguments (flash-attn's
            positional order after qkv; return_lse, sinks keyword-only) and the semantics
            (FlashAttention-2, Dao 2023, Alg. 1 / Alg. 2) as ``flash_attn_func``'s.

    Returns:
        out: (batch, seqlen, nheads, headdim); softmax_lse (if return_lse): (batch, nheads,
        seqlen) float32, natural log; (out, softmax_lse, None) with return_attn_probs=True. The
        gradient w.r.t. qkv has qkv's shape.

    Raises:
        RuntimeError: qkv not of rank 5 with 3 along dim 2 (message names qkv), else as
            ``flash_attn_func``. TypeError: qkv not a torch.Tensor, or as ``flash_attn_func``.
    """
    q, k, v = _unpack("qkv", qkv, "(batch, seqlen, 3, nheads, headdim)", 3)
    compat = dict(dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                  return_attn_probs=return_attn_probs)
    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           return_lse=return_lse, sinks=sinks, **compat)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
):
    """``flash_attn_func`` with k and v packed in one tensor (flash-attn's name and layout).

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        kv: (batch, seqlen_k, 2, nheads_k, headdim): k = kv[:, :, 0], v = kv[:, :, 1] (views;
            nheads % nheads_k == 0: GQA / MQA). Other arguments (flash-attn's positional order
            after kv; return_lse, sinks keyword-only) and the semantics as ``flash_attn_func``'s.

    Returns:
        As ``flash_attn_func``; the gradient w.r.t. kv has kv's shape.

    Raises:
        RuntimeError: kv not of rank 5 with 2 along dim 2 (message names kv), else as
            ``flash_attn_func``. TypeError: q or kv not a torch.Tensor, or as ``flash_attn_func``.
    """
    _check_tensors(q=q)
    k, v = _unpack("kv", kv, "(batch, seqlen_k, 2, nheads_k, headdim)", 2)
    compat = dict(dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                  return_attn_probs=return_attn_probs)
    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           return_lse=return_lse, sinks=sinks, **compat)
