"""The input checks of csrc/flash_api.cpp, for the fake (meta) kernels of flash_attn_ext.ops.

A fake kernel runs instead of the real one under torch.compile / FakeTensor tracing, and for every
call in which one tensor argument is on the meta device (the dispatcher picks the Meta kernel even
when the others are on the CPU). It must refuse exactly what the real op refuses: a fake kernel
that skipped a check would hand back a tensor of uninitialised memory, or a shape that cannot
exist, where the op raises. So each function here is the twin of the C++ function of the same
name (check_qkv, check_bwd_extra, check_varlen, check_kvcache, ...), with the same checks in the
same order: shapes, devices, dtypes and strides, never values (a CUDA call cannot read those
without a device sync either). Messages name the argument as the C++ ones do. Raises
RuntimeError, as TORCH_CHECK does.
"""

from __future__ import annotations

import math
import struct

import torch

MAX_HEADDIM = 256
MAX_SEQLEN = 2**31 - 256  # csrc/flash.h kMaxSeqlen: tile counts and 128-row roundings stay in int32
MAX_SPLITS = 128          # csrc/flash.h kMaxSplits
_INT32_MAX = 2**31 - 1


def _fail(*parts) -> None:
    raise RuntimeError("flash_attn_ext: " + "".join(str(p) for p in parts))


def _sizes_ok(ok, full, static: str) -> None:
    """A check over sizes that may be symbolic under torch.compile (a tensor sliced by .item(), rows
    picked by .nonzero(): unbacked sizes, which an `if` cannot decide): a bool, or a SymBool that has
    a hint, is decided now and raises RuntimeError("flash_attn_ext: " + full()), the C++ check's
    text; an unbacked SymBool becomes torch._check's runtime assert with `static` (no sizes: a
    formatted size would be specialized). In code Dynamo traces (the Python entries' own checks) it
    is left to the op's fake kernel, as _require does."""
    if torch.compiler.is_dynamo_compiling():
        return
    if isinstance(ok, torch.SymBool) and not ok.node.has_hint():
        torch._check_with(RuntimeError, ok, lambda: "flash_attn_ext: " + static)
    elif not ok:
        raise RuntimeError("flash_attn_ext: " + full())


def _num(x: float) -> str:
    """A float as the C++ messages print a double (std::ostream: 6 significant digits, 1.0 as 1)."""
    return f"{x:g}"


def _tuple(sizes) -> str:
    """Sizes as the C++ messages write an expected shape: (2, 3, 4)."""
    return "(" + ", ".join(str(n) for n in sizes) + ")"


def _symbolic(a, b=False) -> bool:
    """Whether a condition may be symbolic: Dynamo is tracing this code (it shows a SymBool as a
    bool there), or one is a SymBool (a fake kernel's SymInt sizes)."""
    return isinstance(a, torch.SymBool) or isinstance(b, torch.SymBool) or torch.compiler.is_dynamo_compiling()


def _or(a, b):
    """a or b for bools and SymBools (the varlen ops' SymInt max_seqlen_q / max_seqlen_k), without
    making a SymBool a bool: that would guard on it, or fail for a size read from a tensor (.item())."""
    return a | b if _symbolic(a, b) else a or b


def _and(a, b):
    """a and b for bools and SymBools, as _or."""
    return a & b if _symbolic(a, b) else a and b


def _require(ok, error: type, message: str, got=None) -> None:
    """Raise error("flash_attn_ext: " + message + got()) unless ok. A SymBool ok (a fake kernel's
    symbolic sizes) goes to torch._check_with: decided by a guard where torch.compile knows the
    sizes' values (the message without got()), else asserted when the graph runs (torch's runtime
    assert then names the expression, not this message). Code that Dynamo traces (the Python
    entries' own checks) leaves the check to the op's fake kernel, which runs it when Dynamo
    calls the op on fake tensors (Dynamo of torch 2.11 traces torch._check_with not at all)."""
    if torch.compiler.is_dynamo_compiling():
        return
    if isinstance(ok, torch.SymBool):
        text = "flash_attn_ext: " + message
        torch._check_with(error, ok, lambda: text)
    elif not ok:
        raise error("flash_attn_ext: " + message + (got() if got else ""))


def _no_left_bound(window_size_left, seqlen_k):
    """Whether a window's left bound hides no key: none (< 0), or as wide as the keys (a symbolic
    seqlen_k: a SymBool, no guard)."""
    return _or(window_size_left < 0, window_size_left >= seqlen_k - 1)


def check_page_size(page_size, cache_name: str) -> None:
    """A paged cache's page_size (its dim 1): a positive multiple of 16 (the kernels' key tiles);
    cache_name as the caller's argument (k_cache, or k for paged varlen)."""
    if page_size <= 0 or page_size % 16 != 0:
        _fail(f"paged {cache_name} has page_size {page_size} ({cache_name}.size(1)); expected a positive "
              "multiple of 16")


