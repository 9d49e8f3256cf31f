"""Attention under a boolean mask, as varlen calls: the masks models build for padding, causal
attention with a diagonal offset, sliding windows and packed sequences, recognised and run as at
most a few ``flash_attn_varlen_func`` calls (unpad, varlen, pad), never approximated. Shared by
the Hugging Face integration (``flash_attn_ext.integrations``: its module docstring lists the
patterns and the transformers side), the SDPA drop-in's ``attn_mask`` and
``MultiheadFlashAttention``'s ``key_padding_mask``.

``masked_attention(q, k, v, attention_mask, scaling, window_left=-1, sinks=None, bidirectional=False,
softcap=0.0, dropout_p=0.0)`` takes BSHD q (B, Lq, H, D), k / v (B, Lk, Hk, D) and a mask (B or 1, 1, Lq, Lk), boolean (True =
attend) or additive (0 = attend; values <= -32752, half of float16's minimum: -inf, any dtype's
minimum, -1e9 = masked); it raises MaskNotSupported (a NotImplementedError whose message is the
reason; each entry point words its own refusal around it) for a pattern it does not take. Rows
that see no key get 0; the output stays connected to q, k, v (zero gradients) when no row sees a
key. Eager calls read sizes on the host (a few syncs per mask tensor: its analysis is kept,
plan_for); under torch.compile
``masked_attention_traced`` runs padding and causal + padding (one run of real rows and keys per
batch element) in a static-shape form, the pattern and the mask's values checked on the device
(an entry point may word the pattern check's message: ``traced_refusal``, one per model).
Meta tensors give an output of the right shape.
"""

from __future__ import annotations

import weakref

import torch

from .interface import flash_attn_func
from .ops import _needs_autograd
from .varlen import flash_attn_varlen_func


class MaskNotSupported(NotImplementedError):
    """A mask this module does not compute; the message is the reason (no advice: each entry point
    adds its own)."""


class MaskPatternNotSupported(MaskNotSupported):
    """A boolean mask whose pattern (which query sees which key) is none that padding_plan runs: not
    padding, causal + padding nor packed sequences (an entry point may know the layer's cause)."""


# Additive mask values at or below this count as masked: -inf, every float dtype's minimum (a
# float16 mask's -65504 too, also after a cast to float32), -1e9. exp(-32752) is 0 in float64.
BLOCKED = -32752.0


def assert_in_graph(ok: torch.Tensor, msg: str) -> None:
    """``torch._assert_async(ok, msg)``: a data-dependent check inside a compiled graph (no host
    read). Its message reaches the device: CUDA takes fewer than 255 characters (longer raises
    "Message length must be smaller than 255" on every call, the check passing or not), and
    inductor pastes it into C++ unquoted, so no double quote; both checked here, on every device."""
    if len(msg) >= 255 or '"' in msg:
        raise ValueError(f"flash_attn_ext internal: an in-graph assert message must be < 255 characters "
                         f"without double quotes, got {len(msg)}: {msg[:60]}...")
    torch._assert_async(ok, msg)


def refuse_mask_derivatives(mask: torch.Tensor, who: str, way_out: str) -> None:
    """An attention mask is a constant here (no derivative is computed for it): one that requires
    grad, or carries a forward-mode tangent (torch.func.jvp / jacfwd, forward_ad duals, which do
    not require grad), is refused rather than given none. ``who``: "<entry>: <argument>"."""
    if mask.requires_grad:
        raise NotImplementedError(f"{who} requires grad; gradients with respect to the mask are not computed "
                                  f"({way_out})")
    if not torch.compiler.is_compiling() and torch.autograd.forward_ad.unpack_dual(mask).tangent is not None:
        raise NotImplementedError(f"{who} carries a forward-mode tangent (jvp, jacfwd, forward_ad); derivatives "
                                  f"with respect to the mask are not computed ({way_out})")


