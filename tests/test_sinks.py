"""Attention sinks (gpt-oss's learnable sinks): ``sinks=`` on every entry point.

Semantics (flash_attn_ext.reference.attention_ref(..., sinks=)): ``sinks`` (nheads,) holds per
query head h a logit, in the units of the scaled scores (softmax_scale * q.k, natural log), of one
more key that every query row sees and whose value is zero. The softmax runs over the visible keys
and the sink; the sink's column is dropped from P:
    out_i = sum_j exp(S_ij - LSE_i) v_j,  LSE_i = log(exp(sinks[h]) + sum_{visible j} exp(S_ij)),
and the returned softmax_lse includes the sink. A row that sees no key (causal with seqlen_q >
seqlen_k, a window past the keys, seqlen_k == 0) gives out 0 and lse = sinks[h]. A sink of -inf is
no sink (the bits of sinks=None; lse +inf for rows without keys). Differentiable (except through
flash_attn_with_kvcache): d sinks[h] = -sum_{b,i} exp(sinks[h] - LSE_{b,h,i}) D_{b,h,i},
D = rowsum(dout * out). The public functions take any floating dtype (used as float32); the raw
ops take float32 only.

Every numeric case is checked with the accuracy rule (tests/accuracy.py) against the float64
reference, the sinks' gradient included; the CPU ones in CI, the CUDA ones on each arch path of
the GPU (conftest.py: arch_path). The sinks are random float32 values (exact in float64, so the
reference sees the values the kernels use: they compute with float32 sinks).
"""

import math

import pytest
import torch

import flash_attn_ext
from accuracy import check_accuracy
from conftest import make_qkv, require_hdim
from test_kvcache import poison_unused  # NaN into the cache rows past each sequence's length
from flash_attn_ext.reference import attention_kvcache_ref, attention_ref, attention_varlen_ref, visible_mask


def make_sinks(nheads, device="cpu", scale=2.0, requires_grad=True, seed=None):
    """Random float32 sinks ~ scale * N(0, 1) (never zeros)."""
    g = None if seed is None else torch.Generator().manual_seed(seed)
    s = (torch.randn(nheads, generator=g) * scale).to(device)
    return s.requires_grad_(requires_grad)


def check_fwd_bwd_sinks(q, k, v, sinks, run, reference, dout=None, grads_of=None):
    """conftest.check_fwd_bwd with the sinks: ``run()`` -> (out, softmax_lse) vs
    ``reference(upcast)`` -> (out, lse) (float64 reference / same-dtype baseline), then the
    gradients w.r.t. q, k, v and sinks (all must require grad). Returns (out, lse, grads)."""
    out, lse = run()
    ref_out, ref_lse = reference(True)
    base_out, base_lse = reference(False)
    check_accuracy("out", out, ref_out, base_out)
    check_accuracy("softmax_lse", lse, ref_lse, base_lse)
    if dout is None:
        dout = torch.randn_like(out)
    inputs = (q, k, v, sinks)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref_out, inputs, dout.to(ref_out.dtype))
    base_grads = torch.autograd.grad(base_out, inputs, dout.to(base_out.dtype))
    stored = _stored_outputs(base_out, ref_out, out.dtype)
    base_grads = base_grads[:3] + (_dsinks_baseline(base_grads[3], ref_grads[3], stored, ref_lse, dout, sinks,
                                                    out.dtype),)
    problem = getattr(reference, "problem", None)
    if problem is not None and out.dtype in (torch.float16, torch.bfloat16):
        # FlashAttention-2 Alg. 2 in float64 with D from a stored 16-bit output: the error every
        # backward that reads a stored 16-bit output carries (see _alg2_grads_with_stored_out).
        for stored_out in stored:
            alg2 = _alg2_grads_with_stored_out(*problem[:7], dout, stored_out, *problem[7:])
            base_grads = tuple(_worse(bg, ag, rg) if ag is not None else bg
                               for bg, ag, rg in zip(base_grads, alg2, ref_grads))
    for name, g, rg, bg in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, base_grads):
        check_accuracy(name, g, rg, bg)
    _check_dsinks_consistent(grads[3], out, lse, dout, sinks)
    assert grads[3].dtype == sinks.dtype and grads[3].shape == sinks.shape
    return out, lse, grads


def _check_dsinks_consistent(dsinks, out, lse, dout, sinks):
    """d sinks against FlashAttention-2 Alg. 2's formula on the call's own out and softmax_lse, in
    float64: -sum_i exp(sinks - LSE_i) rowsum(dout_i o out_i) (rows with out 0 add nothing). Tight
    (1e-4 of the terms' absolute sum, plus the float32 LSE's own rounding at large |LSE|): catches a
    wrong row, head or statistic where the accuracy rule's bound is loose (the same-dtype math's d
    sinks can be far off on a head whose sink takes most of the weight). out: (..., nheads,
    headdim) with lse (batch, nheads, seqlen_q) (dense) or (nheads, total_q) (varlen)."""
    terms = _dsinks_terms(out, lse, dout, sinks)
    finite = lse[torch.isfinite(lse)].double()
    lse_ulps = 2.0 ** -22 * (finite.abs().max().item() if finite.numel() else 0.0)
    tol = (1e-4 + lse_ulps) * terms.abs().sum(0) + 1e-12
    err = (dsinks.detach().double() - (-terms.sum(0))).abs()
    assert (err <= tol).all(), f"dsinks: {err.tolist()} from its own out / lse's formula (tolerance {tol.tolist()})"


def _dsinks_terms(out, lse, dout, sinks):
    """The rows' terms of d sinks, -d sinks[h] = sum_i exp(sinks[h] - LSE_i) rowsum(dout_i o out_i),
    in float64 as (rows, nheads) (rows with out 0 give 0). out: (..., nheads, headdim) with lse
    (batch, nheads, seqlen_q) (dense) or (nheads, total_q) (varlen)."""
    lse_rows = (lse.transpose(1, 2) if out.dim() == 4 else lse.transpose(0, 1)).detach().double()
    d = (dout.double() * out.detach().double()).sum(-1)
    terms = torch.where(d == 0, torch.zeros_like(d), torch.exp(sinks.detach().double() - lse_rows) * d)
    return terms.reshape(-1, sinks.shape[0])


def _stored_outputs(base_out, ref_out, dtype, dithered=8):
    """The 16-bit outputs a backward may read as its stored O (FlashAttention-2 Alg. 2's D =
    rowsum(dO o O)) for the gradients' baselines: the same-dtype baseline's, the exact output
    rounded to nearest, and ``dithered`` roundings of it after a uniform +-1/2-ulp perturbation
    (seeded: each within one ulp of exact, as a kernel's own output is). d sinks sums D's rounding
    errors over every row of a head, a random walk: two implementations' sums are two draws, whose
    ratio exceeds 2 about a third of the time (a Cauchy ratio), so one draw (torch's) is no bound;
    the largest of these draws is. Other dtypes: the baseline's output only."""
    if dtype not in (torch.float16, torch.bfloat16):
        return [base_out]
    exact = ref_out.detach().double()
    nearest = exact.to(dtype)
    ulp = torch.nextafter(nearest, torch.full_like(nearest, math.inf)).double() - nearest.double()
    gen = torch.Generator(device=exact.device).manual_seed(0)
    noise = [torch.rand(exact.shape, generator=gen, device=exact.device, dtype=torch.float64) - 0.5
             for _ in range(dithered)]
    return [base_out, nearest] + [(exact + u * ulp).to(dtype) for u in noise]


def _worse(base, other, ref):
    """The one of two baselines farther from the reference (max abs error), in base's dtype."""
    err = lambda t: (t.double() - ref.double()).abs().max().item() if t.numel() else 0.0  # noqa: E731
    return other.to(base.dtype) if err(other) > err(base) else base


