"""err_out, err_grad: max |x - ref| of the output / of dq, dk, dv (the largest of the three)
against attention_ref in float64, computed one KV-head group at a time. The CLI measures them on
the timed problem's own call: each implementation runs once on the timed problem's first input
set (its forward, and backward where gradients are needed), and a slice of its output and
gradients is compared with the reference of the same slice of the inputs (the problem's
``err_slice``, at the indices of its ``err_index``): the first and last batch items (decode:
sequences; varlen: every sequence), --err-kv-heads KV heads, the first ones and the last, and
their query heads (whole GQA groups, so dk and dv of those heads are complete). The last batch
item and KV head are where the end of a large grid is (a launch-size or 32-bit offset overflow
shows there, not at index 0). Batch items and KV-head groups do not interact, so the slice
of the call is exactly the call's result on those rows: the errors are those of the kernel
configuration that is timed (its grid, split-KV and scheduling choices), at the reference cost
of the slice alone. ``standard`` is the "torch same-dtype math" baseline of the accuracy
criterion, measured the same way.

An implementation whose full call fails for memory (status OOM) is measured on the reduced
problem instead: the slice's inputs alone (batch <= 2, --err-kv-heads KV heads), with err_note
"errors on reduced problem: full call OOM". Inputs that do not fit at all are measured on a
reduced problem of that shape made on its own (sweeps).

Decode: the reference reads the cache gathered through the block table (so a paged result is
checked against the same keys), each sequence's used keys alone (its first cache_seqlens[b]: a
ragged cache, --decode-fill < 1, is checked against the keys it uses); its cost grows with
seqlen_k only, so every case gets one.
Varlen: the reference runs each sequence alone.
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
    shaped like the implementation's output and gradients. A DecodeProblem has no gradients and
    is computed one sequence at a time over its used keys (cache_seqlens); a VarlenProblem one
    sequence at a time."""
    if isinstance(p, DecodeProblem):
        k, v = p.contiguous_cache(0)
        q = p.sets[0][0]
        out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
        for b, n in enumerate(p.cache_seqlens.tolist()):  # sequence b: its first n keys alone
            out[b:b + 1] = _reference_bshd(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], None,
                                           p.softmax_scale, False, False)[0]
        return out, None
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


def _maxdiff(a: torch.Tensor, ref: torch.Tensor, rows=None, heads=None) -> float:
    """max |a - ref| over the reference's slice of ``a``: its rows ``rows`` of dim 0 (batch
    items, or tokens; None: every row) and heads ``heads`` of dim -2 (None: every head); NaN
    where any is NaN."""
    part = a
    if rows is not None:
        part = part.index_select(0, torch.tensor(rows, device=a.device))
    if heads is not None:
        part = part.index_select(part.dim() - 2, torch.tensor(heads, device=a.device))
    if part.shape != ref.shape:
        raise ValueError(f"result of shape {tuple(a.shape)} has no slice {tuple(ref.shape)}")
    d = (part.double() - ref)
    if torch.isnan(d).any():
        return float("nan")
    return d.abs().max().item()


def _compare(impl: Impl, p: Problem, need_grad: bool, ref: tuple, r: dict, index=None) -> None:
    """One call of ``impl`` on the first input set of ``p`` (forward, and backward with
    ``need_grad``): err_out / err_grad of its output and gradients against ``ref`` (out, grads:
    reference_chunked of ``p.err_slice``, or of all of ``p``) into ``r``. ``index``: ``p``'s
    err_index, where ``ref`` is that of its slice (None: of all of ``p``)."""
    rows, kv_heads, q_heads = index if index is not None else (None, None, None)
    q, k, v, dout = p.inputs(grad=need_grad)
    out = p.bind(impl)(q, k, v)
    r["err_out"] = _maxdiff(out, ref[0], rows, q_heads)
    if need_grad:
        grads = torch.autograd.grad(out, (q, k, v), dout)
        r["err_grad"] = max(_maxdiff(g, gr, rows, h)
                            for g, gr, h in zip(grads, ref[1], (q_heads, kv_heads, kv_heads)))


def measure_errors(impls: list[Impl], p: Problem, need_grad: bool, ref_max_seqlen: int,
                   err_kv: int) -> dict:
    """{impl name: {"err_out", "err_grad", "err_note"}} of each implementation's call on the
    problem ``p`` (a Problem, DecodeProblem or VarlenProblem) over ``p.err_slice(err_kv)``; a
    call that fails for memory: on that slice alone (module docstring). ``ref_max_seqlen`` None:
    no limit."""
    nan = float("nan")
    result = {i.name: {"err_out": nan, "err_grad": nan, "err_note": ""} for i in impls}
    if ref_max_seqlen is not None and p.seqlen > ref_max_seqlen:
        for r in result.values():
            r["err_note"] = f"reference skipped: seqlen > {ref_max_seqlen} (--ref-max-seqlen)"
        return result
    reduced, index = p.err_slice(err_kv), p.err_index(err_kv)
    try:
        ref = reference_chunked(reduced, need_grad)
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
        note, failure = "", run_guarded(impl, p.device,
                                        lambda: _compare(impl, p, need_grad, ref, r, index))
        if failure is not None and failure[0] == "OOM":  # the full call does not fit: the slice alone
            failure = run_guarded(impl, p.device,
                                  lambda: _compare(impl, reduced, need_grad, ref, r))
            note = "errors on reduced problem: full call OOM" if failure is None else \
                "full call OOM; on the reduced problem"
        if failure is not None:
            r.update(err_out=nan, err_grad=nan)
            note = " ".join(filter(None, (note, f"{failure[0]}: {failure[1]}")))
        r["err_note"] = note
    del ref, reduced
    free_memory(p.device)
    return result
