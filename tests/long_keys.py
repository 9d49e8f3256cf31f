"""Attention over one very long key sequence (k / v of more than 2^31 elements: the kernels' 64-bit
offsets), checked against references computed one key chunk at a time (a whole float64 copy of
such a k would take 17 GB): the forward merged exactly by LSE weights, the backward as
FlashAttention-2 Alg. 2 per chunk from the rows' whole LSE and D = rowsum(dO o O).

The inputs make the keys past element 2^31 matter: every query row gets a dominant key among the
last keys and the last value rows are shifted.

The keys per row stay near 132k (128 heads of 128): these tests are about offsets. Rows of
millions of keys are about the accumulator: each 16-key step of O's fp32 tensor-core accumulator
rounds toward zero, about N / 16 * 2^-25 of |O| lost over N keys, which past ~2^20 keys is more
than bf16's output rounding (D = rowsum(dO o O) carries it into dq and dk). The forward kernels
therefore move O into a float32 copy every 8192 keys in rows of >= 2^18 keys
(csrc/kernels/common/long_rows.cuh); test_forward_long_rows and test_backward_long_rows check
rows of 2.1M and 1M keys, which missed the rule without it (docs/PERF_NOTES.md, fortieth and
forty-first sessions; README: Accuracy rule).
"""

import math

import pytest
import torch

from accuracy import default_atol


def require_free_gib(gib: int) -> None:
    """pytest.skip without gib GiB of free GPU memory."""
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs ~{gib} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


