"""The open issues' measured bars from benchmark runs (python -m flash_attn_ext.benchmark --out DIR;
results.csv and results.json in each DIR): every cell an issue's "must show" names, ours against
its bar or peer, PASS / FAIL, and the cells no run measured.

    python scripts/issue_bars.py gpu_out/bench gpu_out/bench_graph [...]

Bars (the issues' text; TFLOP/s at the benchmark's 4 / 2.5x-forward counts, decode TB/s of K + V
read): issue 13, the forward against FlashAttention-4 (flash-attn4) at hdim 64 / 128, causal or not,
every N >= 4k (ratio >= 1.00), and against SDPA cuDNN (sdpa-cudnn) at every N >= 1k, every head dim
and dtype run; issue 14, decode B1 Nk 8k >= 2.0, B1 128k >= 3.9, B8 32k >= 4.2, B64 8k and 32k >= 4.4
(each timing the runs have, eager calls or CUDA graph replays, its own cells), paged (page 16, 64,
256) >= 0.90x contiguous at B1 128k and B64 32k; issue 15, the backward at N = 8k: hdim 128 >= 430
non-causal, >= 400 causal, hdim 64 >= 420, hdim 96 / 192 / 256 >= SDPA cuDNN. The issues ask for
these on the H200: the device of each run is printed, and a cell measured on another GPU is no
verdict on them. Several runs of one cell (rounds, repeated sweeps): their median.
"""

import argparse
import json
import os
import sys

import pandas as pd

OURS = "flash_attn_ext"
DECODE_BARS = {(1, 8192): 2.0, (1, 131072): 3.9, (8, 32768): 4.2, (64, 8192): 4.4, (64, 32768): 4.4}
PAGED_CASES = [(1, 131072), (64, 32768)]
BWD_BARS = {(128, False): 430.0, (128, True): 400.0, (64, False): 420.0, (64, True): 420.0}


def load(dirs):
    """All ok rows of the runs in `dirs`, and each run's device name."""
    frames, devices = [], []
    for d in dirs:
        df = pd.read_csv(os.path.join(d, "results.csv"))
        frames.append(df[df["status"] == "ok"])
        env_path = os.path.join(d, "results.json")
        if os.path.exists(env_path):
            with open(env_path) as f:
                env = json.load(f).get("environment", {})
            devices.append(f"{d}: {env.get('device_name') or env.get('device', '?')}")
    return pd.concat(frames, ignore_index=True), devices


def _speed(df, impl, metric, **keys):
    sel = df[df["impl"] == impl]
    for k, v in keys.items():
        if k not in sel:
            return None
        if isinstance(v, (int, float)) and not isinstance(v, bool):  # a contiguous cache's page size: 0 or empty
            col = pd.to_numeric(sel[k], errors="coerce")
            sel = sel[(col.fillna(0) if k == "page_size" else col) == v]
        else:  # strings and bools, as the CSV spells them
            sel = sel[sel[k].astype(str) == str(v)]
    vals = sel[metric].dropna()
    return float(vals.median()) if len(vals) else None


def _cell(rows, issue, cell, ours, peer=None, ratio_bar=None, bar=None):
    """One row: ours against a peer's speed (ours / peer >= ratio_bar) or an absolute bar."""
    if ours is None or (ratio_bar is not None and peer is None):
        rows.append((issue, cell, "-", "-", "-", "not measured"))
    elif ratio_bar is not None:
        ratio = ours / peer
        rows.append((issue, cell, f"{ours:.2f}", f"{peer:.2f}", f"{ratio:.3f}", "PASS" if ratio >= ratio_bar else "FAIL"))
    else:
        rows.append((issue, cell, f"{ours:.2f}", f">= {bar}", f"{ours / bar:.3f}", "PASS" if ours >= bar else "FAIL"))


