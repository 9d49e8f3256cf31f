"""Attention dropout (FlashAttention, Dao et al. 2022, section 3.1 and Algorithms 2 / 4; flash-attn's
``dropout_p``): out = (Z o P) V / (1 - p), Z the keep mask, softmax_lse that of P.

The mask is a function of the call's rng_state alone (csrc/primitives/philox.cuh: Philox4x32-10, one
call per two 2 x 2 units of (query, key) positions, 16-bit randoms), so the reference materialises the
very mask the kernels regenerate (flash_attn_ext.reference.dropout_keep_mask, a torch twin written
from the paper and checked against Random123's known answers) and every numeric case is an
exact-attention case under the accuracy rule (tests/accuracy.py), gradients included: dV = (Z o P)^T dO / (1 - p), dS = P o (Z o dP / (1 - p) - D).
The CPU cells run in CI; the CUDA ones on each arch path (the sm90 twins on the H100 / H200, the sm80
twins with force_sm80_path).
"""

import math

import pytest
import torch

import flash_attn_ext
import flash_attn_ext.nn
from accuracy import check_accuracy
from conftest import VARLEN_LENS_K, VARLEN_LENS_Q, make_qkv, make_varlen_qkv, require_hdim, run_hdim
from flash_attn_ext import reference
from flash_attn_ext.interface import dropout_rng_state
from flash_attn_ext.reference import attention_ref, attention_varlen_ref, dropout_keep_mask

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _devices():
    return ["cpu", pytest.param("cuda", marks=CUDA)]


def _dtypes(device):
    return [torch.float16, torch.bfloat16] + ([torch.float32, torch.float64] if device == "cpu" else [])


