"""flash_attn_ext.nn modules and flash_attn_ext.sdpa.scaled_dot_product_attention.

Accuracy: the project criterion (tests/accuracy.py): max|ours - ref| <= 2 * max|torch same-dtype
- ref| (+ a float32 floor), ref = the same torch computation in float64.
"""

import copy
import re

import pytest
import torch
import torch.nn.functional as F

from accuracy import check_accuracy, sdpa_math
from flash_attn_ext.nn import (FlashAttention, MultiheadFlashAttention, apply_rotary,
                               rotary_cos_sin)
from flash_attn_ext.reference import attention_ref
from flash_attn_ext.sdpa import scaled_dot_product_attention

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _randn(*shape, dtype=torch.float32, device="cpu", seed=None):
    g = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)


# ---------------------------------------------------------------- FlashAttention


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads_k", [4, 1])
@pytest.mark.parametrize("seqlens", [(33, 33), (17, 40), (40, 17)])
def test_flash_attention_module_matches_reference(causal, nheads_k, seqlens):
    Lq, Lk = seqlens
    q = _randn(2, Lq, 4, 32, seed=1)
    k = _randn(2, Lk, nheads_k, 32, seed=2)
    v = _randn(2, Lk, nheads_k, 32, seed=3)
    mod = FlashAttention(softmax_scale=0.3, causal=causal)
    out = mod(q, k, v)
    ref, _ = attention_ref(q, k, v, softmax_scale=0.3, causal=causal, upcast=True)
    base, _ = attention_ref(q, k, v, softmax_scale=0.3, causal=causal, upcast=False)
    check_accuracy("FlashAttention out", out, ref, base)


# ---------------------------------------------------------------- MultiheadFlashAttention


def _mha_pair(embed_dim=64, num_heads=2, bias=True, seed=0):
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=True)
    with torch.no_grad():  # non-zero biases, so a wrong bias slice would show
        for p in mha.parameters():
            p.add_(0.05 * torch.randn_like(p))
    mfa = MultiheadFlashAttention(embed_dim, num_heads, bias=bias)
    mfa.load_state_dict(mha.state_dict())
    return mha, mfa


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mode", ["self", "self_xxx", "cross", "causal_hint", "causal_hint_bool"])
def test_mha_drop_in_for_torch_multihead_attention(bias, mode):
    mha, mfa = _mha_pair(bias=bias)
    mha64 = copy.deepcopy(mha).double()

    def call(m, x, y, mask, ours):
        if mode == "self":
            return m(x) if ours else m(x, x, x, need_weights=False)
        if mode == "self_xxx":
            return m(x, x, x, need_weights=False)
        if mode == "cross":
            return m(x, y, y, need_weights=False)
        return m(x, x, x, need_weights=False, attn_mask=mask, is_causal=True)

    x, y = _randn(3, 24, 64, seed=4), _randn(3, 11, 64, seed=5)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(24)
    if mode == "causal_hint_bool":  # nn.MultiheadAttention's bool convention: True = not allowed to attend
        mask = torch.ones(24, 24, dtype=torch.bool).triu(1)
    out, w = call(mfa, x, y, mask, True)
    assert w is None and out.shape == (3, 24, 64) and out.dtype == torch.float32
    ref = call(mha64, x.double(), y.double(), mask if mask.dtype == torch.bool else mask.double(), False)[0]
    base = call(mha, x, y, mask, False)[0]
    check_accuracy(f"MultiheadFlashAttention {mode}", out, ref, base)


@pytest.mark.parametrize("layer", ["encoder", "decoder"])
@pytest.mark.parametrize("train", [True, False])
def test_mha_as_self_attn_of_torch_transformer_layers(layer, train):
    """MultiheadFlashAttention as ``self_attn`` of torch's Transformer layers, in train and eval mode
    (the encoder layer's eval fast path reads ``_qkv_same_embed_dim``: it once raised AttributeError):
    the layer's output meets the accuracy rule against torch's own layer (float64 reference)."""
    torch.manual_seed(0)
    cls = torch.nn.TransformerEncoderLayer if layer == "encoder" else torch.nn.TransformerDecoderLayer
    ref_layer = cls(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
    ours = copy.deepcopy(ref_layer)
    ours.self_attn = MultiheadFlashAttention(64, 4, batch_first=True)
    ours.self_attn.load_state_dict(ref_layer.self_attn.state_dict())
    for m in (ref_layer, ours):
        m.train(train)
    x, memory = _randn(2, 10, 64, seed=1), _randn(2, 7, 64, seed=2)
    args = (x,) if layer == "encoder" else (x, memory)
    with torch.no_grad():
        out = ours(*args)
        ref = copy.deepcopy(ref_layer).double()(*(a.double() for a in args))
        base = ref_layer(*args)
    check_accuracy(f"{layer} layer (train={train})", out, ref, base)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("causal", [False, True])
def test_mha_swapped_into_a_torch_encoder_takes_its_nested_eval_path(causal):
    """An nn.TransformerEncoder built with torch's attention chooses its nested-tensor eval path at
    construction; MultiheadFlashAttention swapped in afterwards (model surgery) then receives nested
    tensors in eval mode with a src_key_padding_mask (it raised NestedTensorImpl's 'doesn't support
    sizes'). The padded positions' output is torch's (zeros), the rest meets the accuracy rule
    against torch's encoder in float64; a nested query of either layout gives each sequence's rows
    of a run alone."""
    torch.manual_seed(0)
    ref = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(64, 4, 128, 0.0, batch_first=True), 2)
    ours = copy.deepcopy(ref)
    for layer in ours.layers:
        mha = MultiheadFlashAttention(64, 4, causal=causal)
        mha.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = mha
    ref.eval(), ours.eval()
    assert ours.use_nested_tensor
    x = _randn(3, 10, 64, seed=1)
    padding = torch.zeros(3, 10, dtype=torch.bool)
    padding[1, 7:], padding[2, 3:] = True, True
    causal_mask = torch.ones(10, 10, dtype=torch.bool).triu(1) if causal else None
    with torch.no_grad():
        out = ours(x, src_key_padding_mask=padding, is_causal=causal, mask=None)
        # torch's reference: the same layers, the causal mask given explicitly (its nested path takes none)
        ref64 = copy.deepcopy(ref).double()
        ref_out = ref64(x.double(), mask=causal_mask, src_key_padding_mask=padding)
        base = ref(x, mask=causal_mask, src_key_padding_mask=padding)
    keep = ~padding[..., None]
    assert torch.equal(out * ~keep, torch.zeros_like(out))
    check_accuracy(f"encoder nested eval path (causal={causal})", out * keep, ref_out * keep, base * keep)
    mha = ours.layers[0].self_attn
    rows = [_randn(n, 64, seed=n) for n in (5, 2, 7)]
    with torch.no_grad():
        alone = [mha(r[None])[0][0] for r in rows]
        for layout in (torch.strided, torch.jagged):
            nested, _ = mha(torch.nested.nested_tensor(rows, layout=layout))
            assert nested.is_nested and nested.layout == layout
            for got, want in zip(nested.unbind(), alone):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    nested = torch.nested.nested_tensor(rows, layout=torch.jagged)
    with pytest.raises(NotImplementedError, match="nested query is taken for self-attention only"):
        mha(nested, key_padding_mask=torch.zeros(3, 7, dtype=torch.bool))
    # rows of another width were padded to embed_dim and run (a review found it): refused
    with pytest.raises(ValueError, match=r"nested query must be \(batch, ragged seqlen, 64\).*\(2, 32\)"):
        mha(torch.nested.nested_tensor([rows[0], _randn(2, 32)]))
    # a non-causal asymmetric window (the padded path's masks refuse it) and all-empty rows: each
    # sequence alone
    windowed = MultiheadFlashAttention(64, 4, window_size=(2, 1))
    with torch.no_grad():
        out, _ = windowed(torch.nested.nested_tensor(rows))
        for got, row in zip(out.unbind(), rows):
            torch.testing.assert_close(got, windowed(row[None])[0][0], rtol=0, atol=0)
        empty, _ = windowed(torch.nested.nested_tensor([_randn(0, 64), _randn(0, 64)]))
    assert [tuple(t.shape) for t in empty.unbind()] == [(0, 64), (0, 64)]


