"""A model of the sm90 varlen forward's dynamic walk on skewed lengths (a diagnostic, no GPU): the
walk's units (every real Q tile of every head; common/tile_scheduler.cuh, dynamic) go in claim
order to the CTA that frees first, as CTAs claim from the counter; a tile costs its key blocks plus
`--overhead` of a block (prologue, epilogue). Prints, per (hdim, causal), the makespan over the
ideal (total cost / CTAs) for three orders: claim order as the tight grid numbers the tiles today
(sequence order), sequences in four key-length buckets longest first (branch
exp/varlen-lpt-buckets: common/work.cuh, varlen_lpt_index), and longest-processing-time first.
Lengths: the benchmark's (flash_attn_ext.bench.problems.mixed_lengths), averaged over --seeds.
Tile rows mirror csrc/kernels/sm90/tile_config.h as dispatched at these lengths. --pass dkv / dq:
the backward's tight grids instead (one CTA per tile, which the hardware dispatches in index
order: the same list model over --ctas slots, e.g. 264 for two CTAs per SM; a dK/dV tile costs its
Q blocks, a dQ tile its key blocks).

    python scripts/varlen_walk_model.py [--seqs 64 --tokens 16384 --lens 128,1024 --seeds 6]
    python scripts/varlen_walk_model.py --pass dkv --ctas 264
"""
import argparse
import heapq
import statistics

from flash_attn_ext.bench.problems import mixed_lengths

# (kBlockM, kBlockN) per (hdim, causal): FwdTile, and FwdShortTile for causal d128 / d256 at
# max_seqlen_q <= 2048 (kFwdShortCausalMaxSeqlen).
TILES = {(64, False): (192, 128), (64, True): (192, 128), (128, False): (128, 128), (128, True): (192, 64),
         (256, False): (128, 80), (256, True): (128, 64)}
# Backward (kBlockN, kBlockM) of DkvTile and (kBlockM, kBlockN) of DqTile per hdim (d128's dQ:
# DqShortTile's 64 x 64 for packs of at most 512 (causal) / 256 queries and keys per sequence on
# average, e.g. the default 64 sequences of 128..1024 in 16k tokens; DqTile's 128 x 128 otherwise,
# which this table does not follow: a pack with a larger mean runs 128 x 128 there).
DKV_TILES = {64: (64, 128), 128: (64, 64), 256: (64, 64)}
DQ_TILES = {64: (64, 64), 128: (64, 64), 256: (64, 64)}
BUCKETS = 4


def _ceil(a, b):
    return -(-a // b)


def units(lens, heads, block_m, block_n, causal, overhead):
    """(cost, sequence) of every unit in the tight grid's claim order: sequences in order, each
    sequence's tiles last first (heavy first under causal, its partial tile at the top), heads of a
    tile together."""
    out = []
    for s, n in enumerate(lens):
        shift = (block_m - n % block_m) // 64 * 64 if causal and n % block_m else 0
        for j in range(_ceil(n, block_m) - 1, -1, -1):
            m0 = j * block_m - shift
            rows = min(block_m, n - m0)
            blocks = _ceil(m0 + rows, block_n) if causal else _ceil(n, block_n)
            out += [(blocks + overhead, s)] * heads
    return out


def dkv_units(lens, heads, block_n, block_m, causal, overhead):
    """(cost, sequence) of the dK/dV kernel's tiles in grid order: each sequence's key tiles in
    order, a tile costing the Q blocks that see it."""
    out = []
    for s, n in enumerate(lens):
        for j in range(_ceil(n, block_n)):
            blocks = _ceil(n, block_m) - (j * block_n // block_m if causal else 0)
            out += [(blocks + overhead, s)] * heads
    return out


def dq_units(lens, heads, block_m, block_n, causal, overhead):
    """(cost, sequence) of the dQ kernel's tiles in grid order (last tile first)."""
    out = []
    for s, n in enumerate(lens):
        for j in range(_ceil(n, block_m) - 1, -1, -1):
            m0 = j * block_m
            blocks = _ceil(min(m0 + block_m, n), block_n) if causal else _ceil(n, block_n)
            out += [(blocks + overhead, s)] * heads
    return out


def makespan(costs, ctas):
    free = [(0.0, c) for c in range(ctas)]
    for cost in costs:
        t, c = heapq.heappop(free)
        heapq.heappush(free, (t + cost, c))
    return max(t for t, _ in free)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--lens", default="128,1024", help="LO,HI of the sequence lengths")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--ctas", type=int, default=132, help="the persistent grid (the H200's SMs)")
    ap.add_argument("--overhead", type=float, default=0.7, help="a tile's fixed cost, in key blocks")
    ap.add_argument("--pass", dest="kernel", default="fwd", choices=["fwd", "dkv", "dq"])
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.lens.split(","))
    print("hdim causal  claim  buckets  lpt   (makespan / ideal, mean over seeds)")
    for (hdim, causal), (block_m, block_n) in TILES.items():
        rows = []
        for seed in range(args.seeds):
            lens = mixed_lengths(args.seqs, args.tokens, lo, hi, seed=seed)
            if args.kernel == "fwd":
                us = units(lens, 2048 // hdim, block_m, block_n, causal, args.overhead)
            elif args.kernel == "dkv":
                us = dkv_units(lens, 2048 // hdim, *DKV_TILES[hdim], causal, args.overhead)
            else:
                us = dq_units(lens, 2048 // hdim, *DQ_TILES[hdim], causal, args.overhead)
            ideal = sum(c for c, _ in us) / args.ctas
            longest = max(lens)
            bucket = [0 if n == 0 else min(BUCKETS - 1, (n - 1) // _ceil(longest, BUCKETS)) for n in lens]
            by_bucket = sorted(us, key=lambda u: -bucket[u[1]])  # stable: sequence order inside a bucket
            rows.append([makespan([c for c, _ in order], args.ctas) / ideal
                         for order in (us, by_bucket, sorted(us, reverse=True))])
        claim, buckets, lpt = (statistics.mean(x) for x in zip(*rows))
        print(f"{hdim:4} {str(causal):6} {claim:6.3f} {buckets:7.3f} {lpt:6.3f}")


if __name__ == "__main__":
    main()
