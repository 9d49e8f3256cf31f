"""The implementations compared, each as ``fn(q, k, v, softmax_scale, causal) -> out`` (BSHD):

    flash_attn_ext   flash_attn_ext.flash_attn_func (this library)
    sdpa-flash, sdpa-cudnn, sdpa-efficient, sdpa-math
                     torch.nn.functional.scaled_dot_product_attention on ``transpose(1, 2)`` (BHSD)
                     views under torch.nn.attention.sdpa_kernel(<backend>)
    standard         plain PyTorch attention: matmul, mask, softmax, matmul
    flash-attn, flash-attn3, flash-attn4
                     flash_attn.flash_attn_func / flash_attn_interface.flash_attn_func /
                     flash_attn.cute.flash_attn_func, CUDA only and only where importable

A failing call is a result, not a crash: ``run_guarded`` turns its exception into a status
('OOM', 'n/a' or 'error') and a note.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
from typing import Callable

import torch

OURS = "flash_attn_ext"
SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}
ALL_PEERS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "standard",
             "flash-attn", "flash-attn3", "flash-attn4")


class BenchmarkError(Exception):
    """A flag or environment problem, reported as one line without a traceback."""


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

    def fn(q, k, v, softmax_scale, causal):
        gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
        out = F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v), is_causal=causal,
                                             scale=softmax_scale, **gqa)
        return out.transpose(1, 2)

    return fn, (lambda: sdpa_kernel(backend))


_MASKS: dict = {}


def standard_attention(q, k, v, softmax_scale, causal):
    """Plain PyTorch attention in the inputs' dtype (Vaswani et al. 2017, eq. 1): materialises
    the (seqlen_q, seqlen_k) scores and probabilities; K/V heads repeated for GQA."""
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


def _load_flash_attn(name: str):
    """Returns (fn, None) or (None, reason) for the optional FlashAttention packages."""
    try:
        if name == "flash-attn":
            from flash_attn import flash_attn_func as f
        elif name == "flash-attn3":
            from flash_attn_interface import flash_attn_func as f
        else:
            from flash_attn.cute import flash_attn_func as f
    except Exception as e:  # ImportError, or a broken install raising something else
        return None, f"{name} not importable ({type(e).__name__})"
    return _keyword_call(f), None


def build_impls(peers: list[str], device: torch.device, slow_max_seqlen: int | None,
                ours: Callable | None = None) -> tuple[list[Impl], list[str]]:
    """flash_attn_ext first, then the requested peers. Returns (impls, notes about skipped ones)."""
    impls = [Impl(OURS, ours if ours is not None else _load_ours())]
    notes = []
    for name in peers:
        if name in SDPA_BACKENDS:
            fn, ctx = _make_sdpa(SDPA_BACKENDS[name])
            impls.append(Impl(name, fn, ctx, slow_max_seqlen if name == "sdpa-math" else None))
        elif name == "standard":
            impls.append(Impl(name, standard_attention))
        else:
            if device.type != "cuda":
                notes.append(f"{name} skipped: CUDA only")
                continue
            fn, why = _load_flash_attn(name)
            if fn is None:
                notes.append(f"{why}: skipped")
            else:
                impls.append(Impl(name, fn))
    return impls, notes


def classify(exc: BaseException) -> tuple[str, str]:
    """Map an exception from an implementation to (status, note)."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
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