def allowed_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Boolean 'may attend' tensor from a boolean or additive float mask (0 = attend, <= BLOCKED =
    masked; anything else is a bias: MaskNotSupported, eagerly, or a device-side assert under
    torch.compile)."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise MaskNotSupported(f"an attention mask of dtype {mask.dtype} (expected bool, or an additive float "
                               "mask of 0 / -inf)")
    allowed = mask == 0
    bias = "the additive attention mask holds values other than 0 and -inf (an attention bias, e.g. ALiBi or "\
           "relative positions), and biases are not supported"
    ok = (allowed | (mask <= BLOCKED)).all()
    if torch.compiler.is_compiling():
        assert_in_graph(ok, "flash_attn_ext: " + bias)
    elif not bool(ok):
        raise MaskNotSupported(bias)
    return allowed


def _out_zeros(q, v):
    """Zeros of the output's shape: q's with v's head dim (which may differ from q's: MLA)."""
    return q.new_zeros(q.shape[:-1] + (v.shape[-1],))


def _connected_zeros(q, k, v, sinks):
    """Zeros shaped like the output, with q, k, v (and sinks) in their autograd graph (zero
    gradients), for calls where no row sees a key and no kernel runs."""
    out = _out_zeros(q, v)
    if _needs_autograd((q, k, v, sinks)):  # reverse mode, or forward mode's dual tensors (a zero tangent)
        # (t * 0).sum(), not 0 * t.sum(): a float16 sum of large finite inputs overflows to inf.
        out = out + sum((t * 0).sum() for t in (q, k, v, sinks) if t is not None)
    return out


def varlen_flat(q, k, v, cu_q, cu_k, max_q, max_k, scaling, causal, window_left=-1, sinks=None, softcap=0.0,
                dropout_p=0.0):
    """One varlen call over the flattened batch (sequences laid in its rows as cu_seqlens say,
    no unpadding), causal or not, with a causal window (window_left, 0) or a bidirectional one
    (window_left, window_left); returns the output in q's (B, L, H, D) shape."""
    window = (window_left, -1 if causal else window_left) if window_left >= 0 else (-1, -1)
    o = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
                               cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale=scaling, causal=causal,
                               window_size=window, sinks=sinks, softcap=softcap)
    return o.view(*q.shape[:-1], v.shape[-1])


def masked_attention(q, k, v, attention_mask, scaling, window_left=-1, sinks=None, bidirectional=False, softcap=0.0,
                     dropout_p=0.0, epoch=None, traced_refusal=None):
    """Unpad, a few varlen calls (two without a window: the causal rows, the rows that see all
    their keys; one more per distinct count of windowed pad rows; three for a bidirectional
    window; one for packed sequences), pad (see the module docstring). q: (B, Lq, H, D) BSHD,
    k/v: (B, Lk, Hk, D); attention_mask: (B or 1, 1, Lq, Lk); window_left: a causal sliding
    window's left bound (window_size[0]), -1 for none (bidirectional: a bidirectional window,
    bidirectional_window_plan); sinks: None or (H,) attention sinks, given to every call (a row
    that sees no key stays 0, which is also its value with a sink); softcap: logit soft-capping
    (flash_attn_func's), given to every call; dropout_p: attention dropout (flash_attn_func's), given
    to every call (each draws its own mask). Returns (B, Lq, H, v's D).

    Eagerly the mask's analysis (its pattern, the index tensors and sizes of the calls: an O(Lq
    Lk) pass and a few host syncs) is kept per mask tensor and version, so a model's layers,
    which transformers hands one mask object, pay for it once per forward (plan_for; ``epoch``: an
    inference tensor's key there, tensor_version). ``traced_refusal``: under torch.compile, the
    message of masked_attention_traced's pattern check (None: its own)."""
    B, Lq, Lk = q.shape[0], q.shape[1], k.shape[1]
    if q.is_meta:
        return q.new_empty(q.shape[:-1] + (v.shape[-1],))        # the shape alone
    if attention_mask.device != q.device:                        # (a meta mask has no values to read)
        raise RuntimeError(f"flash_attn_ext: the attention mask is on {attention_mask.device} but the query is on "
                           f"{q.device}; expected one device")
    if attention_mask.dim() != 4 or attention_mask.shape[0] not in (1, B) or \
            attention_mask.shape[1] != 1 or tuple(attention_mask.shape[2:]) != (Lq, Lk):
        if attention_mask.is_floating_point() and not torch.compiler.is_compiling():
            allowed_from_mask(attention_mask)                    # a bias (ALiBi's is per head) is named as one
        raise MaskNotSupported(
            f"an attention mask of shape {tuple(attention_mask.shape)} (expected (batch={B} or 1, 1, q_len={Lq}, "
            f"kv_len={Lk}): one mask for all heads)")
    if torch.compiler.is_compiling():
        m = allowed_from_mask(attention_mask)[:, 0].expand(B, Lq, Lk)
        if m.numel() == 0:
            return _connected_zeros(q, k, v, sinks)
        if window_left < 0:
            return masked_attention_traced(q, k, v, m, scaling, sinks, softcap, dropout_p, traced_refusal)
        # The windowed split below reads sizes on the host (its number of calls depends on the
        # data): an explicit graph break, so fullgraph=True names the cause (not a guard error).
        torch._dynamo.graph_break(
            msg="flash_attn_ext: a sliding-window layer with an attention mask reads the sequence sizes on the "
                "host, which torch.compile(fullgraph=True) cannot trace; compile without fullgraph (a graph "
                "break per such call), or load the model with attn_implementation=\"sdpa\"")
    return plan_for(attention_mask, B, Lq, Lk, window_left, bidirectional, epoch)(q, k, v, scaling, sinks, softcap,
                                                                                  dropout_p)


