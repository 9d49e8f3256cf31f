"""flash-attn's rotary embedding function (``flash_attn.layers.rotary.apply_rotary_emb``), for code
ported from it: ``from flash_attn.layers.rotary import apply_rotary_emb`` becomes ``from
flash_attn_ext.rotary import apply_rotary_emb``. RoFormer (Su et al. 2021, eq. 34): channel pairs
of the first ``rotary_dim`` channels rotated by the angle of their position. Torch ops (not a
fused kernel), differentiable, on any device. flash-attn's ``RotaryEmbedding`` module and its
in-place qkv / kv variants are not provided (``flash_attn_ext.nn.rotary_cos_sin`` and
``apply_rotary`` are this library's own module-side pair).
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["apply_rotary_emb"]


def rotate_channels(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x`` with its first ``rotary_dim = 2 * cos.shape[-1]`` channels rotated: pairs ``(2c, 2c + 1)``
    when ``interleaved`` (GPT-J), else ``(c, c + rotary_dim / 2)`` (GPT-NeoX), by ``cos`` / ``sin``
    broadcast to ``x[..., :rotary_dim / 2]``; in float32 (float64 for float64 x), rounded to x's
    dtype; the other channels unchanged. (Shared with flash_attn_with_kvcache's rotary tables.)"""
    rotary_dim = 2 * cos.shape[-1]
    compute = torch.promote_types(x.dtype, torch.float32)
    cos, sin = cos.to(compute), sin.to(compute)
    xr = x[..., :rotary_dim].to(compute)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        y = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        y = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((y.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: int | torch.Tensor = 0,
                     cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
    """Rotary position embedding of ``x``, flash-attn's ``apply_rotary_emb`` (its argument order and
    defaults).

    Args:
        x: ``(batch, seqlen, nheads, headdim)``, or ``(total, nheads, headdim)`` packed sequences
            with ``cu_seqlens``; a floating dtype.
        cos, sin: ``(seqlen_ro, rotary_dim / 2)`` tables (``cos[p, c] = cos(p * theta_c)``), any
            floating dtype (used in float32; flash-attn asks for x's dtype); rotary_dim even, at most
            headdim.
        interleaved: rotate channel pairs ``(2c, 2c + 1)`` (GPT-J) instead of ``(c, c + rotary_dim /
            2)`` (GPT-NeoX / Llama, the default).
        inplace: write the result into ``x`` and return it (a torch in-place write: refused on a leaf
            that requires grad, which flash-attn's autograd Function overwrites; pass inplace=False
            there).
        seqlen_offsets: an int, or an int32 / int64 ``(batch,)`` tensor: token i of sequence b sits
            at position ``i + seqlen_offsets[b]`` (decoding with a KV cache).
        cu_seqlens: ``(batch + 1,)`` int32 / int64 packed-sequence offsets (as flash_attn_varlen_func's):
            positions restart at each sequence; rows past ``cu_seqlens[-1]`` are left unchanged.
        max_seqlen: the longest packed sequence, needed with cu_seqlens (as flash-attn's): an int
            offset plus max_seqlen must fit the tables (a sequence longer than max_seqlen is not
            checked: its positions past the tables are not rotated).
    Returns:
        ``x``'s shape and dtype; channels past rotary_dim unchanged. A position past the tables
        (reachable with tensor offsets) is not rotated (cos 1, sin 0), as flash-attn's kernel.
    Raises:
        ValueError: a shape, dtype or device not as above; cu_seqlens without max_seqlen; an int
            offset plus seqlen (or max_seqlen) past seqlen_ro.
    """
    varlen = cu_seqlens is not None
    if not isinstance(x, torch.Tensor) or x.dim() != (3 if varlen else 4) or not x.is_floating_point():
        got = f"shape {list(x.shape)}, dtype {x.dtype}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
        raise ValueError(f"flash_attn_ext: x is {got}; expected a floating "
                         + ("(total, nheads, headdim) tensor with cu_seqlens" if varlen
                            else "(batch, seqlen, nheads, headdim) tensor"))
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point() or t.device != x.device:
            got = (f"shape {list(t.shape)}, dtype {t.dtype} on {t.device}" if isinstance(t, torch.Tensor)
                   else f"a {type(t).__name__}")
            raise ValueError(f"flash_attn_ext: {name} is {got}; expected a floating (seqlen_ro, rotary_dim / 2) "
                             f"tensor on x's device {x.device}")
    if sin.shape != cos.shape:
        raise ValueError(f"flash_attn_ext: sin has shape {list(sin.shape)} but cos has {list(cos.shape)}; "
                         "expected equal")
    seqlen_ro, rotary_dim, headdim = cos.shape[0], 2 * cos.shape[1], x.shape[-1]
    if rotary_dim > headdim:
        raise ValueError(f"flash_attn_ext: cos has {cos.shape[1]} columns, rotary_dim {rotary_dim}; expected "
                         f"rotary_dim at most headdim = {headdim}")
    batch = cu_seqlens.shape[0] - 1 if varlen else x.shape[0]
    if varlen and (cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.device != x.device
                   or cu_seqlens.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"flash_attn_ext: cu_seqlens has shape {list(cu_seqlens.shape)}, dtype {cu_seqlens.dtype} "
                         f"on {cu_seqlens.device}; expected int32 or int64 (batch + 1,) on x's device")
    if varlen and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or max_seqlen < 0):
        raise ValueError(f"flash_attn_ext: max_seqlen = {max_seqlen!r}; expected a non-negative int with cu_seqlens "
                         "(the longest packed sequence, as flash-attn's)")
    if isinstance(seqlen_offsets, torch.Tensor):
        if tuple(seqlen_offsets.shape) != (batch,) or seqlen_offsets.dtype not in (torch.int32, torch.int64) \
                or seqlen_offsets.device != x.device:
            raise ValueError(f"flash_attn_ext: seqlen_offsets has shape {list(seqlen_offsets.shape)}, dtype "
                             f"{seqlen_offsets.dtype} on {seqlen_offsets.device}; expected an int, or int32 / int64 "
                             f"(batch,) = ({batch},) on x's device")
        offsets = seqlen_offsets.to(torch.int64)
    else:
        longest = int(max_seqlen) if varlen else x.shape[1]
        if isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, numbers.Integral) or seqlen_offsets < 0 \
                or seqlen_offsets + longest > seqlen_ro:
            raise ValueError(f"flash_attn_ext: seqlen_offsets = {seqlen_offsets!r} with "
                             f"{'max_seqlen' if varlen else 'seqlen'} = {longest}; expected a non-negative int with "
                             f"seqlen_offsets + {'max_seqlen' if varlen else 'seqlen'} at most the tables' "
                             f"seqlen_ro = {seqlen_ro}")
        offsets = torch.full((max(batch, 0),), int(seqlen_offsets), dtype=torch.int64, device=x.device)
    if varlen:
        token = torch.arange(x.shape[0], device=x.device)
        cu = cu_seqlens.to(torch.int64)
        seq = torch.searchsorted(cu[1:], token, right=True).clamp_(max=max(batch - 1, 0))
        inside = token < cu[-1]
        positions = token - cu[seq] + (offsets[seq] if batch > 0 else 0)     # (total,)
        positions = torch.where(inside, positions, seqlen_ro)               # past cu_seqlens: not rotated
        view = (slice(None), None, slice(None))                             # (total, 1, rotary_dim / 2)
    else:
        positions = torch.arange(x.shape[1], device=x.device)[None, :] + offsets[:, None]  # (batch, seqlen)
        view = (slice(None), slice(None), None, slice(None))                # (batch, seqlen, 1, rotary_dim / 2)
    if seqlen_ro == 0 or rotary_dim == 0:  # no position in the tables, or no channel rotated
        out = x.clone()
    else:
        in_table = ((positions >= 0) & (positions < seqlen_ro))[..., None]
        rows = positions.clamp(0, seqlen_ro - 1)
        out = rotate_channels(x, torch.where(in_table, cos[rows], 1)[view], torch.where(in_table, sin[rows], 0)[view],
                              interleaved)
    return x.copy_(out) if inplace else out
