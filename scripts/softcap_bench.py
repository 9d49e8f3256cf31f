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

import flash_attn_ext
from flash_attn_ext.bench.peers import flash_attn_module_function
from flash_attn_ext.bench.problems import dense_cases, script_args
from flash_attn_ext.bench.timing import feature_cost_table, script_timer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    script_args(ap, seqlen="4096,8192,16384", rep_ms=50.0)
    ap.add_argument("--softcap", type=float, default=30.0)
    ap.add_argument("--mode", default="fwd,fwd_bwd", help="fwd and / or fwd_bwd (forward + backward)")
    args = ap.parse_args(argv)
    device, dtype, timer = script_timer(args)
    fa4 = flash_attn_module_function("flash-attn4") if device.type == "cuda" else None
    cap = args.softcap

    def theirs(q, k, v, causal):
        out = fa4(q, k, v, causal=causal, softcap=cap)
        return out[0] if isinstance(out, tuple) else out

    impls = {"ours": lambda q, k, v, causal: flash_attn_ext.flash_attn_func(q, k, v, causal=causal),
             "ours softcap": lambda q, k, v, causal: flash_attn_ext.flash_attn_func(q, k, v, causal=causal, softcap=cap)}
    if fa4 is not None:
        impls["FA4 softcap"] = theirs
    print(f"{dtype}, {device}, softcap {cap}; {args.rounds} alternated rounds, medians; "
          f"FlashAttention-4 {'importable' if fa4 else 'not importable' if device.type == 'cuda' else 'CUDA only'}")
    feature_cost_table(args, dense_cases(args, device, dtype), timer, impls, "softcap", "ours", "ours softcap",
                       "FA4 softcap" if fa4 is not None else None)


if __name__ == "__main__":
    main()