def test_mha_torch_positional_order_is_a_clear_error():
    """torch.nn.MultiheadAttention(E, H, dropout) positionally: the third argument here is
    num_kv_heads, so a float there is a TypeError that points at dropout=, not a division error."""
    with pytest.raises(TypeError, match="num_kv_heads .* must be an int.*dropout="):
        MultiheadFlashAttention(64, 4, 0.1)
    with pytest.raises(ValueError, match="always batch-first"):
        MultiheadFlashAttention(64, 4, batch_first=False)


def test_modules_check_their_arguments_at_construction():
    """A wrong type is a TypeError naming the argument when the module is built, not at its first
    forward (rotary_base only with rotary), a head count or width below 1 a ValueError; the values kept are the checked ones (a 0-dim tensor
    scale as a float, 1 as True)."""
    for make, match in ((lambda: FlashAttention(softmax_scale="x"), "softmax_scale must be a real number"),
                        (lambda: FlashAttention(causal="x"), "causal must be a bool"),
                        (lambda: MultiheadFlashAttention(64, 4, causal="yes"), "causal must be a bool"),
                        (lambda: MultiheadFlashAttention(64, 4, rotary=None), "rotary must be a bool"),
                        (lambda: MultiheadFlashAttention(64, 4, rotary=True, rotary_base="1e4"),
                         "rotary_base must be a real number")):
        with pytest.raises(TypeError, match=match):
            make()
    for args, error, match in (((32, 4.0), TypeError, "num_heads must be an int, got float 4.0"),
                               ((32, True), TypeError, "num_heads must be an int, got a bool"),
                               ((32.0, 4), TypeError, "embed_dim must be an int, got float 32.0"),
                               ((32, 0), ValueError, "num_heads must be >= 1, got 0"),
                               ((0, 4), ValueError, "embed_dim must be >= 1, got 0")):
        with pytest.raises(error, match=match):
            MultiheadFlashAttention(*args)
    fa = FlashAttention(softmax_scale=torch.tensor(0.5), causal=1)
    assert fa.softmax_scale == 0.5 and type(fa.softmax_scale) is float and fa.causal is True
    assert MultiheadFlashAttention(64, 4, rotary_base=None).rotary_base is None  # unused without rotary


@pytest.mark.parametrize("kind", ["causal (L, S) bool", "causal (B H, L, S) float", "offset causal, cross",
                                  "packed, self", "with key padding"])
def test_mha_attn_mask_matches_torch(kind):
    """attn_mask as torch.nn.MultiheadAttention takes it without is_causal (bool True = not allowed,
    or additive; (L, S) or (batch * heads, L, S) the same on every head): out and the input's
    gradient against torch's module."""
    mha, mfa = _mha_pair()
    mha64 = copy.deepcopy(mha).double()
    x, y = _randn(3, 10, 64, seed=11), _randn(3, 14, 64, seed=12)
    Lk = 14 if kind.endswith("cross") else 10
    i, j = torch.arange(10)[:, None], torch.arange(Lk)[None, :]
    kw = {}
    if kind == "causal (L, S) bool":
        mask = j > i
    elif kind == "causal (B H, L, S) float":
        mask = torch.zeros(10, 10).masked_fill(j > i, float("-inf")).expand(3 * 2, 10, 10).clone()
    elif kind == "offset causal, cross":
        mask = j > i + Lk - 10                                   # bottom-right causal over 14 keys
    elif kind == "packed, self":
        seq = (torch.arange(10) >= 4).long()
        mask = (j > i) | (seq[:, None] != seq[None, :])
    else:
        mask = j > i
        kw["key_padding_mask"] = torch.arange(10)[None, :] >= torch.tensor([10, 7, 3])[:, None]
    kv = (y, y) if kind.endswith("cross") else None
    xg = x.clone().requires_grad_()
    out = mfa(xg, *(kv or (xg, xg)), attn_mask=mask, need_weights=False, **kw)[0]
    x64 = x.double().requires_grad_()
    m64 = mask if mask.dtype == torch.bool else mask.double()
    ref = mha64(x64, *(tuple(t.double() for t in kv) if kv else (x64, x64)), attn_mask=m64, need_weights=False, **kw)[0]
    base = mha(x, *(kv or (x, x)), attn_mask=mask, need_weights=False, **kw)[0]
    check_accuracy(f"MultiheadFlashAttention attn_mask {kind}", out, ref, base)
    if kv is None:
        dout = _randn(3, 10, 64, seed=13)
        out.backward(dout)
        ref.backward(dout.double())
        xb = x.clone().requires_grad_()
        mha(xb, xb, xb, attn_mask=mask, need_weights=False, **kw)[0].backward(dout)
        check_accuracy(f"MultiheadFlashAttention attn_mask {kind} dx", xg.grad, x64.grad, xb.grad)


