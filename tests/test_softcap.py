"""Logit soft-capping (Gemma 2; flash-attn >= 2.6's ``softcap``): ``softcap=`` on every entry point.

Semantics (flash_attn_ext.reference.attention_ref(..., softcap=)): with softcap > 0 the logit of
score S_ij = q_i . k_j is softcap * tanh(S_ij * softmax_scale / softcap) instead of
S_ij * softmax_scale (Gemma Team et al. 2024, "Gemma 2: Improving Open Language Models at a
Practical Size", section 2, "Logit soft-capping"). The softmax, the masks (causal, sliding window),
softmax_lse and softmax_stats are those of the capped logits; a sink's logit is not capped. The
backward's dS = P (dP - D) gains the factor 1 - t^2, t = tanh(S * softmax_scale / softcap), before
the usual softmax_scale. softcap = 0.0 is none: the bits of a call without it. The kernels hold the
cap as float32: every cap here is exact in float32, so the float64 reference sees the same one.

Every numeric case is checked with the accuracy rule (tests/accuracy.py) against the float64
reference, gradients included; inputs are random (never zeros) and outputs poisoned
(conftest.poison_empty). The CPU ones run in CI; the CUDA ones on each arch path of the GPU
(conftest.py: arch_path, "auto" and, on an sm_90 GPU with sm_90a code, "sm80" forced by
flash_attn_ext.force_sm80_path). The Hugging Face Gemma 2 path is in tests/test_integrations.py.
"""

import math

import pytest
import torch

import flash_attn_ext
from accuracy import check_accuracy
from conftest import check_fwd_bwd, make_qkv, require_hdim
from test_sinks import _cuda_cache, _cuda_kvcache_case, _kvcache_case, _varlen_inputs, check_fwd_bwd_sinks, make_sinks
from flash_attn_ext.reference import attention_kvcache_ref, attention_ref, attention_varlen_ref, visible_mask

SOFTCAPS = [5.0, 50.0]  # a cap random scores reach, and Gemma 2's


def _run(q, k, v, softcap, causal=False, window=(-1, -1), **kw):
    return flash_attn_ext.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                          return_lse=True, **kw)


def _ref(q, k, v, softcap, causal=False, window=(-1, -1), softmax_scale=None, sinks=None):
    def reference(upcast):
        return attention_ref(q, k, v, softmax_scale, causal, upcast=upcast, window_size=window, sinks=sinks,
                             softcap=softcap)

    # test_sinks.check_fwd_bwd_sinks: the 16-bit dS baselines of FlashAttention-2 Alg. 2 (softcap included)
    reference.problem = (q, k, v, sinks, causal, window, softmax_scale, softcap)
    return reference


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


# ---- the reference itself: the formula written out -----------------------------------------

def test_reference_formula():
    """attention_ref(softcap=c) is softmax over c tanh(scale q.k / c) (row by row, float64), its LSE
    that of the capped logits; a cap far above every logit is the plain attention."""
    q, k, v = make_qkv(2, 9, 6, 4, 2, 8, torch.float64, requires_grad=False)
    scale, cap = 0.7, 1.5
    out, lse = attention_ref(q, k, v, scale, softcap=cap)
    kk, vv = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    for b in range(2):
        for h in range(4):
            for i in range(9):
                logits = torch.tensor([cap * math.tanh(scale * float(q[b, i, h] @ kk[b, j, h]) / cap)
                                       for j in range(6)], dtype=torch.float64)
                p = torch.softmax(logits, 0)
                torch.testing.assert_close(out[b, i, h], p @ vv[b, :, h], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(lse[b, h, i].double(), torch.logsumexp(logits, 0), rtol=1e-6, atol=0)
    assert (lse <= cap + math.log(6) + 1e-6).all()  # capped logits: LSE <= cap + log(keys)
    plain = attention_ref(q, k, v, scale)
    for a, b in zip(attention_ref(q, k, v, scale, softcap=1e7), plain):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-9, atol=1e-9)


# ---- CPU (CI) --------------------------------------------------------------------------------

