"""flash_attn_with_kvcache's rotary embedding (rotary_cos / rotary_sin / rotary_interleaved),
cache_batch_idx and cache_leftpad, flash-attn's semantics, on the CPU and (when one is visible) a
CUDA GPU.

The rotation's reference is independent of the implementation: each rotated pair as a complex
number times exp(i theta) in float64 (RoFormer, Su et al. 2021, eq. 34), at flash-attn's
positions (new key j at cache_seqlens[b] + j; query i at cache_seqlens[b] + i when causal, else
every query at cache_seqlens[b]). The attention is checked by the accuracy rule
(tests/accuracy.py): ref = float64 rotation and attention, baseline = both in the inputs' dtype.
"""

import pytest
import torch

import flash_attn_ext
from accuracy import check_accuracy
from flash_attn_ext.reference import attention_kvcache_ref

DEVICES = [("cpu", torch.float32), ("cpu", torch.bfloat16)] + [
    pytest.param("cuda", dt, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))
    for dt in (torch.bfloat16, torch.float16)]


def rotate_ref(x, cos, sin, positions, interleaved, dtype=torch.float64):
    """x (batch, seqlen, heads, d) rotated in ``dtype``: the pairs of the first rotary_dim =
    2 * cos.size(1) channels as complex numbers times cos + i sin at ``positions`` (batch, seqlen)."""
    rd = 2 * cos.shape[1]
    xr = x[..., :rd].to(dtype)
    c = cos[positions].to(dtype)[:, :, None, :]
    s = sin[positions].to(dtype)[:, :, None, :]
    if interleaved:
        re, im = xr[..., 0::2], xr[..., 1::2]
    else:
        re, im = xr[..., :rd // 2], xr[..., rd // 2:]
    out_re, out_im = re * c - im * s, re * s + im * c
    y = torch.stack((out_re, out_im), -1).flatten(-2) if interleaved else torch.cat((out_re, out_im), -1)
    return torch.cat((y, x[..., rd:].to(dtype)), -1)


def _tables(seqlen_ro, rotary_dim, dtype, device, g):
    theta = torch.rand(seqlen_ro, rotary_dim // 2, generator=g, dtype=torch.float64) * 6.3
    return theta.cos().to(dtype).to(device), theta.sin().to(dtype).to(device)


def _cache_rows(cache, table, b, rows):
    """The cache rows `rows` of sequence b (contiguous: cache[b]; paged: through its block table)."""
    if table is None:
        return cache[b, rows]
    page = cache.shape[1]
    return torch.stack([cache[table[b, r // page], r % page] for r in rows])


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 32])
@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_kvcache_rotary_matches_reference(device, dtype, interleaved, causal, rotary_dim, page_size, seqlen_q):
    _check_rotary(device, dtype, interleaved, causal, rotary_dim, page_size, seqlen_q)


@pytest.mark.parametrize("window,per_token", [((5, 0), True), ((5, 2), True), ((-1, 3), True),
                                              ((1000, 1000), False), ((64, -1), False)])
def test_kvcache_rotary_window_positions(window, per_token):
    """flash-attn rotates each query at its own position when causal or local; a window side at
    least the cache's rows (64 here) is no window (flash-attn drops it), so the queries share
    cache_seqlens[b] as without one."""
    _check_rotary("cpu", torch.float32, False, False, 32, 0, 3, window, per_token)


def _check_rotary(device, dtype, interleaved, causal, rotary_dim, page_size, seqlen_q, window=(-1, -1),
                  per_token=None):
    per_token = causal if per_token is None else per_token
    g = torch.Generator().manual_seed(7)
    batch, seqlen_cache, nheads, nheads_k, d, seqlen_new = 3, 64, 4, 2, 32, 3
    if page_size:
        num_blocks = batch * seqlen_cache // page_size + 2
        kc = torch.randn(num_blocks, page_size, nheads_k, d, generator=g).to(dtype)
        vc = torch.randn(num_blocks, page_size, nheads_k, d, generator=g).to(dtype)
        table = torch.randperm(num_blocks, generator=g)[:batch * seqlen_cache // page_size]
        table = table.view(batch, -1).int().to(device)
    else:
        kc = torch.randn(batch, seqlen_cache, nheads_k, d, generator=g).to(dtype)
        vc = torch.randn(batch, seqlen_cache, nheads_k, d, generator=g).to(dtype)
        table = None
    kc, vc = kc.to(device), vc.to(device)
    q = torch.randn(batch, seqlen_q, nheads, d, generator=g).to(dtype).to(device)
    k = torch.randn(batch, seqlen_new, nheads_k, d, generator=g).to(dtype).to(device)
    v = torch.randn(batch, seqlen_new, nheads_k, d, generator=g).to(dtype).to(device)
    cos, sin = _tables(seqlen_cache + 5, rotary_dim, dtype, device, g)
    cache_seqlens = torch.tensor([0, 17, seqlen_cache - seqlen_new], dtype=torch.int32, device=device)
    q_before, k_before, kc_before = q.clone(), k.clone(), kc.clone()

    out, lse = flash_attn_ext.flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=cache_seqlens, block_table=table, causal=causal, window_size=window,
        rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, return_lse=True)

    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # the caller's tensors are not rotated
    start = cache_seqlens.long()[:, None]
    pos_k = start + torch.arange(seqlen_new, device=device)
    pos_q = start + (torch.arange(seqlen_q, device=device) if per_token else torch.zeros(seqlen_q, dtype=torch.long,
                                                                                         device=device))
    k_rot = rotate_ref(k, cos, sin, pos_k, interleaved)
    # The appended rows: the float64 rotation rounded to the dtype, within one rounding (the op
    # rotates in float32).
    for b in range(batch):
        rows = list(range(int(cache_seqlens[b]), int(cache_seqlens[b]) + seqlen_new))
        torch.testing.assert_close(_cache_rows(kc, table, b, rows).double(), k_rot[b].to(dtype).double(),
                                   rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    # Other rows untouched.
    changed = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for b in range(batch):
        for r in range(int(cache_seqlens[b]), int(cache_seqlens[b]) + seqlen_new):
            blk, row = (int(table[b, r // page_size]), r % page_size) if page_size else (b, r)
            changed[blk, row] = True
    assert torch.equal(kc[~changed.to(device)], kc_before[~changed.to(device)])

    # The attention: ref in float64 (rotation and attention), baseline both in the dtype.
    used = cache_seqlens + seqlen_new
    kc64 = kc.double()
    kc_base = kc.clone()
    k_base = rotate_ref(k, cos, sin, pos_k, interleaved, dtype=torch.promote_types(dtype, torch.float32)).to(dtype)
    for b in range(batch):
        for j in range(seqlen_new):
            r = int(cache_seqlens[b]) + j
            blk, row = (int(table[b, r // page_size]), r % page_size) if page_size else (b, r)
            kc64[blk, row] = k_rot[b, j]
            kc_base[blk, row] = k_base[b, j]
    ref, ref_lse = attention_kvcache_ref(rotate_ref(q, cos, sin, pos_q, interleaved), kc64, vc.double(), used,
                                         table, causal=causal, window_size=window)
    q_base = rotate_ref(q, cos, sin, pos_q, interleaved, dtype=torch.promote_types(dtype, torch.float32)).to(dtype)
    base, base_lse = attention_kvcache_ref(q_base, kc_base, vc, used, table, causal=causal, upcast=False,
                                           window_size=window)
    check_accuracy("out", out, ref, base)
    check_accuracy("softmax_lse", lse, ref_lse, base_lse)


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("seqlen_new", [0, 2])
def test_kvcache_cache_batch_idx(device, dtype, seqlen_new):
    """Sequence b reads and appends to k_cache[cache_batch_idx[b]]: the same as a call on those
    rows gathered, and the cache's other entries are left alone."""
    g = torch.Generator().manual_seed(3)
    batch, batch_cache, seqlen_cache, nheads, nheads_k, d = 2, 5, 48, 4, 2, 32
    kc = torch.randn(batch_cache, seqlen_cache, nheads_k, d, generator=g).to(dtype).to(device)
    vc = torch.randn(batch_cache, seqlen_cache, nheads_k, d, generator=g).to(dtype).to(device)
    idx = torch.tensor([3, 1], dtype=torch.int32, device=device)
    q = torch.randn(batch, 2, nheads, d, generator=g).to(dtype).to(device)
    k = torch.randn(batch, seqlen_new, nheads_k, d, generator=g).to(dtype).to(device) if seqlen_new else None
    v = torch.randn(batch, seqlen_new, nheads_k, d, generator=g).to(dtype).to(device) if seqlen_new else None
    cache_seqlens = torch.tensor([30, 7], dtype=torch.int32, device=device)
    kc_before, vc_before = kc.clone(), vc.clone()

    out, lse = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=cache_seqlens, causal=True,
                                                      cache_batch_idx=idx, return_lse=True)

    expected_k, expected_v = kc_before.clone(), vc_before.clone()
    if seqlen_new:
        for b in range(batch):
            r = int(cache_seqlens[b])
            expected_k[int(idx[b]), r:r + seqlen_new] = k[b]
            expected_v[int(idx[b]), r:r + seqlen_new] = v[b]
    assert torch.equal(kc, expected_k) and torch.equal(vc, expected_v)
    gathered_k, gathered_v = expected_k[idx.long()], expected_v[idx.long()]
    used = cache_seqlens + seqlen_new
    ref, ref_lse = attention_kvcache_ref(q, gathered_k, gathered_v, used, causal=True)
    base, base_lse = attention_kvcache_ref(q, gathered_k, gathered_v, used, causal=True, upcast=False)
    check_accuracy("out", out, ref, base)
    check_accuracy("softmax_lse", lse, ref_lse, base_lse)


def _args():
    g = torch.Generator().manual_seed(0)
    return dict(q=torch.randn(2, 1, 4, 32, generator=g), k_cache=torch.randn(2, 32, 2, 32, generator=g),
                v_cache=torch.randn(2, 32, 2, 32, generator=g), k=torch.randn(2, 1, 2, 32, generator=g),
                v=torch.randn(2, 1, 2, 32, generator=g), cache_seqlens=torch.tensor([3, 9], dtype=torch.int32),
                rotary_cos=torch.ones(40, 8), rotary_sin=torch.zeros(40, 8))


@pytest.mark.parametrize("change,match", [
    (lambda a: a.pop("rotary_sin"), "rotary_cos and rotary_sin must be given together"),
    (lambda a: a.update(k=None, v=None), "rotate the new keys k"),
    (lambda a: a.update(rotary_cos=torch.ones(40, 8, dtype=torch.float64)), "rotary_cos has shape .* dtype"),
    (lambda a: a.update(rotary_sin=torch.zeros(40)), "rotary_sin has shape"),
    (lambda a: a.update(rotary_sin=torch.zeros(41, 8)), "rotary_sin has shape .* but rotary_cos has"),
    (lambda a: a.update(rotary_cos=torch.ones(40, 4), rotary_sin=torch.zeros(40, 4)), "a multiple of 16"),
    (lambda a: a.update(rotary_cos=torch.ones(40, 24), rotary_sin=torch.zeros(40, 24)), "at most headdim = 32"),
    (lambda a: a.update(rotary_cos=torch.ones(31, 8), rotary_sin=torch.zeros(31, 8)), "at least the cache's 32"),
    # Queries past the keys with a nearly full cache: positions 30 + 11 = 41 past 40 rows (were clamped).
    (lambda a: a.update(q=torch.randn(2, 12, 4, 32), cache_seqlens=torch.tensor([3, 30], dtype=torch.int32),
                        causal=True), "rotary position 41 .* past rotary_cos's 40 rows"),
    (lambda a: a.update(k_cache=torch.randn(2, 0, 2, 32), v_cache=torch.randn(2, 0, 2, 32), k=torch.randn(2, 0, 2, 32),
                        v=torch.randn(2, 0, 2, 32), cache_seqlens=torch.zeros(2, dtype=torch.int32),
                        rotary_cos=torch.ones(0, 8), rotary_sin=torch.zeros(0, 8)), "has 0 rows .* at least 1"),
    (lambda a: a.update(cache_seqlens=None), "need cache_seqlens"),                   # the op's own check first
    (lambda a: a.update(q=torch.randn(2, 1, 3, 32)), "nheads"),                       # likewise
    (lambda a: a.update(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32),
                        block_table=torch.zeros(2, 2, dtype=torch.int32)), "cache_batch_idx and block_table"),
    (lambda a: a.update(cache_batch_idx=torch.tensor([0, 1])), "cache_batch_idx has dtype torch.int64"),
    (lambda a: a.update(cache_batch_idx=torch.tensor([0], dtype=torch.int32)), r"cache_batch_idx .* shape \[1\]"),
    (lambda a: a.update(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)), r"indices in \[0, batch_cache = 2\)"),
    (lambda a: a.update(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32), k_cache=torch.randn(2, 40, 2, 32),
                        v_cache=torch.randn(2, 40, 2, 32), rotary_cos=None, rotary_sin=None),
     r"seqlen_cache \(k_cache.size\(1\) = 40\) a multiple of 16"),
])
def test_kvcache_rotary_and_batch_idx_bad_input(change, match):
    args = _args()
    change(args)
    before = args["k_cache"].clone()
    with pytest.raises(RuntimeError, match=match):
        flash_attn_ext.flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before)  # refused before anything was written


def test_kvcache_strided_last_dim_q_k_v_are_copied():
    """q, k and v with a last dim of another stride are copied contiguous first (flash-attn's
    maybe_contiguous; they were refused): the same results as contiguous copies."""
    args = _args()
    args.update(rotary_cos=None, rotary_sin=None)
    strided = {n: torch.stack([args[n], args[n]], dim=-1)[..., 0] for n in ("q", "k", "v")}
    assert all(t.stride(-1) == 2 for t in strided.values())
    caches = {n: args[n].clone() for n in ("k_cache", "v_cache")}
    want = flash_attn_ext.flash_attn_with_kvcache(**args)
    got = flash_attn_ext.flash_attn_with_kvcache(**{**args, **strided, **caches})
    assert torch.equal(got, want) and torch.equal(caches["k_cache"], args["k_cache"])


def test_kvcache_rotary_identity_tables_change_nothing():
    """cos = 1, sin = 0 rotates nothing: the call equals the one without tables, bit for bit."""
    args = _args()
    plain = {n: t for n, t in args.items() if not n.startswith("rotary")}
    kc, vc = args["k_cache"].clone(), args["v_cache"].clone()
    want = flash_attn_ext.flash_attn_with_kvcache(**dict(plain, k_cache=kc, v_cache=vc), causal=True)
    got = flash_attn_ext.flash_attn_with_kvcache(**args, causal=True)
    assert torch.equal(got, want) and torch.equal(args["k_cache"], kc)


def test_kvcache_rotary_and_batch_idx_compile_fullgraph():
    """A decode step with rotary tables and cache_batch_idx traces with no graph break and gives
    the eager bits."""
    args = _args()
    args.update(cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32), rotary_cos=torch.rand(40, 8).cos(),
                rotary_sin=torch.rand(40, 8).sin())
    eager_kc, eager_vc = args["k_cache"].clone(), args["v_cache"].clone()
    want = flash_attn_ext.flash_attn_with_kvcache(**dict(args, k_cache=eager_kc, v_cache=eager_vc), causal=True,
                                                  rotary_interleaved=False)
    torch._dynamo.reset()

    def step(q, k_cache, v_cache, k, v, cache_seqlens, cos, sin, idx):
        return flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                                      rotary_cos=cos, rotary_sin=sin, cache_batch_idx=idx,
                                                      causal=True, rotary_interleaved=False)

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(
        args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["cache_seqlens"],
        args["rotary_cos"], args["rotary_sin"], args["cache_batch_idx"])
    assert torch.equal(got, want)
    assert torch.equal(args["k_cache"], eager_kc) and torch.equal(args["v_cache"], eager_vc)


def test_kvcache_rotary_default_scale_compiles_dynamic():
    """Rotary tables with the default softmax_scale under torch.compile(dynamic=True, fullgraph=True):
    the scale 1 / sqrt(headdim) is a symbolic float there, which the wrapper's early shape checks
    passed to math.isfinite (Dynamo: "torch.* op returned non-Tensor"); the op's fake kernel checks
    it. Varying batch and new-key counts, each the eager bits."""
    def step(q, k_cache, v_cache, k, v, cache_seqlens, cos, sin):
        return flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                                      cache_seqlens=cache_seqlens, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    cos, sin = torch.rand(64, 8).cos(), torch.rand(64, 8).sin()
    for batch, new in ((2, 2), (3, 5), (4, 3)):
        q = torch.randn(batch, 1, 6, 16)
        kc, vc = torch.randn(batch, 32, 3, 16), torch.randn(batch, 32, 3, 16)
        k, v = torch.randn(batch, new, 3, 16), torch.randn(batch, new, 3, 16)
        seqlens = torch.randint(0, 32 - new, (batch,), dtype=torch.int32)
        eager_kc, eager_vc = kc.clone(), vc.clone()
        want = step(q, eager_kc, eager_vc, k, v, seqlens, cos, sin)
        assert torch.equal(compiled(q, kc, vc, k, v, seqlens, cos, sin), want)
        assert torch.equal(kc, eager_kc) and torch.equal(vc, eager_vc)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kvcache_rotary_and_batch_idx_cuda_graph():
    """A decode step with rotary tables and cache_batch_idx captured in a CUDA graph: each replay
    gives the bits of the eager call on the same inputs (the rotation's torch ops are captured
    with the kernels; nothing reads values on the host)."""
    args = {n: t.to("cuda", torch.bfloat16 if t.is_floating_point() else t.dtype) for n, t in _args().items()}
    args.update(cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32, device="cuda"),
                rotary_cos=torch.rand(40, 8, device="cuda").cos().bfloat16(),
                rotary_sin=torch.rand(40, 8, device="cuda").sin().bfloat16())
    kc0, vc0 = args["k_cache"].clone(), args["v_cache"].clone()

    def step():
        return flash_attn_ext.flash_attn_with_kvcache(**args, causal=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seqlens in ([3, 9], [20, 0]):
        args["cache_seqlens"].copy_(torch.tensor(seqlens, dtype=torch.int32))
        args["k_cache"].copy_(kc0), args["v_cache"].copy_(vc0)
        graph.replay()
        replayed_kc = args["k_cache"].clone()
        args["k_cache"].copy_(kc0), args["v_cache"].copy_(vc0)
        want = step()
        assert torch.equal(out, want) and torch.equal(replayed_kc, args["k_cache"])


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, 0))])
@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("seqlen_new", [0, 2])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_kvcache_leftpad_matches_reference(device, dtype, causal, window, seqlen_q, seqlen_new, num_splits):
    """Sequence b sees cache rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new) as a sequence of
    its own: the reference runs those rows moved to the front of a cache. Rows before the leftpad
    hold NaN (they must never reach the output); the append writes at rows cache_seqlens[b] + i."""
    g = torch.Generator().manual_seed(11)
    batch, seqlen_cache, nheads, nheads_k, d = 4, 96, 4, 2, 64
    kc = torch.randn(batch, seqlen_cache, nheads_k, d, generator=g).to(dtype)
    vc = torch.randn(batch, seqlen_cache, nheads_k, d, generator=g).to(dtype)
    cache_seqlens = torch.tensor([10, 40, 70, 96 - seqlen_new], dtype=torch.int32)
    leftpad = torch.tensor([3, 0, 69, 17], dtype=torch.int32)   # 69: one key left once 70 rows are in use
    for b in range(batch):
        kc[b, :int(leftpad[b])] = float("nan")
        vc[b, :int(leftpad[b])] = float("nan")
        kc[b, int(cache_seqlens[b]) + seqlen_new:] = float("nan")
        vc[b, int(cache_seqlens[b]) + seqlen_new:] = float("nan")
    q = torch.randn(batch, seqlen_q, nheads, d, generator=g).to(dtype)
    k = torch.randn(batch, seqlen_new, nheads_k, d, generator=g).to(dtype) if seqlen_new else None
    v = torch.randn(batch, seqlen_new, nheads_k, d, generator=g).to(dtype) if seqlen_new else None
    to = (lambda t: None if t is None else t.to(device))
    kc_d, vc_d = kc.to(device), vc.to(device)
    out, lse = flash_attn_ext.flash_attn_with_kvcache(
        q.to(device), kc_d, vc_d, to(k), to(v), cache_seqlens=cache_seqlens.to(device),
        cache_leftpad=leftpad.to(device), causal=causal, window_size=window, num_splits=num_splits, return_lse=True)
    if seqlen_new:  # appended at the absolute rows, the leftpad notwithstanding
        for b in range(batch):
            r = int(cache_seqlens[b])
            kc[b, r:r + seqlen_new], vc[b, r:r + seqlen_new] = k[b], v[b]
    torch.testing.assert_close(kc_d.cpu(), kc, equal_nan=True, rtol=0, atol=0)
    _check_leftpad_attention(out, lse, q, kc, vc, cache_seqlens + seqlen_new, leftpad, causal, window)