def test_philox_known_answers():
    """The torch twin of the kernels' generator against Random123's published known answers for
    Philox4x32-10 (counter, key -> output)."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, expected in cases:
        words = reference.philox4x32_10(tuple(torch.tensor(c) for c in counter), key)
        assert tuple(int(w) for w in words) == expected


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction(p):
    """The mask keeps 1 - p of the elements, independently of position (rows, columns and heads)."""
    rng_state = torch.tensor([2**40 + 12345, 777], dtype=torch.int64)
    keep = dropout_keep_mask(rng_state, 2, 4, 256, 256, p).double()
    n = keep.numel()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.mean().item() - (1 - p)) < 6 * sigma
    # no structure along either axis or between the unit's four words
    for dim in (2, 3):
        frac = keep.mean(dim=dim)
        assert (frac - (1 - p)).abs().max().item() < 6 * math.sqrt(p * (1 - p) / keep.shape[dim])
    for dq in (0, 8):
        for dk in (0, 8):
            sub = keep[..., dq::16, dk::16]
            assert abs(sub.mean().item() - (1 - p)) < 6 * math.sqrt(p * (1 - p) / sub.numel())
    other = dropout_keep_mask(torch.tensor([2**40 + 12345, 778]), 2, 4, 256, 256, p).double()
    assert (keep != other).double().mean().item() > 2 * p * (1 - p) * 0.9  # another offset: another mask


def _alg2_dq_dk(q, k, v, causal, scale, dout, stored_out, p, rng_state, batch0=0):
    """(dq, dk) of FlashAttention-2's backward with dropout (Alg. 2 / 4: dS = P o (Z o dP / (1 - p) -
    D), D = rowsum(dout o O)) as its 16-bit form computes it: float64 arithmetic, D from
    ``stored_out`` (a 16-bit output) and dS rounded to q's dtype before the dQ / dK products. With
    dropout a row's O = (Z o P) V / (1 - p) is rounded even where P is exact (one visible key), so
    D's rounding reaches dq and dk in any implementation that keeps O in 16 bits (tests/test_sinks.py:
    _alg2_grads_with_stored_out, the same for sinks); the accuracy rule's baseline for dq / dk is
    the farther of this and torch's same-dtype math. Dense BSHD, GQA."""
    f = torch.float64
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    kf = k.detach().to(f).repeat_interleave(H // Hk, 2)
    vf = v.detach().to(f).repeat_interleave(H // Hk, 2)
    qf, do = q.detach().to(f), dout.to(f)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    vis = reference.visible_mask(Sq, Sk, causal, device=q.device)
    s = s.masked_fill(~vis, float("-inf"))
    has = vis.any(-1, keepdim=True)
    prob = torch.where(has, torch.softmax(s.masked_fill(~has, 0.0), -1), 0.0)
    keep = dropout_keep_mask(rng_state, B, H, Sq, Sk, p, batch0, device=q.device)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
    dsum = (do * stored_out.detach().to(f)).sum(-1).transpose(1, 2).unsqueeze(-1)
    rp = 1.0 / (1.0 - reference.dropout_threshold(p) / 65536.0)  # the kernels' scale
    ds = (prob * (torch.where(keep, dp * rp, 0.0) - dsum)).to(q.dtype).to(f)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    return dq, dk.unflatten(2, (Hk, H // Hk)).sum(3)


def _check(q, k, v, run, ref, alg2):
    """conftest.check_fwd_bwd, with the dq / dk baselines also from Alg. 2 on the stored outputs
    (``_alg2_dq_dk``) for inputs below float64: a row with one visible key has O = v / (1 - p), which
    the output's dtype rounds, so D = rowsum(dO o O) leaves dS = P (Z dP rp - D) a rounding away from
    the exact 0 of torch's math."""
    out, lse = run()
    ref_out, ref_lse = ref(True)
    base_out, base_lse = ref(False)
    check_accuracy("out", out, ref_out, base_out)
    check_accuracy("softmax_lse", lse, ref_lse, base_lse)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout.to(ref_out.dtype))
    base_grads = list(torch.autograd.grad(base_out, (q, k, v), dout))
    if out.dtype in (torch.float16, torch.bfloat16, torch.float32):
        for stored in (base_out, ref_out.detach().to(out.dtype)):
            for i, g in enumerate(alg2(dout, stored)):
                err = lambda t: (t.double() - ref_grads[i].double()).abs().max().item()  # noqa: E731
                if err(g) > err(base_grads[i]):
                    base_grads[i] = g.to(out.dtype)
    for name, g, rg, bg in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
        check_accuracy(name, g, rg, bg)


def _cells():
    # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
    return [(2, 128, 128, 4, 4, 64), (1, 77, 200, 4, 2, 128), (2, 200, 67, 6, 1, 32), (1, 1, 300, 2, 2, 96),
            (1, 129, 129, 2, 2, 256), (2, 150, 333, 4, 2, 192), (1, 300, 1, 3, 3, 32)]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("shape", _cells())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("p", [0.17, 0.5])
def test_dropout_matches_reference(device, shape, causal, p, poison_empty, arch_path):
    """flash_attn_func with dropout_p against the float64 reference with the same mask (the call's
    rng_state drawn again from the same seed), forward, LSE and gradients."""
    _dropout_case(device, shape, causal, p, _dtypes(device))


# Shapes of the sm90 path's long rows: the forward's FwdLongTile (d128, dense non-causal, >= 8192
# keys) and the backward's DkvLongTile (d96: >= 4096 queries and keys per sequence, >= 2 of its
# 192-key CTAs per SM: 264 here), which has no dropout twin: there the dropout call runs
# DkvMidTile (d96 from 2048 with >= 2 of its 128-key CTAs per SM: 384 and 288 here; dispatch.cu);
# CUDA only (the CPU reference would take minutes).
_LONG_ROW_CELLS = [(1, 128, 8192, 2, 1, 128), (2, 4096, 4096, 6, 6, 96), (2, 2048, 2048, 9, 9, 96)]


@CUDA
@pytest.mark.parametrize("shape", _LONG_ROW_CELLS)
def test_dropout_long_rows(shape, poison_empty, arch_path):
    """The dropout twins at the long tile rows' sizes against the float64 reference, as
    test_dropout_matches_reference (bf16, non-causal: the long forward row's condition); at d96 the
    kernel names show the dK/dV row that ran."""
    from test_cuda_backward import _dkv_row, _sm90_backward_runs, _sm90_rows

    b, sq, sk, h, hk, d = shape
    rows = _sm90_rows(lambda: _dropout_case("cuda", shape, False, 0.17, [torch.bfloat16]), "flash_bwd_dkv")
    if d == 96 and _sm90_backward_runs(arch_path):
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert rows == {_dkv_row(run_hdim(d), sq, sk, b * hk, num_sms, softcap_or_dropout=True)}, rows


def _dropout_case(device, shape, causal, p, dtypes):
    b, sq, sk, h, hk, d = shape
    if device == "cuda":
        require_hdim(d)
    for dtype in dtypes:
        q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device)
        torch.manual_seed(1234)
        rng_state = dropout_rng_state(q.device)

        def run():
            torch.manual_seed(1234)  # the call draws rng_state again
            return flash_attn_ext.flash_attn_func(q, k, v, p, causal=causal, return_lse=True)

        def ref(upcast):
            return attention_ref(q, k, v, None, causal, upcast=upcast, dropout_p=p, rng_state=rng_state.cpu())

        def alg2(dout, stored):
            return _alg2_dq_dk(q, k, v, causal, d**-0.5, dout, stored, p, rng_state.cpu())

        _check(q, k, v, run, ref, alg2)


@pytest.mark.parametrize("device", _devices())
def test_dropout_same_state_same_bits(device):
    """One rng_state gives one mask: the op twice, bit for bit, forward and backward; another state
    another output; p -> 0 the output without dropout."""
    q, k, v = make_qkv(2, 96, 160, 4, 2, 64, torch.bfloat16, device)
    ops = flash_attn_ext.ops
    rs = torch.tensor([99, 7], dtype=torch.int64, device=device)
    dout = torch.randn(q.shape, dtype=q.dtype, device=device)
    results = []
    for _ in range(2):
        out, _, _ = ops.attention_forward(q, k, v, 0.125, True, -1, -1, None, 0.0, 0.3, rs)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    other, _, _ = ops.attention_forward(q, k, v, 0.125, True, -1, -1, None, 0.0, 0.3, rs + 1)
    assert not torch.equal(other, results[0][0])
    # threshold 0: nothing dropped, scale 1 in float32: the bits of the call without dropout (a row's
    # key blocks are the same, in the same order: the sm90 twins run the tile row the call without
    # dropout runs; the sm80 forward's own 64-row FwdDropoutTile has d64's key block width)
    plain, _, _ = ops.attention_forward(q, k, v, 0.125, True)
    tiny, _, _ = ops.attention_forward(q, k, v, 0.125, True, -1, -1, None, 0.0, 1e-12, rs)
    assert torch.equal(plain, tiny)


@pytest.mark.parametrize("device", _devices())
def test_manual_seed_reproduces(device):
    q, k, v = make_qkv(1, 64, 64, 2, 2, 64, torch.float16, device, requires_grad=False)
    torch.manual_seed(5)
    a = flash_attn_ext.flash_attn_func(q, k, v, 0.2)
    b = flash_attn_ext.flash_attn_func(q, k, v, 0.2)
    torch.manual_seed(5)
    c = flash_attn_ext.flash_attn_func(q, k, v, 0.2)
    assert torch.equal(a, c) and not torch.equal(a, b)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 256])