# (seqlen_q, seqlen_k): more keys than queries, more queries (causal rows without keys), square;
# ragged against the 64-row CPU tiles.
CPU_SHAPES = [(113, 251), (251, 113), (70, 70)]


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("nheads_k", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", CPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softcap_cpu_matches_reference(poison_empty, dtype, seqlens, causal, nheads_k, softcap):
    sq, sk = seqlens
    q, k, v = make_qkv(2, sq, sk, 4, nheads_k, 32, dtype)
    check_fwd_bwd(q, k, v, lambda: _run(q, k, v, softcap, causal), _ref(q, k, v, softcap, causal))


@pytest.mark.parametrize("dtype,d", [(torch.float64, 8), (torch.float64, 72), (torch.float16, 64),
                                     (torch.float32, 128), (torch.float32, 256)], ids=str)
def test_softcap_cpu_dtypes_and_head_dims(poison_empty, dtype, d):
    """The other CPU dtypes (float64: float64 accumulation; float16: float32) and head dims."""
    q, k, v = make_qkv(1, 37, 50, 4, 2, d, dtype)
    for causal in (False, True):
        check_fwd_bwd(q, k, v, lambda: _run(q, k, v, 5.0, causal), _ref(q, k, v, 5.0, causal))


@pytest.mark.parametrize("window", [(16, 4), (5, -1), (-1, 3), (0, 0)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_cpu_window(poison_empty, causal, window):
    """Sliding windows with soft-capping (the mask applies to the capped logits), GQA 4:2."""
    q, k, v = make_qkv(2, 113, 251, 4, 2, 32, torch.float32)
    check_fwd_bwd(q, k, v, lambda: _run(q, k, v, 5.0, causal, window), _ref(q, k, v, 5.0, causal, window))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softcap_cpu_scores_far_beyond_the_cap(poison_empty, dtype, causal):
    """A large softmax_scale: scaled scores of tens to hundreds against a cap of 5 (most logits
    saturate at +-5, where 1 - t^2 ~ 0): the reference's result within the rule; the LSE bounded by
    cap + log(keys); the uncapped call is another function (it fails the rule against the capped
    reference)."""
    q, k, v = make_qkv(2, 70, 130, 4, 2, 32, dtype)
    scale, cap = 4.0, 5.0
    out, lse, _ = check_fwd_bwd(q, k, v, lambda: _run(q, k, v, cap, causal, softmax_scale=scale),
                                _ref(q, k, v, cap, causal, softmax_scale=scale))
    finite = torch.isfinite(lse)
    assert (lse[finite] <= cap + math.log(130) + 1e-3).all()
    plain = flash_attn_ext.flash_attn_func(q, k, v, causal=causal, softmax_scale=scale)
    ref, base = (attention_ref(q, k, v, scale, causal, upcast=u, softcap=cap)[0] for u in (True, False))
    with pytest.raises(AssertionError):
        check_accuracy("uncapped out", plain, ref, base)


@pytest.mark.parametrize("scale", [-0.6, 0.0])
def test_softcap_cpu_negative_and_zero_scale(scale):
    """softmax_scale < 0 and = 0 with a cap (the CUDA path runs them as |scale| on -q and scale 1
    on q = 0: flash_api.cpp positive_scale): the reference's result, gradients included."""
    q, k, v = make_qkv(1, 20, 30, 2, 1, 16, torch.float64)
    check_fwd_bwd(q, k, v, lambda: _run(q, k, v, 1.5, True, softmax_scale=scale),
                  _ref(q, k, v, 1.5, True, softmax_scale=scale))


@pytest.mark.parametrize("entry", ["dense", "varlen", "kvcache", "raw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softcap_zero_is_the_plain_call_cpu(dtype, entry):
    """softcap 0 (0.0, the int 0, -0.0) is no soft-capping: the bits of a call without the keyword,
    forward and backward."""
    _check_zero_is_plain(dtype, entry, "cpu")


def _check_zero_is_plain(dtype, entry, device):
    q, k, v = make_qkv(2, 70, 90, 4, 2, 64, dtype, device=device)
    dout = torch.randn(2, 70, 4, 64, dtype=dtype, device=device)
    if entry == "dense":
        want = flash_attn_ext.flash_attn_func(q, k, v, causal=True, window_size=(40, 0), return_lse=True)
        want_grads = _grads(want[0], (q, k, v), dout)
        for zero in (0.0, 0, -0.0):
            got = flash_attn_ext.flash_attn_func(q, k, v, causal=True, window_size=(40, 0), return_lse=True,
                                                 softcap=zero)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), zero
            assert all(torch.equal(a, b) for a, b in zip(_grads(got[0], (q, k, v), dout), want_grads)), zero
    elif entry == "varlen":
        cu = torch.tensor([0, 30, 30, 70], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 50, 60, 90], dtype=torch.int32, device=device)
        args = (q[0], k[0], v[0], cu, cu_k, 40, 50)
        want = flash_attn_ext.flash_attn_varlen_func(*args, causal=True, return_lse=True)
        got = flash_attn_ext.flash_attn_varlen_func(*args, causal=True, return_lse=True, softcap=0.0)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert all(torch.equal(a, b) for a, b in zip(_grads(got[0], (q, k, v), dout[0]),
                                                       _grads(want[0], (q, k, v), dout[0])))
    elif entry == "kvcache":
        with torch.no_grad():
            k_cache, v_cache = k.detach().clone(), v.detach().clone()
            lens = torch.tensor([17, 88], dtype=torch.int32, device=device)
            kw = dict(cache_seqlens=lens, causal=True, num_splits=3, return_lse=True)
            want = flash_attn_ext.flash_attn_with_kvcache(q[:, :2], k_cache, v_cache, k[:, :2], v[:, :2], **kw)
            got = flash_attn_ext.flash_attn_with_kvcache(q[:, :2], k_cache, v_cache, k[:, :2], v[:, :2], softcap=0.0,
                                                         **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    else:
        ops = torch.ops.flash_attn_ext
        qd, kd, vd = (t.detach() for t in (q, k, v))
        want = ops.forward(qd, kd, vd, 0.3, False, 7, 9, None)
        got = ops.forward(qd, kd, vd, 0.3, False, 7, 9, None, 0.0)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        want_g = ops.backward(dout, qd, kd, vd, *want[:2], 0.3, False, want[2], 7, 9, None)
        got_g = ops.backward(dout, qd, kd, vd, *want[:2], 0.3, False, want[2], 7, 9, None, 0.0)
        assert all(torch.equal(a, b) for a, b in zip(got_g, want_g))
        s = torch.randn(4, device=device)
        out, lse, stats = ops.forward(qd, kd, vd, 0.3, True, -1, -1, s)
        want_d = ops.backward_dsinks(dout, qd, kd, vd, out, lse, 0.3, True, stats, -1, -1, s)
        got_d = ops.backward_dsinks(dout, qd, kd, vd, out, lse, 0.3, True, stats, -1, -1, s, 0.0)
        assert all(torch.equal(a, b) for a, b in zip(got_d, want_d))


@pytest.mark.parametrize("window", [(-1, -1), (7, 0), (3, 2)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_varlen_cpu(causal, window):
    """Packed sequences (a zero-length one, one without keys) with a cap: the per-sequence
    reference within the rule, and each sequence the dense call's bits on it alone."""
    lens_q, lens_k = [5, 0, 70, 33, 9], [9, 4, 70, 0, 2]
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, 16, torch.float32)
    out, lse, _ = check_fwd_bwd(
        q, k, v,
        lambda: flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 70, 70, causal=causal, window_size=window,
                                                      softcap=5.0, return_lse=True),
        lambda upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, None, causal, upcast, window_size=window,
                                            softcap=5.0))
    for b, (a, e, ka, ke) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                                           cu_k[1:].tolist())):
        if a == e:
            continue
        o, l = flash_attn_ext.flash_attn_func(q[a:e][None], k[ka:ke][None], v[ka:ke][None], causal=causal,
                                              window_size=window, softcap=5.0, return_lse=True)
        assert torch.equal(o[0], out[a:e]) and torch.equal(l[0], lse[:, a:e]), b


@pytest.mark.parametrize("seqlen_new", [0, 2])
@pytest.mark.parametrize("page_size", [0, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("seqlen_q,causal", [(1, True), (1, False), (4, True)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softcap_kvcache_cpu(dtype, seqlen_q, causal, page_size, seqlen_new):
    """Decode (seqlen_q 1) and chunked prefill against a cache with a cap, contiguous and paged, 1
    and 3 splits, new keys appended, GQA 4:2, NaN in the rows past each sequence; the cap matters
    (scale 1: scaled scores of ~4 against a cap of 2)."""
    q, k_cache, v_cache, table, cache_seqlens, k_new, v_new, used = _kvcache_case(dtype, seqlen_q, page_size,
                                                                                  seqlen_new)
    lens = torch.tensor(used, dtype=torch.int32)
    for num_splits in (1, 3):
        kc, vc = k_cache.clone(), v_cache.clone()
        out, lse = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=cache_seqlens,
                                                          block_table=table, causal=causal, num_splits=num_splits,
                                                          softmax_scale=1.0, softcap=2.0, return_lse=True)
        ref = attention_kvcache_ref(q, kc, vc, lens, table, 1.0, causal, softcap=2.0)
        base = attention_kvcache_ref(q, kc, vc, lens, table, 1.0, causal, upcast=False, softcap=2.0)
        check_accuracy(f"out (num_splits={num_splits})", out, ref[0], base[0])
        check_accuracy(f"softmax_lse (num_splits={num_splits})", lse, ref[1], base[1])
    plain = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, causal=causal,
                                                   softmax_scale=1.0)
    assert not torch.allclose(out[2:], plain[2:])  # the cap matters here


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, 0))], ids=str)
def test_softcap_with_sinks_cpu(poison_empty, causal, window):
    """Sinks and a cap together (the sink's logit uncapped): out, lse, dq, dk, dv and d sinks."""
    q, k, v = make_qkv(2, 50, 37, 4, 2, 16, torch.float32)
    s = make_sinks(4)
    check_fwd_bwd_sinks(q, k, v, s, lambda: _run(q, k, v, 3.0, causal, window, sinks=s),
                        _ref(q, k, v, 3.0, causal, window, sinks=s))


