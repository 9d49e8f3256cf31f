"""Benchmark CLI: flash_attn_ext against SDPA's backends, standard attention and FlashAttention.

    python -m flash_attn_ext.benchmark                  # CPU: small sizes; CUDA: the ANCHORS sweep
    python -m flash_attn_ext.benchmark --quick          # a shorter sweep
    python -m flash_attn_ext.benchmark --help           # every flag

Each case is (dtype, headdim, causal, seqlen, GQA ratio, mode) with mode one of ``fwd``, ``bwd``
(the backward pass alone, given a saved forward graph) or ``fwd_bwd``. Inputs are BSHD
``(batch, seqlen, nheads, headdim)`` random normal tensors; batch = tokens // seqlen (16k tokens
by default) and nheads = 2048 // headdim on CUDA, as in the team's anchor measurements (README, Benchmark).
SDPA peers get ``transpose(1, 2)`` views (BHSD) of the same tensors.

Implementations compared in one run:
    flash_attn_ext   flash_attn_ext.flash_attn_func (this library)
    sdpa-flash, sdpa-cudnn, sdpa-efficient, sdpa-math
                     torch.nn.functional.scaled_dot_product_attention under
                     torch.nn.attention.sdpa_kernel(<backend>); 'n/a' where the backend has no kernel
    standard         plain PyTorch attention: matmul, mask, softmax, matmul; 'OOM' where it does not fit
    flash-attn, flash-attn3, flash-attn4
                     flash_attn.flash_attn_func / flash_attn_interface.flash_attn_func /
                     flash_attn.cute.flash_attn_func, only where importable (skipped with a note otherwise)

Reported per case and implementation:
    ms        median wall time of one call. CUDA: ``triton.testing.do_bench(return_mode="median")``,
              which flushes L2 before each timed call, or (without triton) CUDA events around each
              call after a warm-up with the same L2 flush. CPU: ``time.perf_counter`` median.
              When one input set is smaller than 4x the L2 cache, several input sets are rotated
              so that a short problem is not read from L2.
    TFLOP/s   matmul FLOPs by the standard count (flash_attn_ext.reference.attention_flops):
              forward 4*B*H*N^2*d, halved when causal; bwd 2.5x, fwd_bwd 3.5x the forward.
    ours/<peer>  flash_attn_ext TFLOP/s divided by the peer's TFLOP/s (> 1: flash_attn_ext is faster).
    peak_mem_mib memory allocated at the peak minus what was allocated before, around one
              forward (mode fwd) or forward + backward (modes bwd, fwd_bwd) call: CUDA from
              torch.cuda.max_memory_allocated, CPU from the torch profiler's allocation events.
    err_out, err_grad  max |x - ref| of the output / of dq, dk, dv (the largest of the three)
              against attention_ref in float64, measured on a reduced problem of the same seqlen
              (batch 1, --err-kv-heads KV heads) and computed one KV-head group at a time.
              ``standard`` is the "torch same-dtype math" baseline of the accuracy criterion.

Outputs under --out (default bench_out/): results.csv / results.json (one row per case and
implementation, with status 'ok', 'n/a', 'OOM', 'skipped' or 'error' and a note), summary.csv and
summary.md (one row per case), tflops.png (TFLOP/s vs seqlen per config, every implementation)
and memory.png (peak extra memory vs seqlen, against standard attention). The compact table is
the last thing printed on stdout; the progress bar goes to stderr.

Requires the ``bench`` extra (pandas, matplotlib, tqdm): ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import inspect
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from typing import Callable

import torch

from flash_attn_ext.reference import attention_flops, attention_ref

OURS = "flash_attn_ext"
MODES = ("fwd", "bwd", "fwd_bwd")
DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
    "fp64": torch.float64, "float64": torch.float64,
}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}
ALL_PEERS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "standard",
             "flash-attn", "flash-attn3", "flash-attn4")
DEFAULT_L2_BYTES = 60 * 1024 * 1024  # H200; used when the device does not report its L2 size
MAX_INPUT_SETS = 8


class BenchmarkError(Exception):
    """A flag or environment problem, reported as one line without a traceback."""


# ----------------------------------------------------------------------------------------------
# Implementations
# ----------------------------------------------------------------------------------------------

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


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _load_ours() -> Callable:
    try:
        from flash_attn_ext import flash_attn_func
    except ImportError as e:  # the compiled module is missing
        raise BenchmarkError(
            f"cannot import flash_attn_ext.flash_attn_func ({e}); build the extension first "
            "(see README: pip install --no-build-isolation -e .)") from e

    def fn(q, k, v, softmax_scale, causal):
        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)

    return fn


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

    def fn(q, k, v, softmax_scale, causal):
        return _first(f(q, k, v, softmax_scale=softmax_scale, causal=causal))

    return fn, None


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


# ----------------------------------------------------------------------------------------------
# Timing and memory
# ----------------------------------------------------------------------------------------------

def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Median milliseconds of ``fn()``; see the module docstring for the method per device."""

    def __init__(self, device: torch.device, warmup_ms: float, rep_ms: float, min_reps: int = 3):
        self.device, self.warmup_ms, self.rep_ms, self.min_reps = device, warmup_ms, rep_ms, min_reps
        self.do_bench = None
        if device.type == "cuda":
            try:
                from triton.testing import do_bench
                self.do_bench = do_bench
                params = inspect.signature(do_bench).parameters
                # return_mode="median" where this triton has it, else the 0.5 quantile
                self.median_kw = {"return_mode": "median"} if "return_mode" in params \
                    else {"quantiles": [0.5]}
            except Exception:
                self.do_bench = None
        if device.type == "cpu":
            self.method = "time.perf_counter median"
        elif self.do_bench is not None:
            self.method = "triton.testing.do_bench median (L2 flushed before each call)"
        else:
            self.method = "CUDA events median (L2 flushed before each call)"

    def __call__(self, fn: Callable) -> float:
        if self.device.type == "cpu":
            return self._cpu(fn)
        if self.do_bench is not None:
            ms = self.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, **self.median_kw)
            return float(ms[0] if isinstance(ms, (list, tuple)) else ms)
        return self._cuda_events(fn)

    def _cpu(self, fn):
        t0 = time.perf_counter()
        fn()  # warm-up, also the estimate
        est = max(time.perf_counter() - t0, 1e-6) * 1e3
        reps = max(self.min_reps, min(1000, int(self.rep_ms / est)))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def _cuda_events(self, fn):
        flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=self.device)
        fn()
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        torch.cuda.synchronize(self.device)
        est = max(start.elapsed_time(end) / 3, 1e-3)
        for _ in range(max(1, int(self.warmup_ms / est))):
            fn()
        reps = max(self.min_reps, int(self.rep_ms / est))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        for s, e in events:
            flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in events)


