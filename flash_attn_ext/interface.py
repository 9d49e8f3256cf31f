"""User-facing functions over the ``torch.ops.flash_attn_ext`` ops (autograd included)."""

from __future__ import annotations

import math
import operator

import torch

from . import _fake_checks
from . import ops  # registers fake kernels, autograd and vmap rules


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
            and float64 inputs in float64, but returns the LSE in float32: +inf past its range,
            the value that otherwise marks a row without visible keys. Gradients of near-tied
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
            ``(w, 0)``). Unlike flash-attn, a right bound >= seqlen_k stays a bound (flash-attn
            drops it; they differ only where seqlen_q > seqlen_k + 1). Rows whose window holds no
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
        With return_attn_probs=True (whatever return_lse): (out, softmax_lse, None), as flash-attn
            returns (out, softmax_lse, S_dmask) without dropout: its S_dmask, the dropout pattern
            for its tests, is None there (and here with dropout too); the probabilities are never
            materialised.

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
    q, k, v, d = _kernel_layout(q, k, v)
    out, softmax_lse, _ = ops.attention_forward(q, k, v, scale, _as_bool("causal", causal), *_window(window_size),
                                                _sinks(sinks), softcap, *_dropout_args(dropout, q), alibi_slopes)
    return _with_attn_probs(_cut(out, d), softmax_lse, return_lse, probs)