def test_softcap_forward_ad_gradcheck_and_vmap_cpu():
    """Forward-mode AD (ops.attention_jvp caps too) against the reference's jvp; gradcheck in
    float64; torch.vmap over a batch of calls, per-sample gradients included."""
    q, k, v = make_qkv(1, 20, 30, 2, 1, 16, torch.float64, requires_grad=False)
    tq, tk, tv = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
    kw = dict(softmax_scale=0.8, causal=True, window_size=(9, 0), softcap=1.5)
    _, out_t = torch.func.jvp(lambda a, b, c: flash_attn_ext.flash_attn_func(a, b, c, **kw), (q, k, v), (tq, tk, tv))
    _, ref_t = torch.func.jvp(lambda a, b, c: attention_ref(a, b, c, 0.8, True, window_size=(9, 0), softcap=1.5)[0],
                              (q, k, v), (tq, tk, tv))
    torch.testing.assert_close(out_t, ref_t, rtol=1e-10, atol=1e-10)
    # A cap float32 cannot hold (0.7): forward mode differentiates the function the kernels compute,
    # with the float32 cap, as reverse mode does (it used the float64 cap: 2e-8 apart).
    qs, ks, vs = (torch.randn(1, n, 1, 8, dtype=torch.float64) for n in (3, 4, 4))
    f = lambda a: flash_attn_ext.flash_attn_func(a, ks, vs, softcap=0.7, softmax_scale=2.0)  # noqa: E731
    torch.testing.assert_close(torch.func.jacfwd(f)(qs), torch.func.jacrev(f)(qs), rtol=1e-12, atol=1e-12)

    qs, ks, vs = (torch.randn(1, n, h, 8, dtype=torch.float64, requires_grad=True) for n, h in ((5, 2), (7, 1), (7, 1)))
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda a, b, c: flash_attn_ext.flash_attn_func(a, b, c, softmax_scale=2.0, causal=causal, softcap=1.5),
            (qs, ks, vs))

    qb, kb, vb = make_qkv(6, 12, 15, 4, 2, 16, torch.float32, requires_grad=False)

    def f(a, b, c):
        return flash_attn_ext.flash_attn_func(a[None], b[None], c[None], causal=True, softcap=2.0)[0]

    torch.testing.assert_close(torch.vmap(f)(qb, kb, vb),
                               flash_attn_ext.flash_attn_func(qb, kb, vb, causal=True, softcap=2.0))

    def loss(a, b, c):
        return f(a, b, c).square().sum()

    per_sample = torch.vmap(torch.func.grad(loss))(qb, kb, vb)
    for i in (0, 5):
        torch.testing.assert_close(per_sample[i], torch.func.grad(loss)(qb[i], kb[i], vb[i]))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_softcap_compile_fullgraph_cpu(backend):
    """torch.compile(fullgraph=True) of a soft-capped call, forward and backward through the fake
    kernels (no graph break): eager's results."""
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend=backend)
    def loss_fn(q, k, v):
        out = flash_attn_ext.flash_attn_func(q, k, v, causal=True, window_size=(20, 0), softcap=5.0)
        return out.float().square().sum()

    q, k, v = make_qkv(2, 40, 56, 4, 2, 32, torch.float32)
    loss = loss_fn(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    want = flash_attn_ext.flash_attn_func(q, k, v, causal=True, window_size=(20, 0), softcap=5.0).square().sum()
    torch.testing.assert_close(loss, want)
    for g, w in zip(grads, torch.autograd.grad(want, (q, k, v))):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_bad_softcap_under_compile_names_it(dynamic):
    """Under torch.compile(fullgraph=True) a bad cap is the op's RuntimeError naming softcap (its
    fake kernel's check), also as a symbolic float (dynamic=True, after two good caps): not
    Dynamo's error about the entry's own ValueError, whose message it cannot format."""
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, c: flash_attn_ext.flash_attn_func(q, k, v, softcap=c), backend="eager",
                      fullgraph=True, dynamic=dynamic)
    q, k, v = make_qkv(1, 16, 16, 2, 2, 16, torch.float32, requires_grad=False)
    for good in (2.0, 3.0):
        torch.testing.assert_close(f(q, k, v, good), flash_attn_ext.flash_attn_func(q, k, v, softcap=good))
    for bad in (-1.0, float("nan")):
        with pytest.raises(RuntimeError, match="softcap must be a finite number >= 0") as info:
            f(q, k, v, bad)
        assert not isinstance(info.value, torch._dynamo.exc.Unsupported), info.value