def test_varlen_dropout(device, causal, d, poison_empty, arch_path):
    """Packed sequences: sequence b drops what batch b of the reference drops (positions are the
    sequence's own), forward and gradients (d256: the sm90 backward's Roles<> kernels)."""
    lens_q, lens_k = VARLEN_LENS_Q, VARLEN_LENS_K
    if device == "cuda":
        require_hdim(d)
    for dtype in _dtypes(device)[:2]:
        q, k, v, cu_q, cu_k = make_varlen_qkv(4, 2, d, dtype, device)
        torch.manual_seed(77)
        rng_state = dropout_rng_state(q.device)

        def run():
            torch.manual_seed(77)
            return flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), 0.25,
                                                         causal=causal, return_lse=True)

        def ref(upcast):
            return attention_varlen_ref(q, k, v, cu_q.cpu(), cu_k.cpu(), None, causal, upcast=upcast, dropout_p=0.25,
                                        rng_state=rng_state.cpu())

        def alg2(dout, stored):  # per sequence (batch index b), packed back
            dq, dk = torch.zeros(q.shape, dtype=torch.float64, device=device), torch.zeros(k.shape, dtype=torch.float64,
                                                                                             device=device)
            cq, ck = cu_q.tolist(), cu_k.tolist()
            for b in range(len(lens_q)):
                if cq[b + 1] > cq[b] and ck[b + 1] > ck[b]:
                    sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
                    gq, gk = _alg2_dq_dk(q[sq][None], k[sk][None], v[sk][None], causal, d**-0.5, dout[sq][None],
                                         stored[sq][None], 0.25, rng_state.cpu(), b)
                    dq[sq], dk[sk] = gq[0], gk[0]
            return dq, dk

        _check(q, k, v, run, ref, alg2)


