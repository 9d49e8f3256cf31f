#!/usr/bin/env bash
# Kernel-level A/B of two source trees in one GPU call: builds benchmarks/tune_kernels.py's binary
# from each tree for the same VARIANTS (one after the other: two parallel 16-job compiles have run
# the machine out of memory), runs them alternately old, new, old, new (ROUNDS pairs), and prints
# scripts/compare_tune.py's table (new/old per cell, means over N <= 2k and N >= 4k per head dim).
# No torch build needed: a few minutes of device time less than scripts/gpu_ab.sh.
#
#   git archive HEAD | (mkdir -p .oldsrc && tar -x -C .oldsrc)   # here, before the call
#   OLD_SRC=.oldsrc VARIANTS="fwd90:128:128,128 fwd90:64:192,128" bash scripts/gpu_ab_tune.sh
#   OLD_SRC=.oldsrc VARIANTS="splitkv:128:64,4,2,3,0,1,1" TUNE_ARGS="--splits=0,16 --cases=B1xN8192,B64xN8192" \
#     bash scripts/gpu_ab_tune.sh            # decode steps (TUNE_ARGS: the binary's splitkv options)
# .oldsrc is git-ignored (.git/info/exclude): name it in the device call's carry. Apply a patch to
# such a copy with `git apply --directory=...` or `patch -p1` from inside it: `git apply` run inside
# a subfolder of this checkout patches nothing there (it skips paths outside the folder).
#
# Prebuilt sides (no compile on the GPU machine: the binaries link the CUDA runtime statically and
# ran there as built on a machine without a GPU, 2026-12-01): build each side where nvcc is, e.g.
#   d=$(python3 benchmarks/tune_kernels.py --compile-only $V | grep -o '/tmp/tune_kernels_[A-Za-z0-9_]*')
#   mkdir -p .tune/new && cp $d/tune_kernels .tune/new/          # likewise .tune/old from .oldsrc
#   NVCC_APPEND_FLAGS=-DFLASH_ATTN_EXT_SM90_FWD_PINGPONG=0 python3 benchmarks/tune_kernels.py ...  # a macro variant
# then, carrying .tune (git-ignored): PREBUILT=.tune SIDES="old new other" bash scripts/gpu_ab_tune.sh
# runs the sides alternately ROUNDS times and compares every side with the first.
set -uo pipefail
cd "$(dirname "$0")/.."
SEQLENS=${SEQLENS:-1024,2048,4096,16384}
ROUNDS=${ROUNDS:-2}
WORK=${AB_WORK:-/tmp/flash_ab_tune}
PY=${PYTHON:-python3}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
rm -rf "$WORK"; mkdir -p "$WORK"
if [ -n "${PREBUILT:-}" ]; then
  SIDES=${SIDES:-"old new"}
  for side in $SIDES; do echo "$PREBUILT/$side" >"$WORK/bin_$side"; done
else
  OLD_SRC=${OLD_SRC:-.oldsrc}
  NEW_SRC=${NEW_SRC:-.}
  VARIANTS=${VARIANTS:?"VARIANTS: tune_kernels.py variants, e.g. fwd90:128:128,128 (see its docstring)"}
  SIDES="old new"
  for side in old new; do
    src=$NEW_SRC; [ $side = old ] && src=$OLD_SRC
    # shellcheck disable=SC2086
    $PY "$src/benchmarks/tune_kernels.py" --compile-only $VARIANTS >"$WORK/build_$side.log" 2>&1 \
      || { tail -n 30 "$WORK/build_$side.log"; echo "$side tree: compile failed"; exit 1; }
    grep -o '/tmp/tune_kernels_[A-Za-z0-9_]*' "$WORK/build_$side.log" | head -n 1 >"$WORK/bin_$side"
  done
fi
declare -A runs
read -r -a sides_arr <<<"$SIDES"
for r in $(seq 1 "$ROUNDS"); do
  # The order rotates each round, so no side always runs first or last (a clock or temperature
  # drift over a round then favours no side).
  for k in "${!sides_arr[@]}"; do
    side=${sides_arr[$(( (k + r) % ${#sides_arr[@]} ))]}
    out="$WORK/$side$r.txt"
    # shellcheck disable=SC2086
    "$(cat "$WORK/bin_$side")/tune_kernels" ${SEQLENS//,/ } ${TUNE_ARGS:-} >"$out" 2>&1 || { tail -n 20 "$out"; exit 1; }
    runs[$side]="${runs[$side]:+${runs[$side]},}$out"
  done
done
first=${SIDES%% *}
for side in $SIDES; do
  [ "$side" = "$first" ] && continue
  [ "$first" = old ] && [ "$side" = new ] && name=compare.txt || name=compare_$side.txt
  echo "=== $side / $first"
  $PY scripts/compare_tune.py --old "${runs[$first]}" --new "${runs[$side]}" | tee "$WORK/$name"
done
if [ -n "${OUT:-}" ]; then tar czf "$OUT/ab_tune.tgz" -C "$(dirname "$WORK")" "$(basename "$WORK")"; fi
exit 0
