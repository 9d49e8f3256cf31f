"""Autograd of the dense ops: the autograd.Functions, the sinks' gradient, the Autograd dispatch
kernels' factory and ``attention_forward`` (flash_attn_ext.ops registers the kernels and re-exports
every name)."""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (defines the ops)
from ._ops_jvp import attention_jvp


# ---- autograd ----------------------------------------------------------------------------

_DOUBLE_BACKWARD_MSG = (
    "flash_attn_ext: double backward (differentiating the gradients, e.g. create_graph=True "
    "with a gradient penalty, or torch.func.grad of torch.func.grad) is not implemented; use "
    "torch.nn.functional.scaled_dot_product_attention's math backend for that part of the model")

_FWD_OVER_REV_MSG = (
    "flash_attn_ext: forward-mode AD through the backward pass (e.g. torch.func.hessian, "
    "torch.func.jacfwd(torch.func.jacrev(...)), or a jvp of gradients) is not implemented; "
    "forward-mode AD of the attention output itself (torch.func.jvp / jacfwd) is supported")

_RAW_OP_FUNCTORCH_MSG = (
    "flash_attn_ext: torch.func transforms (grad, vjp, jvp, jacrev, jacfwd) of the raw op "
    "torch.ops.flash_attn_ext.{} are not supported: an autograd kernel inside the dispatcher "
    "cannot reach torch.func's autograd.Function support. Call flash_attn_ext.flash_attn_func "
    "(or flash_attn_ext.ops.attention_forward) instead: they support every torch.func transform "
    "in eager mode. (Under torch.compile the call is traced as the raw op: compile the function "
    "without fullgraph=True, so the transform runs eagerly behind a graph break.)")