@pytest.mark.parametrize("mode", ["self", "cross", "causal_hint", "float"])
def test_mha_key_padding_mask_matches_torch(mode):
    """key_padding_mask as torch.nn.MultiheadAttention takes it (bool True = padding, or float
    0 / -inf), right and left padding, self- and cross-attention, with the causal hint: out (and,
    self-attention, the input's gradient) against torch's module, rows that see no key (a causal
    left-padded row: attention 0 here) included where torch gives a number."""
    mha, mfa = _mha_pair()
    mha64 = copy.deepcopy(mha).double()
    x, y = _randn(3, 12, 64, seed=8), _randn(3, 9, 64, seed=9)
    keys_len = 12 if mode != "cross" else 9
    pos = torch.arange(keys_len)[None, :]
    pad = torch.stack([pos[0] >= keys_len, pos[0] >= keys_len - 4, pos[0] < 3])      # none, right 4, left 3
    kpm = pad if mode != "float" else torch.zeros(3, keys_len).masked_fill(pad, float("-inf"))
    kw = dict(key_padding_mask=kpm, need_weights=False)
    if mode == "causal_hint":
        kw.update(attn_mask=torch.ones(12, 12, dtype=torch.bool).triu(1), is_causal=True)
    kv = (y, y) if mode == "cross" else (x, x)
    xg = x.clone().requires_grad_()
    out = mfa(xg, *(kv if mode == "cross" else (xg, xg)), **kw)[0]
    kw64 = {**kw, "key_padding_mask": kpm if kpm.dtype == torch.bool else kpm.double()}
    x64 = x.double().requires_grad_()
    ref = mha64(x64, *(tuple(t.double() for t in kv) if mode == "cross" else (x64, x64)), **kw64)[0]
    base = mha(x, *kv, **kw)[0]
    rows = torch.isfinite(ref).all(-1)     # (torch versions differ on rows that see no key: NaN or 0)
    check_accuracy(f"MultiheadFlashAttention key_padding_mask {mode}", out[rows], ref[rows], base[rows])
    if mode != "cross":
        dout = _randn(3, 12, 64, seed=10) * rows[..., None]
        out.backward(dout)
        ref.backward(torch.nan_to_num(dout.double()))
        assert torch.isfinite(xg.grad).all()
        xb = x.clone().requires_grad_()
        mha(xb, xb, xb, **kw)[0].backward(dout)
        check_accuracy(f"MultiheadFlashAttention key_padding_mask {mode} dx", xg.grad, torch.nan_to_num(x64.grad),
                       torch.nan_to_num(xb.grad))


def _module_pair(rotary, num_kv_heads, causal, dtype=torch.float32, device="cpu", seed=0):
    torch.manual_seed(seed)
    ours = MultiheadFlashAttention(128, 4, num_kv_heads=num_kv_heads, causal=causal, rotary=rotary,
                                   device=device, dtype=dtype)
    with torch.no_grad():
        ours.in_proj_bias.normal_(0, 0.05)
    ref = MultiheadFlashAttention(128, 4, num_kv_heads=num_kv_heads, causal=causal, rotary=rotary,
                                  device=device, dtype=dtype, backend="torch_sdpa")
    ref.load_state_dict(ours.state_dict())
    return ours, ref


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_mha_gqa_rotary_forward_backward_vs_torch_sdpa(rotary, num_kv_heads, causal):
    ours, torch_mod = _module_pair(rotary, num_kv_heads, causal)
    torch64 = copy.deepcopy(torch_mod).double()
    x = _randn(2, 37, 128, seed=6).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    xb = x.detach().clone().requires_grad_()
    dout = _randn(2, 37, 128, seed=7)
    out = ours(x)[0]
    ref = torch64(x64)[0]
    base = torch_mod(xb)[0]
    check_accuracy("out", out, ref, base)
    out.backward(dout)
    ref.backward(dout.double())
    base.backward(dout)
    check_accuracy("dx", x.grad, x64.grad, xb.grad)
    for (name, p), p64, pb in zip(ours.named_parameters(), torch64.parameters(),
                                  torch_mod.parameters()):
        check_accuracy(f"d{name}", p.grad, p64.grad, pb.grad)


@pytest.mark.parametrize("backend", ["flash_attn_ext", "torch_sdpa"])
def test_mha_rotary_query_chunk_matches_full_rows(backend):
    # Rotary with fewer queries than keys (a chunk of queries against the whole sequence, e.g.
    # chunked prefill): the queries take the last positions, as the causal mask aligns them, so
    # the chunk's rows equal those rows of the full self-attention (a new user's report: queries
    # numbered from 0 gave rows 0.12 off).
    torch.manual_seed(0)
    m = MultiheadFlashAttention(64, 4, num_kv_heads=2, causal=True, rotary=True, dtype=torch.float64,
                                backend=backend)
    x = torch.randn(2, 10, 64, dtype=torch.float64)
    full = m(x)[0]
    for lq in (1, 3, 9):
        part = m(x[:, -lq:], x, x)[0]
        torch.testing.assert_close(part, full[:, -lq:], rtol=0, atol=1e-12)


def test_mha_cross_attention_gqa_causal_bottom_right():
    # Cross-attention with seqlen_q < seqlen_k, causal: bottom-right aligned in both backends.
    ours, torch_mod = _module_pair(False, 2, True)
    torch64 = copy.deepcopy(torch_mod).double()
    x, mem = _randn(2, 9, 128, seed=8), _randn(2, 30, 128, seed=9)
    out = ours(x, mem, mem)[0]
    check_accuracy("cross out", out, torch64(x.double(), mem.double(), mem.double())[0],
                   torch_mod(x, mem, mem)[0])


