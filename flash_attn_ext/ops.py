"""torch.library registrations for the C++ ops ``torch.ops.flash_attn_ext.{forward,backward}``.

The schemas and the CPU/CUDA kernels are registered in C++ (csrc/flash_api.cpp); this module
adds what lives in Python:
  * fake (meta) kernels for both ops, so torch.compile(fullgraph=True) and FakeTensor tracing
    see output shapes without running anything;
  * autograd for ``forward``: the backward calls ``torch.ops.flash_attn_ext.backward``
    (FlashAttention-2, Dao 2023, Alg. 2: recomputation from the saved LSE). ``softmax_lse`` is
    an output without gradient: a gradient flowing into it is ignored.

Op contract (docs/DESIGN.md):
  forward(q, k, v, softmax_scale, causal) -> (out, softmax_lse)
      q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim), BSHD with a
      contiguous last dim; out: q's shape, contiguous; softmax_lse: (batch, nheads, seqlen_q)
      float32, natural log, +inf for a query row that sees no key.
  backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal) -> (dq, dk, dv)
      contiguous, shaped like q, k, v.
"""

import torch

from . import _C  # noqa: F401  (defines the ops)

forward = torch.ops.flash_attn_ext.forward
backward = torch.ops.flash_attn_ext.backward


@torch.library.register_fake("flash_attn_ext::forward")
def _forward_fake(q, k, v, softmax_scale, causal):
    batch, seqlen_q, nheads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    softmax_lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    return out, softmax_lse


@torch.library.register_fake("flash_attn_ext::backward")
def _backward_fake(dout, q, k, v, out, softmax_lse, softmax_scale, causal):
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return dq, dk, dv


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal = inputs
    out, softmax_lse = output
    ctx.save_for_backward(q, k, v, out, softmax_lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.mark_non_differentiable(softmax_lse)


def _backward(ctx, dout, dlse):
    # dlse is ignored: softmax_lse is marked non-differentiable.
    q, k, v, out, softmax_lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.flash_attn_ext.backward(
        dout, q, k, v, out, softmax_lse, ctx.softmax_scale, ctx.causal
    )
    return dq, dk, dv, None, None


torch.library.register_autograd("flash_attn_ext::forward", _backward, setup_context=_setup_context)
