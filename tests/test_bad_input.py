"""Every bad input raises a RuntimeError naming the argument and what was expected, before any work."""

import inspect

import pytest
import torch

import flash_attn_ext
from accuracy import check_accuracy
from flash_attn_ext.reference import attention_ref, attention_varlen_ref

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

fwd = torch.ops.flash_attn_ext.forward
bwd = torch.ops.flash_attn_ext.backward


def qkv(b=2, sq=16, sk=24, h=4, hk=2, d=32, dtype=torch.float32):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


def raises(match, fn, *args):
    with pytest.raises(RuntimeError, match=match):
        fn(*args)


@pytest.mark.parametrize("name,index", [("q", 0), ("k", 1), ("v", 2)])
def test_rank(name, index):
    args = list(qkv())
    args[index] = args[index][0]
    raises(rf"{name} must be 4-D .* got 3-D", fwd, *args, 0.1, False)


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, torch.float8_e4m3fn])
def test_unsupported_dtype(dtype):
    q, k, v = (torch.ones(2, 8, 2, 16).to(dtype) for _ in range(3))
    raises(r"q has dtype .*CPU supports float32, float64, float16 and bfloat16", fwd, q, k, v, 0.1, False)


@pytest.mark.parametrize("name,index", [("k", 1), ("v", 2)])
def test_mismatched_dtype(name, index):
    args = list(qkv())
    args[index] = args[index].double()
    raises(rf"{name} has dtype torch.float64 but q has dtype torch.float32", fwd, *args, 0.1, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to place a tensor elsewhere")
@pytest.mark.parametrize("name,index", [("k", 1), ("v", 2)])
def test_different_devices(name, index):
    args = [t.half().cuda() for t in qkv()]
    args[index] = args[index].cpu()
    raises(rf"{name} is on cpu but q is on cuda", fwd, *args, 0.1, False)


def test_batch_mismatch():
    q, k, v = qkv()
    raises(r"batch mismatch: q has batch 2, k has 1", fwd, q, k[:1], v[:1], 0.1, False)
    raises(r"batch mismatch: q has batch 2, k has 2, v has 1", fwd, q, k, v[:1], 0.1, False)


def test_seqlen_mismatch_k_v():
    q, k, v = qkv()
    raises(r"v has seqlen 23 but k has seqlen_k 24", fwd, q, k, v[:, :23], 0.1, False)


def test_nheads_mismatch_k_v():
    q, k, v = qkv(h=4, hk=2)
    raises(r"v has 1 heads but k has nheads_k 2", fwd, q, k, v[:, :, :1], 0.1, False)


def test_nheads_not_divisible():
    q, k, v = qkv(h=6, hk=4)
    raises(r"nheads \(q.size\(2\) = 6\) must be a multiple of nheads_k \(k.size\(2\) = 4\)", fwd, q, k, v, 0.1, False)


def test_nheads_k_zero():
    """nheads_k = 0 used to read "nheads ... must be a multiple of nheads_k (... = 0)"."""
    q, k, v = (torch.randn(2, 8, 0, 64) for _ in range(3))
    raises(r"nheads_k \(k.size\(2\)\) is 0; expected >= 1", fwd, q, k, v, 0.1, False)


def _huge(shape, device="cpu", dtype=torch.float32):
    """A tensor of `shape` on a few bytes of storage (zero strides but the last), for size checks."""
    return torch.zeros(shape[-1], device=device, dtype=dtype).as_strided(shape, (0,) * (len(shape) - 1) + (1,))


def _cuda_build():
    return torch.cuda.is_available() and flash_attn_ext.build_info().get("with_cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not _cuda_build(), reason="needs a CUDA device and a CUDA build (the CUDA entries' own checks)"))])
def test_sequence_lengths_past_the_int32_tile_counts(device):
    """Sequence lengths above 2^31 - 256 are refused by name before any work (tile counts
    ceil(n / 256) and 128-row roundings would overflow int32; a varlen max_seqlen_q of 2^31 - 1 used
    to reach the sm90 forward with a negative tile count): dense seqlen, varlen max_seqlen / total,
    and a KV-cache call's packed rows seqlen_q * nheads / nheads_k. On CUDA tensors the CUDA
    entries check before any copy or launch (the huge views hold a few bytes)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    huge = lambda shape: _huge(shape, device, dtype)  # noqa: E731
    big = 2**31 - 255
    q, k, v = huge((1, big, 1, 16)), huge((1, 8, 1, 16)), huge((1, 8, 1, 16))
    raises(r"seqlen_q, seqlen_k be at most 2\^31 - 256 = 2147483392", fwd, q, k, v, 0.1, False)
    raises(r"seqlen_q, seqlen_k be at most 2\^31 - 256", fwd, k, q, q, 0.1, False)
    q3 = torch.randn(5, 2, 16, device=device, dtype=dtype)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=device)
    for mq, mk in ((2**31 - 1, 5), (5, big)):
        raises(r"max_seqlen_q and max_seqlen_k must be in \[0, 2\^31 - 256 = 2147483392\]",
               flash_attn_ext.flash_attn_varlen_func, q3, q3, q3, cu, cu, mq, mk)
    meta = [t.to("meta") for t in (q3, cu)]
    raises(r"max_seqlen_q and max_seqlen_k must be in \[0, 2\^31 - 256",
           flash_attn_ext.flash_attn_varlen_func, meta[0], meta[0], meta[0], meta[1], meta[1], 2**31 - 1, 5)
    raises(r"total_q and total_k must be at most 2\^31 - 256", flash_attn_ext.flash_attn_varlen_func,
           huge((big, 2, 16)), q3, q3, cu, cu, 5, 5)
    qk, cache = huge((1, 2**28, 8, 16)), torch.randn(1, 16, 1, 16, device=device, dtype=dtype)
    raises(r"seqlen_q \* nheads / nheads_k \(the packed rows of a kv head\) be at most 2\^31 - 256",
           flash_attn_ext.flash_attn_with_kvcache, qk, cache, cache)


@pytest.mark.parametrize("device", ["cpu", "meta", pytest.param("cuda", marks=pytest.mark.skipif(
    not _cuda_build(), reason="needs a CUDA device and a CUDA build (the CUDA entries' own checks)"))])
def test_sizes_the_kernels_hold_in_int32(device):
    """Sizes the kernels hold in int32 and no other check bounds, refused by name before any work
    (each used to be truncated on CUDA, silently): a varlen batch past int32 (cu_seqlens of 2^31 + 2
    entries: only sequence 0 ran), a paged cache of more than 2^31 - 1 blocks (an expanded view: a
    valid block number read as invalid, its keys as zeros), and new keys k / v of more rows than the
    cache holds (on CPU: the per-sequence check's message; on CUDA dropped, past 2^31 rows wrapped),
    each in the terms of the call (paged varlen's k, cache_batch_idx's entries and seqlen_cache).
    meta: the fake kernels' twins of the checks."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    on = lambda t: t.to(device, dtype) if t.is_floating_point() else t.to(device)  # noqa: E731
    q, q3 = on(torch.randn(1, 1, 1, 16)), on(torch.randn(1, 1, 16))
    table, cu = on(torch.zeros(1, 1, dtype=torch.int32)), on(torch.tensor([0, 1], dtype=torch.int32))
    one, zero = on(torch.ones(1, dtype=torch.int32)), on(torch.zeros(1, dtype=torch.int32))
    blocks = _huge((2**31, 16, 1, 16), device, dtype) if device != "meta" else torch.empty(
        2**31, 16, 1, 16, device="meta")
    raises(r"paged k_cache's num_blocks \(k_cache.size\(0\)\) must be at most 2\^31 - 1 \(block_table holds int32 "
           r"block numbers\), got 2147483648", flash_attn_ext.flash_attn_with_kvcache, q, blocks, blocks,
           None, None, None, None, one, None, None, table)
    raises(r"k_cache's batch_cache \(k_cache.size\(0\)\) must be at most 2\^31 - 1 \(cache_batch_idx holds int32 "
           r"entries\), got 2147483648", flash_attn_ext.flash_attn_with_kvcache, q, blocks, blocks,
           None, None, None, None, one, zero)
    with torch.no_grad():
        raises(r"paged k's num_blocks \(k.size\(0\)\) must be at most 2\^31 - 1 .*, got 2147483648",
               flash_attn_ext.flash_attn_varlen_func, q3, blocks, blocks, cu, cu, 1, 1, 0.0, None, False, (-1, -1),
               0.0, None, False, False, table)
    cache, new = on(torch.randn(1, 16, 1, 16)), on(torch.randn(1, 17, 1, 16))
    # (cache_batch_idx, cache_leftpad, block_table): contiguous, paged, cache_batch_idx
    for where, extra in ((r"k_cache.size\(1\)", (None, None, None)),
                         (r"block_table.size\(1\) \* page_size", (None, None, table)),
                         (r"k_cache.size\(1\)", (zero, None, None))):
        raises(rf"k's seqlen_new \(k.size\(1\)\) must be at most the cache's rows per sequence \({where}\), "
               "got 17 and 16", flash_attn_ext.flash_attn_with_kvcache, q, cache, cache.clone(), new, new,
               None, None, zero, *extra)
    if device != "cuda":  # on CPU a virtual allocation: the check reads no entry (CUDA: 8 GiB of device memory)
        many = torch.empty(2**31 + 2, dtype=torch.int32, device=device)
        raises(r"batch \(cu_seqlens_q.size\(0\) - 1\) must fit in int32, got 2147483649",
               flash_attn_ext.flash_attn_varlen_func, q3, q3, q3, many, many, 1, 1)


def test_headdim_mismatch():
    q, k, v = qkv(d=32)
    raises(r"headdim mismatch: q has headdim 32, k has 24", fwd, q, k[..., :24], v[..., :24], 0.1, False)
    raises(r"headdim mismatch: q has headdim 32, k has 32, v has 24", fwd, q, k, v[..., :24].contiguous(), 0.1, False)


@pytest.mark.parametrize("d", [4, 20, 100, 264, 512])
def test_headdim_unsupported(d):
    q, k, v = qkv(d=d)
    raises(rf"headdim {d} is not supported; expected a multiple of 8 in \[8, 256\]", fwd, q, k, v, 0.1, False)


@pytest.mark.parametrize("name,index", [("q", 0), ("k", 1), ("v", 2)])
def test_last_dim_not_contiguous(name, index):
    args = list(qkv())
    args[index] = torch.randn(*args[index].shape[:3], 64)[..., ::2]
    raises(rf"{name} must have a contiguous last dimension", fwd, *args, 0.1, False)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 3e38, -1e300])
def test_softmax_scale_not_finite(scale):
    """Also a finite scale whose scale * log2(e) is not a float32 (the kernels scale scores by it)."""
    raises(r"softmax_scale must be finite", fwd, *qkv(), scale, False)
    q, k, v = (t.to("meta") for t in qkv())
    raises(r"softmax_scale must be finite", fwd, q, k, v, scale, False)  # the fake kernel too


def test_bwd_fake_checks_every_device():
    """The backward's fake (meta) kernel names a tensor on another device instead of returning
    uninitialised outputs."""
    q, k, v = qkv()
    out, lse, stats = fwd(q, k, v, 0.25, False)
    dout = torch.randn_like(out)
    raises(r"softmax_stats is on meta", bwd, dout, q, k, v, out, lse, 0.25, False, stats.to("meta"))
    raises(r"dout is on meta", bwd, dout.to("meta"), q, k, v, out, lse, 0.25, False, stats)


def test_interface_errors_too():
    q, k, v = qkv(h=6, hk=4)
    with pytest.raises(RuntimeError, match="must be a multiple of nheads_k"):
        flash_attn_ext.flash_attn_func(q, k, v)


def test_interface_non_tensor_arguments():
    """Every entry names the argument that is not a tensor (None, a NumPy array, a list), instead of
    an AttributeError from inside or an empty-tensor shape message."""
    import numpy as np

    q, k, v = qkv()
    for bad in (None, np.zeros((2, 16, 4, 32), dtype=np.float32), [1.0]):
        for i, name in enumerate(("q", "k", "v")):
            args = [q, k, v]
            args[i] = bad
            with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got"):
                flash_attn_ext.flash_attn_func(*args)
    with pytest.raises(TypeError, match="value must be a torch.Tensor, got NoneType"):
        flash_attn_ext.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), None)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a torch.Tensor, got NoneType"):
        flash_attn_ext.flash_attn_varlen_func(q[0], k[0], v[0], None, cu, 16, 24)
    kc = torch.randn(2, 32, 2, 32)
    with pytest.raises(TypeError, match="k_cache must be a torch.Tensor, got NoneType"):
        flash_attn_ext.flash_attn_with_kvcache(q, None, kc)
    with pytest.raises(TypeError, match="block_table must be a torch.Tensor or None, got list"):
        flash_attn_ext.flash_attn_with_kvcache(q, kc, kc.clone(), block_table=[[0]])
    with pytest.raises(TypeError, match=r"cache_seqlens must be an int32 \(batch,\) tensor, an int or None, got list"):
        flash_attn_ext.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=[2, 2])


