"""torch.library registrations for the C++ ops ``torch.ops.flash_attn_ext.{forward, backward,
varlen_forward, varlen_backward, fwd_kvcache}``.

The schemas and the CPU/CUDA kernels are registered in C++ (csrc/flash_api.cpp); this module
adds what lives in Python:
  * fake (meta) kernels for every op, so torch.compile(fullgraph=True) and FakeTensor tracing
    see output shapes without running anything, after the op's own input checks (their twins in
    flash_attn_ext._fake_checks: meta tensors and tracing refuse what a real call refuses);
  * autograd for both ops (an ``Autograd`` dispatch kernel each, calling a
    ``torch.autograd.Function`` with ``setup_context``, so the ``torch.func`` transforms work):
      - ``forward``: reverse mode calls ``torch.ops.flash_attn_ext.backward`` (FlashAttention-2,
        Dao 2023, Alg. 2: recomputation from the saved softmax statistics); forward mode (jvp,
        ``torch.func.jvp`` / ``jacfwd``, ``torch.autograd.forward_ad``) is computed exactly with
        plain torch ops from the inputs (see ``attention_jvp``); ``softmax_lse`` and
        ``softmax_stats`` are outputs without gradient (a gradient flowing into them is ignored,
        their tangent is None);
      - ``backward``: not differentiable; differentiating it (double backward, or forward mode
        over reverse mode such as ``torch.func.hessian``) raises a clear error instead of a
        silently wrong result;
  * vmap (batching) rules for both ops (``torch.library.register_vmap``): the vmapped dimension
    is folded into the batch dimension, one kernel call for the whole vmapped batch, so
    ``torch.vmap`` and per-sample gradients ``torch.vmap(torch.func.grad(...))`` need no
    per-sample fallback loop.

Op contract (docs/DESIGN.md); every op also takes ``window_size_left=-1, window_size_right=-1``
(a sliding window, flash-attn's ``window_size``; see ``reference.visible_mask``), then
``sinks=None`` (attention sinks, (nheads,) float32; the forward ops add them in the kernels'
epilogue; ``backward_dsinks`` is the dense backward op with sinks required that also returns the
sinks' gradient, from its own workspace; ``sinks_grad`` is the same formula in torch ops, for the
paths it does not serve: vmap, double-backward recording, varlen), ``softcap=0.0``
(logit soft-capping, Gemma 2 / flash-attn's softcap: the logit of score S = q.k is
softcap * tanh(S * softmax_scale / softcap); 0.0: none; a backward op takes its forward's) and,
last, ``dropout_p=0.0, rng_state=None`` (attention dropout, FlashAttention Alg. 2 / 4: P's elements
kept with probability 1 - p and scaled by 1 / (1 - p), the mask a function of rng_state, (seed,
offset) int64 (2,) on q's device, which a backward op takes from its forward; fwd_kvcache has none)
and, last, ``alibi_slopes=None`` (ALiBi, Press et al. 2022: float32 (nheads,) or (batch, nheads)
slopes, the logit of query i, key j minus slope * |i + seqlen_k - seqlen_q - j|; a backward op takes
its forward's; fwd_kvcache takes it after softcap; slopes that require grad: NotImplementedError,
forward mode carries their tangent):
  forward(q, k, v, softmax_scale, causal) -> (out, softmax_lse, softmax_stats)
      q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim), BSHD with a
      contiguous last dim; out: q's shape, contiguous; softmax_lse: (batch, nheads, seqlen_q)
      float32, natural log, +inf for a query row that sees no key; softmax_stats: (2, batch,
      nheads, seqlen_q) float32, [0] the row max of softmax_scale*log2(e)*S, [1] log2 of the row
      sum of exp2(scaled - max) (lets the backward recompute P exactly at large magnitudes).
  backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal, softmax_stats=None)
      -> (dq, dk, dv), contiguous, shaped like q, k, v. With softmax_stats the backward uses it
      instead of softmax_lse.
  varlen_forward / varlen_backward: the same on packed sequences (see their __doc__); autograd
      and fake kernels here, no vmap rule.
  fwd_kvcache: inference forward over a KV cache (see its __doc__); fake kernel here; it has no
      gradient (an input that requires grad raises) and no vmap rule (torch.vmap raises, naming the
      batch dimension to use instead).
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (defines the ops)
from . import _fake_checks as _checks
from .reference import alibi_bias, alibi_of_sequence, visible_mask

forward = torch.ops.flash_attn_ext.forward
backward = torch.ops.flash_attn_ext.backward

forward.__doc__ = forward.default.__doc__ = """\
forward(q, k, v, softmax_scale: float, causal: bool, window_size_left: int = -1,
        window_size_right: int = -1, sinks=None, softcap: float = 0.0, dropout_p: float = 0.0,
        rng_state=None, alibi_slopes=None) -> (out, softmax_lse, softmax_stats)