def check_num_blocks(num_blocks, cache_name: str) -> None:
    """A paged cache's num_blocks (its dim 0, an expanded view's too), an int or a SymInt: at most
    2^31 - 1, the int32 block numbers of block_table (the kernels hold the count in int32)."""
    _require(num_blocks <= _INT32_MAX, RuntimeError, f"paged {cache_name}'s num_blocks ({cache_name}.size(0)) must "
             "be at most 2^31 - 1 (block_table holds int32 block numbers)", lambda: f", got {num_blocks}")


def strides_can_meet(delta: int, terms: list, nonzero: bool):
    """Whether sum_t a_t x_t == delta has an integer solution with lo_t <= x_t <= hi_t (terms: (a_t >
    0, lo_t, hi_t); with ``nonzero``, one with some x_t != 0): two strided views of one storage
    addressing one element. True / False, or None past 2^16 nodes (undecided: refused as a layout
    that may overlap). The twin of flash_api.cpp's (depth first by decreasing a_t, only the x_t
    that leave delta reachable)."""
    terms = sorted(terms, key=lambda t: -t[0])
    rest_lo, rest_hi = [0] * (len(terms) + 1), [0] * (len(terms) + 1)
    for t in range(len(terms) - 1, -1, -1):
        a, lo, hi = terms[t]
        rest_lo[t], rest_hi[t] = rest_lo[t + 1] + a * lo, rest_hi[t + 1] + a * hi
    budget = [1 << 16]

    def solve(t, d, moved):
        budget[0] -= 1
        if budget[0] < 0:
            return True  # (ends the search: undecided)
        if t == len(terms):
            return d == 0 and (moved or not nonzero)
        a, lo, hi = terms[t]
        for x in range(max(lo, -((rest_hi[t + 1] - d) // a)), min(hi, (d - rest_lo[t + 1]) // a) + 1):
            if solve(t + 1, d - a * x, moved or x != 0):
                return True
        return False

    found = solve(0, delta, False)
    return None if budget[0] < 0 else found


def _static_layout(*tensors) -> bool:
    """Whether the overlap checks run here: in a fake kernel (fake or meta tensors; a real call's op
    runs its own, the C++ ones), not in code Dynamo traces (the Python entries' own checks: the op's
    fake kernel runs them on its fake tensors), on sizes, strides and storage offsets that are all
    plain ints (not symbolic)."""
    return (not torch.compiler.is_dynamo_compiling()
            and all(t.is_meta or torch._subclasses.fake_tensor.is_fake(t) for t in tensors)
            and all(isinstance(n, int) for t in tensors for n in (*t.shape, *t.stride(), t.storage_offset())))


def has_internal_overlap(t: torch.Tensor):
    """flash_api.cpp's twin: two elements of t share one address (None: undecided)."""
    if t.is_contiguous():
        return False
    terms = []
    for n, s in zip(t.shape, t.stride()):
        if n <= 1:
            continue
        if s == 0:
            return True
        terms.append((abs(s), -(n - 1), n - 1))
    return strides_can_meet(0, terms, True)


def views_meet(a: torch.Tensor, b: torch.Tensor):
    """flash_api.cpp's twin: views a and b of one storage share an element (None: undecided)."""
    merged = {}  # |coefficient| -> the range of its summed index terms
    for sign, t in ((1, a), (-1, b)):
        for n, s in zip(t.shape, t.stride()):
            c = sign * s
            if c and n > 1:
                lo, hi = (0, n - 1) if c > 0 else (-(n - 1), 0)
                old = merged.get(abs(c), (0, 0))
                merged[abs(c)] = (old[0] + lo, old[1] + hi)
    return strides_can_meet(b.storage_offset() - a.storage_offset(), [(s, lo, hi) for s, (lo, hi) in merged.items()],
                            False)


def _shape(t: torch.Tensor) -> list:
    return list(t.shape)


def check_rank(t: torch.Tensor, name: str, rank: int, layout: str) -> None:
    """check_rank4 / check_rank3."""
    if t.dim() != rank:
        kind = "(BSHD)" if rank == 4 else "(packed varlen)"
        _fail(name, f" must be {rank}-D ", layout, f" {kind}, got {t.dim()}-D of shape ", _shape(t))


def check_same_device(t: torch.Tensor, name: str, q: torch.Tensor) -> None:
    if t.device != q.device:
        _fail(name, " is on ", t.device, " but q is on ", q.device, "; all tensors must be on one device")


def check_same_dtype(t: torch.Tensor, name: str, q: torch.Tensor) -> None:
    if t.dtype != q.dtype:
        _fail(name, " has dtype ", t.dtype, " but q has dtype ", q.dtype, "; they must match")


def check_last_dim_contiguous(t: torch.Tensor, name: str, hint: str = "; call .contiguous() first") -> None:
    if t.stride(-1) != 1:
        _fail(name, " must have a contiguous last dimension (stride(-1) == 1), got strides ", list(t.stride()), hint)


def check_devices_dtypes(q, k, v, k_name: str, v_name: str) -> None:
    """k / v on q's device with q's dtype; a CUDA q float16 / bfloat16 (the device decides, as the
    C++ op's CUDA or CPU kernel does; meta follows the CPU rule)."""
    check_same_device(k, k_name, q)
    check_same_device(v, v_name, q)
    if q.device.type == "cuda":
        if q.dtype not in (torch.float16, torch.bfloat16):
            _fail("q has dtype ", q.dtype, "; CUDA supports float16 and bfloat16")
    elif q.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        _fail("q has dtype ", q.dtype, "; CPU supports float32, float64, float16 and bfloat16")
    check_same_dtype(k, k_name, q)
    check_same_dtype(v, v_name, q)


def check_heads_headdim(q, k, v, k_name: str, v_name: str) -> None:
    nheads, nheads_k, headdim = q.shape[-2], k.shape[-2], q.shape[-1]
    if v.shape[-2] != nheads_k:
        _fail(v_name, f" has {v.shape[-2]} heads but ", k_name, f" has nheads_k {nheads_k}; expected equal")
    if k.shape[-1] != headdim or v.shape[-1] != headdim:
        _fail(f"headdim mismatch: q has headdim {headdim}, ", k_name, f" has {k.shape[-1]}, ", v_name,
              f" has {v.shape[-1]}; expected equal")
    if nheads_k <= 0:
        _fail(f"nheads_k ({k_name}.size({k.dim() - 2})) is 0; expected >= 1")
    if nheads > _INT32_MAX:
        _fail(f"nheads (q.size({q.dim() - 2}) = {nheads}) must fit in int32")
    if nheads % nheads_k != 0:
        _fail(f"nheads (q.size({q.dim() - 2}) = {nheads}) must be a multiple of nheads_k "
              f"({k_name}.size({k.dim() - 2}) = {nheads_k})")
    if not (0 < headdim <= MAX_HEADDIM and headdim % 8 == 0):
        _fail(f"headdim {headdim} is not supported; expected a multiple of 8 in [8, {MAX_HEADDIM}]")


def check_softmax_scale(softmax_scale: float) -> None:
    if torch.compiler.is_dynamo_compiling():
        # A symbolic float under torch.compile(dynamic=True) (1 / sqrt(headdim)) that Dynamo cannot
        # pass to math.isfinite; the op's fake kernel checks the value it is given.
        return
    if not softmax_scale_ok(softmax_scale):
        _fail("softmax_scale must be finite with |softmax_scale| * log2(e) < 3.4e38 (float32; the kernels "
              f"scale scores by it), got {_num(softmax_scale)}")


def softmax_scale_ok(softmax_scale: float) -> bool:
    """As the C++ check: softmax_scale * log2(e) finite once rounded to float32 (below FLT_MAX + 2^103,
    half an ulp past float32's max)."""
    return math.isfinite(softmax_scale) and abs(softmax_scale * 1.4426950408889634) < _FLOAT32_ROUNDS_TO_INF


_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_MIN_NORMAL = 1.1754943508222875e-38
_FLOAT32_ROUNDS_TO_INF = 3.4028235677973366e38  # FLT_MAX + 2^103: doubles from here round to inf in float32


def float32(x: float) -> float:
    """``x`` rounded to float32 (as the C++ side's float(x)), as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def check_softcap(softcap: float, softmax_scale: float) -> None:
    """check_softcap: 0 (no soft-capping) or a finite cap > 0 that is a normal float32 (the kernels
    hold it as float32) with softcap * log2(e) and |softmax_scale / softcap| (the cap rounded to
    float32) below float32's max."""
    if not (softcap >= 0.0 and softcap < math.inf):  # NaN fails both comparisons
        _fail(f"softcap must be a finite number >= 0 (0: no soft-capping), got {_num(softcap)}")
    if softcap == 0.0 or torch.compiler.is_dynamo_compiling():
        return  # (traced by Dynamo: its struct polyfill cannot round to float32; the fake kernel checks it)
    fits = softcap >= _FLOAT32_MIN_NORMAL and softcap * 1.4426950408889634 < _FLOAT32_MAX
    if fits:
        cap = float32(softcap)
        fits = cap * 1.4426950408889634 < _FLOAT32_MAX and abs(softmax_scale / cap) < _FLOAT32_MAX
    if not fits:
        _fail("softcap must be within float32's range (the kernels hold it as float32): softcap >= 1.18e-38, "
              f"softcap * log2(e) < 3.4e38 and |softmax_scale / softcap| < 3.4e38, got softcap {_num(softcap)} "
              f"with softmax_scale {_num(softmax_scale)}")


MAX_WINDOWED_SEQLENS = 2**31 - 512  # csrc/flash.h kMaxWindowedSeqlens


def check_window(window_size_left: int, window_size_right: int, causal: bool, seqlen_q, seqlen_k) -> None:
    """mask_args: each side of the sliding window -1 (no bound) or >= 0, and a window that hides
    some key only where seqlen_q + seqlen_k <= 2^31 - 512 (the longest sequence's lengths)."""
    if window_size_left < -1:
        _fail("window_size_left must be -1 (no left bound) or >= 0, got ", window_size_left)
    if window_size_right < -1:
        _fail("window_size_right must be -1 (no right bound) or >= 0, got ", window_size_right)
    causal = causal or window_size_right == 0  # a window (w, 0) is causal with left bound w
    # Each bound hides no key (row): none, or as wide as the sequence (a symbolic size: no guard).
    no_left = _no_left_bound(window_size_left, seqlen_k)
    no_right = _or(causal or window_size_right < 0, window_size_right >= seqlen_q - 1)
    _require(_or(_and(no_left, no_right), seqlen_q + seqlen_k <= MAX_WINDOWED_SEQLENS), RuntimeError,
             f"a sliding window needs seqlen_q + seqlen_k <= 2^31 - 512 = {MAX_WINDOWED_SEQLENS} (the kernels' "
             "mask arithmetic is int32)", lambda: f", got seqlen_q {seqlen_q} and seqlen_k {seqlen_k}")


def check_dropout(dropout_p: float, rng_state, q, window_size_left: int, causal: bool, seqlen_q, seqlen_k,
                  softcap: float, rng_drawn_after: bool = False) -> None:
    """check_dropout: dropout_p in [0, 1); with p > 0 an int64 (2,) rng_state on q's device, and no
    sliding window's left bound (normalized as mask_args does) nor soft-capping. ValueError /
    NotImplementedError as the C++ check (TORCH_CHECK_VALUE / TORCH_CHECK_NOT_IMPLEMENTED).
    rng_drawn_after: the caller draws rng_state once these checks pass (not checked here)."""
    if not (0.0 <= dropout_p < 1.0):  # NaN fails
        raise ValueError(f"flash_attn_ext: dropout_p must be in [0, 1), got {_num(dropout_p)}")
    if dropout_p == 0.0:
        return
    if not rng_drawn_after:
        if rng_state is None:
            raise ValueError(f"flash_attn_ext: dropout_p = {_num(dropout_p)} needs rng_state, the call's (seed, "
                             "offset) as an int64 tensor of shape (2,) on q's device (flash_attn_func and the other "
                             "entry points draw it from torch's generator; pass the forward's to the backward)")
        check_same_device(rng_state, "rng_state", q)
        if rng_state.dtype != torch.int64 or rng_state.dim() != 1 or rng_state.shape[0] != 2:
            raise ValueError(f"flash_attn_ext: rng_state has dtype {rng_state.dtype} and shape "
                             f"{list(rng_state.shape)}; expected int64 of shape (2,): (seed, offset)")
    no_left = _no_left_bound(window_size_left, seqlen_k)
    what = ("softcap > 0" if softcap != 0.0
            else "a sliding window's left bound that hides keys (0 <= window_size[0] < seqlen_k - 1)")
    _require(_and(softcap == 0.0, no_left), NotImplementedError,
             f"dropout_p > 0 with {what} is not supported; dropout runs with causal or full attention, "
             "without soft-capping")


def check_alibi(alibi_slopes, q, batch: int, nheads: int, softmax_scale: float, softcap: float, dropout_p: float,
                window_size_left: int, seqlen_k) -> None:
    """check_alibi: None, or float32 slopes of shape (nheads,) or (batch, nheads) on q's device;
    softmax_scale != 0; no soft-capping, dropout or sliding window's left bound (normalized as
    mask_args does). RuntimeError / ValueError / NotImplementedError as the C++ check."""
    if alibi_slopes is None:
        return
    check_same_device(alibi_slopes, "alibi_slopes", q)
    shape = list(alibi_slopes.shape)
    if alibi_slopes.dtype != torch.float32 or shape not in ([nheads], [batch, nheads]):
        _fail(f"alibi_slopes has dtype {alibi_slopes.dtype} and shape {shape}; expected float32 of shape "
              f"(nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads})")
    if softmax_scale == 0.0:
        raise ValueError("flash_attn_ext: alibi_slopes with softmax_scale = 0 is not supported (the kernels add the "
                         "bias in units of the scaled score)")
    no_left = _no_left_bound(window_size_left, seqlen_k)
    what = ("softcap > 0" if softcap != 0.0 else "dropout_p > 0" if dropout_p != 0.0
            else "a sliding window's left bound that hides keys (0 <= window_size[0] < seqlen_k - 1; a KV "
            "cache's seqlen_k: its capacity, the keys in use being known on the device only)")
    _require(_and(softcap == 0.0 and dropout_p == 0.0, no_left), NotImplementedError,
             f"alibi_slopes with {what} is not supported; ALiBi runs with causal or full attention (a "
             "window's right bound, sinks, GQA)")


def check_last_dims_scale(q, k, v, softmax_scale: float) -> None:
    check_last_dim_contiguous(q, "q")
    check_last_dim_contiguous(k, "k")
    check_last_dim_contiguous(v, "v")
    check_softmax_scale(softmax_scale)


def check_qkv(q, k, v, softmax_scale: float) -> None:
    """The dense ops' q / k / v: rank, device, dtype, shapes, heads and headdim, strides, scale."""
    check_rank(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    check_rank(k, "k", 4, "(batch, seqlen_k, nheads_k, headdim)")
    check_rank(v, "v", 4, "(batch, seqlen_k, nheads_k, headdim)")
    check_devices_dtypes(q, k, v, "k", "v")
    batch = q.shape[0]
    _sizes_ok(_and(k.shape[0] == batch, v.shape[0] == batch),
              lambda: f"batch mismatch: q has batch {batch}, k has {k.shape[0]}, v has {v.shape[0]}; expected equal",
              "batch mismatch: q, k and v must have one batch")
    _sizes_ok(v.shape[1] == k.shape[1], lambda: f"v has seqlen {v.shape[1]} but k has seqlen_k {k.shape[1]}; expected "
              "equal", "v must have k's seqlen_k")
    check_heads_headdim(q, k, v, "k", "v")
    limits = (f"batch must fit in int32 and seqlen_q, seqlen_k be at most 2^31 - 256 = {MAX_SEQLEN} (tile counts "
              "are int32)")
    _sizes_ok(_and(_and(batch <= _INT32_MAX, q.shape[1] <= MAX_SEQLEN), k.shape[1] <= MAX_SEQLEN),
              lambda: f"{limits}, got q shape {_shape(q)}, k shape {_shape(k)}", limits)
    check_last_dims_scale(q, k, v, softmax_scale)


def check_stats(stats, q, expected: tuple) -> None:
    """The dense backward's softmax_stats: `expected` float32 on q's device (the forward's third
    output); the dtype, then the shape, as the C++ check_stats."""
    check_same_device(stats, "softmax_stats", q)
    if stats.dtype != torch.float32:
        _fail("softmax_stats has dtype ", stats.dtype, "; expected float32")
    if tuple(stats.shape) != expected:
        _fail("softmax_stats has shape ", _shape(stats), f"; expected (2, batch, nheads, seqlen_q) = "
              f"{_tuple(expected)}, the forward's third output")


def _check_dout_out(dout, q, out, softmax_lse) -> None:
    """The backward's dout / out like q (and softmax_lse on q's device)."""
    check_same_device(dout, "dout", q)
    check_same_device(out, "out", q)
    check_same_device(softmax_lse, "softmax_lse", q)
    check_same_dtype(dout, "dout", q)
    check_same_dtype(out, "out", q)
    if dout.shape != q.shape:
        _fail("dout has shape ", _shape(dout), "; expected q's shape ", _shape(q))
    if out.shape != q.shape:
        _fail("out has shape ", _shape(out), "; expected q's shape ", _shape(q))


def check_bwd_extra(dout, q, out, softmax_lse, lse_shape: tuple) -> None:
    """check_bwd_extra (dense): dout / out like q, softmax_lse (batch, nheads, seqlen_q) float32."""
    _check_dout_out(dout, q, out, softmax_lse)
    if softmax_lse.dtype != torch.float32:
        _fail("softmax_lse has dtype ", softmax_lse.dtype, "; expected float32")
    if tuple(softmax_lse.shape) != lse_shape:
        _fail("softmax_lse has shape ", _shape(softmax_lse), f"; expected (batch, nheads, seqlen_q) = "
              f"{_tuple(lse_shape)}")
    check_last_dim_contiguous(out, "out")


def check_varlen_bwd_extra(dout, q, out, softmax_lse, softmax_stats) -> None:
    """check_varlen_bwd_extra: dout / out like q, then softmax_lse (nheads, total_q) and
    softmax_stats (2, nheads, total_q) float32, each in one check (the C++ side's order)."""
    _check_dout_out(dout, q, out, softmax_lse)
    check_last_dim_contiguous(out, "out")
    total_q, nheads, _ = q.shape
    if softmax_lse.dtype != torch.float32 or tuple(softmax_lse.shape) != (nheads, total_q):
        _fail("softmax_lse has shape ", _shape(softmax_lse), " and dtype ", softmax_lse.dtype, "; expected (nheads, "
              f"total_q) = {_tuple((nheads, total_q))} float32")
    if softmax_stats is not None:
        check_same_device(softmax_stats, "softmax_stats", q)
        if softmax_stats.dtype != torch.float32 or tuple(softmax_stats.shape) != (2, nheads, total_q):
            _fail("softmax_stats has shape ", _shape(softmax_stats), " and dtype ", softmax_stats.dtype,
                  f"; expected (2, nheads, total_q) = {_tuple((2, nheads, total_q))} float32, the varlen forward's "
                  "third output")


def check_dense_bwd(dout, q, k, v, out, softmax_lse, softmax_scale: float, softmax_stats) -> None:
    """backward's checks (backward_cpu / backward_cuda)."""
    check_qkv(q, k, v, softmax_scale)
    check_rank(dout, "dout", 4, "(batch, seqlen_q, nheads, headdim)")
    check_rank(out, "out", 4, "(batch, seqlen_q, nheads, headdim)")
    batch, seqlen_q, nheads, _ = q.shape
    check_bwd_extra(dout, q, out, softmax_lse, (batch, nheads, seqlen_q))
    if softmax_stats is not None:
        check_stats(softmax_stats, q, (2, batch, nheads, seqlen_q))


def check_sinks_device(sinks, q) -> None:
    """check_sinks_device: the ops' first check (a sinks tensor on another device routes the call)."""
    if sinks is not None:
        check_same_device(sinks, "sinks", q)


def check_sinks(sinks, nheads: int) -> None:
    """check_sinks: None, or (nheads,) float32 (its device: check_sinks_device, every op's first check)."""
    if sinks is None:
        return
    if sinks.dtype != torch.float32:
        _fail("sinks has dtype ", sinks.dtype, "; expected float32 (flash_attn_func and the other entry points "
              "convert it)")
    if sinks.dim() != 1 or sinks.shape[0] != nheads:
        _fail("sinks has shape ", _shape(sinks), "; expected (nheads,) = (", nheads, ",): one logit per query head")


def check_max_seqlens(max_seqlen_q, max_seqlen_k, traced: bool = False) -> None:
    """The varlen ops' range of max_seqlen_q / max_seqlen_k, ints or SymInts (the user function checks
    it too, before the op: a Python int past int64 would not reach the op's own check). traced: the
    caller calls no op that rechecks them (paged varlen's KV-cache op), so while Dynamo traces the
    range is checked here, message-less (the form torch 2.11's Dynamo traces; torch's message names
    the bound)."""
    if type(max_seqlen_q) is int and type(max_seqlen_k) is int and not torch.compiler.is_compiling() and \
            0 <= max_seqlen_q <= MAX_SEQLEN and 0 <= max_seqlen_k <= MAX_SEQLEN:
        return  # the eager call's case, at its old cost
    inside = _and(_and(max_seqlen_q >= 0, max_seqlen_q <= MAX_SEQLEN),
                  _and(max_seqlen_k >= 0, max_seqlen_k <= MAX_SEQLEN))
    if traced and torch.compiler.is_dynamo_compiling():
        torch._check(inside)
        return
    _require(inside, RuntimeError, f"max_seqlen_q and max_seqlen_k must be in [0, 2^31 - 256 = {MAX_SEQLEN}] (tile "
             "counts are int32)", lambda: f", got {max_seqlen_q} and {max_seqlen_k}")


def check_num_splits(num_splits: int) -> None:
    """The KV-cache op's range of num_splits (the user function checks it too, before the op)."""
    if not 0 <= num_splits <= MAX_SPLITS:
        _fail(f"num_splits must be in [0, {MAX_SPLITS}] (0: chosen from the shapes), got {num_splits}")


def check_cu_seqlens(cu, name: str, q) -> None:
    check_same_device(cu, name, q)
    if cu.dtype != torch.int32:
        _fail(name, " has dtype ", cu.dtype, "; expected int32")
    if cu.dim() != 1 or cu.shape[0] < 1:
        _fail(name, " has shape ", _shape(cu), "; expected (batch + 1,) with batch >= 0")
    if not cu.is_contiguous():
        _fail(name, " must be contiguous")


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                 softmax_scale: float) -> None:
    check_rank(q, "q", 3, "(total_q, nheads, headdim)")
    check_rank(k, "k", 3, "(total_k, nheads_k, headdim)")
    check_rank(v, "v", 3, "(total_k, nheads_k, headdim)")
    _sizes_ok(v.shape[0] == k.shape[0], lambda: f"v has {v.shape[0]} rows but k has total_k = {k.shape[0]}; expected "
              "equal", "v must have k's total_k rows")
    check_devices_dtypes(q, k, v, "k", "v")
    check_heads_headdim(q, k, v, "k", "v")
    check_last_dims_scale(q, k, v, softmax_scale)
    check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q)
    check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q)
    _sizes_ok(cu_seqlens_q.shape[0] == cu_seqlens_k.shape[0],
              lambda: f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries but cu_seqlens_k has {cu_seqlens_k.shape[0]}; "
              "expected equal (batch + 1 each)", "cu_seqlens_q and cu_seqlens_k must have batch + 1 entries each")
    batch = cu_seqlens_q.shape[0] - 1  # a SymInt, unbacked for cu_seqlens built by .nonzero() under compile
    _require(batch <= _INT32_MAX, RuntimeError, "batch (cu_seqlens_q.size(0) - 1) must fit in int32",
             lambda: f", got {batch}")
    check_max_seqlens(max_seqlen_q, max_seqlen_k)
    totals = f"total_q and total_k must be at most 2^31 - 256 = {MAX_SEQLEN} (tile counts are int32)"
    _sizes_ok(_and(q.shape[0] <= MAX_SEQLEN, k.shape[0] <= MAX_SEQLEN),
              lambda: f"{totals}, got {q.shape[0]} and {k.shape[0]}", totals)


def check_varlen_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                     max_seqlen_k: int, softmax_scale: float, softmax_stats, sinks) -> None:
    """varlen_backward's checks in the C++ order: check_varlen, check_sinks, then dout / out and
    check_varlen_bwd_extra."""
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
    check_sinks(sinks, q.shape[1])
    check_rank(dout, "dout", 3, "(total_q, nheads, headdim)")
    check_rank(out, "out", 3, "(total_q, nheads, headdim)")
    check_varlen_bwd_extra(dout, q, out, softmax_lse, softmax_stats)


