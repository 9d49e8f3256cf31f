"""ALiBi (Press et al. 2022, "Train Short, Test Long", section 3; flash-attn's ``alibi_slopes``): the
logit of query i and key j gets -slope[b, h] * |i + seqlen_k - seqlen_q - j| (bottom-right aligned,
as the masks), so P, out and softmax_lse are those of the biased logits and the gradients of q, k, v
follow (the bias is a constant of S: dS is unchanged).

Every numeric case is checked against the float64 reference with the bias materialised by
``reference.alibi_bias`` under the accuracy rule (tests/accuracy.py). The CPU cells run in CI; the
CUDA ones on each arch path.
"""

import pytest
import torch

import flash_attn_ext
from accuracy import check_accuracy
from conftest import VARLEN_LENS_K, VARLEN_LENS_Q, check_fwd_bwd, make_qkv, make_varlen_qkv, require_hdim, run_hdim
from flash_attn_ext.reference import alibi_bias, alibi_geometric_slopes, attention_ref, attention_varlen_ref

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _devices():
    return ["cpu", pytest.param("cuda", marks=CUDA)]


def _dtypes(device):
    return [torch.float16, torch.bfloat16] + ([torch.float32, torch.float64] if device == "cpu" else [])


def _slopes(nheads, batch=None, device="cpu"):
    """ALiBi's geometric slopes 2^(-8 (h + 1) / nheads) (the paper's, section 3), per batch row
    scaled differently when ``batch`` is given, so a wrong row would show."""
    base = alibi_geometric_slopes(nheads)
    if batch is not None:
        base = base * torch.linspace(0.5, 1.5, batch).view(-1, 1)
    return base.float().to(device)


def _cells():
    # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
    return [(2, 128, 128, 4, 4, 64), (1, 77, 200, 4, 2, 128), (2, 200, 67, 6, 1, 32), (1, 1, 300, 2, 2, 96),
            (1, 129, 129, 2, 2, 256), (2, 150, 333, 4, 2, 192)]


def test_alibi_bias_values():
    """The reference's bias on a tiny case, by hand: -slope * |i + sk - sq - j|."""
    bias = alibi_bias(torch.tensor([0.5, 2.0]), 1, 2, 2, 3, torch.float64)
    want = -torch.tensor([[[1.0, 0.0, 1.0], [2.0, 1.0, 0.0]]]) * torch.tensor([0.5, 2.0]).view(2, 1, 1)
    assert torch.equal(bias[0], want.double())


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("shape", _cells())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi_matches_reference(device, shape, causal, per_batch, poison_empty, arch_path):
    """flash_attn_func with alibi_slopes ((nheads,) or (batch, nheads)) against the float64 reference,
    forward, LSE and gradients."""
    b, sq, sk, h, hk, d = shape
    if device == "cuda":
        require_hdim(d)
    slopes = _slopes(h, b if per_batch else None, device)
    for dtype in _dtypes(device)[:2] if device == "cuda" or d > 64 else _dtypes(device):
        q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device)
        check_fwd_bwd(
            q, k, v,
            lambda: flash_attn_ext.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes, return_lse=True),
            lambda upcast: attention_ref(q, k, v, None, causal, upcast=upcast, alibi_slopes=slopes))


@CUDA
@pytest.mark.parametrize("shape", [(1, 128, 8192, 2, 1, 128), (2, 4096, 4096, 9, 9, 96), (2, 2048, 2048, 9, 9, 96)])
def test_alibi_long_rows(shape, poison_empty, arch_path):
    """The ALiBi twins of the sm90 path's long tile rows (FwdLongTile: d128, dense non-causal, >= 8192
    keys; DkvLongTile: d96, 4096 x 4096 with >= 2 of its 192-key CTAs per SM: 396; DkvMidTile: d96,
    2048 x 2048, 288 of its 128-key CTAs) against the float64 reference; at d96 the kernel names show
    the dK/dV row that ran."""
    from test_cuda_backward import _dkv_row, _sm90_backward_runs, _sm90_rows

    b, sq, sk, h, hk, d = shape
    require_hdim(d)
    slopes = _slopes(h, b, "cuda")
    q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda")
    rows = _sm90_rows(lambda: check_fwd_bwd(
        q, k, v, lambda: flash_attn_ext.flash_attn_func(q, k, v, alibi_slopes=slopes, return_lse=True),
        lambda upcast: attention_ref(q, k, v, None, False, upcast=upcast, alibi_slopes=slopes)), "flash_bwd_dkv")
    if d == 96 and _sm90_backward_runs(arch_path):
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert rows == {_dkv_row(run_hdim(d), sq, sk, b * hk, num_sms)}, rows