_PLANS: list = []  # the last few plans, most recent first: (weakref to the mask, its version, key, plan)


def tensor_version(t: torch.Tensor, epoch=None):
    """t's count of in-place writes: with t's identity (a weakref), the key of an analysis kept per
    tensor (here and in the Hugging Face integration's position_ids and packing checks). An
    inference tensor keeps no count, so an in-place write to it cannot be seen: its key is the
    caller's ``epoch`` (the Hugging Face integration's: one per model forward, so a buffer rewritten
    between forwards is analysed again) or, without one, a new object that matches no other (no
    reuse: a reused analysis of a rewritten buffer was silently the old one's)."""
    if t.is_inference():
        return ("epoch", epoch) if epoch is not None else object()
    return t._version


def plan_for(attention_mask, B, Lq, Lk, window_left, bidirectional, epoch=None):
    """The calls for ``attention_mask`` as a function plan(q, k, v, scaling, sinks, softcap), from the cache
    when this mask tensor (same object, same version: in-place writes through ``.data``, which keep
    it, are not seen; an inference tensor: the same ``epoch``, tensor_version) was analysed for the
    same sizes and window; a refused pattern is a plan that raises its MaskNotSupported."""
    version = tensor_version(attention_mask, epoch)
    key = (B, Lq, Lk, window_left, bidirectional)
    for ref, seen_version, seen_key, plan in _PLANS:
        if ref() is attention_mask and seen_version == version and seen_key == key:
            return plan
    m = allowed_from_mask(attention_mask)[:, 0].expand(B, Lq, Lk)
    try:
        if m.numel() == 0:
            plan = _connected_zeros_plan
        elif bidirectional and window_left >= 0:
            plan = bidirectional_window_plan(m, window_left)
        else:
            plan = padding_plan(m, window_left)
    except MaskNotSupported as e:
        def plan(*args, _e=e):
            raise type(_e)(str(_e))
    _PLANS.insert(0, (weakref.ref(attention_mask), version, key, plan))
    del _PLANS[4:]  # a model's few masks (full and sliding layers, encoder and decoder)
    return plan


def _connected_zeros_plan(q, k, v, scaling, sinks, softcap=0.0, dropout_p=0.0):
    return _connected_zeros(q, k, v, sinks)


