"""Attention over variable-length sequences packed along one dimension: flash_attn_varlen_func
(its paged form with block_table included) and its qkv / kv-packed variants."""

from __future__ import annotations

import math

import torch

from . import _fake_checks
from . import ops
from ._args import (_as_bool, _as_size, _check_tensors, _cut, _dropout_args, _flash_attn_keywords, _kernel_layout,
                    _scale, _sinks, _unpack, _window, _with_attn_probs)


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
    probabilities; a host read of cu_seqlens); torch.func's grad, vjp, jvp, jacrev and jacfwd
    raise NotImplementedError (vmap works).

    Args:
        q: (total_q, nheads, headdim). k, v: (total_k, nheads_k, headdim); nheads % nheads_k == 0.
            dtype / headdim / strides as ``flash_attn_func``'s (a head dim not a multiple of 8
            padded, a last dimension of another stride copied; with block_table neither: the
            paged caches are read in place).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device, non-decreasing, from 0 to
            at most total_q / total_k (e.g. ``F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))``).
            Zero-length sequences are allowed (a sequence without keys gives out 0, LSE +inf, or
            the head's sink with sinks).
        max_seqlen_q, max_seqlen_k: Python ints >= the longest sequence of each side. Under
            torch.compile they stay symbolic (SymInt in the ops' schemas): a value that changes
            from batch to batch compiles one more graph after the first, not one per value, and
            one read from a tensor (``int(seqlens.max().item())`` with
            ``torch._dynamo.config.capture_scalar_outputs = True``; not with block_table)
            compiles with fullgraph=True, its range then checked when the graph runs (torch's
            runtime assert names the expression, not this library's message).
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
        cu_seqlens that is not int32 (batch + 1,) or whose two lengths differ, a batch past
        int32, max_seqlen outside [0, 2^31 - 256], total_q or total_k above 2^31 - 256.
        TypeError: a tensor argument that is not a torch.Tensor, max_seqlen that is not an int,
        causal or return_lse that is not a bool, softmax_scale or softcap as flash_attn_func's,
        more than 16 positional arguments. ValueError: softcap as flash_attn_func's.
        NotImplementedError: nested tensors; the flash-attn keywords as ``flash_attn_func``'s.
        With block_table: RuntimeError for k / v not paged (rank 4), a block_table that is not
        (batch, max_blocks), grad with an input that requires it, and the KV-cache call's
        checks (``flash_attn_with_kvcache``: block_table int32, page_size a multiple of 16,
        at most 2^31 - 1 blocks).
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
    args = (_as_size("max_seqlen_q", max_seqlen_q), _as_size("max_seqlen_k", max_seqlen_k),
            _scale("softmax_scale", softmax_scale, q))  # the scale from the caller's head dim
    _fake_checks.check_max_seqlens(*args[:2])
    causal, window, sinks = _as_bool("causal", causal), _window(window_size), _sinks(sinks)
    want_lse = _as_bool("return_lse", return_lse)
    if block_table is not None:
        if dropout > 0.0:
            raise NotImplementedError("flash_attn_ext: flash_attn_varlen_func with block_table (inference over a "
                                      "paged K / V) takes no dropout; pass dropout_p=0.0")
        out, softmax_lse = _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *args[:2], block_table, args[2],
                                         causal, window, sinks, softcap, alibi_slopes)
        return _with_attn_probs(out, softmax_lse, want_lse, probs)
    q, k, v, d = _kernel_layout(q, k, v)
    if dropout > 0.0:  # the op's checks before the draw: a refused call draws no random numbers
        _fake_checks.check_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, causal, *window, sinks, softcap,
                                          dropout, None, alibi_slopes, rng_drawn_after=True)
    out, softmax_lse, _ = torch.ops.flash_attn_ext.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, causal,
                                                                  *window, sinks, softcap, *_dropout_args(dropout, q),
                                                                  alibi_slopes)
    return _with_attn_probs(_cut(out, d), softmax_lse, want_lse, probs)


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
    total_q, nheads, d = q.shape
    lens_q, lens_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    # The KV-cache op's checks, before any early return, each with its own message.
    if block_table.dtype != torch.int32:
        raise RuntimeError(f"flash_attn_ext: block_table has dtype {block_table.dtype}; expected int32")
    _fake_checks.check_page_size(k_cache.shape[1], "k")
    _fake_checks.check_num_blocks(k_cache.shape[0], "k")
    # The KV-cache op this path calls takes no max_seqlen: checked here while Dynamo traces too.
    _fake_checks.check_max_seqlens(max_seqlen_q, max_seqlen_k, traced=True)
    # The values, as the CPU varlen op checks them (CUDA: no host read): in the graph under
    # torch.compile, else on the host (fake tensors outside Dynamo, e.g. make_fx: no values).
    compiling = torch.compiler.is_compiling()
    if cu_seqlens_q.device.type == "cpu" and (compiling or not torch._subclasses.fake_tensor.is_fake(cu_seqlens_q)):
        capacity = block_table.shape[1] * k_cache.shape[1]

        def sized(name, value):  # traced, the name alone: Dynamo cannot format a symbolic size
            return name if compiling else f"{name} = {value}"

        checks = [
            ((cu_seqlens_q[0] == 0) & (lens_q >= 0).all() & (cu_seqlens_q[-1] <= total_q)
             & (lens_q <= max_seqlen_q).all(),
             f"cu_seqlens_q must start at 0, not decrease, end at most at {sized('total_q', total_q)}, with "
             f"sequences of at most {sized('max_seqlen_q', max_seqlen_q)} queries"),
            ((cu_seqlens_k[0] == 0) & (lens_k >= 0).all() & (lens_k <= max_seqlen_k).all() & (lens_k <= capacity).all(),
             f"cu_seqlens_k must start at 0 and not decrease, with sequences of at most "
             f"{sized('max_seqlen_k', max_seqlen_k)} keys that fit their block_table's "
             + ("pages" if compiling else f"{block_table.shape[1]} pages of {k_cache.shape[1]} rows")),
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
    # The pages a sequence can use (at most max_seqlen_k keys): the KV-cache op sizes its split count
    # by the table's capacity (splitkv_heuristic.h: one split per 2^20 keys at least), so a table
    # sized for the longest context would split this call, and allocate for it, by that instead.
    # (floor(max_seqlen_k / page) + 1 pages: at least one, at most one past the need; no sym_max,
    # which Dynamo of torch 2.11 does not trace on SymInts.)
    block_table = block_table[:, :max_seqlen_k // k_cache.shape[1] + 1]
    out_p, lse_p = torch.ops.flash_attn_ext.fwd_kvcache(
        padded, k_cache, v_cache, None, None, cache_seqlens, block_table, scale, causal, 0, *window, sinks, None,
        softcap, alibi_slopes)
    out = torch.where(keep[:, None, None], out_p[seq, row], 0)            # (total_q, nheads, d)
    softmax_lse = torch.where(keep[None, :], lse_p[seq, :, row].t(), math.inf)  # (nheads, total_q)
    return out, softmax_lse


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
