"""``scaled_dot_product_attention``: a drop-in for ``torch.nn.functional.scaled_dot_product_attention``
(BHSD layout) that runs flash_attn_ext's kernels.

The math is standard attention, O = softmax(scale * Q K^T) V (Vaswani et al. 2017, eq. 1), computed
tile by tile with an online softmax (FlashAttention-2, Dao 2023, Alg. 1) so the (L, S) score
matrix is never materialised.

What matches torch: argument names and defaults, BHSD shapes, ``is_causal`` semantics (top-left
aligned, also when L != S), ``enable_gqa`` rules, autocast behaviour (under an enabled autocast
region the inputs are cast to the autocast dtype, as torch does for this op).
What is refused (clear error, never ignored): ``attn_mask`` other than None, ``dropout_p`` != 0,
inputs that are not 4-D, and float32/float64 inputs on CUDA outside autocast (the CUDA kernels
are float16/bfloat16 only).
"""

from __future__ import annotations

import torch

from .interface import flash_attn_func

__all__ = ["scaled_dot_product_attention"]

_CUDA_DTYPES = (torch.float16, torch.bfloat16)


def _autocast_and_check_dtype(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Apply autocast like torch's SDPA does, then check the dtypes the device supports.

    ``tensors`` maps argument names (for error messages) to q, k, v in that order.
    Raises TypeError for mixed dtypes or for a dtype the device's kernels do not support.
    """
    names = list(tensors)
    ts = list(tensors.values())
    device_type = ts[0].device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        dt = torch.get_autocast_dtype(device_type)
        ts = [t.to(dt) if t.is_floating_point() else t for t in ts]
    dtype = ts[0].dtype
    for name, t in zip(names[1:], ts[1:]):
        if t.dtype != dtype:
            raise TypeError(
                f"flash_attn_ext: {name} has dtype {t.dtype} but {names[0]} has {dtype}; "
                "all of them must have the same dtype")
    if device_type == "cuda" and dtype not in _CUDA_DTYPES:
        raise TypeError(
            f"flash_attn_ext: the CUDA kernels take float16 or bfloat16, got {names[0]} of dtype "
            f"{dtype}. Run under torch.autocast('cuda', dtype=torch.bfloat16) (or float16), or "
            "convert the model/inputs with .bfloat16() / .half().")
    return ts


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Attention with torch's SDPA calling convention, computed by flash_attn_ext.

    Args:
        query: (batch, nheads, L, headdim).
        key, value: (batch, nheads_k, S, headdim). ``nheads_k == nheads`` unless
            ``enable_gqa=True``, then ``nheads % nheads_k == 0`` (grouped-query attention,
            Ainslie et al. 2023: query head h uses key/value head h // (nheads // nheads_k)).
            headdim: a multiple of 8, at most 256. Last dim contiguous; other strides are free,
            so the usual ``x.view(B, S, H, D).transpose(1, 2)`` views cost no copy.
        attn_mask: must be None (masks are not supported; use ``is_causal``).
        dropout_p: must be 0.0 (no attention dropout).
        is_causal: causal mask aligned to the top-left corner, exactly as torch: query i sees
            key j <= i. (flash_attn_ext's own ``causal`` is bottom-right aligned; this function
            converts, so the result equals torch's also when L != S.)
        scale: softmax scale, default 1 / sqrt(headdim).
        enable_gqa: allow nheads_k < nheads (see above).

    Dtypes: CPU float32/float64/float16/bfloat16; CUDA float16/bfloat16. Under an enabled
    ``torch.autocast`` region the inputs are first cast to the autocast dtype (as torch does).

    Returns:
        (batch, nheads, L, headdim), a transposed view of a contiguous BSHD tensor, in the
        (possibly autocast) input dtype. Differentiable w.r.t. query, key, value.

    Raises:
        NotImplementedError: ``attn_mask`` is not None or ``dropout_p`` != 0.
        ValueError: not 4-D, mismatched batch/headdim/seqlen, or head counts that torch would
            also refuse (nheads_k != nheads without enable_gqa; nheads % nheads_k != 0).
        TypeError: mixed dtypes, or float32/float64 on CUDA outside autocast.
    """
    if attn_mask is not None:
        raise NotImplementedError(
            "flash_attn_ext.scaled_dot_product_attention: attn_mask is not supported (got a "
            f"{type(attn_mask).__name__}); pass attn_mask=None, with is_causal=True for a causal "
            "mask, or use torch.nn.functional.scaled_dot_product_attention for arbitrary masks")
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"flash_attn_ext.scaled_dot_product_attention: dropout_p must be 0.0 (got {dropout_p}); "
            "attention dropout is not implemented")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(
                f"flash_attn_ext.scaled_dot_product_attention: {name} must be 4-D "
                f"(batch, nheads, seqlen, headdim), got shape {tuple(t.shape)}")
    B, H, L, D = query.shape
    Bk, Hk, S, Dk = key.shape
    if key.shape != value.shape:
        raise ValueError(
            f"flash_attn_ext.scaled_dot_product_attention: key {tuple(key.shape)} and value "
            f"{tuple(value.shape)} must have the same shape (batch, nheads_k, S, headdim)")
    if Bk != B or Dk != D:
        raise ValueError(
            f"flash_attn_ext.scaled_dot_product_attention: key/value shape {tuple(key.shape)} does "
            f"not match query {tuple(query.shape)} in batch or headdim")
    if Hk != H and not enable_gqa:
        raise ValueError(
            f"flash_attn_ext.scaled_dot_product_attention: query has {H} heads but key/value have "
            f"{Hk}; pass enable_gqa=True for grouped-query attention (as torch requires)")
    if H % Hk != 0:
        raise ValueError(
            f"flash_attn_ext.scaled_dot_product_attention: nheads ({H}) must be a multiple of "
            f"nheads_k ({Hk})")
    query, key, value = _autocast_and_check_dtype({"query": query, "key": key, "value": value})

    # BHSD -> BSHD: views, no copy (the op takes any strides with a contiguous last dim).
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if not is_causal or L == S:
        # L == S: top-left and bottom-right alignment are the same mask.
        out = flash_attn_func(q, k, v, softmax_scale=scale, causal=is_causal)
    elif L < S:
        # Top-left: query i (< L) sees keys 0..i, so keys >= L are never seen; on the
        # remaining L x L square both alignments agree.
        out = flash_attn_func(q, k[:, :L], v[:, :L], softmax_scale=scale, causal=True)
    else:
        # L > S, top-left: queries 0..S-1 form the causal S x S square; queries >= S see
        # every key (no mask).
        head = flash_attn_func(q[:, :S], k, v, softmax_scale=scale, causal=True)
        tail = flash_attn_func(q[:, S:], k, v, softmax_scale=scale, causal=False)
        out = torch.cat([head, tail], dim=1)
    return out.transpose(1, 2)