@pytest.mark.parametrize("device", _devices())
def test_dropout_bad_input(device):
    q, k, v = make_qkv(1, 32, 32, 2, 2, 64, torch.float16, device, requires_grad=False)
    fwd = torch.ops.flash_attn_ext.forward
    for p in (1.0, -0.1, float("nan"), 1.5):
        with pytest.raises(ValueError, match="dropout_p"):
            flash_attn_ext.flash_attn_func(q, k, v, p)
        with pytest.raises(ValueError, match="dropout_p"):
            fwd(q, k, v, 0.125, False, -1, -1, None, 0.0, p, torch.zeros(2, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="rng_state"):
        fwd(q, k, v, 0.125, False, -1, -1, None, 0.0, 0.1, None)
    for bad in (torch.zeros(2, dtype=torch.int32, device=device), torch.zeros(3, dtype=torch.int64, device=device),
                torch.zeros(1, 2, dtype=torch.int64, device=device)):
        with pytest.raises(ValueError, match="rng_state"):
            fwd(q, k, v, 0.125, False, -1, -1, None, 0.0, 0.1, bad)
    with pytest.raises(NotImplementedError, match="softcap"):
        flash_attn_ext.flash_attn_func(q, k, v, 0.1, softcap=30.0)
    with pytest.raises(NotImplementedError, match="window"):
        flash_attn_ext.flash_attn_func(q, k, v, 0.1, window_size=(8, 0))
    # a window that hides no key is no window (normalized as without dropout)
    flash_attn_ext.flash_attn_func(q, k, v, 0.1, window_size=(100, 100))
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(qd.detach(), torch.randn_like(q))
        with pytest.raises(NotImplementedError, match="forward-mode"):
            flash_attn_ext.flash_attn_func(dual, k, v, 0.1)


def _generator_state(device):
    return torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state(device)


@pytest.mark.parametrize("device", _devices())
def test_refused_dropout_calls_draw_no_random_numbers(device):
    """A dropout call that is refused leaves torch's generator where it was (the entries draw the
    call's (seed, offset) only once the op's checks pass: a refused call, caught and retried, used to
    shift every later mask), and return_lse is checked before the op runs. Dense and varlen, the
    op's shape / dtype / feature checks and, on CPU, the cu_seqlens values."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = make_qkv(2, 16, 16, 4, 2, 16, dtype, device, requires_grad=False)
    f = flash_attn_ext.flash_attn_func
    q3, k3, v3 = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    cu = torch.tensor([0, 5, 32], dtype=torch.int32, device=device)
    fv = flash_attn_ext.flash_attn_varlen_func
    refused = [
        (RuntimeError, lambda: f(q, k[:1], v[:1], 0.1)),                                   # batch
        (RuntimeError, lambda: f(q, k.double() if device == "cpu" else k.half(), v, 0.1)),  # dtype
        (RuntimeError, lambda: f(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1), 0.1)),
        (NotImplementedError, lambda: f(q, k, v, 0.1, softcap=5.0)),
        (NotImplementedError, lambda: f(q, k, v, 0.1, window_size=(3, 0))),
        (NotImplementedError, lambda: f(q, k, v, 0.1, alibi_slopes=torch.ones(4, device=device))),
        (RuntimeError, lambda: f(q, k, v, 0.1, sinks=torch.zeros(5, device=device))),
        (RuntimeError, lambda: f(q, k, v, 0.1, float("inf"))),
        (TypeError, lambda: f(q, k, v, 0.1, return_lse="yes")),
        (RuntimeError, lambda: fv(q3, k3, v3, cu, cu[:2], 27, 27, 0.1)),                   # lengths differ
        (NotImplementedError, lambda: fv(q3, k3, v3, cu, cu, 27, 27, 0.1, softcap=5.0)),
        (TypeError, lambda: fv(q3, k3, v3, cu, cu, 27, 27, 0.1, return_lse="yes")),
    ]
    if device == "cpu":  # the CPU op's value checks
        refused += [(RuntimeError, lambda: fv(q3, k3, v3, torch.tensor([0, 9, 5], dtype=torch.int32), cu, 27, 27, 0.1)),
                    (RuntimeError, lambda: fv(q3, k3, v3, cu, cu, 3, 27, 0.1))]
    for error, call in refused:
        before = _generator_state(device)
        with pytest.raises(error):
            call()
        assert torch.equal(_generator_state(device), before), call
    before = _generator_state(device)
    f(q, k, v, 0.1)  # a call that runs draws
    assert not torch.equal(_generator_state(device), before)


def test_rng_state_on_other_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU for a second device")
    q, k, v = make_qkv(1, 32, 32, 2, 2, 64, torch.float16, "cuda", requires_grad=False)
    with pytest.raises(RuntimeError, match="rng_state"):
        torch.ops.flash_attn_ext.forward(q, k, v, 0.125, False, -1, -1, None, 0.0, 0.1, torch.zeros(2, dtype=torch.int64))


def test_fake_kernels_and_compile():
    """The fake kernels take the dropout arguments and refuse what the op refuses; torch.compile
    (fullgraph) of a training step with a given rng_state equals eager, bit for bit."""
    q, k, v = make_qkv(2, 64, 80, 4, 2, 64, torch.float32, "cpu")
    rs = torch.tensor([3, 4], dtype=torch.int64)
    args = (q, k, v, 0.125, True, -1, -1, None, 0.0, 0.3, rs)
    torch.library.opcheck(torch.ops.flash_attn_ext.forward.default, args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        with pytest.raises(ValueError, match="rng_state"):
            torch.ops.flash_attn_ext.forward(fq, fk, fv, 0.125, True, -1, -1, None, 0.0, 0.3, None)
        with pytest.raises(NotImplementedError, match="softcap"):
            torch.ops.flash_attn_ext.forward(fq, fk, fv, 0.125, True, -1, -1, None, 5.0, 0.3, mode.from_tensor(rs))

    def step(q, k, v, rs):
        out, _, _ = flash_attn_ext.ops.attention_forward(q, k, v, 0.125, True, -1, -1, None, 0.0, 0.3, rs)
        return out.square().sum()

    eager = torch.autograd.grad(step(q, k, v, rs), (q, k, v))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v, rs), (q, k, v))
    for a, b in zip(eager, got):
        assert torch.equal(a, b)
    # flash_attn_func draws its state inside the graph
    out = torch.compile(lambda q, k, v: flash_attn_ext.flash_attn_func(q, k, v, 0.3), fullgraph=True,
                        backend="aot_eager")(q, k, v)
    assert out.shape == q.shape and torch.isfinite(out).all()


@CUDA
def test_cuda_graph_replays_draw_new_masks():
    """A captured training step draws its rng_state inside the graph: each replay a new mask, each
    the reference's for the state it drew."""
    require_hdim(64)
    q, k, v = make_qkv(1, 128, 128, 2, 2, 64, torch.bfloat16, "cuda", requires_grad=False)
    states, outs = [], []
    static = {}

    def body():
        rs = dropout_rng_state(q.device)
        out, _, _ = flash_attn_ext.ops.attention_forward(q, k, v, 0.125, False, -1, -1, None, 0.0, 0.2, rs)
        static["rs"], static["out"] = rs, out

    body()  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        states.append(static["rs"].clone())
        outs.append(static["out"].clone())
    assert not torch.equal(states[0], states[1])
    for rs, out in zip(states, outs):
        ref, _ = attention_ref(q, k, v, 0.125, False, dropout_p=0.2, rng_state=rs.cpu())
        base, _ = attention_ref(q, k, v, 0.125, False, upcast=False, dropout_p=0.2, rng_state=rs.cpu())
        err, base_err = (out.double() - ref).abs().max().item(), (base.double() - ref).abs().max().item()
        assert err <= 2 * base_err + 1e-5


# ---- the entries above the ops: the SDPA drop-in, the nn modules, the Hugging Face integration -----

def _bhsd(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_dropout_is_flash_attn_funcs(is_causal):
    """The SDPA drop-in's dropout_p without a mask is flash_attn_func's (the same mask under the same
    seed), and p = 0 its call without dropout."""
    from flash_attn_ext import scaled_dot_product_attention

    q, k, v = (_bhsd(2, 4, 24, 32) for _ in range(3))
    torch.manual_seed(21)
    got = scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=is_causal)
    torch.manual_seed(21)
    want = flash_attn_ext.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.3,
                                          causal=is_causal).transpose(1, 2)
    assert torch.equal(got, want)
    assert torch.equal(scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=is_causal),
                       scaled_dot_product_attention(q, k, v, is_causal=is_causal))


