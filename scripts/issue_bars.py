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
these on the H200: the device of each run is printed, runs of different GPUs are refused (their
cells would pool), and verdicts from another GPU than the H200 are marked so. Only the issues'
configuration counts: dense rows of 16384 tokens (batch x seqlen) and 2048 / hdim heads without GQA,
decode rows of bf16, GQA 32:8 against a full cache (fill 1.0: a --decode-fill < 1 run's ragged rows
read fewer bytes and are another problem; a column a run lacks does not filter). A cell where ours
failed (status error or OOM) in a run FAILs; a peer's failure leaves its cells not measured. A cell
where ours' error exceeds twice standard attention's in the same run (the accuracy rule, on a slice
of the benchmark's timed call; only where the run has an ok row of the `standard` peer) is WRONG,
whatever its speed.
Several runs of one cell (rounds, repeated sweeps): their median.
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


FAILED_STATUSES = ("error", "OOM")  # ours' statuses that fail a cell (n/a, skipped: not measured)
ERR_FACTOR = 2.0  # the accuracy rule: ours' error <= 2 x standard attention's in the inputs' dtype
ERR_ATOL = 1e-3   # slack for cells where standard attention happens to be near exact


def load(dirs):
    """The rows of the runs in `dirs` in the issues' configuration (anchor): every ok row, and ours'
    failed ones (error, OOM: a FAILED cell); and each run's device name ("dir: name")."""
    frames, devices = [], []
    for d in dirs:
        df = pd.read_csv(os.path.join(d, "results.csv"))
        failed = (df["impl"] == OURS) & df["status"].isin(FAILED_STATUSES)
        frames.append(anchor(df[(df["status"] == "ok") | failed]))
        env_path = os.path.join(d, "results.json")
        if os.path.exists(env_path):
            with open(env_path) as f:
                env = json.load(f).get("environment", {})
            devices.append(f"{d}: {env.get('device_name') or env.get('device', '?')}")
    return pd.concat(frames, ignore_index=True), devices


def anchor(df):
    """The rows of the issues' configuration: dense (fwd / bwd) rows of 16384 tokens, 2048 / hdim
    heads, no GQA; decode rows of bf16, GQA 32:8 and a full cache (fill 1.0, --decode-fill). A column the
    run lacks (or leaves empty: runs before --decode-fill had full caches only) keeps the row."""
    def num(col):
        return pd.to_numeric(df[col], errors="coerce") if col in df else pd.Series(float("nan"), index=df.index)

    def ok(cond, col_values):
        return cond | col_values.isna()

    mode = df["mode"].astype(str) if "mode" in df else pd.Series("", index=df.index)
    dense, dec = mode.isin(["fwd", "bwd", "fwd_bwd"]), mode == "decode"
    gqa, batch, seqlen, nheads, nheads_k, hdim, fill = (num(c) for c in ("gqa", "batch", "seqlen", "nheads",
                                                                         "nheads_k", "hdim", "fill"))
    keep = (~dense | (ok(gqa == 1, gqa) & ok(batch * seqlen == 16384, batch * seqlen)
                      & ok(nheads * hdim == 2048, nheads * hdim)))
    dtype = df["dtype"].astype(str) if "dtype" in df else pd.Series("bf16", index=df.index)
    keep &= ~dec | (ok(nheads == 32, nheads) & ok(nheads_k == 8, nheads_k) & ok(fill == 1.0, fill)
                    & (dtype == "bf16"))
    return df[keep]


def mark_wrong(df):
    """df with a bool column `wrong`: on ours' rows of a case (its keys as the CSV spells them)
    where ours' error is above ERR_FACTOR x standard attention's + ERR_ATOL in the same rows' data;
    False where a run has no error column or no standard row."""
    df = df.assign(wrong=False)
    if "err" not in df or "standard" not in set(df["impl"]):
        return df
    keys = [k for k in ("mode", "dtype", "hdim", "causal", "gqa", "seqlen", "batch", "nheads", "nheads_k",
                        "seqlen_k", "fill", "page_size") if k in df]
    spelled = df[keys].astype(str).apply(tuple, axis=1)
    err = pd.to_numeric(df["err"], errors="coerce")
    std = err[df["impl"] == "standard"].groupby(spelled[df["impl"] == "standard"]).max()
    limit = spelled.map(std) * ERR_FACTOR + ERR_ATOL
    df["wrong"] = (df["impl"] == OURS) & (err > limit)
    return df


def _speed(df, impl, metric, **keys):
    """The median of `metric` over impl's ok rows of the cell `keys` (None if none), "FAILED" where
    one of ours' rows there failed (load: error, OOM), or "WRONG" where one of them failed the
    accuracy rule (mark_wrong)."""
    sel = _select(df, impl, **keys)
    if sel is None:
        return None
    if "status" in sel and (sel["status"] != "ok").any():
        return "FAILED"
    if "wrong" in sel and sel["wrong"].any():
        return "WRONG"
    vals = sel[metric].dropna()
    return float(vals.median()) if len(vals) else None


def _select(df, impl, **keys):
    sel = df[df["impl"] == impl]
    for k, v in keys.items():
        if k not in sel:
            return None
        if isinstance(v, (int, float)) and not isinstance(v, bool):  # a contiguous cache's page size: 0 or empty
            col = pd.to_numeric(sel[k], errors="coerce")
            sel = sel[(col.fillna(0) if k == "page_size" else col) == v]
        else:  # strings and bools, as the CSV spells them
            sel = sel[sel[k].astype(str) == str(v)]
    return sel


def _cell(rows, issue, cell, ours, peer=None, ratio_bar=None, bar=None):
    """One row: ours against a peer's speed (ours / peer >= ratio_bar) or an absolute bar; WRONG
    where ours failed the accuracy rule in the cell (no speed counts then)."""
    if ours == "WRONG":
        rows.append((issue, cell, "-", "-", "-", "WRONG (error above 2x standard attention's)"))
    elif ours == "FAILED":
        rows.append((issue, cell, "-", "-", "-", "FAIL (ours: error or OOM in a run)"))
    elif ours is None or (ratio_bar is not None and (peer is None or isinstance(peer, str))):  # peer FAILED too
        rows.append((issue, cell, "-", "-", "-", "not measured"))
    elif ratio_bar is not None:
        ratio = ours / peer
        rows.append((issue, cell, f"{ours:.2f}", f"{peer:.2f}", f"{ratio:.3f}", "PASS" if ratio >= ratio_bar else "FAIL"))
    else:
        rows.append((issue, cell, f"{ours:.2f}", f">= {bar}", f"{ours / bar:.3f}", "PASS" if ours >= bar else "FAIL"))


def bars(df):
    """The rows (issue, cell, ours, bar or peer, ratio, verdict) of every cell the issues name."""
    rows = []
    df = mark_wrong(df)
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
                seqlens = fwd[fwd["hdim"] == hdim]["seqlen"].dropna() if "seqlen" in fwd else ()
                ns = sorted({int(n) for n in seqlens if n >= 1024}) or [1024]
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
    names = {line.split(": ", 1)[1] for line in devices}
    for line in devices:
        print("device of", line)
    if len(names) > 1:
        print(f"runs of different GPUs ({', '.join(sorted(names))}) would pool into one cell: pass one GPU's runs")
        return 2
    if names and not any("H200" in n for n in names):
        print("NOTE: the issues ask for the H200; these verdicts are of another GPU")
    table = bars(df)
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