def test_interface_scale_that_requires_grad():
    """A softmax_scale tensor that requires grad would silently get no gradient: refused."""
    q, k, v = qkv()
    with pytest.raises(TypeError, match="softmax_scale is a tensor that requires grad"):
        flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.1, requires_grad=True))
    out = flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.1))  # a plain tensor is fine
    torch.testing.assert_close(out, flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=0.1))


# ---- backward-only arguments -------------------------------------------------------------

def _bwd_args():
    q, k, v = qkv()
    out, lse, _ = fwd(q, k, v, 0.1, True)
    return [torch.randn_like(out), q, k, v, out, lse, 0.1, True]


def test_bwd_dout_shape():
    args = _bwd_args()
    args[0] = args[0][:, :8]
    raises(r"dout has shape \[2, 8, 4, 32\]; expected q's shape \[2, 16, 4, 32\]", bwd, *args)


def test_bwd_dout_rank():
    args = _bwd_args()
    args[0] = args[0][0]
    raises(r"dout must be 4-D", bwd, *args)


def test_bwd_dout_dtype():
    args = _bwd_args()
    args[0] = args[0].double()
    raises(r"dout has dtype torch.float64 but q has dtype torch.float32", bwd, *args)


def test_bwd_out_shape():
    args = _bwd_args()
    args[4] = args[4][:, :, :2]
    raises(r"out has shape \[2, 16, 2, 32\]; expected q's shape", bwd, *args)


