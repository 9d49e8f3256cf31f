"""Speed of two builds of flash_attn_ext from benchmark runs made in one GPU session
(python -m flash_attn_ext.benchmark --out DIR ...; results.csv in each DIR).

    python scripts/compare_runs.py --old A1,A2 --new B1,B2 [--peer sdpa-flash]

Each side may list several runs (interleaved old/new runs show the noise): a side's speed (TFLOP/s;
decode rows TB/s) is the median over its runs. Prints new/old of ours per (dtype, hdim, causal,
case, mode), the spread of
each side (max/min over its runs) and, with --peer, the same ratio for the peer (the same code in
both runs: it shows how much the machine itself drifted).
"""

import argparse
import os

import pandas as pd

KEYS = ["dtype", "hdim", "causal", "case", "config", "mode"]
# The rest of a case's configuration, so GQA variants, token counts and head counts of one
# (dtype, hdim, causal, seqlen) stay apart instead of pooling into one median.
CONFIG_COLUMNS = ["gqa", "batch", "nheads", "nheads_k", "tokens", "n_seqs", "min_len"]


def load(dirs, impl):
    """Median and spread (max / min) over `dirs` of impl's speed per case: TFLOP/s of dense and
    varlen rows (a varlen case named by its longest sequence, a dense one by its seqlen), TB/s of
    decode rows (a case named by batch, cache length, page size and, for CUDA graph replays,
    "graph", for a ragged cache (--decode-fill < 1) "fill F"; causal "-")."""
    frames = []
    for i, d in enumerate(dirs):
        df = pd.read_csv(os.path.join(d, "results.csv"))
        df = df[(df["impl"] == impl) & (df["status"] == "ok")].copy()
        mode = df["mode"].astype(str)
        decode, varlen = mode == "decode", mode.str.startswith("varlen")
        case = df["seqlen"].astype("Int64").astype(str) if "seqlen" in df else pd.Series("", index=df.index)
        if varlen.any():  # varlen rows (ours and the dense comparison row): keyed by the longest sequence
            case[varlen] = df.loc[varlen, "max_len"].astype("Int64").astype(str)
        speed = df["tflops"].copy() if "tflops" in df else pd.Series(float("nan"), index=df.index)
        if decode.any():
            dec = df[decode]
            case[decode] = ("B" + dec["batch"].astype("Int64").astype(str) + " Nk" + dec["seqlen_k"].astype("Int64").astype(str)
                            + " page" + dec["page_size"].fillna(0).astype("Int64").astype(str))
            if "timing" in dec:  # CUDA graph replays (--decode-graph) are another case than eager calls
                case[decode] += dec["timing"].map(lambda t: " graph" if t == "graph" else "")
            if "fill" in dec:  # a ragged cache (--decode-fill < 1) is another case than a full one
                fill = pd.to_numeric(dec["fill"], errors="coerce").fillna(1.0)
                case[decode] += fill.map(lambda f: "" if f == 1.0 else f" fill{f:g}")
            speed[decode] = dec["tbps"]
        causal = df["causal"].astype(str).where(~decode, "-") if "causal" in df else "-"  # sortable with "-"
        config = pd.Series("", index=df.index)
        for col in (c for c in CONFIG_COLUMNS if c in df):
            values = pd.to_numeric(df[col], errors="coerce")
            config += values.map(lambda x, col=col: "" if pd.isna(x) else f"{col}={int(x)} ")
        frames.append(pd.DataFrame({"dtype": df["dtype"], "hdim": df["hdim"], "causal": causal, "case": case,
                                    "config": config.str.strip(), "mode": df["mode"], "speed": speed, "run": i}))
    runs = pd.concat(frames)
    grouped = runs.groupby(KEYS)["speed"]
    return pd.DataFrame({"median": grouped.median(), "spread": grouped.max() / grouped.min()})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="comma list of benchmark output dirs of the old build")
    ap.add_argument("--new", required=True, help="comma list of benchmark output dirs of the new build")
    ap.add_argument("--peer", default=None, help="a peer measured in every run, e.g. sdpa-flash")
    args = ap.parse_args()
    old_dirs, new_dirs = args.old.split(","), args.new.split(",")
    old, new = load(old_dirs, "flash_attn_ext"), load(new_dirs, "flash_attn_ext")
    table = pd.DataFrame({"old": old["median"], "new": new["median"],
                          "new/old": new["median"] / old["median"],
                          "old spread": old["spread"], "new spread": new["spread"]})
    if args.peer:
        table[f"{args.peer} new/old"] = load(new_dirs, args.peer)["median"] / load(old_dirs, args.peer)["median"]
    print(table.round(3).to_string())
    ratio = table["new/old"]
    if ratio.notna().sum() == 0:
        raise SystemExit("compare_runs: no case of flash_attn_ext measured ok on both sides")
    both = int(ratio.notna().sum())
    one_side = f" ({len(ratio) - both} more measured on one side only)" if both < len(ratio) else ""
    print(f"\nnew/old over {both} cases{one_side}: min {ratio.min():.3f}, median {ratio.median():.3f}, "
          f"max {ratio.max():.3f}")


if __name__ == "__main__":
    main()
