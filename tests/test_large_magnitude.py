"""Large-magnitude inputs (issue: NaN on CUDA for q = k = v = 133120 in bfloat16).

Every finite input whose scaled scores fit in float32 must give finite, accurate outputs and
gradients, on the CPU and on every CUDA arch path (conftest.py: arch_path), fp16 and bf16, causal or
not. The kernels keep the row max of the raw scores and compute P = exp2((S - m) * c), and the LSE
leaves the forward as two floats (softmax_stats: m in log2 units and log2 l), so the backward
recomputes P exactly at any magnitude (csrc/primitives/softmax.cuh).

The sweep runs constant inputs (q = k = a: every score ties, so out is the mean of the visible
values and P = 1/n exactly) and random inputs scaled by a (scores up to ~1e38 for bf16), checked with
the project's accuracy rule (tests/accuracy.py) against the float64 reference. For dq and dk the
floor atol is the error FlashAttention's backward makes by design at that magnitude (Dao 2023,
Alg. 2 line 4: D_i = rowsum(dO_i o O_i) from the output O as returned, rounded to the dtype):
|dD_i| <= eps/2 sum_c |dO_ic O_ic| enters dS_ij = P_ij (dP_ij - D_i) and reaches dq_i through
softmax_scale * sum_j P_ij k_j and dk_j through softmax_scale * sum_i P_ij q_i, so it grows with a.
torch's same-dtype math has no such term (it differentiates the softmax directly), and with tied
scores its dq can be exactly 0.
"""

import math

import pytest
import torch

import flash_attn_ext
from accuracy import check_accuracy
from conftest import require_hdim
from flash_attn_ext.reference import attention_ref

# Magnitudes per dtype: the raw scores a^2 * headdim (and their scaled values) stay below float32's max for headdim <= 256.
MAGNITUDES = {
    torch.bfloat16: [3.0, 100.0, 133120.0, 1e9, 1e18],
    torch.float16: [3.0, 100.0, 1e4, 6e4],
}
DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(params=["cpu", "cuda"])
def device(request, arch_path):
    if request.param == "cpu":
        if arch_path != "auto":
            pytest.skip("the CPU has one path")
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: the CUDA kernels are tested on a GPU machine")
    return "cuda"


def _inputs(kind, magnitude, dtype, device, headdim, seqlen_q=100, seqlen_k=130, nheads=2):
    g = torch.Generator().manual_seed(int(math.log2(magnitude) * 7) + headdim)
    shape_q, shape_k = (1, seqlen_q, nheads, headdim), (1, seqlen_k, nheads, headdim)
    if kind == "constant":
        q = torch.full(shape_q, magnitude)
        k = torch.full(shape_k, magnitude)
    else:  # clamped to the dtype's range: every input finite
        big = torch.finfo(dtype).max
        q = (torch.randn(shape_q, generator=g) * magnitude).clamp(-big, big)
        k = (torch.randn(shape_k, generator=g) * magnitude).clamp(-big, big)
    v = torch.randn(shape_k, generator=g)
    dout = torch.randn(shape_q, generator=g)
    q, k, v, dout = (t.to(dtype).to(device) for t in (q, k, v, dout))
    assert torch.isfinite(q).all() and torch.isfinite(k).all()
    return [t.requires_grad_() for t in (q, k, v)], dout


def _d_error_floors(q, k, out, dout, ref_grads, scale, causal):
    """Atol floors of dq, dk, dv (see the module docstring), from the float64 probabilities of
    the same inputs. D_i errs by |dD_i| <= (eps/2 + d eps32) sum_c |dO_ic O_ic|: O rounded to the
    dtype, and D and dP = dO V^T summed in different fp32 orders; it reaches dq_i as
    scale * sum_j P_ij |dD_i| |k_j| and dk_j as scale * sum_i P_ij |dD_i| |q_i| (twice that, for the
    rest). Each gradient also gets one rounding to the dtype of its largest reference value: the
    reference is rounded to the inputs' dtype too, so where the baseline lands on the correctly
    rounded value (its error 0: tied scores, or fp16 scores past 65504, where the baseline is the
    float32 math rounded once) a result that rounds to the neighbouring value is still one rounding
    away (fp16 constant 100, 40 x 385 keys: dk 3.9e-3 off at |dk| ~7, one ulp there). dv has only
    that term."""
    eps, eps32 = torch.finfo(q.dtype).eps, torch.finfo(torch.float32).eps
    qd, kd = q.detach().double(), k.detach().double()
    d_err = (eps / 2 + q.shape[-1] * eps32) * (dout.double().abs() * out.detach().double().abs()).sum(-1)
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows without keys: P = 0
    p_err = p * d_err.permute(0, 2, 1).unsqueeze(-1)  # P_ij |dD_i|
    dq_floor = abs(scale) * torch.einsum("bhqk,bkhd->bqhd", p_err, kd.abs()).max().item()
    dk_floor = abs(scale) * torch.einsum("bhqk,bqhd->bkhd", p_err, qd.abs()).max().item()
    dq_round, dk_round, dv_round = (eps * g.double().abs().max().item() for g in ref_grads)
    return 2 * dq_floor + dq_round, 2 * dk_floor + dk_round, dv_round