class FlashAttnFunction(torch.autograd.Function):
    """Autograd for ``flash_attn_ext::forward``: reverse mode (the FlashAttention-2 backward
    kernel), forward mode (``attention_jvp``) and torch.func (``setup_context`` plus a vmap rule
    generated from the ops' batching rules). Inputs/outputs as the op:
    ``apply(q, k, v, softmax_scale, causal[, window_size_left, window_size_right[, sinks[, softcap[,
    dropout_p, rng_state[, alibi_slopes]]]]]) -> (out, softmax_lse, softmax_stats)``. With sinks, their gradient is
    ``sinks_grad``'s; with dropout the backward regenerates the forward's mask from rng_state."""

    generate_vmap_rule = True  # vmaps forward/backward/jvp through the ops' batching rules

    @staticmethod
    def forward(q, k, v, softmax_scale, causal, window_size_left=-1, window_size_right=-1, sinks=None,
                softcap=0.0, dropout_p=0.0, rng_state=None, alibi_slopes=None):
        # Grad mode and forward grad mode are off here, so this reaches the kernel directly.
        return torch.ops.flash_attn_ext.forward(q, k, v, softmax_scale, causal, window_size_left,
                                                window_size_right, sinks, softcap, dropout_p, rng_state, alibi_slopes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, softmax_scale, causal = inputs[:5]
        ctx.window = tuple(inputs[5:7]) + (-1, -1)[len(inputs[5:7]):]  # (left, right)
        sinks = inputs[7] if len(inputs) > 7 else None
        ctx.softcap = inputs[8] if len(inputs) > 8 else 0.0
        ctx.dropout_p = inputs[9] if len(inputs) > 9 else 0.0
        rng_state = inputs[10] if len(inputs) > 10 else None
        alibi_slopes = inputs[11] if len(inputs) > 11 else None
        ctx.num_inputs = len(inputs)
        ctx.has_sinks = sinks is not None
        ctx.has_rng_state = rng_state is not None
        ctx.has_alibi = alibi_slopes is not None
        _fixed_alibi(ctx.has_alibi and ctx.needs_input_grad[11])
        out, softmax_lse, softmax_stats = output
        # The same tensors, in the same order, for both modes: the generated vmap rule keeps one
        # list of batch dims for the saved tensors (two different lists broke reverse over vmap).
        # rng_state last, saved so that an in-place change before the backward is an error (its
        # mask would be another one); alibi_slopes before it (_saved_alibi).
        saved = ((q, k, v, out, softmax_lse, softmax_stats) + ((sinks,) if ctx.has_sinks else ())
                 + ((alibi_slopes,) if ctx.has_alibi else ()) + ((rng_state,) if ctx.has_rng_state else ()))
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*saved)
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.mark_non_differentiable(softmax_lse, softmax_stats)

    @staticmethod
    def backward(ctx, dout, dlse, dstats):
        # dlse, dstats are ignored: softmax_lse and softmax_stats are non-differentiable.
        # saved_tensors read once: non-reentrant activation checkpointing unpacks each tensor once.
        saved = ctx.saved_tensors
        q, k, v, out, softmax_lse, softmax_stats = saved[:6]
        sinks = saved[6] if ctx.has_sinks else None
        dropout = (ctx.dropout_p, saved[-1] if ctx.has_rng_state else None)
        alibi_slopes = _saved_alibi(ctx, saved, 6)
        want_dsinks = ctx.has_sinks and ctx.needs_input_grad[7]
        if want_dsinks and _fused_dsinks():
            # The op fills dsinks from its own workspace (D and the LSE of the preprocess): no pass
            # over dout / out of its own.
            dq, dk, dv, dsinks = torch.ops.flash_attn_ext.backward_dsinks(
                dout, q, k, v, out, softmax_lse, ctx.softmax_scale, ctx.causal, softmax_stats, *ctx.window, sinks,
                ctx.softcap, *dropout, alibi_slopes)
        else:
            dq, dk, dv = FlashAttnBackwardFunction.apply(
                dout, q, k, v, out, softmax_lse, ctx.softmax_scale, ctx.causal, softmax_stats, *ctx.window, sinks,
                ctx.softcap, *dropout, alibi_slopes)
            dsinks = SinksGradFunction.apply(dout, out, softmax_lse.transpose(1, 2), sinks, None,
                                             softmax_stats.transpose(2, 3)) if want_dsinks else None
        return _input_grads(ctx.num_inputs, (dq, dk, dv), 7, dsinks)

    @staticmethod
    def jvp(ctx, q_t, k_t, v_t, *scalar_tangents):
        _no_dropout_jvp(ctx.dropout_p)
        saved = ctx.saved_tensors  # once (see backward)
        q, k, v = saved[:3]
        sinks = saved[6] if ctx.has_sinks else None
        sinks_t = scalar_tangents[4] if ctx.has_sinks else None
        out_t = attention_jvp(q, k, v, q_t, k_t, v_t, ctx.softmax_scale, ctx.causal, *ctx.window, sinks, sinks_t,
                              ctx.softcap, _saved_alibi(ctx, saved, 6), scalar_tangents[8] if ctx.has_alibi else None)
        return out_t, None, None


def _saved_alibi(ctx, saved, base):
    """The alibi_slopes a Function's setup_context saved (``saved``: its ctx.saved_tensors, read
    once): after its ``base`` tensors and the sinks, before rng_state (None if the call had none)."""
    return saved[base + ctx.has_sinks] if ctx.has_alibi else None


def _no_dropout_jvp(dropout_p):
    if dropout_p:
        raise NotImplementedError("flash_attn_ext: forward-mode AD (jvp, jacfwd, forward_ad dual tensors) with "
                                  "dropout_p > 0 is not supported; use reverse mode (backward), or dropout_p=0")


_ALIBI_GRAD_MSG = ("flash_attn_ext: alibi_slopes that require grad: the kernels give the slopes no gradient "
                   "(fixed slopes, as flash-attn's; forward mode does carry their tangent); pass "
                   "alibi_slopes.detach()")


def _fixed_alibi(needs_grad: bool) -> None:
    """Slopes that require grad are refused (the public entries before the call, the ops' Functions
    in setup_context): reverse mode would give them None. Forward mode carries their tangent
    (attention_jvp's alibi_t)."""
    if needs_grad:
        raise NotImplementedError(_ALIBI_GRAD_MSG)