def test_softcap_opcheck():
    """The ops' schemas, fake kernels and autograd registrations with softcap given (the last
    argument of every op)."""
    from torch.library import opcheck

    q, k, v = make_qkv(2, 37, 50, 4, 2, 16, torch.float32)
    ops = torch.ops.flash_attn_ext
    opcheck(ops.forward.default, (q, k, v, 0.25, False, 5, 2, None, 5.0))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse, stats = ops.forward(qd, kd, vd, 0.25, True, 9, -1, None, 5.0)
    dout = torch.randn_like(out)
    opcheck(ops.backward.default, (dout, qd, kd, vd, out, lse, 0.25, True, stats, 9, -1, None, 5.0))
    s = torch.randn(4)
    out, lse, stats = ops.forward(qd, kd, vd, 0.25, True, -1, -1, s, 5.0)
    opcheck(ops.backward_dsinks.default, (dout, qd, kd, vd, out, lse, 0.25, True, stats, -1, -1, s, 5.0))
    cu = torch.tensor([0, 20, 37], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 50], dtype=torch.int32)
    opcheck(ops.varlen_forward.default, (q[0], k[0], v[0], cu, cu_k, 20, 30, 0.25, True, -1, -1, None, 50.0))
    vout, vlse, vstats = ops.varlen_forward(qd[0], kd[0], vd[0], cu, cu_k, 20, 30, 0.25, True, -1, -1, None, 50.0)
    opcheck(ops.varlen_backward.default, (dout[0], qd[0], kd[0], vd[0], vout, vlse, cu, cu_k, 20, 30, 0.25, True,
                                          vstats, -1, -1, None, 50.0))
    kc, vc = torch.randn(2, 64, 2, 16), torch.randn(2, 64, 2, 16)
    opcheck(ops.fwd_kvcache.default, (qd[:, :1], kc, vc, None, None, torch.tensor([10, 64], dtype=torch.int32),
                                      None, 0.25, True, 0, -1, -1, None, None, 5.0),
            test_utils=("test_schema", "test_faketensor"))


