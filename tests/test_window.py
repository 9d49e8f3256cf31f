"""Sliding-window (local) attention: ``window_size=(left, right)`` on every entry point.

Semantics (flash-attn's; flash_attn_ext.reference.visible_mask): with off = seqlen_k - seqlen_q,
query i sees key j only if i + off - left <= j <= i + off + right, -1 leaving a side unbounded;
causal=True is the right bound 0 and overrides window_size[1]. Rows whose window holds no key give
out 0, LSE +inf and zero gradients. Every case is checked against the float64 reference with the
accuracy rule (tests/accuracy.py), the CPU ones in CI, the CUDA ones on each arch path of the GPU
(conftest.py: arch_path; on sm_90 "auto" runs windowed calls on the sm90 kernels).
"""

import re

import pytest
import torch

import flash_attn_ext
from accuracy import check_accuracy
from conftest import check_fwd_bwd, kernel_bool_args, make_qkv, require_hdim
from flash_attn_ext.reference import attention_kvcache_ref, attention_ref, attention_varlen_ref, visible_mask

# (left, right) windows: a diagonal band, left only, right only, both, a one-key window, and one
# that covers every key (normalized away: the unwindowed kernels' bits).
WINDOWS = [(0, 0), (5, -1), (-1, 3), (16, 4), (0, -1), (1000, 1000)]
# (seqlen_q, seqlen_k): square, more keys, more queries (rows whose window lies before the keys),
# and ragged lengths against the 64-row CPU tiles.
CPU_SHAPES = [(1, 1), (37, 50), (130, 129), (100, 30)]


def _run(q, k, v, causal, window, **kw):
    return flash_attn_ext.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True, **kw)


def _ref(q, k, v, causal, window):
    return lambda upcast: attention_ref(q, k, v, None, causal, upcast=upcast, window_size=window)


# ---- the reference mask itself: the contract written out element by element ------------------

def test_visible_mask_contract():
    for sq, sk in [(5, 9), (9, 5), (1, 1), (4, 4)]:
        for causal in (False, True):
            for left, right in [(-1, -1), (0, 0), (2, -1), (-1, 1), (3, 2)]:
                m = visible_mask(sq, sk, causal, left, right)
                for i in range(sq):
                    for j in range(sk):
                        d = i + sk - sq
                        r = 0 if causal else right
                        want = (r < 0 or j <= d + r) and (left < 0 or j >= d - left)
                        assert bool(m[i, j]) == want, (sq, sk, causal, left, right, i, j)


# ---- CPU (CI) --------------------------------------------------------------------------------

@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", CPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_cpu_matches_reference(dtype, seqlens, causal, window):
    sq, sk = seqlens
    q, k, v = make_qkv(2, sq, sk, 4, 2, 32, dtype)
    check_fwd_bwd(q, k, v, lambda: _run(q, k, v, causal, window), _ref(q, k, v, causal, window))


def test_window_rows_without_keys_cpu():
    """A window that ends before the first key (seqlen_q > seqlen_k, right bound 0) or starts after
    the last one: out 0, LSE +inf, gradients 0, never NaN."""
    q, k, v = make_qkv(1, 50, 10, 2, 2, 16, torch.float32)
    out, lse = _run(q, k, v, True, (3, 0))
    hidden = ~visible_mask(50, 10, True, 3, 0).any(-1)
    assert hidden.any() and (~hidden).any()
    assert torch.equal(out[0, hidden], torch.zeros_like(out[0, hidden]))
    assert torch.isinf(lse[0][:, hidden]).all() and torch.isfinite(lse[0][:, ~hidden]).all()
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.equal(dq[0, hidden], torch.zeros_like(dq[0, hidden]))
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))


