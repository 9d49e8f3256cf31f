"""CUDA backward kernels (csrc/kernels/dispatch.cu, csrc/kernels/{sm80,sm90}/flash_bwd_*.cuh):
FlashAttention-2 Alg. 2 (Dao 2023) split into preprocess, dK/dV and dQ kernels.

Every test runs once per backward arch path the GPU can take: "auto" (what the dispatch picks: the
sm90 wgmma kernels on an sm_90 GPU for the head dims they cover, sm80 otherwise) and, on sm_90
with a build that has sm_90a code, "sm80" (flash_attn_ext.force_sm80_path forces the mma.sync path).

dq, dk, dv are checked against the autograd of flash_attn_ext.reference.attention_ref with the
accuracy rule of tests/accuracy.py (max|ours - ref| <= 2 * max|same-dtype torch - ref|, ref in
float64), through the op directly (torch.ops.flash_attn_ext.backward with the forward's out and
softmax_lse) and through autograd of torch.ops.flash_attn_ext.forward. Outputs are poisoned (NaN
fill of torch.empty) so an unwritten element fails.
"""

import math
import os

import pytest
import torch

import flash_attn_ext  # noqa: F401  (registers torch.ops.flash_attn_ext)
from accuracy import check_accuracy
from conftest import require_hdim
from flash_attn_ext.reference import attention_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the CUDA backward kernels need an NVIDIA GPU (sm_80 or newer)")

DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def bwd_path(arch_path):
    """Runs the test on every arch path the GPU can take (conftest.py: arch_path)."""
    return arch_path


def _rand(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, device="cuda")


def _qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, layout="bshd"):
    """q, k, v in the requested memory layout (always BSHD-shaped views, last dim contiguous):
    bshd: contiguous; bhsd: transposed views of (b, h, s, d) tensors; qkv_slice: q/k/v are slices
    of one fused (b, s, h + 2 h_k, d + 8) tensor (row/head strides not of the plain shape)."""
    if layout == "bshd":
        return (_rand(batch, seqlen_q, nheads, headdim, dtype=dtype),
                _rand(batch, seqlen_k, nheads_k, headdim, dtype=dtype),
                _rand(batch, seqlen_k, nheads_k, headdim, dtype=dtype))
    if layout == "bhsd":
        return (_rand(batch, nheads, seqlen_q, headdim, dtype=dtype).transpose(1, 2),
                _rand(batch, nheads_k, seqlen_k, headdim, dtype=dtype).transpose(1, 2),
                _rand(batch, nheads_k, seqlen_k, headdim, dtype=dtype).transpose(1, 2))
    assert layout == "qkv_slice" and seqlen_q == seqlen_k
    fused = _rand(batch, seqlen_q, nheads + 2 * nheads_k, headdim + 8, dtype=dtype)
    q = fused[:, :, :nheads, :headdim]
    k = fused[:, :, nheads:nheads + nheads_k, :headdim]
    v = fused[:, :, nheads + nheads_k:, :headdim]
    return q, k, v


def _reference_grads(q, k, v, dout, causal, softmax_scale):
    """(ref grads in float64, baseline grads in q's dtype) of attention_ref for upstream dout."""
    grads = []
    for upcast in (True, False):
        qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out, _ = attention_ref(qr, kr, vr, softmax_scale, causal, upcast=upcast)
        out.backward(dout.to(out.dtype))
        grads.append((qr.grad, kr.grad, vr.grad))
    return grads


def _flash_bwd(q, k, v, dout, causal, softmax_scale):
    """Forward op for out / softmax_lse, then the backward op directly."""
    out, lse, stats = torch.ops.flash_attn_ext.forward(q, k, v, softmax_scale, causal)
    return torch.ops.flash_attn_ext.backward(dout, q, k, v, out, lse, softmax_scale, causal, stats)


def _check_grads(q, k, v, dout, causal, grads):
    scale = 1.0 / math.sqrt(q.shape[-1])
    ref, base = _reference_grads(q, k, v, dout, causal, scale)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref, base):
        assert g.shape == r.shape and g.dtype == q.dtype, f"{name}: {g.shape} {g.dtype}"
        check_accuracy(name, g, r, b)


SEQLENS = [(1, 1), (17, 128), (128, 255), (255, 17), (1000, 1000), (2048, 1000)]


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [32, 64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_accuracy(dtype, headdim, causal, seqlens, poison_empty):
    """dq, dk, dv over the forward's grid (hdim 80 runs padded to 96 inside the kernel)."""
    require_hdim(headdim)
    seqlen_q, seqlen_k = seqlens
    batch, nheads = (2, 2) if seqlen_q * seqlen_k <= 10**6 else (1, 2)
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, nheads, nheads, headdim, dtype)
    dout = _rand(*q.shape, dtype=dtype)
    grads = _flash_bwd(q, k, v, dout, causal, 1.0 / math.sqrt(headdim))
    _check_grads(q, k, v, dout, causal, grads)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "qkv_slice"])
