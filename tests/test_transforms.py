"""Forward-mode AD and torch.func transforms through flash_attn_func, the SDPA drop-in
(flash_attn_ext.sdpa) and the nn modules (flash_attn_ext.nn).

Forward mode (issue 11 item 2): the tangent is computed exactly (flash_attn_ext.ops.attention_jvp)
and checked against finite differences in float64 (torch.autograd.gradcheck with
check_forward_ad) and against the float64 reference's jvp with the project's accuracy rule.
torch.func (item 3): grad, vjp, jacrev, jacfwd, vmap of the forward, and vmap(grad(...))
per-sample gradients, which must match a loop and use the ops' batching rules (run with vmap's
per-sample fallback disabled, so a missing rule is an error).

Every test runs on CPU; the CUDA variants (bfloat16 kernels) skip without a GPU.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_ext
from accuracy import check_accuracy
from flash_attn_ext import flash_attn_func
from flash_attn_ext.nn import FlashAttention, MultiheadFlashAttention
from flash_attn_ext.reference import attention_ref
from flash_attn_ext.sdpa import scaled_dot_product_attention

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (device, dtype): the CPU twin in float32, the CUDA kernels in bfloat16.
DEVICE_DTYPES = [pytest.param("cpu", torch.float32, id="cpu-fp32"),
                 pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=requires_cuda)]


def _tol(dtype):
    """Tolerance between two runs of our kernels on the same inputs that may differ in batch
    layout (vmap folds the vmapped dim into the batch)."""
    return dict(rtol=1e-5, atol=1e-5) if dtype in (torch.float32, torch.float64) else \
        dict(rtol=2e-2, atol=2e-2)


def _randn(*shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)


def _qkv(b, sq, sk, h, hk, d, dtype=torch.float64, device="cpu", seed=0):
    return (_randn(b, sq, h, d, dtype=dtype, device=device, seed=seed),
            _randn(b, sk, hk, d, dtype=dtype, device=device, seed=seed + 1),
            _randn(b, sk, hk, d, dtype=dtype, device=device, seed=seed + 2))


@pytest.fixture
def no_vmap_fallback():
    """Without a batching rule, vmap runs an op once per sample (the slow fallback, which only
    prints "There is a performance drop because we have not yet implemented the batching
    rule"). Disable that fallback: an op without a rule then raises instead."""
    previous = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(previous)


# ================================================================ forward mode (jvp)


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal", [(5, 7, False), (5, 7, True), (9, 4, True),
                                                      (6, 6, True), (4, 0, False)])
@pytest.mark.parametrize("nheads_k", [2, 1])
def test_forward_ad_gradcheck_float64(seqlen_q, seqlen_k, causal, nheads_k):
    """Forward-mode (and reverse-mode) derivatives vs finite differences, float64: GQA/MQA,
    causal rows that see no key (9 x 4), no key at all (seqlen_k = 0)."""
    q, k, v = (t.requires_grad_() for t in _qkv(1, seqlen_q, seqlen_k, 2, nheads_k, 8))
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=0.5, causal=causal), (q, k, v),
        check_forward_ad=True, check_batched_grad=True, check_batched_forward_grad=True)


