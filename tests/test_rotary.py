"""flash_attn_ext.rotary.apply_rotary_emb (flash-attn's flash_attn.layers.rotary function) against a
float64 reference written as complex multiplication: both channel pairings, partial rotary_dim,
int and per-sequence offsets, packed sequences, positions past the tables, in place, gradients,
and the refusals."""

import pytest
import torch

from flash_attn_ext.rotary import apply_rotary_emb

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _tables(seqlen_ro, rotary_dim, dtype, device, base=10000.0):
    theta = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * theta[None, :]
    return angle.cos().to(dtype).to(device), angle.sin().to(dtype).to(device)


def _reference(x, cos, sin, positions, interleaved):
    """x (..., headdim) at positions (x's leading shape but heads): the first 2 * cos.shape[1]
    channels as complex numbers times exp(i angle), in float64; positions past the tables kept."""
    x64, rd = x.double(), 2 * cos.shape[1]
    xr = x64[..., :rd]
    pairs = xr.unflatten(-1, (-1, 2)) if interleaved else torch.stack(xr.chunk(2, dim=-1), dim=-1)
    z = torch.view_as_complex(pairs.contiguous())
    inside = (positions >= 0) & (positions < cos.shape[0])
    rows = positions.clamp(0, cos.shape[0] - 1)
    rot = torch.complex(torch.where(inside[..., None], cos.double()[rows], 1.0),
                        torch.where(inside[..., None], sin.double()[rows], 0.0)).unsqueeze(-2)  # over heads
    y = torch.view_as_real(z * rot)
    y = y.flatten(-2) if interleaved else torch.cat((y[..., 0], y[..., 1]), dim=-1)
    return torch.cat((y, x64[..., rd:]), dim=-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_emb_matches_reference(device, interleaved, rotary_dim, dtype):
    batch, seqlen, nheads, headdim = 3, 37, 4, 64
    x = torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype)
    cos, sin = _tables(80, rotary_dim, dtype, device)
    for offsets in (0, 11, torch.tensor([0, 5, 43], device=device, dtype=torch.int32)):
        shift = offsets[:, None].long() if isinstance(offsets, torch.Tensor) else offsets
        pos = (torch.arange(seqlen, device=device)[None, :] + shift).expand(batch, seqlen)
        out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
        ref = _reference(x, cos, sin, pos, interleaved)
        same_dtype = _reference(x, cos, sin, pos, interleaved).to(dtype)  # one rounding: the best a dtype does
        assert out.dtype == dtype and out.shape == x.shape
        err, base = (out.double() - ref).abs().max(), (same_dtype.double() - ref).abs().max()
        assert err <= 2 * base + 1e-6, (err, base)
        assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("device", DEVICES)
def test_positions_past_the_tables_are_not_rotated(device):
    """flash-attn's kernel reads cos 1 / sin 0 past seqlen_ro (tensor offsets can reach there)."""
    x = torch.randn(2, 8, 2, 32, device=device)
    cos, sin = _tables(10, 32, torch.float32, device)
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([0, 6], device=device))
    assert torch.equal(out[1, 4:], x[1, 4:]) and not torch.equal(out[1, :4], x[1, :4])
    assert torch.allclose(out[0, 0], x[0, 0]) and not torch.allclose(out[0, 7], x[0, 7])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_sequences_equal_each_sequence_alone(device, interleaved):
    lens = [5, 0, 9, 3]
    cu = torch.tensor([0, 5, 5, 14, 17], dtype=torch.int32, device=device)
    x = torch.randn(19, 2, 32, device=device)  # two rows past cu_seqlens[-1]: unchanged
    cos, sin = _tables(16, 16, torch.float32, device)
    offsets = torch.tensor([1, 2, 3, 4], device=device)
    out = apply_rotary_emb(x, cos, sin, interleaved, False, offsets, cu, max(lens))
    for b, n in enumerate(lens):
        s = int(cu[b])
        alone = apply_rotary_emb(x[None, s:s + n], cos, sin, interleaved, seqlen_offsets=int(offsets[b]))
        assert torch.equal(out[s:s + n], alone[0])
    assert torch.equal(out[17:], x[17:])


def test_inplace_and_gradient():
    x = torch.randn(2, 6, 3, 16, dtype=torch.float64)
    cos, sin = _tables(6, 16, torch.float64, "cpu")
    y = x.clone()
    assert apply_rotary_emb(y, cos, sin, inplace=True) is y and torch.equal(y, apply_rotary_emb(x, cos, sin))
    xg = x.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: apply_rotary_emb(t, cos, sin, interleaved=True), (xg,))
    # in place inside a graph (flash-attn's training use): the gradient is the inverse rotation's
    leaf = x.clone().requires_grad_()
    h = leaf * 1.0
    apply_rotary_emb(h, cos, sin, inplace=True)
    g = torch.randn_like(h)
    h.backward(g)
    rot_t = apply_rotary_emb(g, cos, -sin)  # the transpose of a rotation: the opposite angle
    assert torch.allclose(leaf.grad, rot_t, atol=1e-12)


def test_refusals_name_the_argument():
    x = torch.randn(2, 8, 2, 32)
    cos, sin = _tables(8, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"seqlen_offsets = 1 with seqlen = 8; .* seqlen_ro = 8"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=1)
    with pytest.raises(ValueError, match="rotary_dim at most headdim = 16"):
        apply_rotary_emb(x[..., :16], cos, sin)
    with pytest.raises(ValueError, match=r"sin has shape \[8, 8\] but cos has \[8, 16\]"):
        apply_rotary_emb(x, cos, sin[:, :8])
    with pytest.raises(ValueError, match=r"x is shape \[2, 8, 2, 32\].*\(total, nheads, headdim\) tensor with cu_"):
        apply_rotary_emb(x, cos, sin, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32), max_seqlen=8)
    with pytest.raises(ValueError, match=r"seqlen_offsets has shape \[3\].*\(batch,\) = \(2,\)"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens has shape"):
        apply_rotary_emb(x[0], cos, sin, cu_seqlens=torch.tensor([0.0, 8.0]), max_seqlen=8)
    with pytest.raises(ValueError, match="cos is shape"):
        apply_rotary_emb(x, cos.to(torch.int32), sin)
    packed = torch.randn(20, 1, 32)  # a review: without max_seqlen, rows past the tables went unrotated, unchecked
    with pytest.raises(ValueError, match="max_seqlen = None; expected a non-negative int with cu_seqlens"):
        apply_rotary_emb(packed, cos, sin, cu_seqlens=torch.tensor([0, 20], dtype=torch.int32))
    with pytest.raises(ValueError, match="seqlen_offsets = 0 with max_seqlen = 20"):
        apply_rotary_emb(packed, cos, sin, cu_seqlens=torch.tensor([0, 20], dtype=torch.int32), max_seqlen=20)
    np = pytest.importorskip("numpy")
    assert torch.equal(apply_rotary_emb(x[:, :4], cos, sin, seqlen_offsets=np.int64(3)),
                       apply_rotary_emb(x[:, :4], cos, sin, seqlen_offsets=3))
