"""What ALiBi costs (a diagnostic for the kernels' kAlibi twins, not the benchmark): flash_attn_ext
with and without ``alibi_slopes=`` (the paper's geometric slopes, one per head), and PyTorch SDPA's
memory-efficient backend with the same bias as a float attn_mask (reference.alibi_bias, materialised:
(1, nheads, N, N) in the inputs' dtype; causal as -inf there too), on one device, dense forward and
forward + backward. Prints TFLOP/s of each (reference.attention_flops), medians over ``--rounds``
alternated rounds, and the ratios ours-with / ours-without and ours / SDPA (both with ALiBi).

    python scripts/alibi_bench.py [--hdim 64,128] [--seqlen 2048,4096,8192]
    python scripts/alibi_bench.py --device cpu --seqlen 64 --hdim 16 --tokens 64 --rep-ms 1   # smoke run
"""
import argparse

import torch
import torch.nn.functional as F

import flash_attn_ext
from flash_attn_ext.bench.problems import dense_cases, script_args
from flash_attn_ext.bench.timing import feature_cost_table, script_timer
from flash_attn_ext.reference import alibi_bias, alibi_geometric_slopes, causal_mask


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    script_args(ap, seqlen="2048,4096,8192", rep_ms=50.0)
    ap.add_argument("--mode", default="fwd,fwd_bwd", help="fwd and / or fwd_bwd (forward + backward)")
    args = ap.parse_args(argv)
    device, dtype, timer = script_timer(args)
    biases = {}  # (nheads, N, causal) -> the SDPA peer's attn_mask
    slopes = {}  # nheads -> the slopes (made once, outside the timed calls)

    def slopes_of(h):
        if h not in slopes:
            slopes[h] = alibi_geometric_slopes(h, device)
        return slopes[h]

    def sdpa(q, k, v, causal):
        h, n = q.shape[2], q.shape[1]
        if (h, n, causal) not in biases:
            bias = alibi_bias(slopes_of(h), 1, h, n, n, q.dtype)
            if causal:
                bias = bias.masked_fill(~causal_mask(n, n, device), float("-inf"))
            biases.clear()  # one at a time: (1, H, N, N)
            biases[(h, n, causal)] = bias
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=biases[(h, n, causal)])
        return out.transpose(1, 2)

    impls = {"ours": lambda q, k, v, causal: flash_attn_ext.flash_attn_func(q, k, v, causal=causal),
             "ours alibi": lambda q, k, v, causal: flash_attn_ext.flash_attn_func(q, k, v, causal=causal,
                                                                                  alibi_slopes=slopes_of(q.shape[2]))}
    if device.type == "cuda":
        impls["SDPA efficient alibi"] = sdpa
    print(f"{dtype}, {device}; {args.rounds} alternated rounds, medians")
    feature_cost_table(args, dense_cases(args, device, dtype), timer, impls, "alibi", "ours", "ours alibi",
                       "SDPA efficient alibi" if device.type == "cuda" else None)


if __name__ == "__main__":
    main()