def test_jvp_is_not_zero_and_matches_reference_float64():
    """The failure the issue reports: torch.func.jvp gave a zero tangent."""
    q, k, v = _qkv(2, 11, 13, 4, 2, 16)
    tangents = tuple(_randn(*t.shape, dtype=torch.float64, seed=10 + i) for i, t in enumerate((q, k, v)))
    for causal in (False, True):
        out, out_t = jvp(lambda q, k, v: flash_attn_func(q, k, v, causal=causal), (q, k, v), tangents)
        ref, ref_t = jvp(lambda q, k, v: attention_ref(q, k, v, causal=causal)[0], (q, k, v), tangents)
        assert out_t.abs().max() > 0.1
        torch.testing.assert_close(out_t, ref_t, rtol=0, atol=1e-12)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_jvp_accuracy_rule(device, dtype, causal):
    """max|ours - ref| <= 2 max|same-dtype math - ref| for the tangent, ref in float64."""
    q, k, v = _qkv(2, 70, 45, 4, 2, 32, dtype=dtype, device=device)
    tangents = tuple(_randn(*t.shape, dtype=dtype, device=device, seed=20 + i)
                     for i, t in enumerate((q, k, v)))
    _, ours = jvp(lambda q, k, v: flash_attn_func(q, k, v, causal=causal), (q, k, v), tangents)
    _, ref = jvp(lambda q, k, v: attention_ref(q, k, v, causal=causal)[0], (q, k, v), tangents)
    _, base = jvp(lambda q, k, v: attention_ref(q, k, v, causal=causal, upcast=False)[0],
                  (q, k, v), tangents)
    assert ours.dtype == dtype and ours.shape == q.shape
    check_accuracy("jvp out", ours, ref, base)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_jvp_under_autocast_stays_float32_accurate(device):
    """Under autocast the tangent's matmuls are not downcast: same tangent as without."""
    dtype = torch.bfloat16
    q, k, v = _qkv(1, 40, 40, 2, 2, 32, dtype=dtype, device=device)
    t = _randn(*q.shape, dtype=dtype, device=device, seed=35)
    _, want = jvp(lambda q: flash_attn_func(q, k, v, causal=True), (q,), (t,))
    with torch.autocast(device, dtype=torch.bfloat16):
        _, got = jvp(lambda q: flash_attn_func(q, k, v, causal=True), (q,), (t,))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_forward_ad_dual_tensors(device, dtype):
    """torch.autograd.forward_ad: the tangent was None; now it is the jvp, through
    flash_attn_func and through the raw op."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = _qkv(1, 33, 40, 4, 2, 32, dtype=dtype, device=device)
    tq = _randn(*q.shape, dtype=dtype, device=device, seed=30)
    tv = _randn(*v.shape, dtype=dtype, device=device, seed=31)
    _, want = jvp(lambda q, v: flash_attn_func(q, k, v, causal=True, softmax_scale=0.2), (q, v),
                  (tq, tv))
    with fwAD.dual_level():
        dq, dv = fwAD.make_dual(q, tq), fwAD.make_dual(v, tv)
        for out in (flash_attn_func(dq, k, dv, causal=True, softmax_scale=0.2),
                    torch.ops.flash_attn_ext.forward(dq, k, dv, 0.2, True)[0]):
            tangent = fwAD.unpack_dual(out).tangent
            assert tangent is not None
            torch.testing.assert_close(tangent, want, **_tol(dtype))


@pytest.mark.parametrize("fullgraph", [True, False])
def test_forward_ad_dual_tensors_under_compile(fullgraph):
    """torch.autograd.forward_ad through flash_attn_func and the raw op inside torch.compile: the
    compiled tangent is the eager one, bit for bit (it was silently None: AOTAutograd retraces
    with forward_ad's Python-side level unset, which the op's autograd kernel read)."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = _qkv(2, 7, 9, 4, 2, 16, dtype=torch.float32)
    tq, tv = _randn(*q.shape, seed=32), _randn(*v.shape, seed=33)

    def tangents(q, k, v, tq, tv):
        with fwAD.dual_level():
            dq, dv = fwAD.make_dual(q, tq), fwAD.make_dual(v, tv)
            return (fwAD.unpack_dual(flash_attn_func(dq, k, dv, causal=True)).tangent,
                    fwAD.unpack_dual(torch.ops.flash_attn_ext.forward(dq, k, dv, 0.3, False)[0]).tangent)

    want = tangents(q, k, v, tq, tv)
    torch._dynamo.reset()
    got = torch.compile(tangents, fullgraph=fullgraph, backend="aot_eager")(q, k, v, tq, tv)
    for g, w in zip(got, want):
        assert g is not None and torch.equal(g, w)


