"""Forward speed per clock and per joule under sustained load: ours against peers (CUDA + NVML).

The benchmark's long sweeps run the H200 at its 700 W board limit, where the SM clock follows
power (1,600-1,800 MHz instead of 1,980): a speed ratio then mixes two things, the work done per
clock cycle (the kernel's schedule) and the clock the kernel's power draw leaves. This runs each
implementation back to back for a few seconds at a time (after a warm-up of the same length) and
reads the board's energy counter and SM clock through NVML (libnvidia-ml, by ctypes):

    TFLOP/s   W   MHz   TFLOP/J   TFLOP/s per GHz

    python scripts/sustained_power.py                               # hd 64 / 128, N = 8k, both causal
    python scripts/sustained_power.py --hdim 64 --seqlen 16384 --causal true --peers flash-attn4,sdpa-cudnn

Shapes as the benchmark's: bf16 BSHD, 16k tokens per call (batch = 16384 / N), 2048 / hdim heads.
Each implementation runs twice, alternated (A B A B), so a drift of the board's temperature shows.
docs/PERF_NOTES.md (2026-12-04, fifteenth session) has what it measured.
"""

import argparse
import ctypes
import time

import torch

from flash_attn_ext.bench.peers import ALL_PEERS, build_impls


class Nvml:
    """The board's energy counter (mJ) and SM clock (MHz) of torch's current GPU, found by its PCI
    bus id (NVML's indices ignore CUDA_VISIBLE_DEVICES)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise SystemExit("NVML: nvmlInit_v2 failed")
        self.handle = ctypes.c_void_p()
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        bus_id = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0".encode()
        if self.lib.nvmlDeviceGetHandleByPciBusId_v2(ctypes.c_char_p(bus_id), ctypes.byref(self.handle)) != 0:
            print(f"NVML: no GPU at PCI bus id {bus_id.decode()}; reading NVML's GPU 0")
            if self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle)) != 0:
                raise SystemExit("NVML: no GPU 0")

    def energy_mj(self) -> int:
        e = ctypes.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(e)) != 0:
            raise SystemExit("NVML: this GPU has no energy counter")
        return e.value

    def sm_mhz(self) -> int:
        c = ctypes.c_uint()
        self.lib.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(c))  # NVML_CLOCK_SM
        return c.value


def sustained(fn, nvml: Nvml, seconds: float):
    """Calls of fn() for `seconds` (synchronized every 10): (calls, seconds, joules, mean SM MHz)."""
    calls, clocks = 0, []
    torch.cuda.synchronize()
    e0, t0 = nvml.energy_mj(), time.perf_counter()
    while True:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
        clocks.append(nvml.sm_mhz())
        if time.perf_counter() - t0 > seconds:
            break
    return calls, time.perf_counter() - t0, (nvml.energy_mj() - e0) / 1e3, sum(clocks) / len(clocks)


def implementations(peers):
    """name -> fn(q, k, v, causal): ours first, then the peers, through the benchmark's own
    wrappers (flash_attn_ext.bench.peers: build_impls), each inside its context (SDPA's backend)."""
    impls, notes = build_impls(peers, torch.device("cuda"), None)
    for note in notes:
        print(note)

    def call(impl):
        def fn(q, k, v, causal):
            with impl.context():
                return impl.fn(q, k, v, q.shape[-1] ** -0.5, causal)
        return fn

    return {impl.name: call(impl) for impl in impls}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdim", default="64,128")
    ap.add_argument("--seqlen", default="8192")
    ap.add_argument("--causal", default="both", choices=("true", "false", "both"))
    ap.add_argument("--peers", default="flash-attn4", help=f"comma-separated, of {', '.join(ALL_PEERS)}")
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per run (after as many of warm-up)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sustained_power.py needs a CUDA GPU")
    nvml = Nvml()
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in ALL_PEERS]
    if unknown:
        raise SystemExit(f"unknown peers {unknown} (known: {', '.join(ALL_PEERS)})")
    impls = implementations(peers)
    causals = {"true": [True], "false": [False], "both": [False, True]}[args.causal]
    torch.manual_seed(0)
    print(f"{'case':28s} {'impl':14s} {'TFLOP/s':>8s} {'W':>5s} {'MHz':>5s} {'TFLOP/J':>8s} {'per GHz':>8s}")
    for d in (int(x) for x in args.hdim.split(",")):
        for n in (int(x) for x in args.seqlen.split(",")):
            b, h = max(16384 // n, 1), 2048 // d
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for causal in causals:
                flop = 4 * b * h * n * n * d / (2 if causal else 1)
                for name in list(impls) * 2:  # A B A B
                    fn = lambda f=impls[name]: f(q, k, v, causal)
                    sustained(fn, nvml, args.seconds)
                    calls, secs, joules, mhz = sustained(fn, nvml, args.seconds)
                    tflops = flop * calls / secs / 1e12
                    print(f"{f'd{d} N{n} B{b} H{h} causal={causal}':28s} {name:14s} {tflops:8.1f} "
                          f"{joules / secs:5.0f} {mhz:5.0f} {flop * calls / joules / 1e12:8.3f} "
                          f"{tflops / mhz * 1000:8.1f}", flush=True)


if __name__ == "__main__":
    main()