def _kernel_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """flash-attn's Python-side accommodations, so that its calls port unchanged: a last dimension
    whose stride is not 1 is copied contiguous (flash-attn's maybe_contiguous); a head dim that is
    not a multiple of 8 is zero-padded to the next multiple (flash-attn's wrapper); and values of
    another head dim than the queries' and keys' (multi-head latent attention: DeepSeek-V2 / V3,
    FlashAttention-3's hdim_v) pad both to the larger. Zero columns change neither the scores q.k
    nor the output's other columns, and autograd takes the gradients back through the pad.
    Returns (q, k, v, the output's head dim: v's); ``_cut`` cuts the output back. The ops
    themselves take neither (a clear error names the argument)."""
    q, k, v = _maybe_contiguous(q, k, v)
    if min(q.dim(), k.dim(), v.dim()) < 3:
        return q, k, v, v.shape[-1] if v.dim() else 0  # the op's rank check names the argument
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if k.shape[-1] != d_qk:
        raise RuntimeError(f"flash_attn_ext: k has headdim {k.shape[-1]} but q has {d_qk}; expected equal (v's may "
                           "differ)")
    for name, d in (("q", d_qk), ("v", d_v)):
        if not 0 < d <= 256:
            raise RuntimeError(f"flash_attn_ext: headdim {d} ({name}.size(-1)) is not supported; expected 1..256 "
                               "(one that is not a multiple of 8 runs zero-padded)")
    d = -(-max(d_qk, d_v) // 8) * 8
    q, k, v = (t if t.shape[-1] == d else torch.nn.functional.pad(t, (0, d - t.shape[-1])) for t in (q, k, v))
    return q, k, v, d_v


def _maybe_contiguous(*tensors):
    """flash-attn's maybe_contiguous: each tensor whose last dimension has a stride other than 1
    copied contiguous (None and 0-d tensors as they are). A clone, not ``.contiguous()``, which
    returns a tensor torch already calls contiguous as it is, stride included: an empty one, or one
    whose last dimension has size 1 (the ops require stride(-1) == 1 regardless)."""
    return tuple(t if t is None or t.dim() == 0 or t.stride(-1) == 1 else t.clone(memory_format=torch.contiguous_format)
                 for t in tensors)


def _cut(out: torch.Tensor, d: int) -> torch.Tensor:
    """The output of a ``_kernel_layout`` call back at the caller's head dim d (contiguous)."""
    return out if out.shape[-1] == d else out[..., :d].contiguous()


def _sinks(sinks) -> torch.Tensor | None:
    """sinks as the ops take them: None, or float32 (a differentiable cast). TypeError unless a
    tensor or None; RuntimeError naming sinks for a dtype that is not floating. Shape and device
    are the op's checks (their messages name sinks too)."""
    if sinks is None:
        return None
    _check_tensors(sinks=sinks)
    if not sinks.is_floating_point():
        raise RuntimeError(f"flash_attn_ext: sinks has dtype {sinks.dtype}; expected a floating dtype (one logit "
                           "per query head)")
    return sinks if sinks.dtype == torch.float32 else sinks.to(torch.float32)


def _window(window_size) -> tuple[int, int]:
    """window_size as (left, right) Python ints: TypeError unless a pair (tuple or list) of ints,
    RuntimeError naming the side below -1 (the op's message, with the value given: one past int64
    would not reach the op). One past any sequence length (>= 2^62) is the same bound as 2^62,
    which the op's int64 argument holds."""
    if type(window_size) is tuple and len(window_size) == 2:  # the common case, checked cheaply (eager
        left, right = window_size                              # calls pay this per attention layer)
        if type(left) is int and type(right) is int and -1 <= left <= 2**62 and -1 <= right <= 2**62:
            return window_size
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise TypeError(f"flash_attn_ext: window_size must be a pair (left, right) of ints, got {window_size!r}")
    sides = []
    for i, side in enumerate(("left", "right")):
        value = _as_int(f"window_size[{i}]", window_size[i])
        if value < -1:
            raise RuntimeError(f"flash_attn_ext: window_size_{side} must be -1 (no {side} bound) or >= 0, got {value}")
        sides.append(min(value, 2**62))
    return tuple(sides)


def _scale(name: str, value, q: torch.Tensor) -> float:
    """softmax_scale as a Python float: None -> 1 / sqrt(headdim); else a real number (``_real``)."""
    if value is None:
        # headdim 0 is rejected by the op with a message naming headdim; don't divide by zero first.
        return 1.0 / math.sqrt(q.shape[-1]) if q.dim() > 0 and q.shape[-1] > 0 else 1.0
    return _real(name, value)


def _real(name: str, value) -> float:
    """``value`` as a Python float: a real number (int, float, NumPy or 0-dim real tensor), not a
    bool, None or a string, or TypeError naming ``name`` (also for a tensor that requires grad: the
    kernels take the value as a constant)."""
    if type(value) is float:  # the common case; under torch.compile(dynamic=True) a symbolic float
        return value              # (no message is formatted on it: that would break the graph)

    def error():
        return TypeError(f"flash_attn_ext: {name} must be a real number, got {type(value).__name__} {value!r}")

    non_real_tensor = isinstance(value, torch.Tensor) and (value.is_complex() or value.dtype == torch.bool)
    if isinstance(value, (bool, str, bytes, complex)) or _is_numpy_bool(value) or non_real_tensor:
        raise error()
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        raise TypeError(f"flash_attn_ext: {name} must be a real number or a 0-dim tensor, got a tensor of shape "
                        f"{tuple(value.shape)}")
    if isinstance(value, torch.Tensor) and value.requires_grad:
        raise TypeError(f"flash_attn_ext: {name} is a tensor that requires grad, but it is a constant of the "
                        "kernels (no gradient reaches it); pass a float or a detached tensor")
    if isinstance(value, torch.Tensor) and torch.compiler.is_compiling():
        # Its value is data while tracing, and the ops take a float: a graph break reads it eagerly
        # (under fullgraph=True, Dynamo's error carries this message).
        torch._dynamo.graph_break(msg=f"flash_attn_ext: {name} is a tensor; under torch.compile pass a Python "
                                      f"float (the ops take {name} as a float, a tensor's value is data)")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise error() from None
    except OverflowError:  # an int past float64's range
        raise TypeError(f"flash_attn_ext: {name} must be a real number within float64's range, got "
                        f"{type(value).__name__} {value!r}") from None


def _check_tensors(_optional=(), **tensors) -> None:
    """TypeError naming the first argument that is not a torch.Tensor (None allowed for the names
    in ``_optional``) or NotImplementedError naming the first nested (jagged) or non-strided (sparse,
    mkldnn) tensor: the ops take dense tensors (the packed form of ragged batches is
    flash_attn_varlen_func's)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) and not (t is None and name in _optional):
            expected = "a torch.Tensor or None" if name in _optional else "a torch.Tensor"
            raise TypeError(f"flash_attn_ext: {name} must be {expected}, got {type(t).__name__}")
        if isinstance(t, torch.Tensor) and t.is_nested:
            raise NotImplementedError(
                f"flash_attn_ext: {name} is a nested tensor; the attention functions take dense tensors. "
                "For a ragged batch pass the packed rows (nt.values()) with cu_seqlens (nt.offsets(), int32) to "
                "flash_attn_varlen_func")
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            raise NotImplementedError(
                f"flash_attn_ext: {name} has layout {t.layout}; the attention functions take strided (dense) "
                f"tensors: pass {name}.to_dense()")


def _is_numpy_bool(value) -> bool:
    """A NumPy bool scalar (numpy.bool in NumPy 2, numpy.bool_ in 1), without importing NumPy."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def _as_int(name: str, value) -> int:
    """``value`` as a Python int (ints and integer scalars such as numpy.int64; not floats, not
    bool), or TypeError naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"flash_attn_ext: {name} must be an int, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"flash_attn_ext: {name} must be an int, got {type(value).__name__} {value!r}") from None


def _as_bool(name: str, value) -> bool:
    """``value`` as a Python bool (a bool, numpy.bool_, or an integer 0 / 1), or TypeError naming
    ``name``: a string such as ``'no'`` is not taken as true."""
    if isinstance(value, bool) or _is_numpy_bool(value):
        return bool(value)
    try:
        as_int = operator.index(value)
    except TypeError:
        as_int = None
    if as_int not in (0, 1):
        raise TypeError(f"flash_attn_ext: {name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(as_int)


def _flash_attn_keywords(dropout_p, softcap, alibi_slopes, deterministic,
                         return_attn_probs) -> tuple[float, bool, float]:
    """flash-attn's keywords: TypeError naming an argument of the wrong type (alibi_slopes: a tensor or
    None; the ops check its dtype, shape and device). Returns softcap, checked
    (``_softcap``), as a Python float, return_attn_probs as a bool (the caller then returns
    flash-attn's triple, ``_with_attn_probs``) and dropout_p as a float in [0, 1) (ValueError
    otherwise)."""
    if (type(dropout_p) is float and dropout_p == 0.0 and alibi_slopes is None and deterministic is False
            and return_attn_probs is False):
        return _softcap(softcap), False, 0.0  # the defaults, checked cheaply (eager calls pay this per layer)
    dropout = _dropout_p(dropout_p)
    softcap = _softcap(softcap)
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError("flash_attn_ext: alibi_slopes must be a float32 tensor of shape (nheads,) or (batch, nheads), "
                        f"or None; got {type(alibi_slopes).__name__} (e.g. torch.tensor(slopes, "
                        "dtype=torch.float32, device=q.device))")
    ops._fixed_alibi(alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled())
    if deterministic is not None:  # None: flash-attn < 2.7 took it (as False); the backward is always deterministic
        _as_bool("deterministic", deterministic)
    return softcap, _as_bool("return_attn_probs", return_attn_probs), dropout


def _dropout_p(value, name: str = "dropout_p", owner: str = "flash_attn_ext") -> float:
    """An attention-dropout probability as a Python float: a real number (``_real``: TypeError for
    a bool, None, a string, a tensor that requires grad, ...) in [0, 1) (ValueError otherwise), the
    message naming ``name`` (and ``owner``: the entry that was called)."""
    try:
        p = _real(name, value)
    except TypeError as e:
        raise TypeError(str(e).replace("flash_attn_ext:", f"{owner}:", 1)) from None
    if not 0.0 <= p < 1.0:  # NaN fails
        raise ValueError(f"{owner}: {name} must be in [0, 1), got {value!r}")
    return p


def dropout_rng_state(device) -> torch.Tensor:
    """A fresh attention-dropout state for one call: (seed, offset), int64 (2,) on ``device``, drawn
    from torch's generator of that device (torch.manual_seed makes it reproducible; CUDA graphs and
    torch.compile capture the draw). The ops regenerate the mask from it (csrc/primitives/philox.cuh;
    ``reference.dropout_keep_mask`` materialises it), the backward from the forward's."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


