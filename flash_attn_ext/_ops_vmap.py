"""vmap (batching) rules of the dense ops ``forward`` and ``backward`` and their helpers
(flash_attn_ext.ops imports them, in registration order, and re-exports every name)."""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (defines the ops)


# ---- vmap (batching rules) ---------------------------------------------------------------

_BSHD = {"q": "(batch, seqlen_q, nheads, headdim)", "k": "(batch, seqlen_k, nheads_k, headdim)",
         "v": "(batch, seqlen_k, nheads_k, headdim)", "dout": "(batch, seqlen_q, nheads, headdim)",
         "out": "(batch, seqlen_q, nheads, headdim)"}


def _check_sample_rank4(in_dims, **tensors):
    """The op's rank check on one sample's shape: under torch.vmap the op sees the vmapped dim
    folded into its batch dim, so its own message would name a shape the caller never made."""
    for (name, t), d in zip(tensors.items(), in_dims):
        shape = list(t.shape) if d is None else list(t.shape[:d]) + list(t.shape[d + 1:])
        if len(shape) != 4:
            raise RuntimeError(f"flash_attn_ext: {name} must be 4-D {_BSHD[name]} (BSHD), got {len(shape)}-D of "
                               f"shape {shape} (one sample under torch.vmap)")


def _fold(t, bdim, batch_size, at=0, contiguous_last=True):
    """Move the vmapped dim ``bdim`` of ``t`` (None: not vmapped, broadcast) to position ``at``
    and merge it with the dim after it (the op's batch dim)."""
    if bdim is None:
        t = t.unsqueeze(at).expand(*t.shape[:at], batch_size, *t.shape[at:])
    else:
        t = t.movedim(bdim, at)
    t = t.flatten(at, at + 1)
    if contiguous_last and t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.clone(memory_format=torch.contiguous_format)  # .contiguous() keeps an empty tensor's strides
    return t


def _sinks_not_vmapped(in_dims, index):
    """One sink per head serves every vmapped sample: a vmapped sinks tensor (per-sample sinks) has
    no kernel."""
    if len(in_dims) > index and in_dims[index] is not None:
        raise NotImplementedError("flash_attn_ext: vmap over sinks (a different sinks tensor per vmapped "
                                  "sample) is not supported; vmap over q / k / v with one sinks tensor")


def _vmap_by_sample(info, in_dims, op, args):
    """The op once per vmapped sample, outputs stacked on dim 0: the rule with dropout, where
    folding the samples into the batch would give sample i the mask of batch indices i * batch + b
    instead of the b an unvmapped call with the same rng_state (or the sample's own, under
    randomness="different") draws; so vmap(f)(x)[i] = f(x[i]), and torch.func.jacrev (a backward
    vmapped over cotangents) regenerates the forward's mask."""
    dims = tuple(in_dims) + (None,) * (len(args) - len(in_dims))
    outs = [op(*(a if d is None else a.select(d, i) for a, d in zip(args, dims))) for i in range(info.batch_size)]
    return tuple(torch.stack(o) for o in zip(*outs)), (0,) * len(outs[0])


def _fold_alibi(alibi_slopes, bdim, batch_size, batch):
    """alibi_slopes for the folded batch (batch_size * batch): (nheads,) ones serve every sample as
    they are; (batch, nheads) ones, or per-sample ones (vmapped), become (batch_size * batch, nheads)."""
    if alibi_slopes is None or (bdim is None and alibi_slopes.dim() == 1):
        return alibi_slopes
    if bdim is None:
        return _fold(alibi_slopes, None, batch_size)
    a = alibi_slopes.movedim(bdim, 0)
    return a.repeat_interleave(batch, 0) if a.dim() == 2 else a.flatten(0, 1)


def _unfold(t, batch_size, at=0):
    """Inverse of _fold for an output: split dim ``at`` into (batch_size, batch)."""
    return t.unflatten(at, (batch_size, t.shape[at] // batch_size))


@torch.library.register_vmap("flash_attn_ext::forward")
def _forward_vmap(info, in_dims, q, k, v, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                  sinks=None, softcap=0.0, dropout_p=0.0, rng_state=None, alibi_slopes=None):
    n = info.batch_size
    _sinks_not_vmapped(in_dims, 7)
    _check_sample_rank4(in_dims[:3], q=q, k=k, v=v)
    if dropout_p:
        return _vmap_by_sample(info, in_dims, torch.ops.flash_attn_ext.forward,
                               (q, k, v, softmax_scale, causal, window_size_left, window_size_right, sinks, softcap,
                                dropout_p, rng_state, alibi_slopes))
    batch = q.shape[0] if in_dims[0] is None or in_dims[0] > 0 else q.shape[1]
    alibi_slopes = _fold_alibi(alibi_slopes, in_dims[11] if len(in_dims) > 11 else None, n, batch)
    q, k, v = (_fold(t, d, n) for t, d in zip((q, k, v), in_dims[:3]))
    out, lse, stats = torch.ops.flash_attn_ext.forward(q, k, v, softmax_scale, causal, window_size_left,
                                                       window_size_right, sinks, softcap, dropout_p, rng_state,
                                                       alibi_slopes)
    return (_unfold(out, n), _unfold(lse, n), _unfold(stats, n, at=1)), (0, 0, 1)


@torch.library.register_vmap("flash_attn_ext::backward")
def _backward_vmap(info, in_dims, dout, q, k, v, out, softmax_lse, softmax_scale, causal,
                   softmax_stats=None, window_size_left=-1, window_size_right=-1, sinks=None, softcap=0.0,
                   dropout_p=0.0, rng_state=None, alibi_slopes=None):
    n = info.batch_size
    _sinks_not_vmapped(in_dims, 11)
    _check_sample_rank4(in_dims[:5], dout=dout, q=q, k=k, v=v, out=out)
    if dropout_p:
        return _vmap_by_sample(info, in_dims, torch.ops.flash_attn_ext.backward,
                               (dout, q, k, v, out, softmax_lse, softmax_scale, causal, softmax_stats,
                                window_size_left, window_size_right, sinks, softcap, dropout_p, rng_state,
                                alibi_slopes))
    batch = q.shape[0] if in_dims[1] is None or in_dims[1] > 0 else q.shape[1]
    alibi_slopes = _fold_alibi(alibi_slopes, in_dims[15] if len(in_dims) > 15 else None, n, batch)
    dout, q, k, v, out = (_fold(t, d, n) for t, d in zip((dout, q, k, v, out), in_dims[:5]))
    softmax_lse = _fold(softmax_lse, in_dims[5], n).contiguous()
    if softmax_stats is not None:
        softmax_stats = _fold(softmax_stats, in_dims[8] if len(in_dims) > 8 else None, n,
                              at=1).contiguous()
    dq, dk, dv = torch.ops.flash_attn_ext.backward(dout, q, k, v, out, softmax_lse, softmax_scale,
                                                   causal, softmax_stats, window_size_left, window_size_right, sinks,
                                                   softcap, dropout_p, rng_state, alibi_slopes)
    return (_unfold(dq, n), _unfold(dk, n), _unfold(dv, n)), (0, 0, 0)