BAD_SOFTCAPS = [(-1.0, "softcap must be a finite number >= 0 .0: no soft-capping., got -1"),
                (float("nan"), "softcap must be a finite number >= 0"),
                (float("inf"), "softcap must be a finite number >= 0"),
                (1e39, "softcap must be within float32's range"),     # softcap * log2(e) past float32
                (1e-39, "softcap must be within float32's range")]    # below float32's normal range


@pytest.mark.parametrize("softcap,match", BAD_SOFTCAPS, ids=str)
def test_bad_softcap_refused_before_any_work(softcap, match):
    """A softcap that is negative, NaN or infinite is the entry points' ValueError naming it (one
    past float32's range the op's RuntimeError); the raw ops (CPU and meta: the fake kernel's twin
    check) raise RuntimeError with the same words; a KV-cache call that would append is refused
    before the append (the cache unchanged)."""
    error = ValueError if not math.isfinite(softcap) or softcap < 0 else RuntimeError
    q, k, v = make_qkv(2, 8, 8, 4, 2, 16, torch.float32, requires_grad=False)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    calls = [lambda: flash_attn_ext.flash_attn_func(q, k, v, softcap=softcap),
             lambda: flash_attn_ext.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, softcap=softcap)]
    for call in calls:
        with pytest.raises(error, match=match):
            call()
    ops = torch.ops.flash_attn_ext
    for dev in ("cpu", "meta"):
        qd, kd, vd = (t.to(dev) for t in (q, k, v))
        with pytest.raises(RuntimeError, match=match):
            ops.forward(qd, kd, vd, 0.25, False, -1, -1, None, softcap)
        out, lse, stats = (torch.randn(2, 8, 4, 16, device=dev), torch.randn(2, 4, 8, device=dev),
                           torch.randn(2, 2, 4, 8, device=dev))
        with pytest.raises(RuntimeError, match=match):
            ops.backward(qd, qd, kd, vd, out, lse, 0.25, False, None, -1, -1, None, softcap)
        with pytest.raises(RuntimeError, match=match):
            ops.backward_dsinks(qd, qd, kd, vd, out, lse, 0.25, False, stats, -1, -1, torch.randn(4, device=dev),
                                softcap)
        with pytest.raises(RuntimeError, match=match):
            ops.varlen_forward(qd[0], kd[0], vd[0], cu.to(dev), cu.to(dev), 8, 8, 0.25, False, -1, -1, None, softcap)
        with pytest.raises(RuntimeError, match=match):
            ops.varlen_backward(qd[0], qd[0], kd[0], vd[0], out[0], lse[0], cu.to(dev), cu.to(dev), 8, 8, 0.25,
                                False, None, -1, -1, None, softcap)
    k_cache, v_cache = torch.randn(2, 32, 2, 16), torch.randn(2, 32, 2, 16)
    before = (k_cache.clone(), v_cache.clone())
    lens = torch.tensor([3, 9], dtype=torch.int32)
    with pytest.raises(error, match=match):
        flash_attn_ext.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, k[:, :1], v[:, :1], cache_seqlens=lens,
                                               softcap=softcap)
    with pytest.raises(RuntimeError, match=match):
        ops.fwd_kvcache(q[:, :1], k_cache, v_cache, k[:, :1], v[:, :1], lens, None, 0.25, True, 0, -1, -1, None,
                        None, softcap)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_softcap_range_names_the_scale():
    """|softmax_scale / softcap| past float32 (the kernels' prescale) is refused naming both."""
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float32, requires_grad=False)
    with pytest.raises(RuntimeError, match="softcap must be within float32's range.*softmax_scale 1e"):
        flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=1e10, softcap=1e-30)
    with pytest.raises(RuntimeError, match="softcap must be within float32's range"):
        torch.ops.flash_attn_ext.forward(q.to("meta"), k.to("meta"), v.to("meta"), 1e10, False, -1, -1, None, 1e-30)
    # In range at the edges: the smallest normal float32 cap with a small scale, and a cap of 1e38.
    for scale, cap in ((1e-30, 1.2e-38), (0.25, 1e38)):
        out = flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=scale, softcap=cap)
        assert torch.isfinite(out).all(), (scale, cap)


