"""GPU tests of the varlen (packed-sequence) CUDA kernels (issue 14 item 1) through
``flash_attn_ext.flash_attn_varlen_func``: the sm80 and sm90 (TMA) forwards, the backward
preprocess and the dK/dV and dQ kernels of both arch paths, every test on each arch path the GPU can
take (conftest.py: arch_path; on an H200 the sm90 kernels and, forced, the sm80 ones).

Criteria, per packed call:
  - equal to each sequence run alone through ``flash_attn_func`` on the same arch path, BIT FOR BIT:
    out, softmax_lse and the gradients dq, dk, dv. Every kernel runs a sequence's tiles in the
    order the dense call runs them (forward: key blocks last to first; dK/dV: query heads of the
    GQA group, then Q tiles, in order; dQ: key blocks in order; the preprocess per row), reads its
    rows at the sequence's offset, zero-fills (sm80 cp.async) or masks (sm90 TMA: keys past the
    end -> -inf in S, P = 0) what lies past the sequence's end, the sm90 forward zeroes the Q rows
    past the end that share a warp with the last rows and the V rows past the keys, and the sm90
    dK/dV and dQ kernels (by TMA) the Q / dO and K / V rows past the end of a sequence's last tile
    (the dense call's TMA zero fill), so the same floats meet in the same order;
  - within the accuracy rule of tests/accuracy.py against the float64 reference
    (flash_attn_ext.reference.attention_varlen_ref);
  - deterministic: two identical calls agree bit for bit;
  - NaN-poisoned outputs and workspaces (poison_empty: torch.empty / at::empty fill float tensors
    with NaN, int tensors with their max): a row, gradient, workspace row or block flag a kernel
    forgets to write fails;
  - zero-length sequences: seqlen_k = 0 gives out 0, lse +inf, softmax_stats (+inf, 0), dq 0;
    seqlen_q = 0 gives dk = dv = 0.
Shapes: mixed lengths with seqlen_q != seqlen_k per sequence, causal both ways, GQA 1:1 and 4:1,
head dims 64/128 (+ 96/256 where compiled), fp16/bf16, max_seqlen larger than needed, > 132
sequences (more than the SMs: the sm90 persistent scheduler's skip of empty tiles), large
magnitudes (the exact softmax path), and the issue's 16k tokens in 64 sequences of 128..1024.
"""

import os
import random
import re
import subprocess
import sys

import pytest
import torch

import flash_attn_ext
from conftest import require_hdim
from accuracy import check_accuracy
from flash_attn_ext.reference import attention_varlen_ref

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="varlen CUDA kernel tests need a CUDA GPU (none visible)"
)

DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def varlen_path(arch_path):
    """Every test on each arch path the GPU can take (conftest.py: arch_path)."""
    return arch_path


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


def _inputs(lens_q, lens_k, nheads, nheads_k, d, dtype, scale_q=1.0):
    q = torch.randn(sum(lens_q), nheads, d, device="cuda", dtype=torch.float32) * scale_q
    k = torch.randn(sum(lens_k), nheads_k, d, device="cuda", dtype=torch.float32)
    v = torch.randn(sum(lens_k), nheads_k, d, device="cuda", dtype=torch.float32)
    return q.to(dtype), k.to(dtype), v.to(dtype), _cu(lens_q), _cu(lens_k)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _nan_padded(t, rows):
    """t with NaN rows appended up to `rows` rows (packed buffers larger than their sequences)."""
    pad = torch.full((rows - t.shape[0],) + tuple(t.shape[1:]), float("nan"), device=t.device, dtype=t.dtype)
    return torch.cat([t, pad])


def run_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, dout):
    """flash_attn_varlen_func forward + autograd backward: (out, lse, dq, dk, dv)."""
    q_, k_, v_ = _leaf(q), _leaf(k), _leaf(v)
    out, lse = flash_attn_ext.flash_attn_varlen_func(q_, k_, v_, cu_q, cu_k, max_q, max_k, causal=causal,
                                                     return_lse=True)
    grads = torch.autograd.grad(out, (q_, k_, v_), dout, allow_unused=True)
    # total_q = 0: autograd may skip the op's backward (nothing flows); the gradients are 0 then.
    dq, dk, dv = (torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))
    return out.detach(), lse, dq, dk, dv