def cache_capacity(k_cache, block_table):
    """The rows a KV-cache sequence can hold: seqlen_cache, or max_blocks * page_size when paged."""
    return k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)


def check_seqlen_new(seqlen_new, capacity, capacity_name: str) -> None:
    """New keys k / v of the KV-cache op (ints or SymInts): no more rows than a sequence's cache
    holds (capacity, named as the caller's arguments give it)."""
    _require(seqlen_new <= capacity, RuntimeError, f"k's seqlen_new (k.size(1)) must be at most the cache's rows per "
             f"sequence ({capacity_name})", lambda: f", got {seqlen_new} and {capacity}")


def check_forward(q, k, v, softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int, sinks,
                  softcap: float, dropout_p: float, rng_state, alibi_slopes, rng_drawn_after: bool = False) -> None:
    """The forward op's checks in its order: its fake kernel's, and flash_attn_func's before it
    draws a dropout call's random state (rng_drawn_after), so that a refused call draws none."""
    check_sinks_device(sinks, q)
    check_qkv(q, k, v, softmax_scale)
    check_softcap(softcap, softmax_scale)
    check_window(window_size_left, window_size_right, causal, q.shape[1], k.shape[1])
    check_dropout(dropout_p, rng_state, q, window_size_left, causal, q.shape[1], k.shape[1], softcap, rng_drawn_after)
    check_alibi(alibi_slopes, q, q.shape[0], q.shape[2], softmax_scale, softcap, dropout_p, window_size_left,
                k.shape[1])
    check_sinks(sinks, q.shape[2])