@pytest.mark.parametrize("softcap", [None, True, "5", 1j, torch.tensor(5.0, requires_grad=True)], ids=repr)
def test_softcap_must_be_a_real_number(softcap):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float32, requires_grad=False)
    with pytest.raises(TypeError, match="softcap"):
        flash_attn_ext.flash_attn_func(q, k, v, softcap=softcap)
    with pytest.raises(TypeError, match="softcap"):
        flash_attn_ext.flash_attn_with_kvcache(q, k, v, softcap=softcap)


# ---- CUDA ------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="soft-capping CUDA kernel tests need a CUDA GPU "
                                                               "(none visible)")

# (seqlen_q, seqlen_k): ragged (more keys), several tiles square, and 2048.
CUDA_SHAPES = [(113, 251), (1000, 1000), (2048, 2048)]
CUDA_HDIMS = [64, 96, 128, 192, 256]


@cuda
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("d", CUDA_HDIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_softcap_cuda_matches_reference(arch_path, poison_empty, dtype, d, seqlens, causal, softcap):
    """Every compiled head dim, fp16 and bf16, GQA 4:2, against the float64 reference (forward,
    LSE, dq, dk, dv)."""
    require_hdim(d, exact=True)
    sq, sk = seqlens
    q, k, v = make_qkv(1 if sq >= 2048 else 2, sq, sk, 4, 2, d, dtype, device="cuda")
    check_fwd_bwd(q, k, v, lambda: _run(q, k, v, softcap, causal), _ref(q, k, v, softcap, causal))


@cuda
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,window,seqlens", [(True, (100, 0), (700, 900)), (False, (64, 32), (900, 700)),
                                                   (True, (50, 0), (600, 300)), (False, (-1, 17), (251, 113))],
                         ids=str)
def test_softcap_cuda_window(arch_path, poison_empty, d, causal, window, seqlens):
    """Sliding windows with a cap (the kLocal twins), rows whose window holds no key included
    (out 0, LSE +inf, dq 0)."""
    require_hdim(d, exact=True)
    sq, sk = seqlens
    q, k, v = make_qkv(2, sq, sk, 4, 2, d, torch.bfloat16, device="cuda")
    out, lse, (dq, _, _) = check_fwd_bwd(q, k, v, lambda: _run(q, k, v, 5.0, causal, window),
                                         _ref(q, k, v, 5.0, causal, window))
    hidden = ~visible_mask(sq, sk, causal, *window, device="cuda").any(-1)
    if hidden.any():
        assert torch.equal(out[:, hidden], torch.zeros_like(out[:, hidden]))
        assert torch.isposinf(lse[:, :, hidden]).all()
        assert torch.equal(dq[:, hidden], torch.zeros_like(dq[:, hidden]))


@cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_softcap_cuda_mha_rows_without_keys(arch_path, poison_empty, dtype, d):
    """MHA (nheads_k = nheads) and causal seqlen_q > seqlen_k: rows without keys get out 0, LSE
    +inf, zero dq (never NaN), the rest the reference's."""
    require_hdim(d, exact=True)
    q, k, v = make_qkv(2, 400, 130, 4, 4, d, dtype, device="cuda")
    out, lse, (dq, dk, dv) = check_fwd_bwd(q, k, v, lambda: _run(q, k, v, 5.0, True), _ref(q, k, v, 5.0, True))
    hidden = ~visible_mask(400, 130, True, device="cuda").any(-1)
    assert torch.equal(out[:, hidden], torch.zeros_like(out[:, hidden])) and torch.isposinf(lse[:, :, hidden]).all()
    assert torch.equal(dq[:, hidden], torch.zeros_like(dq[:, hidden]))