def _alg2_grads_with_stored_out(q, k, v, sinks, causal, window, softmax_scale, dout, stored_out, softcap=0.0):
    """(dq, dk, None, dsinks) of FlashAttention-2's backward (Alg. 2: dS = P o (dP - D), D =
    rowsum(dout o O)) as its 16-bit form computes it: float64 arithmetic, but D from
    ``stored_out`` (a 16-bit output: the same-dtype baseline's) and dS rounded to that dtype before
    the dQ / dK products (their tensor-core operands). Without sinks a one-key row has O = v
    exactly and D = dP, dS = 0; with a sink, O = P v is rounded, and D's and dS's roundings reach
    dq, dk and dsinks in any implementation of Alg. 2 that keeps O and dS in 16 bits (torch's
    bfloat16 math differentiates through the softmax instead, at times several times closer on
    such rows). The accuracy rule's baseline for these gradients is the farther of the two. Dense
    BSHD, GQA; softcap > 0: capped logits softcap * tanh(S / softcap), dS times 1 - tanh^2
    (tests/test_softcap.py)."""
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    G = H // Hk
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    qd = q.detach().double()
    kd = k.detach().double().repeat_interleave(G, 2)
    vd = v.detach().double().repeat_interleave(G, 2)
    S = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    dcap = 1.0
    if softcap > 0:
        t = torch.tanh(S / softcap)
        S, dcap = softcap * t, 1 - t * t
    S = S.masked_fill(~visible_mask(Sq, Sk, causal, window[0], window[1], q.device), float("-inf"))
    ext = torch.cat([S, sinks.detach().double().view(1, H, 1, 1).expand(B, H, Sq, 1)], dim=-1)
    p_ext = torch.softmax(ext, dim=-1)
    P, p_sink = p_ext[..., :Sk], p_ext[..., Sk]
    do = dout.double()
    dP = torch.einsum("bqhd,bkhd->bhqk", do, vd)
    d_stored = (do * stored_out.detach().double()).sum(-1).transpose(1, 2)  # (B, H, Sq)
    # dS in the output dtype before the dQ / dK products, as the kernels' 16-bit tensor-core operands
    dS = (P * (dP - d_stored[..., None]) * dcap).to(stored_out.dtype).double()
    dq = torch.einsum("bhqk,bkhd->bqhd", dS, kd) * scale
    dk = (torch.einsum("bhqk,bqhd->bkhd", dS, qd) * scale).reshape(B, Sk, Hk, G, D).sum(3)
    dsinks = -(p_sink * d_stored).sum((0, 2))
    return dq, dk, None, dsinks


def _dsinks_baseline(base, ref, stored_outs, ref_lse, dout, sinks, dtype):
    """The baseline of d sinks for the accuracy rule: the same-dtype math's, or, for 16-bit outputs
    where that is farther from the reference, the formula -sum_i exp(sinks - LSE_i) rowsum(dout_i
    * O_i) with the exact LSE and a stored 16-bit output O (each of ``stored_outs``,
    _stored_outputs: within one ulp of exact). Every backward that reads the stored output
    (FlashAttention-2 Alg. 2's D = rowsum(dO * O)) carries that output's error, summed over the
    rows; torch's bfloat16 math reaches P's sink column another way and is at times several times
    closer. stored_outs: (..., nheads, headdim) with ref_lse (batch, nheads, seqlen_q) (dense) or
    (nheads, total_q) (varlen)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return base
    for stored_out in stored_outs:
        base = _worse(base, -_dsinks_terms(stored_out, ref_lse, dout, sinks).sum(0), ref)
    return base


def _run(q, k, v, sinks, causal=False, window=(-1, -1), **kw):
    return flash_attn_ext.flash_attn_func(q, k, v, causal=causal, window_size=window, sinks=sinks, return_lse=True,
                                          **kw)


def _ref(q, k, v, sinks, causal=False, window=(-1, -1), softmax_scale=None):
    def reference(upcast):
        return attention_ref(q, k, v, softmax_scale, causal, upcast=upcast, window_size=window, sinks=sinks)

    reference.problem = (q, k, v, sinks, causal, window, softmax_scale)  # for _alg2_grads_with_stored_out
    return reference


def _rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# ---- the reference itself: the formula written out -----------------------------------------

def test_reference_formula():
    """attention_ref(sinks=) is the spec's formula: an extra key per head with value 0, visible
    to every row; lse includes it; rows without keys: out 0, lse = sinks[h]."""
    q, k, v = make_qkv(2, 9, 6, 4, 2, 8, torch.float64, requires_grad=False)
    s = torch.tensor([0.5, -1.25, 3.0, -0.75], dtype=torch.float64)
    out, lse = attention_ref(q, k, v, 0.3, True, sinks=s)
    kk, vv = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    for b in range(2):
        for h in range(4):
            for i in range(9):
                seen = [j for j in range(6) if j <= i + 6 - 9]
                scores = torch.stack([0.3 * (q[b, i, h] * kk[b, j, h]).sum() for j in seen] + [s[h]])
                l = torch.logsumexp(scores, 0)
                o = sum((torch.exp(scores[n] - l) * vv[b, j, h] for n, j in enumerate(seen)),
                        torch.zeros(8, dtype=torch.float64))
                torch.testing.assert_close(out[b, i, h], o, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(lse[b, h, i].double(), l, rtol=1e-6, atol=0)


# ---- CPU (CI): dense ----------------------------------------------------------------------

CPU_SHAPES = [(1, 1), (37, 50), (70, 23), (130, 129)]


@pytest.mark.parametrize("nheads_k", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("seqlens", CPU_SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_sinks_cpu_matches_reference(dtype, causal, seqlens, nheads_k, poison_empty):
    sq, sk = seqlens
    q, k, v = make_qkv(2, sq, sk, 4, nheads_k, 32, dtype)
    s = make_sinks(4)
    check_fwd_bwd_sinks(q, k, v, s, lambda: _run(q, k, v, s, causal), _ref(q, k, v, s, causal))


@pytest.mark.parametrize("seqlens", [(37, 50), (70, 23)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sinks_cpu_bf16(causal, seqlens):
    sq, sk = seqlens
    q, k, v = make_qkv(2, sq, sk, 4, 2, 32, torch.bfloat16)
    s = make_sinks(4)
    check_fwd_bwd_sinks(q, k, v, s, lambda: _run(q, k, v, s, causal), _ref(q, k, v, s, causal))


@pytest.mark.parametrize("window", [(3, 0), (2, 2), (0, 0), (5, -1)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(37, 50), (50, 37)], ids=str)
def test_sinks_cpu_window(seqlens, causal, window):
    """Windows, rows whose window holds no key included (seqlen_q > seqlen_k: out 0, lse sink)."""
    sq, sk = seqlens
    q, k, v = make_qkv(2, sq, sk, 4, 2, 16, torch.float32)
    s = make_sinks(4)
    check_fwd_bwd_sinks(q, k, v, s, lambda: _run(q, k, v, s, causal, window), _ref(q, k, v, s, causal, window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_sinks_rows_without_keys(dtype):
    """Causal seqlen_q > seqlen_k and a window past the keys: rows without keys get out exactly 0
    and lse exactly sinks[h]; their q gradients are 0 and every gradient is finite."""
    q, k, v = make_qkv(2, 50, 10, 4, 2, 16, dtype)
    s = make_sinks(4)
    for causal, window in [(True, (-1, -1)), (True, (3, 0)), (False, (0, 0))]:
        out, lse = _run(q, k, v, s, causal, window)
        hidden = ~visible_mask(50, 10, causal, *window).any(-1)
        assert hidden.any() and (~hidden).any()
        assert torch.equal(out[:, hidden], torch.zeros_like(out[:, hidden]))
        want = s.detach()[None, :, None].expand(2, 4, int(hidden.sum()))
        assert torch.equal(lse[:, :, hidden], want), (causal, window)
        assert torch.isfinite(lse).all()
        dq, dk, dv, ds = torch.autograd.grad((out * torch.randn_like(out)).sum(), (q, k, v, s))
        assert torch.equal(dq[:, hidden], torch.zeros_like(dq[:, hidden]))
        assert all(torch.isfinite(g).all() for g in (dq, dk, dv, ds))
        assert (ds != 0).all()  # the rows with keys still pull on the sinks


def test_sinks_seqlen_k_zero():
    """No keys at all: out 0, lse = sinks[h] everywhere, zero gradients (D = 0 as out = 0)."""
    q = torch.randn(2, 7, 4, 16, requires_grad=True)
    k = torch.randn(2, 0, 2, 16, requires_grad=True)
    v = torch.randn(2, 0, 2, 16, requires_grad=True)
    s = make_sinks(4)
    for causal in (False, True):
        out, lse = _run(q, k, v, s, causal)
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(lse, s.detach()[None, :, None].expand(2, 4, 7))
        dq, ds = torch.autograd.grad((out * torch.randn_like(out)).sum(), (q, s))
        assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(ds, torch.zeros_like(ds))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_sinks_extreme_values(dtype, causal):
    """Head 0: sink +30, dominating every row (out ~ e^-30 relative to a plain attention's): out,
    dq and dsinks[0] to the float64 reference in relative terms (the absolute rule's atol would
    pass anything this small). Head 1: -inf, no sink: that head's out, lse and dq have the bits of
    the sinks=None call, dsinks[1] = 0. Heads 2, 3: random. Then the whole call by the rule."""
    q, k, v = make_qkv(2, 40, 56, 4, 4, 16, dtype)
    s = torch.tensor([30.0, float("-inf"), 1.5, -2.25], requires_grad=True)
    out, lse = _run(q, k, v, s, causal)
    dout = torch.randn_like(out)
    dq, dk, dv, ds = torch.autograd.grad(out, (q, k, v, s), dout)
    ref_out, ref_lse = attention_ref(q, k, v, None, causal, sinks=s)
    ref_dq, ref_ds = torch.autograd.grad(ref_out, (q, s), dout.double())
    rtol = 1e-5 if dtype == torch.float32 else 1e-10
    assert out[:, :, 0].abs().max() < 1e-7 and out[:, :, 0].abs().max() > 0
    assert _rel_err(out[:, :, 0], ref_out[:, :, 0]) < rtol
    assert _rel_err(dq[:, :, 0], ref_dq[:, :, 0]) < rtol
    # d sinks carry the float32 statistics' rounding (the sinks are float32 in the kernels): 1e-5 for both dtypes
    assert abs(ds[0].item() - ref_ds[0].item()) <= 1e-5 * abs(ref_ds[0].item()) and ref_ds[0] != 0
    assert (lse[:, 0] >= 30).all()
    # The -inf head is the unsunk call's.
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    plain_out, plain_lse = flash_attn_ext.flash_attn_func(q2, k2, v2, causal=causal, return_lse=True)
    pdq, pdk, pdv = torch.autograd.grad(plain_out, (q2, k2, v2), dout)
    assert torch.equal(out[:, :, 1], plain_out[:, :, 1]) and torch.equal(lse[:, 1], plain_lse[:, 1])
    assert torch.equal(dq[:, :, 1], pdq[:, :, 1])
    assert torch.equal(dk[:, :, 1], pdk[:, :, 1]) and torch.equal(dv[:, :, 1], pdv[:, :, 1])  # nheads_k == nheads
    assert ds[1].item() == 0.0
    check_fwd_bwd_sinks(q, k, v, s, lambda: _run(q, k, v, s, causal), _ref(q, k, v, s, causal), dout)


@pytest.mark.parametrize("seqlens,causal,window", [((30, 40), False, (-1, -1)), ((30, 40), True, (-1, -1)),
                                                   ((50, 12), True, (-1, -1)), ((50, 12), False, (2, 1)),
                                                   ((12, 0), False, (-1, -1))], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_neg_inf_sinks_are_no_sinks(dtype, seqlens, causal, window):
    """sinks all -inf: out, lse (+inf on rows without keys) and dq, dk, dv have the bits of
    sinks=None; dsinks is 0."""
    sq, sk = seqlens
    q, k, v = make_qkv(2, sq, sk, 4, 2, 16, dtype)
    s = torch.full((4,), float("-inf"), requires_grad=True)
    out, lse = _run(q, k, v, s, causal, window)
    plain_out, plain_lse = _run(q, k, v, None, causal, window)
    assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)
    if sq > sk:
        assert torch.isinf(lse).any() and (lse[torch.isinf(lse)] > 0).all()  # +inf: rows without keys
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, s), dout)
    plain = torch.autograd.grad(plain_out, (q, k, v), dout)
    for name, a, b in zip("qkv", grads, plain):
        assert torch.equal(a, b), f"d{name}"
    assert torch.equal(grads[3], torch.zeros(4))


@pytest.mark.parametrize("seqlens,causal,window", [((5, 7), False, (-1, -1)), ((5, 7), True, (-1, -1)),
                                                   ((9, 4), True, (-1, -1)), ((6, 8), False, (2, 1))], ids=str)
def test_sinks_gradcheck_float64(seqlens, causal, window):
    """torch.autograd.gradcheck in float64 w.r.t. q, k, v and sinks. The kernels take the sinks as
    float32, so the sinks are dyadic (0.75, -1.5) and the step eps = 2^-12: every perturbed sink is
    exact in float32, and the finite differences see the function the kernels compute."""
    sq, sk = seqlens
    q = torch.randn(1, sq, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, sk, 1, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, sk, 1, 8, dtype=torch.float64, requires_grad=True)
    s = torch.tensor([0.75, -1.5], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=0.5, causal=causal,
                                                          window_size=window, sinks=s),
        (q, k, v, s), eps=2.0**-12)


def test_sinks_gradient_alone_and_dtypes():
    """Any floating sinks dtype is accepted and used as float32: float64 sinks with float32-exact
    values and a non-contiguous view give the float32 call's bits, bfloat16 sinks the call with
    them converted; the gradient comes back in the sinks' dtype. A call where only the sinks
    require grad differentiates them alone."""
    q, k, v = make_qkv(2, 20, 30, 4, 2, 16, torch.float32, requires_grad=False)
    s = make_sinks(4, requires_grad=False)
    out, lse = _run(q, k, v, s, True)
    strided = torch.stack([s, -s], 1)[:, 0]
    assert not strided.is_contiguous() and torch.equal(strided, s)
    for other in (s.double(), strided):
        o2, l2 = _run(q, k, v, other, True)
        assert torch.equal(o2, out) and torch.equal(l2, lse)
    sb = s.bfloat16()
    for a, b in zip(_run(q, k, v, sb, True), _run(q, k, v, sb.float(), True)):
        assert torch.equal(a, b)
    dout = torch.randn_like(out)
    s32 = s.clone().requires_grad_()
    (g32,) = torch.autograd.grad(_run(q, k, v, s32, True)[0], s32, dout)
    ref_out, _ = attention_ref(q, k, v, None, True, sinks=s32)
    (ref_g,) = torch.autograd.grad(ref_out, s32, dout.double())
    base_out, _ = attention_ref(q, k, v, None, True, upcast=False, sinks=s32)
    (base_g,) = torch.autograd.grad(base_out, s32, dout)
    check_accuracy("dsinks alone", g32, ref_g, base_g)
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        sd = s.to(dtype).requires_grad_()
        (gd,) = torch.autograd.grad(_run(q, k, v, sd, True)[0], sd, dout)
        assert gd.dtype == dtype and gd.shape == (4,)
        if dtype == torch.float64:
            assert torch.equal(gd, g32.double())


def test_sinks_forward_ad_cpu():
    """Forward-mode AD (torch.func.jvp) w.r.t. q, k, v and the sinks against the reference's jvp."""
    q, k, v = make_qkv(1, 20, 30, 2, 1, 16, torch.float64, requires_grad=False)
    s = make_sinks(2, requires_grad=False).double()
    tq, tk, tv, ts = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v), torch.randn_like(s)
    for causal, w in [(False, (-1, -1)), (True, (4, 0))]:
        _, out_t = torch.func.jvp(
            lambda a, b, c, d: flash_attn_ext.flash_attn_func(a, b, c, causal=causal, window_size=w, sinks=d),
            (q, k, v, s), (tq, tk, tv, ts))
        _, ref_t = torch.func.jvp(lambda a, b, c, d: attention_ref(a, b, c, None, causal, window_size=w, sinks=d)[0],
                                  (q, k, v, s), (tq, tk, tv, ts))
        # The sinks and their tangent are used as float32: ~1e-7 relative.
        torch.testing.assert_close(out_t, ref_t, rtol=1e-5, atol=1e-6)


