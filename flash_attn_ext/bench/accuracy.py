"""err_out, err_grad: max |x - ref| of the output / of dq, dk, dv (the largest of the three)
against attention_ref in float64, computed one KV-head group at a time. The CLI measures them on
a reduced problem of the same seqlen (batch 1, --err-kv-heads KV heads); ``standard`` is the
"torch same-dtype math" baseline of the accuracy criterion.

Decode: the reference reads the cache gathered through the block table (so a paged result is
checked against the same keys); the reduced problem keeps seqlen_k, the page size and GQA ratio,
batch min(batch, 2), --err-kv-heads KV heads; its cost grows with seqlen_k only, so every case
gets one. Varlen: the reference runs each sequence alone; the reduced problem keeps every
sequence length, --err-kv-heads KV heads.
"""

from __future__ import annotations

import torch

from flash_attn_ext.bench.peers import Impl, classify, free_memory, run_guarded
from flash_attn_ext.bench.problems import DecodeProblem, Problem, VarlenProblem
from flash_attn_ext.reference import attention_ref


def _reference_bshd(q, k, v, dout, softmax_scale, causal, need_grad):
    """attention_ref in float64 on BSHD tensors, one KV head (and the query heads that share it)
    at a time, so that the score matrix of a long sequence fits.
    Returns (out, (dq, dk, dv) or None) as float64 BSHD tensors."""
    ratio = q.shape[2] // k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    grads = tuple(torch.empty(t.shape, dtype=torch.float64, device=q.device) for t in (q, k, v)) \
        if need_grad else None
    for j in range(k.shape[2]):
        hq = slice(j * ratio, (j + 1) * ratio)
        qh = q[:, :, hq].double().requires_grad_(need_grad)
        kh = k[:, :, j:j + 1].double().requires_grad_(need_grad)
        vh = v[:, :, j:j + 1].double().requires_grad_(need_grad)
        with torch.set_grad_enabled(need_grad):
            oh, _ = attention_ref(qh, kh, vh, softmax_scale, causal, upcast=True)
        out[:, :, hq] = oh.detach()
        if need_grad:
            dq, dk, dv = torch.autograd.grad(oh, (qh, kh, vh), dout[:, :, hq].double())
            grads[0][:, :, hq], grads[1][:, :, j:j + 1], grads[2][:, :, j:j + 1] = dq, dk, dv
        del qh, kh, vh, oh
    return out, grads


def reference_chunked(p: Problem, need_grad: bool):
    """The float64 reference of the problem's first input set: (out, (dq, dk, dv) or None),
    shaped like the implementation's output and gradients. A DecodeProblem has no gradients;
    a VarlenProblem is computed one sequence at a time."""
    if isinstance(p, DecodeProblem):
        k, v = p.contiguous_cache(0)
        return _reference_bshd(p.sets[0][0], k, v, None, p.softmax_scale, False, False)[0], None
    q, k, v, dout = p.sets[0]
    if not isinstance(p, VarlenProblem):
        return _reference_bshd(q, k, v, dout, p.softmax_scale, p.causal, need_grad)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    grads = tuple(torch.zeros(t.shape, dtype=torch.float64, device=q.device) for t in (q, k, v)) \
        if need_grad else None
    bounds = p.cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            continue
        rows = lambda t: t[a:b].unsqueeze(0)
        o, g = _reference_bshd(rows(q), rows(k), rows(v), rows(dout), p.softmax_scale, p.causal,
                               need_grad)
        out[a:b] = o[0]
        if need_grad:
            for full, part in zip(grads, g):
                full[a:b] = part[0]
    return out, grads


def _maxdiff(a: torch.Tensor, ref: torch.Tensor) -> float:
    d = (a.double() - ref)
    if torch.isnan(d).any():
        return float("nan")
    return d.abs().max().item()


def measure_errors(impls: list[Impl], p: Problem, need_grad: bool, ref_max_seqlen: int) -> dict:
    """{impl name: {"err_out", "err_grad", "err_note"}} on the (reduced) problem ``p`` (a
    Problem, DecodeProblem or VarlenProblem); ``ref_max_seqlen`` None: no limit."""
    nan = float("nan")
    result = {i.name: {"err_out": nan, "err_grad": nan, "err_note": ""} for i in impls}
    if ref_max_seqlen is not None and p.seqlen > ref_max_seqlen:
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
            out = p.bind(impl)(q, k, v)
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