@pytest.mark.parametrize("device", _devices())
def test_alibi_with_sinks_window_right_and_negative_scale(device, poison_empty, arch_path):
    """ALiBi beside what it combines with: attention sinks, a window's right bound, a negative
    softmax_scale (the kernels hold the bias in units of the scaled score)."""
    q, k, v = make_qkv(2, 70, 90, 4, 2, 64, torch.bfloat16, device)
    slopes = _slopes(4, 2, device)
    sinks = torch.randn(4, device=device)
    for kwargs in (dict(sinks=sinks, causal=True), dict(window_size=(-1, 5)), dict(softmax_scale=-0.1)):
        check_fwd_bwd(
            q, k, v,
            lambda: flash_attn_ext.flash_attn_func(q, k, v, alibi_slopes=slopes, return_lse=True, **kwargs),
            lambda upcast: attention_ref(q, k, v, kwargs.get("softmax_scale"), kwargs.get("causal", False),
                                         upcast=upcast, window_size=kwargs.get("window_size", (-1, -1)),
                                         sinks=kwargs.get("sinks"), alibi_slopes=slopes))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 256])
def test_varlen_alibi(device, causal, d, poison_empty, arch_path):
    """Packed sequences: sequence b gets batch b's slopes and its own positions (bottom-right per
    sequence), forward and gradients; an empty sequence included."""
    if device == "cuda":
        require_hdim(d)
    for slopes in (_slopes(4, None, device), _slopes(4, len(VARLEN_LENS_Q), device)):
        q, k, v, cu_q, cu_k = make_varlen_qkv(4, 2, d, torch.bfloat16, device)
        check_fwd_bwd(
            q, k, v,
            lambda: flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(VARLEN_LENS_Q), max(VARLEN_LENS_K),
                                                          causal=causal,
                                                          alibi_slopes=slopes, return_lse=True),
            lambda upcast: attention_varlen_ref(q, k, v, cu_q.cpu(), cu_k.cpu(), None, causal, upcast=upcast,
                                                alibi_slopes=slopes))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("seqlen_q, ratio", [(1, 8), (3, 4), (20, 1)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_alibi(device, page_size, seqlen_q, ratio, num_splits, causal, poison_empty):
    """flash_attn_with_kvcache with (batch, nheads) slopes: decode and a chunk, GQA packing (the
    split-KV kernel's packed rows are (query, head) pairs: each row its head's slope), an append,
    contiguous and paged caches, split or not, causal or not; against the reference on the cache
    after the append (the sequence's keys: cache_seqlens[b] + seqlen_new)."""
    from test_kvcache import make_cache
    from flash_attn_ext.reference import attention_kvcache_ref

    batch, seqlen_cache, nheads_k, d, seqlen_new = 3, 96, 2, 64, 2
    nheads = nheads_k * ratio
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    k_cache, v_cache, table = make_cache(batch, seqlen_cache, nheads_k, d, dtype, page_size)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    table = table.to(device) if table is not None else None
    cache_seqlens = torch.tensor([0, 37, seqlen_cache - seqlen_new], dtype=torch.int32, device=device)
    q = torch.randn(batch, seqlen_q, nheads, d, dtype=dtype, device=device)
    k_new, v_new = (torch.randn(batch, seqlen_new, nheads_k, d, dtype=dtype, device=device) for _ in range(2))
    slopes = _slopes(nheads, batch, device)
    out, lse = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                      block_table=table, causal=causal, num_splits=num_splits,
                                                      alibi_slopes=slopes, return_lse=True)
    used = cache_seqlens + seqlen_new
    ref, ref_lse = attention_kvcache_ref(q, k_cache, v_cache, used, table, causal=causal, alibi_slopes=slopes)
    base, base_lse = attention_kvcache_ref(q, k_cache, v_cache, used, table, causal=causal, upcast=False,
                                           alibi_slopes=slopes)
    check_accuracy("out", out, ref, base)
    check_accuracy("softmax_lse", lse, ref_lse, base_lse)


@pytest.mark.parametrize("device", _devices())
def test_kvcache_alibi_leftpad_and_cache_batch_idx(device, poison_empty):
    """A left-padded cache counts its keys from the leftpad (the bias's j and the sequence's key count
    both), and with cache_batch_idx the slopes follow q's sequence, not the cache entry."""
    from test_kvcache import make_cache

    batch, seqlen_cache, nheads, nheads_k, d = 3, 64, 8, 2, 64
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    k_cache, v_cache, _ = make_cache(batch, seqlen_cache, nheads_k, d, dtype)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    q = torch.randn(batch, 3, nheads, d, dtype=dtype, device=device)
    slopes = _slopes(nheads, batch, device)
    cache_seqlens = torch.tensor([20, 40, 64], dtype=torch.int32, device=device)
    leftpad = torch.tensor([0, 7, 30], dtype=torch.int32, device=device)
    out = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                                 cache_leftpad=leftpad, causal=True, alibi_slopes=slopes)
    idx = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    out_idx = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens[idx.long()],
                                                     cache_batch_idx=idx, alibi_slopes=slopes)
    cases = [(out, b, slice(int(leftpad[b]), int(cache_seqlens[b])), True) for b in range(batch)]
    cases += [(out_idx, b, slice(0, int(cache_seqlens[idx[b]])), False) for b in range(batch)]
    for got, b, keys, causal in cases:
        entry = b if got is out else int(idx[b])
        kb, vb = k_cache[entry, keys][None], v_cache[entry, keys][None]
        ref, _ = attention_ref(q[b:b + 1], kb, vb, None, causal, alibi_slopes=slopes[b])
        base, _ = attention_ref(q[b:b + 1], kb, vb, None, causal, upcast=False, alibi_slopes=slopes[b])
        check_accuracy("out", got[b:b + 1], ref, base)