def padding_plan(m, window_left=-1):
    """The plan for padding, causal + padding (split_mask) or, failing those, packed sequences
    (packed_plan) of the boolean (B, Lq, Lk) mask m; MaskNotSupported otherwise."""
    B, Lq, Lk = m.shape
    bad, k_in, q_parts, all_full = split_mask(m, window_left)
    nk, nq = k_in.sum(1), [sel.sum(1) for sel in q_parts]        # (B,) each
    stats = torch.stack([bad.any().long(), m.all().long(), nk.max(), nq[0].sum(), nq[0].max(),
                         nq[1].sum(), nq[1].max()]).tolist()     # one host sync for the sizes
    if stats[0]:
        packed = packed_plan(m, window_left) if Lq == Lk else None
        if packed is not None:
            return packed
        raise MaskPatternNotSupported(
            f"the attention mask of batch element {int(bad.nonzero()[0])} is neither padding, causal+padding nor "
            "packed sequences" + (" with the layer's sliding window" if window_left >= 0
                                  else " (e.g. a sliding window the call does not pass)"))
    all_visible, max_k, total_q, max_q = stats[1], stats[2], stats[3::2], stats[4::2]
    # Every query sees every key: nothing masked. (Not "every row a full row and every key seen",
    # the test before windows: the full rows of an element whose first row sees all keys are
    # still cut on the window's left, e.g. a one-element band of two queries past two keys.)
    if all_visible:
        return lambda q, k, v, scaling, sinks, softcap=0.0, dropout_p=0.0: flash_attn_func(
            q, k, v, dropout_p, softmax_scale=scaling, causal=False, sinks=sinks, softcap=softcap)
    # Unpad: nonzero() lists (batch element, position) pairs in packed order. The calls share
    # the packed keys; an element without rows in a call is a zero-length query sequence there.
    kb, kj = k_in.nonzero().unbind(1)
    cu_k = cu_seqlens(nk)
    calls = []  # (query rows, per-element counts, max count, causal, window_size)
    if total_q[0]:
        calls.append((q_parts[0], nq[0], max_q[0], True, (window_left, -1)))
    if total_q[1] and window_left < 0:
        calls.append((q_parts[1], nq[1], max_q[1], False, (-1, -1)))
    elif total_q[1]:
        # With a window the rows that see all keys are a bottom-right problem of their P rows
        # (offset nk - P): right padding's pad rows (row r of P, after the nk real rows, sees
        # keys j >= nk + r - window_left) with left bound window_left - P; an element whose
        # every row sees all keys (all_full: a decode step, row r sees j >= nk - 1 + r -
        # window_left) with window_left + 1 - P. Both are >= 0: a row past the window would see
        # no key, and so is no full row. One call per distinct (P, all_full) (a host sync for
        # them), the other elements zero-length sequences there.
        for count, shift in sorted(set(zip(nq[1].tolist(), all_full.int().tolist())) - {(0, 0), (0, 1)}):
            sel = q_parts[1] & ((nq[1] == count) & (all_full.int() == shift))[:, None]
            calls.append((sel, sel.sum(1), count, False, (window_left - count + shift, -1)))
    calls = [(*rows.nonzero().unbind(1), cu_seqlens(counts), max_rows, causal, window)
             for rows, counts, max_rows, causal, window in calls]

    def plan(q, k, v, scaling, sinks, softcap=0.0, dropout_p=0.0):
        if not calls:
            return _connected_zeros(q, k, v, sinks)
        k_packed, v_packed = k[kb, kj], v[kb, kj]
        out = _out_zeros(q, v)                                   # rows that see no key stay 0
        for qb, qi, cu_q, max_rows, causal, window in calls:
            o = flash_attn_varlen_func(q[qb, qi], k_packed, v_packed, cu_q, cu_k, max_rows, max_k, dropout_p,
                                       softmax_scale=scaling, causal=causal, window_size=window, sinks=sinks,
                                       softcap=softcap)
            out = out.index_put((qb, qi), o)                     # pad
        return out
    return plan