def test_masked_dropout_is_unbiased():
    """Through a padding mask (the masked path's varlen calls, each drawing its own mask) dropout is
    unbiased: the mean of many draws is the output without dropout (within 6 standard errors per
    element, float64), rows without a key stay 0, and every draw is finite with gradients."""
    from flash_attn_ext import scaled_dot_product_attention

    B, H, L, D, p, n = 2, 2, 12, 8, 0.5, 400
    q, k, v = (_bhsd(B, H, L, D) for _ in range(3))
    allowed = torch.ones(B, 1, L, L, dtype=torch.bool)
    allowed[0, :, :, 9:] = False                      # key padding in element 0
    allowed[1, :, 10:, :] = False                     # query padding in element 1: rows without a key
    plain = scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    draws = torch.stack([scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p).detach()
                         for _ in range(n)])
    assert torch.isfinite(draws).all() and (draws[:, 1, :, 10:] == 0).all()
    se = draws.std(0) / math.sqrt(n)
    assert ((draws.mean(0) - plain.detach()).abs() <= 6 * se + 1e-12).all()
    out = scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_modules_drop_in_training_only():
    """FlashAttention(dropout_p=) and MultiheadFlashAttention(dropout=) apply dropout in training
    mode (flash_attn_func's, the same mask under the same seed) and never in eval mode."""
    q, k, v = (torch.randn(2, 16, 2, 32, dtype=torch.float64) for _ in range(3))
    layer = flash_attn_ext.nn.FlashAttention(causal=True, dropout_p=0.25)
    assert torch.equal(layer.eval()(q, k, v), flash_attn_ext.flash_attn_func(q, k, v, causal=True))
    torch.manual_seed(8)
    got = layer.train()(q, k, v)
    torch.manual_seed(8)
    assert torch.equal(got, flash_attn_ext.flash_attn_func(q, k, v, 0.25, causal=True))
    x = torch.randn(2, 16, 64, dtype=torch.float64)
    for backend in ("flash_attn_ext", "torch_sdpa"):
        torch.manual_seed(0)
        mha = flash_attn_ext.nn.MultiheadFlashAttention(64, 4, causal=True, dtype=torch.float64, backend=backend,
                                                     dropout=0.3)
        torch.manual_seed(0)
        plain = flash_attn_ext.nn.MultiheadFlashAttention(64, 4, causal=True, dtype=torch.float64, backend=backend)
        assert torch.equal(mha.eval()(x)[0], plain.eval()(x)[0])
        a, b = mha.train()(x)[0], mha(x)[0]
        assert torch.isfinite(a).all() and not torch.equal(a, b) and not torch.equal(a, plain(x)[0])
    for bad, error in ((1.0, ValueError), (-0.1, ValueError), (float("nan"), ValueError), (True, TypeError),
                       ("0.1", TypeError), (None, TypeError)):
        with pytest.raises(error, match="MultiheadFlashAttention: dropout "):
            flash_attn_ext.nn.MultiheadFlashAttention(64, 4, dropout=bad)
        with pytest.raises(error, match="FlashAttention: dropout_p "):
            flash_attn_ext.nn.FlashAttention(dropout_p=bad)


