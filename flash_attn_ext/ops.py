"""torch.library registrations for the C++ ops ``torch.ops.flash_attn_ext.{forward, backward,
varlen_forward, varlen_backward, fwd_kvcache, backward_dsinks}``.

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
from .reference import alibi_bias, alibi_of_sequence, visible_mask  # noqa: F401

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

# Forward-mode AD, autograd, the vmap rules and the varlen / KV-cache autograd live in modules of
# their own (_ops_jvp, _ops_autograd, _ops_vmap, _ops_varlen), imported below where their code
# stood, so that every registration keeps its order; each name is re-exported (flash_attn_ext.ops.X
# as before). The fake kernels stay here: the C++ library names this module as theirs
# (m.set_python_module), and torch.library.register_fake refuses one registered from another.


# ---- fake kernels ------------------------------------------------------------------------

# Each fake kernel runs the checks of its C++ op first (flash_attn_ext._fake_checks: one twin per
# check function of csrc/flash_api.cpp), so meta tensors and tracing refuse what a real call refuses.

@torch.library.register_fake("flash_attn_ext::forward")
def _forward_fake(q, k, v, softmax_scale, causal, window_size_left=-1, window_size_right=-1, sinks=None,
                  softcap=0.0, dropout_p=0.0, rng_state=None, alibi_slopes=None):
    _checks.check_forward(q, k, v, softmax_scale, causal, window_size_left, window_size_right, sinks, softcap,
                          dropout_p, rng_state, alibi_slopes)
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


from ._ops_jvp import attention_jvp  # noqa: E402,F401
from ._ops_autograd import (FlashAttnBackwardFunction, FlashAttnFunction, SinksGradFunction,  # noqa: E402,F401
                            _ALIBI_GRAD_MSG, _DOUBLE_BACKWARD_MSG, _FWD_OVER_REV_MSG, _RAW_OP_FUNCTORCH_MSG,
                            _VARLEN_FUNCTORCH_MSG, _autograd_kernel, _fixed_alibi, _fused_dsinks, _input_grads,
                            _needs_autograd, _no_dropout_jvp, _saved_alibi, attention_forward, sinks_grad)

# The ops' Autograd dispatch kernels (what torch.library.register_autograd would install, but
# with forward-mode AD: a dual tensor need not require grad, and its tangent must not be
# dropped). They serve the raw ops and torch.compile; eager code under torch.func transforms
# enters through attention_forward, above the dispatcher.
_lib.impl("forward", _autograd_kernel("forward", FlashAttnFunction), "Autograd")
_lib.impl("backward", _autograd_kernel("backward", FlashAttnBackwardFunction), "Autograd")

from ._ops_vmap import (_BSHD, _backward_vmap, _check_sample_rank4, _fold, _fold_alibi,  # noqa: E402,F401
                        _forward_vmap, _sinks_not_vmapped, _unfold, _vmap_by_sample)


# ---- varlen (packed sequences) and KV cache ----------------------------------------------

varlen_forward = torch.ops.flash_attn_ext.varlen_forward
varlen_backward = torch.ops.flash_attn_ext.varlen_backward
fwd_kvcache = torch.ops.flash_attn_ext.fwd_kvcache

varlen_forward.__doc__ = varlen_forward.default.__doc__ = """\
varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: SymInt, max_seqlen_k: SymInt,
               softmax_scale: float, causal: bool, window_size_left: int = -1,
               window_size_right: int = -1, sinks=None, softcap: float = 0.0, dropout_p: float = 0.0,
               rng_state=None, alibi_slopes=None) -> (out, softmax_lse, softmax_stats)

forward on packed variable-length sequences (FlashAttention-2, Dao 2023, Alg. 1, one sequence per
(batch) entry of the grid). q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim);
cu_seqlens_q / cu_seqlens_k: int32 (batch + 1,) on q's device, sequence b = rows [cu[b], cu[b+1]).
max_seqlen_q / max_seqlen_k: >= every sequence's length (sizes the grid and, on sm90 at d128 /
d256 causal, picks the tile row; on CUDA not checked, a longer sequence is cut to its first max_seqlen
rows / keys; SymInt: symbolic under torch.compile, no graph per value). Returns out (q's shape), softmax_lse (nheads,
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
    _checks.check_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                 causal, window_size_left, window_size_right, sinks, softcap, dropout_p, rng_state,
                                 alibi_slopes)
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
                             max_seqlen_k, softmax_scale, softmax_stats, sinks)
    _checks.check_softcap(softcap, softmax_scale)
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
    capacity = _checks.cache_capacity(k_cache, block_table)
    _checks.check_window(window_size_left, window_size_right, causal, q.shape[1], capacity)
    _checks.check_alibi(alibi_slopes, q, q.shape[0], q.shape[2], softmax_scale, softcap, 0.0, window_size_left,
                        capacity)
    _checks.check_sinks(sinks, q.shape[2])
    batch, seqlen_q, nheads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    softmax_lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    return out, softmax_lse


from ._ops_varlen import (FlashAttnVarlenBackwardFunction, FlashAttnVarlenFunction,  # noqa: E402,F401
                          _KVCACHE_GRAD_MSG, _fwd_kvcache_autograd, _fwd_kvcache_vmap)

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
