"""GPU tests of the CUDA forward kernels (csrc/kernels/sm80/flash_fwd_kernel.cuh and, on sm_90,
csrc/kernels/sm90/flash_fwd_kernel.cuh; FlashAttention-2 Algorithm 1) through
``torch.ops.flash_attn_ext.forward``, every test on each arch path the GPU can take (fwd_path).

Criterion (tests/accuracy.py): max|ours - ref| <= 2 * max|baseline - ref| for out and softmax_lse,
ref = flash_attn_ext.reference.attention_ref(upcast=True) (float64), baseline = the same math in the
inputs' dtype (upcast=False). Every output buffer is poisoned with NaN before the op writes it.

Issue 3 "Must show" grid: {fp16, bf16} x headdim {32, 64, 96, 128, 192, 256, padded 80} x causal x
seqlen_q, seqlen_k in {1, 17, 128, 255, 1000, 2048} (unequal pairs included) x GQA {1:1, 4:1} x
non-contiguous views; batch*heads = 70,000; a k/v tensor of more than 2^31 elements.
The cartesian product is covered by slices that keep the whole file at ~1-2 minutes on an H200:
every (hdim, dtype, causal, GQA) on a core set of seqlen pairs, every seqlen pair on hdim 128 and
hdim 64.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

import flash_attn_ext
from conftest import require_hdim
from accuracy import check_accuracy
from flash_attn_ext.reference import attention_ref
from long_keys import chunked_ref, inputs_past_2pow31, key_chunk, long_key_inputs, require_free_gib

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA forward kernel tests need a CUDA GPU (none visible)"
)

SEQLENS = [1, 17, 128, 255, 1000, 2048]
ALL_PAIRS = [(sq, sk) for sq in SEQLENS for sk in SEQLENS]
# Equal, unequal both ways, 1-row and 1-key edges, ragged (not multiples of any tile), causal
# rows that see no key (seqlen_q > seqlen_k).
CORE_PAIRS = [(1, 1), (17, 1000), (255, 128), (128, 255), (1000, 17), (2048, 2048)]
HDIMS = [32, 64, 80, 96, 128, 192, 256]  # 80 runs on the 96 kernel, zero-padded
DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def fwd_path(arch_path):
    """Runs every test on each arch path the GPU can take (conftest.py: arch_path): on an H200 the
    sm90 TMA/wgmma forward ("auto") and the sm80 mma.sync forward."""
    return arch_path


def _poison_allocator(nbytes_list, device="cuda"):
    """Leave NaN garbage in the CUDA caching allocator: the blocks the op allocates next (out,
    softmax_lse) are likely to be these bytes, so an element the kernel forgets to write reads NaN."""
    bufs = [torch.full((n // 4 + 1,), float("nan"), dtype=torch.float32, device=device) for n in nbytes_list]
    del bufs


class _nan_filled_empty:
    """Inside: torch.empty / at::empty (also in the extension) return NaN-filled float tensors."""

    def __enter__(self):
        self.old = (torch.are_deterministic_algorithms_enabled(),
                    torch.utils.deterministic.fill_uninitialized_memory)
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.old[0])
        torch.utils.deterministic.fill_uninitialized_memory = self.old[1]


def fwd_poisoned(q, k, v, softmax_scale, causal):
    """Run the op twice with poisoned outputs (NaN garbage left in the caching allocator, then
    NaN-filled empty): both results must be NaN-free and agree bit-for-bit (deterministic)."""
    sizes = [q.numel() * q.element_size(), q.shape[0] * q.shape[2] * q.shape[1] * 4]
    _poison_allocator(sizes)
    o1, l1, s1 = torch.ops.flash_attn_ext.forward(q, k, v, softmax_scale, causal)
    with _nan_filled_empty():
        o2, l2, s2 = torch.ops.flash_attn_ext.forward(q, k, v, softmax_scale, causal)
    for o, l, st in ((o1, l1, s1), (o2, l2, s2)):
        assert not torch.isnan(o).any(), "out: NaN (an element was left unwritten or overflowed)"
        assert not torch.isnan(l).any(), "softmax_lse: NaN (a row was left unwritten)"
        assert not torch.isnan(st).any(), "softmax_stats: NaN (a row was left unwritten)"
    assert torch.equal(o1, o2), "out differs between two identical calls"
    assert torch.equal(l1, l2) and torch.equal(s1, s2), "softmax_lse / softmax_stats differ between two identical calls"
    # softmax_stats = (max, log2sum): LSE * log2(e) = max + log2sum; rows without keys (+inf, 0).
    empty = torch.isposinf(l1)
    assert torch.equal(torch.isposinf(s1[0]), empty) and torch.all(s1[1][empty] == 0)
    lse2 = (s1[0] + s1[1])[~empty].double()
    assert torch.allclose(lse2, l1[~empty].double() * math.log2(math.e), rtol=1e-5, atol=1e-4)
    return o1, l1, s1


def check_forward(q, k, v, causal, softmax_scale=None):
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse, stats = fwd_poisoned(q, k, v, softmax_scale, causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    ref_out, ref_lse = attention_ref(q, k, v, softmax_scale, causal, upcast=True)
    base_out, base_lse = attention_ref(q, k, v, softmax_scale, causal, upcast=False)
    check_accuracy("out", out, ref_out, base_out)
    check_accuracy("softmax_lse", lse, ref_lse, base_lse)
    if causal and q.shape[1] > k.shape[1]:
        # Rows that see no key (bottom-right alignment): exactly 0 and +inf.
        n_empty = q.shape[1] - k.shape[1]
        assert torch.all(out[:, :n_empty] == 0)
        assert torch.all(torch.isposinf(lse[:, :, :n_empty]))
    return out, lse, stats


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, d, dtype):
    def rnd(*shape):
        return torch.randn(*shape, dtype=dtype, device="cuda")

    return rnd(batch, seqlen_q, nheads, d), rnd(batch, seqlen_k, nheads_k, d), rnd(batch, seqlen_k, nheads_k, d)


def _shape_for(seqlen_q, seqlen_k):
    # Small batch/heads, smaller still for the largest problems (the fp64 reference dominates).
    big = seqlen_q * seqlen_k >= 1000 * 1000
    return (1, 4) if big else (2, 4)


@pytest.mark.parametrize("gqa", [1, 4], ids=["mha", "gqa4"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", CORE_PAIRS)
@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_forward_hdim_grid(dtype, d, seqlen_q, seqlen_k, causal, gqa):
    require_hdim(d)
    batch, nheads = _shape_for(seqlen_q, seqlen_k)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads // gqa, d, dtype)
    check_forward(q, k, v, causal)


@pytest.mark.parametrize("gqa", [1, 4], ids=["mha", "gqa4"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", ALL_PAIRS)
@pytest.mark.parametrize("d,dtype", [(128, torch.bfloat16), (64, torch.float16)], ids=["d128-bf16", "d64-fp16"])
def test_forward_seqlen_grid(d, dtype, seqlen_q, seqlen_k, causal, gqa):
    require_hdim(d)
    batch, nheads = _shape_for(seqlen_q, seqlen_k)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads // gqa, d, dtype)
    check_forward(q, k, v, causal)


@pytest.mark.parametrize("d", [8, 40, 72, 136, 200, 248])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_padded_headdims(d, causal):
    """Head dims between instantiations run on the next one, zero-padded inside the kernel."""
    require_hdim(d)
    q, k, v = make_qkv(2, 255, 300, 4, 2, d, torch.bfloat16)
    check_forward(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_forward_noncontiguous_views(dtype, causal):
    require_hdim(64)
    b, s, h, d = 2, 300, 4, 64
    # BHSD tensors viewed as BSHD (torch-style layout transposed).
    q = torch.randn(b, h, s, d, dtype=dtype, device="cuda").transpose(1, 2)
    k = torch.randn(b, h, s + 17, d, dtype=dtype, device="cuda").transpose(1, 2)
    v = torch.randn(b, h, s + 17, d, dtype=dtype, device="cuda").transpose(1, 2)
    assert not q.is_contiguous()
    check_forward(q, k, v, causal)
    # Slices of a fused qkv projection output (b, s, 3, h, d).
    qkv = torch.randn(b, s, 3, h, d, dtype=dtype, device="cuda")
    q, k, v = qkv.unbind(2)
    check_forward(q, k, v, causal)
    # Head-dim slice of a wider tensor: row stride larger than the head dim.
    wide = torch.randn(b, s, h, 2 * d, dtype=dtype, device="cuda")
    check_forward(wide[..., :d], k, v, causal)
    # GQA with K/V heads broadcast by a zero batch stride.
    kb = torch.randn(1, s, 2, d, dtype=dtype, device="cuda").expand(b, s, 2, d)
    vb = torch.randn(1, s, 2, d, dtype=dtype, device="cuda").expand(b, s, 2, d)
    check_forward(q, kb, vb, causal)


def test_forward_large_scores_no_nan():
    """Large logits (scale 10x, -inf masks on causal diagonals): no overflow, no NaN."""
    require_hdim(128)
    q, k, v = make_qkv(2, 333, 517, 4, 4, 128, torch.bfloat16)
    check_forward(q * 8, k * 8, v, causal=True, softmax_scale=10.0 / math.sqrt(128))
    check_forward(q * 8, k * 8, v, causal=False, softmax_scale=10.0 / math.sqrt(128))


def test_forward_causal_rows_without_keys():
    """seqlen_q > seqlen_k, causal: whole query tiles (>= 128 rows) see no key -> 0 and +inf."""
    require_hdim(64)
    q, k, v = make_qkv(1, 1000, 40, 2, 1, 64, torch.float16)
    check_forward(q, k, v, causal=True)


def test_forward_batch_heads_70000():
    """batch*nheads = 70,000 (> 65,535 grid-y/z limit): the 1-D grid decomposition."""
    require_hdim(32)
    batch, nheads, s, d = 35, 2000, 16, 32
    q, k, v = make_qkv(batch, s, s, nheads, nheads // 4, d, torch.bfloat16)
    check_forward(q, k, v, causal=True)


def _check_long_key_forward(q, k, v):
    """out and softmax_lse of one long key sequence against the chunked references (tests/long_keys.py)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse, _ = fwd_poisoned(q, k, v, scale, False)
    ref_out, ref_lse = chunked_ref(q, k, v, scale, key_chunk(k), upcast=True)
    base_out, base_lse = chunked_ref(q, k, v, scale, key_chunk(k), upcast=False)
    check_accuracy("out", out, ref_out, base_out)
    check_accuracy("softmax_lse", lse, ref_lse, base_lse)