def test_sinks_vmap_and_func_grad_cpu():
    """torch.vmap over q, k, v with one sinks tensor is the batched call; torch.func.grad w.r.t. the
    sinks is autograd's."""
    q, k, v = make_qkv(6, 12, 15, 4, 2, 16, torch.float32, requires_grad=False)
    s = make_sinks(4, requires_grad=False)
    f = lambda a, b, c: flash_attn_ext.flash_attn_func(a, b, c, causal=True, sinks=s)  # noqa: E731
    batched = torch.vmap(f)(q.view(3, 2, 12, 4, 16), k.view(3, 2, 15, 2, 16), v.view(3, 2, 15, 2, 16))
    torch.testing.assert_close(batched.reshape(6, 12, 4, 16), f(q, k, v), rtol=1e-6, atol=1e-6)

    def loss(a, b, c, d):
        return flash_attn_ext.flash_attn_func(a, b, c, causal=True, sinks=d).square().sum()

    gq, gs = torch.func.grad(loss, argnums=(0, 3))(q, k, v, s)
    qq, ss = q.clone().requires_grad_(), s.clone().requires_grad_()
    want = torch.autograd.grad(loss(qq, k, v, ss), (qq, ss))
    torch.testing.assert_close(gq, want[0])
    torch.testing.assert_close(gs, want[1])


# ---- CPU: varlen --------------------------------------------------------------------------

def _cu(lengths, device="cpu"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _varlen_inputs(lens_q, lens_k, nheads, nheads_k, d, dtype, device="cpu"):
    def rnd(n, h):
        return torch.randn(n, h, d, dtype=dtype, device=device, requires_grad=True)

    return (rnd(sum(lens_q), nheads), rnd(sum(lens_k), nheads_k), rnd(sum(lens_k), nheads_k),
            _cu(lens_q, device), _cu(lens_k, device))


VARLEN_LENGTHS = [([5, 17, 64, 1], [5, 17, 64, 1]), ([3, 40, 9], [70, 12, 9]), ([0, 8, 0, 33, 20], [4, 0, 0, 33, 6])]


@pytest.mark.parametrize("lens_q,lens_k", VARLEN_LENGTHS)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (3, 0)), (False, (2, 2))],
                         ids=["full", "causal", "causal-window", "window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sinks_varlen_cpu(dtype, causal, window, lens_q, lens_k, poison_empty):
    """Packed sequences (zero-length q and k ones included: rows without keys get lse = sinks)
    with sinks against the per-sequence reference, the sinks' gradient (summed over sequences)
    included."""
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, 16, dtype)
    s = make_sinks(4)
    check_fwd_bwd_sinks(
        q, k, v, s,
        lambda: flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                      window_size=window, sinks=s, return_lse=True),
        lambda upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, None, causal, upcast, window_size=window,
                                            sinks=s))


