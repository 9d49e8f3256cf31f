"""Where a forward call's time goes: do_bench's wall time per call (L2 flushed, as the benchmark
times it) against the sum of the device kernel durations per call under torch.profiler, for
flash_attn_func and SDPA's cuDNN backend on the same inputs (bf16, batch 16, 2048 / hdim heads,
the benchmark's shapes). Wall minus kernels is launch and host time; kernels against kernels is
the kernels' own gap. Needs a CUDA GPU and triton (docs/PERF_NOTES.md, 2026-12-03 fourth session).

    python scripts/kernel_vs_wall.py --seqlen 1024 --cases 64c,64,128,128c,192c,192,256c
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn_ext import flash_attn_func


def kernel_us(fn, calls=20):
    """Mean summed device-kernel time of one call, microseconds, and the kernels' names."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in events) / calls, sorted({e.name[:60] for e in events})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--cases", default="64c,64,128,128c,192c,192,256c",
                    help="comma list of head dims, 'c' suffix for causal")
    args = ap.parse_args()
    from triton.testing import do_bench  # after the arguments: --help runs without triton
    torch.manual_seed(0)
    for case in args.cases.split(","):
        d, causal = int(case.rstrip("c")), case.endswith("c")
        B, H, N = max(1, args.tokens // args.seqlen), 2048 // d, args.seqlen
        q, k, v = (torch.randn(B, N, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def ours():
            return flash_attn_func(q, k, v, causal=causal)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        flops = 4 * B * H * N * N * d / (2 if causal else 1)
        lines = []
        for name, fn in (("ours", ours), ("cudnn", cudnn)):
            wall = do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
            kern, names = kernel_us(fn)
            lines.append(f"{name}: wall {wall:.1f} us ({flops / wall / 1e6:.0f} TFLOP/s), kernels {kern:.1f} us "
                         f"({flops / kern / 1e6:.0f} TFLOP/s) {names}")
        print(f"d{d} {'causal' if causal else 'non-causal'} N={N} batch={B} heads={H}:\n  " + "\n  ".join(lines),
              flush=True)


if __name__ == "__main__":
    main()