def _dropout_args(dropout: float, q: torch.Tensor) -> tuple:
    """The ops' (dropout_p, rng_state) for a call's dropout_p (already checked)."""
    return (dropout, dropout_rng_state(q.device)) if dropout > 0.0 else (0.0, None)


def _with_attn_probs(out: torch.Tensor, softmax_lse: torch.Tensor, return_lse, return_attn_probs: bool):
    """What a dense or varlen entry returns: flash-attn's ``(out, softmax_lse, S_dmask)`` with
    return_attn_probs=True, where S_dmask (the dropout pattern, for flash-attn's tests) is None
    without dropout, as in flash-attn (``return_softmax=return_attn_probs and dropout_p > 0``): code
    ported from it gets the LSE that way. Else ``(out, softmax_lse)`` with return_lse, else out."""
    want_lse = _as_bool("return_lse", return_lse)
    if return_attn_probs:
        return out, softmax_lse, None
    return (out, softmax_lse) if want_lse else out


def _softcap(softcap) -> float:
    """softcap (logit soft-capping) as a Python float: a real number (``_real``: TypeError for a
    bool, None, a string, ...), finite and >= 0, 0.0 meaning none (ValueError naming softcap
    otherwise; under torch.compile the op's RuntimeError). The op checks the rest (a cap past
    float32's range: RuntimeError)."""
    if type(softcap) is float and softcap == 0.0:
        return softcap  # the default, checked cheaply
    try:
        value = _real("softcap", softcap)
    except TypeError as e:
        if softcap is None or isinstance(softcap, torch.Tensor) and softcap.dim() != 0:
            # flash-attn <= 2.5's positional order had alibi_slopes where softcap is now.
            raise TypeError(f"{e} (flash-attn >= 2.6's positional order has softcap after window_size, where a call "
                            "written for flash-attn <= 2.5 passed alibi_slopes: pass the arguments after causal by "
                            "keyword)") from None
        raise
    # Under torch.compile the op's fake kernel refuses a bad cap (a RuntimeError naming softcap):
    # a ValueError raised while tracing would reach the user as Dynamo's own error, and a symbolic
    # float (dynamic=True) cannot be formatted into a message.
    if not torch.compiler.is_compiling() and not (value >= 0.0 and value < math.inf):  # NaN fails too
        raise ValueError(f"flash_attn_ext: softcap must be a finite number >= 0 (0: no soft-capping), got {softcap!r}")
    return value


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
):
    """Exact attention over a batch of variable-length sequences packed along one dimension.

    FlashAttention-2 (Dao 2023) Alg. 1 / Alg. 2 run per sequence: the kernels take each
    sequence's rows and lengths from ``cu_seqlens`` (no padding, no per-sequence launches).
    Sequence b is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k and v; its output equals
    ``flash_attn_func`` on that sequence alone (on the same GPU arch path, bit for bit; two
    exceptions, where the sequence alone runs another sm90 tile row: hdim 128 non-causal with
    at least 8192 keys (most such lengths; 144-key tiles, ``FLASH_ATTN_EXT_SM90_FWD_LONG_KEYS``;
    packed calls never take them) and hdim 128 / 256 causal with at most 2048 queries in a call
    whose ``max_seqlen_q`` exceeds 2048 (64-key tiles, ``FLASH_ATTN_EXT_SM90_FWD_SHORT_CAUSAL``;
    packed calls take them when ``max_seqlen_q`` <= 2048); such a sequence rounds its sums
    differently and agrees within the accuracy rule instead).
    Differentiable w.r.t. q, k, v: reverse mode (deterministic, no atomics) and forward mode
    through torch.autograd.forward_ad dual tensors (each sequence's jvp, materialising its
    probabilities; a host read of cu_seqlens); torch.func transforms raise NotImplementedError.

    Args:
        q: (total_q, nheads, headdim). k, v: (total_k, nheads_k, headdim); nheads % nheads_k == 0.
            dtype / headdim / strides as ``flash_attn_func``'s (a head dim not a multiple of 8
            padded, a last dimension of another stride copied; with block_table neither: the
            paged caches are read in place).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device, non-decreasing, from 0 to
            at most total_q / total_k (e.g. ``F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))``).
            Zero-length sequences are allowed (a sequence without keys gives out 0, LSE +inf, or
            the head's sink with sinks).
        max_seqlen_q, max_seqlen_k: Python ints >= the longest sequence of each side.
        Positional order after max_seqlen_k: flash-attn's (dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table);
            return_lse and sinks keyword-only. softmax_scale: default 1 / sqrt(headdim), as
            flash_attn_func's.
            causal: bottom-right aligned per sequence (query i of a sequence sees key j <= i +
            seqlen_k - seqlen_q of that sequence).
        window_size: (left, right) sliding window per sequence, as ``flash_attn_func``'s.
        return_lse: also return softmax_lse.
        sinks: attention sinks, (nheads,), as ``flash_attn_func``'s (differentiable).
        softcap: logit soft-capping, as ``flash_attn_func``'s (softcap * tanh(S * softmax_scale /
            softcap); 0.0: none), per sequence.
        dropout_p, alibi_slopes, deterministic, return_attn_probs: as ``flash_attn_func``'s, per
            sequence (dropout: sequence b's mask that of batch b; alibi_slopes (batch, nheads): row
            b for sequence b). With block_table: no dropout_p (NotImplementedError).
        block_table: None, or int32 (batch, max_blocks) with k / v paged caches (num_blocks,
            page_size, nheads_k, headdim), page_size a multiple of 16 (flash-attn's paged varlen,
            e.g. chunked prefill against a serving engine's cache): sequence b's keys are the
            first cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its pages, row r in block
            ``block_table[b, r // page_size]``. Inference only (no gradient: RuntimeError when
            grad is enabled and an input requires it); run as a ``flash_attn_with_kvcache`` call
            on the queries left-padded to (batch, max_seqlen_q), so it computes batch *
            max_seqlen_q query rows (their LSE and outputs of the real rows as varlen's).

    Returns:
        out: (total_q, nheads, headdim), q's dtype. softmax_lse (if return_lse): (nheads,
        total_q) float32, natural log, no gradient. With return_attn_probs=True: (out,
        softmax_lse, None), as ``flash_attn_func``'s.

    Raises:
        RuntimeError naming the argument for wrong ranks, shapes, dtypes, devices, a
        cu_seqlens that is not int32 (batch + 1,) or whose two lengths differ, max_seqlen
        outside [0, 2^31 - 256], total_q or total_k above 2^31 - 256.
        TypeError: a tensor argument that is not a torch.Tensor, max_seqlen that is not an int,
        causal or return_lse that is not a bool, softmax_scale or softcap as flash_attn_func's,
        more than 16 positional arguments. ValueError: softcap as flash_attn_func's.
        NotImplementedError: nested tensors; the flash-attn keywords as ``flash_attn_func``'s.
        With block_table: RuntimeError for k / v not paged (rank 4), a block_table that is not
        (batch, max_blocks), grad with an input that requires it, and the KV-cache call's
        checks (``flash_attn_with_kvcache``: block_table int32, page_size a multiple of 16).
        On CPU the values are checked too (starting at 0, non-decreasing, inside the tensors,
        <= max_seqlen).
        On CUDA they are not (that would need a device sync): a sequence longer than
        max_seqlen_q / max_seqlen_k is cut to its first max_seqlen rows / keys (its other
        rows are not written), and cu_seqlens past the tensors read out
        of bounds. Rows of q / k not covered by cu_seqlens get unspecified out / gradients on
        CUDA (0 on CPU). With block_table a query sequence longer than max_seqlen_q keeps its
        last max_seqlen_q queries (the others: out 0), and the padded tile (batch, max_seqlen_q,
        nheads, headdim) and its output are allocated: for a batch mixing one long prefill chunk
        with many one-token rows that is batch times the chunk's rows, in memory and compute.
    """
    _check_tensors(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    softcap, probs, dropout = _flash_attn_keywords(dropout_p, softcap, alibi_slopes, deterministic, return_attn_probs)
    args = (_as_int("max_seqlen_q", max_seqlen_q), _as_int("max_seqlen_k", max_seqlen_k),
            _scale("softmax_scale", softmax_scale, q))  # the scale from the caller's head dim
    causal, window, sinks = _as_bool("causal", causal), _window(window_size), _sinks(sinks)
    if block_table is not None:
        if dropout > 0.0:
            raise NotImplementedError("flash_attn_ext: flash_attn_varlen_func with block_table (inference over a "
                                      "paged K / V) takes no dropout; pass dropout_p=0.0")
        out, softmax_lse = _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *args[:2], block_table, args[2],
                                         causal, window, sinks, softcap, alibi_slopes)
        return _with_attn_probs(out, softmax_lse, return_lse, probs)
    q, k, v, d = _kernel_layout(q, k, v)
    out, softmax_lse, _ = torch.ops.flash_attn_ext.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, causal,
                                                                  *window, sinks, softcap, *_dropout_args(dropout, q),
                                                                  alibi_slopes)
    return _with_attn_probs(_cut(out, d), softmax_lse, return_lse, probs)