def bars(df):
    """The rows (issue, cell, ours, bar or peer, ratio, verdict) of every cell the issues name."""
    rows = []
    dense = df[df["mode"].isin(["fwd", "bwd"])] if "mode" in df else df.iloc[:0]
    dtypes = sorted(dense["dtype"].dropna().unique()) if len(dense) else ["bf16"]
    # Issue 13: the forward.
    for dtype in dtypes:
        for hdim in (64, 128):
            for causal in (False, True):
                for n in (4096, 8192, 16384):
                    k = dict(mode="fwd", dtype=dtype, hdim=hdim, causal=causal, seqlen=n)
                    _cell(rows, 13, f"fwd {dtype} hd{hdim}{' causal' if causal else ''} N={n} / flash-attn4",
                          _speed(dense, OURS, "tflops", **k), _speed(dense, "flash-attn4", "tflops", **k), ratio_bar=1.0)
        fwd = dense[(dense["mode"] == "fwd") & (dense["dtype"] == dtype)]
        for hdim in sorted(set(fwd["hdim"].dropna().astype(int)) | {64, 96, 128, 192, 256}):
            for causal in (False, True):
                ns = sorted({int(n) for n in fwd[fwd["hdim"] == hdim]["seqlen"].dropna() if n >= 1024}) or [1024]
                for n in ns:
                    k = dict(mode="fwd", dtype=dtype, hdim=hdim, causal=causal, seqlen=n)
                    _cell(rows, 13, f"fwd {dtype} hd{hdim}{' causal' if causal else ''} N={n} / sdpa-cudnn",
                          _speed(dense, OURS, "tflops", **k), _speed(dense, "sdpa-cudnn", "tflops", **k), ratio_bar=1.0)
    # Issue 14: decode, per timing.
    dec = df[(df["mode"] == "decode") & (df["hdim"] == 128)] if "mode" in df else df.iloc[:0]  # the issue's hd128
    timings = sorted(dec["timing"].dropna().unique()) if "timing" in dec and len(dec) else ["eager"]
    for timing in timings:
        td = dec[dec["timing"] == timing] if "timing" in dec else dec
        for (b, nk), bar in DECODE_BARS.items():
            _cell(rows, 14, f"decode {timing} B{b} Nk={nk}",
                  _speed(td, OURS, "tbps", batch=b, seqlen_k=nk, page_size=0), bar=bar)
        for b, nk in PAGED_CASES:
            contiguous = _speed(td, OURS, "tbps", batch=b, seqlen_k=nk, page_size=0)
            for page in (16, 64, 256):
                _cell(rows, 14, f"decode {timing} B{b} Nk={nk} page {page} / contiguous",
                      _speed(td, OURS, "tbps", batch=b, seqlen_k=nk, page_size=page), contiguous, ratio_bar=0.90)
    # Issue 15: the backward at N = 8k.
    for dtype in dtypes:
        for (hdim, causal), bar in BWD_BARS.items():
            _cell(rows, 15, f"bwd {dtype} hd{hdim}{' causal' if causal else ''} N=8192",
                  _speed(dense, OURS, "tflops", mode="bwd", dtype=dtype, hdim=hdim, causal=causal, seqlen=8192), bar=bar)
        for hdim in (96, 192, 256):
            for causal in (False, True):
                k = dict(mode="bwd", dtype=dtype, hdim=hdim, causal=causal, seqlen=8192)
                _cell(rows, 15, f"bwd {dtype} hd{hdim}{' causal' if causal else ''} N=8192 / sdpa-cudnn",
                      _speed(dense, OURS, "tflops", **k), _speed(dense, "sdpa-cudnn", "tflops", **k), ratio_bar=1.0)
    return pd.DataFrame(rows, columns=["issue", "cell", "ours", "bar or peer", "ratio", "verdict"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="benchmark output dirs (each with results.csv)")
    ap.add_argument("--all", action="store_true", help="also list the cells no run measured")
    args = ap.parse_args(argv)
    df, devices = load(args.dirs)
    table = bars(df)
    for line in devices:
        print("device of", line)
    shown = table if args.all else table[table["verdict"] != "not measured"]
    if shown.empty:
        print("no cell of the issues' bars in these runs")
        return 0
    print(shown.to_markdown(index=False) if _has_tabulate() else shown.to_string(index=False))
    for issue, group in table.groupby("issue"):
        measured = group[group["verdict"] != "not measured"]
        print(f"issue {issue}: {int((measured['verdict'] == 'PASS').sum())} of {len(measured)} measured cells pass "
              f"({len(group) - len(measured)} not measured)")
    return 0


def _has_tabulate():
    try:
        import tabulate  # noqa: F401  (pandas' to_markdown needs it)
        return True
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