def test_transformers_attention_forward_dropout():
    """The Hugging Face integration's ``dropout`` (transformers passes the layer's attention_dropout
    in training) is flash_attn_func's dropout_p: the same mask under the same seed."""
    pytest.importorskip("transformers")
    from flash_attn_ext import integrations as fx

    class Layer(torch.nn.Module):
        is_causal = True

    q, k, v = (_bhsd(2, 4, 16, 32) for _ in range(3))
    torch.manual_seed(4)
    got, _ = fx.flash_attn_ext_attention_forward(Layer(), q, k, v, None, dropout=0.1)
    torch.manual_seed(4)
    want = flash_attn_ext.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.1, causal=True)
    assert torch.equal(got, want)


def test_vmap_and_jacrev_keep_each_samples_mask():
    """Under torch.vmap a sample's dropout mask is the one an unvmapped call with the same rng_state
    draws (the rule runs the op per sample: folding samples into the batch would move their batch
    indices), so vmap(f)(x)[i] = f(x[i]); torch.func.jacrev (the backward vmapped over cotangents)
    regenerates the forward's mask: it equals the Jacobian by autograd."""
    q, k, v = (torch.randn(3, 1, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    rs = torch.tensor([1, 2])

    def f(q, k, v):
        return flash_attn_ext.ops.attention_forward(q, k, v, 0.3, True, -1, -1, None, 0.0, 0.4, rs)[0]

    batched = torch.vmap(f)(q, k, v)
    for i in range(3):
        assert torch.equal(batched[i], f(q[i], k[i], v[i]))
    g = lambda x: f(x, k[0], v[0])  # noqa: E731
    assert torch.allclose(torch.func.jacrev(g)(q[0]), torch.autograd.functional.jacobian(g, q[0]),
                          rtol=0, atol=1e-12)
    # flash_attn_func under vmap's randomness modes: "same" one mask for every sample, "different" one each
    same = torch.vmap(lambda x: flash_attn_ext.flash_attn_func(x, k[0], v[0], 0.5), randomness="same")(
        q[0].expand(3, -1, -1, -1, -1))
    assert torch.equal(same[0], same[1]) and torch.equal(same[1], same[2])
    diff = torch.vmap(lambda x: flash_attn_ext.flash_attn_func(x, k[0], v[0], 0.5), randomness="different")(
        q[0].expand(3, -1, -1, -1, -1))
    assert not torch.equal(diff[0], diff[1])


def test_rng_state_changed_in_place_before_backward():
    """The backward regenerates the mask from the forward's rng_state: changing it in place in between
    is an autograd error, not another mask's gradients."""
    q, k, v = make_qkv(1, 16, 16, 2, 2, 32, torch.float64, "cpu")
    rs = torch.tensor([5, 6])
    out, _, _ = flash_attn_ext.ops.attention_forward(q, k, v, 0.2, True, -1, -1, None, 0.0, 0.3, rs)
    rs[1] += 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("varlen", [False, True])
def test_dropout_under_non_reentrant_checkpointing(device, varlen):
    """torch.utils.checkpoint(use_reentrant=False) unpacks each saved tensor once: the backward reads
    them once (with dropout and sinks too), and the recompute draws the same rng_state (checkpoint
    restores the generator), so the gradients are the plain call's bit for bit."""
    q, k, v = make_qkv(2, 40, 56, 4, 2, 64, torch.bfloat16 if device == "cuda" else torch.float32, device)
    sinks = torch.randn(4, device=device, requires_grad=True)
    cu = torch.tensor([0, 40, 80], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 56, 112], dtype=torch.int32, device=device)

    def f(q, k, v, sinks):
        if varlen:
            return flash_attn_ext.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu_k,
                                                         40, 56, 0.3, causal=True, sinks=sinks)
        return flash_attn_ext.flash_attn_func(q, k, v, 0.3, causal=True, sinks=sinks)

    dout = torch.randn_like(f(q, k, v, sinks))
    torch.manual_seed(3)
    want = torch.autograd.grad(f(q, k, v, sinks), (q, k, v, sinks), dout)
    torch.manual_seed(3)
    out = torch.utils.checkpoint.checkpoint(f, q, k, v, sinks, use_reentrant=False)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("d", [64, 256])
