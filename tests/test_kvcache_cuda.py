"""GPU tests of the KV-cache forward (issue 14 items 2-3) through
``flash_attn_ext.flash_attn_with_kvcache``: the append of new keys (csrc/kernels/common/append_kv.cuh),
the split-KV forward with GQA packing and paged loads (csrc/kernels/sm80/flash_fwd_splitkv_kernel.cuh,
common/paged_kv.cuh) and the combine of the splits (common/combine_kernel.cuh).

Criterion (tests/accuracy.py): max|ours - ref| <= 2 * max|baseline - ref| for out and softmax_lse,
ref = flash_attn_ext.reference.attention_kvcache_ref(upcast=True) (float64), baseline = the same
math in the inputs' dtype. Every cache slot past a sequence's visible keys (and every unused
block of a paged cache) holds NaN, so a slot the kernel should not read shows up in the output;
outputs and split accumulators are allocated NaN-filled (poison_empty) where the test allows it.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

import flash_attn_ext
from conftest import kernel_bool_args, require_hdim
from accuracy import check_accuracy
from flash_attn_ext.reference import attention_kvcache_ref
from long_keys import require_free_gib

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="KV-cache CUDA kernel tests need a CUDA GPU (none visible)"
)

DTYPES = [torch.bfloat16, torch.float16]


def _make_cache(lens, capacity, nheads_k, d, dtype, page_size=None, extra_blocks=3):
    """A K/V cache whose sequence b holds random keys in rows [0, lens[b]) and NaN past them.

    Contiguous: (batch, capacity, nheads_k, d), block_table None. Paged: capacity rounded up to
    whole pages, (num_blocks, page_size, nheads_k, d) with a shuffled block table (batch,
    max_blocks) and `extra_blocks` unused all-NaN blocks. Returns (k_cache, v_cache, block_table).
    """
    batch = len(lens)
    if page_size is not None:
        capacity = math.ceil(capacity / page_size) * page_size
    dense = [torch.randn(batch, capacity, nheads_k, d, device="cuda", dtype=dtype) for _ in range(2)]
    for t in dense:
        for b, n in enumerate(lens):
            t[b, max(0, min(n, capacity)):] = float("nan")
    if page_size is None:
        return dense[0], dense[1], None
    max_blocks = capacity // page_size
    num_blocks = batch * max_blocks + extra_blocks
    table = torch.randperm(num_blocks, device="cuda")[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    paged = []
    for t in dense:
        p = torch.full((num_blocks, page_size, nheads_k, d), float("nan"), device="cuda", dtype=dtype)
        p[table.long().flatten()] = t.reshape(batch * max_blocks, page_size, nheads_k, d)
        paged.append(p)
    return paged[0], paged[1], table


def _sm90_path():
    """Whether KV-cache calls take the sm90 path here (an sm_90 GPU, sm_90a code in the build, the
    sm80 path not forced): the TMA rows."""
    if torch.cuda.get_device_capability() != (9, 0) or "90a" not in flash_attn_ext.build_info()["cuda_archs"]:
        return False
    forced = flash_attn_ext.force_sm80_path(True)
    flash_attn_ext.force_sm80_path(forced)
    return not forced


def _check(q, k_cache, v_cache, block_table, visible, causal, out, lse, softmax_scale=None):
    """out / lse of the kvcache op against the reference on the cache as it is now (after any
    append), sequence b seeing its first visible[b] rows."""
    lens = torch.tensor(visible, dtype=torch.int32)
    ref = attention_kvcache_ref(q, k_cache, v_cache, lens, block_table, softmax_scale, causal, upcast=True)
    base = attention_kvcache_ref(q, k_cache, v_cache, lens, block_table, softmax_scale, causal, upcast=False)
    check_accuracy("out", out, ref[0], base[0])
    check_accuracy("softmax_lse", lse, ref[1], base[1])
    return ref, base


# ---- Decode and short query chunks: GQA packing (ratio 1 / 4 / 8), causal both ways, varied
# visible lengths per sequence (0, 1, ragged, the full capacity), contiguous cache.

@pytest.mark.parametrize("seqlen_q", [1, 2, 7, 16, 33])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_forward(seqlen_q, ratio, d, causal, poison_empty):
    require_hdim(d)
    dtype = torch.bfloat16 if (seqlen_q + ratio) % 2 else torch.float16
    nheads_k, capacity = 2, 300
    lens = [0, capacity, 1, 157]
    q = torch.randn(len(lens), seqlen_q, nheads_k * ratio, d, device="cuda", dtype=dtype)
    kc, vc, _ = _make_cache(lens, capacity, nheads_k, d, dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=causal,
                                                     return_lse=True)
    _check(q, kc, vc, None, lens, causal, out, lse)
    # A sequence without keys: out 0, lse +inf.
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isinf(lse[0]).all()


@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_head_dims(d, dtype, poison_empty):
    """Every compiled head dim (80 runs on the 96 kernel, zero-padded) on a GQA 4:1 decode step with
    a split count of 3 and a 2-row chunk."""
    require_hdim(d)
    lens = [200, 37, 513]
    for seqlen_q, num_splits in [(1, 3), (2, 1)]:
        q = torch.randn(len(lens), seqlen_q, 8, d, device="cuda", dtype=dtype)
        kc, vc, _ = _make_cache(lens, 513, 2, d, dtype)
        out, lse = flash_attn_ext.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"), causal=True,
            num_splits=num_splits, return_lse=True)
        _check(q, kc, vc, None, lens, True, out, lse)


# ---- Paged KV: page sizes 16 / 64 / 256 (and 48: not a power of two) through a shuffled block
# table; the result equals the contiguous cache's bit for bit (the same tiles reach the kernel).

@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
@pytest.mark.parametrize("ratio", [1, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 7])
def test_kvcache_paged(page_size, ratio, d, causal, seqlen_q, poison_empty):
    require_hdim(d)
    dtype = torch.bfloat16
    nheads_k = 2
    lens = [700, 0, 33, 512]
    q = torch.randn(len(lens), seqlen_q, nheads_k * ratio, d, device="cuda", dtype=dtype)
    kc, vc, table = _make_cache(lens, 700, nheads_k, d, dtype, page_size=page_size)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for num_splits in (1, 5):
        out, lse = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                         causal=causal, num_splits=num_splits, return_lse=True)
        _check(q, kc, vc, table, lens, causal, out, lse)
        # The same cache laid out contiguously: identical tiles, identical arithmetic.
        kd = kc[table.long()].flatten(1, 2)
        vd = vc[table.long()].flatten(1, 2)
        out_d, lse_d = flash_attn_ext.flash_attn_with_kvcache(q, kd, vd, cache_seqlens=seqlens, causal=causal,
                                                             num_splits=num_splits, return_lse=True)
        assert torch.equal(out, out_d)
        assert torch.equal(lse, lse_d)


# ---- Append of new keys / values (k, v): written at cache_seqlens[b] + i, rows past the cache
# dropped; every other cache slot untouched (bitwise, NaN included); then the attention sees
# cache_seqlens[b] + seqlen_new keys.

def _bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("seqlen_new", [1, 5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_splits", [1, 0, 4])
def test_kvcache_append(page_size, seqlen_new, causal, num_splits, poison_empty):
    """num_splits 4 takes the balanced splits (on by default; test_kvcache_unbalanced_suite runs
    the plain ones): the appended keys in the lengths the kernels share out, 20 packed rows (two row
    tiles) at seqlen_new 5, the first sequence's one key tile a row of one split, the contiguous
    cache the TMA path on sm90."""
    d, dtype, nheads_k, ratio, capacity = 128, torch.bfloat16, 2, 4, 256
    require_hdim(d)
    lens = [0, 100, capacity - 2, capacity]  # the last two overflow: rows past the cache are dropped
    batch = len(lens)
    kc, vc, table = _make_cache(lens, capacity, nheads_k, d, dtype, page_size=page_size)
    q = torch.randn(batch, seqlen_new, nheads_k * ratio, d, device="cuda", dtype=dtype)
    k_new = torch.randn(batch, seqlen_new, nheads_k, d, device="cuda", dtype=dtype)
    v_new = torch.randn(batch, seqlen_new, nheads_k, d, device="cuda", dtype=dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                                     block_table=table, causal=causal, num_splits=num_splits,
                                                     return_lse=True)
    assert torch.equal(seqlens.cpu(), torch.tensor(lens, dtype=torch.int32)), "cache_seqlens must not change"

    # Expected cache: the old one with the new rows written where they fit.
    k_exp, v_exp = kc0.clone(), vc0.clone()
    for b, n in enumerate(lens):
        for i in range(seqlen_new):
            row = n + i
            if row >= capacity:
                continue
            if table is None:
                k_exp[b, row], v_exp[b, row] = k_new[b, i], v_new[b, i]
            else:
                blk = int(table[b, row // page_size])
                k_exp[blk, row % page_size], v_exp[blk, row % page_size] = k_new[b, i], v_new[b, i]
    assert torch.equal(_bits(kc), _bits(k_exp)), "k_cache after the append"
    assert torch.equal(_bits(vc), _bits(v_exp)), "v_cache after the append"

    visible = [min(n + seqlen_new, capacity) for n in lens]
    _check(q, kc, vc, table, visible, causal, out, lse)


@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("num_splits", [1, 0, 4])
def test_kvcache_cache_seqlens_near_int32_max(page_size, num_splits, poison_empty):
    """cache_seqlens past the cache up to 2^31 - 1 (not read on the host on CUDA): the whole cache is
    attended and the new rows are dropped, as for any value past the cache. 2^31 - 1 plus one new
    key used to wrap negative in int (common/seqlen.cuh: kv_used_rows) and hide every key: out 0,
    LSE +inf. num_splits 4 takes the balanced splits, which share CTAs out by these lengths."""
    d, dtype, nheads_k, ratio, capacity = 128, torch.bfloat16, 2, 4, 256
    require_hdim(d)
    lens = [2**31 - 1, 100, 2**31 - 2, 2**31 - 256]
    batch = len(lens)
    kc, vc, table = _make_cache([capacity] * batch, capacity, nheads_k, d, dtype, page_size=page_size)
    kc0, vc0 = kc.clone(), vc.clone()
    q = torch.randn(batch, 1, nheads_k * ratio, d, device="cuda", dtype=dtype)
    k_new = torch.randn(batch, 1, nheads_k, d, device="cuda", dtype=dtype)
    v_new = torch.randn(batch, 1, nheads_k, d, device="cuda", dtype=dtype)
    out, lse = flash_attn_ext.flash_attn_with_kvcache(
        q, kc, vc, k_new, v_new, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
        block_table=table, num_splits=num_splits, return_lse=True)
    # Sequence 1 appends at row 100; the others' rows are past the cache: dropped.
    k_exp, v_exp = kc0.clone(), vc0.clone()
    if table is None:
        k_exp[1, 100], v_exp[1, 100] = k_new[1, 0], v_new[1, 0]
    else:
        blk = int(table[1, 100 // page_size])
        k_exp[blk, 100 % page_size], v_exp[blk, 100 % page_size] = k_new[1, 0], v_new[1, 0]
    assert torch.equal(_bits(kc), _bits(k_exp)) and torch.equal(_bits(vc), _bits(v_exp)), "the caches after the append"
    _check(q, kc, vc, table, [capacity, 101, capacity, capacity], False, out, lse)


# ---- Split-KV stays exact: 1 split, several (also more than the key tiles: empty splits), and
# the heuristic's choice (0) all meet the rule against the reference and lie within the rule's
# budget of each other.

@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_num_splits(d, causal, seqlen_q, paged, poison_empty):
    require_hdim(d)
    dtype = torch.bfloat16
    lens = [4096, 1500, 3, 0]
    nheads_k, ratio = 2, 4
    q = torch.randn(len(lens), seqlen_q, nheads_k * ratio, d, device="cuda", dtype=dtype)
    kc, vc, table = _make_cache(lens, 4096, nheads_k, d, dtype, page_size=64 if paged else None)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    results = {}
    for num_splits in (1, 2, 3, 7, 16, 128, 0):
        results[num_splits] = flash_attn_ext.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=seqlens, block_table=table, causal=causal, num_splits=num_splits,
            return_lse=True)
    ref, base = _check(q, kc, vc, table, lens, causal, *results[1])
    for num_splits, (out, lse) in results.items():
        check_accuracy(f"out (num_splits={num_splits})", out, ref[0], base[0])
        check_accuracy(f"softmax_lse (num_splits={num_splits})", lse, ref[1], base[1])
        # Against the unsplit result, with the same budget the rule gives each.
        budget = 2 * (base[0].double() - ref[0].double()).nan_to_num(0.0).abs().max().item() + 1e-5
        assert (out.double() - results[1][0].double()).abs().max().item() <= budget, num_splits


# Balanced splits are on unless FLASH_ATTN_EXT_SPLITKV_BALANCE is 0 (read once per process, as an
# integer: "00" and "+0" are 0 too; unset or empty: 2): test_kvcache_unbalanced_suite runs the
# KV-cache tests again in a process with it 0.
BALANCED = int(os.environ.get("FLASH_ATTN_EXT_SPLITKV_BALANCE", "").strip() or 2) != 0


@pytest.mark.skipif(not BALANCED, reason="FLASH_ATTN_EXT_SPLITKV_BALANCE=0 turns the balanced splits off in this "
                                         "process (read once); the default process runs this test")
@pytest.mark.parametrize("lens_kind", ["ragged", "equal", "equal_many", "empty"])
@pytest.mark.parametrize("num_splits", [0, 2, 16, 64])
@pytest.mark.parametrize("causal,seqlen_q", [(False, 1), (True, 3)])
@pytest.mark.parametrize("page_size", [None, 64])
def test_kvcache_balanced_splits(lens_kind, num_splits, causal, seqlen_q, page_size, poison_empty):
    """Balanced splits (csrc/kernels/common/splitkv_work.cuh): the split CTAs of a batch whose
    sequences differ in length are shared out by length on the device. "ragged": sixteen sequences
    from 0 keys to the full capacity; num_splits 2: threshold 22 tiles of 64 keys, the full
    sequences 6 splits, the empty ones none (the combine writes their zeros); 16: 2 tiles, 64
    splits; 64: one tile, and the full sequences at the kMaxSplits cap (128), 554 of the 1024 units
    idle. "equal": four sequences of 5000 keys, the unbalanced grid of the shapes' count.
    "equal_many": 64 sequences of 1000 keys in 1024-row caches, whose 128 unsplit CTAs fill an
    H100 / H200 in one round (the shapes' count 1): with num_splits 0 the grid has 2 units per
    sequence, the second idle, and each sequence's one split writes its output in the split kernel
    while the combine skips the row. "empty": no keys anywhere. Exact against the reference and
    within the rule of the unsplit result; sequences without keys give out 0 and lse +inf."""
    require_hdim(128)
    nheads_k, ratio, d = 2, 4, 128
    capacity = 1024 if lens_kind == "equal_many" else 8192
    lens = {"ragged": [8192, 0, 1, 5, 64, 65, 700, 0, 3000, 2, 128, 129, 8192, 17, 1000, 8191],
            "equal": [5000] * 4, "equal_many": [1000] * 64, "empty": [0] * 3}[lens_kind]
    q = torch.randn(len(lens), seqlen_q, nheads_k * ratio, d, device="cuda", dtype=torch.bfloat16)
    kc, vc, table = _make_cache(lens, capacity, nheads_k, d, torch.bfloat16, page_size=page_size)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def run(splits):
        return flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                      causal=causal, num_splits=splits, return_lse=True)

    out, lse = run(num_splits)
    ref, base = _check(q, kc, vc, table, lens, causal, out, lse)
    out1, _ = run(1)
    budget = 2 * (base[0].double() - ref[0].double()).nan_to_num(0.0).abs().max().item() + 1e-5
    assert (out.double() - out1.double()).abs().max().item() <= budget
    for b, n in enumerate(lens):  # no keys: out 0, lse +inf
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])) and (lse[b] == math.inf).all()
    # The balanced twins ran (kBalanced: the last bool template argument of the split kernel and of
    # the combine) where the host rule applies (splitkv_heuristic.h: balanced_splits_units): an
    # unsplit grid of one CTA per (sequence, kv head) fits the SMs; num_splits=1 never.
    balanced = len(lens) * nheads_k <= torch.cuda.get_device_properties(0).multi_processor_count
    for splits, expect in ((num_splits, balanced), (1, False)):
        names = [n for n in _kernel_names(lambda: run(splits)) if "splitkv" in n]
        assert any("flash_fwd_splitkv_kernel" in n for n in names), names
        assert all(kernel_bool_args(n)[-1] == expect for n in names), (splits, expect, names)
        if expect or splits > 0:  # (unbalanced with num_splits 0, the heuristic's count decides)
            assert any("splitkv_combine" in n for n in names) == (expect or splits > 1), (splits, names)


@pytest.mark.skipif(not BALANCED, reason="this process already runs with the balanced splits off")
def test_kvcache_unbalanced_suite():
    """The KV-cache GPU tests (this file's, the rotary / leftpad ones, the sinks', the paged varlen
    calls and the windowed KV-cache calls: every caller of the KV-cache op) again with the balanced
    splits off (FLASH_ATTN_EXT_SPLITKV_BALANCE=0, a subprocess from the repository's root): every
    sequence runs the shapes' split count, the plain split kernel and combine."""
    require_hdim(128)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, FLASH_ATTN_EXT_SPLITKV_BALANCE="0",
               PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("FLASH_ATTN_EXT_TEST_SHARD", None)  # (conftest: this process's shard; the rerun takes every test)
    files = [os.path.join("tests", f) for f in ("test_kvcache_cuda.py", "test_kvcache_rotary.py", "test_sinks.py",
                                                "test_varlen.py", "test_window.py")]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider", *files, "-k",
                        "(kvcache or paged_varlen) and not forced_splits_knob and not unbalanced_suite"],
                       env=env, capture_output=True, text=True, cwd=root, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "turns the balanced splits off" in r.stdout, r.stdout[-2000:]


def test_kvcache_long_decode_gqa(poison_empty):
    """The issue's decode shape at test scale: GQA 32:8, hd128, bf16, one query, 16k keys, batch 2,
    contiguous and paged (page 16), heuristic splits."""
    require_hdim(128)
    lens = [16384, 9000]
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    for page_size in (None, 16):
        kc, vc, table = _make_cache(lens, 16384, 8, 128, torch.bfloat16, page_size=page_size)
        out, lse = flash_attn_ext.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"), block_table=table,
            return_lse=True)
        _check(q, kc, vc, table, lens, False, out, lse)


