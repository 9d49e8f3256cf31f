"""Autograd of the varlen (packed sequences) ops, the KV-cache op's Autograd kernel (no gradient)
and its vmap refusal (flash_attn_ext.ops holds their docs and fake kernels, registers the Autograd
kernels and re-exports every name)."""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (defines the ops)
from ._ops_autograd import (SinksGradFunction, _DOUBLE_BACKWARD_MSG, _FWD_OVER_REV_MSG, _fixed_alibi, _input_grads,
                            _needs_autograd, _no_dropout_jvp, _saved_alibi)
from ._ops_jvp import attention_jvp
from .reference import alibi_of_sequence


class FlashAttnVarlenFunction(torch.autograd.Function):
    """Autograd for ``flash_attn_ext::varlen_forward`` (reverse mode: ``varlen_backward``).
    ``apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
    causal[, window_size_left, window_size_right[, sinks[, softcap[, dropout_p, rng_state[,
    alibi_slopes]]]]]) -> (out, softmax_lse, softmax_stats)``."""

    @staticmethod
    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_size_left=-1, window_size_right=-1, sinks=None, softcap=0.0, dropout_p=0.0, rng_state=None,
                alibi_slopes=None):
        return torch.ops.flash_attn_ext.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                       max_seqlen_k, softmax_scale, causal, window_size_left,
                                                       window_size_right, sinks, softcap, dropout_p, rng_state,
                                                       alibi_slopes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal = inputs[:9]
        window = tuple(inputs[9:11]) + (-1, -1)[len(inputs[9:11]):]
        sinks = inputs[11] if len(inputs) > 11 else None
        ctx.softcap = inputs[12] if len(inputs) > 12 else 0.0
        ctx.dropout_p = inputs[13] if len(inputs) > 13 else 0.0
        rng_state = inputs[14] if len(inputs) > 14 else None
        alibi_slopes = inputs[15] if len(inputs) > 15 else None
        out, softmax_lse, softmax_stats = output
        ctx.has_sinks = sinks is not None
        ctx.has_rng_state = rng_state is not None
        ctx.has_alibi = alibi_slopes is not None
        _fixed_alibi(ctx.has_alibi and ctx.needs_input_grad[15])
        saved = ((q, k, v, out, softmax_lse, softmax_stats, cu_seqlens_q, cu_seqlens_k)
                 + ((sinks,) if ctx.has_sinks else ()) + ((alibi_slopes,) if ctx.has_alibi else ())
                 + ((rng_state,) if ctx.has_rng_state else ()))
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*saved)
        ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, causal)
        ctx.window = window
        ctx.num_inputs = len(inputs)
        ctx.mark_non_differentiable(softmax_lse, softmax_stats)

    @staticmethod
    def backward(ctx, dout, dlse, dstats):
        saved = ctx.saved_tensors  # once (FlashAttnFunction.backward: non-reentrant checkpointing)
        q, k, v, out, softmax_lse, softmax_stats, cu_seqlens_q, cu_seqlens_k = saved[:8]
        sinks = saved[8] if ctx.has_sinks else None
        max_seqlen_q, max_seqlen_k, softmax_scale, causal = ctx.args
        want_dsinks = ctx.has_sinks and ctx.needs_input_grad[11]
        dq, dk, dv = FlashAttnVarlenBackwardFunction.apply(
            dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, causal, softmax_stats, *ctx.window, sinks, ctx.softcap, ctx.dropout_p,
            saved[-1] if ctx.has_rng_state else None, _saved_alibi(ctx, saved, 8))
        dsinks = None
        if want_dsinks:
            # Rows outside every sequence (before cu_seqlens_q[0], from cu_seqlens_q[-1]) are not
            # written by the CUDA forward: masked on the device, without a host sync.
            rows = torch.arange(q.shape[0], device=q.device)
            valid = ((rows >= cu_seqlens_q[0]) & (rows < cu_seqlens_q[-1])).unsqueeze(-1)
            dsinks = SinksGradFunction.apply(dout, out, softmax_lse.transpose(0, 1), sinks, valid,
                                             softmax_stats.transpose(1, 2))
        return _input_grads(ctx.num_inputs, (dq, dk, dv), 11, dsinks)

    @staticmethod
    def jvp(ctx, q_t, k_t, v_t, *scalar_tangents):
        """Forward mode (torch.autograd.forward_ad dual tensors; torch.func refuses the varlen ops,
        _VARLEN_FUNCTORCH_MSG): ``attention_jvp`` on each sequence alone, its sequences read from
        cu_seqlens on the host (forward mode materialises each sequence's P anyway). Rows outside
        every sequence, and sequences without keys, get tangent 0 (their out is 0)."""
        _no_dropout_jvp(ctx.dropout_p)
        saved = ctx.saved_tensors  # once (FlashAttnFunction.backward)
        q, k, v = saved[:3]
        cu_seqlens_q, cu_seqlens_k = saved[6:8]
        sinks = saved[8] if ctx.has_sinks else None
        sinks_t = scalar_tangents[8] if ctx.has_sinks else None
        max_seqlen_q, max_seqlen_k, softmax_scale, causal = ctx.args
        alibi_slopes = _saved_alibi(ctx, saved, 8)
        alibi_t = scalar_tangents[12] if ctx.has_alibi else None
        out_t = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            q0, k0 = cq[b], ck[b]
            q1, k1 = min(cq[b + 1], q0 + max_seqlen_q), min(ck[b + 1], k0 + max_seqlen_k)  # as the kernels cut
            if q1 > q0 and k1 > k0:
                def seq(t, a, e):
                    return None if t is None else t[a:e].unsqueeze(0)
                out_t[q0:q1] = attention_jvp(seq(q, q0, q1), seq(k, k0, k1), seq(v, k0, k1), seq(q_t, q0, q1),
                                             seq(k_t, k0, k1), seq(v_t, k0, k1), softmax_scale, causal, *ctx.window,
                                             sinks, sinks_t, ctx.softcap,
                                             alibi_of_sequence(alibi_slopes, b), alibi_of_sequence(alibi_t, b))[0]
        return out_t, None, None


