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


_MAX_HEADDIM = 256


def _check_fake_inputs(q, k, v):
    """The shape/device/dtype checks of csrc/flash_api.cpp, for the fake (meta) kernels, so that
    tracing (torch.compile, FakeTensor) and meta tensors get the same errors as a real call instead
    of outputs of a shape that cannot exist. Raises RuntimeError naming the argument."""
    for name, t, layout in (("q", q, "(batch, seqlen_q, nheads, headdim)"),
                            ("k", k, "(batch, seqlen_k, nheads_k, headdim)"),
                            ("v", v, "(batch, seqlen_k, nheads_k, headdim)")):
        if t.dim() != 4:
            raise RuntimeError(f"flash_attn_ext: {name} must be 4-D {layout} (BSHD), got {t.dim()}-D "
                               f"of shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise RuntimeError(f"flash_attn_ext: {name} is on {t.device} but q is on {q.device}; "
                               "all tensors must be on one device")
        if t.dtype != q.dtype:
            raise RuntimeError(f"flash_attn_ext: {name} has dtype {t.dtype} but q has dtype {q.dtype}; "
                               "they must match")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise RuntimeError(f"flash_attn_ext: q has dtype {q.dtype}; supported: float16, bfloat16 "
                           "(CUDA and CPU), float32, float64 (CPU)")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise RuntimeError(f"flash_attn_ext: shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                           f"v {tuple(v.shape)}; expected q (batch, seqlen_q, nheads, headdim) and k, v "
                           "(batch, seqlen_k, nheads_k, headdim)")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise RuntimeError(f"flash_attn_ext: nheads (q.size(2) = {q.shape[2]}) must be a multiple of "
                           f"nheads_k (k.size(2) = {k.shape[2]})")
    headdim = q.shape[3]
    if headdim <= 0 or headdim % 8 != 0 or headdim > _MAX_HEADDIM:
        raise RuntimeError(f"flash_attn_ext: headdim must be a positive multiple of 8 and at most "
                           f"{_MAX_HEADDIM}, got {headdim}")


@torch.library.register_fake("flash_attn_ext::forward")
def _forward_fake(q, k, v, softmax_scale, causal):
    _check_fake_inputs(q, k, v)
    batch, seqlen_q, nheads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    softmax_lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    return out, softmax_lse


@torch.library.register_fake("flash_attn_ext::backward")
def _backward_fake(dout, q, k, v, out, softmax_lse, softmax_scale, causal):
    _check_fake_inputs(q, k, v)
    if dout.shape != q.shape or out.shape != q.shape:
        raise RuntimeError(f"flash_attn_ext: dout {tuple(dout.shape)} and out {tuple(out.shape)} must "
                           f"have q's shape {tuple(q.shape)}")
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


def _double_backward_setup(ctx, inputs, output):
    pass


def _double_backward(ctx, ddq, ddk, ddv):
    raise RuntimeError(
        "flash_attn_ext: double backward (differentiating the gradients, e.g. create_graph=True "
        "with a gradient penalty) is not implemented; use torch.nn.functional."
        "scaled_dot_product_attention's math backend for that part of the model")


# The backward op is not differentiable. Registering an autograd kernel that raises turns the
# silently wrong result torch would otherwise give for double backward into a clear error.
torch.library.register_autograd("flash_attn_ext::backward", _double_backward,
                                setup_context=_double_backward_setup)
