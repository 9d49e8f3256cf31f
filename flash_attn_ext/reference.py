"""Math reference for attention, used by the tests and the benchmark.

Standard attention, materialising the (seqlen_q, seqlen_k) score matrix:
    S = softmax_scale * Q K^T,  P = softmax(S) (row-wise),  O = P V,  LSE = logsumexp(S)
(Vaswani et al. 2017, eq. 1); with logit soft-capping (Gemma 2) S = softcap * tanh(softmax_scale
* Q K^T / softcap); with ALiBi (Press et al. 2022) S_ij - slope * |i + seqlen_k - seqlen_q - j|. Same conventions as the kernels: BSHD layout, GQA/MQA by
repeating K/V heads, causal masks and sliding windows aligned to the bottom-right corner, and a
query row that sees no key gives O = 0 and LSE = +inf.

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
    return visible_mask(seqlen_q, seqlen_k, causal=True, device=device)


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size_left: int = -1,
                 window_size_right: int = -1, device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) mask, True where query i may see key j (flash-attn's
    semantics): with off = seqlen_k - seqlen_q (bottom-right alignment), j <= i + off when causal,
    j <= i + off + window_size_right when window_size_right >= 0 (ignored when causal), and
    j >= i + off - window_size_left when window_size_left >= 0 (-1: no bound on that side)."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    off = seqlen_k - seqlen_q
    visible = torch.ones((seqlen_q, seqlen_k), dtype=torch.bool, device=device)
    right = 0 if causal else window_size_right
    if right >= 0:
        visible &= j <= i + off + right
    if window_size_left >= 0:
        visible &= j >= i + off - window_size_left
    return visible


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    upcast: bool = True,
    ref_dtype: torch.dtype = torch.float64,
    window_size: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    rng_state: torch.Tensor | None = None,
    dropout_batch0: int = 0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention on BSHD tensors.

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        k, v: (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0.
        softmax_scale: defaults to 1 / sqrt(headdim).
        causal: bottom-right aligned causal mask.
        upcast: compute in ``ref_dtype`` (float64 by default) if True, else in q's dtype.
        ref_dtype: the compute dtype when ``upcast`` is True.
        window_size: (left, right) sliding window, bottom-right aligned (``visible_mask``).
        sinks: (nheads,) attention sinks (gpt-oss), or None: per head a logit (natural-log units,
            the scaled scores' scale) of an extra key every row sees, with a zero value. The
            softmax runs over the keys and the sink; the sink's column is dropped from P.
            Differentiable (computed in the compute dtype).
        softcap: logit soft-capping (Gemma 2; flash-attn's softcap): > 0 makes the logits
            softcap * tanh(softmax_scale * q.k / softcap) (computed in the compute dtype), 0 none.
            The sinks are not capped.
        dropout_p, rng_state: attention dropout (FlashAttention, Dao et al. 2022): P's elements
            dropped by the kernels' mask (``dropout_keep_mask``; dropout_batch0 its first batch
            index) and the kept ones scaled by 1 / (1 - dropout_threshold(p) / 2^16) (p as the
            kernels' 16-bit randoms resolve it), after the LSE (which stays that of P). 0.0: none.
        alibi_slopes: ALiBi (Press et al. 2022, "Train Short, Test Long", section 3; flash-attn's
            alibi_slopes), (nheads,) or (batch, nheads), or None: the logit of query i and key j
            gets -slope * |i + seqlen_k - seqlen_q - j| (bottom-right aligned, as the masks), after
            softcap, before the mask (computed in the compute dtype).
    Returns:
        out: (batch, seqlen_q, nheads, headdim) in the compute dtype (differentiable).
        lse: (batch, nheads, seqlen_q) float32 natural-log logsumexp of the scaled scores
             and the sink (+inf for rows that see no key, or the sink's logit with sinks).

    Rows that see no key (decided by the mask alone: causal with seqlen_q > seqlen_k, a window
    past the keys, or seqlen_k == 0) get out = 0 and lse = +inf, with zero gradients. Non-finite inputs are not
    hidden: a NaN (or an inf that makes a score NaN) in q or k propagates to every row whose
    scores it enters, and one in v to the rows that read it (P V is a matmul, so as in torch's
    math SDPA it also reaches rows that see a key but give it probability 0).
    """
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    dtype = ref_dtype if upcast else q.dtype
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    nheads, nheads_k = q.shape[2], k.shape[2]
    if nheads != nheads_k:
        kf = kf.repeat_interleave(nheads // nheads_k, dim=2)
        vf = vf.repeat_interleave(nheads // nheads_k, dim=2)
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * softmax_scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes.to(q.device), q.shape[0], nheads, seqlen_q, seqlen_k, dtype)
    # Rows that see at least one key (by the mask alone, never by the values).
    has_key = torch.full((seqlen_q, 1), seqlen_k > 0, dtype=torch.bool, device=q.device)
    if causal or window_size[0] >= 0 or window_size[1] >= 0:
        mask = visible_mask(seqlen_q, seqlen_k, causal, window_size[0], window_size[1], device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        has_key = has_key & mask.any(dim=-1, keepdim=True)
    keep = None
    if dropout_p > 0:
        keep = dropout_keep_mask(rng_state, q.shape[0], nheads, seqlen_q, seqlen_k, dropout_p, dropout_batch0,
                                 device=q.device)

    def dropped(probs):
        if keep is None:
            return probs
        rp = 1.0 / (1.0 - dropout_threshold(dropout_p) / 65536.0)  # the kernels' scale (dropout_keep_mask)
        return torch.where(keep, probs, torch.zeros((), dtype=probs.dtype, device=probs.device)) * rp

    if sinks is not None:
        # The sink as one more key column, visible to every row, its value 0 (P's column dropped).
        sink_col = sinks.to(dtype).view(1, nheads, 1, 1).expand(*scores.shape[:3], 1)
        ext = torch.cat([scores, sink_col], dim=-1)
        lse = torch.logsumexp(ext.float() if dtype != torch.float64 else ext, dim=-1)
        probs = torch.softmax(ext, dim=-1)[..., :seqlen_k]
        # A -inf sink is no sink: a row without keys then has P = 0 and lse +inf (softmax of all
        # -inf would be NaN).
        keyless = ~has_key.view(1, 1, seqlen_q, 1) & (sinks == float("-inf")).view(1, nheads, 1, 1).to(q.device)
        zero = torch.zeros((), dtype=probs.dtype, device=probs.device)
        probs = torch.where(keyless, zero, probs)
        out = torch.einsum("bhqk,bkhd->bqhd", dropped(probs), vf)
        lse = torch.where(keyless[..., 0], float("inf"), lse)
        return out, lse.float()
    lse = torch.logsumexp(scores.float() if dtype != torch.float64 else scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    # Rows with no visible key: softmax of all -inf is NaN; the convention is P = 0 there. Only
    # there: a NaN/inf coming from the inputs propagates (no nan_to_num).
    zero = torch.zeros((), dtype=probs.dtype, device=probs.device)
    probs = torch.where(has_key, probs, zero)
    out = torch.einsum("bhqk,bkhd->bqhd", dropped(probs), vf)
    out = torch.where(has_key[:, :, None], out, zero)  # also when v holds a NaN
    lse = torch.where(has_key.squeeze(-1), lse, torch.full_like(lse, float("inf")))
    return out, lse.float()


def alibi_geometric_slopes(nheads: int, device=None) -> torch.Tensor:
    """ALiBi's slopes for ``nheads`` heads (Press et al. 2022, section 3): 2^(-8 (h + 1) / nheads)
    for head h, (nheads,) float32 (the paper's sequence for a power-of-2 head count)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / nheads) for h in range(nheads)], device=device)


def alibi_of_sequence(alibi_slopes, b: int):
    """The slopes (or their tangents) sequence b of a varlen / KV-cache batch runs with alone: a
    (nheads,) tensor serves every sequence, row b of a (batch, nheads) one; None stays None."""
    return alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]


def alibi_bias(alibi_slopes: torch.Tensor, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """ALiBi's bias (Press et al. 2022; flash-attn's alibi_slopes), (batch or 1, nheads, seqlen_q,
    seqlen_k) in ``dtype``: -slope * |i + seqlen_k - seqlen_q - j| for query i, key j; slopes
    (nheads,) or (batch, nheads)."""
    i = torch.arange(seqlen_q, device=alibi_slopes.device).view(-1, 1)
    j = torch.arange(seqlen_k, device=alibi_slopes.device).view(1, -1)
    dist = (i + (seqlen_k - seqlen_q) - j).abs().to(dtype)
    slopes = alibi_slopes.to(dtype).view(-1, nheads, 1, 1)
    return -slopes * dist


_M32 = 0xFFFFFFFF


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b for a constant a < 2^32 and an int64 tensor b of values in
    [0, 2^32), in int64 arithmetic without overflow (b split into 16-bit halves)."""
    p_lo = a * (b & 0xFFFF)
    p_hi = a * (b >> 16)
    mid = p_lo + ((p_hi & 0xFFFF) << 16)
    return (p_hi >> 16) + (mid >> 32), mid & _M32


def philox4x32_10(counter: tuple, key: tuple[int, int]) -> tuple:
    """Philox4x32-10 (Salmon et al., SC 2011, section 3.2) on int64 tensors holding uint32 values:
    counter (c0, c1, c2, c3) tensors (broadcastable), key (k0, k1) ints. Returns the four output
    words. The torch twin of csrc/primitives/philox.cuh, written from the paper, for the tests."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _M32 for c in counter)
    k0, k1 = key[0] & _M32, key[1] & _M32
    for _ in range(10):
        hi0, lo0 = _mulhilo32(0xD2511F53, c0)
        hi1, lo1 = _mulhilo32(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def dropout_threshold(dropout_p: float) -> int:
    """The kernels' 16-bit drop threshold for dropout_p: round(p 2^16), at most 2^16 - 1; an element
    is dropped with probability threshold / 2^16, the kept ones scaled by 1 / (1 - threshold / 2^16)."""
    return min(math.floor(dropout_p * 65536.0 + 0.5), 65535)  # halves away from zero, as the API's llround


def dropout_keep_mask(rng_state: torch.Tensor, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                      dropout_p: float, batch0: int = 0, device=None) -> torch.Tensor:
    """The kernels' attention-dropout mask Z (csrc/primitives/philox.cuh): bool (batch, nheads,
    seqlen_q, seqlen_k), True where P's element is kept. With corner(x) = (x >> 4) * 8 + (x & 7),
    element (q, k) of batch b, head h reads the Philox4x32-10 output of counter (corner(k) >> 1,
    corner(q), (batch0 + b) * nheads + h, offset), key (seed low 32 bits, seed high 32 bits ^ offset
    high 32 bits), with (seed, offset) = rng_state: word 2 (corner(k) & 1) + ((q >> 3) & 1), 16-bit
    half (k >> 3) & 1 (0: low); kept iff that half >= dropout_threshold(dropout_p). batch0: the first
    sequence's index (one sequence of a varlen call)."""
    seed, offset = (int(x) & 0xFFFFFFFFFFFFFFFF for x in rng_state.tolist())
    key = (seed & _M32, (seed >> 32) ^ (offset >> 32))
    qi = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1)
    ki = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    bh = ((batch0 + torch.arange(batch, device=device)).view(-1, 1) * nheads
          + torch.arange(nheads, device=device).view(1, -1)).view(batch, nheads, 1, 1)

    def corner(x):
        return (x >> 4) * 8 + (x & 7)
    words = philox4x32_10((corner(ki) >> 1, corner(qi), bh, offset & _M32), key)
    which = 2 * (corner(ki) & 1) + ((qi >> 3) & 1)
    word = torch.where(which == 0, words[0], torch.where(which == 1, words[1], torch.where(which == 2, words[2],
                                                                                             words[3])))
    return ((word >> (16 * ((ki >> 3) & 1))) & 0xFFFF) >= dropout_threshold(dropout_p)


