"""Speed of two source trees' kernels from benchmarks/tune_kernels.py runs made in one GPU session
(scripts/gpu_ab_tune.sh writes them: old1, new1, old2, new2, ... alternated).

    python scripts/compare_tune.py --old o1.txt,o2.txt --new n1.txt,n2.txt

Dense kinds (the lines `hdim causal N kind variant... ms TFLOP/s maxdiff`) and split-KV decode
steps (the lines `B<b>xN<keys>[xP<page>] variant... splits ms TB/s split_ms comb_ms maxdiff`; a
heuristic split count carries an `h`). Each side's TFLOP/s (TB/s) is the mean over its runs;
printed per cell: both sides' runs, new/old, and a summary of new/old per (kind, hdim) over
N <= 2048 and N >= 4096 (per-tile costs show at short N) or per decode variant, then min / median /
max over all cells. A new maxdiff other than the old one is flagged: the two trees should compute
the same thing (decode steps at a different split count may differ by rounding).
"""

import argparse
import re
import statistics
from collections import defaultdict

DECODE_CASE = re.compile(r"^B\d+xN\d+(xP\d+)?$")


def load(path):
    """{key: (speed, maxdiff)} of one tune_kernels.py output: dense keys (kind, variant, hdim,
    causal, N) with TFLOP/s, decode keys ("decode", variant, case, splits) with TB/s."""
    cells = {}
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) >= 9 and DECODE_CASE.match(p[0]) and p[1] != "splits":  # not the summary lines
                cells[("decode", " ".join(p[1:-6]), p[0], p[-6])] = (float(p[-4]), p[-1])
            elif len(p) >= 9 and p[0].isdigit() and p[3] in ("fwd", "dkv", "dq"):
                cells[(p[3], " ".join(p[4:-3]), int(p[0]), p[1], int(p[2]))] = (float(p[-2]), p[-1])
    return cells


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="comma list of tune_kernels.py outputs of the old tree")
    ap.add_argument("--new", required=True, help="comma list of tune_kernels.py outputs of the new tree")
    args = ap.parse_args()
    old = [load(p) for p in args.old.split(",")]
    new = [load(p) for p in args.new.split(",")]
    keys = set.intersection(*(set(r) for r in old + new))
    if not keys:
        raise SystemExit("no cell common to every run")
    ratios, groups = [], defaultdict(list)

    def row(k):
        o = [r[k][0] for r in old]
        n = [r[k][0] for r in new]
        ratio = statistics.mean(n) / statistics.mean(o)
        ratios.append(ratio)
        flag = "" if new[0][k][1] == old[0][k][1] else f"  maxdiff {old[0][k][1]} -> {new[0][k][1]}"
        runs = f"{' '.join(f'{x:7.2f}' for x in o):>15}  {' '.join(f'{x:7.2f}' for x in n):>15}"
        return ratio, runs, flag

    dense = sorted(k for k in keys if k[0] != "decode")
    decode = sorted(k for k in keys if k[0] == "decode")
    if dense:
        print(f"{'kind':5} {'variant':28} {'hd':>4} {'causal':6} {'N':>6}  {'old TFLOP/s':>15}  {'new TFLOP/s':>15}  new/old")
        for k in dense:
            ratio, runs, flag = row(k)
            groups[(k[0], f"hd{k[2]:<4}", "N<=2k" if k[4] <= 2048 else "N>=4k")].append(ratio)
            print(f"{k[0]:5} {k[1][:28]:28} {k[2]:4} {k[3]:6} {k[4]:6}  {runs}  {ratio:.3f}{flag}")
    if decode:
        print(f"\n{'variant':44} {'case':18} {'splits':>6}  {'old TB/s':>15}  {'new TB/s':>15}  new/old")
        for k in decode:
            ratio, runs, flag = row(k)
            groups[("decode", k[1][:44], "")].append(ratio)
            print(f"{k[1][:44]:44} {k[2]:18} {k[3]:>6}  {runs}  {ratio:.3f}{flag}")
    print("\nmean new/old per (kind, hdim) or decode variant:")
    for g in sorted(groups):
        print(f"  {g[0]:4} {g[1]} {g[2]}: {statistics.mean(groups[g]):.3f} over {len(groups[g])} cells")
    print(f"\nall {len(ratios)} cells: min {min(ratios):.3f}, median {statistics.median(ratios):.3f}, "
          f"max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
