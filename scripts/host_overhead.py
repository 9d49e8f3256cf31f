"""Host time of one eager call of the entry points, against the GPU time of its kernels (CUDA).

A small call (a decode step at batch 1) is host-bound when its Python wrapper, the op dispatch,
the checks, allocations and launches take longer than its kernels: then neither the benchmark
(do_bench waits on the launch after its L2 flush) nor a user's eager loop sees the kernels' speed.
This measures both sides:

  host us / call  n calls issued while the GPU is still busy with a long sleep queued before them
                  (so no call waits for the GPU and none is timed with it), best of 5 trials
  GPU us / call   the kernels' device time per call under torch.profiler (L2 warm)

    python scripts/host_overhead.py                  # decode B1 / B64 at 8k, flash_attn_func N=128
    python scripts/host_overhead.py --calls 50 --trials 9

docs/PERF_NOTES.md (2026-12-04, fourteenth session) has the measurements that motivated it.
"""

import argparse
import time

import torch

import flash_attn_ext


def host_us(fn, calls, trials):
    """Best-of-trials host microseconds per call of fn(), each trial issued behind ~4 ms of GPU sleep."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(trials):
        torch.cuda._sleep(8_000_000)  # ~4 ms at 2 GHz: the launches queue behind it
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def gpu_us(fn, calls=50):
    """Device microseconds of fn()'s kernels per call (torch.profiler, L2 warm)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / calls


def cases(dtype):
    d, heads, heads_k = 128, 32, 8
    out = {}
    for b in (1, 64):
        n = 8192
        q = torch.randn(b, 1, heads, d, device="cuda", dtype=dtype)
        kc = torch.randn(b, n, heads_k, d, device="cuda", dtype=dtype)
        vc = torch.randn_like(kc)
        seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        out[f"flash_attn_with_kvcache B{b} Nk {n}"] = (
            lambda q=q, kc=kc, vc=vc, s=seqlens: flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=s))
        op = torch.ops.flash_attn_ext.fwd_kvcache
        out[f"  the op alone B{b}"] = (
            lambda q=q, kc=kc, vc=vc, s=seqlens: op(q, kc, vc, None, None, s, None, d ** -0.5, False, 0, -1, -1, None))
    x = torch.randn(1, 128, heads, d, device="cuda", dtype=dtype)
    out["flash_attn_func B1 N 128"] = lambda: flash_attn_ext.flash_attn_func(x, x, x)
    y = torch.randn(1, 128, heads, d, device="cuda", dtype=dtype)
    out["  torch.add (one launch, reference)"] = lambda: torch.add(y, 1.0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=100, help="calls per trial (queued behind the sleep)")
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_overhead.py needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us per call")
    print(f"{'call':40s} {'host':>8s} {'GPU':>8s}")
    for name, fn in cases(torch.bfloat16).items():
        h = host_us(fn, args.calls, args.trials)
        g = gpu_us(fn)
        print(f"{name:40s} {h:8.1f} {g:8.1f}", flush=True)
    print("host > GPU: an eager loop of such calls runs at the host's pace (capture it in a CUDA graph)")


if __name__ == "__main__":
    main()