def _baseline(q, k, v, dout, scale, causal):
    """The accuracy rule's baseline: torch's math in the inputs' dtype, or, where that overflows
    (fp16 scores past 65504 turn into inf / NaN), the same math in float32 rounded to the dtype:
    the error a careful same-precision implementation would make."""
    out, lse = attention_ref(q, k, v, scale, causal, upcast=False)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    if all(torch.isfinite(t).all() for t in (out, *grads)):
        return out, lse, grads
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out, lse = attention_ref(q32, k32, v32, scale, causal, upcast=False)
    grads = torch.autograd.grad(out, (q32, k32, v32), dout.float())
    return out.to(q.dtype), lse, [g.to(q.dtype) for g in grads]


def _check_magnitudes(device, dtype, headdim, causal, kind, seqlen_q=100, seqlen_k=130):
    """Every magnitude of MAGNITUDES[dtype]: out, LSE and the three gradients by the accuracy rule
    (the floors of _d_error_floors), no non-finite gradient."""
    if device != "cpu":
        require_hdim(headdim)
    scale = headdim ** -0.5
    for magnitude in MAGNITUDES[dtype]:
        (q, k, v), dout = _inputs(kind, magnitude, dtype, device, headdim, seqlen_q, seqlen_k)
        out, lse = flash_attn_ext.flash_attn_func(q, k, v, causal=causal, return_lse=True)
        ref_out, ref_lse = attention_ref(q, k, v, scale, causal, upcast=True)
        base_out, base_lse, base_grads = _baseline(q, k, v, dout, scale, causal)
        where = f"{kind} magnitude {magnitude:g}"
        check_accuracy(f"out ({where})", out, ref_out, base_out)
        # LSE ~ scale * a^2 * d: compare relative to its size (float32 keeps ~7 digits of it).
        lse_floor = 4 * torch.finfo(torch.float32).eps * ref_lse[torch.isfinite(ref_lse)].abs().max().item()
        check_accuracy(f"softmax_lse ({where})", lse, ref_lse, base_lse, atol=lse_floor + 1e-5)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout.double())
        floors = _d_error_floors(q, k, out, dout, ref_grads, scale, causal)
        for name, g, rg, bg, floor in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads, floors):
            assert torch.isfinite(g).all(), f"{name} ({where}): non-finite gradient"
            check_accuracy(f"{name} ({where})", g, rg, bg, atol=floor + 1e-5)


