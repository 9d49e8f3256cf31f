"""What attention dropout costs (a diagnostic for the kernels' kDropout twins, not the benchmark):
flash_attn_ext without and with ``dropout_p``, and PyTorch SDPA's flash backend (FlashAttention-2)
with the same dropout_p, dense forward + backward (dropout is for training). Prints TFLOP/s
(reference.attention_flops, fwd_bwd: 3.5 x the forward count), medians over ``--rounds`` alternated
rounds, and the ratios ours-with / ours-without and ours / SDPA flash (both with dropout).

    python scripts/dropout_bench.py [--hdim 64,128] [--seqlen 2048,8192] [--dropout 0.1]
    python scripts/dropout_bench.py --device cpu --seqlen 64 --hdim 16 --tokens 64 --rep-ms 1   # smoke run
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

import flash_attn_ext
from flash_attn_ext.bench.problems import dense_cases, script_args
from flash_attn_ext.bench.timing import script_timer
from flash_attn_ext.reference import attention_flops


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    script_args(ap, seqlen="2048,8192", rep_ms=50.0)
    ap.add_argument("--dropout", type=float, default=0.1)
    args = ap.parse_args(argv)
    device, dtype, timer = script_timer(args)
    p = args.dropout

    def sdpa_flash(q, k, v, causal):  # BSHD views as SDPA's BHSD
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 dropout_p=p, is_causal=causal)
        return out.transpose(1, 2)

    impls = {"ours": lambda q, k, v, c: flash_attn_ext.flash_attn_func(q, k, v, causal=c),
             f"ours p={p}": lambda q, k, v, c: flash_attn_ext.flash_attn_func(q, k, v, p, causal=c)}
    if device.type == "cuda":
        impls[f"SDPA flash p={p}"] = sdpa_flash
    names = list(impls)
    print(f"{dtype}, {device}, fwd + bwd; {args.rounds} alternated rounds, medians")
    print("| case | " + " | ".join(f"{n} TFLOP/s" for n in names) + " | with / without | ours / SDPA flash |")
    print("|---" * (len(names) + 3) + "|")
    for d, n, batch, nheads, q, k, v, dout in dense_cases(args, device, dtype):
        for causal in (False, True):
            times = {name: [] for name in names}
            for _ in range(args.rounds):
                for name, f in impls.items():
                    times[name].append(timer(lambda: torch.autograd.grad(f(q, k, v, causal), (q, k, v), dout)))
            flops = attention_flops(batch, nheads, n, n, d, causal, "fwd_bwd")
            tf = {name: flops / statistics.median(ts) / 1e9 for name, ts in times.items()}
            peer = tf.get(f"SDPA flash p={p}")
            vs = f"{tf[names[1]] / peer:.3f}" if peer else "-"
            print(f"| d{d} N{n} {'causal' if causal else 'full'} | " + " | ".join(f"{tf[x]:.4g}" for x in names)
                  + f" | {tf[names[1]] / tf['ours']:.3f} | {vs} |")


if __name__ == "__main__":
    main()