def test_window_that_hides_nothing_is_the_unwindowed_call():
    """Bounds that hide no key are normalized away (flash_api.cpp: mask_args; left >= seqlen_k - 1,
    right >= seqlen_q - 1): the same bits as window (-1, -1); a non-causal (w, 0) is causal with left
    bound w; and causal=True ignores window_size[1] (flash-attn's rule)."""
    q, k, v = make_qkv(2, 70, 90, 4, 2, 32, torch.float32, requires_grad=False)
    base = _run(q, k, v, False, (-1, -1))
    for w in [(89, -1), (-1, 69), (5000, 5000)]:
        for a, b in zip(_run(q, k, v, False, w), base):
            assert torch.equal(a, b), w
    causal = _run(q, k, v, True, (-1, -1))
    for a, b in zip(_run(q, k, v, True, (-1, 7)), causal):
        assert torch.equal(a, b)
    for a, b in zip(_run(q, k, v, False, (-1, 0)), causal):
        assert torch.equal(a, b)
    # and a non-causal (w, 0) is causal with the left bound w
    for a, b in zip(_run(q, k, v, False, (5, 0)), _run(q, k, v, True, (5, -1))):
        assert torch.equal(a, b)
    # One less than hiding nothing does hide keys: not the unwindowed result.
    assert not torch.equal(_run(q, k, v, False, (88, -1))[0], base[0])
    assert not torch.equal(_run(q, k, v, False, (-1, 68))[0], base[0])


def test_window_refused_past_int32_mask_sums():
    """A window that hides keys needs seqlen_q + seqlen_k <= 2^31 - 512 (the kernels' mask sums are
    int32): refused by name before any work, by the op and by its fake kernel; the same lengths
    without a window are not refused by this check."""
    n = 2**30 + 64
    x = torch.zeros(1, 1, 1, 8).expand(1, n, 1, 8)  # stride 0 along the sequence: no memory
    with pytest.raises(RuntimeError, match="a sliding window needs seqlen_q . seqlen_k <= 2.31 - 512"):
        flash_attn_ext.flash_attn_func(x, x, x, causal=True, window_size=(5, 0))
    m = torch.empty(1, n, 1, 8, device="meta")
    with pytest.raises(RuntimeError, match="a sliding window needs seqlen_q . seqlen_k <= 2.31 - 512"):
        torch.ops.flash_attn_ext.forward(m, m, m, 0.5, False, -1, 3)
    out = torch.ops.flash_attn_ext.forward(m, m, m, 0.5, True, n, -1)[0]  # normalized away: no window
    assert out.shape == m.shape


@pytest.mark.parametrize("window", [(0, 0), (7, -1), (3, 2)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_window_varlen_cpu(causal, window):
    """Each packed sequence (zero-length ones included) gives what the dense call gives on it alone."""
    lens_q, lens_k = [5, 0, 70, 33, 9], [9, 4, 70, 0, 2]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 16, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 16, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 16, requires_grad=True)
    check_fwd_bwd(
        q, k, v,
        lambda: flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 70, 70, causal=causal,
                                                      window_size=window, return_lse=True),
        lambda upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, None, causal, upcast, window_size=window))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("seqlen_q", [1, 5])
@pytest.mark.parametrize("window", [(0, 0), (20, -1), (-1, 3), (20, 0)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_window_kvcache_cpu(causal, window, seqlen_q, paged):
    """Decode / chunked prefill against a cache with a window (bottom-right against
    cache_seqlens[b]), contiguous and paged, split and not."""
    batch, nheads, nheads_k, d = 3, 4, 2, 16
    q = torch.randn(batch, seqlen_q, nheads, d)
    if paged:
        k_cache = torch.randn(12, 16, nheads_k, d)
        block_table = torch.randperm(12, dtype=torch.int32)[:batch * 4].reshape(batch, 4)
    else:
        k_cache = torch.randn(batch, 64, nheads_k, d)
        block_table = None
    v_cache = torch.randn_like(k_cache)
    cache_seqlens = torch.tensor([5, 40, 60], dtype=torch.int32)
    ref = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens, block_table, None, causal, window_size=window)
    base = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens, block_table, None, causal, upcast=False,
                                 window_size=window)
    for num_splits in (1, 3):
        out, lse = flash_attn_ext.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, causal=causal,
            window_size=window, num_splits=num_splits, return_lse=True)
        check_accuracy("out", out, ref[0], base[0])
        check_accuracy("softmax_lse", lse, ref[1], base[1])


