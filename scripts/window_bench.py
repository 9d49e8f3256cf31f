"""Speed of sliding-window (local) attention against full causal attention, on one device (a
diagnostic for the window's kernels, not the benchmark: flash_attn_ext.benchmark times the
issues' cases). For each (hdim, seqlen, window) it times causal calls with window_size = (window -
1, 0) (transformers' sliding_window = window) and without, forward and forward + backward, ours and
FlashAttention-4 where importable (flash_attn.cute.flash_attn_func, window_size=(window - 1, 0)), and
prints ms and TFLOP/s by the window's FLOP count: 4 B H d per visible (query, key) pair forward,
2.5x that for the backward (the benchmark's count, reference.attention_flops, on the pairs a window
keeps). The ratio to the full causal call shows how close the windowed kernels (their kLocal
twins, common/mask.cuh) come to visiting only the window's tiles.

    python scripts/window_bench.py [--hdim 64,128] [--seqlen 4096,16384] [--window 256,1024,4096]
    python scripts/window_bench.py --device cpu --seqlen 256 --window 32 --hdim 32 --rep-ms 1   # smoke run
"""
import argparse

import torch

import flash_attn_ext
from flash_attn_ext.bench.peers import flash_attn_module_function
from flash_attn_ext.bench.problems import dense_cases, script_args
from flash_attn_ext.bench.timing import script_timer


def visible_pairs(seqlen: int, window: int) -> int:
    """(query, key) pairs a causal window of `window` keys keeps on a square seqlen x seqlen call
    (window <= 0: plain causal)."""
    if window <= 0 or window >= seqlen:
        return seqlen * (seqlen + 1) // 2
    return window * (window + 1) // 2 + (seqlen - window) * window


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    script_args(ap, seqlen="4096,16384", rep_ms=100.0, rounds=None)
    ap.add_argument("--window", default="256,1024,4096", help="windows in keys (transformers' sliding_window)")
    args = ap.parse_args(argv)
    device, dtype, timer = script_timer(args)
    fa4 = flash_attn_module_function("flash-attn4") if device.type == "cuda" else None
    print(f"{dtype}, {device}; causal; nheads = 2048 / hdim; FlashAttention-4: {'yes' if fa4 else 'not importable'}")
    print("| hdim | seqlen | window | impl | pass | ms | TFLOP/s | x full causal (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for d, n, batch, nheads, q, k, v, dout in dense_cases(args, device, dtype):
        impls = [("ours", lambda w: flash_attn_ext.flash_attn_func(q, k, v, causal=True, window_size=w))]
        if fa4 is not None:
            impls.append(("flash-attn4", lambda w: fa4(q, k, v, causal=True, window_size=w)))
        for name, call in impls:
            def out_of(w):
                o = call(w)
                return o[0] if isinstance(o, tuple) else o

            full = {}
            for window in [0] + [int(x) for x in args.window.split(",")]:
                w = (window - 1, 0) if window > 0 else (None, None) if name == "flash-attn4" else (-1, -1)
                for pass_name, scale in (("fwd", 1.0), ("fwd+bwd", 3.5)):
                    def run():
                        if pass_name == "fwd":
                            with torch.no_grad():
                                out_of(w)
                        else:
                            torch.autograd.grad(out_of(w), (q, k, v), dout)

                    ms = timer(run)
                    flops = scale * 4.0 * batch * nheads * d * visible_pairs(n, window)
                    if window == 0:
                        full[pass_name] = ms
                    ratio = ms / full[pass_name]
                    label = window if window > 0 else "none (causal)"
                    print(f"| {d} | {n} | {label} | {name} | {pass_name} | {ms:.3f} | "
                          f"{flops / ms / 1e9:.1f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
