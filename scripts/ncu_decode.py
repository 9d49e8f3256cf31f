"""One decode step of ours and of SDPA's cuDNN backend per case, for Nsight Compute (a profile
driver, not a benchmark): GQA 32:8, hd128, bf16, seqlen_q 1, full contiguous cache.

    ncu --cache-control all --clock-control none --metrics ... python scripts/ncu_decode.py B64xN8192 B1xN8192

--flush-zero: before each step, zero a 256 MB buffer, as the benchmark's timer flushes the L2
(triton.testing.do_bench), and profile with `ncu --cache-control none` to see the step in that L2
state (H200, B1 8k: the split kernel wrote back 1.4 MB of it while reading 33.6 MB; 14.5 us
against 13.9 us after ncu's own flush; docs/PERF_NOTES.md, 2026-12-04).
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn_ext import flash_attn_with_kvcache


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=["B64xN8192", "B1xN8192"], help="BxN decode cases")
    ap.add_argument("--flush-zero", action="store_true", help="zero a 256 MB buffer before each step")
    args = ap.parse_args()
    flush, cases = args.flush_zero, args.cases
    buf = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda") if flush else None
    for case in cases:
        b, n = (int(x[1:]) for x in case.split("x"))
        q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, n, 8, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        seqlens = torch.full((b,), n, device="cuda", dtype=torch.int32)
        if flush:
            buf.zero_()
        torch.cuda.nvtx.range_push(f"ours {case}")
        flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)
        torch.cuda.nvtx.range_pop()
        if flush:
            buf.zero_()
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.cuda.nvtx.range_push(f"cudnn {case}")
            F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        del q, k, v


if __name__ == "__main__":
    main()
