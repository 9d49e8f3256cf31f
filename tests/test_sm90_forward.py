"""GPU tests of the Hopper forward kernel (csrc/kernels/sm90/flash_fwd_kernel.cuh: TMA, mbarriers,
warp specialization, wgmma) through ``torch.ops.flash_attn_ext.forward``.

The sm90 forward runs on compute capability 9.0 when the build has sm_90a code, for the head dims
of the manifest's sm90 "fwd" row (64, 96, 128, 192, 256; 32 keeps the sm80 kernel), and
only for inputs TMA can describe (16-byte-aligned base, strides multiples of 16 bytes); every other
input takes the sm80 kernel. Each test here runs on the default ("auto") path and compares with
the float64 reference under the project's rule (tests/accuracy.py: max|ours - ref| <= 2 x
max|same-dtype torch math - ref|), and, where stated, with the sm80 kernel forced on the same GPU
(flash_attn_ext.force_sm80_path). The accuracy grid over head dims, dtypes, seqlens, causal, GQA,
padded head dims and strided views is tests/test_cuda_forward.py, which runs on both arch paths.
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


def _skip_reason():
    if not torch.cuda.is_available():
        return "the sm90 forward needs a CUDA GPU (none visible)"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"the sm90 forward runs on compute capability 9.0 only (this GPU: {torch.cuda.get_device_capability()})"
    info = flash_attn_ext.build_info()
    if not info.get("with_cuda"):
        return "flash_attn_ext was built without CUDA kernels"
    if "90a" not in str(info.get("cuda_archs", "")):
        return "this build has no sm_90a code (FLASH_ATTN_EXT_CUDA_ARCHS without 90a): only the sm80 path exists"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))

SM90_FWD_HDIMS = [64, 96, 128, 192, 256]
DTYPES = [torch.float16, torch.bfloat16]


class _sm80_forced:
    def __enter__(self):
        self.previous = flash_attn_ext.force_sm80_path(True)

    def __exit__(self, *exc):
        flash_attn_ext.force_sm80_path(self.previous)


def _forward(q, k, v, scale, causal, nan_outputs=True, window_left=-1):
    """The op with its outputs' memory poisoned with NaN (an unwritten element shows as NaN).
    window_left: a left window bound (causal: the window (window_left, 0))."""
    if nan_outputs:
        junk = torch.full((q.numel() * 2 + q.shape[0] * q.shape[1] * q.shape[2] * 4,), float("nan"),
                          dtype=torch.float32, device=q.device)
        del junk
    return torch.ops.flash_attn_ext.forward(q, k, v, scale, causal, window_left)


def check_forward(q, k, v, causal, scale=None, window_left=-1):
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse, stats = _forward(q, k, v, scale, causal, window_left=window_left)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "out: NaN"
    assert not torch.isnan(lse).any() and not torch.isnan(stats).any(), "softmax_lse / softmax_stats: NaN"
    window = (window_left, -1)
    ref_out, ref_lse = attention_ref(q, k, v, scale, causal, upcast=True, window_size=window)
    base_out, base_lse = attention_ref(q, k, v, scale, causal, upcast=False, window_size=window)
    check_accuracy("out", out, ref_out, base_out)
    check_accuracy("softmax_lse", lse, ref_lse, base_lse)
    # softmax_stats: LSE * log2(e) = stats[0] + stats[1]; rows without keys (+inf, 0).
    empty = torch.isposinf(lse)
    assert torch.equal(torch.isposinf(stats[0]), empty) and torch.all(stats[1][empty] == 0)
    lse2 = (stats[0] + stats[1])[~empty].double()
    assert torch.allclose(lse2, lse[~empty].double() * math.log2(math.e), rtol=1e-5, atol=1e-4)
    if causal and q.shape[1] > k.shape[1]:
        n_empty = q.shape[1] - k.shape[1]
        assert torch.all(out[:, :n_empty] == 0)
        assert torch.all(torch.isposinf(lse[:, :, :n_empty]))
    return out, lse, stats


def check_against_sm80(q, k, v, causal, check_sm80=False, window_left=-1):
    """check_forward on the default path, then O within 3x the same-dtype error of the (forced) sm80
    kernel's and the LSE equal up to fp32 summation order: a skipped or twice-computed tile shows.
    check_sm80: the sm80 outputs through check_forward too. Returns both paths' softmax_stats."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    out90, lse90, st90 = check_forward(q, k, v, causal, window_left=window_left)
    with _sm80_forced():
        out80, lse80, st80 = (check_forward(q, k, v, causal, window_left=window_left) if check_sm80
                              else _forward(q, k, v, scale, causal, window_left=window_left))
    ref_out, _ = attention_ref(q, k, v, scale, causal, upcast=True, window_size=(window_left, -1))
    base_out, _ = attention_ref(q, k, v, scale, causal, upcast=False, window_size=(window_left, -1))
    base_err = (base_out.double() - ref_out.double()).abs().max().item()
    assert (out90.double() - out80.double()).abs().max().item() <= 3 * base_err
    torch.testing.assert_close(lse90, lse80, rtol=1e-5, atol=1e-4)
    return st90, st80


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, dtype=dtype, device="cuda", generator=g)

    return rnd(batch, seqlen_q, nheads, d), rnd(batch, seqlen_k, nheads_k, d), rnd(batch, seqlen_k, nheads_k, d)


