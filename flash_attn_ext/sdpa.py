"""``scaled_dot_product_attention``: a drop-in for ``torch.nn.functional.scaled_dot_product_attention``
(BHSD layout) that runs flash_attn_ext's kernels.

The math is standard attention, O = softmax(scale * Q K^T) V (Vaswani et al. 2017, eq. 1), computed
tile by tile with an online softmax (FlashAttention-2, Dao 2023, Alg. 1) so the (L, S) score
matrix is never materialised.

What matches torch: argument names and defaults, BHSD shapes, ``is_causal`` semantics (top-left
aligned, also when L != S), ``enable_gqa`` rules (key and value of one head count), autocast
behaviour (under an enabled autocast region the inputs other than float64 are cast to the autocast
dtype, as torch does for this op).
``attn_mask`` (boolean, True = take part, or additive 0 / -inf) is taken when it is the same for
every head and a pattern the kernels compute: key and/or query padding, causal (any diagonal
offset, top-left included) with padding, sequences packed block-diagonally; it runs as at most
two varlen calls (flash_attn_ext.masked, the Hugging Face integration's unpadding), and a row
that sees no key gets 0 (torch: NaN or 0, by version and backend; with a finite fill such as the
dtype's minimum, which counts as masked from -32752 down, torch gives the values' mean).
What is refused (clear error, never ignored): other masks (per head, additive biases, other
patterns), ``attn_mask`` with ``is_causal=True`` (as torch), ``dropout_p`` outside [0, 1) (torch takes
1.0), inputs that are not 4-D, and float32/float64 inputs on CUDA outside autocast (the CUDA kernels are
float16/bfloat16 only). Every check runs here, before the kernels, and names the arguments
as torch does (query, key, value; BHSD shapes), never the kernels' internal BSHD q/k/v views.
"""

from __future__ import annotations

import torch

from . import _C
from ._fake_checks import MAX_HEADDIM as _MAX_HEADDIM, softmax_scale_ok
from ._args import _as_bool, _check_tensors, _dropout_p, _maybe_contiguous, _scale
from .interface import flash_attn_func

__all__ = ["scaled_dot_product_attention"]

_CUDA_DTYPES = (torch.float16, torch.bfloat16)
_ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _compiled_cuda_head_dims() -> tuple[int, ...]:
    """Head dims with compiled CUDA kernels (empty for a CPU-only build)."""
    info = dict(_C.build_info())
    if not info.get("with_cuda"):
        return ()
    return tuple(int(x) for x in str(info.get("head_dims", "")).split(",") if x.strip())


# Read once at import (a constant for torch.compile, no call into the extension while tracing).
_CUDA_HEAD_DIMS = _compiled_cuda_head_dims()