def test_dropout_nan_reaches_what_it_touches(device, d, arch_path):
    """A NaN in one query row reaches dV through that row's kept elements only, as the reference's
    gradient (a dropped element contributes 0, never NaN * 0), and out's row only (d256: the sm90
    Roles<> dK/dV kernel, whose role 1 reads Z from the sign of what role 0 hands over)."""
    if device == "cuda":
        require_hdim(d)
    q, k, v = make_qkv(1, 24, 40, 2, 2, d, torch.bfloat16 if device == "cuda" else torch.float32, device,
                       requires_grad=False)
    q[0, 3, 0, 0] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    rs = torch.tensor([12, 34], dtype=torch.int64, device=device)
    out, _, _ = flash_attn_ext.ops.attention_forward(q, k, v, 0.125, False, -1, -1, None, 0.0, 0.5, rs)
    dout = torch.randn_like(out)
    dv = torch.autograd.grad(out, v, dout)[0]
    ref_out, _ = attention_ref(q, k, v, 0.125, False, dropout_p=0.5, rng_state=rs.cpu())
    ref_dv = torch.autograd.grad(ref_out, v, dout.to(ref_out.dtype))[0]
    assert torch.equal(out.isnan(), ref_out.isnan())
    assert torch.equal(dv.isnan(), ref_dv.isnan()) and dv.isnan().any() and not dv.isnan().all()