def test_bwd_lse_shape():
    args = _bwd_args()
    args[5] = args[5][:, :, :8]
    raises(r"softmax_lse has shape \[2, 4, 8\]; expected \(batch, nheads, seqlen_q\) = \(2, 4, 16\)", bwd, *args)


def test_bwd_lse_dtype():
    args = _bwd_args()
    args[5] = args[5].double()
    raises(r"softmax_lse has dtype torch.float64; expected float32", bwd, *args)


def test_cuda_only_dtypes_documented_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: checks that CUDA rejects float32 with a clear error")
    q, k, v = (t.cuda() for t in qkv())
    raises(r"q has dtype torch.float32; CUDA supports float16 and bfloat16|this build has no CUDA kernels", fwd, q, k, v,
           0.1, False)


def test_double_backward_raises():
    """Differentiating the gradients is not implemented: a clear error, never a silent wrong value."""
    q, k, v = (t.double().requires_grad_() for t in qkv(b=1, sq=8, sk=8, h=2, hk=2, d=16))
    out = fwd(q, k, v, 0.25, False)[0]
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dq.pow(2).sum().backward()


def test_meta_tensors_are_checked():
    """The fake (meta) kernels run the same checks as the real ones."""
    q, k, v = (t.to("meta") for t in qkv(d=12))
    raises(r"headdim 12 is not supported; expected a multiple of 8", fwd, q, k, v, 0.1, False)
    q, k, v = qkv()
    raises(r"k is on meta but q is on cpu", fwd, q, k.to("meta"), v.to("meta"), 0.1, False)