Exact attention softmax(softmax_scale * Q K^T) V (FlashAttention-2, Dao 2023, Algorithm 1; on
sm_90 GPUs FlashAttention-3's Hopper kernel). q: (batch, seqlen_q, nheads, headdim); k, v:
(batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0; last dim contiguous; headdim a
multiple of 8, <= 256; CUDA: float16 / bfloat16, CPU: also float32 / float64. causal: bottom-right
aligned (query i sees key j <= i + seqlen_k - seqlen_q). window_size_left / window_size_right: a
sliding window (local attention; -1: no bound), query i sees key j only if i + off - left <= j <= i +
off + right with off = seqlen_k - seqlen_q; causal sets the right bound to 0 (flash-attn's
semantics). sinks: None or (nheads,) float32, attention sinks (one logit per query head of a key
every row sees, value zero; flash_attn_func's docstring). softcap: logit soft-capping (Gemma 2;
flash-attn's softcap), 0.0 = none, else a finite cap > 0 (held as float32): the logit of score S =
q.k is softcap * tanh(S * softmax_scale / softcap) instead of S * softmax_scale, and softmax_lse /
softmax_stats are those of the capped logits. dropout_p in [0, 1), with rng_state (seed, offset) int64
(2,) on q's device when > 0: out = (Z o P) V / (1 - p), Z from Philox4x32-10 keyed by rng_state
(csrc/primitives/philox.cuh; reference.dropout_keep_mask materialises it), the statistics those of P
(ValueError for a bad dropout_p or rng_state; NotImplementedError with softcap or a window's left
bound; CUDA: the kDropout twins of the kernels the call would run without it). alibi_slopes: None
or float32 (nheads,) / (batch, nheads) on q's device, ALiBi (Press et al. 2022; flash-attn's): the
logit of query i, key j gains -slope * |i + seqlen_k - seqlen_q - j| (reference.alibi_bias), the
statistics those of the biased logits (NotImplementedError with softcap, dropout or a window's left
bound; ValueError with softmax_scale 0; no gradient for the slopes). Returns out (q's shape and dtype),
softmax_lse (batch, nheads, seqlen_q) float32, natural log (+inf for a row that sees no key, whose
out row is 0; with sinks the sink is in the sum and such a row's LSE is the sink), and
softmax_stats (2, batch, nheads, seqlen_q) float32: the same LSE in log2 units
as (row max * softmax_scale * log2 e rounded to float32, i.e. the max of the scaled log2 scores;
log2 of the row sum), which keeps the backward exact at any input magnitude. Raises RuntimeError naming the argument for bad shapes, dtypes, devices or
strides, or a softcap that is negative, not finite or outside float32's range, before any launch.
Autograd, forward-mode AD, vmap and fake (meta) kernels are registered (flash_attn_ext.ops)."""
backward.__doc__ = backward.default.__doc__ = """\
backward(dout, q, k, v, out, softmax_lse, softmax_scale: float, causal: bool, softmax_stats=None,
         window_size_left: int = -1, window_size_right: int = -1, sinks=None, softcap: float = 0.0,
         dropout_p: float = 0.0, rng_state=None, alibi_slopes=None) -> (dq, dk, dv)

Gradients of forward by recomputation (FlashAttention-2, Dao 2023, Algorithm 2: a preprocess, then
separate dK/dV and dQ kernels; no atomics, bitwise deterministic). dout: out's shape; the other
tensors as forward's inputs and outputs, and every other argument the forward's own (softmax_scale,
causal, the window, sinks, softcap, dropout, alibi_slopes: the backward recomputes that attention;
other values give another attention's gradients, unchecked on CUDA); softmax_stats: forward's third
output (autograd passes it), without which P is recomputed from softmax_lse (exact up to |LSE| ~
700). On CPU, float32 and float64 inputs recompute the statistics in float64 from q and k when softmax_stats is given (so it
must be this forward's own, sinks, softcap and alibi_slopes included: a RuntimeError when they do not match the recompute;
pass softmax_lse alone for statistics merged over chunks of K/V). sinks: the forward's (the CUDA kernels need them not: out and softmax_lse hold the sink; the
CPU float32 / float64 recompute adds them; backward_dsinks, the same op with sinks required, also
returns their gradient). softcap: the forward's (dS = P (dP - D) (1 - t^2), t = tanh(S *
softmax_scale / softcap), then softmax_scale as usual). dropout_p, rng_state: the forward's (its mask
regenerated: dV = (Z o P)^T dO / (1 - p), dS = P o (Z o dP / (1 - p) - D)). alibi_slopes: the
forward's (P recomputed from the biased logits; dS unchanged). Returns dq, dk, dv
with q's, k's and v's shapes and dtypes. Raises RuntimeError naming the argument on bad input."""


# Kernels registered from Python (Autograd); kept alive for the life of the process.
_lib = torch.library.Library("flash_attn_ext", "FRAGMENT")


# ---- fake kernels ------------------------------------------------------------------------

# Each fake kernel runs the checks of its C++ op first (flash_attn_ext._fake_checks: one twin per
# check function of csrc/flash_api.cpp), so meta tensors and tracing refuse what a real call refuses.

@torch.library.register_fake("flash_attn_ext::forward")
def _forward_fake(q, k, v, softmax_scale, causal, window_size_left=-1, window_size_right=-1, sinks=None,
                  softcap=0.0, dropout_p=0.0, rng_state=None, alibi_slopes=None):
    _checks.check_sinks_device(sinks, q)
    _checks.check_qkv(q, k, v, softmax_scale)
    _checks.check_softcap(softcap, softmax_scale)
    _checks.check_window(window_size_left, window_size_right, causal, q.shape[1], k.shape[1])
    _checks.check_dropout(dropout_p, rng_state, q, window_size_left, causal, q.shape[1], k.shape[1], softcap)
    _checks.check_alibi(alibi_slopes, q, q.shape[0], q.shape[2], softmax_scale, softcap, dropout_p, window_size_left,
                        k.shape[1])
    _checks.check_sinks(sinks, q.shape[2])
    batch, seqlen_q, nheads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    softmax_lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    softmax_stats = torch.empty((2, batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    return out, softmax_lse, softmax_stats


@torch.library.register_fake("flash_attn_ext::backward")
def _backward_fake(dout, q, k, v, out, softmax_lse, softmax_scale, causal, softmax_stats=None,
                   window_size_left=-1, window_size_right=-1, sinks=None, softcap=0.0, dropout_p=0.0, rng_state=None,
                   alibi_slopes=None):
    _checks.check_sinks_device(sinks, q)
    _checks.check_dense_bwd(dout, q, k, v, out, softmax_lse, softmax_scale, softmax_stats)
    _checks.check_softcap(softcap, softmax_scale)
    _checks.check_sinks(sinks, q.shape[2])
    _checks.check_window(window_size_left, window_size_right, causal, q.shape[1], k.shape[1])
    _checks.check_dropout(dropout_p, rng_state, q, window_size_left, causal, q.shape[1], k.shape[1], softcap)
    _checks.check_alibi(alibi_slopes, q, q.shape[0], q.shape[2], softmax_scale, softcap, dropout_p, window_size_left,
                        k.shape[1])
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return dq, dk, dv


# ---- forward-mode AD ---------------------------------------------------------------------

def attention_jvp(q, k, v, q_t, k_t, v_t, softmax_scale: float, causal: bool, window_size_left: int = -1,
                  window_size_right: int = -1, sinks=None, sinks_t=None, softcap: float = 0.0,
                  alibi_slopes=None, alibi_t=None) -> torch.Tensor:
    """Tangent of ``out`` (forward-mode derivative) of ``out = softmax(c Q K^T) V``.

    With S = c Q K^T (masked entries -inf: causal, sliding window), P = softmax(S) row-wise, O = P V:
        dS = c (dQ K^T + Q dK^T),  dP = P * (dS - rowsum(P * dS)),  dO = dP V + P dV.
    With logit soft-capping (``softcap`` > 0) the logits are softcap * t, t = tanh(c Q K^T / softcap),
    and dS gains the factor (1 - t^2). ALiBi (``alibi_slopes``, reference.alibi_bias) adds a bias linear
    in the slopes to the logits: P changes, and the slopes' tangent ``alibi_t`` (their shape, or None)
    adds alibi_bias(alibi_t) to the logits' tangent.
    With attention sinks (``sinks`` (nheads,), tangent ``sinks_t`` or None) the softmax runs over
    one more column per row, the head's sink with value 0 and tangent sinks_t[h]; its P column
    enters rowsum(P * dS) only.
    Computed with plain torch ops, materialising P of shape (batch, nheads, seqlen_q,
    seqlen_k) in float32 (float64 for float64 inputs): memory O(seqlen_q * seqlen_k), exact up
    to that dtype's rounding. Query rows that see no key have P = 0, so their tangent is 0.

    Args: q, k, v as the forward op (BSHD, GQA allowed); q_t, k_t, v_t: their tangents (same
    shapes) or None (zero). Returns the tangent of out: q's shape and dtype. Autocast is
    disabled inside (the float32 products stay float32).
    """
    if q_t is None and k_t is None and v_t is None and sinks_t is None and alibi_t is None:
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if q.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(q.device.type):
        with torch.autocast(q.device.type, enabled=False):  # keep the float32 matmuls float32
            return attention_jvp(q, k, v, q_t, k_t, v_t, softmax_scale, causal, window_size_left,
                                 window_size_right, sinks, sinks_t, softcap, alibi_slopes, alibi_t)
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    G = H // Hk
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32

    # Grouped heads, (batch, nheads_k, group, seqlen, headdim): query head h = hk * G + g reads
    # key/value head hk, with no copy of K/V per group (plain matmuls: every vmap supports them).
    def qlayout(t):
        return t.to(cdt).reshape(B, Sq, Hk, G, D).permute(0, 2, 3, 1, 4)

    def kvlayout(t):
        return t.to(cdt).permute(0, 2, 1, 3).unsqueeze(2)

    qh, kh, vh = qlayout(q), kvlayout(k), kvlayout(v)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * softmax_scale          # (B, Hk, G, Sq, Sk)
    dcap = None  # d(logit) / d(c q.k) under soft-capping: 1 - t^2
    if softcap > 0:
        softcap = _checks.float32(softcap)  # the cap the kernels use (flash_api.cpp: set_fwd_params)
        t = torch.tanh(s / softcap)
        s, dcap = softcap * t, 1 - t * t
    if alibi_slopes is not None:  # (batch or 1, nheads, Sq, Sk) -> the grouped layout
        bias = alibi_bias(alibi_slopes.to(q.device), B, H, Sq, Sk, cdt)
        s = s + bias.reshape(bias.shape[0], Hk, G, Sq, Sk)
    visible = visible_mask(Sq, Sk, causal, window_size_left, window_size_right, q.device)
    has_key = visible.any(dim=-1, keepdim=True)  # by the mask alone (False for every row if Sk == 0)
    s = s.masked_fill(~visible, float("-inf"))
    p_sink = None
    if sinks is not None:
        # The sink column (B, Hk, G, Sq, 1): every row sees it, so no row is without a key.
        sink_col = sinks.to(cdt).reshape(1, Hk, G, 1, 1).expand(*s.shape[:-1], 1)
        p_ext = torch.softmax(torch.cat([s, sink_col], dim=-1), dim=-1)
        # A -inf sink is no sink: a row without keys then has P = 0 (softmax of all -inf is NaN).
        p_ext = torch.where(~has_key & (sink_col == float("-inf")), 0.0, p_ext)
        # A +inf sink takes the whole row (P 0 on the keys, 1 on the sink; softmax gives inf - inf
        # = NaN), as the forward and sinks_grad have it.
        all_sink = torch.cat([torch.zeros_like(s), torch.ones_like(sink_col)], dim=-1)
        p_ext = torch.where(sink_col == float("inf"), all_sink, p_ext)
        p, p_sink = p_ext[..., :Sk], p_ext[..., Sk:]
    else:
        # Rows that see no key: softmax of all -inf is NaN; by the op's convention P = 0 there.
        # (torch.where, not nan_to_num: a NaN coming from the inputs must stay NaN.)
        p = torch.where(has_key, torch.softmax(s, dim=-1), 0.0)
    out_t = None
    ds = None
    if q_t is not None:
        ds = torch.matmul(qlayout(q_t), kh.transpose(-1, -2))
    if k_t is not None:
        term = torch.matmul(qh, kvlayout(k_t).transpose(-1, -2))
        ds = term if ds is None else ds + term
    sink_term = None  # rowsum's sink column: P_sink * sinks_t
    if sinks_t is not None and p_sink is not None:
        sink_term = p_sink * sinks_t.to(cdt).reshape(1, Hk, G, 1, 1)
    dlogit = None  # the logits' tangent
    if ds is not None:
        dlogit = (ds * dcap if dcap is not None else ds) * softmax_scale
    if alibi_t is not None:
        bias_t = alibi_bias(alibi_t.to(q.device), B, H, Sq, Sk, cdt)
        bias_t = bias_t.reshape(bias_t.shape[0], Hk, G, Sq, Sk)
        dlogit = bias_t if dlogit is None else dlogit + bias_t
    if dlogit is not None or sink_term is not None:
        pds = p * dlogit if dlogit is not None else torch.zeros_like(p)
        rowsum = pds.sum(dim=-1, keepdim=True)
        if sink_term is not None:
            rowsum = rowsum + sink_term
        dp = pds - p * rowsum
        out_t = torch.matmul(dp, vh)
    if v_t is not None:
        term = torch.matmul(p, kvlayout(v_t))
        out_t = term if out_t is None else out_t + term
    out_t = out_t.permute(0, 3, 1, 2, 4)                                 # (B, Sq, Hk, G, D)
    return out_t.reshape(B, Sq, H, D).to(q.dtype)


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
    level = getattr(torch.autograd.forward_ad, "_current_level", -1)
    if level >= 0 and torch._C._is_fwd_grad_enabled():
        return any(torch.autograd.forward_ad.unpack_dual(t, level=level).tangent is not None
                   for t in tensors)
    return False


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


# The ops' Autograd dispatch kernels (what torch.library.register_autograd would install, but
# with forward-mode AD: a dual tensor need not require grad, and its tangent must not be
# dropped). They serve the raw ops and torch.compile; eager code under torch.func transforms
# enters through attention_forward, above the dispatcher.
_lib.impl("forward", _autograd_kernel("forward", FlashAttnFunction), "Autograd")
_lib.impl("backward", _autograd_kernel("backward", FlashAttnBackwardFunction), "Autograd")


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


# ---- varlen (packed sequences) and KV cache ----------------------------------------------

varlen_forward = torch.ops.flash_attn_ext.varlen_forward
varlen_backward = torch.ops.flash_attn_ext.varlen_backward
fwd_kvcache = torch.ops.flash_attn_ext.fwd_kvcache

varlen_forward.__doc__ = varlen_forward.default.__doc__ = """\
varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
               softmax_scale: float, causal: bool, window_size_left: int = -1,
               window_size_right: int = -1, sinks=None, softcap: float = 0.0, dropout_p: float = 0.0,
               rng_state=None, alibi_slopes=None) -> (out, softmax_lse, softmax_stats)

forward on packed variable-length sequences (FlashAttention-2, Dao 2023, Alg. 1, one sequence per
(batch) entry of the grid). q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim);
cu_seqlens_q / cu_seqlens_k: int32 (batch + 1,) on q's device, sequence b = rows [cu[b], cu[b+1]).
max_seqlen_q / max_seqlen_k: >= every sequence's length (sizes the grid and, on sm90 at d128 /
d256 causal, picks the tile row; on CUDA not checked, a longer sequence is cut to its first max_seqlen
rows / keys). Returns out (q's shape), softmax_lse (nheads,
total_q) float32 natural log, softmax_stats (2, nheads, total_q) float32. Each sequence gives what
forward gives on it alone (causal and the window bottom-right per sequence; a sequence without
keys: out 0, lse +inf, or the sink with sinks (forward's); softcap, dropout_p / rng_state (sequence
b's mask that of batch b) and alibi_slopes ((batch, nheads): row b for sequence b) as forward's).
Rows outside every sequence:
unspecified on CUDA, 0 / +inf on CPU. Raises RuntimeError
naming the argument for bad shapes, dtypes, devices; on CPU also for cu_seqlens that decrease,
leave the tensors or exceed max_seqlen (on CUDA those values are not read on the host: no sync)."""
varlen_backward.__doc__ = varlen_backward.default.__doc__ = """\
varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, softmax_scale, causal, softmax_stats=None, window_size_left=-1,
                window_size_right=-1, sinks=None, softcap=0.0, dropout_p=0.0, rng_state=None,
                alibi_slopes=None) -> (dq, dk, dv)

Gradients of varlen_forward (FlashAttention-2 Alg. 2 per sequence; deterministic, no atomics;
softcap, dropout_p / rng_state and alibi_slopes: the forward's).
Shapes as varlen_forward's inputs and outputs; returns dq, dk, dv like q, k, v."""
fwd_kvcache.__doc__ = fwd_kvcache.default.__doc__ = """\
fwd_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale: float,
            causal: bool, num_splits: int, window_size_left: int = -1, window_size_right: int = -1,
            sinks=None, cache_leftpad=None, softcap: float = 0.0, alibi_slopes=None) -> (out, softmax_lse)

Attention of q against a KV cache, with an optional in-place append of new keys/values, split over
num_splits CTAs per (sequence, kv head) (FlashDecoding: partial outputs merged by their LSEs;
0 = chosen from the shapes and SM count, no device sync). q: (batch, seqlen_q, nheads, headdim);
k_cache / v_cache: (batch, seqlen_cache, nheads_k, headdim), or paged (num_blocks, page_size,
nheads_k, headdim) with block_table int32 (batch, max_blocks); cache_seqlens: int32 (batch,) or
None (all rows); k / v: None or (batch, seqlen_new, nheads_k, headdim), written into the cache at
rows cache_seqlens[b] + i (mutates k_cache / v_cache). Sequence b attends to its first
cache_seqlens[b] + seqlen_new cache rows (causal and the window: bottom-right aligned against that
count; a window reads only the key tiles it covers); cache_leftpad: None or int32 (batch,), a
contiguous cache's sequence b sees only rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new), as a
sequence of that many keys (flash-attn's left-padded caches; the append is unchanged); sinks as
forward's (the combine merges the sink as one more partial with O = 0); softcap as forward's
(logit soft-capping, 0.0: none); alibi_slopes as forward's (query i of sequence b against its
n_b keys: -slope * |i + n_b - seqlen_q - j|). Returns out (q's shape)
and softmax_lse (batch, nheads, seqlen_q) float32 natural log. Not differentiable."""


@torch.library.register_fake("flash_attn_ext::varlen_forward")
def _varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                         causal, window_size_left=-1, window_size_right=-1, sinks=None, softcap=0.0, dropout_p=0.0,
                         rng_state=None, alibi_slopes=None):
    _checks.check_sinks_device(sinks, q)
    _checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
    _checks.check_softcap(softcap, softmax_scale)
    _checks.check_window(window_size_left, window_size_right, causal, max_seqlen_q, max_seqlen_k)
    _checks.check_dropout(dropout_p, rng_state, q, window_size_left, causal, max_seqlen_q, max_seqlen_k, softcap)
    _checks.check_alibi(alibi_slopes, q, cu_seqlens_q.shape[0] - 1, q.shape[1], softmax_scale, softcap, dropout_p,
                        window_size_left, max_seqlen_k)
    _checks.check_sinks(sinks, q.shape[1])
    total_q, nheads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    softmax_lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    softmax_stats = torch.empty((2, nheads, total_q), dtype=torch.float32, device=q.device)
    return out, softmax_lse, softmax_stats


@torch.library.register_fake("flash_attn_ext::varlen_backward")
def _varlen_backward_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, softmax_scale, causal, softmax_stats=None, window_size_left=-1,
                          window_size_right=-1, sinks=None, softcap=0.0, dropout_p=0.0, rng_state=None,
                          alibi_slopes=None):
    _checks.check_sinks_device(sinks, q)
    _checks.check_varlen_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, softmax_scale, softmax_stats)
    _checks.check_softcap(softcap, softmax_scale)
    _checks.check_sinks(sinks, q.shape[1])
    _checks.check_window(window_size_left, window_size_right, causal, max_seqlen_q, max_seqlen_k)
    _checks.check_dropout(dropout_p, rng_state, q, window_size_left, causal, max_seqlen_q, max_seqlen_k, softcap)
    _checks.check_alibi(alibi_slopes, q, cu_seqlens_q.shape[0] - 1, q.shape[1], softmax_scale, softcap, dropout_p,
                        window_size_left, max_seqlen_k)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