def _input_grads(num_inputs, qkv_grads, sinks_index, dsinks):
    """An autograd.Function's backward return: a gradient per input (``num_inputs`` of them), those
    of q, k, v first, ``dsinks`` (or None) at the sinks' position, None for the others (scale,
    causal, window, max_seqlen, softcap, ...)."""
    grads = list(qkv_grads) + [None] * (num_inputs - 3)
    if sinks_index < num_inputs:
        grads[sinks_index] = dsinks
    return tuple(grads)


def _fused_dsinks() -> bool:
    """Whether the dense backward may take the sinks' gradient from ``backward_dsinks`` (its own
    workspace's D and LSE): not while recording a graph (double backward must reach
    FlashAttnBackwardFunction's refusal) and not under torch.func transforms (the ops have no vmap
    rule: one dsinks would sum over the vmapped samples); there ``sinks_grad`` computes it from dout
    and out instead."""
    return not torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()


def sinks_grad(dout, out, softmax_lse, sinks, rows_valid=None, softmax_stats=None):
    """Gradient of the attention sinks (FlashAttention-2's D = rowsum(dO * O), Alg. 2 line 4, with
    the sink as one more key of value 0): d sinks[h] = -sum over rows i of head h of
    exp(sinks[h] - LSE_i) D_i, LSE including the sink (``backward_dsinks`` computes the same from
    its workspace: _fused_dsinks; the varlen backward's sinks always take this path). dout / out:
    (..., nheads, headdim) with the rows in the leading dims; softmax_lse: out's leading shape plus
    nheads, i.e. (..., nheads); softmax_stats: None or the forward's statistics as (2, ...,
    nheads) (row max and log2 row sum, log2 units): the sink's probability from them,
    exp2(sinks log2(e) - max - log2sum), exact at any magnitude (from softmax_lse, a float32, it errs
    by ~|LSE| 2^-24 relative); rows_valid: None or a bool mask of out.shape[:-1] (varlen: rows
    outside every sequence, whose out the CUDA kernels leave unwritten, contribute nothing). Rows
    with D = 0 (out 0: no keys, or a +inf sink) contribute 0. A torch reduction: deterministic.
    Returns sinks' shape and dtype. Not differentiable here (SinksGradFunction refuses)."""
    # The accumulation type of flash_api.cpp's sinks_grad_cpu: float64 for float32 / float64 outputs.
    acc = torch.float64 if out.dtype in (torch.float32, torch.float64) else torch.float32
    D = (dout.to(acc) * out.to(acc)).sum(-1)                               # (..., nheads)
    s = sinks.to(acc)
    if softmax_stats is not None:
        p_sink = torch.exp2((s * 1.4426950408889634 - softmax_stats[0].to(acc)) - softmax_stats[1].to(acc))
    else:
        p_sink = torch.exp(s - softmax_lse.to(acc))
    term = torch.where(D == 0, 0.0, p_sink * D)  # not inf * 0 for a +inf sink
    if rows_valid is not None:
        term = torch.where(rows_valid, term, 0.0)
    return (-term.reshape(-1, sinks.shape[0]).sum(0)).to(sinks.dtype)


class SinksGradFunction(torch.autograd.Function):
    """``sinks_grad`` as an autograd.Function that refuses to be differentiated, as
    FlashAttnBackwardFunction: its formula treats the LSE as a constant, so its derivative would be
    wrong, not merely missing."""

    generate_vmap_rule = True

    @staticmethod
    def forward(dout, out, softmax_lse, sinks, rows_valid=None, softmax_stats=None):
        return sinks_grad(dout, out, softmax_lse, sinks, rows_valid, softmax_stats)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, ddsinks):
        raise RuntimeError(_DOUBLE_BACKWARD_MSG)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(_FWD_OVER_REV_MSG)


