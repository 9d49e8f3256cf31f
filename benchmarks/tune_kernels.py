"""Compare tile configs of the CUDA kernels on the GPU in one call (no torch needed).

    python benchmarks/tune_kernels.py [--arch 90a] [--seqlen 1024,4096,16384] [VARIANT ...]
    python benchmarks/tune_kernels.py [--splits 0,16,48] [--cases B1xN8192,B64xN32768xP16] splitkv:128:... ...

A VARIANT is KIND:HDIM:ARGS with KIND fwd, dkv, dq (sm80 path), dkv90, dq90 (sm90 wgmma path,
--arch 90a only) or splitkv (the KV-cache split-KV forward) and ARGS the kernel's template arguments:
    fwd:128:128,32,4,false,2     FwdTileShape<BLOCK_M, BLOCK_N, warps, Q-in-regs, min CTAs/SM>
    dkv:128:64,128,1             DkvTileShape of BLOCK_M, BLOCK_N, colsplit[, warp rows[, fast copy 0|1]]
    dq:128:128,64                DqTileShape<BLOCK_M, BLOCK_N[, warp rows[, fast copy 0|1]]>
    dkv90:128:64,128             sm90 DkvTileShape of BLOCK_M, BLOCK_N[, split[, roles 0|1[, tma 0|1[, stages[,
                                 diet]]]]] (diet: bits 1 DpInS, 2 PSmem, 4 rounded P^T in dS^T, default 0;
                                 d96's production rows: 64,192,1,0,1,2,3 and 64,64,1,0,1,2,4)
    dq90:128:128,64              sm90 DqTileShape<BLOCK_M, BLOCK_N[, roles 0|1[, tma 0|1[, stages[, min
                                 CTAs/SM]]]]> (roles 1: the Roles<> kernels,
                                 flash_bwd_{dkv,dq}_roles_kernel.cuh, 64 x 64 tiles; tma 0: the
                                 cp.async loads on dense inputs too, default 1; stages: of the TMA
                                 ring, 2 or more, default 2; the roles kernels take 2 only and refuse
                                 others at compile time; min CTAs/SM: __launch_bounds__, default 1,
                                 production d64 3)
    fwd90:128:128,128            sm90 forward FwdTileShape of BLOCK_M (64 rows per consumer
                                 warpgroup), BLOCK_N (a wgmma width: 64..176, csrc/primitives/gen_wgmma.py)
    splitkv:128:64,4,2,3         SplitKvTileShape of BLOCK_N, warps, stages, min CTAs/SM[, Q-in-regs
                                 0|1[, evict-first 0|1 (default 1)[, TMA 0|1 (default 0)]]]
(csrc/kernels/common/tile_shapes.h; the rows of csrc/kernels/<arch>/tile_config.h)
splitkv variants run decode steps instead of the dense problems (GQA --heads, one query, a full
cache of --cases, contiguous or paged xP<page>), timing split kernel + combine with the L2 flushed
before each call (FLASH_TUNE_FLUSH: zero, the default, a 256 MB memset like the benchmark's; read, a
256 MB read, so L2 holds clean lines; none), at each split count of --splits (0: the heuristic of the variant's row,
csrc/kernels/common/splitkv_heuristic.h); one head dim per run; last, a summary table of TB/s.
The first variant of each (output, hdim) is the reference the others' outputs are checked against
(fwd and fwd90 both write O, dkv and dkv90 dK, dq and dq90 dQ; put the production row of tile_config.h first, and
a fwd variant of each hdim: it makes the backward inputs). One translation unit per variant is compiled
in parallel (benchmarks/tune_kernels.cu), then the binary prints one line per (problem, variant).
Dense timings are short (~18 calls) and so run at the boost clock; --sustain MS [--rounds R] times
each point after MS ms of back-to-back calls instead, as the benchmark's sweeps and training runs
load the board (at its power limit, where the clock follows each config's power), printing the SM
clock, board power and TFLOP/s per GHz of every round and each variant's medians.
"""

import argparse
import concurrent.futures as cf
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "benchmarks", "tune_kernels.cu")
# Values of the optional template arguments the .cu side does not default itself (sm90 backward:
# split 1, roles 0, tma 1, stages 2, diet 0; dq: roles 0, tma 1, stages 2).
DEFAULTS = {"dkv90": ["", "", "1", "0", "1", "2", "0"], "dq90": ["", "", "0", "1", "2", "1"]}
KINDS = {"fwd": 0, "dkv": 1, "dq": 2, "fwd90": 0, "dkv90": 1, "dq90": 2, "splitkv": 3}  # kind -> output compared
DEFAULT = [
    "fwd:64:128,64,4,false,2", "fwd:128:128,32,4,false,2",
    "dkv:64:64,128,1", "dq:64:128,128", "dkv:128:64,128,1", "dq:128:128,64",
]


