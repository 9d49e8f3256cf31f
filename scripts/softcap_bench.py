"""What logit soft-capping costs (a diagnostic for the kernels' kSoftcap twins, not the benchmark):
flash_attn_ext with and without ``softcap=``, and FlashAttention-4 (flash_attn.cute, where
importable) with the same softcap, on one device, dense forward and forward + backward. Prints
TFLOP/s of each (reference.attention_flops: forward 4 N^2 d per head, halved when causal; fwd_bwd
3.5 x that), the median over ``--rounds`` alternated rounds (the benchmark's Timer in each), and
the ratios ours-with / ours-without and ours / FA4 (both with softcap).

    python scripts/softcap_bench.py [--hdim 64,128] [--seqlen 4096,8192,16384] [--softcap 30]
    python scripts/softcap_bench.py --device cpu --seqlen 64 --hdim 16 --tokens 64 --rep-ms 1   # smoke run
"""
import argparse
import statistics

import torch

import flash_attn_ext
from flash_attn_ext.bench.peers import flash_attn_module_function
from flash_attn_ext.bench.problems import dense_cases, script_args
from flash_attn_ext.bench.timing import script_timer
from flash_attn_ext.reference import attention_flops


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    script_args(ap, seqlen="4096,8192,16384", rep_ms=50.0)
    ap.add_argument("--softcap", type=float, default=30.0)
    ap.add_argument("--mode", default="fwd,fwd_bwd", help="fwd and / or fwd_bwd (forward + backward)")
    args = ap.parse_args(argv)
    device, dtype, timer = script_timer(args)
    fa4 = flash_attn_module_function("flash-attn4") if device.type == "cuda" else None
    cap = args.softcap

    def ours(q, k, v, causal, softcap):
        return flash_attn_ext.flash_attn_func(q, k, v, causal=causal, softcap=softcap)

    def theirs(q, k, v, causal, softcap):
        out = fa4(q, k, v, causal=causal, softcap=softcap)
        return out[0] if isinstance(out, tuple) else out

    impls = {"ours": (ours, 0.0), "ours softcap": (ours, cap)}
    if fa4 is not None:
        impls["FA4 softcap"] = (theirs, cap)
    print(f"{dtype}, {device}, softcap {cap}; {args.rounds} alternated rounds, medians; "
          f"FlashAttention-4 {'importable' if fa4 else 'not importable' if device.type == 'cuda' else 'CUDA only'}")
    names = list(impls)
    print("| case | " + " | ".join(f"{n} TFLOP/s" for n in names) + " | softcap / plain | ours / FA4 |")
    print("|---" * (len(names) + 3) + "|")
    for d, n, batch, nheads, q, k, v, dout in dense_cases(args, device, dtype):
        for causal in (False, True):
            for mode in args.mode.split(","):
                flops = attention_flops(batch, nheads, n, n, d, causal, mode)

                def run(name):
                    f, softcap = impls[name]
                    if mode == "fwd":
                        with torch.no_grad():
                            f(q, k, v, causal, softcap)
                    else:
                        torch.autograd.grad(f(q, k, v, causal, softcap), (q, k, v), dout)

                t = {name: [] for name in names}
                failed = {}
                for _ in range(args.rounds):
                    for name in names:
                        if name in failed:
                            continue
                        try:
                            t[name].append(timer(lambda: run(name)))
                        except Exception as e:  # e.g. a peer without this softcap path
                            failed[name] = type(e).__name__
                tf = {name: (flops / statistics.median(t[name]) / 1e9 if name not in failed else None)
                      for name in names}
                cells = [f"{tf[x]:.4g}" if tf[x] else f"n/a ({failed[x]})" for x in names]
                ratio = f"{tf['ours softcap'] / tf['ours']:.3f}"
                vs = (f"{tf['ours softcap'] / tf['FA4 softcap']:.3f}" if tf.get("FA4 softcap") else "-")
                label = f"d{d} N{n} {'causal' if causal else 'full'} {mode}"
                print(f"| {label} | " + " | ".join(cells) + f" | {ratio} | {vs} |")


if __name__ == "__main__":
    main()