@torch.library.register_fake("flash_attn_ext::fwd_kvcache")
def _fwd_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
                      num_splits, window_size_left=-1, window_size_right=-1, sinks=None, cache_leftpad=None,
                      softcap=0.0, alibi_slopes=None):
    """check_kvcache's shape / dtype / device / stride checks (not the values, which a real CUDA
    call does not read either), then the output shapes."""
    _checks.check_sinks_device(sinks, q)
    _checks.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, num_splits,
                          cache_leftpad)
    _checks.check_softcap(softcap, softmax_scale)
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    _checks.check_window(window_size_left, window_size_right, causal, q.shape[1], capacity)
    _checks.check_alibi(alibi_slopes, q, q.shape[0], q.shape[2], softmax_scale, softcap, 0.0, window_size_left,
                        capacity)
    _checks.check_sinks(sinks, q.shape[2])
    batch, seqlen_q, nheads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    softmax_lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    return out, softmax_lse


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


_lib.impl("varlen_forward", _autograd_kernel("varlen_forward", FlashAttnVarlenFunction), "Autograd")
_lib.impl("varlen_backward", _autograd_kernel("varlen_backward", FlashAttnVarlenBackwardFunction), "Autograd")
_lib.impl("fwd_kvcache", _fwd_kvcache_autograd, "Autograd")