class FlashAttnVarlenBackwardFunction(torch.autograd.Function):
    """``flash_attn_ext::varlen_backward``, refusing to be differentiated (as FlashAttnBackwardFunction)."""

    @staticmethod
    def forward(*args):
        return torch.ops.flash_attn_ext.varlen_backward(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_DOUBLE_BACKWARD_MSG)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(_FWD_OVER_REV_MSG)


_KVCACHE_GRAD_MSG = (
    "flash_attn_ext: flash_attn_with_kvcache (torch.ops.flash_attn_ext.fwd_kvcache) is an inference "
    "op without a gradient; run it under torch.no_grad() / torch.inference_mode(), or use "
    "flash_attn_func / flash_attn_varlen_func for training")


def _fwd_kvcache_autograd(*args):
    if _needs_autograd(args):
        raise RuntimeError(_KVCACHE_GRAD_MSG)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.flash_attn_ext.fwd_kvcache.default(*args)


@torch.library.register_vmap("flash_attn_ext::fwd_kvcache")
def _fwd_kvcache_vmap(info, in_dims, *args):
    """No batching rule: the op appends k / v into the caches in place (a vmapped cache would be
    per-sample views of one buffer) and already has a batch dimension; refused with the way out,
    not the dispatcher's fallback error."""
    raise NotImplementedError(
        "flash_attn_ext: torch.vmap over flash_attn_with_kvcache (torch.ops.flash_attn_ext.fwd_kvcache) is not "
        "supported: the op has no batching rule (with k / v it writes them into the caches in place, which a "
        "vmapped cache cannot hold). Put the vmapped samples into the batch dimension of q, k_cache / v_cache "
        "(and cache_seqlens, block_table) and call it once")