def test_sinks_varlen_equals_dense_per_sequence():
    """On the CPU each packed sequence with sinks is the dense call on it alone, bit for bit
    (out, lse, dq, dk, dv); dsinks is the sum of the sequences' dsinks."""
    lens_q, lens_k = [7, 30, 0, 1, 64], [9, 30, 5, 0, 40]
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, 16, torch.float32)
    s = make_sinks(4)
    out, lse = flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 40, causal=True, sinks=s,
                                                     return_lse=True)
    dout = torch.randn_like(out)
    dq, dk, dv, ds = torch.autograd.grad(out, (q, k, v, s), dout)
    ds_sum = torch.zeros(4)
    for b in range(len(lens_q)):
        a, e, ka, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if a == e:
            continue
        qs = q[a:e].detach()[None].requires_grad_()
        ks, vs = (t[ka:ke].detach()[None].requires_grad_() for t in (k, v))
        sb = s.detach().clone().requires_grad_()
        o, l = _run(qs, ks, vs, sb, True)
        assert torch.equal(o[0], out[a:e]) and torch.equal(l[0], lse[:, a:e]), b
        g = torch.autograd.grad(o, (qs, ks, vs, sb), dout[a:e][None])
        assert torch.equal(g[0][0], dq[a:e]), b
        assert torch.equal(g[1][0], dk[ka:ke]) and torch.equal(g[2][0], dv[ka:ke]), b
        ds_sum += g[3]
    torch.testing.assert_close(ds, ds_sum, rtol=1e-5, atol=1e-6)


def test_sinks_varlen_uncovered_rows():
    """Rows of q past cu_seqlens_q[-1] are in no sequence: out 0 there, and they add nothing to
    dsinks whatever dout holds on them (the dsinks of the call without them)."""
    lens = [6, 9]
    q, k, v, cu_q, cu_k = _varlen_inputs(lens, lens, 2, 2, 16, torch.float32)
    extra = torch.randn(4, 2, 16)
    q_all = torch.cat([q.detach(), extra]).requires_grad_()
    s = make_sinks(2)
    out = flash_attn_ext.flash_attn_varlen_func(q_all, k, v, cu_q, cu_k, 9, 9, causal=True, sinks=s)
    assert torch.equal(out[15:], torch.zeros_like(out[15:]))
    dout = torch.randn_like(out)
    (ds_all,) = torch.autograd.grad(out, s, dout)
    out2 = flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True, sinks=s)
    (ds,) = torch.autograd.grad(out2, s, dout[:15])
    torch.testing.assert_close(ds_all, ds, rtol=1e-6, atol=1e-7)


def test_sinks_varlen_gradcheck_float64():
    lens_q, lens_k = [3, 0, 5], [4, 2, 3]
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 2, 1, 8, torch.float64)
    s = torch.tensor([0.5, -1.25], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 4, softmax_scale=0.5,
                                                                 causal=True, sinks=s),
        (q, k, v, s), eps=2.0**-12)


# ---- CPU: KV cache ------------------------------------------------------------------------

def _cache(batch, capacity, nheads_k, d, dtype, page_size, device="cpu"):
    """A random K/V cache, contiguous (page_size 0) or paged with a shuffled block table."""
    if page_size:
        max_blocks = capacity // page_size
        num_blocks = batch * max_blocks + 2
        k = torch.randn(num_blocks, page_size, nheads_k, d, dtype=dtype, device=device)
        table = torch.randperm(num_blocks, device=device)[:batch * max_blocks].reshape(batch, max_blocks).int()
    else:
        k = torch.randn(batch, capacity, nheads_k, d, dtype=dtype, device=device)
        table = None
    return k, torch.randn_like(k), table


def _kvcache_case(dtype, seqlen_q, page_size, seqlen_new):
    """A CPU decode / chunked-prefill case (batch 4, GQA 4:2, d 16, a 64-row cache, contiguous or
    paged): cache lengths 0, 1, 23 and full after the append, NaN in the rows past each sequence
    (test_kvcache.poison_unused). Returns (q, k_cache, v_cache, block_table, cache_seqlens, k_new,
    v_new, rows used per sequence after the append)."""
    batch, nheads, nheads_k, d, cap = 4, 4, 2, 16, 64
    k_cache, v_cache, table = _cache(batch, cap, nheads_k, d, dtype, page_size)
    cache_seqlens = torch.tensor([0, 1, 23, cap - seqlen_new], dtype=torch.int32)
    used = (cache_seqlens + seqlen_new).tolist()
    poison_unused(k_cache, v_cache, table, used)
    q = torch.randn(batch, seqlen_q, nheads, d, dtype=dtype)
    k_new = torch.randn(batch, seqlen_new, nheads_k, d, dtype=dtype) if seqlen_new else None
    v_new = torch.randn(batch, seqlen_new, nheads_k, d, dtype=dtype) if seqlen_new else None
    return q, k_cache, v_cache, table, cache_seqlens, k_new, v_new, used


@pytest.mark.parametrize("seqlen_new", [0, 2])
@pytest.mark.parametrize("page_size", [0, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("seqlen_q,causal", [(1, False), (1, True), (4, True), (4, False)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sinks_kvcache_cpu(dtype, seqlen_q, causal, page_size, seqlen_new):
    """Decode / chunked prefill against a cache with sinks, contiguous and paged, 1 and 3 splits,
    new keys appended, varying cache lengths (0: rows without keys get out 0 and lse = sinks[h];
    1 with 4 causal queries: the first rows see none)."""
    q, k_cache, v_cache, table, cache_seqlens, k_new, v_new, used = _kvcache_case(dtype, seqlen_q, page_size,
                                                                                  seqlen_new)
    nheads = q.shape[2]
    s = make_sinks(4, requires_grad=False)
    outs = []
    for num_splits in (1, 3):
        kc, vc = k_cache.clone(), v_cache.clone()
        out, lse = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=cache_seqlens,
                                                          block_table=table, causal=causal, num_splits=num_splits,
                                                          sinks=s, return_lse=True)
        lens = torch.tensor(used, dtype=torch.int32)
        ref = attention_kvcache_ref(q, kc, vc, lens, table, None, causal, sinks=s)
        base = attention_kvcache_ref(q, kc, vc, lens, table, None, causal, upcast=False, sinks=s)
        check_accuracy(f"out (num_splits={num_splits})", out, ref[0], base[0])
        check_accuracy(f"softmax_lse (num_splits={num_splits})", lse, ref[1], base[1])
        if seqlen_new == 0:  # no cached key, nothing new
            assert torch.equal(out[0], torch.zeros_like(out[0]))
            assert torch.equal(lse[0], s[:, None].expand(nheads, seqlen_q))
        outs.append(out)
    nosink = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, causal=causal)
    assert not torch.allclose(outs[-1][1:], nosink[1:])  # the sinks matter here


def test_sinks_kvcache_neg_inf_and_dtypes():
    """-inf sinks in a kvcache call: the bits of sinks=None (lse +inf on rows without keys), each
    split count; float64 sinks are used as float32; a sinks tensor that requires grad is refused
    (the op is inference only), accepted under no_grad."""
    k_cache, v_cache, table = _cache(3, 64, 2, 16, torch.float32, 16)
    cache_seqlens = torch.tensor([0, 9, 64], dtype=torch.int32)
    q = torch.randn(3, 2, 4, 16)
    kw = dict(cache_seqlens=cache_seqlens, block_table=table, causal=True, return_lse=True)
    for num_splits in (1, 3):
        plain = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=num_splits, **kw)
        inf = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=num_splits,
                                                     sinks=torch.full((4,), float("-inf")), **kw)
        assert torch.equal(inf[0], plain[0]) and torch.equal(inf[1], plain[1]), num_splits
        assert torch.isinf(inf[1][0]).all()
    s = make_sinks(4, requires_grad=False)
    a = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, sinks=s, **kw)
    b = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, sinks=s.double(), **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(RuntimeError, match="gradient|grad"):
        flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, sinks=s.clone().requires_grad_(), **kw)
    with torch.no_grad():
        c = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, sinks=s.clone().requires_grad_(), **kw)
    assert torch.equal(a[0], c[0])


# ---- CPU: packed layouts ------------------------------------------------------------------