def test_rotary_is_roformer_eq34_and_relative():
    # RoFormer eq. 34 as complex multiplication on pairs (c, c + d/2): z_c * exp(i m theta_c).
    d, L = 16, 12
    x = _randn(1, L, 2, d, dtype=torch.float64, seed=10)
    cos, sin = rotary_cos_sin(L, d, base=10000.0, dtype=torch.float64)
    got = apply_rotary(x, cos, sin)
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:])
    rot = z * torch.exp(1j * torch.arange(L, dtype=torch.float64)[:, None, None] * theta)
    want = torch.cat([rot.real, rot.imag], dim=-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # float64 tables: float64-accurate
    cos32, sin32 = rotary_cos_sin(L, d, base=10000.0)
    torch.testing.assert_close(apply_rotary(x.float(), cos32, sin32), want.float(), rtol=0, atol=1e-5)
    # Relative: <R_m q, R_n k> depends only on m - n.
    q, k = _randn(d, dtype=torch.float64, seed=11), _randn(d, dtype=torch.float64, seed=12)
    qs = apply_rotary(q.expand(1, L, 1, d), cos, sin)[0, :, 0]
    ks = apply_rotary(k.expand(1, L, 1, d), cos, sin)[0, :, 0]
    dots = qs @ ks.T
    for s in range(1, 4):
        torch.testing.assert_close(dots[s:, s:], dots[:-s, :-s], rtol=0, atol=1e-12)
    assert not torch.allclose(dots[0, 1], dots[0, 2])


def test_mha_autocast_cpu_bf16():
    ours, torch_mod = _module_pair(True, 2, True)
    torch64 = copy.deepcopy(torch_mod).double()
    x = _randn(2, 20, 128, seed=13)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(x)[0]
        base = torch_mod(x)[0]
    assert out.dtype == torch.bfloat16
    check_accuracy("autocast out", out, torch64(x.double())[0], base)


def test_mha_errors_are_clear():
    m = MultiheadFlashAttention(64, 2)
    x = _randn(2, 8, 64)
    with pytest.raises(TypeError, match="is_causal must be a bool, got str 'no'"):
        m(x, is_causal="no")
    with pytest.raises(RuntimeError, match="key_padding_mask is on meta but query is on cpu"):
        m(x, key_padding_mask=torch.zeros(2, 8, dtype=torch.bool, device="meta"))
    with pytest.raises(RuntimeError, match="attn_mask is on meta but query is on cpu"):
        m(x, attn_mask=torch.zeros(8, 8, dtype=torch.bool, device="meta"))
    with pytest.raises(NotImplementedError, match="need_weights"):
        m(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match="key_padding_mask must be .batch=2, seqlen_k=8"):
        m(x, key_padding_mask=torch.zeros(8, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must be a bool"):
        m(x, key_padding_mask=torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(NotImplementedError, match=r"non-causal call needs a symmetric window \(w, w\).*\(2, 1\)"):
        MultiheadFlashAttention(64, 2, window_size=(2, 1))(x, key_padding_mask=torch.zeros(2, 8, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="seqlen_q == seqlen_k, got window_size .2, 2., seqlen_q 8, seqlen_k 5"):
        MultiheadFlashAttention(64, 2, window_size=(2, 2))(x, x[:, :5], x[:, :5],
                                                           key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    per_head = torch.zeros(2 * 2, 8, 8, dtype=torch.bool)
    per_head[1, :, 3] = True                                    # head 1 of element 0 does not see key 3
    with pytest.raises(NotImplementedError, match="attn_mask that differs per head"):
        m(x, attn_mask=per_head)
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    with pytest.raises(NotImplementedError, match="MultiheadFlashAttention: with this key_padding_mask / attn_mask"):
        m(x, attn_mask=(i - j).abs() > 2)                      # a band: not padding nor causal
    with pytest.raises(ValueError, match="attn_mask must be"):
        m(x, attn_mask=torch.zeros(7, 8, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="causal mask"):
        m(x, attn_mask=torch.zeros(8, 8), is_causal=True)  # not causal, though hinted
    with pytest.raises(ValueError, match="both key and value"):
        m(x, x)
    with pytest.raises(ValueError, match="query must be"):
        m(_randn(2, 8, 32))
    with pytest.raises(ValueError, match="divisible by num_heads"):
        MultiheadFlashAttention(65, 2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        MultiheadFlashAttention(64, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="backend"):
        MultiheadFlashAttention(64, 4, backend="xformers")
    with pytest.raises(ValueError, match="headdim = embed_dim / num_heads = 264"):
        MultiheadFlashAttention(528, 2)  # at construction, not at the first forward
    MultiheadFlashAttention(528, 2, backend="torch_sdpa")  # SDPA takes any headdim
    # headdim 12 (not a multiple of 8): zero-padded inside, the torch_sdpa backend's result
    x = torch.randn(2, 5, 48, dtype=torch.float64)
    ours, ref = MultiheadFlashAttention(48, 4, causal=True).double(), MultiheadFlashAttention(
        48, 4, causal=True, backend="torch_sdpa").double()
    ref.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- scaled_dot_product_attention


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("seqlens", [(32, 32), (13, 45), (45, 13), (1, 20)])
@pytest.mark.parametrize("nheads_k", [4, 2])
def test_sdpa_matches_torch_semantics(is_causal, seqlens, nheads_k):
    L, S = seqlens
    q = _randn(2, 4, L, 64, seed=20)
    k = _randn(2, nheads_k, S, 64, seed=21).requires_grad_()
    v = _randn(2, nheads_k, S, 64, seed=22).requires_grad_()
    q.requires_grad_()
    gqa = nheads_k != 4
    out = scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.2, enable_gqa=gqa)
    assert out.shape == (2, 4, L, 64)
    args64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    argsb = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*args64, is_causal=is_causal, scale=0.2, enable_gqa=gqa)
    base = sdpa_math(*argsb, is_causal=is_causal, scale=0.2, enable_gqa=gqa)
    check_accuracy("sdpa out", out, ref, base)
    dout = _randn(2, 4, L, 64, seed=23)
    out.backward(dout)
    ref.backward(dout.double())
    base.backward(dout)
    for name, t, t64, tb in zip("qkv", (q, k, v), args64, argsb):
        check_accuracy(f"sdpa d{name}", t.grad, t64.grad, tb.grad)


def _sdpa_masks(B, L, S):
    """attn_mask values the drop-in takes, as models pass them to torch's SDPA: key padding
    (B, 1, 1, S) bool; its additive float twin (0 / -inf) and the dtype-min fill; top-left
    causal (L, S) (``tril``); causal + key padding (B, 1, L, S); bottom-right causal with left
    padding; query and key padding (encoder-decoder); packed sequences (L == S)."""
    keys = torch.arange(S)[None, :] < torch.tensor([S, S - 3, 1])[:B, None]            # right padding
    left = torch.arange(S)[None, :] >= torch.tensor([0, 4, S - 2])[:B, None]            # left padding
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    masks = {
        "key padding": keys[:, None, None, :],
        "key padding, additive -inf": torch.zeros(B, 1, 1, S).masked_fill(~keys[:, None, None, :], float("-inf")),
        "key padding, additive dtype-min": torch.zeros(B, 1, 1, S).masked_fill(~keys[:, None, None, :],
                                                                               torch.finfo(torch.float32).min),
        "top-left causal": j <= i,
        "causal + key padding": ((j <= i)[None] & keys[:, None, :])[:, None],
        "bottom-right causal + left padding": ((j <= i + S - L)[None] & left[:, None, :])[:, None],
        "query and key padding": ((torch.arange(L)[None, :] < torch.tensor([L, L - 2, 2])[:B, None])[:, :, None]
                                  & keys[:, None, :])[:, None],
    }
    if L == S:
        seq = torch.tensor([0] * 3 + [1] * (L - 5) + [2] * 2)
        masks["packed, causal"] = (seq[:, None] == seq[None, :]) & (j <= i)
    return masks


@pytest.mark.parametrize("device,dtype", [pytest.param("cpu", torch.float32, id="cpu-fp32"),
                                          pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=requires_cuda)])
@pytest.mark.parametrize("seqlens", [(12, 12), (7, 12), (12, 7)])
@pytest.mark.parametrize("nheads_k", [4, 2])
def test_sdpa_attn_mask_matches_torch(seqlens, nheads_k, device, dtype):
    """attn_mask of the patterns the drop-in takes: out and gradients against torch's SDPA on
    the same mask (accuracy rule vs float64); rows that see no key are 0 with zero gradients."""
    L, S = seqlens
    for name, mask in _sdpa_masks(3, L, S).items():
        mask = mask.to(device)
        q = _randn(3, 4, L, 32, seed=30, dtype=dtype, device=device).requires_grad_()
        k = _randn(3, nheads_k, S, 32, seed=31, dtype=dtype, device=device).requires_grad_()
        v = _randn(3, nheads_k, S, 32, seed=32, dtype=dtype, device=device).requires_grad_()
        gqa = nheads_k != 4
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=gqa)
        args64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
        argsb = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        m64 = mask if mask.dtype == torch.bool else mask.double()
        ref = F.scaled_dot_product_attention(*args64, attn_mask=m64, scale=0.3, enable_gqa=gqa)
        base = sdpa_math(*argsb, attn_mask=mask if mask.dtype == torch.bool else mask.to(dtype),
                         scale=0.3, enable_gqa=gqa)
        allowed = (mask if mask.dtype == torch.bool else mask == 0).expand(3, 1, L, S)
        rows = allowed.any(-1).expand(3, 4, L)                   # rows that see a key
        assert (out[~rows] == 0).all(), name
        check_accuracy(f"sdpa attn_mask {name}", out[rows], ref[rows], base[rows])
        dout = _randn(3, 4, L, 32, seed=33, dtype=dtype, device=device) * rows[..., None]  # torch's empty rows: NaN
        out.backward(dout)
        ref.backward(torch.nan_to_num(dout.double()))
        base.backward(dout)
        for g, t, t64, tb in zip("qkv", (q, k, v), args64, argsb):
            check_accuracy(f"sdpa attn_mask {name} d{g}", t.grad, torch.nan_to_num(t64.grad), torch.nan_to_num(tb.grad))


def test_sdpa_attn_mask_under_compile():
    """torch.compile(fullgraph=True) of the drop-in with a key-padding attn_mask: the static-shape
    masked path (no host sync, no graph break), equal to the eager call."""
    q = _randn(3, 4, 10, 16, seed=34)
    mask = (torch.arange(10)[None, :] < torch.tensor([10, 7, 3])[:, None])[:, None, None, :]
    eager = scaled_dot_product_attention(q, q, q, attn_mask=mask)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, m: scaled_dot_product_attention(q, q, q, attn_mask=m), fullgraph=True)(q, mask)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_sdpa_attn_mask_edges():
    """A second engineer's cases: float masks under torch.compile(fullgraph=True) (the values
    checked on the device, not read on the host); a mask expanded over the heads, or equal on
    every head; float16's minimum in a float32 mask counts as masked; no row that sees a key:
    zeros still in the autograd graph (zero gradients); meta tensors: the output's shape; a mask
    that requires grad and vmap over the mask: refused, not silently dropped."""
    q = _randn(2, 4, 6, 16, seed=40)
    keys = torch.arange(6)[None, :] < torch.tensor([6, 3])[:, None]
    additive = torch.zeros(2, 1, 1, 6).masked_fill(~keys[:, None, None, :], float("-inf"))
    ref = F.scaled_dot_product_attention(q, q, q, attn_mask=keys[:, None, None, :])
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, m: scaled_dot_product_attention(q, q, q, attn_mask=m), fullgraph=True)
    torch.testing.assert_close(compiled(q, additive), ref, rtol=1e-5, atol=1e-6)
    for mask in (keys[:, None, None, :].expand(2, 4, 6, 6), keys[:, None, None, :].expand(2, 4, 6, 6).clone(),
                 torch.zeros(2, 1, 1, 6).masked_fill(~keys[:, None, None, :], torch.finfo(torch.float16).min)):
        torch.testing.assert_close(scaled_dot_product_attention(q, q, q, attn_mask=mask), ref, rtol=1e-5, atol=1e-6)
    qg = q.clone().requires_grad_()
    out = scaled_dot_product_attention(qg, qg, qg, attn_mask=torch.zeros(6, 6, dtype=torch.bool))
    out.sum().backward()
    assert (out == 0).all() and (qg.grad == 0).all()
    big = torch.full((1, 2, 64, 16), 60000.0, dtype=torch.float16, requires_grad=True)   # its sum overflows
    out = scaled_dot_product_attention(big, big, big, attn_mask=torch.zeros(64, 64, dtype=torch.bool))
    out.sum().backward()
    assert (out == 0).all() and (big.grad == 0).all()
    meta = torch.empty(2, 4, 6, 16, device="meta")
    assert scaled_dot_product_attention(meta, meta, meta, attn_mask=keys[:, None, None, :].to("meta")).shape == meta.shape
    with pytest.raises(NotImplementedError, match="attn_mask requires grad"):
        scaled_dot_product_attention(q, q, q, attn_mask=additive.clone().requires_grad_())
    # A forward-mode tangent on the mask is refused too (its tangent was dropped silently: zeros).
    with pytest.raises(NotImplementedError, match="attn_mask carries a forward-mode tangent"):
        torch.func.jvp(lambda m: scaled_dot_product_attention(q, q, q, attn_mask=m), (additive,),
                       (torch.randn_like(additive),))
    with torch.autograd.forward_ad.dual_level(), \
            pytest.raises(NotImplementedError, match="attn_mask carries a forward-mode tangent"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.autograd.forward_ad.make_dual(
            additive, torch.randn_like(additive)))
    with pytest.raises(NotImplementedError, match="vmap over attn_mask"):
        torch.func.vmap(lambda m: scaled_dot_product_attention(q, q, q, attn_mask=m))(keys[:, None, None, None, :])


@pytest.mark.parametrize("window", [0, 2, 5, 20])
def test_mha_symmetric_window_with_key_padding_matches_torch_sdpa(window):
    """A non-causal module with a symmetric sliding window (w, w) (a local-attention encoder,
    ModernBERT's local layers) and a key_padding_mask: the masked path's bidirectional-window
    calls (masked.bidirectional_window_plan) against the torch_sdpa backend's explicit mask, out
    and gradients (input, weights) against float64, for no, right and left padding and an
    element whose keys are all padding (its rows: attention 0, out_proj's bias)."""
    ours, torch_mod = _module_pair(False, 2, False)
    for m in (ours, torch_mod):
        m.window_size = (window, window)
    torch64 = copy.deepcopy(torch_mod).double()
    L = 13
    pos = torch.arange(L)
    pad = torch.stack([pos >= L, pos >= L - 4, pos < 3, pos >= 0])         # none, right 4, left 3, all
    x = _randn(4, L, 128, seed=51).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    xb = x.detach().clone().requires_grad_()
    dout = _randn(4, L, 128, seed=52)
    out = ours(x, key_padding_mask=pad)[0]
    ref = torch64(x64, key_padding_mask=pad)[0]
    base = torch_mod(xb, key_padding_mask=pad)[0]
    rows = torch.isfinite(ref).all(-1)     # torch versions differ on rows that see no key: NaN or 0
    assert rows[:3].all()
    check_accuracy(f"window {window} out", out[rows], ref[rows], base[rows])
    assert torch.allclose(out[3], ours.out_proj.bias.expand(L, -1))
    out.backward(dout * rows[..., None])
    ref.backward(torch.nan_to_num(dout.double() * rows[..., None]))
    base.backward(dout * rows[..., None])
    check_accuracy(f"window {window} dx", x.grad, torch.nan_to_num(x64.grad), torch.nan_to_num(xb.grad))
    for (name, p), p64, pb in zip(ours.named_parameters(), torch64.parameters(), torch_mod.parameters()):
        check_accuracy(f"window {window} d{name}", p.grad, torch.nan_to_num(p64.grad), torch.nan_to_num(pb.grad))


def test_mha_key_padding_mask_edges():
    """Float key_padding_mask under torch.compile(fullgraph=True); every key of an element padded
    (its attention rows 0, gradients still flow to the inputs); a causal call whose padding is not
    one run of keys is refused in the module's words."""
    _, mfa = _mha_pair()
    x = _randn(2, 6, 64, seed=41)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    additive = torch.zeros(2, 6).masked_fill(pad, float("-inf"))
    eager = mfa(x, key_padding_mask=pad)[0]
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, m: mfa(x, key_padding_mask=m)[0], fullgraph=True)(x, additive)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    xg = x[:1].clone().requires_grad_()
    out = mfa(xg, key_padding_mask=torch.ones(1, 6, dtype=torch.bool))[0]
    out.sum().backward()
    assert torch.allclose(out, mfa.out_proj.bias.expand_as(out)) and xg.grad is not None
    hole = torch.tensor([[False, True, False, False, False, False]])
    with pytest.raises(NotImplementedError, match="MultiheadFlashAttention: with this key_padding_mask.*torch_sdpa"):
        MultiheadFlashAttention(64, 2, causal=True)(x[:1], key_padding_mask=hole)


def test_sdpa_refuses_what_it_does_not_do():
    q = _randn(1, 4, 8, 32)
    k = _randn(1, 2, 8, 32)
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    per_head = torch.ones(1, 4, 8, 8, dtype=torch.bool)
    per_head[:, 1, :, 5] = False                                   # head 1 does not see key 5
    with pytest.raises(NotImplementedError, match="differs per head"):
        scaled_dot_product_attention(q, q, q, attn_mask=per_head)
    with pytest.raises(NotImplementedError, match="bias.*torch.nn.functional.scaled_dot_product_attention"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.randn(8, 8))
    with pytest.raises(NotImplementedError, match="neither padding.*torch.nn.functional"):
        scaled_dot_product_attention(q, q, q, attn_mask=(i - j).abs() <= 2)       # a band
    with pytest.raises(ValueError, match="is_causal"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="does not broadcast"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 7, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool or floating"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="dropout_p"):
        scaled_dot_product_attention(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match="enable_gqa"):
        scaled_dot_product_attention(q, k, k)
    with pytest.raises(ValueError, match="4-D"):
        scaled_dot_product_attention(q[0], q[0], q[0])
    with pytest.raises(TypeError, match="dtype"):
        scaled_dot_product_attention(q, q.double(), q)


def test_sdpa_zero_heads():
    """No heads: an empty output as torch (and empty gradients); key/value without heads for a
    query with some: a ValueError naming them (was a ZeroDivisionError from nheads % nheads_k)."""
    q, k = _randn(2, 0, 5, 16).requires_grad_(), _randn(2, 0, 7, 16).requires_grad_()
    out = scaled_dot_product_attention(q, k, k)
    # (torch's own SDPA is not called here: torch 2.11's CPU kernel dies of SIGFPE on zero heads.)
    assert out.shape == (2, 0, 5, 16)
    dq, dk = torch.autograd.grad(out.sum(), (q, k))
    assert dq.shape == q.shape and dk.shape == k.shape
    with pytest.raises(ValueError, match="key/value have 0 heads"):
        scaled_dot_product_attention(_randn(2, 4, 5, 16), k, k, enable_gqa=True)


# ---------------------------------------------------------------- torch.compile


class _TinyBlock(torch.nn.Module):
    def __init__(self, backend="flash_attn_ext"):
        super().__init__()
        self.ln = torch.nn.LayerNorm(64)
        self.attn = MultiheadFlashAttention(64, 2, num_kv_heads=1, causal=True, rotary=True,
                                            backend=backend)
        self.mlp = torch.nn.Linear(64, 64)

    def forward(self, x):
        x = x + self.attn(self.ln(x))[0]
        return x + self.mlp(x)


@pytest.mark.parametrize("backend,autocast", [("inductor", False), ("aot_eager", True)])
def test_torch_compile_fullgraph_cpu(backend, autocast):
    """fullgraph=True raises on any graph break; outputs and input grads match eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TinyBlock()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = _randn(2, 16, 64, seed=30).requires_grad_()
    xc = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        eager, out = model(x), compiled(xc)
    tol = 2e-2 if autocast else 1e-5
    torch.testing.assert_close(out, eager, rtol=tol, atol=tol)
    out.float().sum().backward()
    eager.float().sum().backward()
    torch.testing.assert_close(xc.grad, x.grad, rtol=tol, atol=tol)


# ---------------------------------------------------------------- CUDA


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_mha_cuda_forward_backward(dtype, num_kv_heads):
    ours, torch_mod = _module_pair(True, num_kv_heads, True, dtype=dtype, device="cuda")
    torch64 = copy.deepcopy(torch_mod).double()
    x = _randn(2, 300, 128, dtype=dtype, device="cuda", seed=40).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    xb = x.detach().clone().requires_grad_()
    out, ref, base = ours(x)[0], torch64(x64)[0], torch_mod(xb)[0]
    check_accuracy("cuda out", out, ref, base)
    dout = _randn(2, 300, 128, dtype=dtype, device="cuda", seed=41)
    out.backward(dout)
    ref.backward(dout.double())
    base.backward(dout)
    check_accuracy("cuda dx", x.grad, x64.grad, xb.grad)


@requires_cuda
def test_cuda_float32_outside_autocast_is_a_clear_error_and_autocast_works():
    m = MultiheadFlashAttention(128, 2, causal=True, device="cuda")
    x = _randn(2, 64, 128, device="cuda")
    with pytest.raises(TypeError, match="autocast"):
        m(x)
    with pytest.raises(TypeError, match="autocast"):
        scaled_dot_product_attention(*(_randn(1, 2, 64, 64, device="cuda"),) * 3)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = m(x)[0]
        q = _randn(1, 2, 64, 64, device="cuda")
        o2 = scaled_dot_product_attention(q, q, q)
        r2 = F.scaled_dot_product_attention(q, q, q)
    assert out.dtype == torch.bfloat16 and o2.dtype == r2.dtype == torch.bfloat16
    assert torch.isfinite(out).all()


@requires_cuda
def test_torch_compile_cuda_graphs_reduce_overhead():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TinyBlock().to("cuda", torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    x = _randn(4, 256, 64, dtype=torch.bfloat16, device="cuda", seed=50)
    with torch.no_grad():
        eager = model(x)
        for _ in range(3):  # warm-up runs, then replays of the captured CUDA graph
            out = compiled(x).clone()
    torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)
    x2 = _randn(4, 256, 64, dtype=torch.bfloat16, device="cuda", seed=51)
    with torch.no_grad():
        out2 = compiled(x2).clone()
        eager2 = model(x2)
    torch.testing.assert_close(out2, eager2, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(out2, out)


# ---------------------------------------------------------------- SDPA drop-in: layout, errors


DEVICE_DTYPES = [pytest.param("cpu", torch.float32, id="cpu-fp32"),
                 pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=requires_cuda)]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("which", ["query", "key", "all"])
def test_sdpa_accepts_non_contiguous_last_dim(device, dtype, which):
    """torch's SDPA takes a last dim with stride != 1 (it copies); so must the drop-in (the
    op underneath used to refuse it with an error about BSHD q/k/v)."""
    def make(shape, seed, strided):
        t = _randn(*shape[:2], shape[3], shape[2], dtype=dtype, device=device, seed=seed)
        t = t.transpose(-1, -2) if strided else t.transpose(-1, -2).contiguous()
        return t.requires_grad_()

    strided = {"query": which in ("query", "all"), "key": which in ("key", "all"),
               "value": which == "all"}
    q = make((2, 4, 20, 32), 60, strided["query"])
    k = make((2, 2, 27, 32), 61, strided["key"])
    v = make((2, 2, 27, 32), 62, strided["value"])
    assert (q.stride(-1) != 1) == strided["query"] and (k.stride(-1) != 1) == strided["key"]
    out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    # The same values in contiguous tensors: the kernels see the same numbers, so the results are
    # bitwise equal (the accuracy of those kernels is tested elsewhere against the reference).
    dense = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    expected = scaled_dot_product_attention(*dense, is_causal=True, enable_gqa=True)
    assert torch.equal(out, expected)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        args64 = [t.detach().double() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*args64, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)))
    dout = _randn(*out.shape, dtype=dtype, device=device, seed=63)
    out.backward(dout)
    expected.backward(dout)
    for name, t, td in zip(("query", "key", "value"), (q, k, v), dense):
        assert t.grad.shape == t.shape
        assert torch.equal(t.grad, td.grad), f"d{name} of strided inputs differs from contiguous inputs"


def _sdpa_error(exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match) as info:
        scaled_dot_product_attention(*args, **kwargs)
    msg = str(info.value)
    # torch's terms only: argument names query/key/value and BHSD, never the kernel's BSHD q/k/v
    assert "BSHD" not in msg and "(batch, seqlen_q, nheads" not in msg, msg
    assert not re.search(r"\b[qkv]\b", msg), msg
    return msg


def test_sdpa_errors_are_in_torch_terms():
    q = _randn(1, 4, 8, 32)
    _sdpa_error(ValueError, r"headdim \(query.size\(-1\)\) must be positive and at most 256, got 0",
                _randn(1, 4, 8, 0), _randn(1, 4, 8, 0), _randn(1, 4, 8, 0))
    _sdpa_error(ValueError, r"at most 256, got 264", *(_randn(1, 1, 2, 264),) * 3)
    _sdpa_error(RuntimeError, r"query is on cpu but key is on meta", q, q.to("meta"), q.to("meta"))
    _sdpa_error(RuntimeError, r"query is on cpu but value is on meta", q, q, q.to("meta"))
    # a meta mask with real inputs has no values to compute with (it returned uninitialised memory)
    _sdpa_error(RuntimeError, r"attn_mask is on meta but query is on cpu", q, q, q,
                attn_mask=torch.ones(8, 8, dtype=torch.bool, device="meta"))
    # the flags are checked as torch checks them, under their own names (is_causal was named causal)
    _sdpa_error(TypeError, r"is_causal must be a bool, got str 'yes'", q, q, q, is_causal="yes")
    _sdpa_error(TypeError, r"enable_gqa must be a bool, got str 'no'", q, _randn(1, 2, 8, 32),
                _randn(1, 2, 8, 32), enable_gqa="no")
    _sdpa_error(TypeError, r"query has dtype torch.int32", *(q.int(),) * 3)
    _sdpa_error(TypeError, r"value has dtype torch.float64 but query has torch.float32", q, q,
                q.double())
    _sdpa_error(ValueError, r"scale must be finite", q, q, q, scale=float("nan"))
    # finite, but its float32 scaling of the scores is not: named as torch names it, not softmax_scale
    _sdpa_error(ValueError, r"scaled_dot_product_attention: scale must be finite with \|scale\| \* log2\(e\) < 3.4e38",
                q, q, q, scale=1e39)
    _sdpa_error(TypeError, r"scale must be a real number, got str", q, q, q, scale="0.5")
    _sdpa_error(ValueError, r"key/value shape \(1, 4, 8, 16\) does not match query \(1, 4, 8, 32\)",
                q, _randn(1, 4, 8, 16), _randn(1, 4, 8, 16))


# ---------------------------------------------------------------- causal hint under torch.compile


def _hint_module(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    return MultiheadFlashAttention(64, 2, device=device, dtype=dtype)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_causal_hint_is_checked_under_compile(backend):
    """The eager check that attn_mask is the causal mask was skipped when compiled: a wrong
    mask silently ran as causal. Now it is an in-graph assert (fullgraph: no graph break)."""
    torch._dynamo.reset()
    m = _hint_module()
    cm = torch.compile(m, fullgraph=True, backend=backend)
    x = _randn(2, 8, 64, seed=70)
    for good in (torch.nn.Transformer.generate_square_subsequent_mask(8),
                 torch.ones(8, 8, dtype=torch.bool).triu(1)):  # nn.MultiheadAttention: True = blocked
        torch.testing.assert_close(cm(x, x, x, attn_mask=good, is_causal=True)[0],
                                   m(x, attn_mask=good, is_causal=True)[0])
    not_causal_float = torch.zeros(8, 8)                              # attends everywhere
    not_causal_bool = torch.ones(8, 8, dtype=torch.bool).triu(0)      # blocks the diagonal too
    sdpa_convention = torch.ones(8, 8, dtype=torch.bool).tril()       # True = attend: SDPA's, not MHA's
    bad_values = torch.nn.Transformer.generate_square_subsequent_mask(8).masked_fill(
        torch.ones(8, 8, dtype=torch.bool).triu(1), -1e9)             # not -inf: a bias
    for bad in (not_causal_float, not_causal_bool, sdpa_convention, bad_values):
        with pytest.raises(NotImplementedError, match="causal mask"):
            m(x, attn_mask=bad, is_causal=True)
        with pytest.raises(RuntimeError, match="square causal mask"):
            cm(x, x, x, attn_mask=bad, is_causal=True)
    with pytest.raises(RuntimeError, match="square causal mask"):           # shape, at trace time
        cm(x, x, x, attn_mask=torch.zeros(7, 8), is_causal=True)


def test_causal_hint_compiles_once_for_every_length():
    """The causal hint under torch.compile(fullgraph=True) over six sequence lengths: two graphs (the
    first static, then automatic dynamic), not one per length (the check's message formatted the
    symbolic length, pinning it; the ninth length hit the recompile limit). The eager bits."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    m = _hint_module()
    counter = CompileCounterWithBackend("aot_eager")
    cm = torch.compile(lambda x, mask: m(x, attn_mask=mask, is_causal=True)[0], fullgraph=True, backend=counter)
    for length in (7, 11, 19, 23, 29, 31):
        x, mask = _randn(3, length, 64, seed=73), torch.ones(length, length, dtype=torch.bool).triu(1)
        assert torch.equal(cm(x, mask), m(x, attn_mask=mask, is_causal=True)[0])
    assert counter.frame_count <= 2, counter.frame_count


def test_causal_hint_cross_attention_message():
    """seqlen_q != seqlen_k with is_causal and a mask: the message says why (the hint is torch's
    square mask), not that a (5, 9) mask should have shape (5, 9)."""
    m = _hint_module()
    x, y = _randn(1, 5, 64, seed=71), _randn(1, 9, 64, seed=72)
    with pytest.raises(NotImplementedError, match="needs seqlen_q == seqlen_k .* got seqlen_q 5 and seqlen_k 9"):
        m(x, y, y, attn_mask=torch.ones(5, 9, dtype=torch.bool).triu(1), is_causal=True, need_weights=False)


@requires_cuda
def test_causal_hint_under_compile_cuda():
    """CUDA: the good mask compiles with no graph break and matches eager. (A wrong mask is a
    device-side assertion, which would leave this process's CUDA context unusable: not run.)"""
    torch._dynamo.reset()
    m = _hint_module("cuda", torch.bfloat16)
    cm = torch.compile(m, fullgraph=True)
    x = _randn(2, 64, 64, dtype=torch.bfloat16, device="cuda", seed=71)
    mask = torch.ones(64, 64, dtype=torch.bool, device="cuda").triu(1)  # True = not allowed to attend
    torch.testing.assert_close(cm(x, x, x, attn_mask=mask, is_causal=True)[0],
                               m(x, attn_mask=mask, is_causal=True)[0], rtol=2e-2, atol=2e-2)


def test_float64_rotary_module_is_float64_accurate():
    """A .double() module with rotary was float32-accurate (3e-7 off): its cos / sin tables and the
    rotation were float32 whatever the activations' dtype."""
    from flash_attn_ext.reference import attention_ref

    torch.manual_seed(3)
    B, L, H, d = 2, 24, 4, 16
    ours = MultiheadFlashAttention(H * d, H, rotary=True, causal=True).double()
    x = torch.randn(B, L, H * d, dtype=torch.float64)
    # Reference built apart from the module's rotary code: RoFormer eq. 34 as complex rotation.
    angles = torch.arange(L, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)

    def rotate(t):
        z = torch.complex(t[..., : d // 2], t[..., d // 2:]) * torch.exp(1j * angles)[:, None, :]
        return torch.cat([z.real, z.imag], dim=-1)

    with torch.no_grad():
        q, k, v = F.linear(x, ours.in_proj_weight, ours.in_proj_bias).view(B, L, 3 * H, d).split([H, H, H], dim=2)
        o = attention_ref(rotate(q), rotate(k), v, causal=True)[0]
        want = ours.out_proj(o.reshape(B, L, H * d))
        torch.testing.assert_close(ours(x)[0], want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("D,Ev", [(4, 4), (12, 12), (100, 100), (192, 128), (24, 16)])
@pytest.mark.parametrize("L,S", [(7, 7), (5, 9), (9, 5)])
@pytest.mark.parametrize("mode", ["none", "causal", "key_padding"])
def test_sdpa_head_dims_the_kernels_do_not_take(D, Ev, L, S, mode):
    """The drop-in takes any head dims up to 256, as torch's SDPA does: one that is not a multiple
    of 8, and a value head dim Ev other than the query's (multi-head latent attention), run
    zero-padded (interface.py: _kernel_layout); output and gradients match torch's SDPA in float64
    (top-left causal, a key padding mask), the default scale 1 / sqrt(D)."""
    kw = {"causal": {"is_causal": True},
          "key_padding": {"attn_mask": (torch.arange(S) < S - 2).view(1, 1, 1, S).expand(2, 1, L, S)}}.get(mode, {})
    q, k, v = (torch.randn(2, 4, n, d, dtype=torch.float64, requires_grad=True) for n, d in ((L, D), (S, D), (S, Ev)))
    ours = scaled_dot_product_attention(q, k, v, **kw)
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    dout = torch.randn_like(ref)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    for g, r in zip(torch.autograd.grad(ours, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


def test_sdpa_masked_forward_ad():
    """Forward mode through torch.autograd.forward_ad dual tensors also with a padding attn_mask
    (its varlen calls' jvp): the tangent of the float64 softmax formula (torch's own CPU SDPA has
    no forward AD)."""
    import torch.autograd.forward_ad as fwAD
    q, k, v = (torch.randn(2, 4, n, 16, dtype=torch.float64) for n in (5, 7, 7))
    mask = (torch.arange(7) < 5).view(1, 1, 1, 7).expand(2, 1, 5, 7)

    def formula(q, k, v):
        s = (q @ k.transpose(-1, -2) / 4.0).masked_fill(~mask, float("-inf"))
        return torch.softmax(s, -1) @ v

    with fwAD.dual_level():
        duals = [fwAD.make_dual(t, torch.randn_like(t)) for t in (q, k, v)]
        ours = fwAD.unpack_dual(scaled_dot_product_attention(*duals, attn_mask=mask)).tangent
        ref = fwAD.unpack_dual(formula(*duals)).tangent
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)


def test_autocast_leaves_float64_alone():
    """Autocast casts floating inputs other than float64 (as torch's autocast does): float64 runs
    in float64 under a bf16 CPU autocast region, in the SDPA drop-in (its output torch's dtype)
    and in MultiheadFlashAttention with float64 parameters (whose out_proj then gets float64)."""
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    mha = MultiheadFlashAttention(16, 2, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = scaled_dot_product_attention(q, q, q)
        assert out.dtype == F.scaled_dot_product_attention(q, q, q).dtype == torch.float64
        assert mha(x)[0].dtype == torch.float64
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q), rtol=0, atol=1e-12)


def test_sdpa_all_masked_forward_ad_tangent_is_zero():
    """A mask that hides every key (no kernel runs): out 0 with a zero tangent for dual inputs (it
    was None), and zero gradients."""
    import torch.autograd.forward_ad as fwAD
    q, k, v = (torch.randn(2, 4, n, 8, dtype=torch.float64) for n in (3, 4, 4))
    mask = torch.zeros(2, 1, 3, 4, dtype=torch.bool)
    with fwAD.dual_level():
        out = scaled_dot_product_attention(fwAD.make_dual(q, torch.randn_like(q)), k, v, attn_mask=mask)
        tangent = fwAD.unpack_dual(out).tangent
    assert tangent is not None and torch.equal(tangent, torch.zeros_like(tangent))


def test_mha_mask_derivatives_are_refused():
    """MultiheadFlashAttention's key_padding_mask / attn_mask are constants: one that requires grad or
    carries a forward-mode tangent is refused (masked.refuse_mask_derivatives, shared with the SDPA
    drop-in), not given no derivative."""
    m = MultiheadFlashAttention(32, 4)
    x = _randn(2, 6, 32, seed=3)
    kpm = torch.zeros(2, 6)
    kpm[0, 4:] = float("-inf")
    with pytest.raises(NotImplementedError, match="key_padding_mask requires grad"):
        m(x, x, x, key_padding_mask=kpm.clone().requires_grad_())
    with pytest.raises(NotImplementedError, match="key_padding_mask carries a forward-mode tangent"):
        torch.func.jvp(lambda k: m(x, x, x, key_padding_mask=k)[0], (kpm,), (torch.randn_like(kpm),))