def test_headdim_zero_with_default_scale():
    q = torch.randn(1, 4, 2, 0)
    with pytest.raises(RuntimeError, match="headdim"):
        flash_attn_ext.flash_attn_func(q, q, q)


# ---- the user functions' Python arguments (flash_attn_ext/interface.py) ----------------------

# flash-attn's (>= 2.6) parameters in their positional order: the spec that calls ported from it,
# positional ones included, rely on.
_FA_TAIL = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
            "return_attn_probs"]
FLASH_ATTN_POSITIONAL_ORDER = {
    "flash_attn_func": ["q", "k", "v"] + _FA_TAIL,
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    + _FA_TAIL + ["block_table"],
    "flash_attn_qkvpacked_func": ["qkv"] + _FA_TAIL,
    "flash_attn_kvpacked_func": ["q", "kv"] + _FA_TAIL,
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"] + _FA_TAIL,
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    + _FA_TAIL,
    "flash_attn_with_kvcache": ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                                "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
                                "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
                                "return_softmax_lse"],
}


def test_flash_attns_module_path():
    """``flash_attn.flash_attn_interface``'s public functions under flash_attn_ext's name, so a
    ported import line only changes the package."""
    from flash_attn_ext import flash_attn_interface
    assert sorted(flash_attn_interface.__all__) == sorted(FLASH_ATTN_POSITIONAL_ORDER)
    for name in FLASH_ATTN_POSITIONAL_ORDER:
        assert getattr(flash_attn_interface, name) is getattr(flash_attn_ext, name)


@pytest.mark.parametrize("name", sorted(FLASH_ATTN_POSITIONAL_ORDER))
def test_positional_order_is_flash_attns(name):
    """Every flash_attn_* entry takes flash-attn's parameters in flash-attn's positional order,
    and only this library's own (return_lse, sinks) keyword-only."""
    params = inspect.signature(getattr(flash_attn_ext, name)).parameters.values()
    assert [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD] == FLASH_ATTN_POSITIONAL_ORDER[name]
    assert [p.name for p in params if p.kind == p.KEYWORD_ONLY] == ["return_lse", "sinks"]