@cuda
@pytest.mark.parametrize("scale", [1.0, 10.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_softcap_cuda_scores_far_beyond_the_cap(arch_path, poison_empty, dtype, d, causal, scale):
    """A large softmax_scale (scaled scores ~ 10 and ~ 100 times the cap of 5 at d128: most logits
    saturate, 1 - t^2 ~ 0 there): the reference within the rule, the LSE bounded by cap +
    log(keys), and the uncapped call fails the rule against the capped reference."""
    require_hdim(d, exact=True)
    q, k, v = make_qkv(2, 500, 700, 4, 2, d, dtype, device="cuda")
    out, lse, _ = check_fwd_bwd(q, k, v, lambda: _run(q, k, v, 5.0, causal, softmax_scale=scale),
                                _ref(q, k, v, 5.0, causal, softmax_scale=scale))
    assert (lse[torch.isfinite(lse)] <= 5.0 + math.log(700) + 1e-2).all()
    plain = flash_attn_ext.flash_attn_func(q, k, v, causal=causal, softmax_scale=scale)
    ref, base = (attention_ref(q, k, v, scale, causal, upcast=u, softcap=5.0)[0] for u in (True, False))
    with pytest.raises(AssertionError):
        check_accuracy("uncapped out", plain, ref, base)


@cuda
@pytest.mark.parametrize("entry", ["dense", "varlen", "kvcache", "raw"])
def test_softcap_zero_is_the_plain_call_cuda(arch_path, entry):
    """softcap 0 on the GPU: the bits of a call without it (the kernels' twins without the cap)."""
    require_hdim(64, exact=True)
    _check_zero_is_plain(torch.bfloat16, entry, "cuda")


@cuda
def test_softcap_cuda_deterministic_and_negative_scale(arch_path, poison_empty):
    """The capped backward is bitwise deterministic (two runs); a negative and a zero
    softmax_scale (run as |scale| on -q and scale 1 on q = 0) give the reference's results."""
    require_hdim(128, exact=True)
    q, k, v = make_qkv(2, 300, 500, 4, 2, 128, torch.bfloat16, device="cuda")
    dout = torch.randn(2, 300, 4, 128, dtype=torch.bfloat16, device="cuda")
    runs = []
    for _ in range(2):
        out, lse = _run(q, k, v, 5.0, True)
        runs.append((out, lse) + _grads(out, (q, k, v), dout))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    for scale in (-0.2, 0.0):
        check_fwd_bwd(q, k, v, lambda: _run(q, k, v, 5.0, True, softmax_scale=scale),
                      _ref(q, k, v, 5.0, True, softmax_scale=scale))


@cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_cuda_varlen(arch_path, poison_empty, causal, d):
    """Packed sequences of mixed lengths (an empty one, one without keys) with a cap: the
    per-sequence reference within the rule, and each sequence the dense call's bits on it alone
    (the same arch path; lengths outside README's two exceptions), gradients included."""
    require_hdim(d, exact=True)
    lens_q, lens_k = [70, 1, 0, 300, 129], [90, 5, 3, 300, 0]
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, d, torch.bfloat16, device="cuda")
    dout = torch.randn(sum(lens_q), 4, d, dtype=torch.bfloat16, device="cuda")
    out, lse, grads = check_fwd_bwd(
        q, k, v,
        lambda: flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 300, 300, causal=causal, softcap=5.0,
                                                      return_lse=True),
        lambda upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, None, causal, upcast, softcap=5.0), dout=dout)
    bounds = zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())
    for b, (a, e, ka, ke) in enumerate(bounds):
        if a == e or ka == ke:
            continue
        qs, ks, vs = (t.detach().unsqueeze(0).requires_grad_() for t in (q[a:e], k[ka:ke], v[ka:ke]))
        o, l = flash_attn_ext.flash_attn_func(qs, ks, vs, causal=causal, softcap=5.0, return_lse=True)
        assert torch.equal(o[0], out[a:e]) and torch.equal(l[0], lse[:, a:e]), b
        g = _grads(o, (qs, ks, vs), dout[a:e].unsqueeze(0))
        for name, x, y in zip(("dq", "dk", "dv"), g, (grads[0][a:e], grads[1][ka:ke], grads[2][ka:ke])):
            assert torch.equal(x[0], y), (b, name)