def _paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                  block_table, scale: float, causal: bool, window: tuple[int, int], sinks, softcap: float,
                  alibi_slopes=None):
    """flash_attn_varlen_func with block_table (flash-attn's paged varlen; inference: no gradient).
    k_cache / v_cache: paged (num_blocks, page_size, nheads_k, headdim); sequence b's keys are the
    first cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its pages, block_table[b] (int32 (batch,
    max_blocks)). Runs as one KV-cache call (flash_attn_with_kvcache's split-KV kernels) on the
    queries placed at the END of a (batch, max_seqlen_q) tile: left padding keeps the bottom-right
    alignment (padded row max_seqlen_q - n_b + i has the causal / window offset of row i of n_b
    queries), the pads' rows are computed and dropped (cost: batch * max_seqlen_q query rows
    instead of total_q). Gather and scatter indices come from cu_seqlens_q on the device: no host
    sync. Returns (out (total_q, nheads, headdim), softmax_lse (nheads, total_q))."""
    if ops._needs_autograd((q, k_cache, v_cache, sinks, alibi_slopes)):  # reverse mode, or forward mode's duals
        raise RuntimeError("flash_attn_ext: flash_attn_varlen_func with block_table (a paged K / V) is inference "
                           "only: no gradient (as flash-attn's); call it under torch.no_grad() or detach q, k, v "
                           "(and sinks), and pass no forward-mode dual tensors")
    _check_tensors(block_table=block_table)
    _fake_checks.check_rank(q, "q", 3, "(total_q, nheads, headdim)")
    for name, t in (("k", k_cache), ("v", v_cache)):
        if t.dim() != 4:
            raise RuntimeError(f"flash_attn_ext: with block_table, {name} must be a paged cache (num_blocks, "
                               f"page_size, nheads_k, headdim), got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise RuntimeError(f"flash_attn_ext: with block_table, {name} must have a contiguous last dimension "
                               f"(stride(-1) == 1; the paged cache is read in place), got strides {t.stride()}")
    _fake_checks.check_devices_dtypes(q, k_cache, v_cache, "k", "v")
    if v_cache.shape != k_cache.shape or k_cache.shape[-1] != q.shape[-1]:
        raise RuntimeError(f"flash_attn_ext: with block_table, q has shape {tuple(q.shape)}, k {tuple(k_cache.shape)}, "
                           f"v {tuple(v_cache.shape)}; expected k and v of one paged layout and one head dim with q "
                           "(a v head dim of its own is not taken with block_table)")
    if q.shape[-1] % 8:
        raise RuntimeError(f"flash_attn_ext: with block_table, headdim must be a multiple of 8 (the paged caches "
                           f"are read in place, not padded), got {q.shape[-1]}")
    _fake_checks.check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q)
    _fake_checks.check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q)
    batch = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape[0] != batch + 1 or block_table.dim() != 2 or block_table.shape[0] != batch:
        raise RuntimeError(f"flash_attn_ext: cu_seqlens_q has {batch + 1} entries, cu_seqlens_k "
                           f"{cu_seqlens_k.shape[0]}, block_table shape {tuple(block_table.shape)}; expected batch + "
                           f"1, batch + 1 and (batch, max_blocks) = ({batch}, max_blocks)")
    if not (0 <= max_seqlen_q <= _fake_checks.MAX_SEQLEN and 0 <= max_seqlen_k <= _fake_checks.MAX_SEQLEN):
        raise RuntimeError(f"flash_attn_ext: max_seqlen_q and max_seqlen_k must be in [0, 2^31 - 256], got "
                           f"{max_seqlen_q} and {max_seqlen_k}")
    total_q, nheads, d = q.shape
    lens_q, lens_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    if block_table.dtype != torch.int32 or k_cache.shape[1] % 16:  # the KV-cache op's, before any early return
        raise RuntimeError(f"flash_attn_ext: with block_table, block_table must be int32 (got {block_table.dtype}) "
                           f"and page_size (k.size(1)) a positive multiple of 16 (got {k_cache.shape[1]})")
    # The values, as the CPU varlen op checks them (CUDA: no host read): in the graph under
    # torch.compile, else on the host (fake tensors outside Dynamo, e.g. make_fx: no values).
    compiling = torch.compiler.is_compiling()
    if cu_seqlens_q.device.type == "cpu" and (compiling or not torch._subclasses.fake_tensor.is_fake(cu_seqlens_q)):
        capacity = block_table.shape[1] * k_cache.shape[1]
        checks = [
            ((cu_seqlens_q[0] == 0) & (lens_q >= 0).all() & (cu_seqlens_q[-1] <= total_q)
             & (lens_q <= max_seqlen_q).all(),
             f"cu_seqlens_q must start at 0, not decrease, end at most at total_q = {total_q}, with sequences of "
             f"at most max_seqlen_q = {max_seqlen_q} queries"),
            ((cu_seqlens_k[0] == 0) & (lens_k >= 0).all() & (lens_k <= max_seqlen_k).all() & (lens_k <= capacity).all(),
             f"cu_seqlens_k must start at 0 and not decrease, with sequences of at most max_seqlen_k = "
             f"{max_seqlen_k} keys that fit their block_table's {block_table.shape[1]} pages of "
             f"{k_cache.shape[1]} rows"),
        ]
        for ok, msg in checks:
            if compiling:
                from .masked import assert_in_graph
                assert_in_graph(ok, "flash_attn_ext: " + msg)
            elif not bool(ok):
                raise RuntimeError(f"flash_attn_ext: {msg}; got cu_seqlens_q = {cu_seqlens_q.tolist()}, "
                                   f"cu_seqlens_k = {cu_seqlens_k.tolist()}")
    if batch == 0 or max_seqlen_q == 0 or total_q == 0:  # no query in any sequence: no kernel
        return q.new_zeros(q.shape), q.new_full((nheads, total_q), math.inf, dtype=torch.float32)
    # Padded row r of sequence b holds its query i = r - (max_seqlen_q - n_b) (token cu_seqlens_q[b] + i),
    # zeros before it: gathers both ways, no scatter. (On CUDA a sequence longer than max_seqlen_q
    # keeps its last max_seqlen_q queries; its first ones get out 0.)
    r = torch.arange(max_seqlen_q, device=q.device, dtype=torch.int32)
    src = cu_seqlens_q[:-1, None] + r - (max_seqlen_q - lens_q)[:, None]            # (batch, max_seqlen_q)
    valid = (src >= cu_seqlens_q[:-1, None]) & (src < cu_seqlens_q[1:, None]) & (src < total_q)
    padded = torch.where(valid[..., None, None], q[src.clamp(0, total_q - 1).long()], 0)
    token = torch.arange(total_q, device=q.device, dtype=torch.int32)
    seq = torch.searchsorted(cu_seqlens_q[1:], token, right=True).clamp_(max=batch - 1)
    row = max_seqlen_q - lens_q[seq] + (token - cu_seqlens_q[seq])
    keep = (token < cu_seqlens_q[-1]) & (row >= 0) & (row < max_seqlen_q)  # rows cu_seqlens covers
    seq, row = seq.long(), row.long().clamp_(0, max_seqlen_q - 1)
    # CUDA (values unchecked): a longer sequence cut, as varlen's; a decreasing cu_seqlens_k: no keys.
    cache_seqlens = lens_k.clamp(min=0, max=max_seqlen_k).to(torch.int32)
    # A left bound that hides no key of any sequence (each has at most max_seqlen_k keys) is none, as
    # the varlen op's own normalization (the KV-cache op would judge it by the pages' capacity).
    if window[0] >= max_seqlen_k - 1:
        window = (-1, window[1])
    out_p, lse_p = torch.ops.flash_attn_ext.fwd_kvcache(
        padded, k_cache, v_cache, None, None, cache_seqlens, block_table, scale, causal, 0, *window, sinks, None,
        softcap, alibi_slopes)
    out = torch.where(keep[:, None, None], out_p[seq, row], 0)            # (total_q, nheads, d)
    softmax_lse = torch.where(keep[None, :], lse_p[seq, :, row].t(), math.inf)  # (nheads, total_q)
    return out, softmax_lse