def test_jacfwd_matches_jacrev_float64():
    q, k, v = _qkv(1, 4, 6, 2, 1, 8)
    f = lambda q, k, v: flash_attn_func(q, k, v, causal=True)  # noqa: E731
    for argnum in range(3):
        jf = jacfwd(f, argnums=argnum)(q, k, v)
        jr = jacrev(f, argnums=argnum)(q, k, v)
        ref = jacrev(lambda *a: attention_ref(*a, causal=True)[0], argnums=argnum)(q, k, v)
        torch.testing.assert_close(jf, ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(jr, ref, rtol=0, atol=1e-12)


def test_jvp_propagates_nan_and_keeps_no_key_rows_zero():
    q, k, v = _qkv(1, 6, 3, 2, 2, 8)
    tangents = tuple(torch.ones_like(t) for t in (q, k, v))
    _, out_t = jvp(lambda q, k, v: flash_attn_func(q, k, v, causal=True), (q, k, v), tangents)
    assert (out_t[:, :3] == 0).all() and torch.isfinite(out_t).all()  # rows 0..2 see no key
    q2 = q.clone()
    q2[0, 4, 1, 0] = float("nan")
    _, out_t = jvp(lambda q: flash_attn_func(q, k, v, causal=True), (q2,), (tangents[0],))
    assert torch.isnan(out_t[0, 4, 1]).all()
    assert torch.isfinite(out_t[0, 5]).all() and torch.isfinite(out_t[0, 4, 0]).all()


def test_forward_over_reverse_and_double_backward_are_refused():
    q, k, v = _qkv(1, 4, 4, 2, 2, 8)
    loss = lambda q: flash_attn_func(q, k, v).pow(2).sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match="forward-mode AD through the backward"):
        torch.func.hessian(loss)(q)
    with pytest.raises(RuntimeError, match="double backward"):
        grad(lambda q: grad(loss)(q).sum())(q)


# ---- the SDPA drop-in and the modules


@pytest.mark.parametrize("seqlens", [(24, 24), (13, 30), (30, 13)])
def test_sdpa_jvp_matches_torch_math(seqlens):
    L, S = seqlens
    q = _randn(2, 4, L, 16, dtype=torch.float64, seed=40)
    k, v = (_randn(2, 2, S, 16, dtype=torch.float64, seed=s) for s in (41, 42))
    tangents = tuple(_randn(*t.shape, dtype=torch.float64, seed=50 + i) for i, t in enumerate((q, k, v)))
    kw = dict(is_causal=True, enable_gqa=True, scale=0.3)
    _, ours = jvp(lambda q, k, v: scaled_dot_product_attention(q, k, v, **kw), (q, k, v), tangents)
    with sdpa_kernel(SDPBackend.MATH):
        _, ref = jvp(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw), (q, k, v), tangents)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)


def _module_pair(seed=0, dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    ours = MultiheadFlashAttention(64, 4, num_kv_heads=2, causal=True, rotary=True,
                                   device=device, dtype=dtype)
    with torch.no_grad():
        ours.in_proj_bias.normal_(0, 0.05)
    ref = MultiheadFlashAttention(64, 4, num_kv_heads=2, causal=True, rotary=True,
                                  device=device, dtype=dtype, backend="torch_sdpa")
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def test_module_jvp_matches_torch_math():
    ours, ref = _module_pair()
    ours, ref = ours.double(), ref.double()
    x = _randn(2, 19, 64, dtype=torch.float64, seed=60)
    t = _randn(2, 19, 64, dtype=torch.float64, seed=61)
    _, got = jvp(lambda x: ours(x)[0], (x,), (t,))
    with sdpa_kernel(SDPBackend.MATH):
        _, want = jvp(lambda x: ref(x)[0], (x,), (t,))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    core = FlashAttention(causal=True)
    q, k, v = _qkv(1, 9, 9, 2, 2, 16)
    _, got = jvp(lambda q: core(q, k, v), (q,), (torch.ones_like(q),))
    _, want = jvp(lambda q: attention_ref(q, k, v, causal=True)[0], (q,), (torch.ones_like(q),))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# ================================================================ torch.func (reverse mode, vmap)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_func_grad_vjp_jacrev(device, dtype):
    """torch.func.grad / vjp / jacrev raised "must override the setup_context staticmethod"."""
    q, k, v = _qkv(2, 20, 28, 4, 2, 32, dtype=dtype, device=device)
    dout = _randn(*q.shape, dtype=dtype, device=device, seed=70)

    def loss(fn, q, k, v):
        return (fn(q, k, v).float() * dout.float()).sum()

    ours_fn = lambda q, k, v: flash_attn_func(q, k, v, causal=True)  # noqa: E731
    ref_fn = lambda q, k, v: attention_ref(q, k, v, causal=True)[0]  # noqa: E731
    base_fn = lambda q, k, v: attention_ref(q, k, v, causal=True, upcast=False)[0]  # noqa: E731
    grads = grad(lambda *a: loss(ours_fn, *a), argnums=(0, 1, 2))(q, k, v)
    refs = grad(lambda *a: loss(ref_fn, *a), argnums=(0, 1, 2))(q, k, v)
    bases = grad(lambda *a: loss(base_fn, *a), argnums=(0, 1, 2))(q, k, v)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, refs, bases):
        check_accuracy(f"func.grad {name}", g, r, b)
    out, vjp_fn = vjp(ours_fn, q, k, v)
    for name, g, r, b in zip(("dq", "dk", "dv"), vjp_fn(dout), refs, bases):
        check_accuracy(f"func.vjp {name}", g, r, b)
    # jacrev on a small problem, float64 on CPU
    if device == "cpu":
        q, k, v = _qkv(1, 3, 5, 2, 1, 8)
        jr = jacrev(lambda q, k, v: flash_attn_func(q, k, v, causal=True), argnums=(0, 1, 2))(q, k, v)
        jref = jacrev(lambda q, k, v: attention_ref(q, k, v, causal=True)[0], argnums=(0, 1, 2))(q, k, v)
        for a, b in zip(jr, jref):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_vmap_forward_uses_batching_rule(device, dtype, no_vmap_fallback):
    """vmap over an extra leading dim, with vmapped dims anywhere (a vmapped last dim makes
    the per-sample headdim non-contiguous) and unbatched k: matches a loop."""
    q = _randn(3, 2, 17, 4, 32, dtype=dtype, device=device, seed=80)     # vmapped at dim 0
    k = _randn(2, 23, 2, 32, dtype=dtype, device=device, seed=81)        # not vmapped
    v = _randn(2, 23, 2, 32, 3, dtype=dtype, device=device, seed=82)     # vmapped at dim 4
    f = lambda q, k, v: flash_attn_func(q, k, v, causal=True)  # noqa: E731
    out = vmap(f, in_dims=(0, None, 4))(q, k, v)
    loop = torch.stack([f(q[i], k, v[..., i].contiguous()) for i in range(3)])
    torch.testing.assert_close(out, loop, **_tol(dtype))
    out, lse = vmap(lambda q: flash_attn_func(q, k, k, return_lse=True))(q)
    assert out.shape == q.shape and lse.shape == (3, 2, 4, 17)