@pytest.mark.parametrize("kind", ["constant", "random"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
# 80: padded to 96; on an H200 the backward of 96 / 256 runs the sm80 kernels, every forward the sm90 one
@pytest.mark.parametrize("headdim", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_large_magnitude_sweep(device, dtype, headdim, causal, kind):
    if device == "cpu" and headdim != 64:
        pytest.skip("the CPU path has no head-dim specializations: one head dim covers it")
    _check_magnitudes(device, dtype, headdim, causal, kind)


@pytest.mark.parametrize("kind", ["constant", "random"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_large_magnitude_few_rows_many_keys(device, dtype, headdim, causal, kind):
    """40 query rows over 385 keys (a partial query tile, a partial last key block, P ~ 1/385):
    the case where fp16 constant inputs left dk one ulp from the correctly rounded value while the
    baseline (float32 math, the fp16 scores overflow) had none, which the floors now allow."""
    if device == "cpu" and headdim != 64:
        pytest.skip("the CPU path has no head-dim specializations: one head dim covers it")
    _check_magnitudes(device, dtype, headdim, causal, kind, seqlen_q=40, seqlen_k=385)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_constant_large_input_is_exact(device, dtype):
    """The reported case: q = k = v = a, one row: out = a exactly (every key ties), LSE = scale a^2 d,
    dv = dout exactly (one key: P = 1), and dq = dk = 0 up to the floor of D = rowsum(dO o O)
    against dP = dO V^T in fp32 (dS = P (dP - D) = 0 in exact arithmetic)."""
    a = 133120.0 if dtype == torch.bfloat16 else 60000.0
    q, k, v = (torch.full((1, 1, 1, 64), a, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    out, lse = flash_attn_ext.flash_attn_func(q, k, v, return_lse=True)
    assert torch.equal(out, v.detach()), f"out {out.flatten()[:4]} != {a}"
    assert lse.item() == pytest.approx(a * a * 64 * 0.125, rel=1e-6)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.equal(dv, dout)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all()
    exact = (torch.zeros_like(q), torch.zeros_like(k), dv)  # dq = dk = 0 in exact arithmetic
    dq_floor, dk_floor, _ = _d_error_floors(q, k, out, dout, exact, 0.125, False)
    assert dq.abs().max().item() <= dq_floor and dk.abs().max().item() <= dk_floor


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("softmax_scale", [-0.3, 0.0], ids=["negative", "zero"])
def test_nonpositive_softmax_scale(device, softmax_scale, causal):
    """Any finite softmax_scale: a negative one favours the smallest scores, zero weighs every
    visible key the same (the CUDA kernels run them as |scale| on -q and scale 1 on q = 0)."""
    dtype = torch.bfloat16
    (q, k, v), dout = _inputs("random", 1.0, dtype, device, 64, seqlen_q=70, seqlen_k=90)
    out = flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)
    ref_out, _ = attention_ref(q, k, v, softmax_scale, causal, upcast=True)
    base_out, _ = attention_ref(q, k, v, softmax_scale, causal, upcast=False)
    check_accuracy("out", out, ref_out, base_out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout.double())
    base_grads = torch.autograd.grad(base_out, (q, k, v), dout)
    for name, g, rg, bg in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
        check_accuracy(name, g, rg, bg)


def test_backward_without_stats_matches_with_stats(device):
    """The backward op also takes a caller's own softmax_lse without softmax_stats (e.g. an LSE
    merged across ring-attention steps): at ordinary magnitudes both give the same gradients."""
    (q, k, v), dout = _inputs("random", 1.0, torch.bfloat16, device, 64)
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse, stats = torch.ops.flash_attn_ext.forward(q, k, v, 0.125, True)
    with_stats = torch.ops.flash_attn_ext.backward(dout, q, k, v, out, lse, 0.125, True, stats)
    without = torch.ops.flash_attn_ext.backward(dout, q, k, v, out, lse, 0.125, True)
    for a, b in zip(with_stats, without):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_near_ties_are_not_merged(dtype):
    """Scores 100 apart at 1e8 (one product each, so exact in any order): P is one-hot and the
    gradients are the reference's. The CPU backward recomputes the forward's scores bit for bit, so
    it uses no tie tolerance (a relative one merged such scores and made dv [1, 1])."""
    q = torch.zeros(1, 1, 1, 8, dtype=dtype)
    q[..., 0] = 1
    k = torch.zeros(1, 2, 1, 8, dtype=dtype)
    k[0, :, 0, 0] = torch.tensor([1e8, 1e8 - 100])
    v = torch.randn(1, 2, 1, 8, dtype=dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=1.0)
    (dv,) = torch.autograd.grad(out.sum(), v)
    torch.testing.assert_close(dv[0, :, 0, 0], torch.tensor([1.0, 0.0], dtype=dtype))


def test_cpu_near_ties_under_a_shared_offset_float64():
    """A score offset shared by every key (softmax-invariant) at 1e3 and 1e4: float64 gradients
    equal the reference's to float64 precision (they were off by up to 4 with a tie tolerance)."""
    g = torch.Generator().manual_seed(3)
    for offset in (1e3, 1e4):
        q = torch.randn(1, 128, 2, 64, generator=g, dtype=torch.float64)
        k = torch.randn(1, 128, 2, 64, generator=g, dtype=torch.float64)
        v = torch.randn(1, 128, 2, 64, generator=g, dtype=torch.float64)
        q[..., 0] = 1.0
        k[..., 0] = offset * 8.0  # scale 1/8: every scaled score shifted by `offset`
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = flash_attn_ext.flash_attn_func(q, k, v, causal=True)
        ref, _ = attention_ref(q, k, v, 0.125, True, upcast=True)
        dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9 * offset)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backward_with_a_merged_lse(dtype):
    """Ring-attention style: K/V in two chunks, each chunk's backward run with the LSE merged over
    both (no softmax_stats): the chunks' dq add up to the full dq, dk/dv are the full ones' slices.
    float64 uses the caller's LSE too (it recomputes its own statistics only from softmax_stats);
    that LSE is float32, so float64 gradients are float32-accurate then."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=g, dtype=dtype) for _ in range(3))
    dout = torch.randn(1, 40, 2, 16, generator=g, dtype=dtype)
    fwd, bwd = torch.ops.flash_attn_ext.forward, torch.ops.flash_attn_ext.backward
    out, lse, stats = fwd(q, k, v, 0.25, False)
    full = bwd(dout, q, k, v, out, lse, 0.25, False, stats)
    parts = [slice(0, 17), slice(17, 40)]
    lses = [fwd(q, k[:, s], v[:, s], 0.25, False)[1] for s in parts]
    merged = torch.logaddexp(lses[0], lses[1])
    chunks = [bwd(dout, q, k[:, s], v[:, s], out, merged, 0.25, False) for s in parts]
    tol = dict(rtol=2e-5, atol=2e-5)  # the op's LSE is float32: so are merged probabilities
    torch.testing.assert_close(chunks[0][0] + chunks[1][0], full[0], **tol)
    for s, (_, dk, dv) in zip(parts, chunks):
        torch.testing.assert_close(dk, full[1][:, s], **tol)
        torch.testing.assert_close(dv, full[2][:, s], **tol)