def test_positional_calls_ported_from_flash_attn():
    """Calls written positionally for flash-attn give the bits of the same call by keywords (dense,
    varlen, packed, KV cache); a fourth positional 0.5 is dropout_p (the call by keyword under the
    same seed), never the softmax scale; one positional argument more than flash-attn's is a TypeError."""
    q, k, v = qkv()
    ref = flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, window_size=(5, 0), softcap=2.0)
    assert torch.equal(flash_attn_ext.flash_attn_func(q, k, v, 0.0, 0.3, True, (5, 0), 2.0, None, False, False), ref)
    out, lse, s_dmask = flash_attn_ext.flash_attn_func(q, k, v, 0.0, 0.3, True, (5, 0), 2.0, None, True, True)
    assert torch.equal(out, ref) and lse.shape == (2, 4, 16) and s_dmask is None
    torch.manual_seed(3)
    positional = flash_attn_ext.flash_attn_func(q, k, v, 0.5)
    torch.manual_seed(3)
    assert torch.equal(positional, flash_attn_ext.flash_attn_func(q, k, v, dropout_p=0.5))
    assert not torch.equal(positional, flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=0.5))
    with pytest.raises(TypeError, match="positional"):
        flash_attn_ext.flash_attn_func(q, k, v, 0.0, 0.3, True, (5, 0), 2.0, None, False, False, True)
    # flash-attn <= 2.5's order (alibi_slopes where softcap is now): the message says so
    with pytest.raises(TypeError, match=r"softcap must be a real number, got NoneType None \(flash-attn >= 2.6's "
                                        r"positional order has softcap after window_size"):
        flash_attn_ext.flash_attn_func(q, k, v, 0.0, None, True, (-1, -1), None, False, True)
    qv, kv, vv = q[0], k[0], v[0]
    cu_q, cu_k = torch.tensor([0, 16], dtype=torch.int32), torch.tensor([0, 24], dtype=torch.int32)
    ref = flash_attn_ext.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 16, 24, softmax_scale=0.3, causal=True)
    assert torch.equal(flash_attn_ext.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 16, 24, 0.0, 0.3, True), ref)
    qkv_packed = torch.stack([q, q, q], dim=2)
    ref = flash_attn_ext.flash_attn_qkvpacked_func(qkv_packed, softmax_scale=0.3, causal=True)
    assert torch.equal(flash_attn_ext.flash_attn_qkvpacked_func(qkv_packed, 0.0, 0.3, True), ref)
    seqlens = torch.tensor([20, 24], dtype=torch.int32)
    ref = flash_attn_ext.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, softmax_scale=0.3, causal=True)
    got = flash_attn_ext.flash_attn_with_kvcache(q, k, v, None, None, None, None, seqlens, None, None, None, 0.3, True)
    assert torch.equal(got, ref)


def _flash_attn_calls():
    """(name, call(**keywords)) for every entry that takes flash-attn's keywords."""
    q, k, v = qkv()
    qv, kv, vv = q[0], k[0], v[0]
    cu_q, cu_k = torch.tensor([0, 16], dtype=torch.int32), torch.tensor([0, 24], dtype=torch.int32)
    return [
        ("flash_attn_func", lambda **kw: flash_attn_ext.flash_attn_func(q, k, v, causal=True, **kw)),
        ("flash_attn_varlen_func",
         lambda **kw: flash_attn_ext.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 16, 24, causal=True, **kw)),
        ("flash_attn_qkvpacked_func",
         lambda **kw: flash_attn_ext.flash_attn_qkvpacked_func(torch.stack([q, q, q], dim=2), **kw)),
        ("flash_attn_kvpacked_func",
         lambda **kw: flash_attn_ext.flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), **kw)),
        ("flash_attn_varlen_qkvpacked_func",
         lambda **kw: flash_attn_ext.flash_attn_varlen_qkvpacked_func(torch.stack([qv, qv, qv], dim=1), cu_q, 16, **kw)),
        ("flash_attn_varlen_kvpacked_func",
         lambda **kw: flash_attn_ext.flash_attn_varlen_kvpacked_func(qv, torch.stack([kv, vv], dim=1), cu_q, cu_k, 16,
                                                                     24, **kw)),
    ]


def test_flash_attn_keywords_at_their_defaults_are_the_plain_call():
    """A call ported from flash-attn with dropout_p=0.0, softcap=0.0, alibi_slopes=None,
    deterministic (either value) and return_attn_probs=False runs unchanged: the same bits."""
    for name, call in _flash_attn_calls():
        ref = call()
        for deterministic in (False, True, None):
            out = call(dropout_p=0.0, softcap=0.0, alibi_slopes=None, deterministic=deterministic,
                       return_attn_probs=False)
            assert torch.equal(out, ref), name
        assert torch.equal(call(dropout_p=0), ref), name


def test_return_attn_probs_gives_flash_attns_triple():
    """return_attn_probs=True returns flash-attn's (out, softmax_lse, S_dmask) with S_dmask None, as
    flash-attn does without dropout (code written for it gets the LSE this way): out and
    softmax_lse the bits of the call with return_lse=True, whatever return_lse, on every dense,
    varlen and packed entry; the gradient through out is the plain call's; fullgraph compile."""
    for name, call in _flash_attn_calls():
        ref_out, ref_lse = call(return_lse=True)
        for return_lse in (False, True):
            got = call(return_attn_probs=True, return_lse=return_lse)
            assert isinstance(got, tuple) and len(got) == 3 and got[2] is None, name
            assert torch.equal(got[0], ref_out) and torch.equal(got[1], ref_lse), name
        assert torch.equal(call(return_attn_probs=0), ref_out), name  # 0 / 1 are bools here, as for return_lse
    q, k, v = (t.requires_grad_() for t in qkv())
    out, lse, s_dmask = flash_attn_ext.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(flash_attn_ext.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref))
    compiled = torch.compile(lambda q, k, v: flash_attn_ext.flash_attn_func(q, k, v, return_attn_probs=True),
                             fullgraph=True, backend="eager")
    c_out, c_lse, c_none = compiled(q.detach(), k.detach(), v.detach())
    e_out, e_lse = flash_attn_ext.flash_attn_func(q.detach(), k.detach(), v.detach(), return_lse=True)
    assert c_none is None and torch.equal(c_out, e_out) and torch.equal(c_lse, e_lse)


