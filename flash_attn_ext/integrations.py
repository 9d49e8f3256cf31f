"""Hugging Face transformers integration (transformers 5.x).

    import flash_attn_ext.integrations as fx
    name = fx.register_transformers()            # "fa_ext"
    model = AutoModel.from_pretrained(path, attn_implementation=name)

Why the name is ``"fa_ext"`` and not ``"flash_attn_ext"``: transformers 5.x treats every
``attn_implementation`` whose name contains the substring ``"flash"`` as a Flash-Attention-package
variant (``transformers.utils.generic.is_flash_attention_requested``): ``from_pretrained`` then
tries to load a kernel of that name from the Hub and fails, and models change their masking,
generation and packing paths for it. So the registered name must not contain "flash";
``register_transformers`` refuses such a name with that explanation.

What is registered:
  * ``AttentionInterface[name] = flash_attn_ext_attention_forward``;
  * ``AttentionMaskInterface[name] = transformers.masking_utils.sdpa_mask``: the model builds the
    same masks as for ``attn_implementation="sdpa"`` (None when nothing is masked beyond plain
    causal/bidirectional attention, else a 4-D boolean mask). Without this registration
    transformers would silently drop padding masks for an unknown implementation name.

Masks (never ignored):
  * None: one kernel call for the whole batch (causal per ``module.is_causal`` / ``is_causal``).
  * A 4-D mask (batch or 1, 1, q_len, kv_len), boolean (True = attend) or additive float
    (0 = attend, -inf or dtype-min = blocked): handled per sequence by unpadding. For each batch
    element the queries and keys that take part are gathered, and the mask restricted to them
    must be all-True (padding only) or causal with a diagonal offset (query i sees key
    j <= i + off: causal + padding). That covers left padding and decoding with a cache
    (bottom-right, off = kv_len - q_len) and right padding under a causal mask: transformers
    then builds the top-left pattern (off = 0) in which each real query row sees the real keys
    up to itself (plain causal attention) and each pad query row sees every real key. The
    kernel runs on that sequence (the rows that see every key, such as right-padding pad rows,
    in a second non-causal call) and the output rows are scattered back, so every row equals
    sdpa's; rows that see no key are 0. Any other pattern (sliding windows, packed sequences,
    per-head masks, additive biases) raises NotImplementedError naming the cause: use
    attn_implementation="sdpa" for those models.
"""

from __future__ import annotations

import torch

from .interface import flash_attn_func
from .sdpa import _autocast_and_check_dtype

__all__ = ["register_transformers", "flash_attn_ext_attention_forward", "DEFAULT_NAME"]

DEFAULT_NAME = "fa_ext"


def _allowed_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Boolean 'may attend' tensor from a boolean or additive float mask."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise NotImplementedError(
            f"flash_attn_ext attention: attention_mask of dtype {mask.dtype} is not supported "
            "(expected bool, or an additive float mask of 0 / -inf)")
    allowed = mask == 0
    blocked = mask <= torch.finfo(mask.dtype).min / 2  # -inf or transformers' dtype-min fill
    if not bool((allowed | blocked).all()):
        raise NotImplementedError(
            "flash_attn_ext attention: the additive attention_mask holds values other than 0 and "
            "-inf (an attention bias, e.g. ALiBi or relative positions); biases are not supported, "
            'use attn_implementation="sdpa"')
    return allowed


def _masked_attention(q, k, v, attention_mask, scaling):
    """Per-sequence unpadded attention (see the module docstring). q: (B, Lq, H, D) BSHD,
    k/v: (B, Lk, Hk, D); attention_mask: (B or 1, 1, Lq, Lk)."""
    B, Lq = q.shape[0], q.shape[1]
    Lk = k.shape[1]
    if attention_mask.dim() != 4 or attention_mask.shape[0] not in (1, B) or \
            attention_mask.shape[1] != 1 or tuple(attention_mask.shape[2:]) != (Lq, Lk):
        raise NotImplementedError(
            f"flash_attn_ext attention: attention_mask of shape {tuple(attention_mask.shape)} is "
            f"not supported; expected (batch={B} or 1, 1, q_len={Lq}, kv_len={Lk}) (one mask "
            "for all heads)")
    allowed = _allowed_from_mask(attention_mask)
    if bool(allowed.all()):
        return flash_attn_func(q, k, v, softmax_scale=scaling, causal=False)
    outs = []
    for b in range(B):
        m = allowed[b if allowed.shape[0] > 1 else 0, 0]           # (Lq, Lk)
        q_idx = m.any(dim=1).nonzero().squeeze(1)                # queries that see some key
        kv_idx = m.any(dim=0).nonzero().squeeze(1)               # keys seen by some query
        sub = m[q_idx][:, kv_idx]
        nq, nk = q_idx.numel(), kv_idx.numel()
        out_b = q.new_zeros(q.shape[1:])                         # rows seeing no key stay 0
        if nq > 0:
            o = _causal_offset_attention(q[b:b + 1, q_idx], k[b:b + 1, kv_idx],
                                         v[b:b + 1, kv_idx], sub, scaling, b)[0]
            out_b = out_b.index_copy(0, q_idx, o)
        outs.append(out_b)
    return torch.stack(outs)


