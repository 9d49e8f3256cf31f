"""Where a decode step's time goes: the GPU timeline of ours and of SDPA's cuDNN backend (a
profile driver, not a benchmark). GQA 32:8, hd128, bf16, seqlen_q 1, full cache (contiguous, or
paged with xP<page>). Each call follows the benchmark's loop (flash_attn_ext/bench/timing.py:
a 256 MB L2 flush, then the call, no sync between), under torch.profiler (CUPTI kernel times);
per call it prints the kernels with their durations, the GPU's idle time between the flush and
the first kernel (host launch cost the flush did not hide) and the span from the flush's end to
the last kernel's end, the time the benchmark's events see. Medians over the calls.

    python scripts/profile_decode.py B1xN8192 B1xN131072 B8xN32768 B64xN8192 B64xN32768xP16
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from flash_attn_ext import flash_attn_with_kvcache


def make_case(case):
    parts = case.split("x")
    b, n = int(parts[0][1:]), int(parts[1][1:])
    page = int(parts[2][1:]) if len(parts) > 2 else 0
    q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.full((b,), n, device="cuda", dtype=torch.int32)
    if page:
        nb = b * n // page
        k = torch.randn(nb, page, 8, 128, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(nb, device="cuda", dtype=torch.int32).view(b, n // page)
    else:
        k, table = torch.randn(b, n, 8, 128, device="cuda", dtype=torch.bfloat16), None
    v = torch.randn_like(k)
    calls = {"ours": lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table)}
    if not page:
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        calls["cudnn"] = cudnn
    return calls, 2 * k.numel() * k.element_size()


def timeline(fn, reps=30):
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    for _ in range(5):
        flush.zero_()
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    calls, cur = [], None
    for e in evs:
        if "FillFunctor" in e.name and e.time_range.end - e.time_range.start > 20:  # the flush
            cur = {"flush_end": e.time_range.end, "kernels": []}
            calls.append(cur)
        elif cur is not None:
            cur["kernels"].append((e.name, e.time_range.start, e.time_range.end))
    calls = [c for c in calls if c["kernels"]]
    gap = statistics.median(c["kernels"][0][1] - c["flush_end"] for c in calls)
    span = statistics.median(max(k[2] for k in c["kernels"]) - c["flush_end"] for c in calls)
    names = {}
    for c in calls:
        for name, s, e in c["kernels"]:
            names.setdefault(name[:90], []).append(e - s)
    return gap, span, {n: (statistics.median(d), len(d) / len(calls)) for n, d in names.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=["B1xN8192", "B64xN8192"], help="BxN decode cases")
    for case in ap.parse_args().cases:
        calls, kv_bytes = make_case(case)
        for who, fn in calls.items():
            gap, span, kernels = timeline(fn)
            print(f"{case} {who}: span {span:.1f} us ({kv_bytes / span / 1e6:.2f} TB/s), "
                  f"launch gap {gap:.1f} us")
            for name, (dur, per_call) in kernels.items():
                print(f"    {dur:8.1f} us  x{per_call:.1f}  {name}")
        del calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