@pytest.mark.parametrize("entry", ["qkvpacked", "kvpacked", "varlen_qkvpacked", "varlen_kvpacked"])
def test_sinks_packed_entries(entry):
    """Each packed entry passes the sinks through: the unpacked call's bits, dsinks included."""
    s = make_sinks(4)
    s2 = s.detach().clone().requires_grad_()
    lens = [5, 0, 19]
    cu = _cu(lens)
    if entry == "qkvpacked":
        packed = torch.randn(2, 19, 3, 4, 16, requires_grad=True)
        out = flash_attn_ext.flash_attn_qkvpacked_func(packed, causal=True, sinks=s)
        q, k, v = (t.detach().clone().requires_grad_() for t in packed.unbind(2))
        ref = flash_attn_ext.flash_attn_func(q, k, v, causal=True, sinks=s2)
        stack = 2
    elif entry == "kvpacked":
        q = torch.randn(2, 19, 4, 16, requires_grad=True)
        packed = torch.randn(2, 33, 2, 2, 16, requires_grad=True)
        out = flash_attn_ext.flash_attn_kvpacked_func(q, packed, causal=True, sinks=s)
        k, v = (t.detach().clone().requires_grad_() for t in packed.unbind(2))
        ref = flash_attn_ext.flash_attn_func(q, k, v, causal=True, sinks=s2)
        stack = 2
    elif entry == "varlen_qkvpacked":
        packed = torch.randn(24, 3, 4, 16, requires_grad=True)
        out = flash_attn_ext.flash_attn_varlen_qkvpacked_func(packed, cu, 19, causal=True, sinks=s)
        q, k, v = (t.detach().clone().requires_grad_() for t in packed.unbind(1))
        ref = flash_attn_ext.flash_attn_varlen_func(q, k, v, cu, cu, 19, 19, causal=True, sinks=s2)
        stack = 1
    else:
        q = torch.randn(24, 4, 16, requires_grad=True)
        packed = torch.randn(24, 2, 2, 16, requires_grad=True)
        out = flash_attn_ext.flash_attn_varlen_kvpacked_func(q, packed, cu, cu, 19, 19, causal=True, sinks=s)
        k, v = (t.detach().clone().requires_grad_() for t in packed.unbind(1))
        ref = flash_attn_ext.flash_attn_varlen_func(q, k, v, cu, cu, 19, 19, causal=True, sinks=s2)
        stack = 1
    assert torch.equal(out, ref)
    dout = torch.randn_like(out)
    (dpacked, ds) = torch.autograd.grad(out, (packed, s), dout)
    slots = (q, k, v) if "qkv" in entry else (k, v)
    *dslots, ds2 = torch.autograd.grad(ref, (*slots, s2), dout)
    assert torch.equal(dpacked, torch.stack(dslots, stack)) and torch.equal(ds, ds2)
    assert (ds != 0).all()


# ---- CPU: bad input -----------------------------------------------------------------------

def _public_calls(sinks):
    """Each public entry point called with ``sinks`` on small valid CPU inputs."""
    q, k, v = make_qkv(1, 8, 8, 4, 2, 16, torch.float32, requires_grad=False)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    kc = torch.randn(1, 16, 2, 16)
    qkv = torch.randn(1, 8, 3, 4, 16)
    return {
        "flash_attn_func": lambda: flash_attn_ext.flash_attn_func(q, k, v, sinks=sinks),
        "flash_attn_varlen_func": lambda: flash_attn_ext.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8,
                                                                                sinks=sinks),
        "flash_attn_with_kvcache": lambda: flash_attn_ext.flash_attn_with_kvcache(q, kc, kc.clone(), sinks=sinks),
        "flash_attn_qkvpacked_func": lambda: flash_attn_ext.flash_attn_qkvpacked_func(qkv, sinks=sinks),
        "flash_attn_kvpacked_func": lambda: flash_attn_ext.flash_attn_kvpacked_func(q, qkv[:, :, 1:, :2],
                                                                                    sinks=sinks),
        "flash_attn_varlen_qkvpacked_func": lambda: flash_attn_ext.flash_attn_varlen_qkvpacked_func(qkv[0], cu, 8,
                                                                                                    sinks=sinks),
        "flash_attn_varlen_kvpacked_func": lambda: flash_attn_ext.flash_attn_varlen_kvpacked_func(
            q[0], qkv[0, :, 1:, :2], cu, cu, 8, 8, sinks=sinks),
    }


PUBLIC = list(_public_calls(None))


@pytest.mark.parametrize("entry", PUBLIC)
def test_sinks_bad_input_public(entry):
    """TypeError naming sinks for a non-tensor; RuntimeError naming sinks for a wrong shape, a
    non-floating dtype or another device; valid sinks run."""
    assert _public_calls(make_sinks(4, requires_grad=False))[entry]() is not None
    for bad in ([0.5, 1.0, 2.0, 3.0], 1.5, "sinks", (torch.zeros(4),)):
        with pytest.raises(TypeError, match="sinks"):
            _public_calls(bad)[entry]()
    for bad in (torch.randn(3), torch.randn(5), torch.randn(1, 4), torch.randn(4, 1), torch.tensor(0.5),
                torch.randn(2), torch.arange(4), torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.int32),
                torch.randn(4, dtype=torch.complex64), torch.randn(4, device="meta")):
        with pytest.raises(RuntimeError, match="sinks"):
            _public_calls(bad)[entry]()


def test_sinks_bad_input_raw_ops():
    """The raw ops take float32 sinks only (RuntimeError naming sinks for float64, bfloat16), of
    shape (nheads,); the fake kernels refuse the same (meta tensors)."""
    q, k, v = make_qkv(2, 9, 11, 4, 2, 16, torch.float32, requires_grad=False)
    ops = torch.ops.flash_attn_ext
    good = make_sinks(4, requires_grad=False)
    out, lse, stats = ops.forward(q, k, v, 0.25, True, -1, -1, good)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11], dtype=torch.int32)
    kc = torch.randn(2, 16, 2, 16)
    lens = torch.tensor([3, 16], dtype=torch.int32)
    vout, vlse, vstats = ops.varlen_forward(q[0], k[0], v[0], cu, cu_k, 5, 6, 0.25, True, -1, -1, good)
    calls = {
        "forward": lambda s: ops.forward(q, k, v, 0.25, True, -1, -1, s),
        "backward": lambda s: ops.backward(torch.randn_like(out), q, k, v, out, lse, 0.25, True, stats, -1, -1, s),
        "varlen_forward": lambda s: ops.varlen_forward(q[0], k[0], v[0], cu, cu_k, 5, 6, 0.25, True, -1, -1, s),
        "varlen_backward": lambda s: ops.varlen_backward(torch.randn_like(vout), q[0], k[0], v[0], vout, vlse, cu,
                                                         cu_k, 5, 6, 0.25, True, vstats, -1, -1, s),
        "fwd_kvcache": lambda s: ops.fwd_kvcache(q, kc, kc.clone(), None, None, lens, None, 0.25, True, 0, -1, -1, s),
    }
    for name, call in calls.items():
        call(good)
        for bad in (good.double(), good.bfloat16(), good.half(), torch.randn(5), torch.randn(2, 2),
                    torch.arange(4)):
            with pytest.raises(RuntimeError, match="sinks"):
                call(bad)
    m = lambda t: t.to("meta")  # noqa: E731
    with pytest.raises(RuntimeError, match="sinks"):
        ops.forward(m(q), m(k), m(v), 0.25, False, -1, -1, m(good.double()))
    with pytest.raises(RuntimeError, match="sinks"):
        ops.forward(m(q), m(k), m(v), 0.25, False, -1, -1, torch.randn(3, device="meta"))
    with pytest.raises(RuntimeError, match="sinks"):
        ops.forward(m(q), m(k), m(v), 0.25, False, -1, -1, good)  # cpu sinks, meta q: another device
    assert ops.forward(m(q), m(k), m(v), 0.25, False, -1, -1, m(good))[0].shape == q.shape


# ---- CPU: the op surface (opcheck, torch.compile) -----------------------------------------

def test_sinks_opcheck():
    """The ops' schemas, fake kernels and autograd registrations with sinks given."""
    from torch.library import opcheck

    ops = torch.ops.flash_attn_ext
    q, k, v = make_qkv(2, 37, 50, 4, 2, 16, torch.float32)
    s = make_sinks(4)
    opcheck(ops.forward.default, (q, k, v, 0.25, True, -1, -1, s))
    opcheck(ops.forward.default, (q, k, v, 0.25, False, 5, 2, s))
    qd, kd, vd, sd = (t.detach() for t in (q, k, v, s))
    out, lse, stats = ops.forward(qd, kd, vd, 0.25, True, -1, -1, sd)
    opcheck(ops.backward.default, (torch.randn_like(out), qd, kd, vd, out, lse, 0.25, True, stats, -1, -1, sd))
    cu = torch.tensor([0, 20, 37], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 50], dtype=torch.int32)
    opcheck(ops.varlen_forward.default, (q[0], k[0], v[0], cu, cu_k, 20, 30, 0.25, True, -1, -1, s))
    vout, vlse, vstats = ops.varlen_forward(qd[0], kd[0], vd[0], cu, cu_k, 20, 30, 0.25, True, -1, -1, sd)
    opcheck(ops.varlen_backward.default, (torch.randn_like(vout), qd[0], kd[0], vd[0], vout, vlse, cu, cu_k, 20, 30,
                                          0.25, True, vstats, -1, -1, sd))
    kc, vc = torch.randn(2, 64, 2, 16), torch.randn(2, 64, 2, 16)
    opcheck(ops.fwd_kvcache.default, (qd[:, :1], kc, vc, None, None, torch.tensor([10, 64], dtype=torch.int32), None,
                                      0.25, True, 0, -1, -1, sd), test_utils=("test_schema", "test_faketensor"))
    dout = torch.randn_like(out)
    opcheck(ops.backward_dsinks.default, (dout, qd, kd, vd, out, lse, 0.25, True, stats, -1, -1, sd))