def bidirectional_window_plan(m, w):
    """The plan for a bidirectional sliding window (ModernBERT's local layers: query i sees key j
    iff |i - j| <= w) over padded batches, as transformers builds the mask: the padding on the
    keys only, so per batch element the real keys are one run [s, s + n) and every row, pad rows
    included, sees the real keys within w of it. Three varlen calls, whatever the padding: the
    real rows against the real keys (window (w, w)); the P = min(w, L) rows after each element's
    keys (right padding's pad rows, row r seeing keys n + r - w .. n - 1 of its element:
    bottom-right window (w - P, -1) of P rows against n keys); the P rows before them likewise,
    rows and keys taken in reverse order. Rows of those two problems past the tensor's ends (or
    of an element without keys) are computed from a stand-in row and dropped. m: the (B, L, L)
    boolean mask (queries and keys the same L positions); anything else raises
    MaskNotSupported."""
    B, Lq, Lk = m.shape
    pos = torch.arange(Lk, device=m.device)
    k_in = m.any(1)                                              # (B, L): the real keys
    s, n, one_run = run_of(k_in)
    expected = k_in[:, None, :] & ((pos[:, None] - pos[None, :]).abs() <= w)[None]
    bad = ~one_run | (m != expected).flatten(1).any(1) if Lq == Lk else torch.ones_like(one_run)
    nb, max_n = torch.stack([bad.any().long(), n.max()]).tolist()  # one host sync
    if nb:
        raise MaskNotSupported(f"the attention mask of batch element {int(bad.nonzero()[0])} is not padding with "
                               "the layer's bidirectional sliding window")
    if max_n == 0:
        return _connected_zeros_plan
    kb, kj = k_in.nonzero().unbind(1)                            # the real rows and keys, packed
    cu = cu_seqlens(n)
    # The pad rows: P rows after each run (r = 0..P-1 at s + n + r) and P before it (at s - 1 - r),
    # the latter against the run's keys reversed; rows past the tensor are stand-ins.
    P = min(w, Lq)
    r = torch.arange(P, device=m.device)[None, :]                # (1, P); none for w = 0
    b = torch.arange(B, device=m.device)[:, None].expand(B, P)
    pads = []  # (rows (B, P), in the tensor (B, P), clamped rows, key order or None)
    for rows, keys_reversed in ((s[:, None] + n[:, None] + r, False), (s[:, None] - 1 - r, True)) if P else ():
        real = (rows >= 0) & (rows < Lq) & (n[:, None] > 0)
        order = torch.argsort(kb * Lk - kj, stable=True) if keys_reversed else None  # each element's keys, last first
        pads.append((rows, real, rows.clamp(0, Lq - 1), order))
    cu_q = torch.arange(B + 1, device=m.device, dtype=torch.int32) * P

    def plan(q, k, v, scaling, sinks, softcap=0.0, dropout_p=0.0):
        k_real, v_real = k[kb, kj], v[kb, kj]
        o = flash_attn_varlen_func(q[kb, kj], k_real, v_real, cu, cu, max_n, max_n, dropout_p, softmax_scale=scaling,
                                   causal=False, window_size=(w, w), sinks=sinks, softcap=softcap)
        out = _out_zeros(q, v).index_put((kb, kj), o)
        for rows, real, rows_c, order in pads:
            kr, vr = (k_real, v_real) if order is None else (k_real[order], v_real[order])
            o = flash_attn_varlen_func(q[b, rows_c].flatten(0, 1), kr, vr, cu_q, cu, P, max_n, dropout_p,
                                       softmax_scale=scaling, causal=False, window_size=(w - P, -1), sinks=sinks,
                                       softcap=softcap).view(B, P, q.shape[2], v.shape[-1])
            out = out.index_put((b[real], rows[real]), o[real])
        return out
    return plan