def test_kvcache_no_cache_seqlens_and_views(poison_empty):
    """cache_seqlens None (every cache row seen), an int cache_seqlens, a softmax_scale, and q / cache
    as non-contiguous views (a slice of a wider tensor)."""
    require_hdim(64)
    dtype = torch.float16
    wide_q = torch.randn(2, 3, 8, 80, device="cuda", dtype=dtype)
    q = wide_q[..., 8:72]
    wide_k = torch.randn(2, 200, 2, 64 + 16, device="cuda", dtype=dtype)
    wide_v = torch.randn(2, 200, 2, 64 + 16, device="cuda", dtype=dtype)
    kc, vc = wide_k[..., :64], wide_v[..., 16:]
    for causal in (False, True):
        out, lse = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, softmax_scale=0.3, causal=causal,
                                                         return_lse=True)
        _check(q, kc, vc, None, [200, 200], causal, out, lse, softmax_scale=0.3)
        out, lse = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=150, causal=causal,
                                                         num_splits=4, return_lse=True)
        _check(q, kc, vc, None, [150, 150], causal, out, lse)


def test_kvcache_misaligned_read_only_cache(poison_empty):
    """A cache view 8 bytes into its buffer is refused only when k / v are appended to it (it is
    written in place); read-only, it is copied as q is, as the CPU path reads it (a reviewer found
    CUDA refusing what CPU accepted)."""
    require_hdim(64)
    dtype = torch.float16
    base_k = torch.randn(2 * 96 * 2 * 64 + 4, device="cuda", dtype=dtype)
    base_v = torch.randn(2 * 96 * 2 * 64 + 4, device="cuda", dtype=dtype)
    kc = base_k[4:].view(2, 96, 2, 64)  # 8-byte offset: TMA and 16-byte copies cannot read it
    vc = base_v[4:].view(2, 96, 2, 64)
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=dtype)
    out, lse = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([96, 50], dtype=torch.int32,
                                                     device="cuda"), return_lse=True)
    _check(q, kc, vc, None, [96, 50], False, out, lse)
    with pytest.raises(RuntimeError, match="k_cache must have a 16-byte aligned base"):
        flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, k=torch.randn(2, 1, 2, 64, device="cuda", dtype=dtype),
                                               v=torch.randn(2, 1, 2, 64, device="cuda", dtype=dtype),
                                               cache_seqlens=torch.tensor([10, 20], dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("num_splits", [0, 4])
def test_kvcache_no_query_heads(num_splits):
    """nheads = 0: empty outputs, no error, whatever num_splits (the heuristic picked 8 splits and
    the call failed for want of split workspaces; CPU returned the empty outputs); the append
    still writes the cache."""
    require_hdim(64)
    dtype = torch.float16
    kc = torch.randn(2, 4096, 2, 64, device="cuda", dtype=dtype)
    vc = torch.randn(2, 4096, 2, 64, device="cuda", dtype=dtype)
    k_new, v_new = (torch.randn(2, 1, 2, 64, device="cuda", dtype=dtype) for _ in range(2))
    q = torch.randn(2, 1, 0, 64, device="cuda", dtype=dtype)
    seqlens = torch.tensor([100, 200], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=seqlens,
                                                     num_splits=num_splits, return_lse=True)
    assert out.shape == (2, 1, 0, 64) and lse.shape == (2, 0, 1)
    assert torch.equal(kc[0, 100], k_new[0, 0]) and torch.equal(vc[1, 200], v_new[1, 0])


# ---- NaN past cache_seqlens never reaches the output, whatever the split and the layout;
# also a NaN in the last visible tile's padding rows and in the padded head-dim columns' source.

@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [1, 6])
def test_kvcache_nan_past_cache_seqlens(paged, num_splits, poison_empty):
    require_hdim(128)
    dtype = torch.bfloat16
    lens = [65, 64, 63, 1, 129]  # ragged against 64-key tiles and 16-row groups
    q = torch.randn(len(lens), 1, 8, 128, device="cuda", dtype=dtype)
    kc, vc, table = _make_cache(lens, 256, 2, 128, dtype, page_size=16 if paged else None)
    out, lse = flash_attn_ext.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"), block_table=table,
        num_splits=num_splits, return_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    _check(q, kc, vc, table, lens, False, out, lse)