def long_key_inputs(seqlen_k, seqlen_q=16, nheads=8, headdim=128, dtype=torch.bfloat16, device="cuda",
                    dominance=4.0, shifted_rows=None, equal_norms=False):
    """q (1, seqlen_q, nheads, headdim), k, v (1, seqlen_k, nheads, headdim): random, query row i's
    dominant key at row seqlen_k - 3 - i (dominance * q_i: score ~ 11 * dominance at headdim 128,
    the default's ~45 takes all of the row's probability), value rows of the last shifted_rows keys
    (default: a quarter of them, at most 2^20) shifted by 2. equal_norms: every q row scaled to norm
    sqrt(headdim) first, so every row's dominant score is dominance * sqrt(headdim)."""
    q = torch.randn(1, seqlen_q, nheads, headdim, dtype=dtype, device=device)
    if equal_norms:
        q = (q.float() * math.sqrt(headdim) / q.float().norm(dim=-1, keepdim=True)).to(dtype)
    k = torch.randn(1, seqlen_k, nheads, headdim, dtype=dtype, device=device)
    v = torch.randn(1, seqlen_k, nheads, headdim, dtype=dtype, device=device)
    v[:, -(shifted_rows or min(1 << 20, seqlen_k // 4)):] += 2.0
    for i in range(seqlen_q):
        k[:, -3 - i] = q[:, i] * dominance
    return q, k, v


def inputs_past_2pow31(min_free_gib: int, dominance: float = 4.0):
    """long_key_inputs on the GPU with k and v of 2^31 + 16,384,000 elements each (128 heads, head
    dim 128, 132,072 keys, bf16, ~4.3 GB each; the last 1000 keys lie past element 2^31), or
    pytest.skip without min_free_gib GiB of free GPU memory."""
    require_free_gib(min_free_gib)
    h, d = 128, 128
    seqlen_k = 2**31 // (h * d) + 1000
    q, k, v = long_key_inputs(seqlen_k, nheads=h, headdim=d, dominance=dominance)
    assert k.numel() > 2**31
    return q, k, v


def key_chunk(k) -> int:
    """Keys per reference chunk: 2^27 elements of k (1 GiB as float64), as many chunks at any head
    count."""
    return max(2**27 // (k.shape[2] * k.shape[3]), 1)


def _chunked_attention(q, k, v, softmax_scale, chunk, upcast):
    """(out (b, s, h, d), lse (b, s, h)) merged over key chunks: float64 (upcast) or float32. Per
    chunk attention_ref's math without a mask (scores, softmax, P V in float64 or in the inputs'
    dtype), but the LSE in float64 for the reference (attention_ref's is float32: its rounding,
    ~5e-6 at |LSE| ~ 45, would be the reference's own error in the backward's P = exp(S - LSE))."""
    out_acc, lse_acc = None, None
    t = torch.float64 if upcast else q.dtype
    acc_dtype = torch.float64 if upcast else torch.float32
    for start in range(0, k.shape[1], chunk):
        s = torch.einsum("bqhd,bkhd->bhqk", q.to(t), k[:, start:start + chunk].to(t)) * softmax_scale
        l = torch.logsumexp(s.to(acc_dtype), dim=-1).transpose(1, 2)  # (b, s, h)
        o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v[:, start:start + chunk].to(t)).to(acc_dtype)
        if out_acc is None:
            out_acc, lse_acc = o, l
        else:
            new = torch.logaddexp(lse_acc, l)
            out_acc = out_acc * torch.exp(lse_acc - new)[..., None] + o * torch.exp(l - new)[..., None]
            lse_acc = new
    return out_acc, lse_acc


def chunked_ref(q, k, v, softmax_scale, chunk, upcast):
    """Attention over a very long k/v, one key chunk at a time, merged exactly by LSE weights.
    upcast=True: float64 per chunk (the reference); False: the inputs' dtype per chunk (the
    same-dtype baseline), merged in float32. Returns (out, softmax_lse (b, h, s) float32); the
    baseline's out ends in the inputs' dtype, like a same-dtype computation would."""
    out, lse = _chunked_attention(q, k, v, softmax_scale, chunk, upcast)
    return (out if upcast else out.to(q.dtype)), lse.transpose(1, 2).float()


def _chunked_grads(q, k, v, dout, softmax_scale, chunk, upcast):
    """Yields (start, dk_chunk, dv_chunk) per key chunk, then (None, dq, None): FA2 Alg. 2 (dV = P^T dO,
    dP = dO V^T, dS = P o (dP - D), dK = scale dS^T Q, dQ = scale dS K) per chunk, P = exp(S - LSE)
    from the whole row's LSE. upcast: float64 throughout; else every product in the inputs' dtype
    (P rounded to it from float32, as torch's softmax rounds), dQ summed over chunks in float32."""
    t = torch.float64 if upcast else q.dtype
    out, lse = _chunked_attention(q, k, v, softmax_scale, chunk, upcast)
    out = out.to(t)
    lse = lse.transpose(1, 2)[..., None]                                    # (b, h, s, 1)
    qt, dot = q.to(t), dout.to(t)
    d_rows = (dot * out).sum(-1).transpose(1, 2)[..., None]                  # D: (b, h, s, 1)
    dq = torch.zeros(q.shape, dtype=torch.float64 if upcast else torch.float32, device=q.device)
    for start in range(0, k.shape[1], chunk):
        kc, vc = k[:, start:start + chunk].to(t), v[:, start:start + chunk].to(t)
        s = torch.einsum("bqhd,bkhd->bhqk", qt, kc) * softmax_scale
        p = torch.exp(s.to(lse.dtype) - lse).to(t)
        dv = torch.einsum("bhqk,bqhd->bkhd", p, dot)
        dp = torch.einsum("bqhd,bkhd->bhqk", dot, vc)
        ds = p * (dp - d_rows.to(t))
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, qt) * softmax_scale
        dq += (torch.einsum("bhqk,bkhd->bqhd", ds, kc) * softmax_scale).to(dq.dtype)
        yield start, dk, dv
    yield None, (dq if upcast else dq.to(q.dtype)), None


def check_long_key_grads(q, k, v, dout, softmax_scale, dq, dk, dv, chunk=None, factor=2.0):
    """The accuracy rule (tests/accuracy.py) for dq, dk, dv over the whole tensors, their errors
    gathered chunk by chunk (default: key_chunk(k) keys): max|ours - ref| <= factor * max|baseline
    - ref| + atol. NaN fails."""
    chunk = chunk or key_chunk(k)
    err = {"dq": 0.0, "dk": 0.0, "dv": 0.0}
    base_err = dict(err)
    # Per chunk (start, dk, dv) from the reference and the baseline; last (None, dq, None).
    for (start, ref1, ref2), (_, base1, base2) in zip(_chunked_grads(q, k, v, dout, softmax_scale, chunk, True),
                                                      _chunked_grads(q, k, v, dout, softmax_scale, chunk, False)):
        pairs = (("dq", dq, ref1, base1),) if start is None else (
            ("dk", dk[:, start:start + chunk], ref1, base1), ("dv", dv[:, start:start + chunk], ref2, base2))
        for name, ours, ref, base in pairs:
            ours = ours.double()
            assert not torch.isnan(ours).any(), f"{name}: NaN in output (rows from {start})"
            err[name] = max(err[name], (ours - ref.double()).abs().max().item())
            base_err[name] = max(base_err[name], (base.double() - ref.double()).abs().max().item())
    for name in err:
        assert err[name] <= factor * base_err[name] + default_atol(q.dtype), (
            f"{name}: max|ours-ref|={err[name]:.3e} > {factor}*max|baseline-ref|={factor * base_err[name]:.3e}")
    return err, base_err
