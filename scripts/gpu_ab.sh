#!/usr/bin/env bash
# Speed of two builds of flash_attn_ext in one GPU session: builds both (OLD_SRC and NEW_SRC, source
# trees, e.g. `git archive <commit> | tar -x -C .oldsrc`; NEW_SRC defaults to this tree), then runs
# the benchmark alternately old, new, old, new (ROUNDS pairs) and prints new/old per case
# (scripts/compare_runs.py; the spread of each side and the peer's own new/old show the noise).
#
#   OLD_SRC=.oldsrc HDIMS=64,128 bash scripts/gpu_ab.sh
#   BENCH_ARGS="--seqlen 1024,4096,16384 --peers sdpa-flash" ROUNDS=2 bash scripts/gpu_ab.sh
#   NEW_ENV="FLASH_ATTN_EXT_DISABLE_SM90=1" BENCH_ARGS="... --mode fwd" bash scripts/gpu_ab.sh  # env of the new side
#     only (here: its sm80 forward against an old tree that had no sm90 forward)
#   OLD_SRC=. OLD_ENV="FLASH_ATTN_EXT_SM90_FWD_LONG_KEYS=0" BENCH_ARGS="--hdim 128 --mode fwd ..." bash scripts/gpu_ab.sh
#     # one build, two environments (OLD_SRC the same tree as NEW_SRC: built once): a run-time knob's A/B
set -uo pipefail
cd "$(dirname "$0")/.."
OLD_SRC=${OLD_SRC:-.oldsrc}
NEW_SRC=$(cd "${NEW_SRC:-.}" && pwd)
HDIMS=${HDIMS:-64,128}
ROUNDS=${ROUNDS:-2}
BENCH_ARGS=${BENCH_ARGS:-"--hdim $HDIMS --causal both --seqlen 1024,4096,16384 --mode fwd,bwd --peers sdpa-flash"}
WORK=${AB_WORK:-/tmp/flash_ab}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 FLASH_ATTN_EXT_CUDA_ARCHS=${FLASH_ATTN_EXT_CUDA_ARCHS:-90a} FLASH_ATTN_EXT_PTX=0
export FLASH_ATTN_EXT_HDIMS=$HDIMS MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi  # see gpu_run.sh
rm -rf "$WORK"; mkdir -p "$WORK"
same_tree=0; [ "$(cd "$OLD_SRC" && pwd)" = "$NEW_SRC" ] && same_tree=1
old_pid=""
[ $same_tree = 0 ] && { (cd "$OLD_SRC" && $PY setup.py build_ext --inplace >"$WORK/old_build.log" 2>&1) & old_pid=$!; }
(cd "$NEW_SRC" && $PY setup.py build_ext --inplace >"$WORK/new_build.log" 2>&1) || { tail -n 40 "$WORK/new_build.log"; exit 1; }
[ -z "$old_pid" ] || wait $old_pid || { tail -n 40 "$WORK/old_build.log"; exit 1; }
old_dirs=(); new_dirs=()
for r in $(seq 1 "$ROUNDS"); do
  for side in old new; do
    src=$NEW_SRC; [ $side = old ] && src=$(cd "$OLD_SRC" && pwd)
    # Run from the tree itself: `python -m` puts the working directory first on sys.path.
    side_env=(); if [ $side = new ]; then read -r -a side_env <<<"${NEW_ENV:-}"; else read -r -a side_env <<<"${OLD_ENV:-}"; fi
    (cd "$src" && env ${side_env[@]+"${side_env[@]}"} PYTHONPATH=$src $PY -m flash_attn_ext.benchmark $BENCH_ARGS --ref-max-seqlen 0 --no-plots \
      --no-progress --out "$WORK/$side$r" >"$WORK/$side$r.log" 2>&1) || { tail -n 30 "$WORK/$side$r.log"; exit 1; }
    if [ $side = old ]; then old_dirs+=("$WORK/$side$r"); else new_dirs+=("$WORK/$side$r"); fi
  done
done
peer=$(echo "$BENCH_ARGS" | sed -n 's/.*--peers \([^ ,]*\).*/\1/p')
$PY scripts/compare_runs.py --old "$(IFS=,; echo "${old_dirs[*]}")" --new "$(IFS=,; echo "${new_dirs[*]}")" \
  ${peer:+--peer $peer} | tee "$WORK/compare.txt"