def test_forward_tensor_over_2pow31_elements():
    """k and v of > 2^31 elements each (bf16, ~4.3 GB): 64-bit offsets in the kernel (tests/long_keys.py:
    the keys past element 2^31 dominate every row; the references one key chunk at a time)."""
    require_hdim(128)
    q, k, v = inputs_past_2pow31(24)
    _check_long_key_forward(q, k, v)


def test_forward_long_rows():
    """Rows of 2.1M keys (8 heads, k / v of > 2^31 elements) whose heaviest key comes first in the
    kernels' walk (each query row of norm sqrt(d), its key among the last; tests/long_keys.py): O
    moves out of the tensor cores' accumulator every 8192 keys (kernels/common/long_rows.cuh).
    Without that, out's error was 2.4x the same-dtype baseline's on an H100 (7.97e-2 against
    3.28e-2; docs/PERF_NOTES.md, forty-first session)."""
    require_hdim(128)
    require_free_gib(24)
    seqlen_k = 2**31 // (8 * 128) + 1000
    q, k, v = long_key_inputs(seqlen_k, nheads=8, dominance=1.5, shifted_rows=1 << 20, equal_norms=True)
    _check_long_key_forward(q, k, v)


def test_forward_long_rows_workspace(arch_path):
    """The long rows' workspace (kernels/common/long_rows.cuh) of a call with 2^18 keys (32 heads of
    4096 query rows, d128): the sm90 forward's, one slot per CTA, is at most 32 MB (9 MB on 132 SMs);
    the sm80 kernel's, one per query row, twice a bf16 out (here 75 MB). The peak over the call's
    outputs (out, softmax_lse and its two float32 parts) is measured; out must be finite. (Not
    under the knobs that change it: a SCHEDULE other than auto, a LONG_ROW_KEYS bound.)"""
    require_hdim(128)
    if os.environ.get("FLASH_ATTN_EXT_SM90_FWD_SCHEDULE", "auto") != "auto" or \
            os.environ.get("FLASH_ATTN_EXT_LONG_ROW_KEYS", "0") != "0":
        pytest.skip("a schedule or long-row knob is set in this process")
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 4096, 1 << 18, 32, 4, 128, torch.bfloat16)
    outputs = q.numel() * 2 + 3 * 32 * 4096 * 4
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = torch.ops.flash_attn_ext.forward(q, k, v, 1.0 / math.sqrt(128), False)[0]
    torch.cuda.synchronize()
    workspace = torch.cuda.max_memory_allocated() - before - outputs
    assert torch.isfinite(out).all()
    sm90 = arch_path == "auto" and torch.cuda.get_device_capability() == (9, 0) and \
        "90a" in flash_attn_ext.build_info().get("cuda_archs", "")
    if sm90:  # at least one CTA slot per SM (no workspace: no flush), at most 32 MB
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert sms * 128 * 132 * 4 <= workspace <= 32 * 2**20, \
            f"the sm90 forward's long-row workspace took {workspace / 2**20:.1f} MB"
    else:  # per row: 32 heads x (4096 + 512) rows x (128 + 4) float32
        assert workspace >= 32 * (4096 + 512) * 132 * 4, f"{workspace / 2**20:.1f} MB: no per-row workspace?"