def test_paged_varlen_alibi_with_a_window_that_hides_nothing():
    """Paged varlen judges a window's left bound by max_seqlen_k, as the varlen op does (not by the
    pages' capacity): one that hides no key runs with ALiBi, the same output as without it."""
    from test_varlen import _paged_case

    lens_q, lens_k = [5, 9], [20, 33]
    q, kc, vc, table, k, v, cu_q, cu_k = _paged_case(lens_q, lens_k, 4, 2, 32, torch.float32, 16, "cpu")
    slopes = _slopes(4, 2)
    args = (q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k))
    want = flash_attn_ext.flash_attn_varlen_func(*args, causal=True, block_table=table, alibi_slopes=slopes)
    got = flash_attn_ext.flash_attn_varlen_func(*args, causal=True, block_table=table, alibi_slopes=slopes,
                                                window_size=(max(lens_k) - 1, 0))
    assert torch.equal(got, want)


def test_alibi_gradcheck_and_forward_ad():
    """float64 gradcheck (reverse and forward mode) through the op with (batch, nheads) slopes; the
    slopes themselves get no gradient (as flash-attn's), so slopes that require grad are refused."""
    q, k, v = make_qkv(1, 5, 7, 2, 1, 16, torch.float64)
    slopes = _slopes(2, 1).double().float()

    def f(q, k, v):
        return flash_attn_ext.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)

    assert torch.autograd.gradcheck(f, (q, k, v), check_forward_ad=True)
    slopes.requires_grad_(True)  # learnable slopes would get no gradient: refused, not silently frozen
    with pytest.raises(NotImplementedError, match="alibi_slopes that require grad"):
        f(q, k, v)
    with torch.no_grad():
        f(q, k, v)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alibi_huge_finite_slopes_never_nan(device, dtype):
    """Finite slopes whose bias overflows float32 (1e38 x distance) give no NaN: a key whose bias
    overflows is invisible (-inf), a row whose every key overflows is one without keys (out 0, LSE
    +inf), the others attend their nearest keys (the CPU twin once gave NaN rows: exp2(-inf - -inf))."""
    if dtype == torch.float32 and device == "cuda":
        pytest.skip("the CUDA kernels take 16-bit inputs")
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 8, 3, 1, 1, 16, dtype, device, requires_grad=False)
    out, lse = flash_attn_ext.flash_attn_func(q, k, v, alibi_slopes=torch.tensor([1e38], device=device),
                                              return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    # Query i's nearest key is i - 5 (seqlen_k - seqlen_q = -5): rows 5..7 see it at distance 0.
    torch.testing.assert_close(out[0, 5:, 0].float(), v[0, :, 0].float())


def test_alibi_learnable_slopes_refused_on_the_raw_ops():
    """Slopes that require grad are refused by the raw ops too (dense and varlen), not given None."""
    q, k, v = make_qkv(1, 6, 6, 2, 2, 16, torch.float32)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    learnable = _slopes(2).requires_grad_(True)
    with pytest.raises(NotImplementedError, match="alibi_slopes that require grad"):
        torch.ops.flash_attn_ext.forward(q, k, v, 0.25, False, alibi_slopes=learnable)
    with pytest.raises(NotImplementedError, match="alibi_slopes that require grad"):
        torch.ops.flash_attn_ext.varlen_forward(q[0], k[0], v[0], cu, cu, 6, 6, 0.25, False, alibi_slopes=learnable)


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi_forward_mode_tangents(per_batch):
    """Forward mode carries the slopes' tangent (the bias is linear in them): torch.func.jvp and
    forward_ad dual slopes match the float64 reference's jvp (attention_ref, float64 slopes of the
    same values), dense and varlen; the varlen tangent of q equals the dense one per sequence with
    (nheads,) and (batch, nheads) slopes (it once dropped (nheads,) slopes)."""
    import torch.autograd.forward_ad as fwAD
    torch.manual_seed(0)
    q, k, v = make_qkv(2, 7, 9, 4, 2, 16, torch.float64, requires_grad=False)
    slopes = _slopes(4, 2) if per_batch else _slopes(4)
    tangent = torch.randn_like(slopes)
    cu_q, cu_k = torch.tensor([0, 7, 14], dtype=torch.int32), torch.tensor([0, 9, 18], dtype=torch.int32)

    def dense(s, q=q):
        return flash_attn_ext.flash_attn_func(q, k, v, causal=True, alibi_slopes=s)

    def varlen(s, q=q):
        return flash_attn_ext.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k,
                                                     7, 9, causal=True, alibi_slopes=s).unflatten(0, (2, 7))

    _, want = torch.func.jvp(lambda s: attention_ref(q, k, v, causal=True, alibi_slopes=s)[0], (slopes.double(),),
                             (tangent.double(),))
    _, got = torch.func.jvp(dense, (slopes,), (tangent,))
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)
    q_t = torch.randn_like(q)
    with fwAD.dual_level():
        for f in (dense, varlen):
            got = fwAD.unpack_dual(f(fwAD.make_dual(slopes, tangent))).tangent
            torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)
        dense_q_t = fwAD.unpack_dual(dense(slopes, fwAD.make_dual(q, q_t))).tangent
        varlen_q_t = fwAD.unpack_dual(varlen(slopes, fwAD.make_dual(q, q_t))).tangent
    torch.testing.assert_close(varlen_q_t, dense_q_t, atol=1e-12, rtol=1e-12)


