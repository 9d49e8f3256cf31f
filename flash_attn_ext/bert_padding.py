"""flash-attn's padding helpers (``flash_attn.bert_padding``, flash-attn >= 2.7), for code ported from
it: ``from flash_attn.bert_padding import unpad_input, pad_input`` becomes ``from
flash_attn_ext.bert_padding import unpad_input, pad_input``. They turn a right- or left-padded
batch ``(batch, seqlen, ...)`` and its ``(batch, seqlen)`` mask into the packed rows and
``cu_seqlens`` that ``flash_attn_varlen_func`` takes, and its output back (the unpadding of
MLCommons' BERT, which flash-attn's module adapts). Plain torch indexing: differentiable, on any
device; the padded rows' gradient is 0.

    x_unpad, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, attention_mask)   # (total, ...)
    out_unpad = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens,
                                       max_seqlen, max_seqlen, causal=True)
    out = pad_input(out_unpad, indices, batch, seqlen)                             # (batch, seqlen, ...)

``unpad_input`` reads the lengths on the host (a device sync, as flash-attn's: ``max_seqlen`` is a
Python int). flash-attn < 2.7 returned 4 values (no ``used_seqlens_in_batch``); this module
follows >= 2.7. flash-attn's ``index_first_axis_residual`` (for its fused MLP) is not provided.
"""

from __future__ import annotations

import torch

from .masked import cu_seqlens

__all__ = ["index_first_axis", "index_put_first_axis", "unpad_input", "pad_input",
           "unpad_input_for_concatenated_sequences"]