# Run in a subprocess with FLASH_ATTN_EXT_LONG_ROW_KEYS set (test_forward_long_rows_at_every_block).
# argv: inputs, outputs, whether to force the sm80 path.
_LONG_ROWS_SCRIPT = """
import sys, torch, flash_attn_ext
from flash_attn_ext import flash_attn_func, flash_attn_varlen_func
cases, varlen = torch.load(sys.argv[1])
if sys.argv[3] == "sm80":
    flash_attn_ext.force_sm80_path(True)
outs = [flash_attn_func(q, k, v, return_lse=True, **kw) for q, k, v, kw in cases]
q, k, v, cu, max_len = varlen
outs.append(flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True, return_lse=True))
outs += [flash_attn_func(q[None, a:b], k[None, a:b], v[None, a:b], causal=True, return_lse=True)
         for a, b in zip(cu[:-1], cu[1:])]
torch.save(outs, sys.argv[2])
"""


@pytest.mark.parametrize("bound", ["1", "1000"])
def test_forward_long_rows_at_every_block(bound, arch_path, tmp_path):
    """The long rows' path (kernels/common/long_rows.cuh) on ordinary shapes, in a subprocess with
    FLASH_ATTN_EXT_LONG_ROW_KEYS=bound: 1, every row moves O out of the accumulator after every key
    block; 1000, tiles whose key blocks hold >= 1000 keys every floor(1000 / kBlockN) blocks (896
    keys at 128, 960 at 64, 864 at 144), the others not (both arch paths; causal with GQA, with the
    sm90 forward's top-shifted tiles: 384 tiles of 192 rows shifted 128 rows up; a sliding window;
    soft-capping; the sm90 long-key tiles at 8192 keys; causal varlen). Each output meets the
    accuracy rule; with bound 1 it differs from the default call's bits (the path ran); a varlen
    call gives each sequence the bits of the sequence alone (a tile's flushes depend on its own
    sequence); with bound 1000 the 700-key sequence keeps the default bits and the 1500-key one
    does not."""
    require_hdim(64)
    require_hdim(128)
    torch.manual_seed(0)
    cases = []
    for (b, sq, sk, h, hk, d), kw in [((2, 1000, 1500, 8, 2, 64), {"causal": True}),
                                      ((4, 1000, 1000, 16, 4, 64), {"causal": True}),
                                      ((1, 2048, 2048, 4, 4, 128), {}),
                                      ((1, 777, 2000, 4, 2, 128), {"causal": True, "window_size": (300, 0)}),
                                      ((1, 512, 1024, 2, 2, 64), {"softcap": 30.0}),
                                      ((1, 256, 8192, 2, 2, 128), {})]:
        q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16)
        cases.append((q, k, v, kw))
    lens = [700, 1500, 40]
    cu = torch.tensor([0, 700, 2200, 2240], dtype=torch.int32, device="cuda")
    qv, kv, vv = (torch.randn(sum(lens), 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    torch.save((cases, (qv, kv, vv, cu, max(lens))), tmp_path / "in.pt")
    env = dict(os.environ, FLASH_ATTN_EXT_LONG_ROW_KEYS=bound)
    r = subprocess.run([sys.executable, "-c", _LONG_ROWS_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt"),
                        arch_path], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    outs = torch.load(tmp_path / "out.pt")
    for (q, k, v, kw), (out, lse) in zip(cases, outs):
        ref_out, ref_lse = attention_ref(q, k, v, None, upcast=True, **kw)
        base_out, base_lse = attention_ref(q, k, v, None, upcast=False, **kw)
        check_accuracy(f"out {tuple(q.shape)} {kw}", out, ref_out, base_out)
        check_accuracy(f"softmax_lse {tuple(q.shape)} {kw}", lse, ref_lse, base_lse)
        if bound == "1":
            default_out, _ = flash_attn_ext.flash_attn_func(q, k, v, return_lse=True, **kw)
            assert not torch.equal(out, default_out), f"{tuple(q.shape)} {kw}: the same bits as without the knob"
    varlen_out, varlen_lse = outs[len(cases)]
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone_out, alone_lse = outs[len(cases) + 1 + i]
        assert torch.equal(varlen_out[a:b], alone_out[0]), f"varlen sequence {i}: not the bits of the sequence alone"
        assert torch.equal(varlen_lse[:, a:b], alone_lse[0])
        if bound == "1000":  # the 700-key sequence does not flush (no workspace alone), the 1500-key one does
            default_out, _ = flash_attn_ext.flash_attn_func(qv[None, a:b], kv[None, a:b], vv[None, a:b], causal=True,
                                                            return_lse=True)
            assert torch.equal(alone_out, default_out) == (b - a < 1000), f"varlen sequence {i}: flushed {b - a} keys"
        ref_out, _ = attention_ref(qv[None, a:b], kv[None, a:b], vv[None, a:b], None, True, upcast=True)
        base_out, _ = attention_ref(qv[None, a:b], kv[None, a:b], vv[None, a:b], None, True, upcast=False)
        check_accuracy(f"varlen out, sequence {i}", alone_out, ref_out, base_out)