def _check_leftpad_attention(out, lse, q, kc, vc, used, leftpad, causal, window):
    """The accuracy rule for a call with cache_leftpad: the reference runs each sequence's rows
    [leftpad[b], used[b]) of the (CPU, post-append) cache moved to the front of a cache."""
    front_k, front_v = torch.zeros_like(kc), torch.zeros_like(vc)
    for b in range(kc.shape[0]):
        lp, n = int(leftpad[b]), int(used[b])
        front_k[b, :n - lp], front_v[b, :n - lp] = kc[b, lp:n], vc[b, lp:n]
    ref, ref_lse = attention_kvcache_ref(q, front_k, front_v, used - leftpad, causal=causal, window_size=window)
    base, base_lse = attention_kvcache_ref(q, front_k, front_v, used - leftpad, causal=causal, window_size=window,
                                           upcast=False)
    check_accuracy("out", out.cpu(), ref, base)
    check_accuracy("softmax_lse", lse.cpu(), ref_lse, base_lse)


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_kvcache_leftpad_edges(device, dtype):
    """A leftpad of every row in use leaves no key (out 0, LSE +inf); no cache_seqlens means every
    cache row is in use; leftpad 0 is the plain call, bit for bit."""
    g = torch.Generator().manual_seed(5)
    kc = torch.randn(2, 32, 2, 32, generator=g).to(dtype).to(device)
    vc = torch.randn(2, 32, 2, 32, generator=g).to(dtype).to(device)
    q = torch.randn(2, 1, 4, 32, generator=g).to(dtype).to(device)
    seqlens = torch.tensor([7, 20], dtype=torch.int32, device=device)
    out, lse = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, cache_leftpad=seqlens.clone(),
                                                      return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse > 0).all()
    zero = torch.zeros(2, dtype=torch.int32, device=device)
    assert torch.equal(flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, cache_leftpad=zero),
                       flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens))
    lp = torch.tensor([5, 30], dtype=torch.int32, device=device)
    full = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_leftpad=lp, causal=True)
    for b in range(2):
        row = flash_attn_ext.flash_attn_func(q[b:b + 1], kc[b:b + 1, int(lp[b]):], vc[b:b + 1, int(lp[b]):])
        torch.testing.assert_close(full[b:b + 1], row, rtol=0, atol=2 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(cache_leftpad=torch.tensor([0, 1])), "cache_leftpad has dtype"),
    (lambda a: a.update(cache_leftpad=torch.tensor([0], dtype=torch.int32)), r"cache_leftpad has shape \[1\]"),
    (lambda a: a.update(cache_leftpad=torch.tensor([[0, 1]], dtype=torch.int32)), r"cache_leftpad has shape \[1, 2\]"),
    (lambda a: a.update(cache_leftpad=torch.zeros(4, dtype=torch.int32)[::2]), "cache_leftpad must be contiguous"),
    (lambda a: a.update(cache_leftpad=torch.zeros(2, dtype=torch.int32), k_cache=torch.randn(5, 16, 2, 32),
                        v_cache=torch.randn(5, 16, 2, 32), block_table=torch.zeros(2, 2, dtype=torch.int32)),
     "cache_leftpad with block_table"),
    (lambda a: a.update(cache_leftpad=torch.zeros(2, dtype=torch.int32),
                        cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32)), "cache_batch_idx with cache_leftpad"),
    (lambda a: a.update(cache_leftpad=torch.tensor([0, 11], dtype=torch.int32)),
     r"cache_leftpad\[1\] = 11; expected in \[0, cache_seqlens\[b\] \+ seqlen_new = 10\]"),
    (lambda a: a.update(cache_leftpad=torch.tensor([-1, 0], dtype=torch.int32)), r"cache_leftpad\[0\] = -1"),
])
def test_kvcache_leftpad_bad_input(change, match):
    args = {n: t for n, t in _args().items() if not n.startswith("rotary")}
    change(args)
    before = args["k_cache"].clone()
    with pytest.raises(RuntimeError, match=match):
        flash_attn_ext.flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before)
    if "expected in" in match or "= -1" in match or "cache_batch_idx" in match or "contiguous" in match:
        return  # values (checked on CPU only), the wrapper's own rule, a stride .to("meta") drops
    meta = {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    with pytest.raises(RuntimeError, match=match):   # the fake kernel refuses it alike
        flash_attn_ext.flash_attn_with_kvcache(**meta)


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_kvcache_leftpad_with_rotary(device, dtype):
    """Rotary positions are cache rows, leftpad or not (flash-attn's kernel adds the leftpad back
    for cos / sin): new key j at cache_seqlens[b] + j, causal query i likewise."""
    g = torch.Generator().manual_seed(9)
    batch, seqlen_cache, d = 2, 48, 32
    kc = torch.randn(batch, seqlen_cache, 2, d, generator=g).to(dtype)
    vc = torch.randn(batch, seqlen_cache, 2, d, generator=g).to(dtype)
    q = torch.randn(batch, 2, 4, d, generator=g).to(dtype)
    k = torch.randn(batch, 2, 2, d, generator=g).to(dtype)
    v = torch.randn(batch, 2, 2, d, generator=g).to(dtype)
    cos, sin = _tables(seqlen_cache, 32, dtype, "cpu", g)
    seqlens = torch.tensor([9, 30], dtype=torch.int32)
    leftpad = torch.tensor([4, 0], dtype=torch.int32)
    kc_d, vc_d = kc.to(device), vc.to(device)
    out = flash_attn_ext.flash_attn_with_kvcache(
        q.to(device), kc_d, vc_d, k.to(device), v.to(device), cache_seqlens=seqlens.to(device),
        cache_leftpad=leftpad.to(device), causal=True, rotary_cos=cos.to(device), rotary_sin=sin.to(device),
        rotary_interleaved=False)
    pos = seqlens.long()[:, None] + torch.arange(2)
    k_rot = rotate_ref(k, cos, sin, pos, False)
    q_rot = rotate_ref(q, cos, sin, pos, False)
    kc64, vc64 = kc.double(), vc.double()
    front_k, front_v = torch.zeros_like(kc64), torch.zeros_like(vc64)
    for b in range(batch):
        r, lp = int(seqlens[b]), int(leftpad[b])
        kc64[b, r:r + 2], vc64[b, r:r + 2] = k_rot[b], v[b].double()
        front_k[b, :r + 2 - lp], front_v[b, :r + 2 - lp] = kc64[b, lp:r + 2], vc64[b, lp:r + 2]
    ref, _ = attention_kvcache_ref(q_rot, front_k, front_v, seqlens + 2 - leftpad, causal=True)
    base, _ = attention_kvcache_ref(q_rot.to(dtype), front_k.to(dtype), front_v.to(dtype), seqlens + 2 - leftpad,
                                    causal=True, upcast=False)
    check_accuracy("out", out.cpu(), ref, base)


def _leftpad_case(device, dtype, batch, nheads, nheads_k, d, seqlen_cache, cache_seqlens, leftpad, seqlen_q, causal,
                  window, num_splits, seed=0):
    """flash_attn_with_kvcache with cache_leftpad against the reference on the rows moved to the
    front of a cache; NaN before each leftpad and past the rows in use."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(batch, seqlen_cache, nheads_k, d, generator=g).to(dtype)
    vc = torch.randn(batch, seqlen_cache, nheads_k, d, generator=g).to(dtype)
    lens, pads = torch.tensor(cache_seqlens, dtype=torch.int32), torch.tensor(leftpad, dtype=torch.int32)
    for b in range(batch):
        lp, n = int(pads[b]), int(lens[b])
        kc[b, :lp], vc[b, :lp], kc[b, n:], vc[b, n:] = float("nan"), float("nan"), float("nan"), float("nan")
    q = torch.randn(batch, seqlen_q, nheads, d, generator=g).to(dtype)
    out, lse = flash_attn_ext.flash_attn_with_kvcache(
        q.to(device), kc.to(device), vc.to(device), cache_seqlens=lens.to(device), cache_leftpad=pads.to(device),
        causal=causal, window_size=window, num_splits=num_splits, return_lse=True)
    _check_leftpad_attention(out, lse, q, kc, vc, lens, pads, causal, window)


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal,window,seqlen_q", [(False, (-1, -1), 1), (True, (-1, -1), 4), (True, (200, 0), 4)])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_kvcache_leftpad_long_caches(device, dtype, d, causal, window, seqlen_q, num_splits):
    """Many key tiles per sequence (1100 cache rows): leftpads inside a tile (333, 517), none, and
    past most of the rows in use (1000), so the row offset meets partial first and last tiles,
    unmasked middle tiles, windows that skip tiles and splits of several tiles; head dims whose
    copies take the whole-row and the generic chunk walks (96)."""
    _leftpad_case(device, dtype, 4, 8, 2, d, 1100, [1100, 900, 700, 1050], [333, 517, 0, 1000], seqlen_q, causal,
                  window, num_splits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kvcache_leftpad_decode_batch_cuda():
    """A batch-64 GQA decode (32:8, hd128: 512 CTAs, unsplit at this capacity of 8 key tiles) with
    a leftpad per sequence."""
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(300, 512, (64,), generator=g)
    pads = (torch.rand(64, generator=g) * lens).long()
    _leftpad_case("cuda", torch.bfloat16, 64, 32, 8, 128, 512, lens.tolist(), pads.tolist(), 1, True, (-1, -1), 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kvcache_leftpad_out_of_range_cuda():
    """CUDA does not read cache_leftpad on the host: a negative leftpad reads as 0 (the same bits),
    one past the rows in use leaves no key (out 0, LSE +inf); nothing outside the cache is read."""
    g = torch.Generator().manual_seed(2)
    kc = torch.randn(2, 64, 2, 64, generator=g).bfloat16().cuda()
    vc = torch.randn(2, 64, 2, 64, generator=g).bfloat16().cuda()
    q = torch.randn(2, 1, 4, 64, generator=g).bfloat16().cuda()
    lens = torch.tensor([40, 64], dtype=torch.int32, device="cuda")
    call = lambda pads: flash_attn_ext.flash_attn_with_kvcache(  # noqa: E731
        q, kc, vc, cache_seqlens=lens, cache_leftpad=torch.tensor(pads, dtype=torch.int32, device="cuda"),
        return_lse=True)
    assert torch.equal(call([-5, -1000])[0], call([0, 0])[0])
    out, lse = call([140, 2**30])
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse > 0).all()