def _unpack(name: str, packed: torch.Tensor, layout: str, slots: int) -> tuple[torch.Tensor, ...]:
    """The ``slots`` views of a packed tensor (``layout``: its documented shape, the slot dimension
    named by its size): qkv -> (q, k, v), kv -> (k, v). Views, no copy; autograd stacks their
    gradients back into one packed gradient."""
    _check_tensors(**{name: packed})
    dims = layout.strip("()").split(", ")
    dim = dims.index(str(slots))
    if packed.dim() != len(dims) or packed.shape[dim] != slots:
        raise RuntimeError(f"flash_attn_ext: {name} must be {layout}, got shape {tuple(packed.shape)}")
    return packed.unbind(dim)


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


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
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
    """``flash_attn_varlen_func`` on q, k, v packed in one tensor, one set of sequence lengths
    for queries and keys (flash-attn's name and layout).

    Args:
        qkv: (total, 3, nheads, headdim): q = qkv[:, 0], k = qkv[:, 1], v = qkv[:, 2] (views).
        cu_seqlens: int32 (batch + 1,), as ``flash_attn_varlen_func``'s cu_seqlens_q and
            cu_seqlens_k. max_seqlen: its max_seqlen_q and max_seqlen_k. Other arguments
            (flash-attn's positional order after max_seqlen; return_lse, sinks keyword-only) and
            the semantics as ``flash_attn_varlen_func``'s.

    Returns:
        out: (total, nheads, headdim); softmax_lse (if return_lse): (nheads, total) float32;
        (out, softmax_lse, None) with return_attn_probs=True. The gradient w.r.t. qkv has qkv's
        shape.

    Raises:
        RuntimeError: qkv not of rank 4 with 3 along dim 1 (message names qkv), else as
            ``flash_attn_varlen_func``. TypeError: as ``flash_attn_varlen_func``.
    """
    q, k, v = _unpack("qkv", qkv, "(total, 3, nheads, headdim)", 3)
    compat = dict(dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                  return_attn_probs=return_attn_probs)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                  return_lse=return_lse, sinks=sinks, **compat)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
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
    """``flash_attn_varlen_func`` with k and v packed in one tensor (flash-attn's name and layout).

    Args:
        q: (total_q, nheads, headdim). kv: (total_k, 2, nheads_k, headdim): k = kv[:, 0],
            v = kv[:, 1] (views). Other arguments (flash-attn's positional order after
            max_seqlen_k; return_lse, sinks keyword-only) and the semantics as
            ``flash_attn_varlen_func``'s.

    Returns:
        As ``flash_attn_varlen_func``; the gradient w.r.t. kv has kv's shape.

    Raises:
        RuntimeError: kv not of rank 4 with 2 along dim 1 (message names kv), else as
            ``flash_attn_varlen_func``. TypeError: as ``flash_attn_varlen_func``.
    """
    _check_tensors(q=q)
    k, v = _unpack("kv", kv, "(total_k, 2, nheads_k, headdim)", 2)
    compat = dict(dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                  return_attn_probs=return_attn_probs)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                  return_lse=return_lse, sinks=sinks, **compat)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | int | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
):
    """Attention of new queries against a KV cache, for inference (decoding, chunked prefill).

    Split-KV (FlashDecoding, Dao et al. 2023): the cached keys of each (sequence, kv head) are
    split over ``num_splits`` CTAs so every SM streams K/V; the partial outputs are merged
    exactly by their log-sum-exps. The query heads of one kv head share its K/V reads (GQA).
    Optionally appends new keys/values into the cache first (in place, flash-attn semantics:
    the caller advances ``cache_seqlens`` afterwards). No gradient; CUDA-graph capturable (no
    host sync: ``num_splits=0`` is decided from the shapes and SM count).

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch, seqlen_cache, nheads_k, headdim), or paged (num_blocks,
            page_size, nheads_k, headdim) with ``block_table``; page_size a multiple of 16
            (16..256 typical). Written in place when k / v are given (16-byte aligned strides
            needed). nheads % nheads_k == 0; dtype float16 / bfloat16 on CUDA (CPU: also
            float32 / float64); headdim a multiple of 8, <= 256.
        k, v: None, or new keys / values (batch, seqlen_new, nheads_k, headdim) written at cache
            rows ``cache_seqlens[b] + i`` (needs cache_seqlens); read as they are before the call
            even where their memory overlaps a cache's (e.g. views of the very rows written):
            such q, k and v are copied first.
        Positional order: flash-attn's (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
            cache_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
            window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
            return_softmax_lse); return_lse and sinks keyword-only.
        cache_seqlens: int32 (batch,) tensor or an int: the rows of each sequence's cache in
            use before this call. None: every cache row is used.
        block_table: int32 (batch, max_blocks): sequence b's cache row r lives in block
            ``block_table[b, r // page_size]``, row ``r % page_size``.
        softmax_scale: default 1 / sqrt(headdim). causal: bottom-right aligned: query i sees
            cache row j <= i + cache_seqlens[b] + seqlen_new - seqlen_q.
        window_size: (left, right) sliding window against the same count, as
            ``flash_attn_func``'s (a decode step with window_size=(w - 1, 0) reads the last w
            cache rows only).
        num_splits: 0 = chosen from the shapes (sized for full caches: cache_seqlens is not read on
            the host); 1 = no split; up to 128. Caches far from full, of mixed lengths, may run
            faster with more splits than the shapes' choice.
        return_lse: also return softmax_lse.
        sinks: attention sinks, (nheads,), as ``flash_attn_func``'s (the split-KV combine merges
            the sink as one more partial with O = 0; not differentiable here).
        rotary_cos, rotary_sin: None, or flash-attn's rotary embedding (RoFormer, Su et al.
            2021, eq. 34) of q and the new k before the append: (seqlen_ro, rotary_dim / 2)
            tables in q's dtype, seqlen_ro >= the cache's rows, rotary_dim a multiple of 16 and
            <= headdim (the first rotary_dim channels rotate, the rest pass). New key j sits at
            position cache_seqlens[b] + j; query i at cache_seqlens[b] + i when causal or local
            (a window side shorter than the cache's rows), else every query at cache_seqlens[b].
            Needs k and v. Computed in float32 by torch ops ahead of the kernel (not fused into
            it: a decode step gains a few small launches; q and k are not modified).
        rotary_interleaved: pairs (2c, 2c + 1) rotate together (GPT-J; flash-attn's default
            True), else (c, c + rotary_dim / 2) (GPT-NeoX / Llama).
        cache_batch_idx: None, or int32 (batch,): sequence b reads and appends to cache row
            cache_batch_idx[b] of a contiguous cache (batch_cache >= batch allowed); run as the
            paged form of the same tensor (blocks of seqlen_cache rows), so seqlen_cache must
            be a multiple of 16; not with block_table. Indices are checked on CPU; on CUDA they
            are trusted as block_table's are; repeated indices that append race (flash-attn's
            rule: the cache keeps either).
        cache_leftpad: None, or int32 (batch,): a left-padded contiguous cache (flash-attn's):
            sequence b's keys are cache rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new),
            attended as a sequence of that many keys (causal and the window bottom-right against
            that count, which is the same row for row); the append still writes at rows
            cache_seqlens[b] + i and rotary positions stay the cache rows (flash-attn's). Not with
            block_table or cache_batch_idx. Checked on CPU (0 <= cache_leftpad[b] <=
            cache_seqlens[b] + seqlen_new); on CUDA capped to that range.
        softcap: logit soft-capping, as ``flash_attn_func``'s (the logit of cache row j is softcap *
            tanh(q . k_j * softmax_scale / softcap); 0.0: none), every split alike.
        alibi_slopes: ALiBi, as ``flash_attn_func``'s: (nheads,) or (batch, nheads) float32 (row b
            for q's sequence b), the logit of query i and cache row j minus slope * |i + n_b -
            seqlen_q - j| with n_b the sequence's keys (cache_seqlens[b] + seqlen_new, less a
            cache_leftpad, whose rows are then counted from it), every split alike. A window's
            left bound is judged against the cache's capacity (the keys in use are on the device):
            one below capacity - 1 is refused even where the cached keys are fewer.
        return_softmax_lse: flash-attn's keyword: True is return_lse=True.

    Returns:
        out: (batch, seqlen_q, nheads, headdim). softmax_lse (if return_lse): (batch, nheads,
        seqlen_q) float32, natural log (+inf for a row that sees no key, whose out row is 0; with
        sinks the head's sink there).

    Raises:
        RuntimeError naming the argument for wrong shapes, dtypes, devices, a block_table or
        cache_seqlens of the wrong dtype or shape, k without v, num_splits outside [0, 128],
        an input that requires grad, a cache longer than 2^31 - 256 rows or seqlen_q * nheads /
        nheads_k above 2^31 - 256. On CPU cache_seqlens[b] + seqlen_new past the cache, the
        block numbers of the pages a sequence uses (those of its first cache_seqlens[b] +
        seqlen_new rows) outside [0, num_blocks), and rotary positions past rotary_cos's rows
        raise too; on CUDA they are not read on the host
        (no sync): cache rows past the cache are dropped from the append and the attention,
        and block numbers are trusted. TypeError: q / k_cache / v_cache not a torch.Tensor (k,
        v, block_table: a tensor or None), num_splits not an int, cache_seqlens not a tensor, an
        int or None, causal or return_lse that is not a bool, softmax_scale or softcap as
        flash_attn_func's, more than 19 positional arguments. ValueError: softcap negative or
        not finite. RuntimeError naming rotary_cos / rotary_sin /
        cache_batch_idx / cache_leftpad for the requirements above. NotImplementedError: nested
        tensors; the flash-attn features above.
    """
    _check_tensors(("k", "v", "block_table", "rotary_cos", "rotary_sin", "cache_batch_idx", "cache_leftpad"),
                   q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, block_table=block_table, rotary_cos=rotary_cos,
                   rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad)
    interleaved = _as_bool("rotary_interleaved", rotary_interleaved)  # only meaningful with rotary_cos
    softcap, _, _ = _flash_attn_keywords(0.0, softcap, alibi_slopes, False, False)
    want_lse = _as_bool("return_lse", return_lse) | _as_bool("return_softmax_lse", return_softmax_lse)
    scale = _scale("softmax_scale", softmax_scale, q)
    if torch.compiler.is_compiling() and isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        # Traced (torch.compile; the value dynamic after a second one): checked in the graph rather
        # than by Python comparisons, which would specialize it, one recompile per value.
        torch._check(cache_seqlens >= 0, lambda: "flash_attn_ext: cache_seqlens must be >= 0")
        torch._check(cache_seqlens < 2**31, lambda: "flash_attn_ext: cache_seqlens must be < 2^31 (int32)")
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    elif cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        try:
            n = _as_int("cache_seqlens", cache_seqlens)
        except TypeError:
            raise TypeError("flash_attn_ext: cache_seqlens must be an int32 (batch,) tensor, an int or None, got "
                            f"{type(cache_seqlens).__name__} {cache_seqlens!r}") from None
        if not 0 <= n < 2**31:
            raise RuntimeError(f"flash_attn_ext: cache_seqlens = {n} must be in [0, 2^31) (int32)")
        cache_seqlens = torch.full((q.shape[0],), n, dtype=torch.int32, device=q.device)
    causal = _as_bool("causal", causal)
    window = _window(window_size)
    if cache_batch_idx is not None:
        if cache_leftpad is not None:
            raise RuntimeError("flash_attn_ext: cache_batch_idx with cache_leftpad is not supported; pass one of "
                               "them (index the cache's entries first, e.g. k_cache[cache_batch_idx])")
        block_table = _cache_batch_idx_as_block_table(cache_batch_idx, block_table, q, k_cache)
    # The caches are written in place: they must have a contiguous last dim; q, k, v are copied.
    q, k, v = _maybe_contiguous(q, k, v)
    if rotary_cos is not None or rotary_sin is not None:
        _fake_checks.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, 0, cache_leftpad)
        q, k = _rotary_for_kvcache(q, k, rotary_cos, rotary_sin, interleaved, cache_seqlens, block_table, k_cache,
                                   causal, window)
    out, softmax_lse = torch.ops.flash_attn_ext.fwd_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, causal,
        _as_int("num_splits", num_splits), *window, _sinks(sinks), cache_leftpad, softcap, alibi_slopes)
    return (out, softmax_lse) if want_lse else out