@cuda
@pytest.mark.parametrize("page_size", [0, 16, 64], ids=["contiguous", "paged16", "paged64"])
@pytest.mark.parametrize("seqlen_q", [1, 7])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_softcap_cuda_kvcache(arch_path, poison_empty, dtype, seqlen_q, page_size):
    """Split-KV decode (seqlen_q 1) and chunked prefill with a cap, GQA 8:2, head dim 128, a
    1000-row cache (NaN past each sequence), lengths 0, 1, ragged and full, causal; num_splits 1, 3
    and 0 (auto); a window too; the cap matters (scale 0.3: scaled scores of ~3 against a cap of 2)."""
    require_hdim(128, exact=True)
    q, k_cache, v_cache, table, cache_seqlens = _cuda_kvcache_case(dtype, seqlen_q, page_size)
    for window in ((-1, -1), (255, 0)):
        ref = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens, table, 0.3, True, window_size=window,
                                    softcap=2.0)
        base = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens, table, 0.3, True, upcast=False,
                                     window_size=window, softcap=2.0)
        kw = dict(cache_seqlens=cache_seqlens, block_table=table, causal=True, window_size=window, softmax_scale=0.3,
                  return_lse=True)
        for num_splits in (1, 3, 0):
            out, lse = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=num_splits, softcap=2.0,
                                                              **kw)
            check_accuracy(f"out (window={window}, num_splits={num_splits})", out, ref[0], base[0])
            check_accuracy(f"softmax_lse (window={window}, num_splits={num_splits})", lse, ref[1], base[1])
            assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isposinf(lse[0]).all()
        plain = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=3, **kw)[0]
        assert not torch.allclose(plain[2:], out[2:])  # the cap matters here


@cuda
def test_softcap_cuda_kvcache_append(arch_path):
    """New keys appended in place with a cap, decode step: the reference on the cache after the
    append, split and not."""
    require_hdim(128, exact=True)
    lens = [0, 40, 990]
    for num_splits in (1, 4):
        k_cache, v_cache, table = _cuda_cache([n + 1 for n in lens], 1000, 2, 128, torch.bfloat16, 16)
        q = torch.randn(3, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
        k_new = torch.randn(3, 1, 2, 128, dtype=torch.bfloat16, device="cuda")
        v_new = torch.randn_like(k_new)
        cache_seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        out, lse = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                          cache_seqlens=cache_seqlens, block_table=table, causal=True,
                                                          num_splits=num_splits, softcap=5.0, return_lse=True)
        used = cache_seqlens + 1
        ref = attention_kvcache_ref(q, k_cache, v_cache, used, table, None, True, softcap=5.0)
        base = attention_kvcache_ref(q, k_cache, v_cache, used, table, None, True, upcast=False, softcap=5.0)
        check_accuracy(f"out (num_splits={num_splits})", out, ref[0], base[0])
        check_accuracy(f"softmax_lse (num_splits={num_splits})", lse, ref[1], base[1])


@cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (100, 0))], ids=str)
def test_softcap_cuda_with_sinks(arch_path, poison_empty, d, causal, window):
    """Sinks and a cap together on the GPU (the sink's logit uncapped): out, lse, dq, dk, dv, d sinks."""
    require_hdim(d, exact=True)
    q, k, v = make_qkv(2, 333, 500, 4, 2, d, torch.bfloat16, device="cuda")
    s = make_sinks(4, requires_grad=False)
    s[0] = 8.0
    s = s.cuda().requires_grad_()
    check_fwd_bwd_sinks(q, k, v, s, lambda: _run(q, k, v, 5.0, causal, window, sinks=s),
                        _ref(q, k, v, 5.0, causal, window, sinks=s))


@cuda
def test_softcap_cuda_compile_fullgraph(arch_path):
    """torch.compile(fullgraph=True, inductor) of a capped call on the GPU: eager's bits for the
    forward and close gradients (inductor fuses the loss differently)."""
    require_hdim(128, exact=True)
    torch._dynamo.reset()

    def loss_fn(q, k, v):
        out = flash_attn_ext.flash_attn_func(q, k, v, causal=True, softcap=50.0)
        return out, out.float().square().sum()

    q, k, v = make_qkv(2, 256, 384, 4, 2, 128, torch.bfloat16, device="cuda")
    out, loss = torch.compile(loss_fn, fullgraph=True)(q, k, v)
    want_out, want = loss_fn(q, k, v)
    assert torch.equal(out, want_out)
    for g, w in zip(_grads(loss, (q, k, v), None), _grads(want, (q, k, v), None)):
        torch.testing.assert_close(g, w)


# The kSoftcap twins run for softcap > 0 (and the twins without the cap for 0), forward, dK/dV, dQ and
# the split-KV decode, with and without a window: tests/test_window.py,
# test_window_left_bound_runs_the_local_twins[softcap].