@pytest.mark.parametrize("keyword, value, error, match", [
    ("dropout_p", 1.0, ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    ("softcap", -1.0, ValueError, r"softcap must be a finite number >= 0 \(0: no soft-capping\), got -1.0"),
    ("softcap", float("nan"), ValueError, "softcap must be a finite number >= 0"),
    ("softcap", float("inf"), ValueError, "softcap must be a finite number >= 0"),
    ("softcap", True, TypeError, "softcap must be a real number"),
    ("softcap", "30", TypeError, "softcap must be a real number"),
    ("alibi_slopes", [0.5, 0.25], TypeError, r"alibi_slopes must be a float32 tensor of shape \(nheads,\)"),
    ("alibi_slopes", torch.ones(3), RuntimeError, r"alibi_slopes has dtype torch.float32 and shape \[3\]; "
                                                  r"expected float32 of shape \(nheads,\) = \(4,\)"),
    ("alibi_slopes", torch.ones(4, dtype=torch.float64), RuntimeError, "alibi_slopes has dtype torch.float64"),
    ("return_attn_probs", "yes", TypeError, "return_attn_probs must be a bool"),
    ("dropout_p", "0.1", TypeError, "dropout_p must be a real number"),
    ("softcap", None, TypeError, "softcap must be a real number"),
    ("softcap", torch.tensor([2.0]), TypeError, r"softcap must be a real number or a 0-dim tensor, got a tensor of "
                                                r"shape \(1,\)"),
    ("softmax_scale", torch.tensor([0.5]), TypeError, "softmax_scale must be a real number or a 0-dim tensor"),
    ("deterministic", "yes", TypeError, "deterministic must be a bool"),
])
def test_flash_attn_keywords_that_ask_for_a_missing_feature(keyword, value, error, match):
    """Another value asks for a feature this library does not have, or is no valid value (softcap:
    a real number >= 0, finite; alibi_slopes: float32 (nheads,) or (batch, nheads)): an error naming
    it, before any work (never a silently different result)."""
    for name, call in _flash_attn_calls():
        with pytest.raises(error, match=match):
            call(**{keyword: value})


def test_flash_attn_dropout_keyword_runs():
    """dropout_p (attention dropout, tests/test_dropout.py) runs on every entry that takes flash-attn's
    keywords: a new mask per call, the same one under the same seed (torch.manual_seed), and with
    softcap a NotImplementedError naming it."""
    for name, call in _flash_attn_calls():
        torch.manual_seed(11)
        out = call(dropout_p=0.3)
        torch.manual_seed(11)
        assert torch.equal(call(dropout_p=0.3), out), name
        assert torch.isfinite(out).all() and not torch.equal(out, call()) and not torch.equal(out, call(dropout_p=0.3))
        with pytest.raises(NotImplementedError, match="dropout_p > 0 with softcap"):
            call(dropout_p=0.3, softcap=30.0)


def test_flash_attn_softcap_keyword_runs():
    """softcap (logit soft-capping, tests/test_softcap.py) runs on every entry that takes flash-attn's
    keywords: 30.0 (a float, an int, a NumPy scalar, a 0-dim tensor: the same bits) changes the
    result; a cap past float32's range is the op's RuntimeError naming softcap."""
    import numpy as np

    for name, call in _flash_attn_calls():
        out = call(softcap=30.0)
        assert torch.isfinite(out).all() and not torch.equal(out, call()), name
        for same in (30, np.float64(30.0), torch.tensor(30.0)):
            assert torch.equal(call(softcap=same), out), (name, same)
        with pytest.raises(RuntimeError, match="softcap must be within float32's range"):
            call(softcap=1e39)


def test_varlen_block_table_keyword():
    """flash-attn's flash_attn_varlen_func takes block_table=None: the same bits; with a block_table
    k / v must be paged caches (tests/test_varlen.py: the paged varlen)."""
    call = dict(_flash_attn_calls())["flash_attn_varlen_func"]
    assert torch.equal(call(block_table=None), call())
    with torch.no_grad(), pytest.raises(RuntimeError, match="with block_table, k must be a paged cache"):
        call(block_table=torch.zeros(1, 2, dtype=torch.int32))


@pytest.mark.parametrize("scale", ["0.1", True, 1j, b"1", 10 ** 400])
def test_softmax_scale_must_be_a_real_number(scale):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="softmax_scale must be a real number"):
        flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=scale)