def _cache_batch_idx_as_block_table(cache_batch_idx, block_table, q, k_cache) -> torch.Tensor:
    """flash-attn's cache_batch_idx (sequence b reads and appends to k_cache[cache_batch_idx[b]]) as
    the paged form of the same tensor: k_cache (batch_cache, seqlen_cache, ...) is a paged cache of
    batch_cache blocks of seqlen_cache rows, and block_table = cache_batch_idx[:, None]. No copy,
    the same kernels. Needs seqlen_cache a multiple of 16 (the paged loads' page sizes). The
    indices are checked here on CPU in eager calls (traced, the CPU op's block_table check names
    them as block_table)."""
    if block_table is not None:
        raise RuntimeError("flash_attn_ext: cache_batch_idx and block_table were both given; a paged cache is "
                           "indexed by block_table alone (as flash-attn's): pass one of them")
    if cache_batch_idx.dtype != torch.int32 or tuple(cache_batch_idx.shape) != (q.shape[0],) \
            or cache_batch_idx.device != q.device:
        raise RuntimeError(f"flash_attn_ext: cache_batch_idx has dtype {cache_batch_idx.dtype}, shape "
                           f"{list(cache_batch_idx.shape)} on {cache_batch_idx.device}; expected int32 (batch,) = "
                           f"({q.shape[0]},) on q's device {q.device}")
    if k_cache.dim() == 4 and k_cache.shape[1] % 16 != 0:
        raise RuntimeError(f"flash_attn_ext: cache_batch_idx needs seqlen_cache (k_cache.size(1) = {k_cache.shape[1]}) "
                           "a multiple of 16 (the cache is read as blocks of seqlen_cache rows); allocate the cache "
                           "with a multiple of 16 rows")
    if cache_batch_idx.device.type == "cpu" and not torch.compiler.is_compiling() and k_cache.dim() == 4 and (
            cache_batch_idx.numel() and (
            int(cache_batch_idx.min()) < 0 or int(cache_batch_idx.max()) >= k_cache.shape[0])):
        raise RuntimeError(f"flash_attn_ext: cache_batch_idx holds {cache_batch_idx.tolist()}; expected indices in "
                           f"[0, batch_cache = {k_cache.shape[0]})")
    return cache_batch_idx.unsqueeze(1)