def test_window_forward_ad_and_compile_cpu():
    """Forward-mode AD (attention_jvp masks by the window too) against the reference's jvp, and a
    torch.compile(fullgraph=True) graph of a windowed call."""
    q, k, v = make_qkv(1, 20, 30, 2, 1, 16, torch.float64, requires_grad=False)
    tq, tk, tv = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
    w = (4, 1)
    _, out_t = torch.func.jvp(lambda a, b, c: flash_attn_ext.flash_attn_func(a, b, c, window_size=w),
                              (q, k, v), (tq, tk, tv))
    _, ref_t = torch.func.jvp(lambda a, b, c: attention_ref(a, b, c, window_size=w)[0], (q, k, v), (tq, tk, tv))
    torch.testing.assert_close(out_t, ref_t, rtol=1e-10, atol=1e-10)
    f = torch.compile(lambda a, b, c: flash_attn_ext.flash_attn_func(a, b, c, causal=True, window_size=(8, 0)),
                      fullgraph=True)
    torch.testing.assert_close(f(q, k, v), attention_ref(q, k, v, causal=True, window_size=(8, 0))[0],
                               rtol=1e-10, atol=1e-10)


def test_window_nn_modules_cpu():
    """FlashAttention(window_size=...) equals the reference; MultiheadFlashAttention's flash and
    torch_sdpa backends (an explicit window mask there) compute the same function."""
    from flash_attn_ext.nn import FlashAttention, MultiheadFlashAttention

    q, k, v = make_qkv(2, 30, 30, 4, 2, 16, torch.float64, requires_grad=False)
    out = FlashAttention(causal=True, window_size=(5, 0))(q, k, v)
    torch.testing.assert_close(out, attention_ref(q, k, v, causal=True, window_size=(5, 0))[0], rtol=1e-10, atol=1e-10)
    torch.manual_seed(0)
    flash = MultiheadFlashAttention(64, 4, 2, causal=True, window_size=(7, 0), dtype=torch.float64)
    ref = MultiheadFlashAttention(64, 4, 2, causal=True, window_size=(7, 0), dtype=torch.float64, backend="torch_sdpa")
    ref.load_state_dict(flash.state_dict())
    x = torch.randn(2, 40, 64, dtype=torch.float64)
    torch.testing.assert_close(flash(x)[0], ref(x)[0], rtol=1e-10, atol=1e-10)
    assert "window_size=(7, 0)" in repr(flash)
    full = MultiheadFlashAttention(64, 4, 2, causal=True, dtype=torch.float64)
    full.load_state_dict(flash.state_dict())
    assert not torch.allclose(full(x)[0], flash(x)[0])  # the window changes the result
    # A bad window is refused at construction, naming it, not at the first forward.
    for bad, error in [(5, TypeError), ("ab", TypeError), ((-2, 0), RuntimeError)]:
        with pytest.raises(error, match="window_size"):
            FlashAttention(window_size=bad)
        with pytest.raises(error, match="window_size"):
            MultiheadFlashAttention(64, 4, causal=True, window_size=bad)


def test_window_opcheck():
    """The ops' schemas, fake kernels and autograd registrations with window arguments given."""
    from torch.library import opcheck

    q, k, v = make_qkv(2, 37, 50, 4, 2, 16, torch.float32)
    ops = torch.ops.flash_attn_ext
    opcheck(ops.forward.default, (q, k, v, 0.25, False, 5, 2))
    out, lse, stats = ops.forward(q.detach(), k.detach(), v.detach(), 0.25, True, 9, -1)
    opcheck(ops.backward.default, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, 0.25, True,
                                   stats, 9, -1))
    cu = torch.tensor([0, 20, 37], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 50], dtype=torch.int32)
    opcheck(ops.varlen_forward.default, (q[0], k[0], v[0], cu, cu_k, 20, 30, 0.25, False, 3, 4))
    kc, vc = torch.randn(2, 64, 2, 16), torch.randn(2, 64, 2, 16)
    opcheck(ops.fwd_kvcache.default, (q[:, :1].detach(), kc, vc, None, None, torch.tensor([10, 64], dtype=torch.int32),
                                      None, 0.25, True, 0, 16, -1), test_utils=("test_schema", "test_faketensor"))


