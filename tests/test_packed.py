"""flash-attn's packed layouts: flash_attn_qkvpacked_func, flash_attn_kvpacked_func and their varlen
forms are the unpacked functions on views of the packed tensor, so their outputs, LSEs and
gradients are the unpacked call's bit for bit (CPU always; CUDA on both arch paths)."""
import pytest
import torch

import flash_attn_ext
from conftest import require_hdim

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _dtype(device, arch_path, d):
    """The test's dtype (float32 on CPU, bfloat16 on CUDA); skips the CPU's second arch path and
    CUDA head dims this build lacks."""
    if device == "cpu" and arch_path != "auto":
        pytest.skip("the CPU has one path")
    if device == "cuda":
        require_hdim(d, exact=True)
    return torch.float32 if device == "cpu" else torch.bfloat16


def _grads(out, lse, inputs, seed=1):
    """Gradients of a random linear function of (out, lse) w.r.t. inputs."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dout = torch.randn(out.shape, generator=g).to(out)
    return torch.autograd.grad((out * dout).sum(), inputs)


def _assert_same(got, want, what):
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b), what


def _unpacked_leaves(packed, dim):
    """Copies of the packed tensor's slots as fresh leaves (the unpacked call's inputs)."""
    return [t.detach().clone().requires_grad_(True) for t in packed.unbind(dim)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, 0)), (False, (3, 2))],
                         ids=["full", "causal", "causal-window", "window"])
def test_qkvpacked_is_the_unpacked_call(device, causal, window, arch_path):
    qkv = torch.randn(2, 37, 3, 4, 64, dtype=_dtype(device, arch_path, 64), device=device, requires_grad=True)
    out, lse = flash_attn_ext.flash_attn_qkvpacked_func(qkv, causal=causal, window_size=window, return_lse=True)
    (dqkv,) = _grads(out, lse, [qkv])
    q, k, v = _unpacked_leaves(qkv, 2)
    ref_out, ref_lse = flash_attn_ext.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    _assert_same((out, lse), (ref_out, ref_lse), "qkvpacked forward")
    _assert_same((dqkv,), (torch.stack(_grads(ref_out, ref_lse, [q, k, v]), dim=2),), "qkvpacked gradient")


@pytest.mark.parametrize("device", DEVICES)
def test_kvpacked_is_the_unpacked_call_gqa(device, arch_path):
    dtype = _dtype(device, arch_path, 128)
    q = torch.randn(2, 19, 6, 128, dtype=dtype, device=device, requires_grad=True)
    kv = torch.randn(2, 45, 2, 2, 128, dtype=dtype, device=device, requires_grad=True)
    out, lse = flash_attn_ext.flash_attn_kvpacked_func(q, kv, causal=True, softmax_scale=0.3, return_lse=True)
    dq, dkv = _grads(out, lse, [q, kv])
    q2 = q.detach().clone().requires_grad_(True)
    k, v = _unpacked_leaves(kv, 2)
    ref_out, ref_lse = flash_attn_ext.flash_attn_func(q2, k, v, causal=True, softmax_scale=0.3, return_lse=True)
    rq, rk, rv = _grads(ref_out, ref_lse, [q2, k, v])
    _assert_same((out, lse), (ref_out, ref_lse), "kvpacked forward")
    _assert_same((dq, dkv), (rq, torch.stack([rk, rv], dim=2)), "kvpacked gradients")


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_packed_are_the_unpacked_calls(device, arch_path):
    dtype = _dtype(device, arch_path, 64)
    cu = torch.tensor([0, 5, 5, 31, 40], dtype=torch.int32, device=device)
    qkv = torch.randn(40, 3, 4, 64, dtype=dtype, device=device, requires_grad=True)
    out, lse = flash_attn_ext.flash_attn_varlen_qkvpacked_func(qkv, cu, 26, causal=True, window_size=(7, 0),
                                                               return_lse=True)
    (dqkv,) = _grads(out, lse, [qkv])
    q, k, v = _unpacked_leaves(qkv, 1)
    ref_out, ref_lse = flash_attn_ext.flash_attn_varlen_func(q, k, v, cu, cu, 26, 26, causal=True, window_size=(7, 0),
                                                             return_lse=True)
    _assert_same((out, lse), (ref_out, ref_lse), "varlen qkvpacked forward")
    _assert_same((dqkv,), (torch.stack(_grads(ref_out, ref_lse, [q, k, v]), dim=1),), "varlen qkvpacked gradient")

    cu_k = torch.tensor([0, 9, 12, 30, 52], dtype=torch.int32, device=device)
    qv = torch.randn(40, 4, 64, dtype=dtype, device=device, requires_grad=True)
    kv = torch.randn(52, 2, 2, 64, dtype=dtype, device=device, requires_grad=True)
    out = flash_attn_ext.flash_attn_varlen_kvpacked_func(qv, kv, cu, cu_k, 26, 22)
    dq, dkv = _grads(out, None, [qv, kv])
    q2 = qv.detach().clone().requires_grad_(True)
    k, v = _unpacked_leaves(kv, 1)
    ref = flash_attn_ext.flash_attn_varlen_func(q2, k, v, cu, cu_k, 26, 22)
    rq, rk, rv = _grads(ref, None, [q2, k, v])
    _assert_same((out, dq, dkv), (ref, rq, torch.stack([rk, rv], dim=1)), "varlen kvpacked")


def test_packed_compile_fullgraph():
    """No graph break: the views and the op trace as one graph (CPU)."""
    qkv = torch.randn(1, 16, 3, 2, 32, requires_grad=True)
    fn = torch.compile(lambda x: flash_attn_ext.flash_attn_qkvpacked_func(x, causal=True), fullgraph=True)
    out = fn(qkv)
    out.sum().backward()
    ref = flash_attn_ext.flash_attn_qkvpacked_func(qkv.detach(), causal=True)
    torch.testing.assert_close(out, ref)
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape


def test_packed_bad_input():
    q = torch.randn(1, 8, 2, 32)
    dense = r"qkv must be \(batch, seqlen, 3, nheads, headdim\), got shape "
    with pytest.raises(RuntimeError, match=dense + r"\(1, 8, 2, 2, 32\)"):
        flash_attn_ext.flash_attn_qkvpacked_func(torch.randn(1, 8, 2, 2, 32))
    with pytest.raises(RuntimeError, match=dense + r"\(8, 3, 2, 32\)"):
        flash_attn_ext.flash_attn_qkvpacked_func(torch.randn(8, 3, 2, 32))
    with pytest.raises(RuntimeError, match=r"kv must be \(batch, seqlen_k, 2, nheads_k, headdim\)"):
        flash_attn_ext.flash_attn_kvpacked_func(q, torch.randn(1, 8, 3, 2, 32))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"qkv must be \(total, 3, nheads, headdim\)"):
        flash_attn_ext.flash_attn_varlen_qkvpacked_func(torch.randn(8, 2, 2, 32), cu, 8)
    with pytest.raises(RuntimeError, match=r"kv must be \(total_k, 2, nheads_k, headdim\)"):
        flash_attn_ext.flash_attn_varlen_kvpacked_func(q[0], torch.randn(8, 2, 32), cu, cu, 8, 8)
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor, got list"):
        flash_attn_ext.flash_attn_qkvpacked_func([q, q, q])
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got NoneType"):
        flash_attn_ext.flash_attn_kvpacked_func(None, torch.randn(1, 8, 2, 2, 32))
    qkv = torch.randn(1, 8, 3, 2, 32)
    torch.manual_seed(3)  # flash-attn's second positional is dropout_p, not the softmax scale
    positional = flash_attn_ext.flash_attn_qkvpacked_func(qkv, 0.5)
    torch.manual_seed(3)
    assert torch.equal(positional, flash_attn_ext.flash_attn_qkvpacked_func(qkv, dropout_p=0.5))
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_ext.flash_attn_qkvpacked_func(qkv, 1.0)
    # The unpacked function's own checks still name their arguments (here: the head dim).
    with pytest.raises(RuntimeError, match="headdim"):
        flash_attn_ext.flash_attn_qkvpacked_func(torch.randn(1, 8, 3, 2, 264))