def _dsinks_ops_against_formula(device, dtype):
    """backward_dsinks: dq, dk, dv bitwise the backward op's, dsinks the torch formula's
    (ops.sinks_grad) within float32 summation-order noise (on CUDA: from the backward's workspace)."""
    from flash_attn_ext import ops as fops

    ops = torch.ops.flash_attn_ext
    for causal, sq, sk in ((True, 150, 170), (False, 200, 70), (True, 300, 100)):  # the last: rows without keys
        q, k, v = make_qkv(2, sq, sk, 4, 2, 64, dtype, device=device, requires_grad=False)
        s = make_sinks(4, requires_grad=False).to(device)
        out, lse, stats = ops.forward(q, k, v, 0.125, causal, -1, -1, s)
        dout = torch.randn_like(out)
        dq, dk, dv = ops.backward(dout, q, k, v, out, lse, 0.125, causal, stats, -1, -1, s)
        dq2, dk2, dv2, ds = ops.backward_dsinks(dout, q, k, v, out, lse, 0.125, causal, stats, -1, -1, s)
        assert torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(dv, dv2)
        want = fops.sinks_grad(dout, out, lse.transpose(1, 2), s)
        assert torch.isfinite(ds).all()
        torch.testing.assert_close(ds, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_dsinks_ops_cpu(dtype):
    _dsinks_ops_against_formula("cpu", dtype)


def test_backward_dsinks_ops_errors():
    """sinks required: a wrong shape or dtype is the backward's sinks error."""
    ops = torch.ops.flash_attn_ext
    q, k, v = make_qkv(1, 8, 8, 4, 2, 16, torch.float32, requires_grad=False)
    out, lse, stats = ops.forward(q, k, v, 0.25, False)
    for bad in (torch.zeros(3), torch.zeros(4, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="sinks"):
            ops.backward_dsinks(torch.randn_like(out), q, k, v, out, lse, 0.25, False, stats, -1, -1, bad)


def _compiled_matches_eager(step, inputs, backend):
    """torch.compile(step, fullgraph=True) of a scalar loss: the loss and its gradients w.r.t. every
    input equal eager's."""
    loss = torch.compile(step, fullgraph=True, backend=backend)(*inputs)
    grads = torch.autograd.grad(loss, inputs)
    ref_loss = step(*inputs)
    ref_grads = torch.autograd.grad(ref_loss, inputs)
    torch.testing.assert_close(loss, ref_loss)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_sinks_torch_compile_fullgraph(backend):
    """fwd + bwd with sinks compiles with no graph break (the fake kernels, the sinks' gradient);
    loss and gradients (dsinks included) match eager."""
    torch._dynamo.reset()

    def step(q, k, v, s):
        out = flash_attn_ext.flash_attn_func(q, k, v, causal=True, window_size=(9, 0), sinks=s)
        return (out * out).sum()

    q, k, v = make_qkv(2, 40, 56, 4, 2, 16, torch.float32)
    s = make_sinks(4)
    _compiled_matches_eager(step, (q, k, v, s), backend)


def test_sinks_torch_compile_varlen_and_kvcache():
    """Varlen fwd + bwd with sinks and a kvcache decode step with sinks compile with no graph break."""
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = _varlen_inputs([5, 11, 0], [7, 11, 3], 4, 2, 16, torch.float32)
    s = make_sinks(4)

    def step(q, k, v, s):
        return flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 11, 11, causal=True, sinks=s).square().sum()

    _compiled_matches_eager(step, (q, k, v, s), "aot_eager")

    def decode(q, kc, vc, lens, s):
        return flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, sinks=s)

    qd = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(2, 32, 2, 16), torch.randn(2, 32, 2, 16)
    lens = torch.tensor([0, 20], dtype=torch.int32)
    sd = s.detach()
    out = torch.compile(decode, fullgraph=True, backend="aot_eager")(qd, kc, vc, lens, sd)
    assert torch.equal(out, decode(qd, kc, vc, lens, sd))


# ---- CUDA ---------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="attention-sink CUDA kernel tests need a CUDA GPU "
                                                               "(none visible)")

# (seqlen_q, seqlen_k): one key, a tile, ragged both ways (333 > 200: causal rows without keys), several tiles.
CUDA_SHAPES = [(1, 1), (128, 128), (200, 333), (333, 200), (1000, 1000)]


def _cuda_sinks(nheads):
    """Random sinks on the GPU, one head's large (+8: the sink takes most of the weight)."""
    s = make_sinks(nheads, requires_grad=False)
    s[0] = 8.0
    return s.cuda().requires_grad_()


@cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_sinks_cuda_matches_reference(arch_path, poison_empty, dtype, d, seqlens, causal):
    require_hdim(d, exact=True)
    sq, sk = seqlens
    q, k, v = make_qkv(2, sq, sk, 4, 2, d, dtype, device="cuda")
    s = _cuda_sinks(4)
    check_fwd_bwd_sinks(q, k, v, s, lambda: _run(q, k, v, s, causal), _ref(q, k, v, s, causal))


@cuda
@pytest.mark.parametrize("d", [96, 192, 256])
def test_sinks_cuda_other_head_dims(arch_path, poison_empty, d):
    require_hdim(d, exact=True)
    q, k, v = make_qkv(1, 300, 500, 4, 2, d, torch.bfloat16, device="cuda")
    s = _cuda_sinks(4)
    for causal in (False, True):
        check_fwd_bwd_sinks(q, k, v, s, lambda: _run(q, k, v, s, causal), _ref(q, k, v, s, causal))


@cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window,seqlens", [(True, (100, 0), (700, 900)), (False, (64, 32), (900, 700)),
                                                   (True, (50, 0), (600, 300))], ids=str)
def test_sinks_cuda_window(arch_path, poison_empty, d, causal, window, seqlens):
    """Sliding windows with sinks (the last case: causal rows past the keys, lse = sinks there)."""
    require_hdim(d, exact=True)
    sq, sk = seqlens
    q, k, v = make_qkv(2, sq, sk, 4, 2, d, torch.bfloat16, device="cuda")
    s = _cuda_sinks(4)
    out, lse, _ = check_fwd_bwd_sinks(q, k, v, s, lambda: _run(q, k, v, s, causal, window),
                                      _ref(q, k, v, s, causal, window))
    hidden = ~visible_mask(sq, sk, causal, *window, device="cuda").any(-1)
    if hidden.any():
        assert torch.equal(out[:, hidden], torch.zeros_like(out[:, hidden]))
        assert torch.equal(lse[:, :, hidden], s.detach()[None, :, None].expand(2, 4, int(hidden.sum())))


@cuda
@pytest.mark.parametrize("d", [64, 128])
def test_sinks_cuda_rows_without_keys(arch_path, poison_empty, d):
    """Causal seqlen_q > seqlen_k on the GPU: rows without keys get out exactly 0 and lse exactly
    sinks[h], finite gradients."""
    require_hdim(d, exact=True)
    q, k, v = make_qkv(2, 400, 130, 4, 2, d, torch.bfloat16, device="cuda")
    s = _cuda_sinks(4)
    out, lse = _run(q, k, v, s, True)
    hidden = ~visible_mask(400, 130, True, device="cuda").any(-1)
    assert torch.equal(out[:, hidden], torch.zeros_like(out[:, hidden]))
    assert torch.equal(lse[:, :, hidden], s.detach()[None, :, None].expand(2, 4, int(hidden.sum())))
    grads = torch.autograd.grad((out.float() * torch.randn_like(out.float())).sum(), (q, k, v, s))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][:, hidden], torch.zeros_like(grads[0][:, hidden]))


@cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_sinks_cuda_neg_inf_is_no_sink(arch_path, d, causal):
    """-inf sinks on the GPU: the bits of sinks=None, forward (lse +inf on rows without keys) and
    backward; one -inf head among finite ones: that head's out and lse bits."""
    require_hdim(d, exact=True)
    q, k, v = make_qkv(2, 333, 200, 4, 2, d, torch.bfloat16, device="cuda")
    s = torch.full((4,), float("-inf"), device="cuda", requires_grad=True)
    out, lse = _run(q, k, v, s, causal)
    plain_out, plain_lse = _run(q, k, v, None, causal)
    assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, s), dout)
    for name, a, b in zip("qkv", grads, torch.autograd.grad(plain_out, (q, k, v), dout)):
        assert torch.equal(a, b), f"d{name}"
    assert torch.equal(grads[3], torch.zeros_like(grads[3]))
    mixed = torch.tensor([1.0, float("-inf"), -2.0, 3.0], device="cuda")
    o2, l2 = _run(q.detach(), k.detach(), v.detach(), mixed, causal)
    assert torch.equal(o2[:, :, 1], plain_out[:, :, 1]) and torch.equal(l2[:, 1], plain_lse[:, 1])


@cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sinks_cuda_varlen(arch_path, poison_empty, causal, d):
    """5 packed sequences of mixed lengths, one empty (and one without keys), with sinks, against
    the per-sequence reference, dsinks included."""
    require_hdim(d, exact=True)
    lens_q, lens_k = [70, 1, 0, 300, 129], [90, 5, 3, 300, 0]
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, d, torch.bfloat16, device="cuda")
    s = _cuda_sinks(4)
    check_fwd_bwd_sinks(
        q, k, v, s,
        lambda: flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 300, 300, causal=causal, sinks=s,
                                                      return_lse=True),
        lambda upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, None, causal, upcast, sinks=s))


def _cuda_cache(lens, capacity, nheads_k, d, dtype, page_size):
    """A CUDA K/V cache whose sequence b holds random keys in rows [0, lens[b]) and NaN past them;
    paged: a shuffled block table and two unused all-NaN blocks."""
    batch = len(lens)
    dense = [torch.randn(batch, capacity, nheads_k, d, device="cuda", dtype=dtype) for _ in range(2)]
    for t in dense:
        for b, n in enumerate(lens):
            t[b, n:] = float("nan")
    if not page_size:
        return dense[0], dense[1], None
    max_blocks = math.ceil(capacity / page_size)
    num_blocks = batch * max_blocks + 2
    table = torch.randperm(num_blocks, device="cuda")[:batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    paged = []
    for t in dense:
        full = torch.full((batch, max_blocks * page_size, nheads_k, d), float("nan"), device="cuda", dtype=dtype)
        full[:, :capacity] = t
        p = torch.full((num_blocks, page_size, nheads_k, d), float("nan"), device="cuda", dtype=dtype)
        p[table.long().flatten()] = full.reshape(batch * max_blocks, page_size, nheads_k, d)
        paged.append(p)
    return paged[0], paged[1], table


def _cuda_kvcache_case(dtype, seqlen_q, page_size):
    """A CUDA split-KV case: batch 4, GQA 8:2, head dim 128, a 1000-row cache (contiguous or paged,
    NaN past each sequence: _cuda_cache) with lengths 0, 1, 517 and full. Returns (q, k_cache,
    v_cache, block_table, cache_seqlens)."""
    batch, nheads, nheads_k, d, cap = 4, 8, 2, 128, 1000
    lens = [0, 1, 517, cap]
    k_cache, v_cache, table = _cuda_cache(lens, cap, nheads_k, d, dtype, page_size)
    cache_seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, seqlen_q, nheads, d, dtype=dtype, device="cuda")
    return q, k_cache, v_cache, table, cache_seqlens


@cuda
@pytest.mark.parametrize("page_size", [0, 16, 64], ids=["contiguous", "paged16", "paged64"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_sinks_cuda_kvcache(arch_path, poison_empty, dtype, seqlen_q, page_size):
    """Split-KV decode with sinks, GQA 8:2, head dim 128, a 1000-row cache (NaN past each
    sequence), lengths 0 (out 0, lse = sinks), 1, ragged and full, causal; num_splits 1, 0 (auto)
    and 4 (the combine adds the sink once); -inf sinks: the bits of sinks=None."""
    require_hdim(128, exact=True)
    q, k_cache, v_cache, table, cache_seqlens = _cuda_kvcache_case(dtype, seqlen_q, page_size)
    nheads = q.shape[2]
    s = _cuda_sinks(nheads).detach()
    ref = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens, table, None, True, sinks=s)
    base = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens, table, None, True, upcast=False, sinks=s)
    kw = dict(cache_seqlens=cache_seqlens, block_table=table, causal=True, return_lse=True)
    for num_splits in (1, 0, 4):
        out, lse = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=num_splits, sinks=s, **kw)
        check_accuracy(f"out (num_splits={num_splits})", out, ref[0], base[0])
        check_accuracy(f"softmax_lse (num_splits={num_splits})", lse, ref[1], base[1])
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.equal(lse[0], s[:, None].expand(nheads, seqlen_q))
        plain = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=num_splits, **kw)
        inf = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=num_splits,
                                                     sinks=torch.full_like(s, float("-inf")), **kw)
        assert torch.equal(inf[0], plain[0]) and torch.equal(inf[1], plain[1]), num_splits


@cuda
def test_sinks_cuda_kvcache_append(arch_path):
    """New keys appended in place with sinks: the reference on the cache after the append."""
    require_hdim(128, exact=True)
    lens = [0, 40, 990]
    k_cache, v_cache, table = _cuda_cache([n + 3 for n in lens], 1000, 2, 128, torch.bfloat16, 16)
    q = torch.randn(3, 3, 8, 128, dtype=torch.bfloat16, device="cuda")
    k_new = torch.randn(3, 3, 2, 128, dtype=torch.bfloat16, device="cuda")
    v_new = torch.randn_like(k_new)
    s = _cuda_sinks(8).detach()
    cache_seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                      block_table=table, causal=True, num_splits=4, sinks=s,
                                                      return_lse=True)
    used = cache_seqlens + 3
    ref = attention_kvcache_ref(q, k_cache, v_cache, used, table, None, True, sinks=s)
    base = attention_kvcache_ref(q, k_cache, v_cache, used, table, None, True, upcast=False, sinks=s)
    check_accuracy("out", out, ref[0], base[0])
    check_accuracy("softmax_lse", lse, ref[1], base[1])


@cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_sinks_cuda_large_magnitude(arch_path, dtype, causal):
    """q * 100 with sinks (one at +300, near the rows' max scores): finite outputs and gradients, out
    and dv by the accuracy rule, lse relative to its size."""
    require_hdim(128, exact=True)
    q, k, v = make_qkv(1, 300, 400, 4, 2, 128, dtype, device="cuda", requires_grad=False)
    q = (q.float() * 100).to(dtype).requires_grad_()
    k, v = k.requires_grad_(), v.requires_grad_()
    s = torch.tensor([300.0, 1.0, -3.0, 40.0], device="cuda", requires_grad=True)
    out, lse = _run(q, k, v, s, causal)
    ref_out, ref_lse = attention_ref(q, k, v, None, causal, sinks=s)
    base_out, base_lse = attention_ref(q, k, v, None, causal, upcast=False, sinks=s)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert torch.isfinite(base_out).all(), "the same-dtype baseline overflowed: pick a smaller magnitude"
    check_accuracy("out", out, ref_out, base_out)
    lse_floor = 4 * torch.finfo(torch.float32).eps * ref_lse.abs().max().item()
    check_accuracy("softmax_lse", lse, ref_lse, base_lse, atol=lse_floor + 1e-5)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, s), dout)
    assert all(torch.isfinite(g).all() for g in grads)
    ref_dv = torch.autograd.grad(ref_out, v, dout.double())[0]
    base_dv = torch.autograd.grad(base_out, v, dout)[0]
    check_accuracy("dv", grads[2], ref_dv, base_dv, atol=torch.finfo(dtype).eps * ref_dv.abs().max().item())


@cuda
def test_sinks_cuda_device_and_dtype_checks():
    """sinks on another device than q (CPU sinks, CUDA q, and back): RuntimeError naming sinks;
    any floating dtype accepted (float64 sinks with float32-exact values: the float32 bits)."""
    require_hdim(64)
    q, k, v = make_qkv(1, 16, 16, 4, 2, 64, torch.bfloat16, device="cuda", requires_grad=False)
    s = make_sinks(4, requires_grad=False)
    with pytest.raises(RuntimeError, match="sinks"):
        flash_attn_ext.flash_attn_func(q, k, v, sinks=s)
    with pytest.raises(RuntimeError, match="sinks"):
        flash_attn_ext.flash_attn_func(q.cpu().float(), k.cpu().float(), v.cpu().float(), sinks=s.cuda())
    with pytest.raises(RuntimeError, match="sinks"):
        flash_attn_ext.flash_attn_with_kvcache(q, k, v, sinks=s)
    a = _run(q, k, v, s.cuda())
    b = _run(q, k, v, s.cuda().double())
    c = _run(q, k, v, s.cuda().half())
    d = _run(q, k, v, s.cuda().half().float())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(c[0], d[0]) and torch.equal(c[1], d[1])


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_backward_dsinks_ops_cuda(arch_path, poison_empty, dtype):
    """The CUDA dsinks from the backward's workspace (D and LSE planes) against the torch formula."""
    require_hdim(64, exact=True)
    _dsinks_ops_against_formula("cuda", dtype)