def test_dropout_argument_checks_name_the_entry():
    """Every entry checks its dropout argument itself, naming it and the entry: a real number (a 0-dim
    tensor too, not one that requires grad; TypeError otherwise) in [0, 1) (ValueError)."""
    from flash_attn_ext import integrations as fx
    from flash_attn_ext import scaled_dot_product_attention

    q = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    qb = q.transpose(1, 2)
    torch.manual_seed(0)
    a = flash_attn_ext.flash_attn_func(qb, qb, qb, torch.tensor(0.25, dtype=torch.float64))
    torch.manual_seed(0)
    assert torch.equal(a, flash_attn_ext.flash_attn_func(qb, qb, qb, 0.25))
    with pytest.raises(TypeError, match="dropout_p is a tensor that requires grad"):
        flash_attn_ext.flash_attn_func(qb, qb, qb, torch.tensor(0.25, requires_grad=True))
    with pytest.raises(ValueError, match=r"flash_attn_ext.scaled_dot_product_attention: dropout_p must be in \[0, 1\)"):
        scaled_dot_product_attention(q, q, q, dropout_p=1.0)
    with pytest.raises(TypeError, match="flash_attn_ext.scaled_dot_product_attention: dropout_p must be a real"):
        scaled_dot_product_attention(q, q, q, dropout_p="0.1")

    class Layer(torch.nn.Module):
        is_causal = True

    for bad, error in (("0.1", TypeError), (True, TypeError), (1.5, ValueError)):
        with pytest.raises(error, match="flash_attn_ext attention: dropout "):
            fx.flash_attn_ext_attention_forward(Layer(), q, q, q, None, dropout=bad)
