"""The implementations compared, each as ``fn(q, k, v, softmax_scale, causal) -> out`` (BSHD):

    flash_attn_ext   flash_attn_ext.flash_attn_func (this library)
    sdpa-flash, sdpa-cudnn, sdpa-efficient, sdpa-math
                     torch.nn.functional.scaled_dot_product_attention on ``transpose(1, 2)`` (BHSD)
                     views under torch.nn.attention.sdpa_kernel(<backend>)
    standard         plain PyTorch attention: matmul, mask, softmax, matmul
    flash-attn, flash-attn3, flash-attn4
                     flash_attn.flash_attn_func / flash_attn_interface.flash_attn_func /
                     flash_attn.cute.flash_attn_func, CUDA only and only where importable

Two more families of cases have their own call shapes (``build_impls(..., family=...)``):

    decode   fn(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale) -> out, q
             (batch, 1, nheads, headdim), the cache contiguous (batch, seqlen_k, nheads_k, headdim)
             or paged (num_blocks, page_size, nheads_k, headdim) with block_table (batch,
             blocks per sequence) int32 (None when contiguous):
        flash_attn_ext   flash_attn_ext.flash_attn_with_kvcache(..., num_splits=0)
        sdpa-*, standard the dense call on the whole cache; a ragged cache (some
                         cache_seqlens[b] < seqlen_k, --decode-fill < 1) with a key mask
                         (keys past each sequence's length masked out: the same result, every
                         key read), 'n/a' where the backend has no masked kernel; contiguous
                         only, 'n/a' for a paged cache
        flash-attn, flash-attn3
                         flash_attn.flash_attn_with_kvcache (block_table) /
                         flash_attn_interface.flash_attn_with_kvcache (page_table)
        flash-attn4      flash_attn.cute.flash_attn_varlen_func(q, k_cache, v_cache,
                         seqused_k=cache_seqlens, page_table=block_table); num_splits left at its
                         default 1 (its sm90 path has no split-KV)
    varlen   fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
             causal) -> out, q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim):
        flash_attn_ext   flash_attn_ext.flash_attn_varlen_func
        flash-attn, flash-attn3, flash-attn4
                         their flash_attn_varlen_func (same keywords)
        sdpa-*, standard no varlen entry: skipped with a note
        (flash_attn_ext-dense, ``ours_dense_impl``: flash_attn_func, the CLI's comparison row,
        run on a dense Problem of as many tokens)
    A build of flash_attn_ext without flash_attn_with_kvcache / flash_attn_varlen_func gives no
    implementations for that family and a note: the CLI skips those modes.

A failing call is a result, not a crash: ``run_guarded`` turns its exception into a status
('OOM', 'n/a' or 'error') and a note.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import warnings
from typing import Callable

import torch

OURS = "flash_attn_ext"
OURS_DENSE = "flash_attn_ext-dense"  # varlen's comparison row: the dense op on as many tokens
SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}
ALL_PEERS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "standard",
             "flash-attn", "flash-attn3", "flash-attn4")


FAMILIES = ("dense", "decode", "varlen")


class BenchmarkError(Exception):
    """A flag or environment problem, reported as one line without a traceback."""


class NotApplicable(Exception):
    """An implementation without an entry for this case (e.g. SDPA and a paged cache): 'n/a'."""


@dataclasses.dataclass
class Impl:
    """One attention implementation: ``fn(q, k, v, softmax_scale, causal) -> out``, BSHD in and out.

    ``context`` is entered around every use (SDPA backend selection); ``max_seqlen`` marks a
    slow implementation as 'skipped' above that seqlen.
    """

    name: str
    fn: Callable
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    max_seqlen: int | None = None

    def skips(self, seqlen: int) -> bool:
        """True where this implementation is not run at ``seqlen`` (above ``max_seqlen``)."""
        return self.max_seqlen is not None and seqlen > self.max_seqlen


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _make_sdpa(backend_name: str):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def fn(q, k, v, softmax_scale, causal, key_mask=None):
        """``key_mask``: (batch, seqlen_k) bool, True for the keys each batch item attends to."""
        kw = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
        if key_mask is not None:
            kw["attn_mask"] = key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v), is_causal=causal,
                                             scale=softmax_scale, **kw)
        return out.transpose(1, 2)

    return fn, (lambda: sdpa_kernel(backend))


_MASKS: dict = {}


def standard_attention(q, k, v, softmax_scale, causal, key_mask=None):
    """Plain PyTorch attention in the inputs' dtype (Vaswani et al. 2017, eq. 1): materialises
    the (seqlen_q, seqlen_k) scores and probabilities; K/V heads repeated for GQA. ``key_mask``:
    (batch, seqlen_k) bool, True for the keys each batch item attends to (None: every key)."""
    qt, kt, vt = _bhsd(q), _bhsd(k), _bhsd(v)
    if q.shape[2] != k.shape[2]:
        kt = kt.repeat_interleave(q.shape[2] // k.shape[2], dim=1)
        vt = vt.repeat_interleave(q.shape[2] // k.shape[2], dim=1)
    scores = torch.matmul(qt, (kt * softmax_scale).transpose(-2, -1))
    if causal:
        key = (q.shape[1], k.shape[1], q.device)
        if key not in _MASKS:  # cached: the mask is not part of the attention cost
            _MASKS.clear()
            i = torch.arange(q.shape[1], device=q.device).unsqueeze(1)
            j = torch.arange(k.shape[1], device=q.device).unsqueeze(0)
            _MASKS[key] = j > i + (k.shape[1] - q.shape[1])
        scores = scores.masked_fill(_MASKS[key], float("-inf"))
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vt).transpose(1, 2)


def _keyword_call(f: Callable) -> Callable:
    """``fn(q, k, v, softmax_scale, causal)`` calling a flash_attn_func-style ``f`` and keeping
    only the output where it returns a tuple (out, lse, ...)."""
    def fn(q, k, v, softmax_scale, causal):
        out = f(q, k, v, softmax_scale=softmax_scale, causal=causal)
        return out[0] if isinstance(out, (tuple, list)) else out

    return fn


def _load_ours() -> Callable:
    try:
        from flash_attn_ext import flash_attn_func
    except ImportError as e:  # the compiled module is missing
        raise BenchmarkError(
            f"cannot import flash_attn_ext.flash_attn_func ({e}); build the extension first "
            "(see README: pip install --no-build-isolation -e .)") from e
    return _keyword_call(flash_attn_func)


def _first(out):
    """The output of a call that may return a tuple (out, lse, ...)."""
    return out[0] if isinstance(out, (tuple, list)) else out


_KEY_MASK: list = []  # [(cache_seqlens, seqlen_k, mask or None)]: the last one built


def decode_key_mask(cache_seqlens: torch.Tensor, seqlen_k: int) -> torch.Tensor | None:
    """(batch, seqlen_k) bool, True for the keys sequence b uses (j < cache_seqlens[b]), or None
    where every sequence uses the whole cache. Kept for the last ``cache_seqlens`` tensor (held, so
    that its identity stands for its values; the benchmark never writes one), so that a timed call
    (or a captured CUDA graph) reuses the mask its problem's first call built: the mask is not
    part of the attention cost, and building it syncs."""
    if _KEY_MASK and _KEY_MASK[0][0] is cache_seqlens and _KEY_MASK[0][1] == seqlen_k:
        return _KEY_MASK[0][2]
    mask = torch.arange(seqlen_k, device=cache_seqlens.device)[None, :] < cache_seqlens[:, None].long()
    mask = None if bool(mask.all()) else mask
    _KEY_MASK[:] = [(cache_seqlens, seqlen_k, mask)]
    return mask


def _decode_from_dense(dense_fn: Callable) -> Callable:
    """A decode ``fn`` over a dense ``fn(q, k, v, softmax_scale, causal, key_mask=None)``:
    attention of the one query row over the contiguous cache, every key where every sequence uses
    the whole cache (causal bottom-right is then no mask), else with the key mask of the used
    lengths (decode_key_mask: the same result as reading each sequence's used keys alone, though
    the dense call reads them all); 'n/a' where the backend has no kernel with a mask."""
    def fn(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale):
        if block_table is not None:
            raise NotApplicable("contiguous cache only (no paged KV entry)")
        mask = decode_key_mask(cache_seqlens, k_cache.shape[1])
        if mask is None:
            return dense_fn(q, k_cache, v_cache, softmax_scale, False)
        try:
            return dense_fn(q, k_cache, v_cache, softmax_scale, False, key_mask=mask)
        except RuntimeError as e:
            if classify(e)[0] == "n/a":
                raise NotApplicable("no kernel for this case with a key mask (ragged cache, "
                                    "--decode-fill < 1)") from e
            raise

    return fn


def _ours_decode(f: Callable) -> Callable:
    def fn(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale):
        return _first(f(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                        softmax_scale=softmax_scale, causal=False, num_splits=0))

    return fn


def _varlen_keyword_call(f: Callable) -> Callable:
    """A varlen ``fn`` over a flash_attn_varlen_func-style ``f`` (flash-attn 2/3/4 and ours)."""
    def fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        return _first(f(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                        softmax_scale=softmax_scale, causal=causal))

    return fn


def _fa_decode(name: str, f: Callable) -> Callable:
    """A decode ``fn`` over FlashAttention's KV-cache entry: flash-attn 2 names the page table
    ``block_table``, flash-attn 3 ``page_table``; FA4 has only flash_attn_varlen_func, with the
    used lengths as ``seqused_k``."""
    def fn(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale):
        if name == "flash-attn4":
            out = f(q, k_cache, v_cache, seqused_k=cache_seqlens, page_table=block_table,
                    softmax_scale=softmax_scale, causal=False)
        else:
            table = {"block_table" if name == "flash-attn" else "page_table": block_table}
            out = f(q, k_cache, v_cache, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale,
                    causal=False, **table)
        return _first(out)

    return fn


_FA_ENTRIES = {  # family -> peer -> (module, function)
    "dense": {"flash-attn": ("flash_attn", "flash_attn_func"),
              "flash-attn3": ("flash_attn_interface", "flash_attn_func"),
              "flash-attn4": ("flash_attn.cute", "flash_attn_func")},
    "decode": {"flash-attn": ("flash_attn", "flash_attn_with_kvcache"),
               "flash-attn3": ("flash_attn_interface", "flash_attn_with_kvcache"),
               "flash-attn4": ("flash_attn.cute", "flash_attn_varlen_func")},
    "varlen": {"flash-attn": ("flash_attn", "flash_attn_varlen_func"),
               "flash-attn3": ("flash_attn_interface", "flash_attn_varlen_func"),
               "flash-attn4": ("flash_attn.cute", "flash_attn_varlen_func")},
}


def flash_attn_module_function(name: str, family: str = "dense") -> Callable | None:
    """The raw function of a FlashAttention package (``name``: flash-attn, flash-attn3 or
    flash-attn4; ``family``: dense, decode or varlen), or None where it is not importable: for the
    diagnostic scripts that call a peer with keywords of their own (scripts/window_bench.py,
    scripts/softcap_bench.py)."""
    module, attr = _FA_ENTRIES[family][name]
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception:  # ImportError, or a broken install raising something else
        return None


def _load_flash_attn(name: str, family: str = "dense"):
    """Returns (fn, None) or (None, reason) for the optional FlashAttention packages."""
    module, attr = _FA_ENTRIES[family][name]
    try:
        f = getattr(importlib.import_module(module), attr)
    except Exception as e:  # ImportError, or a broken install raising something else
        return None, f"{name} not importable ({type(e).__name__})"
    if family == "decode":
        return _fa_decode(name, f), None
    if family == "varlen":
        return _varlen_keyword_call(f), None
    return _keyword_call(f), None


def ours_entry(name: str) -> Callable | None:
    """flash_attn_ext.<name> (e.g. flash_attn_with_kvcache), or None where this build predates it."""
    try:
        import flash_attn_ext
    except ImportError as e:  # the compiled module is missing
        raise BenchmarkError(f"cannot import flash_attn_ext ({e}); build the extension first "
                             "(see README: pip install --no-build-isolation -e .)") from e
    f = getattr(flash_attn_ext, name, None)
    if f is None:
        try:
            from flash_attn_ext import interface
            f = getattr(interface, name, None)
        except ImportError:
            f = None
    return f


def ours_dense_impl(ours: Callable | None = None) -> Impl:
    """Varlen's comparison row: flash_attn_ext.flash_attn_func (or ``ours``), as OURS_DENSE."""
    return Impl(OURS_DENSE, ours if ours is not None else _load_ours())