# ---- faults a user trial found (each failed before its fix) --------------------------------

def test_sinks_double_backward_raises():
    """Differentiating the sinks' gradient (create_graph, grad of grad) raises as for dq / dk / dv: its
    formula treats the LSE as a constant, so a derivative of it would be silently wrong."""
    q, k, v = make_qkv(1, 4, 4, 2, 2, 8, torch.float64, requires_grad=False)
    s = torch.tensor([0.5, -0.25], dtype=torch.float64)
    inner = torch.func.grad(lambda s: flash_attn_ext.flash_attn_func(q, k, v, sinks=s).pow(2).sum())
    with pytest.raises(RuntimeError, match="double backward"):
        torch.func.grad(lambda s: inner(s).sum())(s)
    s2 = s.clone().requires_grad_()
    (g,) = torch.autograd.grad(flash_attn_ext.flash_attn_func(q, k, v, sinks=s2).pow(2).sum(), s2, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(g.sum(), s2)


def test_sinks_jvp_keyless_rows_with_a_minus_inf_sink():
    """Forward-mode AD: a row without keys under a -inf (no) sink has tangent 0, not NaN."""
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 2, 8, dtype=torch.float64)
    s = torch.tensor([float("-inf"), 0.5], dtype=torch.float64)
    _, t = torch.func.jvp(lambda q: flash_attn_ext.flash_attn_func(q, k, k, causal=True, sinks=s), (q,),
                          (torch.ones_like(q),))
    assert torch.isfinite(t).all() and torch.equal(t[:, :2], torch.zeros_like(t[:, :2]))


def test_sinks_grad_paths_agree_in_float32():
    """The sinks' gradient from the fused backward (flash_api.cpp's sinks_grad_cpu) and from the torch
    formula (sinks_grad: torch.func, vmap, double-backward recording) accumulate alike (float64 for
    float32 inputs), so they agree to an ulp; the torch formula once summed in float32 (ulps
    apart: here 5e-7 relative; up to 3.9x the float32 baseline's error in a helper's sweep)."""
    torch.manual_seed(29)
    q = 2 * torch.randn(1, 128, 4, 32)
    k, v = 2 * torch.randn(1, 200, 1, 32), torch.randn(1, 200, 1, 32)
    s, dout = torch.randn(4), torch.randn(1, 128, 4, 32)

    def loss(s):
        return (flash_attn_ext.flash_attn_func(q, k, v, sinks=s) * dout).sum()

    s_fused = s.clone().requires_grad_()
    loss(s_fused).backward()
    torch.testing.assert_close(torch.func.grad(loss)(s), s_fused.grad, rtol=2.4e-7, atol=0)


def test_sinks_jvp_plus_inf_sink_is_zero():
    """Forward-mode AD under a +inf sink (it takes every row: out 0): tangent 0, as reverse mode's
    gradient, not NaN (softmax over [S, +inf] is inf - inf), dense (torch.func.jvp) and varlen
    (forward_ad); the other head's tangent equals the dense one with a finite sink there."""
    import torch.autograd.forward_ad as fwAD
    torch.manual_seed(0)
    q = torch.randn(1, 3, 2, 8, dtype=torch.float64)
    k, v = torch.randn(1, 5, 2, 8, dtype=torch.float64), torch.randn(1, 5, 2, 8, dtype=torch.float64)
    s = torch.tensor([float("inf"), 0.5])
    q_t = torch.randn_like(q)
    _, t = torch.func.jvp(lambda q: flash_attn_ext.flash_attn_func(q, k, v, sinks=s), (q,), (q_t,))
    assert torch.equal(t[..., 0, :], torch.zeros_like(t[..., 0, :])) and torch.isfinite(t).all()
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    with fwAD.dual_level():
        o = flash_attn_ext.flash_attn_varlen_func(fwAD.make_dual(q[0], q_t[0]), k[0], v[0], cu_q, cu_k, 3, 5, sinks=s)
        tv = fwAD.unpack_dual(o).tangent
    torch.testing.assert_close(tv, t[0], atol=1e-12, rtol=0)


def test_sinks_plus_inf_sink_gradient_is_zero():
    """A +inf sink takes every row (out 0, D = 0): its gradient is 0 (the limit), not inf * 0 = NaN,
    on the fused op and on the torch formula (vmap)."""
    q = torch.randn(1, 3, 2, 8)
    s = torch.tensor([float("inf"), 0.5], requires_grad=True)
    flash_attn_ext.flash_attn_func(q, q, q, sinks=s).sum().backward()
    assert s.grad[0] == 0 and torch.isfinite(s.grad).all()
    grads = torch.vmap(torch.func.grad(lambda qq, ss: flash_attn_ext.flash_attn_func(qq, qq, qq, sinks=ss).sum(),
                                       argnums=1), in_dims=(0, None))(q.unsqueeze(0).expand(2, -1, -1, -1, -1),
                                                                     s.detach())
    assert torch.isfinite(grads).all() and (grads[:, 0] == 0).all()


def test_cpu_backward_refuses_statistics_of_another_forward():
    """The float32 / float64 CPU backward recomputes the statistics: given a forward's softmax_stats
    with sinks but called without them (or with other q), it raises instead of returning the
    gradients of another attention; with the sinks, or softmax_stats=None, it runs."""
    ops = torch.ops.flash_attn_ext
    q = torch.randn(1, 3, 2, 8)
    s = torch.tensor([1.5, -0.5])
    o, lse, st = ops.forward(q, q, q, 0.3, False, -1, -1, s)
    do = torch.randn_like(o)
    with pytest.raises(RuntimeError, match="softmax_stats do not match"):
        ops.backward(do, q, q, q, o, lse, 0.3, False, st, -1, -1, None)
    with pytest.raises(RuntimeError, match="softmax_stats do not match"):
        ops.backward(do, q + 1, q, q, o, lse, 0.3, False, st, -1, -1, s)
    ops.backward(do, q, q, q, o, lse, 0.3, False, st, -1, -1, s)
    ops.backward(do, q, q, q, o, lse, 0.3, False, None, -1, -1, None)
    # A sink a little below a large row max changes only the log2 sum (by ~0.05): still caught.
    qb = torch.full((1, 2, 1, 64), 100.0) + torch.randn(1, 2, 1, 64)
    o2, lse2, st2 = ops.forward(qb, qb, qb, 0.125, False)
    sb = (lse2[0, :, 0] - 3.3).float()
    o3, lse3, st3 = ops.forward(qb, qb, qb, 0.125, False, -1, -1, sb)
    with pytest.raises(RuntimeError, match="softmax_stats do not match"):
        ops.backward(torch.randn_like(o3), qb, qb, qb, o3, lse3, 0.125, False, st3, -1, -1, None)
    # Valid calls whose statistics leave float32 (scores past its range; a sink of 3e38) still run.
    for qq, ss in ((torch.full((1, 1, 1, 8), 2e19, dtype=torch.float64), None),
                   (torch.randn(1, 3, 2, 8), torch.tensor([3e38, 0.5]))):
        o4, lse4, st4 = ops.forward(qq, qq, qq, 1.0, False, -1, -1, ss)
        ops.backward(torch.randn_like(o4), qq, qq, qq, o4, lse4, 1.0, False, st4, -1, -1, ss)


@pytest.mark.parametrize("change", ["causal", "softmax_scale", "window_size"])
def test_cpu_backward_statistics_message_names_the_mask_and_scale(change):
    """Statistics of a causal forward given to a non-causal backward (or another softmax_scale or
    window): the refusal lists those arguments among the ones to match, and does not offer
    softmax_stats=None as the way out (that skips the check; the gradients would still be another
    attention's)."""
    ops = torch.ops.flash_attn_ext
    q = torch.randn(1, 4, 2, 16)
    o, lse, st = ops.forward(q, q, q, 0.25, True)
    args = {"causal": (0.25, False, -1, -1), "softmax_scale": (0.5, True, -1, -1),
            "window_size": (0.25, True, 1, 0)}[change]
    with pytest.raises(RuntimeError, match=r"softmax_scale, causal, window_size.*does not make other arguments right"):
        ops.backward(torch.randn_like(o), q, q, q, o, lse, args[0], args[1], st, args[2], args[3])


def test_backward_dsinks_needs_sinks_on_cpu_and_meta():
    ops = torch.ops.flash_attn_ext
    q = torch.randn(1, 3, 2, 8)
    o, lse, st = ops.forward(q, q, q, 0.3, False)
    for dev in ("cpu", "meta"):
        args = [t.to(dev) for t in (torch.randn_like(o), q, q, q, o, lse)]
        with pytest.raises(RuntimeError, match="backward_dsinks needs sinks"):
            ops.backward_dsinks(*args, 0.3, False, st.to(dev), -1, -1, None)