def test_vmap_rank_error_names_the_sample_shape():
    """A per-sample q of the wrong rank under vmap: the error names the sample's shape, not the
    folded one the op would see (the vmapped dim merged into the batch)."""
    q = _randn(2, 5, 4, 8, dtype=torch.float32, device="cpu", seed=70)  # samples (5, 4, 8): 3-D
    with pytest.raises(RuntimeError, match=r"q must be 4-D .*got 3-D of shape \[5, 4, 8\] \(one sample"):
        vmap(lambda x: flash_attn_func(x, x, x))(q)
    k = _randn(1, 7, 4, 8, dtype=torch.float32, device="cpu", seed=71)  # not vmapped, 4-D
    with pytest.raises(RuntimeError, match=r"k must be 4-D .*got 5-D of shape \[1, 1, 7, 4, 8\]"):
        vmap(lambda x: flash_attn_func(x, k[None], k), in_dims=0)(q[:, None])


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_vmap_grad_per_sample_gradients(device, dtype, no_vmap_fallback):
    """Per-sample gradients through flash_attn_func: vmap(grad(loss)) == a loop of grads."""
    n = 4
    q, k, v = _qkv(n, 19, 25, 4, 2, 32, dtype=dtype, device=device, seed=90)
    w = _randn(n, 19, 4, 32, dtype=dtype, device=device, seed=93)

    def loss(q, k, v, w):  # one sample: add the batch dim of 1 the op expects
        out = flash_attn_func(q[None], k[None], v[None], causal=True)[0]
        return (out.float() * w.float()).sum()

    per_sample = vmap(grad(loss, argnums=(0, 1, 2)))(q, k, v, w)
    for i, name in enumerate(("dq", "dk", "dv")):
        loop = torch.stack([grad(loss, argnums=(0, 1, 2))(q[s], k[s], v[s], w[s])[i] for s in range(n)])
        torch.testing.assert_close(per_sample[i], loop, **_tol(dtype), msg=name)
    # and against the float64 reference, with the accuracy rule
    refs = [torch.stack(t) for t in zip(*[
        grad(lambda q, k, v: (attention_ref(q[None], k[None], v[None], causal=True)[0][0]
                              * w[s].double()).sum(), argnums=(0, 1, 2))(q[s], k[s], v[s])
        for s in range(n)])]
    bases = [torch.stack(t) for t in zip(*[
        grad(lambda q, k, v: (attention_ref(q[None], k[None], v[None], causal=True, upcast=False)[0][0]
                              .float() * w[s].float()).sum(), argnums=(0, 1, 2))(q[s], k[s], v[s])
        for s in range(n)])]
    for name, g, r, b in zip(("dq", "dk", "dv"), per_sample, refs, bases):
        check_accuracy(f"per-sample {name}", g, r, b)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_sdpa_func_transforms(device, dtype, no_vmap_fallback):
    """grad, and vmap(grad) per-sample, through the SDPA drop-in (L > S causal: the split path)."""
    q = _randn(3, 4, 30, 32, dtype=dtype, device=device, seed=100)
    k = _randn(3, 2, 13, 32, dtype=dtype, device=device, seed=101)
    v = _randn(3, 2, 13, 32, dtype=dtype, device=device, seed=102)

    def loss(sdpa, q, k, v):
        return sdpa(q, k, v, is_causal=True, enable_gqa=True).float().pow(2).sum()

    g = grad(lambda *a: loss(scaled_dot_product_attention, *a), argnums=(0, 1, 2))(q, k, v)
    # torch.func.grad runs the same kernels as eager autograd: the same gradients, bitwise.
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    eager = torch.autograd.grad(loss(scaled_dot_product_attention, *leaves), leaves)
    for name, x, y in zip("qkv", g, eager):
        assert torch.equal(x, y), f"func.grad d{name} differs from autograd's"
    args64 = [t.double() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        r = grad(lambda *a: loss(F.scaled_dot_product_attention, *a), argnums=(0, 1, 2))(*args64)
    loose = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=1e-1)
    for name, x, y in zip("qkv", g, r):  # a sanity check; the accuracy rule is test_cuda_*'s
        torch.testing.assert_close(x.double(), y, **loose)
    per_sample = vmap(grad(lambda q, k, v: loss(scaled_dot_product_attention, q[None], k[None], v[None]),
                           argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(per_sample, g):  # the loss is a sum over samples: per-sample grads = grads
        torch.testing.assert_close(a, b, **_tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_module_per_sample_gradients(device, dtype, no_vmap_fallback):
    """vmap(grad(functional_call(...))) over MultiheadFlashAttention's parameters == a loop
    of ordinary backward passes, and close to the same module on torch's SDPA."""
    ours, ref = _module_pair(dtype=dtype, device=device)
    x = _randn(3, 16, 64, dtype=dtype, device=device, seed=110)
    y = _randn(3, 16, 64, dtype=dtype, device=device, seed=111)
    params = {n: p.detach() for n, p in ours.named_parameters()}

    def loss(params, x, y):
        out = functional_call(ours, params, (x[None],))[0]
        return (out.float() - y.float()).pow(2).mean()

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for s in range(3):
        ours.zero_grad()
        (ours(x[s:s + 1])[0].float() - y[s:s + 1].float()).pow(2).mean().backward()
        for n, p in ours.named_parameters():
            torch.testing.assert_close(per_sample[n][s], p.grad, **_tol(dtype), msg=n)
    # torch's SDPA in float64 as the reference, its same-dtype run as the baseline
    ref64 = copy.deepcopy(ref).double()
    p64 = {n: p.detach() for n, p in ref64.named_parameters()}
    pb = {n: p.detach() for n, p in ref.named_parameters()}

    def ref_loss(module, params, x, y):  # as loss(): float32 loss math, float64 for the ref
        out = functional_call(module, params, (x[None],))[0]
        out = out if out.dtype == torch.float64 else out.float()
        return (out - y.to(out.dtype)).pow(2).mean()

    with sdpa_kernel(SDPBackend.MATH):
        want = vmap(grad(lambda p, x, y: ref_loss(ref64, p, x, y)), in_dims=(None, 0, 0))(
            p64, x.double(), y.double())
        base = vmap(grad(lambda p, x, y: ref_loss(ref, p, x, y)), in_dims=(None, 0, 0))(pb, x, y)
    for n in params:
        check_accuracy(f"per-sample d{n}", per_sample[n], want[n], base[n])


def test_raw_op_under_torch_func_is_a_clear_error():
    q, k, v = _qkv(1, 4, 4, 2, 2, 8)
    with pytest.raises(NotImplementedError, match="flash_attn_func"):
        grad(lambda q: torch.ops.flash_attn_ext.forward(q, k, v, 0.3, False)[0].sum())(q)
    with pytest.raises(NotImplementedError, match="flash_attn_func"):
        jvp(lambda q: torch.ops.flash_attn_ext.forward(q, k, v, 0.3, False)[0], (q,), (q,))
    # without a transform that differentiates, the raw op works under vmap
    out = vmap(lambda q: torch.ops.flash_attn_ext.forward(q, k, v, 0.3, False)[0])(q[None])
    torch.testing.assert_close(out[0], flash_attn_func(q, k, v, softmax_scale=0.3))


def test_lse_and_stats_carry_no_tangent_or_gradient():
    import torch.autograd.forward_ad as fwAD

    q, k, v = _qkv(1, 5, 6, 2, 2, 8)
    with fwAD.dual_level():
        out, lse, stats = torch.ops.flash_attn_ext.forward(fwAD.make_dual(q, torch.ones_like(q)),
                                                          k, v, 0.3, False)
        assert fwAD.unpack_dual(lse).tangent is None and fwAD.unpack_dual(stats).tangent is None
    qg = q.clone().requires_grad_()
    out, lse, stats = torch.ops.flash_attn_ext.forward(qg, k, v, 0.3, False)
    assert out.requires_grad and not lse.requires_grad and not stats.requires_grad
    assert flash_attn_ext.ops.attention_forward(qg, k, v, 0.3, False)[2].shape == (2, 1, 2, 5)


def test_sdpa_and_modules_vjp_jacrev_float64():
    """torch.func.vjp / jacrev through the SDPA drop-in and FlashAttention / MultiheadFlashAttention
    (they raised "must override the setup_context staticmethod")."""
    q = _randn(1, 2, 5, 8, dtype=torch.float64, seed=120)
    k = _randn(1, 1, 3, 8, dtype=torch.float64, seed=121)
    f = lambda q, k: scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)  # noqa: E731
    with sdpa_kernel(SDPBackend.MATH):
        g = lambda q, k: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)  # noqa: E731
        want = jacrev(g, argnums=(0, 1))(q, k)
        out, vjp_fn = vjp(g, q, k)
        want_vjp = vjp_fn(torch.ones_like(out))
    for a, b in zip(jacrev(f, argnums=(0, 1))(q, k), want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    out, vjp_fn = vjp(f, q, k)
    for a, b in zip(vjp_fn(torch.ones_like(out)), want_vjp):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    core = FlashAttention(causal=True)
    qb, kb, vb = _qkv(1, 4, 4, 2, 1, 8)
    torch.testing.assert_close(
        jacrev(lambda q: core(q, kb, vb))(qb),
        jacrev(lambda q: attention_ref(q, kb, vb, causal=True)[0])(qb), rtol=0, atol=1e-12)
    ours, ref = _module_pair()
    ours, ref = ours.double(), ref.double()
    x = _randn(1, 6, 64, dtype=torch.float64, seed=122)
    params = {n: p.detach() for n, p in ours.named_parameters()}
    jo = jacrev(lambda p: functional_call(ours, p, (x,))[0])(params)
    with sdpa_kernel(SDPBackend.MATH):
        jr = jacrev(lambda p: functional_call(ref, p, (x,))[0])(params)
    for n in params:
        torch.testing.assert_close(jo[n], jr[n], rtol=0, atol=1e-12, msg=n)


def test_reverse_mode_over_vmap_float64():
    """Reverse mode through a vmapped call (vmap inside grad, and a plain .backward() of a vmapped
    output): the saved tensors keep one list of batch dims (forward and reverse mode save the same)."""
    q, k, v = (torch.randn(3, 1, 5, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    batched = torch.func.vmap(lambda q, k, v: flash_attn_ext.flash_attn_func(q, k, v, causal=True))
    g = torch.autograd.grad(batched(q, k, v).pow(2).sum(), (q, k, v))
    looped = [flash_attn_ext.flash_attn_func(q[i], k[i], v[i], causal=True) for i in range(3)]
    g_ref = torch.autograd.grad(sum(o.pow(2).sum() for o in looped), (q, k, v))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)
    g_func = torch.func.grad(lambda q: batched(q, k, v).pow(2).sum())(q)
    torch.testing.assert_close(g_func, g_ref[0])