def packed_plan(m, window_left=-1):
    """The plan for packed sequences: several sequences in one batch row, as transformers lays
    them out for padding-free training (``DataCollatorWithFlattening``: position_ids restarting
    at 0 at each sequence, no attention_mask; ``sdpa_mask`` then builds a block-diagonal mask).
    m: the (B, L, L) boolean mask (queries and keys the same L positions). Row i opens a sequence
    where the first key it sees is key i; every row must belong to one (see some key), and each
    element's mask must be, over its sequences [a, e), causal (key j seen iff a <= j <= i, and j
    >= i - window_left with the layer's sliding window) or, without a window, full (a <= j < e)
    for every element alike. Then one flash_attn_varlen_func call over the flattened batch (each
    sequence's rows in place: no unpadding) gives each sequence's attention alone. Returns the
    plan, or None where the mask is not such a pattern (two host syncs: the sequence starts,
    then the check with the longest sequence); MaskNotSupported where every element is packed
    but causal in some and full in others."""
    B, L = m.shape[0], m.shape[1]
    pos = torch.arange(L, device=m.device)
    start = m.byte().argmax(2) == pos                            # (B, L): row i opens a sequence
    a = torch.cummax(torch.where(start, pos, -1), 1).values      # its sequence's first row (-1: none)
    nxt = torch.where(start, pos, L).flip(1).cummin(1).values.flip(1)   # next start at or after i
    e = torch.cat([nxt[:, 1:], nxt.new_full((B, 1), L)], 1)      # its sequence's end
    i, j = pos[None, :, None], pos[None, None, :]
    inside = j >= a[:, :, None]
    causal = inside & (j <= i)
    if window_left >= 0:
        causal &= j >= i - window_left
    each_causal = (m == causal).flatten(1).all(1)               # (B,): per element
    each_full = (m == (inside & (j < e[:, :, None]))).flatten(1).all(1) & (window_left < 0)
    is_causal, is_full = each_causal.all(), each_full.all()
    not_alike = (each_causal | each_full).all() & ~is_causal & ~is_full   # all packed, kinds mixed
    flat_starts = start.flatten()
    lengths = torch.diff(torch.cat([flat_starts.nonzero().flatten(), pos.new_full((1,), B * L)]))
    ok, causal_kind, mixed, max_len = torch.stack([(is_causal | is_full).long(), is_causal.long(), not_alike.long(),
                                                   lengths.max() if lengths.numel() else pos.new_zeros(())]).tolist()
    if mixed:
        raise MaskNotSupported(
            f"the attention mask packs causal sequences in batch element {int((~each_full).nonzero()[0])} and "
            f"bidirectional ones in batch element {int((~each_causal).nonzero()[0])}: one call takes one kind for "
            "every element")
    if not ok:  # (ok implies that row 0 of each element opens a sequence: none spans two elements)
        return None
    cu = cu_seqlens(lengths)
    return lambda q, k, v, scaling, sinks, softcap=0.0, dropout_p=0.0: varlen_flat(
        q, k, v, cu, cu, max_len, max_len, scaling, bool(causal_kind), window_left if causal_kind else -1, sinks,
        softcap, dropout_p)


def masked_attention_traced(q, k, v, m, scaling, sinks=None, softcap=0.0, dropout_p=0.0, refusal=None):
    """masked_attention without host syncs or data-dependent shapes, for ``torch.compile``
    (fullgraph, CUDA graphs): transformers (before torch 2.14) builds a 4-D mask there even
    without padding, since while tracing it cannot rule out packed sequences in position_ids.
    m: the (B, Lq, Lk) boolean mask. The same two problems as the eager path (the causal rows,
    the rows that see all their element's keys), each one varlen call over the flattened batch
    without unpadding: per element its rows and keys as one sequence, the rows before and after
    them in its block as two filler sequences (computed and dropped), so every size is static (3B
    sequences, none longer than L, max_seqlen L: the dense call's own, hence its tile rows).
    Needs each element's rows of a call and its keys to be one run each (all padding and cache
    patterns are); the pattern check runs on the device (torch._assert_async: a
    RuntimeError on the CPU, a device-side assert on CUDA) instead of MaskNotSupported, its
    message ``refusal`` (None: the patterns, and packed sequences' way out). An entry point that
    knows a cause words its own: the Hugging Face integration names Llama 4's chunked attention
    so. The message is a constant of the graph: one that depended on the layer (its index) would
    compile a graph per layer where each layer is compiled on its own. Rows that see no key stay
    0. Sliding windows take the eager path (their number of calls depends on the data)."""
    B, Lq, Lk = q.shape[0], q.shape[1], k.shape[1]
    bad, k_in, q_parts, _ = split_mask(m)
    ks, nk, k_run = run_of(k_in)
    out = _out_zeros(q, v)
    ok = ~bad & k_run
    for rows, causal in zip(q_parts, (True, False)):
        qs, nq, q_run = run_of(rows)
        ok = ok & q_run
        o = varlen_flat(q, k, v, blocked_cu_seqlens(qs, nq, Lq), blocked_cu_seqlens(ks, nk, Lk), Lq, Lk, scaling,
                        causal, sinks=sinks, softcap=softcap, dropout_p=dropout_p)
        out = torch.where(rows[:, :, None, None], o, out)
    if refusal is None:
        refusal = ("flash_attn_ext: under torch.compile a mask must be padding or causal+padding, one run of real "
                   "rows and keys per batch element (packed sequences: the collator keywords, "
                   "DataCollatorWithFlattening(return_flash_attn_kwargs=True))")
    assert_in_graph(ok.all(), refusal)
    return out