def attention_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int,
                    causal: bool, mode: str = "fwd") -> float:
    """Matmul FLOPs by the standard count (the one FlashAttention's
    benchmarks use): forward 4·B·H·Nq·Nk·d, halved when causal; backward 2.5 × forward;
    "fwd_bwd" 3.5 × forward."""
    f = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim * (0.5 if causal else 1.0)
    return {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode] * f


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, upcast=True,
                         ref_dtype: torch.dtype = torch.float64, window_size: tuple[int, int] = (-1, -1),
                         sinks: torch.Tensor | None = None, softcap: float = 0.0, dropout_p: float = 0.0,
                         rng_state: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None):
    """Reference for packed sequences: ``attention_ref`` on each sequence alone.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_*: (batch + 1,)
    integer tensors (any device); sinks, softcap, dropout and alibi_slopes as ``attention_ref``'s
    (sequence b's dropout mask that of batch b; (batch, nheads) slopes: row b for sequence b). Returns out (total_q, nheads, headdim)
    in the compute dtype and lse (nheads, total_q) float32; rows outside every sequence: out 0, lse
    +inf. Differentiable.
    """
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    dtype = ref_dtype if upcast else q.dtype
    outs, lses = [], []
    covered = 0
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q0 > covered:  # rows before this sequence that no sequence covers
            outs.append(torch.zeros((q0 - covered, *q.shape[1:]), dtype=dtype, device=q.device))
            lses.append(torch.full((q.shape[1], q0 - covered), float("inf"), device=q.device))
        o, lse = attention_ref(q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0),
                               softmax_scale, causal, upcast, ref_dtype, window_size, sinks, softcap, dropout_p,
                               rng_state, b, alibi_of_sequence(alibi_slopes, b))
        outs.append(o[0])
        lses.append(lse[0])
        covered = q1
    if covered < q.shape[0]:
        outs.append(torch.zeros((q.shape[0] - covered, *q.shape[1:]), dtype=dtype, device=q.device))
        lses.append(torch.full((q.shape[1], q.shape[0] - covered), float("inf"), device=q.device))
    return torch.cat(outs, 0), torch.cat(lses, 1)


def attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None,
                          causal=False, upcast=True, ref_dtype: torch.dtype = torch.float64,
                          window_size: tuple[int, int] = (-1, -1), sinks: torch.Tensor | None = None,
                          softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None):
    """Reference for attention against a KV cache (no append: pass the cache after it).

    q: (batch, seqlen_q, nheads, headdim); k_cache / v_cache: (batch, seqlen_cache, nheads_k,
    headdim) or paged (num_blocks, page_size, nheads_k, headdim) with block_table (batch,
    max_blocks); cache_seqlens: (batch,) rows in use (None: all); sinks, softcap and alibi_slopes as
    ``attention_ref``'s ((batch, nheads) slopes: row b for sequence b).
    ``attention_ref`` of each sequence
    against its first cache_seqlens[b] rows. Returns out (q's shape, compute dtype) and lse (batch,
    nheads, seqlen_q) float32.
    """
    batch = q.shape[0]
    outs, lses = [], []
    for b in range(batch):
        if block_table is not None:
            kb = k_cache[block_table[b].long()].flatten(0, 1)
            vb = v_cache[block_table[b].long()].flatten(0, 1)
        else:
            kb, vb = k_cache[b], v_cache[b]
        n = kb.shape[0] if cache_seqlens is None else int(cache_seqlens[b])
        o, lse = attention_ref(q[b:b + 1], kb[:n].unsqueeze(0), vb[:n].unsqueeze(0), softmax_scale, causal,
                               upcast, ref_dtype, window_size, sinks, softcap,
                               alibi_slopes=alibi_of_sequence(alibi_slopes, b))
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 0), torch.cat(lses, 0)