def test_softmax_scale_real_number_types():
    """ints, NumPy scalars and 0-dim real tensors are real numbers: the same result as the float."""
    import numpy as np

    q, k, v = qkv()
    ref = flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=0.5)
    for scale in (np.float32(0.5), np.float64(0.5), torch.tensor(0.5)):
        assert torch.equal(flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=scale), ref)
    assert torch.equal(flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=1),
                       flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=1.0))


def test_return_lse_must_be_a_bool():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        flash_attn_ext.flash_attn_func(q, k, v, return_lse="no")


def test_nested_tensors_are_refused_clearly():
    """A jagged nested tensor gets an error naming it and the varlen entry, not the dispatcher's
    bare NotImplementedError."""
    nt = torch.nested.nested_tensor([torch.randn(3, 2, 8), torch.randn(5, 2, 8)], layout=torch.jagged)
    with pytest.raises(NotImplementedError, match="q is a nested tensor.*flash_attn_varlen_func"):
        flash_attn_ext.flash_attn_func(nt, nt, nt)
    bhsd = nt.transpose(1, 2)
    with pytest.raises(NotImplementedError, match="query is a nested tensor"):
        flash_attn_ext.scaled_dot_product_attention(bhsd, bhsd, bhsd)


@pytest.mark.parametrize("entry", ["dense", "varlen", "kvcache", "sdpa"])
def test_sparse_tensors_are_refused_clearly(entry):
    """A sparse (non-strided) tensor gets an error naming the argument and its layout, not the
    dispatcher's "Could not run ... with arguments from the 'SparseCPU' backend"."""
    q, k, v = qkv()
    sparse = q.to_sparse()
    if entry == "dense":
        call, name = lambda: flash_attn_ext.flash_attn_func(sparse, k, v), "q"
    elif entry == "varlen":
        cu = torch.tensor([0, q.shape[1]], dtype=torch.int32)
        kp = k[0].to_sparse()
        call, name = lambda: flash_attn_ext.flash_attn_varlen_func(q[0], kp, v[0], cu, cu, q.shape[1], q.shape[1]), "k"
    elif entry == "kvcache":
        call, name = lambda: flash_attn_ext.flash_attn_with_kvcache(q, k, v.to_sparse()), "v_cache"
    else:
        call, name = lambda: flash_attn_ext.scaled_dot_product_attention(sparse, k, v), "query"
    with pytest.raises(NotImplementedError, match=f"{name} has layout torch.sparse_coo.*strided"):
        call()


# ---- flash-attn's Python-side accommodations (interface.py: _kernel_layout) ---------------------

@pytest.mark.parametrize("device,dtype", [pytest.param("cpu", torch.float64, id="cpu-fp64"),
                                          pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
                                          pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=requires_cuda)])
@pytest.mark.parametrize("d_qk,d_v", [(4, 4), (20, 20), (100, 100), (250, 250), (192, 128), (24, 16), (20, 36)])
def test_head_dims_the_kernels_do_not_take_run_padded(device, dtype, d_qk, d_v):
    """A head dim that is not a multiple of 8 runs zero-padded to the next one, as flash-attn's
    wrapper does, and values of another head dim than the queries' and keys' (multi-head latent
    attention, e.g. DeepSeek-V3's 192 / 128; FlashAttention-3's hdim_v) with both padded to the
    larger: out (..., d_v, contiguous), LSE and the gradients of the dense, varlen and packed
    entries within the accuracy rule of the float64 reference (softmax_scale's default 1 /
    sqrt(d_qk))."""
    def rnd(*shape):
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)

    q, k, v = rnd(2, 9, 4, d_qk), rnd(2, 13, 2, d_qk), rnd(2, 13, 2, d_v)
    out, lse = flash_attn_ext.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 9, 4, d_v) and out.is_contiguous()
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = {}
    for upcast in (True, False):
        o, l = attention_ref(q, k, v, None, True, upcast=upcast)
        refs[upcast] = (o, l, torch.autograd.grad(o, (q, k, v), dout.to(o.dtype)))
    check_accuracy("out", out, refs[True][0], refs[False][0])
    check_accuracy("lse", lse, refs[True][1], refs[False][1])
    for name, g, r, b in zip("qkv", grads, refs[True][2], refs[False][2]):
        check_accuracy(f"d{name}", g, r, b)
    qv, kv, vv = (t.detach()[0] for t in (q, k, v))
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32, device=device)
    out, lse = flash_attn_ext.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 5, 7, causal=True, return_lse=True)
    ref = attention_varlen_ref(qv, kv, vv, cu_q, cu_k, causal=True)
    base = attention_varlen_ref(qv, kv, vv, cu_q, cu_k, causal=True, upcast=False)
    check_accuracy("varlen out", out, ref[0], base[0])
    check_accuracy("varlen lse", lse, ref[1], base[1])
    if d_qk == d_v:
        qkv = torch.stack([t.detach() for t in (q, q, q)], dim=2)
        assert torch.equal(flash_attn_ext.flash_attn_qkvpacked_func(qkv, causal=True),
                           flash_attn_ext.flash_attn_func(*qkv.unbind(2), causal=True))