# ---- backward with the sinks' gradient ---------------------------------------------------

backward_dsinks = torch.ops.flash_attn_ext.backward_dsinks
backward_dsinks.__doc__ = backward_dsinks.default.__doc__ = """\
backward_dsinks(dout, q, k, v, out, softmax_lse, softmax_scale, causal, softmax_stats, window_size_left,
                window_size_right, sinks, softcap=0.0, dropout_p=0.0, rng_state=None, alibi_slopes=None)
                -> (dq, dk, dv, dsinks)

backward with attention sinks (required, (nheads,) float32), also returning their gradient dsinks
((nheads,) float32): -sum_{b,i} exp(sinks[h] - LSE_i) D_i (FlashAttention-2 Alg. 2's D =
rowsum(dout o out); sinks_grad's formula), on CUDA from the backward's own workspace (its D and
LSE planes: no extra pass over dout / out). Not differentiable; no vmap rule (sinks_grad serves
vmap)."""
@torch.library.register_fake("flash_attn_ext::backward_dsinks")
def _backward_dsinks_fake(dout, q, k, v, out, softmax_lse, softmax_scale, causal, softmax_stats,
                          window_size_left, window_size_right, sinks, softcap=0.0, dropout_p=0.0, rng_state=None,
                          alibi_slopes=None):
    if sinks is None:
        raise RuntimeError("flash_attn_ext: backward_dsinks needs sinks (the forward's (nheads,) float32); "
                           "without sinks call backward")
    dq, dk, dv = _backward_fake(dout, q, k, v, out, softmax_lse, softmax_scale, causal, softmax_stats,
                                window_size_left, window_size_right, sinks, softcap, dropout_p, rng_state, alibi_slopes)
    return dq, dk, dv, torch.empty((sinks.numel(),), dtype=torch.float32, device=sinks.device)


def _not_differentiable(name):
    op = getattr(torch.ops.flash_attn_ext, name).default

    def kernel(*args):
        if _needs_autograd(args):
            raise RuntimeError(_DOUBLE_BACKWARD_MSG)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    return kernel


_lib.impl("backward_dsinks", _not_differentiable("backward_dsinks"), "Autograd")
