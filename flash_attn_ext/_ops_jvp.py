"""Forward-mode AD of the attention output: ``attention_jvp``, the tangent the autograd.Functions'
jvp return (flash_attn_ext.ops re-exports it)."""

from __future__ import annotations

import torch

from . import _fake_checks as _checks
from .reference import alibi_bias, visible_mask


# ---- forward-mode AD ---------------------------------------------------------------------

def attention_jvp(q, k, v, q_t, k_t, v_t, softmax_scale: float, causal: bool, window_size_left: int = -1,
                  window_size_right: int = -1, sinks=None, sinks_t=None, softcap: float = 0.0,
                  alibi_slopes=None, alibi_t=None) -> torch.Tensor:
    """Tangent of ``out`` (forward-mode derivative) of ``out = softmax(c Q K^T) V``.

    With S = c Q K^T (masked entries -inf: causal, sliding window), P = softmax(S) row-wise, O = P V:
        dS = c (dQ K^T + Q dK^T),  dP = P * (dS - rowsum(P * dS)),  dO = dP V + P dV.
    With logit soft-capping (``softcap`` > 0) the logits are softcap * t, t = tanh(c Q K^T / softcap),
    and dS gains the factor (1 - t^2). ALiBi (``alibi_slopes``, reference.alibi_bias) adds a bias linear
    in the slopes to the logits: P changes, and the slopes' tangent ``alibi_t`` (their shape, or None)
    adds alibi_bias(alibi_t) to the logits' tangent.
    With attention sinks (``sinks`` (nheads,), tangent ``sinks_t`` or None) the softmax runs over
    one more column per row, the head's sink with value 0 and tangent sinks_t[h]; its P column
    enters rowsum(P * dS) only.
    Computed with plain torch ops, materialising P of shape (batch, nheads, seqlen_q,
    seqlen_k) in float32 (float64 for float64 inputs): memory O(seqlen_q * seqlen_k), exact up
    to that dtype's rounding. Query rows that see no key have P = 0, so their tangent is 0.

    Args: q, k, v as the forward op (BSHD, GQA allowed); q_t, k_t, v_t: their tangents (same
    shapes) or None (zero). Returns the tangent of out: q's shape and dtype. Autocast is
    disabled inside (the float32 products stay float32).
    """
    if q_t is None and k_t is None and v_t is None and sinks_t is None and alibi_t is None:
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if q.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(q.device.type):
        with torch.autocast(q.device.type, enabled=False):  # keep the float32 matmuls float32
            return attention_jvp(q, k, v, q_t, k_t, v_t, softmax_scale, causal, window_size_left,
                                 window_size_right, sinks, sinks_t, softcap, alibi_slopes, alibi_t)
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    G = H // Hk
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32

    # Grouped heads, (batch, nheads_k, group, seqlen, headdim): query head h = hk * G + g reads
    # key/value head hk, with no copy of K/V per group (plain matmuls: every vmap supports them).
    def qlayout(t):
        return t.to(cdt).reshape(B, Sq, Hk, G, D).permute(0, 2, 3, 1, 4)

    def kvlayout(t):
        return t.to(cdt).permute(0, 2, 1, 3).unsqueeze(2)

    qh, kh, vh = qlayout(q), kvlayout(k), kvlayout(v)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * softmax_scale          # (B, Hk, G, Sq, Sk)
    dcap = None  # d(logit) / d(c q.k) under soft-capping: 1 - t^2
    if softcap > 0:
        softcap = _checks.float32(softcap)  # the cap the kernels use (flash_api.cpp: set_fwd_params)
        t = torch.tanh(s / softcap)
        s, dcap = softcap * t, 1 - t * t
    if alibi_slopes is not None:  # (batch or 1, nheads, Sq, Sk) -> the grouped layout
        bias = alibi_bias(alibi_slopes.to(q.device), B, H, Sq, Sk, cdt)
        s = s + bias.reshape(bias.shape[0], Hk, G, Sq, Sk)
    visible = visible_mask(Sq, Sk, causal, window_size_left, window_size_right, q.device)
    has_key = visible.any(dim=-1, keepdim=True)  # by the mask alone (False for every row if Sk == 0)
    s = s.masked_fill(~visible, float("-inf"))
    p_sink = None
    if sinks is not None:
        # The sink column (B, Hk, G, Sq, 1): every row sees it, so no row is without a key.
        sink_col = sinks.to(cdt).reshape(1, Hk, G, 1, 1).expand(*s.shape[:-1], 1)
        p_ext = torch.softmax(torch.cat([s, sink_col], dim=-1), dim=-1)
        # A -inf sink is no sink: a row without keys then has P = 0 (softmax of all -inf is NaN).
        p_ext = torch.where(~has_key & (sink_col == float("-inf")), 0.0, p_ext)
        # A +inf sink takes the whole row (P 0 on the keys, 1 on the sink; softmax gives inf - inf
        # = NaN), as the forward and sinks_grad have it.
        all_sink = torch.cat([torch.zeros_like(s), torch.ones_like(sink_col)], dim=-1)
        p_ext = torch.where(sink_col == float("inf"), all_sink, p_ext)
        p, p_sink = p_ext[..., :Sk], p_ext[..., Sk:]
    else:
        # Rows that see no key: softmax of all -inf is NaN; by the op's convention P = 0 there.
        # (torch.where, not nan_to_num: a NaN coming from the inputs must stay NaN.)
        p = torch.where(has_key, torch.softmax(s, dim=-1), 0.0)
    out_t = None
    ds = None
    if q_t is not None:
        ds = torch.matmul(qlayout(q_t), kh.transpose(-1, -2))
    if k_t is not None:
        term = torch.matmul(qh, kvlayout(k_t).transpose(-1, -2))
        ds = term if ds is None else ds + term
    sink_term = None  # rowsum's sink column: P_sink * sinks_t
    if sinks_t is not None and p_sink is not None:
        sink_term = p_sink * sinks_t.to(cdt).reshape(1, Hk, G, 1, 1)
    dlogit = None  # the logits' tangent
    if ds is not None:
        dlogit = (ds * dcap if dcap is not None else ds) * softmax_scale
    if alibi_t is not None:
        bias_t = alibi_bias(alibi_t.to(q.device), B, H, Sq, Sk, cdt)
        bias_t = bias_t.reshape(bias_t.shape[0], Hk, G, Sq, Sk)
        dlogit = bias_t if dlogit is None else dlogit + bias_t
    if dlogit is not None or sink_term is not None:
        pds = p * dlogit if dlogit is not None else torch.zeros_like(p)
        rowsum = pds.sum(dim=-1, keepdim=True)
        if sink_term is not None:
            rowsum = rowsum + sink_term
        dp = pds - p * rowsum
        out_t = torch.matmul(dp, vh)
    if v_t is not None:
        term = torch.matmul(p, kvlayout(v_t))
        out_t = term if out_t is None else out_t + term
    out_t = out_t.permute(0, 3, 1, 2, 4)                                 # (B, Sq, Hk, G, D)
    return out_t.reshape(B, Sq, H, D).to(q.dtype)
