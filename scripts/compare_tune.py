"""Speed of two source trees' kernels from benchmarks/tune_kernels.py runs made in one GPU session
(scripts/gpu_ab_tune.sh writes them: old1, new1, old2, new2, ... alternated).

    python scripts/compare_tune.py --old o1.txt,o2.txt --new n1.txt,n2.txt

Dense kinds only (the lines `hdim causal N kind variant... ms TFLOP/s maxdiff`). Each side's
TFLOP/s is the mean over its runs; printed per (kind, variant, hdim, causal, N): both sides' runs,
new/old, and a summary of new/old per (kind, hdim) over N <= 2048 and N >= 4096 (per-tile costs
show at short N), then min / median / max over all cells. A new maxdiff other than the old one is
flagged: the two trees should compute the same thing.
"""

import argparse
import statistics
from collections import defaultdict


def load(path):
    """{(kind, variant, hdim, causal, N): (tflops, maxdiff)} of one tune_kernels.py output."""
    cells = {}
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) < 9 or p[0] == "hdim" or not p[0].isdigit() or p[3] not in ("fwd", "dkv", "dq"):
                continue
            key = (p[3], " ".join(p[4:-3]), int(p[0]), p[1], int(p[2]))
            cells[key] = (float(p[-2]), p[-1])
    return cells


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="comma list of tune_kernels.py outputs of the old tree")
    ap.add_argument("--new", required=True, help="comma list of tune_kernels.py outputs of the new tree")
    args = ap.parse_args()
    old = [load(p) for p in args.old.split(",")]
    new = [load(p) for p in args.new.split(",")]
    keys = sorted(set.intersection(*(set(r) for r in old + new)))
    if not keys:
        raise SystemExit("no cell common to every run")
    ratios, groups = [], defaultdict(list)
    print(f"{'kind':5} {'variant':28} {'hd':>4} {'causal':6} {'N':>6}  {'old TFLOP/s':>15}  {'new TFLOP/s':>15}  new/old")
    for k in keys:
        o = [r[k][0] for r in old]
        n = [r[k][0] for r in new]
        ratio = statistics.mean(n) / statistics.mean(o)
        ratios.append(ratio)
        groups[(k[0], k[2], "N<=2k" if k[4] <= 2048 else "N>=4k")].append(ratio)
        flag = "" if new[0][k][1] == old[0][k][1] else f"  maxdiff {old[0][k][1]} -> {new[0][k][1]}"
        print(f"{k[0]:5} {k[1][:28]:28} {k[2]:4} {k[3]:6} {k[4]:6}  {' '.join(f'{x:7.1f}' for x in o):>15}  "
              f"{' '.join(f'{x:7.1f}' for x in n):>15}  {ratio:.3f}{flag}")
    print("\nmean new/old per (kind, hdim):")
    for g in sorted(groups):
        print(f"  {g[0]:4} hd{g[1]:<4} {g[2]}: {statistics.mean(groups[g]):.3f} over {len(groups[g])} cells")
    print(f"\nall {len(ratios)} cells: min {min(ratios):.3f}, median {statistics.median(ratios):.3f}, "
          f"max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