def _autocast_and_check_dtype(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Apply autocast like torch's SDPA does, then check the dtypes the device supports.

    ``tensors`` maps argument names (for error messages) to q, k, v in that order.
    Raises TypeError for mixed dtypes, a non-floating dtype, or a dtype the device's kernels do
    not support.
    """
    names = list(tensors)
    ts = list(tensors.values())
    device_type = ts[0].device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        # As autocast's casts: floating tensors other than float64 (which autocast leaves alone).
        dt = torch.get_autocast_dtype(device_type)
        ts = [t.to(dt) if t.is_floating_point() and t.dtype != torch.float64 else t for t in ts]
    dtype = ts[0].dtype
    if dtype not in _ALL_DTYPES:
        raise TypeError(
            f"flash_attn_ext: {names[0]} has dtype {dtype}; supported: float16, bfloat16 (CUDA and "
            "CPU), float32, float64 (CPU)")
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
        key, value: (batch, nheads_k, S, headdim); value's head dim may be another (Ev, as
            torch's: multi-head latent attention; both run padded to the larger). ``nheads_k == nheads`` unless
            ``enable_gqa=True``, then ``nheads % nheads_k == 0`` (grouped-query attention,
            Ainslie et al. 2023: query head h uses key/value head h // (nheads // nheads_k)).
            headdim: at most 256 (on CUDA, with a compiled kernel head dim >= headdim); one that
            is not a multiple of 8 runs zero-padded to the next (a copy; the output cut back;
            the default scale stays 1 / sqrt(headdim)). Any strides: the usual
            ``x.view(B, S, H, D).transpose(1, 2)`` views cost no copy; a last dim with a stride
            other than 1 is made contiguous first (a copy), as torch does.
            query, key, value: one device (cpu or cuda).
        attn_mask: None, or a mask broadcastable to (batch, nheads, L, S), the same for every
            head (size 1 there, or expanded / equal over the heads): bool (True = take part) or
            floating (0 = take part, values <= -32752 such as -inf or a float dtype's minimum =
            masked), on query's device, not requiring grad. Taken where the allowed positions of
            each batch element form padding (of keys and/or queries), causal attention with a
            diagonal offset plus padding (top-left ``tril``, bottom-right, left / right
            padding), or block-diagonal packed sequences (every block causal, or every block
            full); a row that sees no key gets 0. Reads sizes on the host (a few syncs per call); under
            torch.compile padding and causal + padding (one run of real rows and keys per batch
            element) run in a static-shape form, the pattern checked on the device (a
            RuntimeError / device-side assert otherwise).
        dropout_p: attention dropout probability in [0, 1) (as torch: applied whenever given, pass
            ``dropout_p if self.training else 0.0``): flash_attn_func's ``dropout_p`` (each kernel
            call draws its own mask from torch's generator; on CUDA the kernels' dropout twins run it).
        is_causal: causal mask aligned to the top-left corner, exactly as torch: query i sees
            key j <= i. (flash_attn_ext's own ``causal`` is bottom-right aligned; this function
            converts, so the result equals torch's also when L != S.)
        scale: softmax scale, default 1 / sqrt(headdim); must be finite with |scale| * log2(e)
            < 3.4e38 (float32).
        enable_gqa: allow nheads_k < nheads (see above).

    Differentiable in reverse mode and forward mode, and usable under torch.func transforms
    (grad, vjp, jvp, jacrev, jacfwd, vmap): see ``flash_attn_ext.flash_attn_func``. With an
    ``attn_mask``: reverse mode (autograd), forward mode through torch.autograd.forward_ad dual
    tensors and vmap over query / key / value; the other torch.func transforms (jvp, grad, ...)
    raise NotImplementedError (flash_attn_varlen_func's) where the mask needs a varlen call (every
    mask but an all-True one).

    Dtypes: CPU float32/float64/float16/bfloat16; CUDA float16/bfloat16. Under an enabled
    ``torch.autocast`` region the inputs are first cast to the autocast dtype (as torch does;
    float64 inputs stay float64, as autocast leaves them).

    Returns:
        (batch, nheads, L, Ev), a transposed view of a contiguous BSHD tensor, in the
        (possibly autocast) input dtype. Differentiable w.r.t. query, key, value.

    Raises (before any kernel runs; messages name query/key/value and their BHSD shapes):
        NotImplementedError: an ``attn_mask`` of another pattern, per head, with bias values,
            requiring grad, carrying a forward-mode tangent or batched by vmap, or a nested (jagged)
            tensor.
        ValueError: ``attn_mask`` with ``is_causal=True``, or not broadcastable to (batch,
            nheads, L, S); inputs not 4-D, mismatched batch/headdim/seqlen, head counts that torch would
            also refuse (nheads_k != nheads without enable_gqa; nheads % nheads_k != 0), key/value
            without heads for a query with some (nheads = 0: an empty output, as torch),
            headdim <= 0 or > 256 (or without a compiled CUDA kernel), a
            scale that is not finite or past float32's range, ``dropout_p`` outside [0, 1).
        RuntimeError: query, key, value (or attn_mask) on different devices, or on a device
            other than cpu/cuda; under torch.compile, a mask that is not the static form's
            pattern (a device-side assert).
        TypeError: mixed dtypes, a dtype other than float16/bfloat16/float32/float64, or
            float32/float64 on CUDA outside autocast; an attn_mask that is not a bool or
            floating tensor; ``is_causal`` or ``enable_gqa`` not a bool (or 0 / 1).
    """
    is_causal, enable_gqa = _as_bool("is_causal", is_causal), _as_bool("enable_gqa", enable_gqa)
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor) or not (attn_mask.dtype == torch.bool or
                                                           attn_mask.is_floating_point()):
            raise TypeError(
                "flash_attn_ext.scaled_dot_product_attention: attn_mask must be a bool or floating "
                f"tensor, got {attn_mask.dtype if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__}")
        from .masked import refuse_mask_derivatives

        refuse_mask_derivatives(attn_mask, "flash_attn_ext.scaled_dot_product_attention: attn_mask",
                                "pass a plain (detached) mask, or use torch's SDPA")
        if not torch.compiler.is_compiling() and torch._C._functorch.is_batchedtensor(attn_mask):
            raise NotImplementedError("flash_attn_ext.scaled_dot_product_attention: vmap over attn_mask is not "
                                      "supported (vmap over query / key / value with one mask is)")
        if is_causal:
            raise ValueError("flash_attn_ext.scaled_dot_product_attention: attn_mask and is_causal=True were both "
                             "given (as torch refuses it); put the causal pattern into attn_mask, or pass one of them")
    _check_tensors(query=query, key=key, value=value)
    dropout_p = _dropout_p(dropout_p, "dropout_p", "flash_attn_ext.scaled_dot_product_attention")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(
                f"flash_attn_ext.scaled_dot_product_attention: {name} must be 4-D "
                f"(batch, nheads, seqlen, headdim), got shape {tuple(t.shape)}")
    B, H, L, D = query.shape
    Bk, Hk, S, Dk = key.shape
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(
            f"flash_attn_ext.scaled_dot_product_attention: key {tuple(key.shape)} and value "
            f"{tuple(value.shape)} must have the same (batch, nheads_k, S) (value's headdim may differ, as torch's)")
    Ev = value.shape[-1]
    if Bk != B or Dk != D:
        raise ValueError(
            f"flash_attn_ext.scaled_dot_product_attention: key/value shape {tuple(key.shape)} does "
            f"not match query {tuple(query.shape)} in batch or headdim")
    if Hk != H and not enable_gqa:
        raise ValueError(
            f"flash_attn_ext.scaled_dot_product_attention: query has {H} heads but key/value have "
            f"{Hk}; pass enable_gqa=True for grouped-query attention (as torch requires)")
    if Hk == 0 and H > 0:
        raise ValueError(
            f"flash_attn_ext.scaled_dot_product_attention: key/value have 0 heads (shape "
            f"{tuple(key.shape)}) for a query with {H}; expected nheads_k >= 1")
    if Hk and H % Hk != 0:
        raise ValueError(
            f"flash_attn_ext.scaled_dot_product_attention: nheads ({H}) must be a multiple of "
            f"nheads_k ({Hk})")
    for name, t in (("key", key), ("value", value)):
        if t.device != query.device:
            raise RuntimeError(
                f"flash_attn_ext.scaled_dot_product_attention: query is on {query.device} but "
                f"{name} is on {t.device}; query, key and value must be on one device")
    if query.device.type not in ("cpu", "cuda", "meta"):
        raise RuntimeError(
            f"flash_attn_ext.scaled_dot_product_attention: query is on {query.device}; the kernels "
            "run on cpu and cuda")
    for name, t in (("query", query), ("value", value)):  # another than a multiple of 8: padded (interface.py)
        if not 0 < t.shape[-1] <= _MAX_HEADDIM:
            raise ValueError(
                f"flash_attn_ext.scaled_dot_product_attention: headdim ({name}.size(-1)) must be "
                f"positive and at most {_MAX_HEADDIM}, got {t.shape[-1]} ({name} shape "
                f"{tuple(t.shape)}, (batch, nheads, L or S, headdim))")
    if query.device.type == "cuda" and not any(d >= max(D, Ev) for d in _CUDA_HEAD_DIMS):
        raise ValueError(
            f"flash_attn_ext.scaled_dot_product_attention: no CUDA kernel for headdim "
            f"(query.size(-1), value.size(-1)) {max(D, Ev)} in this build (compiled head dims: "
            f"{','.join(map(str, _CUDA_HEAD_DIMS)) or 'none'}); rebuild with "
            f"FLASH_ATTN_EXT_HDIMS including a head dim >= {max(D, Ev)}")
    if scale is not None:
        scale = _scale("scale", scale, query)  # a real number (TypeError naming scale otherwise)
        if not softmax_scale_ok(scale):
            raise ValueError("flash_attn_ext.scaled_dot_product_attention: scale must be finite with |scale| * "
                             f"log2(e) < 3.4e38 (float32; the kernels scale scores by it), got {scale}")
    query, key, value = _autocast_and_check_dtype({"query": query, "key": key, "value": value})
    if H == 0:
        # No heads (as torch: an empty output); the sum ties it to the inputs for autograd (their
        # gradients: empty zeros).
        return query.new_zeros((B, 0, L, Ev)) + 0 * (query.sum() + key.sum() + value.sum())
    # As torch: a last dim with a stride other than 1 is copied to a contiguous tensor (the
    # kernels read rows of headdim contiguous elements; interface._maybe_contiguous, which also
    # copies the empty and size-1 ones .contiguous() would return as they are); every other
    # stride is used as is.
    query, key, value = _maybe_contiguous(query, key, value)

    # BHSD -> BSHD: views, no copy (the op takes any strides with a contiguous last dim).
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if attn_mask is not None:
        return _masked(q, k, v, attn_mask, scale, (B, H, L, S), dropout_p).transpose(1, 2)
    if not is_causal or L == S:
        # L == S: top-left and bottom-right alignment are the same mask.
        out = flash_attn_func(q, k, v, dropout_p, softmax_scale=scale, causal=is_causal)
    elif L < S:
        # Top-left: query i (< L) sees keys 0..i, so keys >= L are never seen; on the
        # remaining L x L square both alignments agree.
        out = flash_attn_func(q, k[:, :L], v[:, :L], dropout_p, softmax_scale=scale, causal=True)
    else:
        # L > S, top-left: queries 0..S-1 form the causal S x S square; queries >= S see
        # every key (no mask).
        head = flash_attn_func(q[:, :S], k, v, dropout_p, softmax_scale=scale, causal=True)
        tail = flash_attn_func(q[:, S:], k, v, dropout_p, softmax_scale=scale, causal=False)
        out = torch.cat([head, tail], dim=1)
    return out.transpose(1, 2)