class FlashAttnBackwardFunction(torch.autograd.Function):
    """``flash_attn_ext::backward`` as an autograd.Function that runs the op and refuses to be
    differentiated (double backward: RuntimeError; forward mode: NotImplementedError)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(dout, q, k, v, out, softmax_lse, softmax_scale, causal, softmax_stats=None,
                window_size_left=-1, window_size_right=-1, sinks=None, softcap=0.0, dropout_p=0.0, rng_state=None,
                alibi_slopes=None):
        return torch.ops.flash_attn_ext.backward(dout, q, k, v, out, softmax_lse, softmax_scale,
                                                 causal, softmax_stats, window_size_left, window_size_right, sinks,
                                                 softcap, dropout_p, rng_state, alibi_slopes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, ddq, ddk, ddv):
        raise RuntimeError(_DOUBLE_BACKWARD_MSG)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(_FWD_OVER_REV_MSG)


def _needs_autograd(tensors) -> bool:
    """True if a call on ``tensors`` must record a graph (reverse mode) or carry tangents
    (forward mode) under the current grad modes."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return True
    def has_tangent(level):
        return torch._C._is_fwd_grad_enabled() and any(
            torch.autograd.forward_ad.unpack_dual(t, level=level).tangent is not None for t in tensors)

    level = getattr(torch.autograd.forward_ad, "_current_level", -1)
    if level < 0 and tensors and type(tensors[0]) is not torch.Tensor and not torch.compiler.is_dynamo_compiling() \
            and torch._guards.TracingContext.try_get() is not None:
        # torch.compile's tracing (AOTAutograd) runs the call with that Python-side level unset (-1)
        # while the tensors still carry their tangents at level 0, the one level PyTorch supports:
        # probe it (else a compiled forward-mode call silently lost its tangent; torch 2.11's
        # is_compiling() is False there, a tracing context is set in both; its tensors are fake or
        # functional, not plain: checked first, the cheap test of an eager call). Not in code
        # Dynamo traces (the paged varlen entry), where the level is the user's. Probed with the
        # tracer off: the probe's ops are no part of the graph (inductor's re-trace of an op's
        # functionalization counts the nodes).
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
        with disable_proxy_modes_tracing():
            return has_tangent(0)
    return level >= 0 and has_tangent(level)


_VARLEN_FUNCTORCH_MSG = (
    "flash_attn_ext: torch.func transforms (grad, vjp, jvp, jacrev, jacfwd) of flash_attn_varlen_func "
    "(torch.ops.flash_attn_ext.{}) are not supported: an autograd kernel inside the dispatcher cannot "
    "reach torch.func's autograd.Function support. Use plain autograd (loss.backward(), "
    "torch.autograd.grad) for packed sequences, or flash_attn_func on padded batches under torch.func.")


def _autograd_kernel(name, function):
    op = getattr(torch.ops.flash_attn_ext, name).default
    functorch_msg = _VARLEN_FUNCTORCH_MSG if name.startswith("varlen") else _RAW_OP_FUNCTORCH_MSG

    def kernel(*args):
        if _needs_autograd(args):
            if torch._C._are_functorch_transforms_active():
                raise NotImplementedError(functorch_msg.format(name))
            return function.apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    return kernel


def attention_forward(q, k, v, softmax_scale: float, causal: bool, window_size_left: int = -1,
                      window_size_right: int = -1, sinks=None, softcap: float = 0.0, dropout_p: float = 0.0,
                      rng_state=None, alibi_slopes=None):
    """``torch.ops.flash_attn_ext.forward`` with autograd that every transform understands:
    returns ``(out, softmax_lse, softmax_stats)`` exactly as the op (see the module docstring).

    Under torch.func transforms (grad, vjp, jvp, jacrev, jacfwd, vmap, functional_call) in
    eager mode it applies ``FlashAttnFunction`` directly (torch.func handles an
    autograd.Function only when it is applied outside the dispatcher); otherwise it calls the
    op, whose Autograd kernel applies the same Function (reverse and forward mode), and which
    torch.compile traces as one op.
    """
    if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
        return FlashAttnFunction.apply(q, k, v, softmax_scale, causal, window_size_left, window_size_right, sinks,
                                       softcap, dropout_p, rng_state, alibi_slopes)
    return torch.ops.flash_attn_ext.forward(q, k, v, softmax_scale, causal, window_size_left, window_size_right,
                                            sinks, softcap, dropout_p, rng_state, alibi_slopes)
