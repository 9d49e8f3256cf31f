"""What the varlen kernels' idle CTAs cost (a diagnostic, not a benchmark). Every varlen kernel's grid
is sized by max_seqlen (forward and dQ: ceil(max_seqlen_q / kBlockM) x batch x nheads CTAs; dK/dV:
ceil(max_seqlen_k / kBlockN) x batch x nheads_k), and a CTA whose tile starts past its sequence's
end exits without work (kernels/common/work.cuh: past_end). On skewed lengths most CTAs are such.
This times one packed batch (the benchmark's: --seqs sequences of --lens summing to --tokens,
flash_attn_ext.bench.problems.mixed_lengths) through flash_attn_varlen_func with max_seqlen = the
longest sequence and = --factor times that: the extra CTAs are all idle (the same bits:
tests/test_varlen_cuda.py test_varlen_max_seqlen_larger_than_needed), so the difference per idle CTA
is what a grid of only the real tiles (FlashAttention-4's SingleTileVarlenScheduler: total /
kBlockM + batch CTAs, each finding its tile by a prefix sum over cu_seqlens) would save.

    python scripts/varlen_idle_ctas.py [--hdim 64,128] [--causal both] [--factor 8]
    python scripts/varlen_idle_ctas.py --device cpu --tokens 256 --seqs 4 --lens 16,128   # smoke run

Prints, per (hdim, causal, pass), the median ms at both max_seqlen and their ratio.
"""
import argparse
import statistics
import time

import torch

import flash_attn_ext
from flash_attn_ext.bench.problems import mixed_lengths


def _timed(fn, device, reps):
    """Median ms of fn() over reps calls (CUDA events around each, after a warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hdim", default="64,128")
    ap.add_argument("--causal", default="both", choices=["both", "true", "false"])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--lens", default="128,1024", help="LO,HI of the sequence lengths")
    ap.add_argument("--factor", type=int, default=8, help="max_seqlen of the second call, in longest sequences")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lo, hi = (int(x) for x in args.lens.split(","))
    lens = mixed_lengths(args.seqs, args.tokens, lo, hi)
    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    longest = max(lens)
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    print(f"{args.seqs} sequences of {lo}..{hi} ({sum(lens)} tokens, longest {longest}), {dtype}, {device}")
    print("| hdim | causal | pass | ms at max_seqlen = longest | ms at x%d | ratio |" % args.factor)
    print("|---|---|---|---|---|---|")
    for d in (int(x) for x in args.hdim.split(",")):
        nheads = max(1, 2048 // d)
        q, k, v = (torch.randn(sum(lens), nheads, d, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        for causal in causals:
            def fwd(m):
                return flash_attn_ext.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=causal)

            def fwd_bwd(m):
                torch.autograd.grad(fwd(m), (q, k, v), dout)

            for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                with torch.no_grad() if name == "fwd" else torch.enable_grad():
                    tight = _timed(lambda: fn(longest), device, args.reps)
                    loose = _timed(lambda: fn(args.factor * longest), device, args.reps)
                print(f"| {d} | {causal} | {name} | {tight:.3f} | {loose:.3f} | {loose / tight:.3f} |")


if __name__ == "__main__":
    main()