OURS_ENTRY = {"decode": "flash_attn_with_kvcache", "varlen": "flash_attn_varlen_func"}
OURS_WRAP = {"decode": _ours_decode, "varlen": _varlen_keyword_call}


def build_impls(peers: list[str], device: torch.device, slow_max_seqlen: int | None,
                ours: Callable | None = None, family: str = "dense") -> tuple[list[Impl], list[str]]:
    """flash_attn_ext first, then the requested peers, with the call shape of ``family`` (see
    the module docstring; ``ours`` replaces flash_attn_ext's function, already in that shape).
    Returns (impls, notes about skipped ones); for decode / varlen, no impls at all where this
    build of flash_attn_ext lacks the entry."""
    notes = []
    if ours is None and family == "dense":
        ours = _load_ours()
    elif ours is None:
        f = ours_entry(OURS_ENTRY[family])
        if f is None:
            return [], [f"{family} modes skipped: flash_attn_ext.{OURS_ENTRY[family]} is not in "
                        f"this build (rebuild flash_attn_ext from a tree that has it)"]
        ours = OURS_WRAP[family](f)
    impls = [Impl(OURS, ours)]
    no_varlen = [n for n in peers if family == "varlen" and (n in SDPA_BACKENDS or n == "standard")]
    if no_varlen:
        notes.append(f"{', '.join(no_varlen)} skipped for varlen: no varlen entry")
    for name in peers:
        if name in no_varlen:
            continue
        if name in SDPA_BACKENDS or name == "standard":
            if name == "standard":
                fn, ctx = standard_attention, contextlib.nullcontext
            else:
                fn, ctx = _make_sdpa(SDPA_BACKENDS[name])
            if family == "decode":
                fn = _decode_from_dense(fn)
            impls.append(Impl(name, fn, ctx, slow_max_seqlen if name == "sdpa-math" else None))
        else:
            if device.type != "cuda":
                notes.append(f"{name} skipped: CUDA only")
                continue
            fn, why = _load_flash_attn(name, family)
            if fn is None:
                notes.append(f"{why}: skipped")
            else:
                impls.append(Impl(name, fn))
    return impls, notes


