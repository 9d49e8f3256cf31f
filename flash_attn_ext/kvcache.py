"""Attention against a KV cache, for inference: flash_attn_with_kvcache (append, paged caches,
cache_batch_idx, rotary embedding)."""

from __future__ import annotations

import torch

from . import _fake_checks
from ._args import (_as_bool, _as_int, _check_tensors, _flash_attn_keywords, _maybe_contiguous, _scale, _sinks,
                    _window)
from .rotary import rotate_channels


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
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim) with batch_cache >= batch
            (sequence b uses entry b, or cache_batch_idx[b]; flash-attn's), or paged (num_blocks,
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
            the host), at least one split per 2^20 keys of the cache up to 128 (each of the split
            kernel's fp32 accumulators then sees at most 2^18 keys: README, Accuracy rule); 1 = no
            split; up to 128. Where the balanced splits apply (batch > 1,
            cache_seqlens given, no window left bound, softcap or ALiBi, at most one CTA per SM
            unsplit; README: FLASH_ATTN_EXT_SPLITKV_BALANCE, on by default) the split CTAs are
            shared out by the sequences' lengths on the device, and a num_splits >= 2 is their
            number per sequence (a long sequence gets more, an empty one none). Caches far from
            full may run faster with more splits than the shapes' choice.
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
        return_softmax_lse: flash-attn's keyword: True is return_lse=True (either one True
            returns softmax_lse).

    Returns:
        out: (batch, seqlen_q, nheads, headdim). softmax_lse (if return_lse): (batch, nheads,
        seqlen_q) float32, natural log (+inf for a row that sees no key, whose out row is 0; with
        sinks the head's sink there).

    Raises:
        RuntimeError naming the argument for wrong shapes, dtypes, devices, a block_table or
        cache_seqlens of the wrong dtype or shape, k without v, k / v of more rows than the
        cache holds per sequence or to append to k_cache and v_cache of one memory, a paged
        cache of more than 2^31 - 1 blocks, num_splits outside [0, 128], an input that requires
        grad, a cache longer than 2^31 - 256 rows or seqlen_q * nheads / nheads_k above 2^31 -
        256. On CPU cache_seqlens[b] + seqlen_new
        past the cache, the block numbers of the pages a sequence uses (those of its first
        cache_seqlens[b] + seqlen_new rows) outside [0, num_blocks), and rotary positions past
        rotary_cos's rows raise too; on CUDA they are not read on the host (no sync): cache rows
        past the cache are dropped from the append and the attention (any int32 cache_seqlens,
        2^31 - 1 included), and block numbers are trusted. TypeError: q / k_cache / v_cache not
        a torch.Tensor (k, v, block_table: a tensor or None), num_splits not an int,
        cache_seqlens not a tensor, an int or None, causal or return_lse that is not a bool,
        softmax_scale or softcap as flash_attn_func's, more than 19 positional arguments.
        ValueError: softcap negative or not finite. RuntimeError naming rotary_cos / rotary_sin /
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
        block_table = _cache_batch_idx_as_block_table(cache_batch_idx, block_table, q, k_cache, k)
    elif block_table is None and q.dim() == 4 and k_cache.dim() == 4 and v_cache.dim() == 4 \
            and k_cache.shape[0] == v_cache.shape[0]:  # (caches of unequal batch: the op's shape check)
        if k_cache.shape[0] < q.shape[0]:
            raise RuntimeError(f"flash_attn_ext: k_cache and v_cache have batch {k_cache.shape[0]} but q has batch "
                               f"{q.shape[0]}; expected at least batch cache entries (sequence b uses entry b), or "
                               "pass cache_batch_idx / block_table")
        if k_cache.shape[0] > q.shape[0]:
            # flash-attn's contiguous cache of more entries than sequences: sequence b uses entry b
            # (views: the append still writes in place).
            if k is not None and (k_cache.stride(0) == 0 or v_cache.stride(0) == 0):
                raise RuntimeError("flash_attn_ext: k_cache / v_cache is expanded along its batch (stride 0), so "
                                   "appending k / v to one entry would write every entry; pass caches whose "
                                   "entries own their memory")
            k_cache, v_cache = k_cache[:q.shape[0]], v_cache[:q.shape[0]]
    # The caches are written in place: they must have a contiguous last dim; q, k, v are copied.
    q, k, v = _maybe_contiguous(q, k, v)
    if rotary_cos is not None or rotary_sin is not None:
        _fake_checks.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, 0, cache_leftpad)
        q, k = _rotary_for_kvcache(q, k, rotary_cos, rotary_sin, interleaved, cache_seqlens, block_table, k_cache,
                                   causal, window)
    num_splits = _as_int("num_splits", num_splits)
    _fake_checks.check_num_splits(num_splits)
    out, softmax_lse = torch.ops.flash_attn_ext.fwd_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, causal, num_splits, *window, _sinks(sinks),
        cache_leftpad, softcap, alibi_slopes)
    return (out, softmax_lse) if want_lse else out


def _cache_batch_idx_as_block_table(cache_batch_idx, block_table, q, k_cache, k=None) -> torch.Tensor:
    """flash-attn's cache_batch_idx (sequence b reads and appends to k_cache[cache_batch_idx[b]]) as
    the paged form of the same tensor: k_cache (batch_cache, seqlen_cache, ...) is a paged cache of
    batch_cache blocks of seqlen_cache rows, and block_table = cache_batch_idx[:, None]. No copy,
    the same kernels. Needs seqlen_cache a multiple of 16 (the paged loads' page sizes). The
    indices are checked here on CPU in eager calls (traced, the CPU op's block_table check names
    them as block_table). The sizes the paged op would name in its terms (blocks, block_table) are
    checked here in the caller's: batch_cache within int32, the new keys k within seqlen_cache."""
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
    if k_cache.dim() == 4:
        _fake_checks._require(k_cache.shape[0] <= _fake_checks._INT32_MAX, RuntimeError,
                              "k_cache's batch_cache (k_cache.size(0)) must be at most 2^31 - 1 (cache_batch_idx "
                              "holds int32 entries)", lambda: f", got {k_cache.shape[0]}")
        if k is not None and k.dim() == 4:
            _fake_checks.check_seqlen_new(k.shape[1], k_cache.shape[1], "k_cache.size(1)")
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
    seqlen_cache = _fake_checks.cache_capacity(k_cache, block_table)
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
        positions = positions.clamp(max=seqlen_ro - 1)  # (batch, seqlen) -> tables (batch, seqlen, 1, rotary_dim / 2)
        return rotate_channels(x, rotary_cos[positions].unsqueeze(2), rotary_sin[positions].unsqueeze(2), interleaved)

    steps_q = torch.arange(q.shape[1], device=q.device) if q_per_token else torch.zeros(q.shape[1], dtype=torch.int64,
                                                                                         device=q.device)
    return (rotate(q, start + steps_q), rotate(k, start + torch.arange(k.shape[1], device=q.device)))