@pytest.mark.parametrize("d", SM90_FWD_HDIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_sm90_matches_sm80(dtype, d, causal):
    """The sm90 and the (forced) sm80 kernel of the same GPU: both within the rule, and the
    statistics equal up to fp32 summation order."""
    require_hdim(d, exact=True)
    q, k, v = make_qkv(2, 777, 1029, 6, 2, d, dtype, seed=d)
    st90, st80 = check_against_sm80(q, k, v, causal, check_sm80=True)
    torch.testing.assert_close(st90[0] + st90[1], st80[0] + st80[1], rtol=1e-5, atol=1e-4)


def test_sm90_forward_rows_without_keys():
    """causal, seqlen_q > seqlen_k: whole 128/192-row tiles see no key (no TMA issued) -> 0, +inf."""
    for d in (64, 128):
        require_hdim(d, exact=True)
        q, k, v = make_qkv(1, 1000, 40, 2, 1, d, torch.float16)
        check_forward(q, k, v, causal=True)


def test_sm90_forward_batch_heads_70000():
    """batch * nheads = 70,000 (> 65,535): the tile-index decode of QTileWork (persistent grid)."""
    require_hdim(64, exact=True)
    q, k, v = make_qkv(35, 16, 16, 2000, 500, 64, torch.bfloat16)
    check_forward(q, k, v, causal=True)


@pytest.mark.parametrize("magnitude", [100.0, 133120.0, 1e9])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_forward_large_magnitude(magnitude, causal):
    """Scores far beyond exp's range (the exact P form of primitives/softmax.cuh): finite, accurate."""
    require_hdim(128, exact=True)
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(1, 100, 2, 128, generator=g) * magnitude).to(torch.bfloat16).cuda()
    k = (torch.randn(1, 130, 2, 128, generator=g) * magnitude).to(torch.bfloat16).cuda()
    v = torch.randn(1, 130, 2, 128, generator=g).to(torch.bfloat16).cuda()
    check_forward(q, k, v, causal)
    c = torch.full((1, 100, 2, 128), magnitude).to(torch.bfloat16).cuda()
    ck = torch.full((1, 130, 2, 128), magnitude).to(torch.bfloat16).cuda()
    check_forward(c, ck, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_forward_misaligned_falls_back(d, causal):
    """Inputs TMA cannot describe, correctly: a base pointer 2 bytes off 16-byte alignment (odd
    storage offset into a fused qkv buffer) and a row stride of an odd number of elements are made
    contiguous by the API (flash_api.cpp: aligned_for_cuda; the kernels' 16-byte loads need that on
    every path), and a zero batch stride (K/V broadcast over the batch), which passes that check,
    takes the sm80 kernel in run_mha_fwd (kernels/dispatch.cu: tma_can_describe_inputs)."""
    require_hdim(d, exact=True)
    b, s, h = 2, 257, 4
    dtype = torch.bfloat16
    flat = torch.randn(b * s * 3 * h * d + 1, dtype=dtype, device="cuda")
    qkv = flat[1:].view(b, s, 3, h, d)  # storage offset 1 element: base not 16-byte aligned
    q, k, v = qkv.unbind(2)
    assert q.data_ptr() % 16 != 0
    check_forward(q, k, v, causal)
    # Contiguous views with a misaligned base: contiguous() returned them as they were (a reviewer
    # found it), so the API copies with clone.
    q_c, k_c, v_c = (flat[1 + i * b * s * h * d:][: b * s * h * d].view(b, s, h, d) for i in range(3))
    assert q_c.is_contiguous() and q_c.data_ptr() % 16 != 0
    check_forward(q_c, k_c, v_c, causal)
    # Row stride h*d + 1 elements (2 bytes past a multiple of 16).
    buf = torch.randn(b * s * (h * d + 1) + 64, dtype=dtype, device="cuda")
    q_odd = buf.as_strided((b, s, h, d), (s * (h * d + 1), h * d + 1, d, 1))
    k2, v2 = make_qkv(b, s, s, h, h, d, dtype)[1:]
    check_forward(q_odd, k2, v2, causal)
    # K/V broadcast over the batch (zero batch stride, which TMA refuses).
    check_forward(q_odd, k2[:1].expand_as(k2), v2[:1].expand_as(v2), causal)


def test_sm90_forward_deterministic():
    """Two identical calls give bit-identical outputs (no atomics, fixed order)."""
    require_hdim(128, exact=True)
    q, k, v = make_qkv(2, 1000, 1000, 4, 2, 128, torch.bfloat16)
    a = _forward(q, k, v, 0.1, True)
    b = _forward(q, k, v, 0.1, True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _forward_kernel_names(q, k, v, causal):
    """Names of the CUDA kernels one forward call launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.ops.flash_attn_ext.forward(q, k, v, 0.125, causal)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "flash_fwd_kernel" in e.name]


@pytest.mark.parametrize("d", SM90_FWD_HDIMS)
def test_sm90_forward_kernel_is_the_one_that_runs(d):
    """The dispatch really picks the sm90 kernel (a refused tensor map would fall back to sm80
    silently, and every accuracy test above would still pass), and forcing the sm80 path or a
    zero batch stride picks the sm80 kernel."""
    require_hdim(d, exact=True)
    q, k, v = make_qkv(2, 300, 300, 4, 2, d, torch.bfloat16)
    for causal in (False, True):
        names = _forward_kernel_names(q, k, v, causal)
        assert names and all("sm90" in n for n in names), names
    with _sm80_forced():
        names = _forward_kernel_names(q, k, v, False)
    assert names and all("sm80" in n for n in names), names
    kb = k[:1].expand(2, -1, -1, -1)
    vb = v[:1].expand(2, -1, -1, -1)
    names = _forward_kernel_names(q, kb, vb, False)
    assert names and all("sm80" in n for n in names), names


# ---- The long-key tile row (sm90/tile_config.h: FwdLongTile, chosen by fwd_long_keys): dense
# non-causal calls with >= 8192 keys whose 144-key blocks pad at most 0.5 % more keys than 128-key
# ones take the d128 kernel with 144-key tiles. (seqlen_q, seqlen_k): 8192 and 16384 take it; 8200
# takes it with a ragged last block (136 keys); 12288 does not (0.8 % more padding).


def _long_keys(seqlen_k, causal):
    if causal or seqlen_k < 8192:
        return False
    padded = lambda block: -(-seqlen_k // block) * block  # noqa: E731
    return padded(144) * 1000 <= padded(128) * 1005


def _tile_rows(names):
    """The tile rows the sm90 forward kernels in ``names`` instantiate (their demangled or mangled
    names): "long" (FwdLongTile), "short_causal" (FwdShortTile) or "default" (FwdTile)."""
    return {"long" if "FwdLongTile" in n else "short_causal" if "FwdShortTile" in n else "default"
            for n in names if "sm90" in n}


def _short_causal(d, causal, seqlen_q):
    """Whether a call takes the short causal row (sm90/tile_config.h: FwdShortTile, d128 and d256,
    fwd_short_causal: causal, seqlen_q (varlen: max_seqlen_q) <= kFwdShortCausalMaxSeqlen = 2048) unless
    FLASH_ATTN_EXT_SM90_FWD_SHORT_CAUSAL=0."""
    return (d in (128, 256) and causal and seqlen_q <= 2048
            and os.environ.get("FLASH_ATTN_EXT_SM90_FWD_SHORT_CAUSAL") != "0")


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 8192), (777, 8200), (300, 16384), (500, 12288)])
def test_sm90_forward_long_key_tiles(seqlen_q, seqlen_k):
    """The dispatch picks the long-key row exactly where fwd_long_keys says (non-causal only), and
    both rows are within the rule and agree with the (forced) sm80 kernel, GQA 3:1."""
    require_hdim(128, exact=True)
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 6, 2, 128, torch.bfloat16, seed=seqlen_k)
    for causal in (False, True):
        names = _forward_kernel_names(q, k, v, causal)
        want = ("long" if _long_keys(seqlen_k, causal) else
                "short_causal" if _short_causal(128, causal, seqlen_q) else "default")
        assert _tile_rows(names) == {want}, (causal, names)
        check_against_sm80(q, k, v, causal)


# ---- The short causal row (sm90/tile_config.h: FwdShortTile, chosen by fwd_short_causal): causal
# d128 / d256 calls with at most 2048 queries (varlen: max_seqlen_q; tests/test_varlen_cuda.py has
# the bound's bit-for-bit cases) run 192 x 64 tiles at d128 (three consumer warpgroups, key ranges
# per warpgroup, the partial tile at the top) and 128 x 64 at d256. (seqlen_q, seqlen_k): 1000 (a partial last
# tile), 2048 (the bound, 10.67 tiles), 2049 (past it: FwdTile), (300, 2000) (a causal offset),
# (1500, 700) (rows without keys).


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 1000), (2048, 2048), (2049, 2049), (300, 2000), (1500, 700)])
@pytest.mark.parametrize("d", [128, 256])
def test_sm90_forward_short_causal_tiles(d, seqlen_q, seqlen_k):
    """The dispatch picks the short causal row exactly where fwd_short_causal says (causal only),
    and every row is within the rule and agrees with the (forced) sm80 kernel, GQA 3:1."""
    require_hdim(d, exact=True)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 6, 2, d, torch.bfloat16, seed=seqlen_q + seqlen_k)
    for causal in (False, True):
        names = _forward_kernel_names(q, k, v, causal)
        want = "short_causal" if _short_causal(d, causal, seqlen_q) else "default"
        assert _tile_rows(names) == {want}, (causal, names)
        check_against_sm80(q, k, v, causal)


# ---- The persistent grid (csrc/kernels/common/tile_scheduler.cuh): at most one CTA per SM, each
# walking several Q tiles, with the K/V and Q mbarrier rings running across tiles and causal tiles
# dealt in (heavy, light) pairs when there are more tiles than SMs.


def _block_m(d, causal=False, seqlen_q=0):
    """The sm90 forward's Q tile rows of a dense call (csrc/kernels/sm90/tile_config.h): three
    consumer warpgroups at d64 and d96 (FwdTile) and on d128's short causal row (FwdShortTile), two
    otherwise (d256's short causal row too)."""
    return 192 if d in (64, 96) or (d == 128 and _short_causal(d, causal, seqlen_q)) else 128


def _key_ranges(d, causal=False, seqlen_q=0):
    """Whether the kernel a dense call runs skips a warpgroup's empty key range
    (FwdKernelTraits::kWarpgroupKeyRanges): every row but d128's FwdTile."""
    return d != 128 or _short_causal(d, causal, seqlen_q)


def _num_sms():
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


# (seqlen_q, seqlen_k): causal rows without keys (whole 128/192-row tiles with n_block_max == 0
# between tiles with keys: no loads, O = 0, LSE = +inf); an odd number of 128-row Q tiles (5: the
# heaviest causal tile is a unit of its own) next to 4 of 192 rows; an odd count of 192-row tiles (3).
PERSISTENT_PAIRS = [(700, 400), (600, 601), (500, 333)]


@pytest.mark.parametrize("seqlen_q,seqlen_k", PERSISTENT_PAIRS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", SM90_FWD_HDIMS)
def test_sm90_forward_persistent_many_tiles(d, causal, seqlen_q, seqlen_k):
    """More than twice as many Q tiles as SMs, not a multiple of the SM count: every CTA walks
    several tiles and CTAs walk different numbers of them (and of key blocks), GQA."""
    require_hdim(d, exact=True)
    batch, nheads, nheads_k = 2, 48, 16
    block_m = _block_m(d, causal, seqlen_q)
    tiles = batch * nheads * math.ceil(seqlen_q / block_m)
    assert tiles > 2 * _num_sms() or _num_sms() > 150, (tiles, _num_sms())
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, d, torch.bfloat16, seed=d + seqlen_q)
    check_forward(q, k, v, causal)


def test_sm90_forward_persistent_batch_heads_70000():
    """batch * nheads = 70,000 with 2 Q tiles each (140,000 tiles, 70,000 causal pairs), rows without
    keys in the first tile: against the (forced) sm80 kernel everywhere, the reference on one batch."""
    require_hdim(64, exact=True)
    q, k, v = make_qkv(35, 200, 100, 2000, 500, 64, torch.bfloat16, seed=3)
    out, lse, _ = _forward(q, k, v, 0.125, True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    with _sm80_forced():
        out80, lse80, _ = _forward(q, k, v, 0.125, True)
    assert torch.all(out[:, :100] == 0) and torch.all(torch.isposinf(lse[:, :, :100]))
    # Two kernels, the same math in another order (key block widths, P rounding points): a wrong or
    # skipped tile shows as O(1) differences, rounding as a few bf16 ulps.
    diff = (out.float() - out80.float()).abs()
    assert diff.max().item() <= 0.1 and diff.mean().item() <= 2e-3, (diff.max().item(), diff.mean().item())
    torch.testing.assert_close(lse, lse80, rtol=1e-5, atol=1e-4)
    ref_out, ref_lse = attention_ref(q[:1], k[:1], v[:1], 0.125, True, upcast=True)
    base_out, base_lse = attention_ref(q[:1], k[:1], v[:1], 0.125, True, upcast=False)
    check_accuracy("out", out[:1], ref_out, base_out)
    check_accuracy("softmax_lse", lse[:1], ref_lse, base_lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", SM90_FWD_HDIMS)
def test_sm90_forward_persistent_deterministic(d, causal):
    """Many tiles per CTA (two Q buffers at d64, d96 and d128; one at d192 and d256, whose O is
    staged in the V ring): three calls, bit-identical outputs."""
    require_hdim(d, exact=True)
    q, k, v = make_qkv(4, 1000, 1000, 16, 4, d, torch.bfloat16, seed=11)
    first = _forward(q, k, v, 0.1, causal)
    for _ in range(2):
        again = _forward(q, k, v, 0.1, causal)
        for x, y in zip(first, again):
            assert torch.equal(x, y)


# ---- Tiles of one key block (seqlen_k <= kBlockN), many per CTA: the next tile's loads follow
# each epilogue most closely. With one Q buffer (d192, d256: FwdKernelTraits::kStageOInV) O is
# staged in the V ring: the producer's next V waits for the O store to have read it (o_free), and
# the Q buffer is released before the tile's last P V. A missing wait shows as another tile's V or
# O in the output. Causal (2048, 100): 15 of 16 tiles per (batch, head) see no key (O = 0 staged
# through the ring, no loads), between tiles with keys.


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", SM90_FWD_HDIMS)
def test_sm90_forward_one_key_block_tiles(d, causal, dtype):
    """seqlen_k = 100 (one key block) under 2048 query rows, 48 heads (GQA 3:1), 2 batches: every CTA
    walks many tiles; within the rule against the reference and against the (forced) sm80 kernel."""
    require_hdim(d, exact=True)
    q, k, v = make_qkv(2, 2048, 100, 48, 16, d, dtype, seed=d + 7)
    check_against_sm80(q, k, v, causal)


# ---- Warpgroup key ranges (sm90 FwdKernelTraits::kWarpgroupKeyRanges: d64, d96, d192, d256): each
# consumer warpgroup visits only the key blocks its own 64 rows see, passing its turns and
# releasing the ring stages of the others; the scheduler deals the units holding a tile with a
# warpgroup without rows after all the others. (seqlen_q, seqlen_k):
#   (1024, 1024): d64's / d96's last 192-row tile has 64 rows (two warpgroups without rows, light
#   units last);
#   (1088, 1088): its last tile has 128 rows (one without rows);
#   (1000, 900): causal rows 0..99 see no key: a warpgroup with no key inside a tile with keys;
#   (300, 2000): causal offset 1700 (not a multiple of 64): every warpgroup its own last block;
#   (1000, 850): causal d64 / d96 with the partial tile at the top (FwdTileScheduler::m_shift = 128: the
#   first tile's two warpgroups above row 0 store nothing) and rows 0..149 without keys.
# Causal d64 / d96 at 1024 / 1088 / 1000 also start their tiles above row 0 (m_shift 128 / 64 / 128).
WARPGROUP_RANGE_PAIRS = [(1024, 1024), (1088, 1088), (1000, 900), (300, 2000), (1000, 850)]


@pytest.mark.parametrize("seqlen_q,seqlen_k", WARPGROUP_RANGE_PAIRS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", SM90_FWD_HDIMS)
def test_sm90_forward_warpgroup_key_ranges(d, causal, seqlen_q, seqlen_k):
    """Tiles whose warpgroups see different key ranges, on the persistent grid (more tiles than
    twice the SMs): within the rule against the reference, and against the (forced) sm80 kernel."""
    require_hdim(d, exact=True)
    batch, nheads, nheads_k = 2, 48, 16
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, d, torch.bfloat16, seed=d + seqlen_k)
    check_against_sm80(q, k, v, causal)


def _top_shift():
    """Whether the scheduler puts a causal partial tile at the top (FLASH_ATTN_EXT_SM90_FWD_TOP_SHIFT
    not 0; read once per process)."""
    return os.environ.get("FLASH_ATTN_EXT_SM90_FWD_TOP_SHIFT") != "0"


def _split_tail_units(bh, seqlen_q, block_m, causal, num_sms, skips_empty_warpgroups, window=False):
    """csrc/kernels/common/tile_scheduler.cuh's split-tail count (FwdTileScheduler::make), dense
    persistent calls: how many causal pairs it deals as single tiles after the other full units.
    window: a left window bound (no top-aligned partial tile, so the light units stay)."""
    num_m = math.ceil(seqlen_q / block_m)
    if not (causal and num_m >= 2 and bh * num_m > num_sms):
        return 0
    units_per_bh = (num_m + 1) // 2
    rows_last = seqlen_q % block_m
    partial = skips_empty_warpgroups and 0 < rows_last <= block_m - 64  # a warpgroup without rows
    shifted = partial and not window and _top_shift()  # m_shift > 0: the partial tile at the top, no light units
    light = partial and units_per_bh >= 2 and not shifted
    k = units_per_bh - 1 if light else units_per_bh
    full, rest = bh * k, (bh * k) % num_sms
    fits = 2 * rest + (bh if light else 0) <= num_sms
    return rest if k >= 2 and full > num_sms and 0 < rest <= bh and fits else 0


# (d, batch, nheads, nheads_k, seqlen): on 132 SMs each splits a causal tail: d128's FwdTile an even
# and an odd number of Q tiles per sequence (18, 19: past the short causal row's 2048), d64 / d96 /
# d128's short causal row with the partial tile at the top (6 and 9 tiles of 192 rows, m_shift 128).
SPLIT_TAIL_CASES = [(128, 3, 5, 5, 2304), (128, 2, 7, 7, 2432), (64, 2, 25, 5, 1000), (64, 3, 9, 1, 1600),
                    (96, 2, 25, 5, 1000), (128, 2, 25, 5, 1000)]


@pytest.mark.parametrize("d,batch,nheads,nheads_k,seqlen", SPLIT_TAIL_CASES)
def test_sm90_forward_persistent_split_tail(d, batch, nheads, nheads_k, seqlen):
    """Causal calls whose full units leave a short last round: the scheduler's split tail (the last
    pairs dealt as single tiles) and, at d64, the light units after it. Every tile must be computed
    once: within the rule against the reference, and against the (forced) sm80 kernel."""
    require_hdim(d, exact=True)
    block_m = _block_m(d, True, seqlen)
    split = _split_tail_units(batch * nheads, seqlen, block_m, True, _num_sms(), _key_ranges(d, True, seqlen))
    if _num_sms() == 132 and _top_shift():
        assert split > 0, "the case no longer exercises the split tail on this GPU"
    q, k, v = make_qkv(batch, seqlen, seqlen, nheads, nheads_k, d, torch.bfloat16, seed=seqlen + d)
    check_against_sm80(q, k, v, True)


# (d, batch, nheads, nheads_k, seqlen, window_left): causal with a left window bound: no partial tile
# at the top, so d64's light units (the last tile's warpgroups without rows) follow the split tail.
WINDOW_SPLIT_TAIL_CASES = [(64, 2, 35, 7, 1000, 300), (64, 2, 17, 1, 1600, 700)]


@pytest.mark.parametrize("d,batch,nheads,nheads_k,seqlen,window_left", WINDOW_SPLIT_TAIL_CASES)
def test_sm90_forward_persistent_split_tail_window(d, batch, nheads, nheads_k, seqlen, window_left):
    """Windowed causal calls with a split tail and light units: every tile computed once, within the
    rule against the reference and against the (forced) sm80 kernel."""
    require_hdim(d, exact=True)
    split = _split_tail_units(batch * nheads, seqlen, 192, True, _num_sms(), True, window=True)
    if _num_sms() == 132:
        assert split > 0, "the case no longer exercises the split tail on this GPU"
    q, k, v = make_qkv(batch, seqlen, seqlen, nheads, nheads_k, d, torch.bfloat16, seed=seqlen + window_left)
    check_against_sm80(q, k, v, True, window_left=window_left)


_TOP_SHIFT_OFF_SCRIPT = """
import sys, torch, flash_attn_ext
q, k, v = torch.load(sys.argv[1])
out, lse, _ = torch.ops.flash_attn_ext.forward(q, k, v, float(sys.argv[3]), True)
torch.save((out, lse), sys.argv[2])
"""


@pytest.mark.parametrize("seqlen", [1000, 1088])
def test_sm90_forward_top_shift_knob(seqlen, tmp_path):
    """The partial Q tile at the top (FwdTileScheduler::m_shift; d64 causal, 192-row tiles: m_shift
    128 at 1000, 64 at 1088) and, in a subprocess with FLASH_ATTN_EXT_SM90_FWD_TOP_SHIFT=0, at the
    bottom (the light units): both within the rule against the reference and bit for bit the same
    (the shift moves whole 64-row warpgroup slabs; each keeps its own key range, hence its
    summation order)."""
    require_hdim(64, exact=True)
    batch, nheads, nheads_k, d = 2, 48, 16, 64
    q, k, v = make_qkv(batch, seqlen, seqlen, nheads, nheads_k, d, torch.bfloat16, seed=seqlen)
    scale = 1.0 / math.sqrt(d)
    torch.save((q, k, v), tmp_path / "qkv.pt")
    env = dict(os.environ, FLASH_ATTN_EXT_SM90_FWD_TOP_SHIFT="0")
    r = subprocess.run([sys.executable, "-c", _TOP_SHIFT_OFF_SCRIPT, str(tmp_path / "qkv.pt"), str(tmp_path / "out.pt"),
                        repr(scale)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    out_off, lse_off = torch.load(tmp_path / "out.pt")
    out_on, lse_on, _ = check_forward(q, k, v, True)  # the shift as configured (on unless the knob says 0)
    ref_out, ref_lse = attention_ref(q, k, v, scale, True, upcast=True)
    base_out, base_lse = attention_ref(q, k, v, scale, True, upcast=False)
    check_accuracy("out (top shift off)", out_off, ref_out, base_out)
    check_accuracy("softmax_lse (top shift off)", lse_off, ref_lse, base_lse)
    assert torch.equal(out_on, out_off) and torch.equal(lse_on, lse_off)