def check_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale: float,
                         causal: bool, window_size_left: int, window_size_right: int, sinks, softcap: float,
                         dropout_p: float, rng_state, alibi_slopes, rng_drawn_after: bool = False) -> None:
    """The varlen forward op's checks in its order, as check_forward; with rng_drawn_after on CPU
    tensors outside torch.compile also the CPU op's checks of the cu_seqlens values."""
    check_sinks_device(sinks, q)
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
    check_softcap(softcap, softmax_scale)
    check_window(window_size_left, window_size_right, causal, max_seqlen_q, max_seqlen_k)
    check_dropout(dropout_p, rng_state, q, window_size_left, causal, max_seqlen_q, max_seqlen_k, softcap,
                  rng_drawn_after)
    check_alibi(alibi_slopes, q, cu_seqlens_q.shape[0] - 1, q.shape[1], softmax_scale, softcap, dropout_p,
                window_size_left, max_seqlen_k)
    check_sinks(sinks, q.shape[1])
    if rng_drawn_after and q.device.type == "cpu" and not torch.compiler.is_compiling():
        check_cu_seqlens_values(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q, "max_seqlen_q")
        check_cu_seqlens_values(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k, "max_seqlen_k")


def check_cu_seqlens_values(cu, name: str, total: int, max_seqlen: int, max_name: str) -> None:
    """host_cu_seqlens, the CPU op's checks of the values (read on the host: CPU tensors only):
    from 0, inside the packed tensor, non-decreasing, lengths within max_seqlen."""
    values = cu.tolist()
    for i, x in enumerate(values):
        if i == 0 and x != 0:
            _fail(f"{name}[0] = {x}; expected 0 (cu_seqlens start at 0)")
        if not 0 <= x <= total:
            _fail(f"{name}[{i}] = {x} is outside [0, {total}] (the packed tensor's rows)")
        if i > 0 and x < values[i - 1]:
            _fail(f"{name} must be non-decreasing, got {name}[{i - 1}] = {values[i - 1]} > {name}[{i}] = {x}")
        if i > 0 and x - values[i - 1] > max_seqlen:
            _fail(f"sequence {i - 1} has {x - values[i - 1]} rows ({name}) but {max_name} = {max_seqlen}; expected "
                  "max_seqlen >= every length")