def _classify(exc: BaseException) -> tuple[str, str]:
    """Map an exception from an implementation to (status, note)."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in msg.lower() \
            or "can't allocate memory" in msg.lower():
        return "OOM", msg[:160]
    if "no available kernel" in str(exc).lower() or "no viable backend" in str(exc).lower():
        return "n/a", "no kernel for this case"
    return "error", f"{type(exc).__name__}: {msg[:160]}"


def _free(device: torch.device, collect: bool = False) -> None:
    """Return cached CUDA memory; ``collect`` also breaks reference cycles (a caught exception's
    traceback keeps the failed call's tensors alive), which takes a fraction of a second."""
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclasses.dataclass
class Problem:
    """One case's inputs: ``sets`` of (q, k, v, dout) BSHD tensors, rotated between calls."""

    batch: int
    seqlen: int
    nheads: int
    nheads_k: int
    headdim: int
    causal: bool
    dtype: torch.dtype
    device: torch.device
    softmax_scale: float
    sets: list

    @classmethod
    def make(cls, batch, seqlen, nheads, nheads_k, headdim, causal, dtype, device, n_sets=1, seed=0):
        g = torch.Generator(device=device).manual_seed(seed)
        sets = []
        for _ in range(n_sets):
            q = torch.randn(batch, seqlen, nheads, headdim, dtype=dtype, device=device, generator=g)
            k = torch.randn(batch, seqlen, nheads_k, headdim, dtype=dtype, device=device, generator=g)
            v = torch.randn(batch, seqlen, nheads_k, headdim, dtype=dtype, device=device, generator=g)
            dout = torch.randn_like(q)
            sets.append((q, k, v, dout))
        return cls(batch, seqlen, nheads, nheads_k, headdim, causal, dtype, device,
                   1.0 / math.sqrt(headdim), sets)


def input_sets_needed(batch, seqlen, nheads, nheads_k, headdim, dtype, l2_bytes) -> int:
    """Input sets to rotate so that the sets together exceed 4x L2 (q, k, v, out, dout)."""
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = batch * seqlen * (3 * nheads + 2 * nheads_k) * headdim * elem
    if nbytes >= 4 * l2_bytes:
        return 1
    return min(MAX_INPUT_SETS, math.ceil(4 * l2_bytes / max(nbytes, 1)))


def _leaves(s):
    q, k, v, dout = s
    return (q.detach().requires_grad_(), k.detach().requires_grad_(),
            v.detach().requires_grad_(), dout)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (the profiler's C++ start/stop log lines)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _cpu_peak_bytes(fn: Callable) -> float:
    """Peak of the running sum of CPU allocations minus frees during ``fn()``, from the torch
    profiler's memory events; NaN if this torch's profiler does not expose them."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
    except AttributeError:
        return float("nan")
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return float(peak)


def peak_extra_memory_mib(impl: Impl, p: Problem, mode: str) -> float:
    """Peak memory above what was allocated before one forward (mode fwd) or forward+backward
    call, in MiB. CUDA: torch.cuda.max_memory_allocated; CPU: the profiler's allocation events."""
    q, k, v, dout = _leaves(p.sets[0]) if mode != "fwd" else p.sets[0]

    def one_call():
        out = impl.fn(q, k, v, p.softmax_scale, p.causal)
        if mode != "fwd":
            torch.autograd.grad(out, (q, k, v), dout)

    if p.device.type != "cuda":
        return _cpu_peak_bytes(one_call) / 2**20
    _synchronize(p.device)
    torch.cuda.reset_peak_memory_stats(p.device)
    base = torch.cuda.memory_allocated(p.device)
    one_call()
    _synchronize(p.device)
    return (torch.cuda.max_memory_allocated(p.device) - base) / 2**20


def time_impl(impl: Impl, p: Problem, mode: str, timer: Timer) -> float:
    """Median ms of one call of ``mode``, rotating over the problem's input sets."""
    n = len(p.sets)
    state = {"i": 0}

    def next_index():
        i = state["i"] % n
        state["i"] += 1
        return i

    scale, causal = p.softmax_scale, p.causal
    if mode == "fwd":
        def call():
            q, k, v, _ = p.sets[next_index()]
            return impl.fn(q, k, v, scale, causal)
    elif mode == "bwd":
        leaves = [_leaves(s) for s in p.sets]
        outs = [impl.fn(q, k, v, scale, causal) for q, k, v, _ in leaves]

        def call():
            i = next_index()
            q, k, v, dout = leaves[i]
            return torch.autograd.grad(outs[i], (q, k, v), dout, retain_graph=True)
    else:
        leaves = [_leaves(s) for s in p.sets]

        def call():
            q, k, v, dout = leaves[next_index()]
            return torch.autograd.grad(impl.fn(q, k, v, scale, causal), (q, k, v), dout)

    return timer(call)


def measure(impl: Impl, p: Problem, mode: str, timer: Timer) -> dict:
    """Time and peak memory of one implementation on one case. Never raises for a failing
    implementation: returns status 'n/a' / 'OOM' / 'error' / 'skipped' with a note instead."""
    row = {"status": "ok", "note": "", "ms": float("nan"), "tflops": float("nan"),
           "peak_mem_mib": float("nan")}
    if impl.max_seqlen is not None and p.seqlen > impl.max_seqlen:
        row.update(status="skipped", note=f"seqlen > {impl.max_seqlen} (--slow-max-seqlen)")
        return row
    failure = None
    try:
        with warnings.catch_warnings(), impl.context():
            warnings.simplefilter("ignore")
            row["peak_mem_mib"] = peak_extra_memory_mib(impl, p, mode)
            row["ms"] = time_impl(impl, p, mode, timer)
    except Exception as e:  # an implementation failing is a result, not a crash
        failure = _classify(e)
    if failure is not None:
        row.update(status=failure[0], note=failure[1], ms=float("nan"), peak_mem_mib=float("nan"))
        _free(p.device, collect=failure[0] == "OOM")
    if row["status"] == "ok":
        flops = attention_flops(p.batch, p.nheads, p.seqlen, p.seqlen, p.headdim, p.causal, mode)
        row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
    return row


# ----------------------------------------------------------------------------------------------
# Accuracy
# ----------------------------------------------------------------------------------------------

def reference_chunked(p: Problem, need_grad: bool):
    """attention_ref in float64 on the problem's first input set, one KV head (and the query
    heads that share it) at a time, so that the score matrix of a long sequence fits.
    Returns (out, (dq, dk, dv) or None) as float64 BSHD tensors."""
    q, k, v, dout = p.sets[0]
    ratio = p.nheads // p.nheads_k
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    grads = tuple(torch.empty(t.shape, dtype=torch.float64, device=q.device) for t in (q, k, v)) \
        if need_grad else None
    for j in range(p.nheads_k):
        hq = slice(j * ratio, (j + 1) * ratio)
        qh = q[:, :, hq].double().requires_grad_(need_grad)
        kh = k[:, :, j:j + 1].double().requires_grad_(need_grad)
        vh = v[:, :, j:j + 1].double().requires_grad_(need_grad)
        with torch.set_grad_enabled(need_grad):
            oh, _ = attention_ref(qh, kh, vh, p.softmax_scale, p.causal, upcast=True)
        out[:, :, hq] = oh.detach()
        if need_grad:
            dq, dk, dv = torch.autograd.grad(oh, (qh, kh, vh), dout[:, :, hq].double())
            grads[0][:, :, hq], grads[1][:, :, j:j + 1], grads[2][:, :, j:j + 1] = dq, dk, dv
        del qh, kh, vh, oh
    return out, grads


def _maxdiff(a: torch.Tensor, ref: torch.Tensor) -> float:
    d = (a.double() - ref)
    if torch.isnan(d).any():
        return float("nan")
    return d.abs().max().item()


def measure_errors(impls: list[Impl], p: Problem, need_grad: bool, ref_max_seqlen: int) -> dict:
    """{impl name: {"err_out", "err_grad", "err_note"}} on the (reduced) problem ``p``."""
    nan = float("nan")
    result = {i.name: {"err_out": nan, "err_grad": nan, "err_note": ""} for i in impls}
    if p.seqlen > ref_max_seqlen:
        for r in result.values():
            r["err_note"] = f"reference skipped: seqlen > {ref_max_seqlen} (--ref-max-seqlen)"
        return result
    try:
        ref_out, ref_grads = reference_chunked(p, need_grad)
    except Exception as e:
        status, note = _classify(e)
        for r in result.values():
            r["err_note"] = f"reference {status}: {note}"
        _free(p.device, collect=True)
        return result
    for impl in impls:
        r = result[impl.name]
        if impl.max_seqlen is not None and p.seqlen > impl.max_seqlen:
            r["err_note"] = "skipped"
            continue
        failure = None
        try:
            with warnings.catch_warnings(), impl.context():
                warnings.simplefilter("ignore")
                q, k, v, dout = _leaves(p.sets[0]) if need_grad else p.sets[0]
                out = impl.fn(q, k, v, p.softmax_scale, p.causal)
                r["err_out"] = _maxdiff(out, ref_out)
                if need_grad:
                    grads = torch.autograd.grad(out, (q, k, v), dout)
                    r["err_grad"] = max(_maxdiff(g, gr) for g, gr in zip(grads, ref_grads))
                    del grads
                del out
        except Exception as e:
            failure = _classify(e)
        if failure is not None:
            r.update(err_out=nan, err_grad=nan, err_note=f"{failure[0]}: {failure[1]}")
            _free(p.device, collect=failure[0] == "OOM")
    del ref_out, ref_grads
    _free(p.device)
    return result


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------

def _int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchmarkError(f"{flag}: expected a comma-separated list of integers, got {text!r}")
    if not values or any(x <= 0 for x in values):
        raise BenchmarkError(f"{flag}: expected positive integers, got {text!r}")
    return values


def _choice_list(flag: str, text: str, choices) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in values if x not in choices]
    if not values or bad:
        raise BenchmarkError(f"{flag}: expected a comma-separated list from {sorted(set(choices))}, "
                             f"got {text!r}")
    return values


def _causal_list(text: str) -> list[bool]:
    table = {"both": [False, True], "true": [True], "1": [True], "false": [False], "0": [False]}
    out = []
    for x in text.lower().split(","):
        if x.strip() not in table:
            raise BenchmarkError(f"--causal: expected both, true, false (or 1, 0), got {text!r}")
        out += [c for c in table[x.strip()] if c not in out]
    return out


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m flash_attn_ext.benchmark",
        description="Benchmark flash_attn_ext against SDPA backends, standard attention and "
                    "FlashAttention (if installed). Defaults depend on the device: on CUDA the "
                    "anchor sweep (bf16, hdim 64,128, causal both, seqlen 512..16384, 16k tokens, "
                    "nheads 2048/hdim, fwd and bwd); on CPU small sizes (fp32, hdim 64, seqlen "
                    "128..512, batch 2, 4 heads).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    ap.add_argument("--dtype", default=None, help="comma list of bf16, fp16, fp32, fp64 "
                    "[cuda: bf16; cpu: fp32]")
    ap.add_argument("--hdim", default=None, help="comma list of head dims [cuda: 64,128; cpu: 64]")
    ap.add_argument("--causal", default="both", help="both, true or false")
    ap.add_argument("--seqlen", default=None,
                    help="comma list [cuda: 512,1024,2048,4096,8192,16384; cpu: 128,256,512]")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per batch: batch = max(1, tokens // seqlen) [cuda: 16384]")
    ap.add_argument("--batch", type=int, default=None,
                    help="fixed batch size, overrides --tokens [cpu: 2]")
    ap.add_argument("--nheads", type=int, default=None,
                    help="query heads [cuda: 2048 // hdim; cpu: 4]")
    ap.add_argument("--gqa", default="1", help="comma list of GQA ratios nheads / nheads_k")
    ap.add_argument("--mode", default="fwd,bwd", help="comma list of fwd, bwd, fwd_bwd")
    ap.add_argument("--peers", default=",".join(ALL_PEERS),
                    help="comma list of peers to compare against (or 'none')")
    ap.add_argument("--out", default="bench_out", help="output directory")
    ap.add_argument("--quick", action="store_true",
                    help="short sweep (cuda: hdim 128, seqlen 1024,4096; cpu: seqlen 128,256) "
                         "with shorter timing")
    ap.add_argument("--warmup-ms", type=float, default=None, help="warm-up time per measurement "
                    "[25; --quick 10]")
    ap.add_argument("--rep-ms", type=float, default=None, help="time spent in timed repetitions "
                    "per measurement [cuda: 100, cpu: 60; --quick 30]")
    ap.add_argument("--slow-max-seqlen", type=int, default=4096,
                    help="sdpa-math is skipped above this seqlen (it takes seconds per call)")
    ap.add_argument("--ref-max-seqlen", type=int, default=16384,
                    help="errors vs the float64 reference are computed up to this seqlen")
    ap.add_argument("--err-kv-heads", type=int, default=2,
                    help="KV heads of the reduced (batch 1) problem the errors are measured on")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU: torch.set_num_threads (fewer threads than busy cores gives steadier "
                         "times on a shared machine) [torch's default]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--no-plots", action="store_true", help="do not write the PNG plots")
    return ap


@dataclasses.dataclass
class Sweep:
    device: torch.device
    dtypes: list
    hdims: list
    causals: list
    seqlens: list
    gqas: list
    modes: list
    peers: list
    tokens: int | None
    batch: int | None
    nheads: int | None


def resolve_args(args: argparse.Namespace) -> Sweep:
    """Fill device-dependent defaults and check every flag (BenchmarkError names the flag)."""
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise BenchmarkError(f"--device: expected auto, cpu, cuda or cuda:N, got {args.device!r}")
        if device.type not in ("cpu", "cuda"):
            raise BenchmarkError(f"--device: expected auto, cpu, cuda or cuda:N, got {args.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BenchmarkError("--device cuda: no CUDA device is available")
    cuda = device.type == "cuda"
    dtypes = [DTYPES[x] for x in _choice_list("--dtype", args.dtype or ("bf16" if cuda else "fp32"), DTYPES)]
    if cuda and any(d in (torch.float32, torch.float64) for d in dtypes):
        raise BenchmarkError("--dtype: flash_attn_ext on CUDA supports bf16 and fp16 only")
    if args.quick:
        hdims_default, seqlens_default = ("128", "1024,4096") if cuda else ("64", "128,256")
    else:
        hdims_default, seqlens_default = ("64,128", "512,1024,2048,4096,8192,16384") if cuda \
            else ("64", "128,256,512")
    hdims = _int_list("--hdim", args.hdim or hdims_default)
    bad = [h for h in hdims if h % 8 or h > 256]
    if bad:
        raise BenchmarkError(f"--hdim: expected multiples of 8 up to 256, got {bad}")
    seqlens = _int_list("--seqlen", args.seqlen or seqlens_default)
    gqas = _int_list("--gqa", args.gqa)
    modes = _choice_list("--mode", args.mode, MODES)
    peers = [] if args.peers.strip().lower() == "none" else _choice_list("--peers", args.peers, ALL_PEERS)
    tokens, batch = args.tokens, args.batch
    if tokens is not None and tokens <= 0:
        raise BenchmarkError(f"--tokens: expected a positive integer, got {tokens}")
    if batch is not None and batch <= 0:
        raise BenchmarkError(f"--batch: expected a positive integer, got {batch}")
    if tokens is None and batch is None:
        tokens, batch = (16384, None) if cuda else (None, 2)
    nheads = args.nheads
    if nheads is not None and nheads <= 0:
        raise BenchmarkError(f"--nheads: expected a positive integer, got {nheads}")
    if nheads is None and not cuda:
        nheads = 4
    for h in hdims:
        nh = nheads if nheads is not None else max(1, 2048 // h)
        for r in gqas:
            if nh % r:
                raise BenchmarkError(f"--gqa: ratio {r} does not divide nheads={nh} (hdim {h})")
    for flag in ("warmup_ms", "rep_ms"):
        v = getattr(args, flag)
        if v is not None and v <= 0:
            raise BenchmarkError(f"--{flag.replace('_', '-')}: expected a positive number, got {v}")
    if args.threads is not None and args.threads <= 0:
        raise BenchmarkError(f"--threads: expected a positive integer, got {args.threads}")
    if args.err_kv_heads <= 0:
        raise BenchmarkError(f"--err-kv-heads: expected a positive integer, got {args.err_kv_heads}")
    return Sweep(device, dtypes, hdims, _causal_list(args.causal), seqlens, gqas, modes, peers,
                 tokens, batch, nheads)


def _require_bench_deps():
    missing = []
    for mod in ("pandas", "matplotlib", "tqdm"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise BenchmarkError(
            f"the benchmark needs {', '.join(missing)}: pip install 'flash_attn_ext[bench]' "
            f"(or pip install pandas matplotlib tqdm)")


def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def run_sweep(sweep: Sweep, args, impls: list[Impl], timer: Timer, progress) -> list[dict]:
    """Every (dtype, hdim, causal, gqa, seqlen, mode) case x implementation: one row each."""
    rows = []
    l2 = _l2_bytes(sweep.device)
    need_grad = any(m != "fwd" for m in sweep.modes)
    for dtype in sweep.dtypes:
        for hdim in sweep.hdims:
            nheads = sweep.nheads if sweep.nheads is not None else max(1, 2048 // hdim)
            for causal in sweep.causals:
                for gqa in sweep.gqas:
                    nheads_k = nheads // gqa
                    for seqlen in sweep.seqlens:
                        batch = sweep.batch if sweep.batch is not None else max(1, sweep.tokens // seqlen)
                        case = dict(dtype=DTYPE_NAMES[dtype], hdim=hdim, causal=causal, seqlen=seqlen,
                                    batch=batch, nheads=nheads, nheads_k=nheads_k, gqa=gqa)
                        progress.set_postfix_str(
                            f"{case['dtype']} d={hdim} causal={causal} gqa={gqa} N={seqlen}: errors")
                        err_kv = min(nheads_k, args.err_kv_heads)
                        small = Problem.make(1, seqlen, err_kv * gqa, err_kv, hdim, causal, dtype,
                                             sweep.device, seed=args.seed + 1)
                        errors = measure_errors(impls, small, need_grad, args.ref_max_seqlen)
                        del small
                        n_sets = input_sets_needed(batch, seqlen, nheads, nheads_k, hdim, dtype, l2) \
                            if sweep.device.type == "cuda" else 1
                        try:
                            p = Problem.make(batch, seqlen, nheads, nheads_k, hdim, causal, dtype,
                                             sweep.device, n_sets=n_sets, seed=args.seed)
                            p_status = None
                        except Exception as e:  # the inputs themselves do not fit
                            p, p_status = None, _classify(e)
                            _free(sweep.device, collect=True)
                        for mode in sweep.modes:
                            for impl in impls:
                                progress.set_postfix_str(
                                    f"{case['dtype']} d={hdim} causal={causal} gqa={gqa} N={seqlen} "
                                    f"{mode} {impl.name}")
                                if p is None:
                                    m = {"status": p_status[0], "note": "inputs: " + p_status[1],
                                         "ms": float("nan"), "tflops": float("nan"),
                                         "peak_mem_mib": float("nan")}
                                else:
                                    m = measure(impl, p, mode, timer)
                                e = errors[impl.name]
                                err = e["err_out"] if mode == "fwd" else e["err_grad"]
                                rows.append({**case, "mode": mode, "impl": impl.name, **m,
                                             "n_input_sets": n_sets, "err_out": e["err_out"],
                                             "err_grad": e["err_grad"], "err": err,
                                             "err_note": e["err_note"]})
                                progress.update(1)
                        del p
                        _free(sweep.device)
    return rows


CASE_KEYS = ["dtype", "hdim", "causal", "gqa", "seqlen", "batch", "nheads", "nheads_k", "mode"]


def add_ratios(df):
    """Column ``ours_over_peer`` = flash_attn_ext TFLOP/s / this row's TFLOP/s (same case)."""
    ours = df[df["impl"] == OURS].set_index(CASE_KEYS)["tflops"]
    keyed = df.set_index(CASE_KEYS)
    df = df.copy()
    df["ours_over_peer"] = (ours.reindex(keyed.index).to_numpy() / keyed["tflops"].to_numpy())
    return df


def summarize(df, impl_names: list[str]):
    """One row per case: TFLOP/s per implementation (or its status), ours/peer ratios, errors."""
    import pandas as pd

    cell = df["tflops"].map(lambda x: f"{x:.3g}" if x == x else "")
    cell = cell.where(df["status"] == "ok", df["status"])
    wide = df.assign(cell=cell).pivot_table(index=CASE_KEYS, columns="impl", values="cell",
                                            aggfunc="first", sort=False)
    num = df.pivot_table(index=CASE_KEYS, columns="impl", values="tflops", aggfunc="first",
                         sort=False, dropna=False)
    errs = df.pivot_table(index=CASE_KEYS, columns="impl", values="err", aggfunc="first",
                          sort=False, dropna=False)
    out = pd.DataFrame(index=wide.index)
    for name in impl_names:
        out[f"{name} TFLOP/s"] = num[name] if name in num else float("nan")
    for name in impl_names[1:]:
        out[f"ours/{name}"] = num[OURS] / num[name] if name in num else float("nan")
    for name in impl_names:
        out[f"err {name}"] = errs[name] if name in errs else float("nan")
    return out.reset_index(), wide.reset_index()


def compact_table(df, impl_names: list[str], ratio_peers: list[str]):
    """The stdout table: case, TFLOP/s of each implementation that ran somewhere, ours/peer ratios
    for up to two peers, and the max error of flash_attn_ext and of standard attention."""
    import pandas as pd

    shown = [n for n in impl_names if (df[(df["impl"] == n)]["status"] != "n/a").any()]
    _, wide = summarize(df, impl_names)
    index = wide.set_index(CASE_KEYS).index
    num = df.pivot_table(index=CASE_KEYS, columns="impl", values="tflops", aggfunc="first",
                         sort=False, dropna=False).reindex(index)
    errs = df.pivot_table(index=CASE_KEYS, columns="impl", values="err", aggfunc="first",
                          sort=False, dropna=False).reindex(index)
    ratio_peers = [r for r in ratio_peers if r in shown and r != OURS and num[r].notna().any()]
    if not ratio_peers:
        ratio_peers = [n for n in shown if n != OURS and num[n].notna().any()][:2]
    t = pd.DataFrame({"dtype": wide["dtype"], "hdim": wide["hdim"],
                      "causal": wide["causal"].map(lambda c: "yes" if c else "no"),
                      "N": wide["seqlen"], "mode": wide["mode"]})
    if (wide["gqa"] != 1).any():
        t.insert(3, "gqa", wide["gqa"])
    t.insert(len(t.columns), "batch", wide["batch"])
    for n in shown:
        t[("ours" if n == OURS else n)] = wide[n].fillna("").to_numpy()
    for r in ratio_peers:
        ratio = (num[OURS] / num[r]).to_numpy()
        t[f"ours/{r}"] = [f"{x:.2f}" if x == x else "" for x in ratio]
    for n, label in ((OURS, "err ours"), ("standard", "err std")):
        if n in errs:
            t[label] = [f"{x:.1e}" if x == x else "" for x in errs[n].to_numpy()]
    return t


def to_markdown(t) -> str:
    cols = [str(c) for c in t.columns]
    rows = [[str(x) for x in r] for r in t.itertuples(index=False)]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(cols), sep] + [line(r) for r in rows])


IMPL_STYLE = {OURS: dict(color="black", linewidth=2.5, marker="o")}


def plot(df, impl_names: list[str], out_dir: str, device_label: str) -> list[str]:
    """tflops.png and memory.png: one panel per (dtype, hdim, causal, gqa) x mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    configs = list(dict.fromkeys(zip(df["dtype"], df["hdim"], df["causal"], df["gqa"])))
    modes = list(dict.fromkeys(df["mode"]))
    colors = plt.get_cmap("tab10")
    paths = []
    for metric, ylabel, fname, log in (("tflops", "TFLOP/s", "tflops.png", False),
                                       ("peak_mem_mib", "peak extra memory (MiB)", "memory.png", True)):
        fig, axes = plt.subplots(len(configs), len(modes), squeeze=False,
                                 figsize=(5.0 * len(modes), 3.4 * len(configs)))
        for r, (dtype, hdim, causal, gqa) in enumerate(configs):
            for c, mode in enumerate(modes):
                ax = axes[r][c]
                sel = df[(df["dtype"] == dtype) & (df["hdim"] == hdim) & (df["causal"] == causal)
                         & (df["gqa"] == gqa) & (df["mode"] == mode)]
                drawn = 0
                for i, name in enumerate(impl_names):
                    style = IMPL_STYLE.get(name, dict(color=colors(i % 10), linewidth=1.3, marker="."))
                    for x in sel[(sel["impl"] == name) & (sel["status"] == "OOM")]["seqlen"]:
                        ax.annotate(f"{name} OOM", xy=(x, 0.98), xycoords=("data", "axes fraction"),
                                    fontsize=7, color=style["color"], ha="center", va="top",
                                    rotation=90)
                    s = sel[(sel["impl"] == name) & sel[metric].notna()].sort_values("seqlen")
                    if not s.empty:
                        ax.plot(s["seqlen"], s[metric], label=name, **style)
                        drawn += 1
                ax.set_xscale("log", base=2)
                seqlens = sorted(set(sel["seqlen"]))
                ax.set_xticks(seqlens, [str(x) for x in seqlens])
                ax.xaxis.set_minor_locator(NullLocator())
                if log and drawn:
                    ax.set_yscale("log")
                title = f"{dtype} hdim {hdim} {'causal' if causal else 'non-causal'}"
                title += f" gqa {gqa}" if gqa != 1 else ""
                ax.set_title(f"{title}, {mode}", fontsize=9)
                ax.set_xlabel("seqlen")
                ax.set_ylabel(ylabel)
                ax.grid(True, which="both", alpha=0.3)
                if drawn:
                    ax.legend(fontsize=7)
                else:
                    ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center",
                            va="center")
        fig.suptitle(f"flash_attn_ext vs peers on {device_label}", fontsize=11)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def environment(device: torch.device, timer: Timer, argv: list[str]) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": shlex.join(["python", "-m", "flash_attn_ext.benchmark", *argv]),
           "torch": torch.__version__, "python": platform.python_version(),
           "device": str(device), "timer": timer.method}
    try:
        import flash_attn_ext
        env["flash_attn_ext"] = getattr(flash_attn_ext, "__version__", "unknown")
    except Exception:
        pass
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        env.update(device_name=prop.name, sm=f"{prop.major}.{prop.minor}",
                   sm_count=prop.multi_processor_count, cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), l2_bytes=_l2_bytes(device))
        try:
            import triton
            env["triton"] = triton.__version__
        except Exception:
            pass
    else:
        env.update(device_name=platform.processor() or platform.machine(),
                   cpu_threads=torch.get_num_threads())
    return env


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2: bad flag or environment, 1: flash_attn_ext
    failed on some case, 0 otherwise)."""
    args = make_parser().parse_args(argv)
    try:
        _require_bench_deps()
        sweep = resolve_args(args)
        impls, notes = build_impls(sweep.peers, sweep.device, args.slow_max_seqlen)
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import pandas as pd
    from tqdm import tqdm

    cuda = sweep.device.type == "cuda"
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if cuda:
        torch.cuda.set_device(sweep.device.index or 0)  # do_bench synchronizes the current device
    warmup = args.warmup_ms if args.warmup_ms is not None else (10 if args.quick else 25)
    rep = args.rep_ms if args.rep_ms is not None else (30 if args.quick else (100 if cuda else 60))
    timer = Timer(sweep.device, warmup, rep, min_reps=3 if cuda else 5)
    env = environment(sweep.device, timer, sys.argv[1:] if argv is None else list(argv))
    for n in notes:
        print(f"note: {n}", file=sys.stderr)

    n_cases = (len(sweep.dtypes) * len(sweep.hdims) * len(sweep.causals) * len(sweep.gqas)
               * len(sweep.seqlens) * len(sweep.modes))
    t0 = time.perf_counter()
    with tqdm(total=n_cases * len(impls), desc="benchmark", unit="run", file=sys.stderr,
              disable=args.no_progress, mininterval=1.0, dynamic_ncols=True) as progress:
        rows = run_sweep(sweep, args, impls, timer, progress)
    env["sweep_seconds"] = round(time.perf_counter() - t0, 1)

    names = [i.name for i in impls]
    df = add_ratios(pd.DataFrame(rows))
    os.makedirs(args.out, exist_ok=True)
    paths = {"results.csv": os.path.join(args.out, "results.csv"),
             "results.json": os.path.join(args.out, "results.json"),
             "summary.csv": os.path.join(args.out, "summary.csv"),
             "summary.md": os.path.join(args.out, "summary.md")}
    df.to_csv(paths["results.csv"], index=False)
    records = json.loads(df.to_json(orient="records"))  # NaN -> null
    with open(paths["results.json"], "w") as f:
        json.dump({"environment": env, "notes": notes, "results": records}, f, indent=1)
    summary, _ = summarize(df, names)
    summary.to_csv(paths["summary.csv"], index=False)
    table = compact_table(df, names, ["sdpa-flash", "sdpa-cudnn"])
    device_label = env.get("device_name") or str(sweep.device)
    header = (f"flash_attn_ext benchmark on {device_label} ({env['device']}), torch {env['torch']}; "
              f"timer: {env['timer']}.\nTFLOP/s by the standard count (fwd 4*B*H*N^2*d, halved "
              f"when causal; bwd 2.5x, fwd_bwd 3.5x); ours/<peer> = ratio of TFLOP/s (> 1: ours "
              f"faster); err = max |x - float64 reference| (out for fwd, max of dq/dk/dv "
              f"otherwise), batch 1 same seqlen.\nCommand: {env['command']}")
    md = to_markdown(table)
    with open(paths["summary.md"], "w") as f:
        f.write(header + "\n\n" + md + "\n")
    if not args.no_plots:
        for p in plot(df, names, args.out, device_label):
            paths[os.path.basename(p)] = p
    not_ok = df[df["status"] != "ok"]
    print(f"wrote {', '.join(paths.values())} ({env['sweep_seconds']} s sweep)")
    if len(not_ok):
        counts = not_ok.groupby(["impl", "status"]).size()
        print("not measured: " + "; ".join(f"{i} {s} x{c}" for (i, s), c in counts.items())
              + " (see the note column of results.csv)")
    for n in notes:
        print(f"note: {n}")
    print()
    print(header)
    print(md)
    errors = df[(df["impl"] == OURS) & (df["status"] == "error")]
    return 1 if len(errors) else 0


if __name__ == "__main__":
    sys.exit(main())