def classify(exc: BaseException) -> tuple[str, str]:
    """Map an exception from an implementation to (status, note)."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, NotApplicable):
        return "n/a", msg[:160]
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in msg.lower() \
            or "can't allocate memory" in msg.lower():
        return "OOM", msg[:160]
    if "no available kernel" in str(exc).lower() or "no viable backend" in str(exc).lower():
        return "n/a", "no kernel for this case"
    return "error", f"{type(exc).__name__}: {msg[:160]}"


def free_memory(device: torch.device, collect: bool = False) -> None:
    """Return cached CUDA memory; ``collect`` also breaks reference cycles (a caught exception's
    traceback keeps the failed call's tensors alive), which takes a fraction of a second."""
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_guarded(impl: Impl, device: torch.device, body: Callable[[], None]) -> tuple[str, str] | None:
    """``body()`` under ``impl.context()`` with warnings silenced. Returns None, or the
    (status, note) of the exception it raised; after one, frees memory (collecting after OOM)."""
    failure = None
    try:
        with warnings.catch_warnings(), impl.context():
            warnings.simplefilter("ignore")
            body()
    except Exception as e:  # an implementation failing is a result, not a crash
        failure = classify(e)
    if failure is not None:  # outside the except block: the traceback is released by now
        free_memory(device, collect=failure[0] == "OOM")
    return failure
