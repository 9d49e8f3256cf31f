#!/usr/bin/env bash
# Decode TB/s of ours under forced split counts (FLASH_ATTN_EXT_SPLITKV_SPLITS; where the balanced
# splits apply, BALANCE below, the count S they scale to F x S units per sequence), each in its own
# process (the knob is read once), rounds x fills x splits alternated; one line per run:
#   R<round> F<fill> S=<splits, h = the heuristic>: B<batch>x<seqlen_k>=<TB/s> ...
# Needs a built tree (e.g. `STEPS=build HDIMS=128 bash scripts/gpu_run.sh` first).
#
#   CASES=B8xN32768,B64xN8192 SPLITS="h 6 8" FILLS="1 0.5" ROUNDS=2 bash scripts/splitkv_sweep.sh
# BALANCE: values of FLASH_ATTN_EXT_SPLITKV_BALANCE to alternate (default "2", the library's;
# "2 1 0" compares the balanced splits' grid factors 2 and 1 with every sequence at num_splits).
# GRAPH: the timing flag (default --decode-graph; empty: eager calls, e.g. on the CPU).
# EXTRA: more benchmark flags (e.g. "--decode-hdim 64 --decode-heads 8:2").
set -uo pipefail
cd "$(dirname "$0")/.."
CASES=${CASES:-B8xN32768,B8xN8192,B4xN32768,B64xN8192}
SPLITS=${SPLITS:-"h 6 8"}
FILLS=${FILLS:-"1 0.5"}
ROUNDS=${ROUNDS:-2}
BALANCE=${BALANCE:-2}
GRAPH=${GRAPH---decode-graph}
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for r in $(seq 1 "$ROUNDS"); do
  for f in $FILLS; do
    for s in $SPLITS; do
      for bal in $BALANCE; do
        n=$([ "$s" = h ] && echo "" || echo "$s")
        rm -rf "$work/out"
        # shellcheck disable=SC2086  # GRAPH and EXTRA are lists of flags
        if ! FLASH_ATTN_EXT_SPLITKV_BALANCE=$bal FLASH_ATTN_EXT_SPLITKV_SPLITS=$n $PY -m flash_attn_ext.benchmark --mode decode $GRAPH --page-size 0 \
            --peers none --decode-cases "$CASES" --decode-fill "$f" --rep-ms "${REP_MS:-50}" --warmup-ms "${WARMUP_MS:-10}" \
            --no-plots --no-progress ${EXTRA:-} --out "$work/out" >"$work/log" 2>&1; then
          echo "R$r F$f S=$s bal=$bal: FAILED"; tail -n 5 "$work/log"; continue
        fi
        echo "R$r F$f S=$s bal=$bal: $($PY -c "
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r['impl'] == 'flash_attn_ext']
print(' '.join(f\"B{r['batch']}x{r['seqlen_k']}={float(r['tbps']):.3f}\" if r['status'] == 'ok'
               else f\"B{r['batch']}x{r['seqlen_k']}={r['status']}\" for r in rows))" "$work/out/results.csv")"
      done
    done
  done
done