def test_alibi_under_non_reentrant_checkpointing():
    """torch.utils.checkpoint(use_reentrant=False): the backward reads the saved slopes with the other
    saved tensors, once; gradients equal the plain call's (dense and varlen)."""
    q, k, v = make_qkv(2, 20, 30, 4, 2, 32, torch.float32)
    slopes = _slopes(4, 2)
    cu_q, cu_k = torch.tensor([0, 20, 40], dtype=torch.int32), torch.tensor([0, 30, 60], dtype=torch.int32)
    for f in (lambda q, k, v: flash_attn_ext.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes),
              lambda q, k, v: flash_attn_ext.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                                                    cu_q, cu_k, 20, 30, alibi_slopes=slopes)):
        dout = torch.randn_like(f(q, k, v))
        want = torch.autograd.grad(f(q, k, v), (q, k, v), dout)
        got = torch.autograd.grad(torch.utils.checkpoint.checkpoint(f, q, k, v, use_reentrant=False), (q, k, v), dout)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_alibi_vmap_per_sample_slopes():
    """vmap over the slopes (a different (nheads,) or (batch, nheads) tensor per sample) and over q:
    vmap(f)(x)[i] = f(x[i])."""
    q, k, v = make_qkv(2, 9, 11, 4, 2, 16, torch.float64, requires_grad=False)

    def f(q, slopes):
        return flash_attn_ext.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)

    for slopes in (torch.rand(3, 4), torch.rand(3, 2, 4)):
        want = torch.stack([f(q, s) for s in slopes])
        assert torch.equal(torch.vmap(f, in_dims=(None, 0))(q, slopes), want)
    qs = torch.stack([q, 0.5 * q])
    slopes = _slopes(4, 2)
    assert torch.equal(torch.vmap(f, in_dims=(0, None))(qs, slopes), torch.stack([f(x, slopes) for x in qs]))


