"""Why tests/test_cuda_backward.py::test_backward_tensors_over_2pow31_elements failed on the GPU.

Answered on an H100 in the forty-first session (docs/PERF_NOTES.md): the forward's O, not an
offset. "early" passed, "1m" (no element past 2^31) failed, dq from the reference's O passed. The
kernels now move O out of the tensor-core accumulator every 8192 keys in rows of >= 2^18 keys
(csrc/kernels/common/long_rows.cuh), and every case below passed (H200, 8h / 1m / equal / flat, on
the build before the flush's __syncwarp mend, which has not run on a GPU yet); the script stays
as the check of that.

The fortieth session ran it on an H100 for the first time, with 8 heads (2,098,152 keys per row,
dominance 1.5): dq's max error 2.56e-1 against the rule's 2 x 8.56e-2, on both arch paths; every
other test past 2^31 elements passed. A read of both paths found no indexing fault and a likely
precision limit (tests/long_keys.py): the forward walks key blocks last to first, so a row's
dominant key (among the last) is in O's fp32 tensor-core accumulator first, and each 16-key step
rounds toward zero, up to an ulp of |O| lost per step (~N / 16 * 2^-24 of |O| over N keys, half an
ulp a step); D =
rowsum(dO o O) carries that into dq. The test now uses 128 heads (132,072 keys per row, dominance
1.3). One call checks both, each case printing the forward's and the three gradients' max errors
beside the same-dtype baseline's (tests/long_keys.py: the chunked references) and the rows of the
largest dq errors with their dominant key's probability:

  test    the test's inputs now (128 heads, 132k keys per row), both arch paths: "sm80" too
  8h      the failing shape (8 heads, 2.1M keys per row, the last 2^20 value rows shifted): out's
          error should exceed the baseline's
  early   8h with each row's dominant key moved to row 1000 + i (walked last): should pass
  1m      8 heads, 1M keys (no element past 2^31)
  equal   8h with every q row of norm sqrt(128): every row's dominant key ~0.88
  flat    8h without a dominant key: the forward's drift alone
and, per case, dq from the reference's O (in bf16) and LSE: passing there puts the error in the
forward's O (the precision limit), failing in the backward kernels.

and the same question for dK / dV over long query rows (docs/PERF_NOTES.md, forty-second session;
run on an H100 in the forty-third: both paths within the rule at 2^20 queries): the dK/dV kernels
accumulate P^T dO and dS^T Q over every query of a key block in fp32 tensor-core accumulators,
the same rounding toward zero, over the queries:

  longq       8 heads, 2^20 queries, 1024 keys (seqlen_q set by --seqlen-q): dk / dv against
              float64 and a same-dtype baseline (products of bf16-rounded operands summed in
              float32, rounded to bf16 once: stricter than a bf16 matmul), one query chunk at a time
  longq-sm80  the same on the sm80 path

  python scripts/long_keys_diag.py [--cases test,sm80,8h,early,1m,equal,flat,longq]   (~29 GiB of GPU memory)
  python scripts/long_keys_diag.py --device cpu --seqlen-k 4096   (the CPU op, short keys: a smoke test)
"""

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import flash_attn_ext  # noqa: E402
from accuracy import default_atol  # noqa: E402
from long_keys import _chunked_grads, chunked_ref, key_chunk, long_key_inputs  # noqa: E402

BIG = 2**31 // (8 * 128) + 1000  # 8 heads: k.numel() = 2^31 + 8,192,000 (the inputs that failed)
TEST = 2**31 // (128 * 128) + 1000  # 128 heads: inputs_past_2pow31's
CASES = {  # name: (seqlen_k, nheads, dominance, force_sm80, transform)
    "test": (TEST, 128, 1.3, False, None), "sm80": (TEST, 128, 1.3, True, None), "8h": (BIG, 8, 1.5, False, None),
    "early": (BIG, 8, 1.5, False, "early"), "1m": (1 << 20, 8, 1.5, False, None), "equal": (BIG, 8, 1.5, False, "equal"),
    "flat": (BIG, 8, 0.0, False, None),
}
LONG_QUERY_CASES = ("longq", "longq-sm80")  # run_long_queries