def test_window_bad_input():
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float32, requires_grad=False)
    with pytest.raises(RuntimeError, match="window_size_left must be -1 .no left bound. or >= 0, got -2"):
        flash_attn_ext.flash_attn_func(q, k, v, window_size=(-2, 0))
    with pytest.raises(RuntimeError, match="window_size_right must be -1 .no right bound. or >= 0, got -5"):
        flash_attn_ext.flash_attn_func(q, k, v, window_size=(0, -5))
    # Past int64 too: the same message with the value given (it would not reach the op's int64).
    with pytest.raises(RuntimeError, match=f"window_size_left must be -1 .no left bound. or >= 0, got {-2**70}"):
        flash_attn_ext.flash_attn_func(q, k, v, window_size=(-2**70, 0))
    for bad in [3, (1, 2, 3), "ab", (1.5, 0)]:
        with pytest.raises(TypeError, match="window_size"):
            flash_attn_ext.flash_attn_func(q, k, v, window_size=bad)
    # The fake kernel refuses what the op refuses, with the same message.
    with pytest.raises(RuntimeError, match="window_size_left must be -1"):
        torch.ops.flash_attn_ext.forward(q.to("meta"), k.to("meta"), v.to("meta"), 0.25, False, -3, -1)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="window_size_right must be -1"):
        flash_attn_ext.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, window_size=(0, -9))
    kc = torch.randn(1, 16, 2, 16)
    with pytest.raises(RuntimeError, match="window_size_left must be -1"):
        flash_attn_ext.flash_attn_with_kvcache(q, kc, kc.clone(), window_size=(-7, -1))


# ---- CUDA ------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="windowed CUDA kernel tests need a CUDA GPU (none visible)")

CUDA_SHAPES = [(1, 1), (200, 333), (333, 200), (1000, 1000), (1025, 2049)]
CUDA_WINDOWS = [(0, 0), (32, -1), (-1, 17), (100, 50), (256, 0), (5000, -1)]


@cuda
@pytest.mark.parametrize("window", CUDA_WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_window_cuda_matches_reference(arch_path, poison_empty, dtype, d, seqlens, causal, window):
    require_hdim(d, exact=True)
    sq, sk = seqlens
    q, k, v = make_qkv(2, sq, sk, 4, 2, d, dtype, device="cuda")
    check_fwd_bwd(q, k, v, lambda: _run(q, k, v, causal, window), _ref(q, k, v, causal, window))


@cuda
@pytest.mark.parametrize("d", [96, 192, 256])
def test_window_cuda_other_head_dims(arch_path, poison_empty, d):
    """The head dims whose sm90 backward runs other kernels (d96: 128-column tiles; d192 / d256:
    the roles kernels)."""
    require_hdim(d, exact=True)
    q, k, v = make_qkv(1, 700, 900, 4, 2, d, torch.bfloat16, device="cuda")
    for causal, window in [(True, (128, 0)), (False, (64, 100))]:
        check_fwd_bwd(q, k, v, lambda: _run(q, k, v, causal, window), _ref(q, k, v, causal, window))


@cuda
def test_window_cuda_sm90_forward_rows(arch_path, poison_empty):
    """The sm90 forward's windowed tiles on its other rows: d128's long-key row (non-causal, >= 8192
    keys: 144-key tiles, per-warpgroup ranges), more tiles than SMs (the persistent walk), and
    windows narrower than a key tile on the rows with per-warpgroup ranges (d64: three warpgroups;
    d256: O staged in the V ring), whose warpgroups skip steps at both ends."""
    for d, b, sq, sk, causal, window in [(128, 1, 1000, 8192, False, (300, 200)), (128, 8, 2048, 2048, True, (100, 0)),
                                         (128, 2, 640, 640, False, (5, 5)), (64, 2, 640, 640, False, (5, 5)),
                                         (64, 1, 1000, 1000, True, (40, 0)), (256, 2, 500, 700, False, (9, 3))]:
        require_hdim(d, exact=True)
        q, k, v = make_qkv(b, sq, sk, 4, 2, d, torch.bfloat16, device="cuda")
        check_fwd_bwd(q, k, v, lambda: _run(q, k, v, causal, window), _ref(q, k, v, causal, window))


@cuda
@pytest.mark.parametrize("case", [(64, 4, 4096, 4096, True, (300, 0)), (96, 4, 4096, 4200, False, (100, 50)),
                                  (96, 5, 2048, 2100, False, (100, 50)), (128, 1, 8192, 8192, False, (500, 200))],
                         ids=lambda c: f"d{c[0]}_{c[2]}x{c[3]}")
def test_window_cuda_backward_long_rows(arch_path, poison_empty, case):
    """The sm90 backward's long-query dK/dV row (tile_config.h's dkv_long_rows, from 4096 / 4096 /
    8192 queries and keys at d64 / d96 / d128; 128 keys per CTA on two warpgroups, d96 192 on three,
    P^T through shared memory) and d96's middle-length row (from 2048, 128 keys on two warpgroups)
    with a window, whose warpgroups' key rows see different query ranges, against the reference; the
    kernel names show the row ran (GQA 2:1; >= 2 CTAs of the row per SM up to 170 SMs)."""
    from test_cuda_backward import _dkv_row, _sm90_backward_runs, _sm90_rows

    d, b, sq, sk, causal, window = case
    require_hdim(d, exact=True)
    q, k, v = make_qkv(b, sq, sk, 8, 4, d, torch.bfloat16, device="cuda") if d != 128 else \
        make_qkv(b, sq, sk, 16, 8, d, torch.bfloat16, device="cuda")
    rows = _sm90_rows(lambda: check_fwd_bwd(q, k, v, lambda: _run(q, k, v, causal, window),
                                            _ref(q, k, v, causal, window)), "flash_bwd_dkv")
    expected = {_dkv_row(d, sq, sk, b * k.shape[2], torch.cuda.get_device_properties(0).multi_processor_count)}
    assert rows == (expected if _sm90_backward_runs(arch_path) else set()), rows


@cuda
@pytest.mark.parametrize("d", [64, 256])
def test_window_cuda_varlen_wg_ranges(arch_path, d):
    """Varlen with a window on the rows with per-warpgroup ranges (the V tail zeroed at step 0, tail
    skips, O in the V ring at d256) against the reference, sequences shorter and longer than a tile."""
    require_hdim(d, exact=True)
    lens_q, lens_k = [70, 1, 300, 129], [90, 5, 300, 0]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), 4, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k = torch.randn(sum(lens_k), 2, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    v = torch.randn(sum(lens_k), 2, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    for causal, window in [(True, (33, 0)), (False, (7, 7))]:
        check_fwd_bwd(
            q, k, v,
            lambda: flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 300, 300, causal=causal,
                                                          window_size=window, return_lse=True),
            lambda upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, None, causal, upcast, window_size=window))