def _masked(q, k, v, attn_mask, scale, shape, dropout_p=0.0):
    """scaled_dot_product_attention with an attn_mask: the mask brought to (batch or 1, 1, L, S),
    then flash_attn_ext.masked's varlen calls (its refusals worded for this function)."""
    from .masked import MaskNotSupported, masked_attention

    B, H, L, S = shape
    try:
        if torch.broadcast_shapes(attn_mask.shape, shape) != torch.Size(shape):
            raise RuntimeError
    except RuntimeError:
        raise ValueError(f"flash_attn_ext.scaled_dot_product_attention: attn_mask of shape {tuple(attn_mask.shape)} "
                         f"does not broadcast to (batch, nheads, L, S) = {shape}") from None
    if attn_mask.device != q.device:
        raise RuntimeError(f"flash_attn_ext.scaled_dot_product_attention: attn_mask is on {attn_mask.device} but "
                           f"query is on {q.device}")
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if mask.shape[1] != 1 and mask.stride(1) == 0:
        mask = mask[:, :1]                                       # expanded over the heads: one head's
    elif mask.shape[1] != 1 and not torch.compiler.is_compiling() and not mask.is_meta and \
            bool((mask == mask[:, :1]).all()):                   # the same on every head (a host read)
        mask = mask[:, :1]
    if mask.shape[1] != 1:
        raise NotImplementedError(
            "flash_attn_ext.scaled_dot_product_attention: attn_mask differs per head (size "
            f"{mask.shape[1]} on the heads dim); masks the same for every head are supported, use "
            "torch.nn.functional.scaled_dot_product_attention for this one")
    try:
        return masked_attention(q, k, v, mask.expand(mask.shape[0], 1, L, S), scale, dropout_p=dropout_p)
    except MaskNotSupported as e:
        raise NotImplementedError(
            f"flash_attn_ext.scaled_dot_product_attention: {e}; use "
            "torch.nn.functional.scaled_dot_product_attention for this mask") from None