def check_per_sequence_int32(t, name: str, q) -> None:
    """One int32 per sequence, contiguous, on q's device (cache_seqlens, cache_leftpad)."""
    check_same_device(t, name, q)
    if t.dtype != torch.int32:
        _fail(name, " has dtype ", t.dtype, "; expected int32")
    _sizes_ok(t.shape[0] == q.shape[0] if t.dim() == 1 else False,
              lambda: f"{name} has shape {_shape(t)}; expected (batch,) = ({q.shape[0]},)",
              f"{name} must have shape (batch,)")
    if not t.is_contiguous():
        _fail(name, " must be contiguous")


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale: float,
                  num_splits: int, cache_leftpad=None) -> None:
    check_rank(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    check_rank(k_cache, "k_cache", 4, "(batch_cache, seqlen_cache, nheads_k, headdim) or paged (num_blocks, "
               "page_size, nheads_k, headdim)")
    check_rank(v_cache, "v_cache", 4, "like k_cache")
    same = True
    for a, b in zip(v_cache.shape, k_cache.shape):
        same = _and(same, a == b)
    _sizes_ok(same, lambda: f"v_cache has shape {_shape(v_cache)} but k_cache has shape {_shape(k_cache)}; expected "
              "equal", "v_cache must have k_cache's shape")
    batch = q.shape[0]
    if block_table is not None:
        check_same_device(block_table, "block_table", q)
        if block_table.dtype != torch.int32:
            _fail("block_table has dtype ", block_table.dtype, "; expected int32")
        _sizes_ok(_and(block_table.shape[0] == batch, block_table.shape[1] >= 1) if block_table.dim() == 2 else False,
                  lambda: f"block_table has shape {_shape(block_table)}; expected (batch, max_blocks) = "
                  f"({batch}, >= 1)",
                  "block_table must have shape (batch, max_blocks >= 1)")
        if block_table.stride(1) != 1:
            _fail("block_table must have a contiguous last dimension")
        page_size = k_cache.shape[1]
        check_page_size(page_size, "k_cache")
        check_num_blocks(k_cache.shape[0], "k_cache")
        longest = ("block_table.size(1) * page_size (the longest sequence's cache) must be at most 2^31 - 256 = "
                   f"{MAX_SEQLEN}")
        _sizes_ok(block_table.shape[1] * page_size <= MAX_SEQLEN,
                  lambda: f"{longest}, got {block_table.shape[1]} * {page_size}", longest)
    else:
        _sizes_ok(k_cache.shape[0] == batch, lambda: f"k_cache has batch {k_cache.shape[0]} but q has batch {batch}; "
                  "expected equal (or pass block_table for a paged cache)", "k_cache must have q's batch")
    check_devices_dtypes(q, k_cache, v_cache, "k_cache", "v_cache")
    check_heads_headdim(q, k_cache, v_cache, "k_cache", "v_cache")
    limits = ("batch must fit in int32, seqlen_cache and seqlen_q * nheads / nheads_k (the packed rows of a kv "
              f"head) be at most 2^31 - 256 = {MAX_SEQLEN} (tile counts are int32)")
    _sizes_ok(_and(_and(batch <= _INT32_MAX, k_cache.shape[1] <= MAX_SEQLEN),
                   q.shape[1] * (q.shape[2] // k_cache.shape[2]) <= MAX_SEQLEN),
              lambda: f"{limits}, got q shape {_shape(q)}, k_cache shape {_shape(k_cache)}", limits)
    check_last_dim_contiguous(q, "q")
    in_place = ("; the cache is written in place, so it cannot be copied: allocate it with a contiguous last "
                "dimension")
    check_last_dim_contiguous(k_cache, "k_cache", in_place)
    check_last_dim_contiguous(v_cache, "v_cache", in_place)
    check_softmax_scale(softmax_scale)
    if cache_seqlens is not None:
        check_per_sequence_int32(cache_seqlens, "cache_seqlens", q)
    if cache_leftpad is not None:
        check_per_sequence_int32(cache_leftpad, "cache_leftpad", q)
        if block_table is not None:
            _fail("cache_leftpad with block_table: a paged cache is not left-padded (as flash-attn's); pass one of "
                  "them")
    if (k is None) != (v is None):
        _fail("k and v (the new keys and values) must be given together")
    if k is not None:
        if cache_seqlens is None:
            _fail("k / v (new keys) need cache_seqlens: they are written at rows cache_seqlens[b] + i")
        for name, t in (("k", k), ("v", v)):
            check_rank(t, name, 4, "(batch, seqlen_new, nheads_k, headdim)")
            check_same_device(t, name, q)
            check_same_dtype(t, name, q)
            _sizes_ok(_and(_and(t.shape[0] == batch, t.shape[2] == k_cache.shape[2]), t.shape[3] == q.shape[3]),
                      lambda: f"{name} has shape {_shape(t)}; expected (batch, seqlen_new, nheads_k, headdim) = "
                      f"({batch}, seqlen_new, {k_cache.shape[2]}, {q.shape[3]})",
                      f"{name} must have shape (batch, seqlen_new, nheads_k, headdim)")
            check_last_dim_contiguous(t, name)
        _sizes_ok(v.shape[1] == k.shape[1], lambda: f"v has seqlen_new {v.shape[1]} but k has {k.shape[1]}; expected "
                  "equal", "v must have k's seqlen_new")
        check_seqlen_new(k.shape[1], cache_capacity(k_cache, block_table),
                         "block_table.size(1) * page_size" if block_table is not None else "k_cache.size(1)")
        static = _static_layout(k_cache, v_cache)
        one_view = (k_cache.storage_offset(), k_cache.shape, k_cache.stride()) == (
            v_cache.storage_offset(), v_cache.shape, v_cache.stride()) if static else False
        meet = views_meet(k_cache, v_cache) if static and k_cache.untyped_storage()._cdata == \
            v_cache.untyped_storage()._cdata and not (one_view and k is v) else False
        if meet is not False:
            _fail("k_cache and v_cache ", "share memory" if meet else "may share memory (views of one buffer whose "
                  "strides the check could not clear in 2^16 steps)", ", so appending k and v would write one over "
                  "the other; pass caches with memory of their own (calls without k / v may share it)")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            for d in range(3):
                if t.stride(d) == 0 and t.shape[d] > 1:
                    _fail(name, f" has stride 0 in dim {d} (an expanded view): appending k / v would write one "
                          "cache row for several; pass a cache with its own storage per row")
            self_meet = has_internal_overlap(t) if static else False
            if self_meet is not False:
                _fail(name, f" has strides {list(t.stride())} for shape {list(t.shape)}",
                      ", under which two of its elements share memory" if self_meet else
                      ", which the check could not clear of shared elements in 2^16 steps",
                      ": appending k / v would write one over the other; pass a cache with its own storage per element")
    check_num_splits(num_splits)
