"""flash_attn_ext.bert_padding (flash-attn's padding helpers): the packed rows, indices and
cu_seqlens against masks built by hand, the round trip through flash_attn_varlen_func against the
padded dense call, gradients, flash-attn's concatenated-sequences form, and the refusals."""

import pytest
import torch

import flash_attn_ext
from flash_attn_ext.bert_padding import (index_first_axis, index_put_first_axis, pad_input, unpad_input,
                                         unpad_input_for_concatenated_sequences)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and flash_attn_ext.build_info()["with_cuda"] else [])


def _masks(device):
    """Right padding, left padding, padding in the middle, a full row and an empty row."""
    return torch.tensor([[1, 1, 1, 0, 0, 0],
                         [0, 0, 1, 1, 1, 1],
                         [1, 0, 1, 1, 0, 1],
                         [1, 1, 1, 1, 1, 1],
                         [0, 0, 0, 0, 0, 0]], dtype=torch.bool, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.int64, torch.uint8])
def test_unpad_input_packs_the_kept_rows_in_order(device, mask_dtype):
    mask = _masks(device)
    x = torch.randn(5, 6, 3, 4, device=device)
    packed, indices, cu_seqlens, max_seqlen, used = unpad_input(x, mask.to(mask_dtype))
    rows = [(b, s) for b in range(5) for s in range(6) if mask[b, s]]
    assert indices.dtype == torch.int64 and indices.tolist() == [b * 6 + s for b, s in rows]
    assert torch.equal(packed, torch.stack([x[b, s] for b, s in rows]))
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 7, 11, 17, 17]
    assert isinstance(max_seqlen, int) and max_seqlen == 6
    assert used.dtype == torch.int32 and used.tolist() == [3, 4, 4, 6, 0]
    back = pad_input(packed, indices, 5, 6)
    assert torch.equal(back, torch.where(mask[..., None, None], x, 0))


@pytest.mark.parametrize("device", DEVICES)
def test_unpad_input_unused_rows_are_packed_and_counted(device):
    """flash-attn >= 2.7's unused_mask: those rows are packed and in cu_seqlens, not in
    used_seqlens_in_batch."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], device=device)
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]], device=device)
    x = torch.randn(2, 4, 8, device=device)
    packed, indices, cu_seqlens, max_seqlen, used = unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6] and cu_seqlens.tolist() == [0, 3, 6]
    assert max_seqlen == 3 and used.tolist() == [2, 1] and torch.equal(packed, x.flatten(0, 1)[indices])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_unpad_varlen_pad_equals_each_sequence_alone(device, causal):
    """The porting recipe: unpad q, k, v by the mask, flash_attn_varlen_func, pad back: each
    sequence's kept tokens attend among themselves, bit for bit flash_attn_func on that sequence
    alone; padded rows out 0; gradients flow to the kept rows only."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    mask = _masks(device)
    batch, seqlen, nheads, d = 5, 6, 2, 32
    q, k, v = (torch.randn(batch, seqlen, nheads, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    q_u, indices, cu, max_s, _ = unpad_input(q, mask)
    k_u, v_u = unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    out_u = flash_attn_ext.flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_s, max_s, causal=causal)
    out = pad_input(out_u, indices, batch, seqlen)
    assert out.shape == q.shape and torch.equal(out[~mask], torch.zeros_like(out[~mask]))
    for b in range(batch):
        keep = mask[b].nonzero().flatten()
        if keep.numel():
            alone = flash_attn_ext.flash_attn_func(q[b:b + 1, keep], k[b:b + 1, keep], v[b:b + 1, keep],
                                                   causal=causal)
            assert torch.equal(out[b, keep], alone[0])  # (README: bit for bit on the same arch path)
    out.float().square().sum().backward()
    for t in (q, k, v):
        assert torch.equal(t.grad[~mask], torch.zeros_like(t.grad[~mask])) and t.grad[mask].abs().sum() > 0


def test_index_helpers_are_inverse_and_differentiable():
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([5, 0, 3])
    picked = index_first_axis(x, idx)
    assert torch.equal(picked, x.detach()[idx])
    assert torch.equal(index_put_first_axis(picked, idx, 7)[idx], picked)
    picked.sum().backward()
    assert x.grad[:, 0].tolist() == [1, 0, 0, 1, 0, 1, 0]
    vals = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: index_put_first_axis(t, idx, 7), (vals,))
    with pytest.raises(ValueError, match="values has 3 rows but indices 2 entries"):
        index_put_first_axis(vals, idx[:2], 7)


def test_concatenated_sequences_as_flash_attn_documents():
    """flash-attn's docstring example: rows [2, 3], [3, 2] and [6] of seqlen 6."""
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = torch.randn(3, 6, 4)
    packed, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert cu_seqlens.tolist() == [0, 2, 5, 8, 10, 16] and max_seqlen == 6
    assert torch.equal(packed, x.flatten(0, 1)[indices])
    with pytest.raises(ValueError, match="sum past seqlen = 6"):
        unpad_input_for_concatenated_sequences(x, torch.tensor([[4, 3, 0, 0, 0, 0]] * 3))
    with pytest.raises(ValueError, match="expected an integer dtype"):
        unpad_input_for_concatenated_sequences(x, lengths > 0)


def test_empty_batch_and_all_padding():
    x = torch.randn(0, 4, 2)
    packed, indices, cu, max_s, used = unpad_input(x, torch.zeros(0, 4, dtype=torch.bool))
    assert packed.shape == (0, 2) and cu.tolist() == [0] and max_s == 0 and used.numel() == 0
    x = torch.randn(2, 4, 2)
    packed, indices, cu, max_s, used = unpad_input(x, torch.zeros(2, 4, dtype=torch.bool))
    assert packed.shape == (0, 2) and cu.tolist() == [0, 0, 0] and max_s == 0
    assert torch.equal(pad_input(packed, indices, 2, 4), torch.zeros(2, 4, 2))


def test_refusals_name_the_argument():
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match=r"attention_mask is shape \[2, 5\] but hidden_states has shape \[2, 4, 8\]"):
        unpad_input(x, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask has dtype torch.float32; expected bool or an integer"):
        unpad_input(x, torch.ones(2, 4))
    with pytest.raises(ValueError, match="hold 1 values other than 0 / 1"):
        unpad_input(x, torch.tensor([[1, 2, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="or are both 1 at a position"):
        unpad_input(x, torch.ones(2, 4, dtype=torch.int32), torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="unused_mask is a list"):
        unpad_input(x, torch.ones(2, 4, dtype=torch.int32), [[0] * 4] * 2)
    with pytest.raises(ValueError, match="attention_mask is on meta but hidden_states on cpu"):
        unpad_input(x, torch.ones(2, 4, dtype=torch.bool, device="meta"))