def nvcc():
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return os.path.join(home, "bin", "nvcc") if os.path.exists(os.path.join(home, "bin", "nvcc")) else "nvcc"


def flags(arch):
    return ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "-I" + os.path.join(ROOT, "csrc"),
            f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def variant_defines(spec):
    # No commas inside -D values: nvcc splits option values at commas.
    kind, hdim, args = spec.split(":")
    a = args.split(",")
    n_args = {"fwd": (5, 5), "dkv": (3, 5), "dq": (2, 4), "fwd90": (2, 2), "dkv90": (2, 7), "dq90": (2, 6),
              "splitkv": (4, 7)}[kind]
    if not n_args[0] <= len(a) <= n_args[1]:  # (required, allowed)
        sys.exit(f"variant {spec}: {kind} takes {n_args[0]} to {n_args[1]} template arguments")
    a += DEFAULTS.get(kind, [])[len(a):]  # the optional arguments a kind's registrar takes as given
    defs = ["-DTUNE_VARIANT", f"-DKIND={KINDS[kind]}", f"-DHD={hdim}"]
    if kind.endswith("90"):
        defs.append("-DTUNE_SM90")
    return defs + [f"-DA{i + 1}={x}" for i, x in enumerate(a)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="90a")
    ap.add_argument("--seqlen", default="1024,4096,16384")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--splits", default=None, help="splitkv: comma list of num_splits, 0 = heuristic [0]")
    ap.add_argument("--cases", default=None, help="splitkv: comma list of B<b>xN<keys>[xP<page>] "
                    "[issue 14's five + page 16 at B1xN131072, B64xN32768]")
    ap.add_argument("--heads", default=None, help="splitkv: NHEADS:NHEADS_K [32:8]")
    ap.add_argument("--reps", type=int, default=None,
                    help="splitkv: timed calls per point [as many as ~100 ms allow, 10..100]")
    ap.add_argument("--csv", default=None, help="splitkv: also write every point to this CSV file")
    ap.add_argument("--sustain", type=float, default=None,
                    help="dense kinds: time each point after SUSTAIN ms of back-to-back calls (the power-capped "
                    "regime of long runs), with the SM clock (MHz), board power (W) and TFLOP/s per GHz "
                    "from NVML [off: ~18 calls at the boost clock]")
    ap.add_argument("--rounds", type=int, default=None,
                    help="with --sustain: rounds of every variant per point, the order rotated each round [1]")
    ap.add_argument("variants", nargs="*")
    args = ap.parse_args()
    variants = args.variants or DEFAULT
    subprocess.run([sys.executable, os.path.join(ROOT, "csrc", "primitives", "gen_wgmma.py")], check=True)
    work = tempfile.mkdtemp(prefix="tune_kernels_")
    jobs = [(os.path.join(work, "main.o"), [])]
    jobs += [(os.path.join(work, f"v{i:02d}.o"), variant_defines(v)) for i, v in enumerate(variants)]

    def compile_one(job):
        obj, defs = job
        cmd = [nvcc()] + flags(args.arch) + defs + ["-c", SRC, "-o", obj]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return obj, r.returncode, r.stderr

    with cf.ThreadPoolExecutor(args.jobs) as ex:
        for obj, rc, err in ex.map(compile_one, jobs):
            if rc != 0:
                print(err[-4000:])
                sys.exit(f"compile failed: {obj}")
    exe = os.path.join(work, "tune_kernels")
    subprocess.run([nvcc(), "-o", exe] + [j[0] for j in jobs] + ["-ldl", "-lpthread"], check=True)
    print(f"built {len(variants)} variants in {work}", flush=True)
    if args.compile_only:
        return
    if args.rounds is not None and args.sustain is None:
        sys.exit("--rounds needs --sustain")
    extra = [f"--{k}={getattr(args, k)}" for k in ("splits", "cases", "heads", "reps", "csv", "sustain", "rounds")
             if getattr(args, k) is not None]
    sys.exit(subprocess.run([exe] + args.seqlen.split(",") + extra).returncode)


if __name__ == "__main__":
    main()