# ---- The TMA copies (sm_90 path: the hd64 / 128 / 256 rows; common/paged_kv.cuh:
# copy_kv_tiles_tma) on a grid of several CTAs per SM: whole boxes reach past the visible keys (NaN
# there: zeroed in V, masked in S), pages of 16 / 48 / 64 / 256 rows (boxes of gcd(page, BLOCK_N)
# rows; groups past a sequence's keys read at block -1: zero fill), d = 112 inside a 128-column
# storage whose last 16 columns hold NaN (the maps' extent is d, not the 128 the kernel runs).
# Paged equals contiguous, and the cp.async twin (force_sm80_path) equals the TMA row, bit for bit.

def _wide_nan_cache(lens, capacity, nheads_k, d, dtype, page_size):
    """_make_cache's tensors with head dim d as a view into storage of d rounded up to 64 columns,
    the extra columns NaN."""
    wide = (d + 63) // 64 * 64
    kc, vc, table = _make_cache(lens, capacity, nheads_k, wide, dtype, page_size=page_size)
    for t in (kc, vc):
        t[..., d:] = float("nan")
    return kc[..., :d], vc[..., :d], table


@pytest.mark.parametrize("page_size", [None, 16, 48, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,seqlen_q", [(False, 1), (True, 7)])
@pytest.mark.parametrize("d", [64, 112, 128, 256])
def test_kvcache_tma_path(page_size, dtype, causal, seqlen_q, d, poison_empty):
    d_kernel = (d + 63) // 64 * 64
    require_hdim(d_kernel, exact=True)
    nheads_k, ratio = 8, 4
    lens = [1000, 777, 64, 129, 0, 1]
    q = torch.randn(len(lens), seqlen_q, nheads_k * ratio, d, device="cuda", dtype=dtype)
    kc, vc, table = _wide_nan_cache(lens, 1024, nheads_k, d, dtype, page_size)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def run(k_cache, v_cache, block_table):  # 6 x 8 x 16 = 768 CTAs
        return flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                      block_table=block_table, causal=causal, num_splits=16,
                                                      return_lse=True)

    out, lse = run(kc, vc, table)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    _check(q, kc, vc, table, lens, causal, out, lse)
    if _sm90_path():  # the TMA row ran, and its twin agrees
        tma_row = f"SplitKvTile<{d_kernel}>"
        assert any("flash_fwd_splitkv_kernel" in n and tma_row in n for n in _kernel_names(lambda: run(kc, vc, table)))
        previous = flash_attn_ext.force_sm80_path(True)
        try:
            names = _kernel_names(lambda: run(kc, vc, table))
            out_t, lse_t = run(kc, vc, table)
        finally:
            flash_attn_ext.force_sm80_path(previous)
        assert not any(tma_row in n for n in names), names
        assert torch.equal(out, out_t) and torch.equal(lse, lse_t)
    if table is not None:
        out_d, lse_d = run(kc[table.long()].flatten(1, 2), vc[table.long()].flatten(1, 2), None)
        assert torch.equal(out, out_d) and torch.equal(lse, lse_d)


# ---- FLASH_ATTN_EXT_SPLITKV_SPLITS (kernels/dispatch.cu: a tuning knob for split-count sweeps).

_FORCED_SPLITS_SCRIPT = """
import sys, torch, flash_attn_ext
q, kc, vc, seqlens = torch.load(sys.argv[1])
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    out, lse = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, return_lse=True)
    torch.cuda.synchronize()
torch.save((out, lse, [e.name for e in prof.events() if "flash" in e.name]), sys.argv[2])
"""


def test_kvcache_forced_splits_knob(tmp_path):
    """FLASH_ATTN_EXT_SPLITKV_SPLITS=N (a tuning knob, read once: a subprocess) replaces the
    heuristic's split count: a grid the heuristic runs unsplit (one (sequence, kv head) CTA per SM)
    runs N splits and the combine, exact against the reference; out of range it is a clear error
    naming the knob. The balanced splits (FLASH_ATTN_EXT_SPLITKV_BALANCE unset, empty or 2: the
    default factor 2) give the ragged batch a grid of 2 units per sequence even where the heuristic
    says 1, so the combine runs; 0 gives every sequence the heuristic's count (here 1: no combine);
    out of [0, 8] it is a clear error."""
    require_hdim(128, exact=True)
    nheads_k, ratio, d, capacity = 8, 4, 128, 1024
    batch = torch.cuda.get_device_properties(0).multi_processor_count // nheads_k
    gen = torch.Generator().manual_seed(8)
    lens = torch.randint(0, capacity + 1, (batch,), generator=gen).tolist()
    lens[:3] = [0, 1, capacity]
    q = torch.randn(batch, 1, nheads_k * ratio, d, device="cuda", dtype=torch.bfloat16)
    kc, vc, _ = _make_cache(lens, capacity, nheads_k, d, torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    torch.save((q, kc, vc, seqlens), tmp_path / "in.pt")
    for value, balance, ok, combine in (("", "0", True, False), ("3", "0", True, True), ("129", "0", False, None),
                                        ("", None, True, True), ("", "", True, True), ("", "2", True, True),
                                        ("", "9", False, None)):
        env = dict(os.environ, FLASH_ATTN_EXT_SPLITKV_SPLITS=value)
        env.pop("FLASH_ATTN_EXT_SPLITKV_BALANCE", None)  # None: unset
        if balance is not None:
            env["FLASH_ATTN_EXT_SPLITKV_BALANCE"] = balance
        r = subprocess.run([sys.executable, "-c", _FORCED_SPLITS_SCRIPT, str(tmp_path / "in.pt"),
                            str(tmp_path / "out.pt")], env=env, capture_output=True, text=True)
        if not ok:
            message = ("FLASH_ATTN_EXT_SPLITKV_SPLITS must be in [0, 128], got '129'" if value else
                       "FLASH_ATTN_EXT_SPLITKV_BALANCE must be in [0, 8], got '9'")
            assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
            continue
        assert r.returncode == 0, r.stderr[-2000:]
        out, lse, names = torch.load(tmp_path / "out.pt")
        assert any("flash_fwd_splitkv_kernel" in n for n in names), names
        assert any("splitkv_combine" in n for n in names) == combine, (value, balance, names)
        _check(q, kc, vc, None, lens, False, out, lse)


# ---- Caches larger than twice the L2 (the launch's estimate from the capacity): the TMA row's
# quarter-evict-first reads (Flash_fwd_params::kv_stream_exceeds_l2), NaN past the keys.

@pytest.mark.parametrize("page_size", [None, 64])
def test_kvcache_cache_beyond_l2(page_size, poison_empty):
    require_hdim(128)
    dtype = torch.bfloat16
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    nheads_k, ratio, d = 8, 4, 128
    lens = [5000, 0, 777]
    capacity = max(1024, (4 * l2) // (len(lens) * nheads_k * d * 2 * 2) // 256 * 256)  # K + V: 4x the L2
    q = torch.randn(len(lens), 1, nheads_k * ratio, d, device="cuda", dtype=dtype)
    kc, vc, table = _make_cache(lens, capacity, nheads_k, d, dtype, page_size=page_size, extra_blocks=1)
    out, lse = flash_attn_ext.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"), block_table=table,
        return_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    _check(q, kc, vc, table, lens, False, out, lse)


# ---- A cache pool of more than 2^31 elements (serving pools are larger): the rows past element
# 2^31 read and appended with 64-bit offsets (paged_kv.cuh: KvCacheRows::row_ptr and the TMA boxes,
# append_kv.cuh), each way a sequence finds its cache.

@pytest.mark.parametrize("layout", ["contiguous", "paged", "cache_batch_idx"])
def test_kvcache_cache_over_2pow31_elements(layout, poison_empty):
    """contiguous: sequence b at entry b of 2,051 (the last three past element 2^31 hold keys, the
    others none but their new one); paged: blocks of 256 rows numbered past 2^31 elements;
    cache_batch_idx: entries past it. One new key appended per sequence (past element 2^31 but for
    one entry and one block below it)."""
    require_hdim(128)
    require_free_gib(16)
    dtype, nheads_k, ratio, d, rows = torch.bfloat16, 8, 4, 128, 1024
    entries = 2**31 // (rows * nheads_k * d) + 3  # 2,051 entries; entry 2,048 starts at element 2^31
    kc = torch.randn(entries, rows, nheads_k, d, device="cuda", dtype=dtype)
    vc = torch.randn(entries, rows, nheads_k, d, device="cuda", dtype=dtype)
    assert kc.numel() > 2**31
    lens = [1000, 0, 517]  # the sequences' cached keys before the append
    if layout == "contiguous":
        used = [entries - 3, entries - 2, entries - 1]  # the entries of the sequences with keys
        batch, table, call_kc, call_vc = entries, None, kc, vc
        seqlens = [0] * entries
        for e, n in zip(used, lens):
            seqlens[e] = n
    else:
        used, batch, seqlens = list(range(3)), 3, lens
        if layout == "paged":  # the same memory as (entries * 4) blocks of 256 rows
            call_kc, call_vc = (t.view(entries * 4, 256, nheads_k, d) for t in (kc, vc))
            table = torch.tensor([[8195, 8192, 3, 8201], [8199, 8200, 8194, 8193], [8202, 17, 8197, 8196]],
                                 dtype=torch.int32, device="cuda")
        else:
            call_kc, call_vc, table = kc, vc, torch.tensor([2050, 7, 2048], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, nheads_k * ratio, d, device="cuda", dtype=dtype)
    k_new = torch.randn(batch, 1, nheads_k, d, device="cuda", dtype=dtype)
    v_new = torch.randn(batch, 1, nheads_k, d, device="cuda", dtype=dtype)
    out, lse = flash_attn_ext.flash_attn_with_kvcache(
        q, call_kc, call_vc, k_new, v_new, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device="cuda"),
        block_table=table if layout == "paged" else None,
        cache_batch_idx=table if layout == "cache_batch_idx" else None, return_lse=True)
    def cache_of(t, i):  # the i-th sequence with keys: its cache as a (1, rows, ...) tensor, after the append
        if layout == "paged":
            return t.view(entries * 4, 256, nheads_k, d)[table[i].long()].reshape(1, rows, nheads_k, d)
        return t[int(table[i]) if layout == "cache_batch_idx" else used[i]].unsqueeze(0)

    for i, (b, n) in enumerate(zip(used, lens)):  # b: the sequence (contiguous: its entry too)
        k_b, v_b = cache_of(kc, i), cache_of(vc, i)
        assert torch.equal(_bits(k_b[0, n]), _bits(k_new[b, 0])), f"sequence {b}: the appended key"
        assert torch.equal(_bits(v_b[0, n]), _bits(v_new[b, 0])), f"sequence {b}: the appended value"
        _check(q[b:b + 1], k_b, v_b, None, [n + 1], False, out[b:b + 1], lse[b:b + 1])
    if layout == "contiguous":  # the sequences without keys but the new one
        rest = torch.ones(batch, dtype=torch.bool, device="cuda")
        rest[used] = False
        _check(q[rest][:4], kc[:4], vc[:4], None, [1] * 4, False, out[rest][:4], lse[rest][:4])


# ---- CUDA graphs: a decode step (append + attention, heuristic splits) captured once and
# replayed with new inputs written into the captured tensors, equal to eager runs bit for bit.

@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_cuda_graph_decode(paged):
    require_hdim(128)
    dtype = torch.bfloat16
    batch, nheads_k, ratio, d, capacity = 3, 2, 4, 128, 1024
    lens = [10, 700, 1000]
    kc, vc, table = _make_cache(lens, capacity, nheads_k, d, dtype, page_size=64 if paged else None)
    kc0, vc0 = kc.clone(), vc.clone()
    q = torch.randn(batch, 1, nheads_k * ratio, d, device="cuda", dtype=dtype)
    k_new = torch.randn(batch, 1, nheads_k, d, device="cuda", dtype=dtype)
    v_new = torch.randn(batch, 1, nheads_k, d, device="cuda", dtype=dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def step():
        return flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                                      block_table=table, return_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (first-call setup) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = step()

    kc.copy_(kc0), vc.copy_(vc0)
    kc_e, vc_e = kc0.clone(), vc0.clone()
    for _ in range(3):  # three decode steps: new q / k / v, cache_seqlens advanced by the caller
        q.normal_(), k_new.normal_(), v_new.normal_()
        graph.replay()
        out_e, lse_e = flash_attn_ext.flash_attn_with_kvcache(q, kc_e, vc_e, k_new, v_new, cache_seqlens=seqlens,
                                                              block_table=table, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(out_g, out_e) and torch.equal(lse_g, lse_e)
        assert torch.equal(_bits(kc), _bits(kc_e)) and torch.equal(_bits(vc), _bits(vc_e))
        visible = [min(int(n) + 1, capacity) for n in seqlens.tolist()]
        _check(q, kc, vc, table, visible, False, out_g, lse_g)
        seqlens += 1


# ---- The kernels that run: the split-KV kernel (never the dense forward), the combine only when
# split, the append only with new keys.

def _kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "flash" in e.name]


def test_kvcache_kernels_that_run():
    require_hdim(128)
    dtype = torch.bfloat16
    lens = [300, 1000]
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=dtype)
    kc, vc, _ = _make_cache(lens, 1024, 2, 128, dtype)
    kn = torch.randn(2, 1, 2, 128, device="cuda", dtype=dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for num_splits, k_new in [(1, None), (4, None), (4, kn)]:
        names = _kernel_names(lambda: flash_attn_ext.flash_attn_with_kvcache(
            q, kc, vc, k_new, None if k_new is None else kn, cache_seqlens=seqlens, num_splits=num_splits))
        assert any("flash_fwd_splitkv_kernel" in n for n in names), names
        assert not any("flash_fwd_kernel" in n for n in names), names
        assert any("splitkv_combine" in n for n in names) == (num_splits > 1), names
        assert any("append_kv" in n for n in names) == (k_new is not None), names