def test_a_last_dim_of_another_stride_is_copied():
    """q, k, v whose last dimension has a stride other than 1 run as their contiguous copies (as
    flash-attn's maybe_contiguous): the same bits, and the same gradient in the caller's strides
    (up to the order in which q, k and v's gradients of the one tensor add up); the raw op still
    names the layout it needs."""
    x = torch.randn(2, 9, 32, 4, dtype=torch.float64, requires_grad=True)
    q = x.transpose(2, 3)                       # (2, 9, 4, 32) with stride(-1) == 4
    assert q.stride(-1) != 1
    out = flash_attn_ext.flash_attn_func(q, q, q, causal=True)
    qc = q.detach().contiguous().requires_grad_()
    ref = flash_attn_ext.flash_attn_func(qc, qc, qc, causal=True)
    assert torch.equal(out, ref)
    (g,) = torch.autograd.grad(out.sum(), x)
    (gc,) = torch.autograd.grad(ref.sum(), qc)
    torch.testing.assert_close(g.transpose(2, 3), gc, rtol=0, atol=1e-12)
    raises("q must have a contiguous last dimension", fwd, q.detach(), q.detach(), q.detach(), 0.1, False)


def test_padding_leaves_the_other_checks_to_their_messages():
    """The head-dim padding (interface._kernel_layout) runs before the op's checks: a 0-dim q still
    gets the rank message, k of another head dim than q's its own (v's may differ)."""
    with pytest.raises(RuntimeError, match="q must be 4-D"):
        flash_attn_ext.flash_attn_func(torch.tensor(1.0), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(RuntimeError, match=r"k has headdim 24 but q has 16; expected equal \(v's may differ\)"):
        flash_attn_ext.flash_attn_func(q, torch.randn(1, 4, 2, 24), torch.randn(1, 4, 2, 24))


@pytest.mark.parametrize("d", [0, 257, 264])
def test_head_dims_outside_1_to_256_name_the_range(d):
    """The flash_attn_* functions take head dims 1..256 (padding the ones the kernels do not take):
    outside that range the error gives that range, not the kernels' multiples of 8, and names the
    tensor (q's, or v's where only the values' head dim is out of range)."""
    q = torch.randn(1, 4, 2, d)
    with pytest.raises(RuntimeError, match=rf"headdim {d} \(q.size\(-1\)\) is not supported; expected 1..256"):
        flash_attn_ext.flash_attn_func(q, q, q)
    with pytest.raises(RuntimeError, match=rf"headdim {d} \(q.size\(-1\)\) is not supported; expected 1..256"):
        flash_attn_ext.flash_attn_varlen_func(q[0], q[0], q[0], *[torch.tensor([0, 4], dtype=torch.int32)] * 2, 4, 4)
    # Values may have another head dim than q / k (multi-head latent attention): the error names v.
    qk = torch.randn(1, 4, 2, 16)
    with pytest.raises(RuntimeError, match=rf"headdim {d} \(v.size\(-1\)\) is not supported; expected 1..256"):
        flash_attn_ext.flash_attn_func(qk, qk, q)
    with pytest.raises(RuntimeError, match=rf"headdim {d} \(v.size\(-1\)\) is not supported; expected 1..256"):
        flash_attn_ext.flash_attn_varlen_func(qk[0], qk[0], q[0], *[torch.tensor([0, 4], dtype=torch.int32)] * 2,
                                              4, 4)


@pytest.mark.parametrize("case", ["empty", "headdim1"])
def test_stride_of_a_last_dim_torch_calls_contiguous_is_copied_too(case):
    """Tensors torch calls contiguous although their last stride is not 1 (an empty one; one whose
    last dimension has size 1) are copied like any other (`.contiguous()` returned them as they
    were and the op refused their stride), in flash_attn_func and the SDPA drop-in; torch's SDPA
    takes them."""
    if case == "empty":
        q = torch.randn(0, 5, 2, 8, 2)[..., 0]                  # BSHD (0, 5, 2, 8), strides (.., 2)
        k = v = torch.randn(0, 7, 2, 8)
    else:
        q = torch.randn(1, 1, 1, 8).permute(0, 3, 1, 2)         # BSHD (1, 8, 1, 1): stride(-1) == 8
        k = v = torch.randn(1, 4, 1, 1)
    assert q.is_contiguous() and q.stride(-1) != 1
    out = flash_attn_ext.flash_attn_func(q, k, v)
    ref = flash_attn_ext.flash_attn_func(q.clone(memory_format=torch.contiguous_format), k, v)
    assert out.shape == ref.shape and torch.equal(out, ref)
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))         # BHSD for the SDPA drop-in
    sdpa = flash_attn_ext.scaled_dot_product_attention(qb, kb, vb)
    torch.testing.assert_close(sdpa, torch.nn.functional.scaled_dot_product_attention(qb, kb, vb))
