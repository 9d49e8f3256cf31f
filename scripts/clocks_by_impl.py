"""SM clock and board power during each implementation's timing: the benchmark's results joined with
an nvidia-smi log.

Sustained tensor-core work can hold an H200 at its power limit, where the SM clock drops (the
sweeps' clocks.csv has read 1,635-1,980 MHz at 580-700 W). Two implementations timed under
different clocks differ by more than their kernels: this script says whether a few-percent ratio
came with a clock difference.

    python scripts/clocks_by_impl.py gpu_out/bench gpu_out/clocks.csv [--peer flash-attn4]

bench: a benchmark --out folder (results.csv with timed_from / timed_to, flash_attn_ext.bench.timing);
clocks: `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits
-lms 200` (what scripts/gpu_run.sh writes while the sweeps run), on the same machine (local time).

Prints, per implementation, the median over its rows of each row's median SM MHz and mean W; with
--peer, per case ours' speed over the peer's (the inverse ratio of their median times) next to both
implementations' MHz (and their ratio) and W. A row whose timing window holds no sample takes the
sample nearest its middle (within 0.5 s), else stays out.
"""

import argparse
import sys

import pandas as pd

OURS = "flash_attn_ext"
FMT = "%Y/%m/%d %H:%M:%S.%f"


def read_clocks(path):
    """clocks.csv -> DataFrame(t, mhz, watts), sorted by time."""
    df = pd.read_csv(path, header=None, names=["t", "mhz", "watts", "temp"], skipinitialspace=True)
    df["t"] = pd.to_datetime(df["t"].astype(str).str.strip(), format=FMT)
    return df.sort_values("t").reset_index(drop=True)


def join(results, clocks, slack_s=0.5):
    """results with columns mhz / watts: each row's samples within [timed_from, timed_to]."""
    rows = results.dropna(subset=["timed_from", "timed_to"]).copy()
    t0 = pd.to_datetime(rows["timed_from"], format=FMT)
    t1 = pd.to_datetime(rows["timed_to"], format=FMT)
    mhz, watts = [], []
    for a, b in zip(t0, t1):
        inside = clocks[(clocks["t"] >= a) & (clocks["t"] <= b)]
        if inside.empty:
            mid = a + (b - a) / 2
            gap = (clocks["t"] - mid).abs()
            inside = clocks[gap == gap.min()] if len(gap) and gap.min() <= pd.Timedelta(seconds=slack_s) else inside
        mhz.append(inside["mhz"].median() if not inside.empty else float("nan"))
        watts.append(inside["watts"].mean() if not inside.empty else float("nan"))
    rows["mhz"], rows["watts"] = mhz, watts
    return rows


def per_impl(rows):
    """Median over each implementation's rows (per mode) of the rows' MHz and W."""
    return rows.groupby(["mode", "impl"])[["mhz", "watts"]].median().round(0)


def versus(rows, peer):
    """Per case (those both have): ours' speed over the peer's, both MHz, their ratio, both W."""
    keys = [k for k in ("dtype", "hdim", "causal", "seqlen", "batch", "seqlen_k", "page_size", "mode")
            if k in rows.columns]
    wide = rows.pivot_table(index=keys, columns="impl", values=["mhz", "watts", "ms"], aggfunc="first", dropna=False)
    if (("mhz", OURS) not in wide.columns) or (("mhz", peer) not in wide.columns):
        return None
    out = pd.DataFrame({"speed ours / peer": wide[("ms", peer)] / wide[("ms", OURS)],
                        "mhz ours": wide[("mhz", OURS)], f"mhz {peer}": wide[("mhz", peer)],
                        "mhz ratio": wide[("mhz", OURS)] / wide[("mhz", peer)],
                        "W ours": wide[("watts", OURS)], f"W {peer}": wide[("watts", peer)]})
    return out.dropna(how="all").round(3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", help="the benchmark's --out folder (results.csv)")
    ap.add_argument("clocks", help="nvidia-smi log (timestamp, clocks.sm, power.draw, temperature.gpu)")
    ap.add_argument("--peer", default=None, help="also print ours / this peer per case")
    args = ap.parse_args(argv)
    results = pd.read_csv(f"{args.bench}/results.csv", keep_default_na=False, na_values=[""])
    if "timed_from" not in results.columns:
        sys.exit(f"{args.bench}/results.csv has no timed_from / timed_to columns (a benchmark from before them)")
    rows = join(results, read_clocks(args.clocks))
    if rows["mhz"].isna().all():
        sys.exit("no clock sample falls in any timing window (different machines or clocks?)")
    print("median SM MHz / board W while each implementation was timed (median over its rows):")
    print(per_impl(rows).to_string())
    if args.peer:
        table = versus(rows, args.peer)
        if table is None:
            sys.exit(f"no rows of both {OURS} and {args.peer}")
        print(f"\nper case, ours against {args.peer}:")
        print(table.to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