def _rotary_for_kvcache(q, k, rotary_cos, rotary_sin, interleaved: bool, cache_seqlens, block_table, k_cache,
                        causal: bool, window: tuple[int, int]):
    """flash-attn's rotary embedding of flash_attn_with_kvcache (RoFormer, Su et al. 2021, eq. 34):
    the new keys at positions cache_seqlens[b] + j and the queries at cache_seqlens[b] + i when
    causal or local (a window side shorter than the cache's rows: flash-attn drops longer ones),
    else all at cache_seqlens[b]; the first rotary_dim = 2 * rotary_cos.size(1) channels rotated in
    pairs (2c, 2c + 1) when ``interleaved`` (GPT-J), or (c, c + rotary_dim / 2) (GPT-NeoX), in
    float32 from the tables' values, rounded to q's dtype.
    Torch ops ahead of the kernel (not fused into it): new tensors, the caller's q and k unchanged.
    A position past the tables (cache_seqlens past the cache, or queries past the keys: seqlen_q >
    seqlen_new with a full cache) raises on CPU (RuntimeError naming rotary_cos); a CUDA call does not
    read cache_seqlens on the host (no sync) and reads the tables' last row there instead of faulting."""
    if rotary_cos is None or rotary_sin is None:
        raise RuntimeError("flash_attn_ext: rotary_cos and rotary_sin must be given together")
    if k is None:
        raise RuntimeError("flash_attn_ext: rotary_cos / rotary_sin rotate the new keys k as they are appended "
                           "(flash-attn's rule); pass k and v, or rotate q yourself and pass no tables")
    seqlen_cache = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if t.dim() != 2 or t.dtype != q.dtype or t.device != q.device:
            raise RuntimeError(f"flash_attn_ext: {name} has shape {list(t.shape)}, dtype {t.dtype} on {t.device}; "
                               f"expected (seqlen_ro, rotary_dim / 2) in q's dtype {q.dtype} on {q.device}")
    if rotary_sin.shape != rotary_cos.shape:
        raise RuntimeError(f"flash_attn_ext: rotary_sin has shape {list(rotary_sin.shape)} but rotary_cos has "
                           f"{list(rotary_cos.shape)}; expected equal")
    seqlen_ro, rotary_dim = rotary_cos.shape[0], 2 * rotary_cos.shape[1]
    if not 0 < rotary_dim <= q.shape[3] or rotary_dim % 16 != 0:
        raise RuntimeError(f"flash_attn_ext: rotary_cos has {rotary_cos.shape[1]} columns (rotary_dim / 2); expected "
                           f"rotary_dim a multiple of 16 and at most headdim = {q.shape[3]}")
    if seqlen_ro < max(seqlen_cache, 1):
        raise RuntimeError(f"flash_attn_ext: rotary_cos has {seqlen_ro} rows (positions); expected at least the "
                           f"cache's {seqlen_cache} and at least 1")
    q_per_token = causal or any(0 <= side < seqlen_cache for side in window)
    if q.device.type == "cpu" and not torch.compiler.is_compiling() and q.shape[0] > 0:
        # The values are on the host here: a position past the tables is an error, not a clamp.
        last = int(cache_seqlens.max()) + max(k.shape[1], q.shape[1] if q_per_token else 1) - 1
        if last >= seqlen_ro:
            raise RuntimeError(f"flash_attn_ext: rotary position {last} (cache_seqlens[b] plus a new key's or query's "
                               f"index) is past rotary_cos's {seqlen_ro} rows; pass tables covering every position "
                               "rotated, or fewer queries than the cache has room for")
    start = cache_seqlens.to(torch.int64).clamp(0, seqlen_ro - 1)[:, None]

    def rotate(x, positions):
        positions = positions.clamp(max=seqlen_ro - 1)
        compute = torch.promote_types(x.dtype, torch.float32)
        cos = rotary_cos[positions].to(compute).unsqueeze(2)  # (batch, seqlen, 1, rotary_dim / 2)
        sin = rotary_sin[positions].to(compute).unsqueeze(2)
        xr = x[..., :rotary_dim].to(compute)
        if interleaved:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            y = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        else:
            x1, x2 = xr.chunk(2, dim=-1)
            y = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return torch.cat((y.to(x.dtype), x[..., rotary_dim:]), dim=-1)

    steps_q = torch.arange(q.shape[1], device=q.device) if q_per_token else torch.zeros(q.shape[1], dtype=torch.int64,
                                                                                         device=q.device)
    return (rotate(q, start + steps_q), rotate(k, start + torch.arange(k.shape[1], device=q.device)))