def test_alibi_compiles_and_opcheck():
    """The ops with alibi_slopes pass torch.library.opcheck (schema, fake kernel, autograd) and a
    fullgraph compile gives the eager bits."""
    q, k, v = make_qkv(2, 16, 24, 4, 2, 32, torch.float32)
    slopes = _slopes(4, 2)
    out, lse, stats = torch.ops.flash_attn_ext.forward(q, k, v, 0.2, True, -1, -1, None, 0.0, 0.0, None, slopes)
    torch.library.opcheck(torch.ops.flash_attn_ext.forward, (q, k, v, 0.2, True, -1, -1, None, 0.0, 0.0, None, slopes))
    dout = torch.randn_like(out)
    qd, kd, vd, od = (t.detach() for t in (q, k, v, out))  # the backward op has no gradient of its own
    torch.library.opcheck(torch.ops.flash_attn_ext.backward,
                          (dout, qd, kd, vd, od, lse, 0.2, True, stats, -1, -1, None, 0.0, 0.0, None, slopes))
    cu = torch.tensor([0, 16, 32], dtype=torch.int32)
    qv, kv, vv = (t.detach().flatten(0, 1)[:32].requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flash_attn_ext.varlen_forward,
                          (qv, kv, vv, cu, cu, 16, 16, 0.2, True, -1, -1, None, 0.0, 0.0, None, slopes))

    def f(q, k, v):
        return flash_attn_ext.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.equal(compiled(q, k, v), f(q, k, v))


@pytest.mark.parametrize("device", _devices())
def test_alibi_bad_input(device):
    """Wrong slopes and the combinations the kernels' ALiBi twin lacks: errors naming them, before any work."""
    q, k, v = make_qkv(2, 16, 24, 4, 2, 32, torch.bfloat16, device, requires_grad=False)
    call = flash_attn_ext.flash_attn_func
    with pytest.raises(RuntimeError, match=r"alibi_slopes has dtype torch.float32 and shape \[2, 3\]; expected "
                                           r"float32 of shape \(nheads,\) = \(4,\) or \(batch, nheads\) = \(2, 4\)"):
        call(q, k, v, alibi_slopes=torch.ones(2, 3, device=device))
    with pytest.raises(RuntimeError, match="alibi_slopes has dtype torch.bfloat16"):
        call(q, k, v, alibi_slopes=torch.ones(4, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="alibi_slopes with softmax_scale = 0"):
        call(q, k, v, softmax_scale=0.0, alibi_slopes=_slopes(4, device=device))
    for kwargs, what in ((dict(softcap=30.0), "softcap > 0"), (dict(dropout_p=0.1), "dropout_p > 0"),
                         (dict(window_size=(3, 0)), "a sliding window's left bound")):
        with pytest.raises(NotImplementedError, match="alibi_slopes with " + what):
            call(q, k, v, alibi_slopes=_slopes(4, device=device), **kwargs)
    if device == "cpu":
        with pytest.raises(RuntimeError, match="alibi_slopes"):
            call(q, k, v, alibi_slopes=_slopes(4, device="meta"))
    # A slope past float32's range in score units (|slope / softmax_scale| > 3.4e38) keeps only the
    # nearest key, as the exact bias does: finite, never NaN.
    huge = torch.full((4,), 3e38, device=device)
    out = call(q, k, v, softmax_scale=0.5, alibi_slopes=huge)
    ref, _ = attention_ref(q, k, v, 0.5, alibi_slopes=huge)
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max() < 1e-2