def run_of(sel):
    """(start, count, one_run) of each row of the boolean (B, L) ``sel``: its first True (0 if
    none), its number of Trues, and whether they form one contiguous run."""
    count = sel.sum(1)
    start = torch.where(count > 0, sel.int().argmax(1), 0)
    pos = torch.arange(sel.shape[1], device=sel.device)[None, :]
    run = (pos >= start[:, None]) & (pos < (start + count)[:, None])
    return start, count, (run == sel).all(1)


def blocked_cu_seqlens(start, count, L):
    """int32 (3B + 1,) cu_seqlens over B flattened blocks of L rows: for block b a filler sequence
    [b L, b L + start), the run [b L + start, b L + start + count), a filler to (b + 1) L; each at
    most L long (a filler may be empty)."""
    B = start.shape[0]
    base = torch.arange(B, device=start.device) * L
    bounds = torch.stack([base, base + start, base + start + count], 1).flatten()
    return torch.cat([bounds, bounds.new_full((1,), B * L)]).int()


def split_mask(m, window_left=-1):
    """Analysis of a boolean (B, Lq, Lk) mask, vectorized over the batch.

    For batch element b: the queries that see some key (nq of them, ranked i = 0..nq-1 in
    order) and the keys seen by some query (nk, ranked j); the mask restricted to them must be
    causal with a diagonal offset: query i sees key j iff j <= i + off, where off + 1 is the
    number of keys its first query sees. Then 0 <= off and nk - nq <= off (every key is seen).
    off >= nk - 1 is all-True (padding only, decoding). Otherwise the first h = nk - off <= nq
    rows with all nk keys are a bottom-right causal problem (h = nq: left padding, a cache) and
    the other nq - h rows see all nk keys (off = 0, nq > nk: the pad query rows of right
    padding under a causal mask).

    With a sliding window (window_left >= 0) each query also sees only keys j >= i + off -
    window_left (the rows that see all keys of their element: those within the window).

    Returns (bad, k_in, (causal_q, full_q), all_full): bad (B,) bool, the elements whose mask
    is not such a pattern; k_in (B, Lk) bool, the keys seen by some query; causal_q / full_q
    (B, Lq) bool, the query rows of the causal problems and the rows that see all keys of their
    element; all_full (B,) bool, the elements whose first query already sees all keys (h = 0:
    every row is a full row, e.g. a decode step; under a window its full rows start one key
    later than right padding's, whose first full row comes after the diagonal).
    """
    q_in, k_in = m.any(2), m.any(1)                              # (B, Lq), (B, Lk)
    i, j = q_in.cumsum(1) - 1, k_in.cumsum(1) - 1                # ranks among them
    nk = k_in.sum(1)                                             # (B,)
    first = q_in.int().argmax(1)                                 # first query seeing a key
    off = m.sum(2).gather(1, first[:, None]).squeeze(1) - 1      # -1 where none does
    expected = (q_in[:, :, None] & k_in[:, None, :]
                & (j[:, None, :] <= i[:, :, None] + off[:, None, None]))
    if window_left >= 0:
        expected &= j[:, None, :] >= i[:, :, None] + off[:, None, None] - window_left
    bad = (m != expected).flatten(1).any(1)
    all_full = off + 1 >= nk
    h = torch.where(all_full, 0, nk - off)[:, None]              # rows of the causal problem
    return bad, k_in, (q_in & (i < h), q_in & (i >= h)), all_full


def cu_seqlens(seqlens):
    """int32 (B + 1,) cumulative offsets of the per-sequence lengths ``seqlens`` (B,)."""
    return torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