def _check_mask(mask: torch.Tensor, name: str, hidden_states: torch.Tensor) -> None:
    """A (batch, seqlen) bool or integer mask on hidden_states' device whose sizes are
    hidden_states' first two: else ValueError naming it."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or hidden_states.dim() < 2 \
            or tuple(mask.shape) != tuple(hidden_states.shape[:2]):
        got = (f"shape {list(mask.shape)}" if isinstance(mask, torch.Tensor) else f"a {type(mask).__name__}")
        raise ValueError(f"flash_attn_ext: {name} is {got} but hidden_states has shape "
                         f"{list(hidden_states.shape)}; expected a (batch, seqlen) tensor with hidden_states' "
                         "(batch, seqlen, ...) first two sizes")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise ValueError(f"flash_attn_ext: {name} has dtype {mask.dtype}; expected bool or an integer dtype")
    if mask.device != hidden_states.device:
        raise ValueError(f"flash_attn_ext: {name} is on {mask.device} but hidden_states on {hidden_states.device}; "
                         "expected the same device")


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``input[indices]``: the rows ``indices`` (1-D, int64 or int32) of ``input`` (first_axis_dim,
    ...), shape ``(len(indices), ...)``. Differentiable in ``input`` (rows not picked get gradient
    0)."""
    return input[indices]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A new ``(first_axis_dim, ...)`` tensor of ``values``' dtype and device, zeros but for row
    ``indices[i]`` = ``values[i]`` (``values``: ``(len(indices), ...)``; indices distinct). The
    inverse of index_first_axis; differentiable in ``values``."""
    if values.shape[0] != indices.shape[0]:
        raise ValueError(f"flash_attn_ext: values has {values.shape[0]} rows but indices {indices.shape[0]} "
                         "entries; expected one index per row")
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """The rows of a padded batch that its mask keeps, packed in order (sequence 0's first).

    Args:
        hidden_states: ``(batch, seqlen, ...)``, any dtype.
        attention_mask: ``(batch, seqlen)`` bool or integer, 1 (True) = a real token, 0 = padding;
            padding on either side or anywhere (each sequence is its kept tokens, in order).
        unused_mask: optional, the same shape: 1 = a row allocated to the sequence but not used
            (flash-attn >= 2.7: such rows are packed too and counted in ``cu_seqlens``, for
            FlashAttention-3's ``seqused_*``, which flash_attn_ext does not take).
    Returns:
        ``(hidden_states_unpad, indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch)``:
        ``(total, ...)`` rows; ``indices`` ``(total,)`` int64, each row's index into the flattened
        ``(batch * seqlen)`` input; ``cu_seqlens`` ``(batch + 1,)`` int32 from 0; the longest
        sequence as a Python int (a device sync); ``used_seqlens_in_batch`` ``(batch,)`` int32,
        the rows ``attention_mask`` keeps per sequence.
    Raises:
        ValueError: a mask not ``(batch, seqlen)`` = hidden_states' first sizes, of a floating
            dtype or on another device; a mask value other than 0 / 1 (the values are read with
            the lengths, in the same sync); ``attention_mask`` and ``unused_mask`` both 1 at a
            position.
    """
    _check_mask(attention_mask, "attention_mask", hidden_states)
    if unused_mask is not None:
        _check_mask(unused_mask, "unused_mask", hidden_states)
    used = attention_mask.to(torch.int64)
    unused = unused_mask.to(torch.int64) if unused_mask is not None else None
    rows = used if unused is None else used + unused
    seqlens = rows.sum(dim=-1, dtype=torch.int32)
    # One host read for the longest sequence and the masks' validity (0 / 1 each, their sum too).
    bad = (used < 0) | (used > 1) | (rows > 1)
    if unused is not None:
        bad |= (unused < 0) | (unused > 1)
    max_seqlen, n_bad = torch.stack([seqlens.max() if seqlens.numel() else seqlens.new_zeros(()),
                                     bad.sum(dtype=torch.int32)]).tolist()
    if n_bad:
        raise ValueError("flash_attn_ext: attention_mask" + (" / unused_mask" if unused_mask is not None else "")
                         + f" hold {n_bad} values other than 0 / 1" + (" or are both 1 at a position"
                                                                       if unused_mask is not None else "")
                         + "; expected 1 for a kept row and 0 for padding")
    indices = torch.nonzero(rows.flatten()).flatten()
    packed = index_first_axis(hidden_states.flatten(0, 1), indices)
    return packed, indices, cu_seqlens(seqlens), max_seqlen, used.sum(dim=-1, dtype=torch.int32)


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """flash-attn's form for rows that each hold several short sequences back to back:
    ``attention_mask_in_length`` ``(batch, seqlen)`` integer, row b's nonzero entries the lengths of
    its sequences in order (``[2, 3, 0, 0, 0, 0]``: tokens 0-1 one sequence, 2-4 the next, 5 padding),
    their sum at most seqlen. Every sequence becomes one of ``cu_seqlens``' (so attention stays
    inside it). Returns ``(hidden_states_unpad, indices, cu_seqlens, max_seqlen_in_batch)`` as
    unpad_input (4 values, as flash-attn's). ValueError: a shape, dtype or device as unpad_input's,
    a negative length, or a row's lengths summing past seqlen."""
    _check_mask(attention_mask_in_length, "attention_mask_in_length", hidden_states)
    if attention_mask_in_length.dtype == torch.bool:
        raise ValueError("flash_attn_ext: attention_mask_in_length has dtype torch.bool; expected an integer dtype "
                         "(the lengths of each row's sequences)")
    lengths = attention_mask_in_length.to(torch.int64)
    seqlen = lengths.shape[1]
    totals = lengths.sum(dim=-1)
    flat = lengths.flatten()
    seqlens = flat[flat != 0].to(torch.int32)
    bad_row = (totals > seqlen).sum() + (lengths < 0).sum()
    max_seqlen, n_bad = torch.stack([seqlens.max().to(torch.int64) if seqlens.numel() else totals.new_zeros(()),
                                     bad_row]).tolist()
    if n_bad:
        raise ValueError(f"flash_attn_ext: attention_mask_in_length holds a negative length or a row whose lengths "
                         f"sum past seqlen = {seqlen}; expected each row's sequence lengths, then zeros")
    keep = torch.arange(seqlen, device=lengths.device) < totals[:, None]
    indices = torch.nonzero(keep.flatten()).flatten()
    return index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens(seqlens), max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of unpad_input: ``hidden_states`` ``(total, ...)`` put back at ``indices`` (as
    unpad_input returned them) of a zero ``(batch, seqlen, ...)`` tensor. Differentiable.
    ValueError: a row count other than len(indices)."""
    return index_put_first_axis(hidden_states, indices, batch * seqlen).unflatten(0, (batch, seqlen))