@pytest.mark.parametrize("seqlens", [(255, 255), (1000, 1000), (300, 1000), (1000, 300)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_gqa_layouts(dtype, headdim, causal, seqlens, layout, poison_empty):
    """GQA 4:1 (dK/dV sum over the 4 query heads of a group) with non-contiguous q/k/v views."""
    require_hdim(headdim)
    seqlen_q, seqlen_k = seqlens
    if layout == "qkv_slice" and seqlen_q != seqlen_k:
        pytest.skip("a fused qkv tensor has one sequence length")
    q, k, v = _qkv(2, seqlen_q, seqlen_k, 8, 2, headdim, dtype, layout)
    dout = _rand(2, 8, seqlen_q, headdim, dtype=dtype).transpose(1, 2)  # non-contiguous dout too
    grads = _flash_bwd(q, k, v, dout, causal, 1.0 / math.sqrt(headdim))
    _check_grads(q, k, v, dout, causal, grads)


@pytest.mark.parametrize("nheads_k", [8, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_autograd(dtype, nheads_k, poison_empty):
    """Autograd through torch.ops.flash_attn_ext.forward (ops.py wiring) gives the op's grads."""
    require_hdim(128)
    q, k, v = (t.requires_grad_(True) for t in _qkv(2, 700, 900, 8, nheads_k, 128, dtype))
    scale = 1.0 / math.sqrt(128)
    out = torch.ops.flash_attn_ext.forward(q, k, v, scale, True)[0]
    dout = _rand(*out.shape, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    direct = _flash_bwd(q.detach(), k.detach(), v.detach(), dout, True, scale)
    for g, d in zip(grads, direct):
        assert torch.equal(g, d)
    _check_grads(q.detach(), k.detach(), v.detach(), dout, True, grads)


@pytest.mark.parametrize("headdim", [128, 256])  # the rows and the roles kernels on sm_90
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_deterministic(dtype, headdim):
    """No atomics: two runs are bitwise equal (GQA 4:1, causal, ragged lengths)."""
    require_hdim(headdim)
    q, k, v = _qkv(2, 1000, 1100, 8, 2, headdim, dtype)
    dout = _rand(*q.shape, dtype=dtype)
    scale = 1.0 / math.sqrt(headdim)
    out, lse, stats = torch.ops.flash_attn_ext.forward(q, k, v, scale, True)
    first = torch.ops.flash_attn_ext.backward(dout, q, k, v, out, lse, scale, True, stats)
    for _ in range(2):
        again = torch.ops.flash_attn_ext.backward(dout, q, k, v, out, lse, scale, True, stats)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between runs"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_load_paths_agree(dtype, headdim, causal, poison_empty):
    """The sm90 backward kernels stream their tiles by TMA for inputs TMA can describe and by
    cp.async for the rest (kernels/sm90/smem_layout.cuh: BwdStages); both give the same bits. A
    dout broadcast over heads (head stride 0) sends the dK/dV kernel to cp.async, K/V broadcast
    over the batch (batch stride 0) the dQ kernel; their contiguous copies take TMA. GQA 2:1,
    ragged lengths."""
    require_hdim(headdim)
    q = _rand(2, 333, 4, headdim, dtype=dtype)
    k1, v1 = _rand(1, 257, 2, headdim, dtype=dtype), _rand(1, 257, 2, headdim, dtype=dtype)
    dout1 = _rand(2, 333, 1, headdim, dtype=dtype)
    scale = 1.0 / math.sqrt(headdim)
    k, v, dout = k1.expand(2, -1, -1, -1), v1.expand(2, -1, -1, -1), dout1.expand(-1, -1, 4, -1)
    assert k.stride(0) == 0 and dout.stride(2) == 0
    # One forward for both (a zero-stride K/V would send the forward to another kernel as well).
    kd, vd, doutd = k.contiguous(), v.contiguous(), dout.contiguous()
    out, lse, stats = torch.ops.flash_attn_ext.forward(q, kd, vd, scale, causal)
    bwd = torch.ops.flash_attn_ext.backward
    strided = bwd(dout, q, k, v, out, lse, scale, causal, stats)
    dense = bwd(doutd, q, kd, vd, out, lse, scale, causal, stats)
    for name, a, b in zip(("dq", "dk", "dv"), strided, dense):
        assert torch.equal(a, b), f"{name}: the cp.async and TMA loads disagree"
    _check_grads(q, kd, vd, doutd, causal, dense)


@pytest.mark.parametrize("headdim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_rows_without_keys(dtype, headdim, poison_empty):
    """Causal with seqlen_q > seqlen_k: query rows i < seqlen_q - seqlen_k see no key. Their dq is
    exactly 0, nothing is NaN, and the rest still meets the accuracy rule."""
    require_hdim(headdim)
    seqlen_q, seqlen_k = 300, 100
    q, k, v = _qkv(2, seqlen_q, seqlen_k, 4, 2, headdim, dtype)
    dout = _rand(*q.shape, dtype=dtype)
    dq, dk, dv = _flash_bwd(q, k, v, dout, True, 1.0 / math.sqrt(headdim))
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(g).any(), f"{name} has NaN"
    blind = seqlen_q - seqlen_k
    assert torch.equal(dq[:, :blind], torch.zeros_like(dq[:, :blind]))
    assert dq[:, blind:].abs().amax() > 0
    _check_grads(q, k, v, dout, True, (dq, dk, dv))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_large_dout(dtype, headdim, causal, poison_empty):
    """dout scaled by 2^12, as fp16 loss scaling does (|dout| <= 4 * 2^12, representable): dP - D
    (|dP| up to ~1e5) leaves fp16's range while every gradient stays representable (near-uniform
    P <= 1/257: seqlen_k - seqlen_q = 256 keys are visible to every row, and the causal mask zeroes
    the rest). The backward is linear in dout, so grads / 2^12 must meet the accuracy rule of the
    unscaled problem. A kernel that rounds dP - D to fp16 before multiplying by P gets inf there,
    and 0 * inf = NaN on masked pairs."""
    require_hdim(headdim)
    q, k, v = _qkv(2, 128, 384, 2, 2, headdim, dtype)
    q, k = q * 0.1, k * 0.1
    dout = _rand(*q.shape, dtype=dtype).clamp(-4, 4)
    loss_scale = 2.0 ** 12
    grads = _flash_bwd(q, k, v, dout * loss_scale, causal, 1.0 / math.sqrt(headdim))
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(g).all(), f"{name}: inf or NaN with dout * 2^12"
    _check_grads(q, k, v, dout, causal, tuple(g / loss_scale for g in grads))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_zero_stride_dout(dtype, causal, poison_empty):
    """out.sum().backward(): autograd hands the backward an all-zero-stride dout (expanded ones)."""
    require_hdim(64)
    q, k, v = (t.requires_grad_(True) for t in _qkv(2, 333, 257, 4, 4, 64, dtype))
    scale = 1.0 / math.sqrt(64)
    out = torch.ops.flash_attn_ext.forward(q, k, v, scale, causal)[0]
    out.sum().backward()
    dout = torch.ones(1, dtype=dtype, device="cuda").expand(q.shape)
    assert dout.stride() == (0, 0, 0, 0)
    direct = _flash_bwd(q.detach(), k.detach(), v.detach(), dout, causal, scale)
    for g, d in zip((q.grad, k.grad, v.grad), direct):
        assert torch.equal(g, d)
    _check_grads(q.detach(), k.detach(), v.detach(), dout, causal, direct)
    # stride(-1) == 1 with every other stride 0 reaches the kernels without a copy.
    dout = _rand(1, 1, 1, 64, dtype=dtype).expand(q.shape)
    assert dout.stride() == (0, 0, 0, 1)
    grads = _flash_bwd(q.detach(), k.detach(), v.detach(), dout, causal, scale)
    _check_grads(q.detach(), k.detach(), v.detach(), dout, causal, grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_noncontiguous_dout(dtype, poison_empty):
    """dout a strided slice (row stride != nheads * headdim) and a broadcast over heads."""
    require_hdim(128)
    q, k, v = _qkv(2, 200, 300, 4, 4, 128, dtype)
    wide = _rand(2, 200, 4, 136, dtype=dtype)
    for dout in (wide[..., :128], _rand(2, 200, 1, 128, dtype=dtype).expand(2, 200, 4, 128)):
        assert not dout.is_contiguous()
        grads = _flash_bwd(q, k, v, dout, False, 1.0 / math.sqrt(128))
        _check_grads(q, k, v, dout, False, grads)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_many_heads(causal, poison_empty):
    """batch * nheads = 70,000 > 65,535: the 1-D grids cover every (batch, head)."""
    require_hdim(64)
    dtype = torch.bfloat16
    q, k, v = _qkv(4375, 9, 7, 16, 16, 64, dtype)
    dout = _rand(*q.shape, dtype=dtype)
    grads = _flash_bwd(q, k, v, dout, causal, 0.125)
    ref, base = _reference_grads(q, k, v, dout, causal, 0.125)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref, base):
        check_accuracy(name, g, r, b)
    # The last (batch, head) pairs are written too (a 16-bit grid dimension would miss them).
    assert grads[2][-1].abs().amax() > 0 and grads[0][-1, -1].abs().amax() > 0


# ---- The long-query dK/dV row (sm90/tile_config.h: DkvLongTile, chosen by dkv_long_rows): dense
# calls with >= 8192 queries and >= 8192 keys at d64 run the sm90 dK/dV kernel on 128-key tiles
# (two warpgroups per CTA sharing each Q / dO tile) instead of DkvTile<64>'s 64-key tiles. Every K
# row's sum over the Q tiles keeps its order, so both rows give the same bits. A varlen call is not
# dense and keeps DkvTile<64>: one packed sequence is the long row's bitwise twin (the varlen
# kernels equal the dense ones bit for bit: tests/test_varlen_cuda.py).


def _sm90_dkv_rows(fn):
    """The tile rows of the sm90 dK/dV kernels fn() launches (torch.profiler kernel names, which
    carry the row's type): "long" (DkvLongTile) or "short" (DkvTile); empty on the sm80 path."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "flash_bwd_dkv" in e.name and "sm90" in e.name]
    return {"long" if "DkvLongTile" in n else "short" for n in names}


def _sm90_backward_runs(path):
    """Whether the dispatch runs the sm90 backward kernels on this GPU and arch path."""
    return (path == "auto" and torch.cuda.get_device_capability() == (9, 0)
            and "90a" in str(flash_attn_ext.build_info().get("cuda_archs", "")))


# (batch, nheads, nheads_k, seqlen_q, seqlen_k): the long row where both lengths are >= 8192 and its
# grid has >= 2 CTAs per SM (ceil(seqlen_k / 128) * batch * nheads_k); 8192 x 8200 (causal offset 8)
# and 8400 x 8192 (offset -208) make the CTA's upper 64 key rows visit one fully masked Q tile more
# than its lower ones; 8000 x 9000 is too short; batch 1 MQA at 8192 keys has 64 long CTAs.
LONG_ROW_CASES = [(2, 8, 4, 8192, 8192), (2, 8, 4, 8192, 8200), (2, 8, 4, 8400, 8192), (2, 8, 4, 8000, 9000),
                  (1, 2, 1, 8192, 8192)]


@pytest.mark.parametrize("case", LONG_ROW_CASES, ids=lambda c: "b{}h{}hk{}_{}x{}".format(*c))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_long_query_rows(dtype, causal, case, bwd_path, poison_empty):
    """d64, GQA 2:1: the dispatch takes the long-query dK/dV row exactly where dkv_long_rows says,
    and its gradients are the short row's bits (the same backward through the varlen op, on the
    dense forward's out and statistics) and within the rule."""
    require_hdim(64, exact=True)
    if bwd_path == "sm80":
        pytest.skip("the long-query row is a row of the sm90 dK/dV kernel")
    batch, nheads, nheads_k, seqlen_q, seqlen_k = case
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, 64, dtype)
    dout = _rand(*q.shape, dtype=dtype)
    scale = 0.125
    ops = torch.ops.flash_attn_ext
    out, lse, stats = ops.forward(q, k, v, scale, causal)
    dense = []
    rows = _sm90_dkv_rows(lambda: dense.extend(ops.backward(dout, q, k, v, out, lse, scale, causal, stats)))
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    long_ctas = -(-seqlen_k // 128) * batch * nheads_k
    long_rows = (min(seqlen_q, seqlen_k) >= 8192 and long_ctas >= 2 * num_sms
                 and os.environ.get("FLASH_ATTN_EXT_SM90_BWD_LONG_ROWS") != "0")
    expected = ({"long" if long_rows else "short"} if _sm90_backward_runs(bwd_path) else set())
    assert rows == expected, (rows, expected)

    # The same backward as one packed call (varlen: never the long row), on the dense forward's
    # out, softmax_lse and softmax_stats, so that only the dK/dV tile row differs.
    def packed(t):  # (batch, seqlen, heads, d) -> (batch * seqlen, heads, d)
        return t.reshape(-1, *t.shape[2:])
    cu_q = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * seqlen_q
    cu_k = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * seqlen_k
    lse_p = lse.transpose(0, 1).reshape(nheads, -1)
    stats_p = stats.transpose(1, 2).reshape(2, nheads, -1)
    varlen = []
    varlen_rows = _sm90_dkv_rows(lambda: varlen.extend(ops.varlen_backward(
        packed(dout), packed(q), packed(k), packed(v), packed(out), lse_p, cu_q, cu_k, seqlen_q, seqlen_k, scale,
        causal, stats_p)))
    assert varlen_rows == ({"short"} if _sm90_backward_runs(bwd_path) else set()), varlen_rows
    for name, a, b in zip(("dq", "dk", "dv"), dense, varlen):
        assert torch.equal(packed(a), b), f"{name}: the long-query row and the varlen (short) row disagree"
    _check_grads(q, k, v, dout, causal, dense)