def run_dense_per_sequence(q, k, v, cu_q, cu_k, causal, dout):
    """Each sequence alone through flash_attn_func (batch 1), assembled into the packed layout. A
    sequence without queries or keys gets the contract's values directly (out 0, lse +inf, zero
    gradients): there is no dense kernel call to compare with."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), device=q.device)
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        qb, kb, vb = _leaf(q[q0:q1][None]), _leaf(k[k0:k1][None]), _leaf(v[k0:k1][None])
        ob, lb = flash_attn_ext.flash_attn_func(qb, kb, vb, causal=causal, return_lse=True)
        gq, gk, gv = torch.autograd.grad(ob, (qb, kb, vb), dout[q0:q1][None])
        out[q0:q1], lse[:, q0:q1] = ob[0].detach(), lb[0]
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = gq[0], gk[0], gv[0]
    return out, lse, dq, dk, dv


NAMES = ("out", "softmax_lse", "dq", "dk", "dv")


def one_sequence(results, rows_q, rows_k):
    """(out, lse, dq, dk, dv) of one packed sequence: q rows rows_q (lse is (nheads, total_q)), k rows rows_k."""
    out, lse, dq, dk, dv = results
    return out[rows_q], lse[:, rows_q], dq[rows_q], dk[rows_k], dv[rows_k]


def assert_bitwise(ours, theirs, what):
    for name, a, b in zip(NAMES, ours, theirs):
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)} ({what})"
        assert not torch.isnan(a).any(), f"{name}: NaN (an element left unwritten?) ({what})"
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs()
            diff[torch.isnan(diff)] = 0  # inf - inf where both are +inf
            bad = (a != b).nonzero()
            raise AssertionError(f"{name} differs from {what}: {bad.shape[0]} elements, first at "
                                 f"{tuple(bad[0].tolist())}, max |diff| {diff.max().item():.3e}")


def check_reference(q, k, v, cu_q, cu_k, causal, dout, ours):
    """The accuracy rule (tests/accuracy.py) against the float64 reference, forward and backward."""
    qr, kr, vr = _leaf(q), _leaf(k), _leaf(v)
    ref, ref_lse = attention_varlen_ref(qr, kr, vr, cu_q, cu_k, None, causal, upcast=True)
    base, base_lse = attention_varlen_ref(qr, kr, vr, cu_q, cu_k, None, causal, upcast=False)
    out, lse, dq, dk, dv = ours
    check_accuracy("out", out, ref, base)
    check_accuracy("softmax_lse", lse, ref_lse, base_lse)
    ref_g = torch.autograd.grad(ref, (qr, kr, vr), dout.to(ref.dtype))
    base_g = torch.autograd.grad(base, (qr, kr, vr), dout)
    for name, g, rg, bg in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_g, base_g):
        check_accuracy(name, g, rg, bg)


def check_zero_length_contract(lens_q, lens_k, cu_q, cu_k, ours):
    out, lse, dq, dk, dv = ours
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nk == 0 and nq > 0:
            rows = slice(cq[b], cq[b + 1])
            assert torch.all(out[rows] == 0), f"sequence {b} has no key: out must be 0"
            assert torch.all(torch.isposinf(lse[:, rows])), f"sequence {b} has no key: lse must be +inf"
            assert torch.all(dq[rows] == 0), f"sequence {b} has no key: dq must be 0"
        if nq == 0 and nk > 0:
            rows = slice(ck[b], ck[b + 1])
            assert torch.all(dk[rows] == 0) and torch.all(dv[rows] == 0), f"sequence {b} has no query: dk = dv = 0"


def check_varlen_call(lens_q, lens_k, nheads, nheads_k, d, dtype, causal, max_q=None, max_k=None, scale_q=1.0,
                      reference=True):
    """The whole check of one packed call: bitwise vs the dense op per sequence, determinism,
    the zero-length contract and (reference=True) the accuracy rule."""
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, nheads, nheads_k, d, dtype, scale_q)
    max_q = max(lens_q, default=0) if max_q is None else max_q
    max_k = max(lens_k, default=0) if max_k is None else max_k
    dout = torch.randn_like(q)
    ours = run_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, dout)
    again = run_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, dout)
    assert_bitwise(again, ours, "an identical second call (determinism)")
    dense = run_dense_per_sequence(q, k, v, cu_q, cu_k, causal, dout)
    assert_bitwise(ours, dense, "flash_attn_func on each sequence alone")
    check_zero_length_contract(lens_q, lens_k, cu_q, cu_k, ours)
    if reference and q.shape[0] > 0:
        check_reference(q, k, v, cu_q, cu_k, causal, dout, ours)
    return ours


# (lens_q, lens_k): every row of q and k belongs to a sequence (rows outside every sequence are
# unspecified on CUDA, so poisoned outputs could not be checked there).
LENGTHS = {
    "mixed_small": ([5, 17, 64, 1], [5, 17, 64, 1]),
    "ragged_tiles": ([200, 37, 129, 64, 255], [200, 37, 129, 64, 255]),
    "q_ne_k": ([3, 300, 9, 150], [170, 12, 9, 400]),  # both ways; causal rows that see no key
    "zero_length": ([0, 40, 0, 33, 7, 130], [4, 0, 0, 33, 90, 0]),  # q and/or k empty
    "one_long": ([1000], [1000]),
    "no_query": ([0, 0], [16, 5]),  # total_q = 0: dk = dv = 0
}


@pytest.mark.parametrize("case", list(LENGTHS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads,nheads_k", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_equals_dense_per_sequence(case, causal, nheads, nheads_k, dtype, poison_empty):
    require_hdim(128, exact=True)
    lens_q, lens_k = LENGTHS[case]
    check_varlen_call(lens_q, lens_k, nheads, nheads_k, 128, dtype, causal)


def test_varlen_sequence_past_the_long_key_bound(poison_empty):
    """The documented exception to bit-for-bit equality: a packed sequence with >= 8192 keys,
    non-causal, d128. Alone, flash_attn_func takes the sm90 long-key row (144-key tiles,
    csrc/kernels/sm90/tile_config.h: fwd_long_keys), the packed call 128-key tiles, so that
    sequence's sums round differently: both within the accuracy rule. The other sequence of the
    call is bit for bit, and the packed call deterministic."""
    require_hdim(128, exact=True)
    lens_q, lens_k = [200, 64], [8200, 300]
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, 4, 2, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    ours = run_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), False, dout)
    assert_bitwise(run_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), False, dout), ours,
                   "an identical second call (determinism)")
    check_reference(q, k, v, cu_q, cu_k, False, dout, ours)
    dense = run_dense_per_sequence(q, k, v, cu_q, cu_k, False, dout)
    # the short sequence (rows 200:264 of q, 8200:8500 of k / v): the same kernels, the same bits
    rows_q, rows_k = slice(200, 264), slice(8200, 8500)
    assert_bitwise(one_sequence(ours, rows_q, rows_k), one_sequence(dense, rows_q, rows_k),
                   "flash_attn_func on the short sequence alone")
    # the long one alone: within the rule against the same reference (its own kernels' rounding)
    check_reference(q, k, v, cu_q, cu_k, False, dout, dense)


@pytest.mark.parametrize("max_q", [2048, 2049])
@pytest.mark.parametrize("d", [128, 256])
def test_varlen_causal_at_the_short_row_bound(d, max_q, poison_empty):
    """The short causal row's bound (sm90 d128 / d256, tile_config.h: fwd_short_causal, by
    max_seqlen_q): with max_seqlen_q <= 2048 the packed call and each sequence alone run 64-key
    tiles, bit for bit; one past it the packed call runs FwdTile's (128 / 80 keys) and its sequences
    of <= 2048 queries alone still 64-key ones: the documented exception, within the accuracy rule."""
    require_hdim(d, exact=True)
    lens = [max_q, 300]
    q, k, v, cu_q, cu_k = _inputs(lens, lens, 4, 2, d, torch.bfloat16)
    dout = torch.randn_like(q)
    ours = run_varlen(q, k, v, cu_q, cu_k, max_q, max_q, True, dout)
    check_reference(q, k, v, cu_q, cu_k, True, dout, ours)
    dense = run_dense_per_sequence(q, k, v, cu_q, cu_k, True, dout)
    if max_q <= 2048 or os.environ.get("FLASH_ATTN_EXT_SM90_FWD_SHORT_CAUSAL") == "0":
        assert_bitwise(ours, dense, "flash_attn_func on each sequence alone")
    else:  # the first sequence (2049 queries) alone: the packed call's row, the same bits
        rows = slice(0, max_q)
        assert_bitwise(one_sequence(ours, rows, rows), one_sequence(dense, rows, rows),
                       "flash_attn_func on the 2049-query sequence alone")
        check_reference(q, k, v, cu_q, cu_k, True, dout, dense)


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_head_dims(d, causal, dtype, poison_empty):
    require_hdim(d, exact=True)
    check_varlen_call([70, 0, 129, 1, 64], [33, 12, 200, 0, 64], 8, 2, d, dtype, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_max_seqlen_larger_than_needed(causal, d, poison_empty):
    """Grids sized by max_seqlen: the extra Q tiles / key blocks of every sequence return at once
    (no store); the result is the exact-max call's, bit for bit."""
    require_hdim(d, exact=True)
    lens_q, lens_k = [37, 130, 0, 64], [90, 5, 20, 64]
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, 4, 2, d, torch.bfloat16)
    dout = torch.randn_like(q)
    exact = run_varlen(q, k, v, cu_q, cu_k, 130, 90, causal, dout)
    larger = run_varlen(q, k, v, cu_q, cu_k, 130 + 333, 90 + 517, causal, dout)
    assert_bitwise(larger, exact, "the call with max_seqlen = the longest sequence")
    dense = run_dense_per_sequence(q, k, v, cu_q, cu_k, causal, dout)
    assert_bitwise(larger, dense, "flash_attn_func on each sequence alone")