def _causal_offset_attention(q, k, v, sub, scaling, b):
    """Attention of one unpadded sequence whose mask ``sub`` (nq, nk) is all-True or causal
    with some diagonal offset: query i sees key j iff j <= i + off.

    Every row sees a key and every key is seen (the caller gathered them), so
    0 <= off and nk - nq <= off. off = nk - nq is the bottom-right mask of the kernel (left
    padding, decoding with a cache); off = 0 with nq > nk is the top-left mask that
    transformers builds for right padding with a causal mask (pad query rows after the last
    real key see every real key). In general the first h = min(nq, nk - off) rows are the
    bottom-right causal problem (h rows, h + off keys) and the remaining rows see every key.
    """
    nq, nk = sub.shape
    if bool(sub.all()):
        return flash_attn_func(q, k, v, softmax_scale=scaling, causal=False)
    off = int(sub[0].sum()) - 1
    i = torch.arange(nq, device=sub.device)[:, None]
    j = torch.arange(nk, device=sub.device)[None, :]
    if off < 0 or not torch.equal(sub, j <= i + off):
        raise NotImplementedError(
            f"flash_attn_ext attention: the attention mask of batch element {b} is neither "
            "padding nor causal+padding (e.g. a sliding window or packed sequences); "
            'those patterns are not supported, use attn_implementation="sdpa"')
    h = min(nq, nk - off)
    head = flash_attn_func(q[:, :h], k[:, :h + off], v[:, :h + off], softmax_scale=scaling,
                           causal=True)
    if h == nq:
        return head
    tail = flash_attn_func(q[:, h:], k, v, softmax_scale=scaling, causal=False)
    return torch.cat([head, tail], dim=1)


def flash_attn_ext_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function.

    Args:
        module: the calling attention layer (``module.is_causal`` is read when ``is_causal`` is
            None).
        query: (batch, nheads, q_len, headdim); key, value: (batch, nheads_kv, kv_len, headdim),
            BHSD as transformers passes them; nheads % nheads_kv == 0 (GQA runs natively).
        attention_mask: None or a 4-D mask as built by ``sdpa_mask`` (see the module docstring).
        dropout: must be 0.0 (call ``model.eval()``, or set the attention dropout to 0).
        scaling: softmax scale (default 1 / sqrt(headdim)).
        is_causal: overrides ``module.is_causal``.
        kwargs: ``softcap``, ``position_bias``, ``s_aux``/``sinks`` must be None; others (e.g.
            ``sliding_window``, already encoded in the mask) are ignored as by the sdpa path.
    Returns:
        (attn_output (batch, q_len, nheads, headdim) contiguous, None).
    Raises:
        NotImplementedError: dropout > 0, unsupported kwargs or mask patterns.
        TypeError: float32 on CUDA outside autocast.
    """
    for name in ("softcap", "position_bias", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"flash_attn_ext attention: `{name}` is not supported; use "
                'attn_implementation="sdpa" or "eager" for this model')
    if dropout:
        raise NotImplementedError(
            f"flash_attn_ext attention: attention dropout ({dropout}) is not supported; call "
            "model.eval() or set the model's attention dropout probability to 0")
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "flash_attn_ext attention: output_attentions=True is not supported (the attention "
            'weights are never materialised); use attn_implementation="eager"')
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_len, kv_len = query.shape[2], key.shape[2]
    query, key, value = _autocast_and_check_dtype({"query": query, "key": key, "value": value})
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # BSHD views
    if attention_mask is not None:
        return _masked_attention(q, k, v, attention_mask, scaling), None
    # No mask: transformers' sdpa_mask returned None, so the pattern is plain causal or plain
    # bidirectional. As the sdpa path: one query token sees everything; with kv_len > q_len
    # (prefill into an empty static cache) the keys beyond q_len are empty slots: drop them.
    causal = bool(is_causal) and q_len > 1
    if causal and kv_len > q_len:
        k, v = k[:, :q_len], v[:, :q_len]
    return flash_attn_func(q, k, v, softmax_scale=scaling, causal=causal), None


def register_transformers(name: str = DEFAULT_NAME) -> str:
    """Register flash_attn_ext as a transformers attention implementation; returns ``name``.

    After this, ``from_pretrained(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` use flash_attn_ext. Idempotent.

    Raises:
        ImportError: transformers is not installed.
        ValueError: ``name`` contains "flash" (transformers 5.x would treat it as a Hub
            flash-attention kernel; see the module docstring) or is a built-in name.
    """
    if "flash" in name.lower():
        raise ValueError(
            f"register_transformers: name {name!r} contains 'flash'; transformers treats such "
            "attn_implementation names as Flash-Attention kernels to fetch from the Hub, so "
            f"pick a name without it (default {DEFAULT_NAME!r})")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError("register_transformers needs transformers >= 5.0 "
                          "(pip install transformers): " + str(e)) from e
    if name in ("sdpa", "eager", "flex_attention", "paged|eager"):
        raise ValueError(f"register_transformers: {name!r} is a built-in implementation name")
    AttentionInterface.register(name, flash_attn_ext_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
