"""Dense forward calls of one implementation for Nsight Compute (a profile driver, not a benchmark):
ours (flash_attn_ext.flash_attn_func) or FlashAttention-4 (flash_attn.cute.flash_attn_func, where
importable), bf16 BSHD, random normal inputs, one call per case in the order given (FA4 compiles
each case's kernel in its first call; ncu replays the launch it profiles, so that call serves).
A case is BATCHxSEQLENxHEADSxHEADDIM, with a trailing c for causal.

    ncu --clock-control none --kernel-name regex:flash_fwd_kernel --section SpeedOfLight \\
        --section WarpStateStats python scripts/ncu_fwd.py ours 4x4096x16x128 4x4096x16x128c
    ncu --clock-control none --kernel-name 'regex:[Ff]lash' ... python scripts/ncu_fwd.py flash-attn4 ...
"""
import argparse

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("impl", choices=["ours", "flash-attn4"])
    ap.add_argument("cases", nargs="+", help="BATCHxSEQLENxHEADSxHEADDIM[c]")
    args = ap.parse_args()
    if args.impl == "ours":
        from flash_attn_ext import flash_attn_func
    else:
        from flash_attn.cute import flash_attn_func
    for case in args.cases:
        causal = case.endswith("c")
        shape = tuple(int(x) for x in case.rstrip("c").split("x"))
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        torch.cuda.nvtx.range_push(case)
        flash_attn_func(q, k, v, causal=causal)
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