def inputs(seqlen_k, nheads, dominance, transform, device):
    # the 8-head cases shift the last 2^20 value rows, as the inputs that failed did
    shifted = min(1 << 20, seqlen_k) if nheads == 8 else None
    # "equal": every row's dominant score 1.5 * 128 / sqrt(128) ~ 17
    q, k, v = long_key_inputs(seqlen_k, nheads=nheads, dominance=dominance, device=device, shifted_rows=shifted,
                              equal_norms=transform == "equal")
    if transform == "early":  # each row's dominant key moved before element 2^31
        for i in range(q.shape[1]):
            k[:, 1000 + i], k[:, -3 - i] = k[:, -3 - i].clone(), k[:, 1000 + i].clone()
    return q, k, v


def run(name, device, seqlen_k=None):
    default_k, nheads, dominance, sm80, transform = CASES[name]
    seqlen_k = seqlen_k or default_k
    torch.manual_seed(0)
    q, k, v = inputs(seqlen_k, nheads, dominance, transform, device)
    chunk = key_chunk(k)
    dout = torch.randn_like(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    previous = flash_attn_ext.force_sm80_path(sm80)
    try:
        out, lse, stats = torch.ops.flash_attn_ext.forward(q, k, v, scale, False)
        dq, dk, dv = torch.ops.flash_attn_ext.backward(dout, q, k, v, out, lse, scale, False, stats)
        ref_out, ref_lse = chunked_ref(q, k, v, scale, chunk, True)
        base_out, _ = chunked_ref(q, k, v, scale, chunk, False)
        dq_ref_fwd = torch.ops.flash_attn_ext.backward(dout, q, k, v, ref_out.to(q.dtype), ref_lse.contiguous(),
                                                       scale, False, None)[0]
    finally:
        flash_attn_ext.force_sm80_path(previous)
    print(f"== {name}: seqlen_k {seqlen_k}, {nheads} heads, dominance {dominance}, sm80 {sm80}, "
          f"{transform or 'as generated'}")
    print(f"  out: err {(out.double() - ref_out).abs().max().item():.3e}, baseline "
          f"{(base_out.double() - ref_out).abs().max().item():.3e}; lse err "
          f"{(lse.double() - ref_lse.double()).abs().max().item():.3e}")
    # each row's dominant-key probability, from the reference's LSE: (s, h)
    rows = torch.arange(q.shape[1], device=q.device)
    dominant = 1000 + rows if transform == "early" else seqlen_k - 3 - rows
    s_dom = (q[0].double() * k[0, dominant].double()).sum(-1) * scale
    p_dom = torch.exp(s_dom - ref_lse[0].transpose(0, 1).double())
    errs = {}
    for (start, ref1, ref2), (_, base1, base2) in zip(_chunked_grads(q, k, v, dout, scale, chunk, True),
                                                      _chunked_grads(q, k, v, dout, scale, chunk, False)):
        pairs = (("dq", dq, ref1, base1), ("dq from the reference's O, LSE", dq_ref_fwd, ref1, base1)) \
            if start is None else (("dk", dk[:, start:start + chunk], ref1, base1),
                                   ("dv", dv[:, start:start + chunk], ref2, base2))
        for what, ours, ref, base in pairs:
            e = errs.setdefault(what, [0.0, 0.0, 0.0])
            e[0] = max(e[0], (ours.double() - ref).abs().max().item())
            e[1] = max(e[1], (base.double() - ref).abs().max().item())
            e[2] = max(e[2], ref.abs().max().item())
        if start is None:
            row_err = (dq.double() - ref1).abs().amax(-1)[0]        # (s, h)
            top = row_err.flatten().topk(4).indices
            out_row = (out.double() - ref_out).abs().amax(-1)[0]
            for i in top.tolist():
                s, h = divmod(i, q.shape[2])
                print(f"  dq row {s} head {h}: err {row_err[s, h].item():.3e}, |dq| "
                      f"{ref1[0, s, h].abs().max().item():.3e}, P(dominant key) {p_dom[s, h].item():.3f}, "
                      f"out err {out_row[s, h].item():.3e}")
    for what, (e, b, m) in errs.items():
        verdict = "ok" if e <= 2 * b + default_atol(q.dtype) else "FAILS the rule"
        print(f"  {what}: err {e:.3e}, baseline {b:.3e} (x{e / max(b, 1e-30):.2f}), max|ref| {m:.3e}: {verdict}")
    sys.stdout.flush()


def run_long_queries(name, device, seqlen_q=None):
    """The longq cases: dq, dk, dv of 2^20 query rows over 1024 keys, references per query chunk."""
    seqlen_q, nheads, seqlen_k, d = seqlen_q or 1 << 20, 8, 1024, 128
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, n, nheads, d, dtype=torch.bfloat16, device=device)
                     for n in (seqlen_q, seqlen_k, seqlen_k, seqlen_q))
    scale = 1.0 / math.sqrt(d)
    previous = flash_attn_ext.force_sm80_path(name.endswith("sm80"))
    try:
        out, lse, stats = torch.ops.flash_attn_ext.forward(q, k, v, scale, False)
        dq, dk, dv = torch.ops.flash_attn_ext.backward(dout, q, k, v, out, lse, scale, False, stats)
    finally:
        flash_attn_ext.force_sm80_path(previous)
    chunk = max(2**27 // (nheads * seqlen_k), 1)
    acc = {w: torch.zeros(1, seqlen_k, nheads, d, dtype=torch.float64, device=device)
           for w in ("dk ref", "dv ref", "dk base", "dv base")}
    err = {"dq": [0.0, 0.0, 0.0]}
    for a in range(0, seqlen_q, chunk):
        qc, doc = q[:, a:a + chunk], dout[:, a:a + chunk]
        for what, t in (("ref", torch.float64), ("base", torch.float32)):
            # ref: float64 throughout; base: every operand rounded to bf16, products summed in float32
            r = (lambda x: x.to(t)) if what == "ref" else (lambda x: x.to(torch.bfloat16).to(t))
            s = torch.einsum("bqhd,bkhd->bhqk", r(qc), r(k)) * scale
            p = r(torch.softmax(r(s), dim=-1))
            o = r(torch.einsum("bhqk,bkhd->bqhd", p, r(v)))
            d_rows = (r(doc) * o).sum(-1).transpose(1, 2)[..., None]  # D = rowsum(dO o O)
            acc["dv " + what] += torch.einsum("bhqk,bqhd->bkhd", p, r(doc)).double()
            ds = r(p * (r(torch.einsum("bqhd,bkhd->bhqk", r(doc), r(v))) - d_rows))
            acc["dk " + what] += (torch.einsum("bhqk,bqhd->bkhd", ds, r(qc)) * scale).double()
            dqc = torch.einsum("bhqk,bkhd->bqhd", ds, r(k)) * scale
            if what == "ref":
                dq_ref = dqc
            else:
                e = err["dq"]
                e[0] = max(e[0], (dq[:, a:a + chunk].double() - dq_ref).abs().max().item())
                e[1] = max(e[1], (dqc.to(torch.bfloat16).double() - dq_ref).abs().max().item())
                e[2] = max(e[2], dq_ref.abs().max().item())
    for what, ours in (("dk", dk), ("dv", dv)):
        ref, base = acc[what + " ref"], acc[what + " base"].to(torch.bfloat16).double()
        err[what] = [(ours.double() - ref).abs().max().item(), (base - ref).abs().max().item(), ref.abs().max().item()]
    print(f"== {name}: seqlen_q {seqlen_q}, seqlen_k {seqlen_k}, {nheads} heads")
    for what, (e, b, m) in err.items():
        verdict = "ok" if e <= 2 * b + default_atol(q.dtype) else "FAILS the rule"
        print(f"  {what}: err {e:.3e}, baseline {b:.3e} (x{e / max(b, 1e-30):.2f}), max|ref| {m:.3e}: {verdict}")
    sys.stdout.flush()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES),
                        help="comma list of: " + ", ".join([*CASES, *LONG_QUERY_CASES]) + " (default: the key cases)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (the CPU op)")
    parser.add_argument("--seqlen-k", type=int, default=None, help="every case's key count (default: its own)")
    parser.add_argument("--seqlen-q", type=int, default=None, help="the longq cases' query count (default 2^20)")
    args = parser.parse_args(argv)
    names = args.cases.split(",")
    for name in names:
        if name not in CASES and name not in LONG_QUERY_CASES:
            parser.error(f"--cases: unknown case {name!r}; expected some of {', '.join([*CASES, *LONG_QUERY_CASES])}")
    for name in names:
        if name in LONG_QUERY_CASES:
            run_long_queries(name, args.device, args.seqlen_q)
        else:
            run(name, args.device, args.seqlen_k)
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
