"""err_out, err_grad: max |x - ref| of the output / of dq, dk, dv (the largest of the three)
against attention_ref in float64, computed one KV-head group at a time. The CLI measures them on
a reduced problem of the same seqlen (batch 1, --err-kv-heads KV heads); ``standard`` is the
"torch same-dtype math" baseline of the accuracy criterion.
"""

from __future__ import annotations

import torch

from flash_attn_ext.bench.peers import Impl, classify, free_memory, run_guarded
from flash_attn_ext.bench.timing import Problem
from flash_attn_ext.reference import attention_ref


def reference_chunked(p: Problem, need_grad: bool):
    """attention_ref in float64 on the problem's first input set, one KV head (and the query
    heads that share it) at a time, so that the score matrix of a long sequence fits.
    Returns (out, (dq, dk, dv) or None) as float64 BSHD tensors."""
    q, k, v, dout = p.sets[0]
    ratio = p.nheads // p.nheads_k
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    grads = tuple(torch.empty(t.shape, dtype=torch.float64, device=q.device) for t in (q, k, v)) \
        if need_grad else None
    for j in range(p.nheads_k):
        hq = slice(j * ratio, (j + 1) * ratio)
        qh = q[:, :, hq].double().requires_grad_(need_grad)
        kh = k[:, :, j:j + 1].double().requires_grad_(need_grad)
        vh = v[:, :, j:j + 1].double().requires_grad_(need_grad)
        with torch.set_grad_enabled(need_grad):
            oh, _ = attention_ref(qh, kh, vh, p.softmax_scale, p.causal, upcast=True)
        out[:, :, hq] = oh.detach()
        if need_grad:
            dq, dk, dv = torch.autograd.grad(oh, (qh, kh, vh), dout[:, :, hq].double())
            grads[0][:, :, hq], grads[1][:, :, j:j + 1], grads[2][:, :, j:j + 1] = dq, dk, dv
        del qh, kh, vh, oh
    return out, grads


def _maxdiff(a: torch.Tensor, ref: torch.Tensor) -> float:
    d = (a.double() - ref)
    if torch.isnan(d).any():
        return float("nan")
    return d.abs().max().item()


def measure_errors(impls: list[Impl], p: Problem, need_grad: bool, ref_max_seqlen: int) -> dict:
    """{impl name: {"err_out", "err_grad", "err_note"}} on the (reduced) problem ``p``."""
    nan = float("nan")
    result = {i.name: {"err_out": nan, "err_grad": nan, "err_note": ""} for i in impls}
    if p.seqlen > ref_max_seqlen:
        for r in result.values():
            r["err_note"] = f"reference skipped: seqlen > {ref_max_seqlen} (--ref-max-seqlen)"
        return result
    try:
        ref_out, ref_grads = reference_chunked(p, need_grad)
    except Exception as e:
        status, note = classify(e)
        for r in result.values():
            r["err_note"] = f"reference {status}: {note}"
        free_memory(p.device, collect=True)
        return result
    for impl in impls:
        r = result[impl.name]
        if impl.skips(p.seqlen):
            r["err_note"] = "skipped"
            continue

        def body():
            q, k, v, dout = p.inputs(grad=need_grad)
            out = impl.fn(q, k, v, p.softmax_scale, p.causal)
            r["err_out"] = _maxdiff(out, ref_out)
            if need_grad:
                grads = torch.autograd.grad(out, (q, k, v), dout)
                r["err_grad"] = max(_maxdiff(g, gr) for g, gr in zip(grads, ref_grads))

        failure = run_guarded(impl, p.device, body)
        if failure is not None:
            r.update(err_out=nan, err_grad=nan, err_note=f"{failure[0]}: {failure[1]}")
    del ref_out, ref_grads
    free_memory(p.device)
    return result