def test_varlen_all_keys_empty(poison_empty):
    """total_k = 0: every row sees no key (out 0, lse +inf, softmax_stats (+inf, 0), dq 0)."""
    q, k, v, cu_q, cu_k = _inputs([7, 3], [0, 0], 4, 4, 64, torch.float16)
    out, lse, stats = torch.ops.flash_attn_ext.varlen_forward(q, k, v, cu_q, cu_k, 7, 0, 0.125, False)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))
    assert torch.all(torch.isposinf(stats[0])) and torch.all(stats[1] == 0)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_stats_of_rows_without_keys(causal, poison_empty):
    """The raw op's softmax_stats: (+inf, 0) for the rows of a sequence without keys (and, causal,
    for rows before the bottom-right diagonal), the LSE's two parts elsewhere."""
    require_hdim(64, exact=True)
    lens_q, lens_k = [9, 20, 4], [0, 6, 11]
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, 4, 4, 64, torch.bfloat16)
    out, lse, stats = torch.ops.flash_attn_ext.varlen_forward(q, k, v, cu_q, cu_k, 20, 11, 0.125, causal)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any() and not torch.isnan(stats).any()
    empty = torch.isposinf(lse)
    assert torch.all(empty[:, :9]), "sequence 0 has no key"
    assert torch.equal(torch.isposinf(stats[0]), empty) and torch.all(stats[1][empty] == 0)
    assert torch.all(out[:9] == 0)
    ok = ~empty
    torch.testing.assert_close((stats[0] + stats[1])[ok].double(), lse[ok].double() * 1.4426950408889634,
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("max_larger", [False, True])
def test_varlen_many_sequences(causal, max_larger, poison_empty):
    """300 sequences (more than any GPU's SM count: the sm90 persistent grid walks many units per
    CTA and skips empty tiles in step), lengths 0..70 drawn independently for q and k."""
    require_hdim(64, exact=True)
    rng = random.Random(14)
    lens_q = [rng.choice([0, 1, 2, 15, 16, 17, 63, 64, 65, 70]) for _ in range(300)]
    lens_k = [rng.choice([0, 1, 5, 31, 32, 33, 64, 70]) for _ in range(300)]
    max_q = max(lens_q) + (200 if max_larger else 0)
    max_k = max(lens_k) + (100 if max_larger else 0)
    check_varlen_call(lens_q, lens_k, 8, 2, 64, torch.float16, causal, max_q, max_k)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_large_magnitude(causal, poison_empty):
    """Scores with |max * scale * log2(e)| >= 2^10 take the exact softmax form (forward) and the
    exact P recompute (backward, precise_rows); the form is chosen per warp, over rows that include
    rows past a sequence's end: still the dense op's result, bit for bit."""
    require_hdim(128, exact=True)
    check_varlen_call([40, 129, 7], [60, 129, 200], 4, 4, 128, torch.bfloat16, causal, scale_q=300.0,
                      reference=False)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_issue_shape_16k_tokens_64_sequences(causal, poison_empty):
    """The issue's shape: 16,384 tokens in 64 sequences of 128..1024 (self-attention), hd128 bf16,
    GQA 16:4."""
    require_hdim(128, exact=True)
    rng = random.Random(1414)
    lens = [128] * 64
    lens[0] = 1024
    extra = 16384 - sum(lens)
    while extra > 0:
        i = rng.randrange(1, 64)
        step = min(extra, rng.choice([1, 7, 64, 128]), 1024 - lens[i])
        lens[i] += step
        extra -= step
    assert sum(lens) == 16384 and min(lens) >= 128 and max(lens) == 1024
    check_varlen_call(lens, lens, 16, 4, 128, torch.bfloat16, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_varlen_nan_past_the_last_sequence(causal, d, poison_empty):
    """Rows of q, dout, k and v that belong to no sequence's work hold NaN: past cu_seqlens_q[-1] /
    cu_seqlens_k[-1] (packed buffers larger than their sequences), and the q / dout rows of a
    sequence without keys, the k / v rows of a sequence without queries (between two sequences
    with work). The tiles of the sequence before them reach into them (the sm90 kernels load whole
    TMA boxes), where P = 0 met V = NaN in P V (forward), dO = NaN in dV += P^T dO and Q = NaN in
    dK += dS^T Q (dK/dV kernel), K, V = NaN in dQ += dS K (dQ kernel) until those rows were zeroed.
    Finite rows there give the same bits either way (P = 0 and dS = 0 times finite), so only NaN
    tests the zeroing: output and gradients must equal the dense op on each sequence alone, bit
    for bit, at every sm90 head dim (the rows and the roles kernels, d96's padded columns)."""
    require_hdim(d)
    dtype = torch.bfloat16
    # sequence 1 has no keys (its q / dout rows NaN), sequence 3 no queries (its k / v rows NaN)
    lens_q, lens_k = [200, 37, 130, 0, 70], [200, 0, 130, 45, 70]
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, 4, 2, d, dtype)
    dout = torch.randn_like(q)
    nan = float("nan")
    cq, ck = cu_q.tolist(), cu_k.tolist()
    q_nan, dout_nan, k_nan, v_nan = q.clone(), dout.clone(), k.clone(), v.clone()
    q_nan[cq[1]:cq[2]], dout_nan[cq[1]:cq[2]] = nan, nan
    k_nan[ck[3]:ck[4]], v_nan[ck[3]:ck[4]] = nan, nan
    q_pad, dout_pad = _nan_padded(q_nan, q.shape[0] + 100), _nan_padded(dout_nan, q.shape[0] + 100)
    k_pad, v_pad = _nan_padded(k_nan, k.shape[0] + 100), _nan_padded(v_nan, k.shape[0] + 100)
    out, lse, dq, dk, dv = run_varlen(q_pad, k_pad, v_pad, cu_q, cu_k, max(lens_q), max(lens_k), causal, dout_pad)
    n, nq = k.shape[0], q.shape[0]
    dense = run_dense_per_sequence(q, k, v, cu_q, cu_k, causal, dout)
    assert_bitwise((out[:nq], lse[:, :nq], dq[:nq], dk[:n], dv[:n]), dense, "flash_attn_func on each sequence alone")


def _sm90_backward_kernel_names(fn):
    """Names of the sm90 dK/dV and dQ kernels fn() launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "sm90" in e.name and ("flash_bwd_dkv" in e.name or "flash_bwd_dq" in e.name)]


@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen_backward_loads_by_tma(d, arch_path, poison_empty):
    """On the sm90 path the varlen backward's dK/dV and dQ kernels stream their tiles by TMA (the
    packed tensors as one batch; kernels/sm90/smem_layout.cuh: launch_bwd_stages, zero_stage_tail),
    the instantiation whose template argument kTma (the fourth) is true and kLocal (the fifth: a
    sliding window's twin) false, the twins after it (soft-capping) whatever they are; the rows past
    each sequence's end are zeroed so the result is the dense op's per sequence, bit for bit."""
    require_hdim(d, exact=True)
    if arch_path != "auto" or torch.cuda.get_device_capability() != (9, 0) or \
            "90a" not in str(flash_attn_ext.build_info().get("cuda_archs", "")):
        pytest.skip("the sm90 backward kernels run on the default path of an sm_90a build only")
    if os.environ.get("FLASH_ATTN_EXT_SM90_BWD_TMA") == "0":
        pytest.skip("FLASH_ATTN_EXT_SM90_BWD_TMA=0: the sm90 backward copies by cp.async")
    lens_q, lens_k = [70, 129, 1, 300], [33, 200, 64, 301]
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, 8, 2, d, torch.bfloat16)
    dout = torch.randn_like(q)
    ours = []
    names = _sm90_backward_kernel_names(
        lambda: ours.extend(run_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), True, dout)))
    tma = lambda n: re.search(r"Tile<\d+>,\s*true,\s*false[,>]", n) is not None or "Lb1ELb0E" in n  # noqa: E731 (demangled or not)
    assert len(names) == 2 and all(tma(n) for n in names), names
    dense = run_dense_per_sequence(q, k, v, cu_q, cu_k, True, dout)
    assert_bitwise(tuple(ours), dense, "flash_attn_func on each sequence alone")


def _kernel_grids(fn, tmp_path):
    """{kernel name: [grid x of each launch]} of the CUDA kernels fn() launches (the profiler's
    chrome trace, whose kernel events carry their launch grid)."""
    import json

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    grids = {}
    for e in json.loads(path.read_text())["traceEvents"]:
        if e.get("cat") == "kernel" and "grid" in e.get("args", {}):
            grids.setdefault(e["name"], []).append(e["args"]["grid"][0])
    return grids


# Skewed lengths (a few long sequences, many short or empty): most tiles of a grid sized by
# max_seqlen would start past their sequence's end, so the kernels run on a tight grid of the real
# tiles (kernels/common/work.cuh: varlen_tight_grid, varlen_dense_index).
TIGHT_LENS = ([900, 3, 17, 0, 130, 1, 64, 255, 2, 700], [700, 40, 0, 9, 130, 1, 200, 255, 5, 900])


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_tight_grid(d, causal, arch_path, poison_empty, tmp_path):
    """On a tight grid every CTA finds its (sequence, tile) by a prefix sum over cu_seqlens: the
    result is the dense op's per sequence, bit for bit, and the kernels' grids do not grow with
    max_seqlen (a call with 2x the longest sequence launches the same grids and gives the same
    bits; 2 x 900 queries stay within the sm90 d128 / d256 short causal row's bound, 2048, which
    max_seqlen_q selects: tile_config.h, fwd_short_causal). The sm80 forward keeps the grid of
    max_seqlen (its registers): its grids are not compared."""
    require_hdim(d, exact=True)
    lens_q, lens_k = TIGHT_LENS
    check_varlen_call(lens_q, lens_k, 8, 2, d, torch.bfloat16, causal)
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, 8, 2, d, torch.bfloat16)
    dout = torch.randn_like(q)
    results, grids = [], []
    for m in (1, 2):
        grids.append(_kernel_grids(lambda m=m: results.append(
            run_varlen(q, k, v, cu_q, cu_k, m * max(lens_q), m * max(lens_k), causal, dout)), tmp_path))
    assert_bitwise(results[1], results[0], "the call with max_seqlen = the longest sequence")
    if os.environ.get("FLASH_ATTN_EXT_VARLEN_TIGHT_GRID") == "0":
        return  # the knob keeps the grids of max_seqlen: only the bits above are compared
    # The sm90 forward (flash::sm90::flash_fwd_kernel; not the sm80 forward's sm_90 row, whose
    # name carries sm90::Sm80FwdTile and whose grid stays that of max_seqlen) and the backward's
    # three kernels (preprocess, dK/dV, dQ).
    tight = lambda n: ("sm90::flash_fwd_kernel<" in n or "flash_bwd_dkv" in n or "flash_bwd_dq" in n  # noqa: E731
                       or "flash_bwd_preprocess" in n)
    names = [n for n in grids[0] if tight(n)]
    assert names, list(grids[0])
    for n in names:
        assert grids[0][n] == grids[1].get(n), (n, grids[0][n], grids[1].get(n))


# ---- The sm90 forward's dynamic walk (kernels/common/tile_scheduler.cuh: dynamic): on compute
# capability 9.0 a varlen forward runs a grid of at most one CTA per SM whose CTAs claim the tiles
# (a tight grid's, or every tile of max_seqlen_q rows) from a counter the call zeroes (flash.h:
# tile_counter); the producer warp finds each tile and hands its index to the consumers on a pair
# of named barriers.

def _sm90_forward_runs(arch_path) -> bool:
    return (arch_path == "auto" and torch.cuda.get_device_capability() == (9, 0)
            and "90a" in flash_attn_ext.build_info().get("cuda_archs", ""))


_SCHEDULE_SCRIPT = r"""
import sys, torch, flash_attn_ext
q, k, v, cu_q, cu_k, max_q, max_k, causal = torch.load(sys.argv[1])
out, lse = flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True)
torch.save((out, lse), sys.argv[2])
"""


def _checked_call_args(lens_q, lens_k, nheads, nheads_k, d, causal):
    """check_varlen_call on these lengths (bf16), then the arguments of one varlen forward call
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal) on fresh inputs."""
    check_varlen_call(lens_q, lens_k, nheads, nheads_k, d, torch.bfloat16, causal)
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, nheads, nheads_k, d, torch.bfloat16)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal


def _varlen_in_subprocess(args, tmp_path, **env_vars):
    """(out, lse) of flash_attn_varlen_func(*args) in a fresh process with env_vars set (the
    knobs are read once per process)."""
    torch.save(args, tmp_path / "in.pt")
    env = dict(os.environ, **env_vars)
    r = subprocess.run([sys.executable, "-c", _SCHEDULE_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return torch.load(tmp_path / "out.pt")


# 40 sequences of 321 rows and three short ones (q, k lengths): no tight grid, the walk over every
# tile of max_seqlen_q rows with the past-end ones skipped.
_NEAR_EQUAL_321 = ([321] * 40 + [30, 1, 0], [321] * 40 + [100, 5, 7])


def _mixed_lengths(seed, n):
    rng = random.Random(seed)
    pick = [0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 300, 513, 1024]
    return [rng.choice(pick) for _ in range(n)], [rng.choice(pick) for _ in range(n)]


# Full packs: total rows = batch x max_seqlen, q and k alike. The sm90 forward runs them on the
# static persistent walk, the dense op's (csrc/kernels/dispatch.cu: sm90_fwd_schedule),
# whose round-robin also deals the tiles past a shorter sequence's end (skipped by the producer
# and the consumers alike). The rows past cu_seqlens[-1] are unused (NaN in the test).
FULL_PACKS = {
    "equal": ([256] * 12, [256] * 12),  # every sequence max_seqlen long
    # 6 x 300 rows each side: sequences of every length below max_seqlen, one without keys, one
    # without queries
    "rows_unused": ([300, 120, 0, 77, 300, 5], [300, 41, 300, 0, 9, 290]),
    # 43 x 321 rows: many units per CTA, real tiles and past-end ones (the three short sequences'
    # tiles of max_seqlen_q rows) interleaved in the round-robin
    "near_equal_321": _NEAR_EQUAL_321,
    # 6 x 1024: causal d64 (192-row tiles, 48 (sequence, head)s, 144 paired units on 132 SMs)
    # takes the split tail; one sequence 24 queries short, its rows unused
    "split_tail": ([1024, 1024, 1000, 1024, 1024, 1024], [1024] * 6),
}


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(FULL_PACKS))
def test_varlen_full_pack(d, causal, case, arch_path, poison_empty, tmp_path):
    """A full pack (the static walk on sm90; the sm80 path as any varlen call): forward and
    backward equal the dense op on each sequence alone, bit for bit, and the accuracy rule; the
    unused rows past cu_seqlens_q[-1] / cu_seqlens_k[-1] hold NaN (q, dout, k, v) and reach no
    sequence's result. On sm90 the forward also equals the dynamic walk's bits (d128:
    FLASH_ATTN_EXT_SM90_FWD_SCHEDULE=dynamic, a subprocess): both walks run every tile alike. The
    cases reach the static walk's light units (non-causal d64 / d96 at 256 rows: a partial last
    tile of one 64-row warpgroup), paired causal tiles, the split tail (causal d64 split_tail) and
    past-end tiles between real ones on one CTA."""
    require_hdim(d, exact=True)
    lens_q, lens_k = FULL_PACKS[case]
    max_q, max_k = max(lens_q), max(lens_k)
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, 8, 2, d, torch.bfloat16)
    dout = torch.randn_like(q)
    total_q, total_k = len(lens_q) * max_q, len(lens_k) * max_k
    q_pad, k_pad, v_pad = _nan_padded(q, total_q), _nan_padded(k, total_k), _nan_padded(v, total_k)
    ours = run_varlen(q_pad, k_pad, v_pad, cu_q, cu_k, max_q, max_k, causal, _nan_padded(dout, total_q))
    ours = one_sequence(ours, slice(0, q.shape[0]), slice(0, k.shape[0]))
    assert_bitwise(ours, run_dense_per_sequence(q, k, v, cu_q, cu_k, causal, dout),
                   "flash_attn_func on each sequence alone")
    check_zero_length_contract(lens_q, lens_k, cu_q, cu_k, ours)
    check_reference(q, k, v, cu_q, cu_k, causal, dout, ours)
    if _sm90_forward_runs(arch_path) and d == 128:
        out_dyn, lse_dyn = _varlen_in_subprocess((q_pad, k_pad, v_pad, cu_q, cu_k, max_q, max_k, causal), tmp_path,
                                                 FLASH_ATTN_EXT_SM90_FWD_SCHEDULE="dynamic")
        nq = q.shape[0]
        assert torch.equal(ours[0], out_dyn[:nq]) and torch.equal(ours[1], lse_dyn[:, :nq]), "static vs dynamic walk"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", ["mixed", "ascending", "near_equal"])
def test_varlen_dynamic_walk(d, causal, lengths, arch_path, poison_empty, tmp_path):
    """Far more tiles than SMs, so each CTA of the dynamic walk claims many, 16 query heads over 4
    kv heads. mixed: 80 sequences (empty ones, 1 row, tile edges, up to 1024; q and k drawn apart),
    a tight grid's units, which the walk deals longest sequences first (by keys, in four buckets:
    common/work.cuh, varlen_lpt_index). ascending: 70 sequences, shortest first, every third
    one's keys half its queries (the buckets reorder nearly all of them; keys and queries bucket
    apart). near_equal: 40 sequences of 300 rows and three shorter ones (1, 0, 130):
    no tight grid (it would not halve the dense one), so the walk claims every (sequence, head) tile
    of max_seqlen_q rows and skips those past a sequence's end. Bit for bit the dense op per
    sequence (check_varlen_call: the accuracy rule too) and the same bits as one CTA per tile
    (FLASH_ATTN_EXT_SM90_FWD_SCHEDULE=tile, a subprocess); the forward's grid is the SM count."""
    if not _sm90_forward_runs(arch_path):
        pytest.skip("the dynamic walk is the sm90 forward's (compute capability 9.0, a build with sm_90a)")
    require_hdim(d, exact=True)
    if lengths == "mixed":
        lens_q, lens_k = _mixed_lengths(d + causal, 80)
    elif lengths == "ascending":
        lens_q = sorted(_mixed_lengths(d + causal, 70)[0])
        lens_k = [n // 2 if i % 3 == 0 else n for i, n in enumerate(lens_q)]
    else:
        lens_q, lens_k = [300] * 40 + [1, 0, 130], [300] * 40 + [5, 200, 0]
    args = _checked_call_args(lens_q, lens_k, 16, 4, d, causal)
    out_tile, lse_tile = _varlen_in_subprocess(args, tmp_path, FLASH_ATTN_EXT_SM90_FWD_SCHEDULE="tile")
    results = []
    grids = _kernel_grids(lambda: results.append(flash_attn_ext.flash_attn_varlen_func(
        *args[:7], causal=causal, return_lse=True)), tmp_path)
    out, lse = results[0]
    assert torch.equal(out, out_tile) and torch.equal(lse, lse_tile), "dynamic walk vs one CTA per tile"
    if os.environ.get("FLASH_ATTN_EXT_SM90_FWD_SCHEDULE", "auto") == "auto":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        fwd = [g for n, g in grids.items() if "sm90::flash_fwd_kernel<" in n]
        assert fwd == [[sms]], (fwd, sms)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("lengths", ["edges", "near_equal"])
def test_varlen_causal_partial_tiles_at_the_top(d, lengths, arch_path, poison_empty, tmp_path):
    """Causal varlen calls put each sequence's partial Q tile at its top (common/work.cuh:
    QTileWork::kShiftPerSequence; d64 / d128 / d256 take 192 / 192 / 128-row tiles here). edges:
    every size of partial tile, shifted by 0, 64 or 128 rows, the first sequence's tiles starting
    above row 0 of the packed tensor, keys as many as queries, more, fewer or none (a tight grid's
    walk). near_equal: 40 sequences of 321 rows and three short ones, no tight grid (the walk over
    every tile of max_seqlen_q rows, the past-end ones skipped). Bit for bit the dense op per
    sequence and the same bits as with the shift off (FLASH_ATTN_EXT_SM90_FWD_TOP_SHIFT=0, a
    subprocess): whole 64-row warpgroups move between tiles, each with its own key blocks."""
    if not _sm90_forward_runs(arch_path):
        pytest.skip("the shift is the sm90 forward's (compute capability 9.0, a build with sm_90a)")
    require_hdim(d, exact=True)
    if lengths == "edges":
        lens_q = [30, 1, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 320, 383, 384, 385, 1000, 1024, 0, 200]
        lens_k = [n + (7 * i) % 3 - (i % 4 == 3) * (n // 2) for i, n in enumerate(lens_q)]
        lens_k[-1] = 0  # a sequence of queries without keys
    else:
        lens_q, lens_k = _NEAR_EQUAL_321
    args = _checked_call_args(lens_q, lens_k, 8, 2, d, True)
    out_off, lse_off = _varlen_in_subprocess(args, tmp_path, FLASH_ATTN_EXT_SM90_FWD_TOP_SHIFT="0")
    out, lse = flash_attn_ext.flash_attn_varlen_func(*args[:7], causal=True, return_lse=True)
    assert torch.equal(out, out_off) and torch.equal(lse, lse_off), "partial tiles at the top vs at the bottom"


def test_varlen_dynamic_walk_counter_reused(arch_path, poison_empty):
    """The walk's counter is the stream's, reused by its calls (each launch leaves it zero): calls
    of every walk (a tight grid's units; every tile of max_seqlen_q rows, past-end ones skipped;
    fewer units than SMs) back to back on one stream, twice over, give the bits each gave first
    on a stream of its own (another counter). A stale counter would skip units: rows left as the
    poisoned allocation had them (NaN)."""
    if not _sm90_forward_runs(arch_path):
        pytest.skip("the dynamic walk is the sm90 forward's (compute capability 9.0, a build with sm_90a)")
    d = 128
    require_hdim(d, exact=True)
    shapes = [_mixed_lengths(3, 64), _NEAR_EQUAL_321, ([200, 17], [90, 300])]
    calls = [(_inputs(lq, lk, 8, 2, d, torch.bfloat16), max(lq), max(lk)) for lq, lk in shapes]
    run = lambda c, causal: flash_attn_ext.flash_attn_varlen_func(*c[0], c[1], c[2], causal=causal)  # noqa: E731
    first = {}
    for i, c in enumerate(calls):
        for causal in (False, True):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())  # the inputs
            with torch.cuda.stream(side):
                first[i, causal] = run(c, causal)
            torch.cuda.synchronize()
    for _ in range(2):
        for i, c in enumerate(calls):
            for causal in (False, True):
                assert torch.equal(run(c, causal), first[i, causal]), f"call {i}, causal={causal}, on a used stream"


def test_varlen_compile_reduce_overhead(arch_path):
    """torch.compile(mode="reduce-overhead") of a varlen call: its warm-up runs eagerly on a stream
    of its own with allocations going to the CUDA graph's private pool (the stream's counter must
    not: torch's checks after the warm-up find a tensor left in the pool, and a reset of the pool
    would free it under the cache), then captures and replays. Every result, on two inputs, is the
    eager call's bits."""
    if not _sm90_forward_runs(arch_path):
        pytest.skip("the dynamic walk is the sm90 forward's (compute capability 9.0, a build with sm_90a)")
    d = 128
    require_hdim(d, exact=True)
    torch._dynamo.reset()
    lens_q, lens_k = _mixed_lengths(5, 48)
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, 8, 2, d, torch.bfloat16)
    f = lambda q, k, v: flash_attn_ext.flash_attn_varlen_func(  # noqa: E731
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    compiled = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for q_i in (q, torch.randn_like(q)):
            eager = f(q_i, k, v)
            for _ in range(4):  # warm-up, capture, replays
                assert torch.equal(compiled(q_i, k, v).clone(), eager)


def test_varlen_dynamic_walk_streams_and_graph(arch_path):
    """Two calls on two streams at once (a counter each), and a CUDA graph of the call replayed on
    new inputs (a fresh counter, zeroed by a node of the graph), give the eager bits."""
    if not _sm90_forward_runs(arch_path):
        pytest.skip("the dynamic walk is the sm90 forward's (compute capability 9.0, a build with sm_90a)")
    d = 128
    require_hdim(d, exact=True)
    lens_q, lens_k = _mixed_lengths(7, 64)
    calls = [_inputs(lens_q, lens_k, 16, 4, d, torch.bfloat16) for _ in range(3)]
    run = lambda c: flash_attn_ext.flash_attn_varlen_func(*c, max(lens_q), max(lens_k), causal=True)  # noqa: E731
    eager = [run(c) for c in calls]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    outs = []
    for s, c in zip(streams, calls[:2]):
        with torch.cuda.stream(s):
            outs.append(run(c))
    torch.cuda.synchronize()
    for o, e in zip(outs, eager[:2]):
        assert torch.equal(o, e), "a call on a second stream at once"
    static = [t.clone() for t in calls[0]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = run(static)
    for c, e in zip(calls, eager):
        for dst, src in zip(static, c):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out, e), "a replay of the captured call"
