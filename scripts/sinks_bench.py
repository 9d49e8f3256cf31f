"""What attention sinks cost: the same calls with ``sinks=`` and without, alternated, on one device
(a diagnostic for the sink's epilogue, primitives/softmax.cuh sink_share, and the split-KV
combine; not the benchmark). Dense causal and non-causal forward and forward + backward (the
backward adds ops.sinks_grad's reduction), and decode steps through flash_attn_with_kvcache (GQA
32:8, hdim 128, one query per sequence). Prints ms without and with sinks and their ratio, the
median over ``--rounds`` alternated rounds (the benchmark's Timer in each).

    python scripts/sinks_bench.py [--hdim 64,128] [--seqlen 1024,4096,16384] [--decode B1xN8192,B64xN8192]
    python scripts/sinks_bench.py --device cpu --seqlen 256 --hdim 32 --decode B2xN512 --rep-ms 2   # smoke run
"""
import argparse
import statistics

import torch

import flash_attn_ext
from flash_attn_ext.bench.problems import dense_cases, script_args
from flash_attn_ext.bench.timing import script_timer


def _cases(text):
    out = []
    for item in text.split(","):
        b, n = item.upper().lstrip("B").split("XN")
        out.append((int(b), int(n)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    script_args(ap, seqlen="1024,4096,16384", rep_ms=50.0)
    ap.add_argument("--decode", default="B1xN8192,B8xN32768,B64xN8192", help="decode cases BxN ('' for none)")
    args = ap.parse_args(argv)
    device, dtype, timer = script_timer(args)

    def ratio_row(label, run):
        """run(with_sinks) timed alternately without / with, args.rounds times."""
        t = {False: [], True: []}
        for _ in range(args.rounds):
            for with_sinks in (False, True):
                t[with_sinks].append(timer(lambda: run(with_sinks)))
        ms0, ms1 = statistics.median(t[False]), statistics.median(t[True])
        print(f"| {label} | {ms0:.4f} | {ms1:.4f} | {ms1 / ms0:.3f} |")

    print(f"{dtype}, {device}; {args.rounds} alternated rounds, medians")
    print("| case | ms without sinks | ms with sinks | with / without |")
    print("|---|---|---|---|")
    for d, n, batch, nheads, q, k, v, dout in dense_cases(args, device, dtype):
        sinks = torch.randn(nheads, device=device, dtype=torch.float32, requires_grad=True)
        for causal in (False, True):
            def fwd(with_sinks):
                with torch.no_grad():
                    flash_attn_ext.flash_attn_func(q, k, v, causal=causal, sinks=sinks if with_sinks else None)

            def fwd_bwd(with_sinks):
                s = sinks if with_sinks else None
                out = flash_attn_ext.flash_attn_func(q, k, v, causal=causal, sinks=s)
                torch.autograd.grad(out, (q, k, v, s) if with_sinks else (q, k, v), dout)

            ratio_row(f"d{d} N{n} {'causal' if causal else 'full'} fwd", fwd)
            ratio_row(f"d{d} N{n} {'causal' if causal else 'full'} fwd+bwd", fwd_bwd)
    nheads, nheads_k, d = (32, 8, 128) if device.type == "cuda" else (8, 2, 64)
    sinks = torch.randn(nheads, device=device, dtype=torch.float32)
    for b, n in (_cases(args.decode) if args.decode else []):
        q = torch.randn(b, 1, nheads, d, device=device, dtype=dtype)
        kc, vc = (torch.randn(b, n, nheads_k, d, device=device, dtype=dtype) for _ in range(2))

        def step(with_sinks):
            with torch.no_grad():
                flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, causal=True, sinks=sinks if with_sinks else None)

        ratio_row(f"decode B{b} N{n} (GQA {nheads}:{nheads_k}, d{d})", step)


if __name__ == "__main__":
    main()