@cuda
@pytest.mark.parametrize("causal", [True, False])
def test_window_cuda_varlen_equals_dense(arch_path, causal):
    """A packed batch with a window gives, per sequence, the dense windowed call's bits (the same
    kernels, the same arch path), gradients included. causal=False: the window (64, 0) is causal
    with a left bound whatever the lengths (flash_api.cpp: mask_args), so the one-key sequence
    alone (where the left bound hides nothing) and the packed call run the same causal row."""
    require_hdim(128, exact=True)
    lens = [300, 1, 0, 777, 129]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens), 4, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k = torch.randn(sum(lens), 2, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    v = torch.randn(sum(lens), 2, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = (64, 0)
    out = flash_attn_ext.flash_attn_varlen_func(q, k, v, cu, cu, 777, 777, causal=causal, window_size=w)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == e:
            continue
        qs, ks, vs = (t[a:e].detach().unsqueeze(0).requires_grad_() for t in (q, k, v))
        o = flash_attn_ext.flash_attn_func(qs, ks, vs, causal=causal, window_size=w)
        g = torch.autograd.grad(o, (qs, ks, vs), dout[a:e].unsqueeze(0))
        assert torch.equal(o[0], out[a:e]), b
        for x, y in zip(g, grads):
            assert torch.equal(x[0], y[a:e]), b


@cuda
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("window", [(0, 0), (255, 0), (1000, -1), (-1, 2)], ids=str)
@pytest.mark.parametrize("seqlen_q", [1, 7])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_window_cuda_kvcache(paged, window, seqlen_q, causal):
    """Split-KV decode with a window against the reference, at 1 split and several, GQA 8:2.
    Non-causal keeps the right bound (causal clips it to 0): with seqlen_q 7, (-1, 2) is a right
    bound alone, which the balanced splits take (no left bound)."""
    require_hdim(128, exact=True)
    batch, nheads, nheads_k, d, cap = 3, 8, 2, 128, 4096
    q = torch.randn(batch, seqlen_q, nheads, d, dtype=torch.bfloat16, device="cuda")
    if paged:
        k_cache = torch.randn(batch * cap // 64, 64, nheads_k, d, dtype=torch.bfloat16, device="cuda")
        block_table = torch.randperm(batch * cap // 64, dtype=torch.int32, device="cuda").reshape(batch, cap // 64)
    else:
        k_cache = torch.randn(batch, cap, nheads_k, d, dtype=torch.bfloat16, device="cuda")
        block_table = None
    v_cache = torch.randn_like(k_cache)
    cache_seqlens = torch.tensor([17, 2000, 4096], dtype=torch.int32, device="cuda")
    ref = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens, block_table, None, causal, window_size=window)
    base = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens, block_table, None, causal, upcast=False,
                                 window_size=window)
    for num_splits in (0, 1, 8):
        out, lse = flash_attn_ext.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, causal=causal,
            window_size=window, num_splits=num_splits, return_lse=True)
        check_accuracy("out", out, ref[0], base[0])
        check_accuracy("softmax_lse", lse, ref[1], base[1])


@cuda
def test_window_cuda_kernels_that_run():
    """On sm_90 windowed and unwindowed calls run the sm90 kernels, forward and backward (a refused
    tensor map or a dispatch rule would fall back to sm80 silently)."""
    if torch.cuda.get_device_capability() != (9, 0) or "90a" not in flash_attn_ext.build_info().get("cuda_archs", ""):
        pytest.skip("needs an sm_90 GPU and a build with sm_90a code")
    require_hdim(128, exact=True)
    from torch.profiler import ProfilerActivity, profile

    q, k, v = make_qkv(1, 512, 512, 2, 2, 128, torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = flash_attn_ext.flash_attn_func(q, k, v, causal=True, window_size=(64, 0))
        out.sum().backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    fwd = [n for n in names if "flash_fwd_kernel" in n]
    bwd = [n for n in names if "flash_bwd_dkv_kernel" in n or "flash_bwd_dq_kernel" in n]
    assert fwd and all("sm90" in n for n in fwd), fwd
    assert bwd and all("sm90" in n for n in bwd), bwd
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = flash_attn_ext.flash_attn_func(q, k, v, causal=True)
        out.sum().backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "flash_fwd_kernel" in e.name or "flash_bwd_d" in e.name]
    assert names and all("sm90" in n for n in names), names


_TWIN_KERNEL = re.compile(r"flash_(fwd|bwd_dkv|bwd_dq)(_roles)?_kernel")


def _twin_flags(name: str) -> tuple[bool, bool]:
    """(kLocal, kSoftcap) of a kernel's profiler name, demangled (`..., true, false>(`) or not
    (`Lb1ELb0EEEv`): the kernel's trailing bool template arguments are the twins' flags, kLocal and
    kSoftcap first, then any later twin's (kDropout: tests/test_dropout.py), except in the sm90
    backward kernels, whose first is kTma."""
    flags = kernel_bool_args(name)
    if "sm90" in name and "bwd" in name:
        flags = flags[1:]  # kTma
    assert len(flags) >= 2, f"no (kLocal, kSoftcap) template arguments in {name!r}"
    return flags[0], flags[1]


def test_local_twin_parser():
    """_twin_flags reads (kLocal, kSoftcap), demangled or mangled, with or without kTma before them and
    later twins' flags after them; kernel_bool_args reads every trailing bool."""
    dkv = ("void flash::sm90::flash_bwd_dkv_kernel<__nv_bfloat16, 64, flash::sm90::DkvTile<64>, true, false, true>"
           "(flash::Flash_bwd_params, flash::sm90::BwdTmaMaps)")
    fwd = ("void flash::sm90::flash_fwd_kernel<flash::sm90::FwdKernelTraits<__nv_bfloat16, 128, "
           "flash::sm90::FwdTile<128> >, true, false>(flash::Flash_fwd_params, flash::sm90::FwdTmaMaps, "
           "flash::FwdTileScheduler<128>)")
    sm80_dq = ("void flash::sm80::flash_bwd_dq_kernel<__half, 64, flash::sm80::DqTile<64>, false, true, false>"
               "(flash::Flash_bwd_params)")
    assert _twin_flags(dkv) == (False, True) and _twin_flags(fwd) == (True, False)
    assert _twin_flags(sm80_dq) == (False, True)
    dkv_mangled = "_ZN5flash4sm9020flash_bwd_dkv_kernelI13__nv_bfloat16Li64ENS0_7DkvTileILi64EEELb0ELb1ELb0EEEvNS_16F"
    fwd_mangled = "_ZN5flash4sm8016flash_fwd_kernelINS0_15FwdKernelTraitsI13__nv_bfloat16Li128EEELb0ELb1EEEvNS_16F"
    fwd3_mangled = "_ZN5flash4sm8016flash_fwd_kernelINS0_15FwdKernelTraitsI13__nv_bfloat16Li128EEELb1ELb0ELb0EEEvNS_16F"
    assert _twin_flags(dkv_mangled) == (True, False) and _twin_flags(fwd_mangled) == (False, True)
    assert _twin_flags(fwd3_mangled) == (True, False)
    # kernel_bool_args (conftest) on the split-KV kernels' names (cuobjdump -symbols): kBalanced last.
    split = ("_ZN5flash4sm8024flash_fwd_splitkv_kernelINS0_19SplitKvKernelTraitsI13__nv_bfloat16Li128ENS0_11SplitKvTile"
             "ILi128EEEEELb0ELb0ELb0ELb1EEEvNS_16Flash_fwd_paramsENS_9KvTmaMapsE")
    combine = "_ZN5flash32flash_fwd_splitkv_combine_kernelI13__nv_bfloat16Li16ELb1EEEvNS_16Flash_fwd_paramsE"
    combine_demangled = "void flash::flash_fwd_splitkv_combine_kernel<__half, 4, false>(flash::Flash_fwd_params)"
    assert kernel_bool_args(split) == [False, False, False, True] and kernel_bool_args(combine) == [True]
    assert kernel_bool_args(combine_demangled) == [False]


@cuda
@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("d", [64, 128])
def test_window_left_bound_runs_the_local_twins(arch_path, d, softcap):
    """A call with a window's left bound runs the kernels' kLocal twins, forward and backward, and
    the split-KV decode; a call without one (plain causal, or a right bound alone) the twins
    compiled for the causal mask alone (common/mask.cuh; docs/DESIGN.md), on both arch paths. Each
    with softcap > 0 the kSoftcap twin of that (tests/test_softcap.py), softcap 0 the one without
    the cap (the code as before it)."""
    require_hdim(d, exact=True)
    from torch.profiler import ProfilerActivity, profile

    q, k, v = make_qkv(2, 300, 400, 4, 2, d, torch.bfloat16, device="cuda")
    for causal, window, local in [(True, (64, 0), True), (False, (50, 20), True), (True, (-1, -1), False),
                                  (False, (-1, 3), False), (False, (-1, -1), False)]:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = flash_attn_ext.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)
            out.sum().backward()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if _TWIN_KERNEL.search(e.name)]
        kinds = {m.group(1) for m in map(_TWIN_KERNEL.search, names)}
        assert kinds == {"fwd", "bwd_dkv", "bwd_dq"}, (causal, window, names)
        assert all(_twin_flags(n) == (local, softcap > 0) for n in names), (causal, window, names)
        q.grad = k.grad = v.grad = None
    # Decode against a KV cache: the split-KV kernel's twins.
    qd = torch.randn(2, 1, 4, d, dtype=torch.bfloat16, device="cuda")
    k_cache = torch.randn(2, 1024, 2, d, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    cache_seqlens = torch.tensor([700, 1024], dtype=torch.int32, device="cuda")
    for window, local in [((255, 0), True), ((-1, -1), False)]:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            flash_attn_ext.flash_attn_with_kvcache(qd, k_cache, v_cache, cache_seqlens=cache_seqlens, causal=True,
                                                   window_size=window, num_splits=4, softcap=softcap)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if "flash_fwd_splitkv_kernel" in e.name]
        assert names and all(_twin_flags(n) == (local, softcap > 0) for n in names), (window, names)


def test_window_huge_values_are_unbounded():
    """A window side past any length (even past int64) is no bound: the unwindowed bits."""
    q, k, v = make_qkv(1, 20, 30, 2, 1, 16, torch.float32, requires_grad=False)
    base = _run(q, k, v, True, (-1, -1))
    for w in [(2**40, 0), (2**63, 2**70)]:
        for a, b in zip(_run(q, k, v, True, w), base):
            assert torch.equal(a, b), w
