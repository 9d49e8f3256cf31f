#!/usr/bin/env bash
# One call on a GPU machine: build, GPU tests, sanitizer, benchmark; a short table last.
#
#   bash scripts/gpu_run.sh                      # everything, all head dims
#   STEPS="build test" HDIMS=64,128 bash scripts/gpu_run.sh
#   TESTS="tests/test_cuda_forward.py" BENCH_ARGS="--hdim 128 --mode fwd" bash scripts/gpu_run.sh
#   STEPS="build test sanitize" TESTS="tests/test_sm90_forward.py tests/test_cuda_forward.py" bash scripts/gpu_run.sh
#   STEPS="build hf" HDIMS=128 bash scripts/gpu_run.sh   # scripts/hf_bench.py (HF_ARGS), not in the default STEPS
# Bounds (seconds, 0 = none; a benchmark's rc 124: timed out, 125: skipped): TEST_TIMEOUT_S, SAN_S
# (each sanitizer), BENCH_S (each sweep), BENCH3_S (the decode / varlen sweep; default BENCH_S); and CALL_S (default 560), the whole
# call's: every bounded step is cut to what is left of it, or skipped (said in the summary), so the
# logs come back before the device tool's 600 s kill (a killed call returns nothing). Set it lower
# when the call does other work first (e.g. unpacking FA4's libraries: ~20 s).
# The test step leaves out the CPU-only tests (GPU_ONLY=1, the default; tests/conftest.py:
# FLASH_ATTN_EXT_TEST_GPU_ONLY; CI runs them; GPU_ONLY=0 keeps them). SHARD=i/n runs the i-th of n
# shards of the tests (FLASH_ATTN_EXT_TEST_SHARD): the whole suite took ~25 min on an H100
# (2026-12-07: one of three shards, 2,103 tests, in 518 s), an estimated ~20 GPU-only: more than
# three calls, so e.g.
#   STEPS="build test" SHARD=1/4 bash scripts/gpu_run.sh; then STEPS=test SHARD=2/4, 3/4, 4/4
# in the next calls while the machine is warm (the build stays in place).
# The bench step runs the dense sweep (BENCH_ARGS), then issue 14's decode (KV cache) and varlen
# tables (BENCH3_ARGS; BENCH3_ARGS= skips it), the decode cases as CUDA graph replays
# (DECODE_GRAPH_ARGS; empty skips), then BENCH2_ARGS if set.
#
# Logs go to ./gpu_out; when $OUT is set (the device tool brings that folder back), they are
# also packed into $OUT/gpu_out.tgz at the end (the tool returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-}
OUT=$PWD/gpu_out
rm -rf "$OUT"; mkdir -p "$OUT"
STEPS=${STEPS:-"build test sanitize memory bench"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export FLASH_ATTN_EXT_CUDA_ARCHS=${FLASH_ATTN_EXT_CUDA_ARCHS:-90a}
export FLASH_ATTN_EXT_PTX=${FLASH_ATTN_EXT_PTX:-0}
export FLASH_ATTN_EXT_PTXAS_V=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
[ -n "${HDIMS:-}" ] && export FLASH_ATTN_EXT_HDIMS=$HDIMS
# The lent H200 image sets CXX to a g++ wrapper that links libstdc++ statically: C++ exceptions
# thrown by the extension (every TORCH_CHECK) then crash the process instead of raising in Python.
# Build with the system compiler, which links libstdc++ dynamically like torch does.
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
summary=()
pack() { if [ -n "$DEST" ]; then printf '%s\n' "${summary[@]}" >"$OUT/summary.txt"; tar czf "$DEST/gpu_out.tgz" -C "$PWD" gpu_out; fi; }
t0=$(date +%s)
CALL_S=${CALL_S:-560}
# Seconds a step may run: its own bound ($1; 0 = none) cut to what is left of CALL_S less 30 s (the
# interrupt's grace and the packing); -1 when under 20 s are left: the step is skipped.
step_s() {
  local own=${1:-0} left
  [ "$CALL_S" = 0 ] && { echo "$own"; return; }
  left=$(( CALL_S - ($(date +%s) - t0) - 30 ))
  if [ "$left" -lt 20 ]; then echo -1
  elif [ "$own" = 0 ] || [ "$own" -gt "$left" ]; then echo "$left"
  else echo "$own"; fi
}
# "$@" under timeout with step_s's bound of its own bound $1: rc 124 timed out, 125 skipped.
bounded() { local s; s=$(step_s "$1"); shift; [ "$s" -lt 0 ] && return 125; timeout "$s" "$@"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')" | tee -a "$OUT/gpu.txt"

if [[ " $STEPS " == *" build "* ]]; then
  tb=$(date +%s)
  if $PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
    summary+=("build: ok in $(( $(date +%s) - tb )) s (archs=$FLASH_ATTN_EXT_CUDA_ARCHS hdims=${FLASH_ATTN_EXT_HDIMS:-all})")
  else
    tail -n 60 "$OUT/build.log"
    echo "BUILD FAILED"; exit 1
  fi
  # ptxas resource report: one line per kernel (registers, spills, smem).
  grep -E "Compiling entry|registers|spill" "$OUT/build.log" \
    | sed -E 's/ptxas info *: //' >"$OUT/ptxas.txt" || true
  spills=$(grep -cE "[1-9][0-9]* bytes spill" "$OUT/ptxas.txt" || true)
  summary+=("ptxas: $(grep -c 'Used' "$OUT/ptxas.txt") kernels, $spills with spills (ptxas.txt)")
  # C7515: ptxas serialized a kernel's wgmma (e.g. branches joining while a product is in flight):
  # every product then waits for the one before, a silent slowdown. Should be 0.
  summary+=("ptxas: $(grep -c 'C7515' "$OUT/build.log" || true) wgmma-serialization warnings (C7515; expected 0)")
  pack
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [[ " $STEPS " == *" build "* ]]; then
  # SASS of the sm80 hdim-128 forward kernel: tensor-core (HMMA) and ldmatrix (LDSM) counts.
  obj=$(find build -name 'flash_fwd_hdim128_bf16_sm80.o' | head -n 1)
  if [ -n "$obj" ]; then
    cuobjdump --dump-sass "$obj" >"$OUT/sass_fwd_hdim128_bf16.txt" 2>&1
    summary+=("SASS fwd hdim128 bf16: $(grep -c HMMA "$OUT/sass_fwd_hdim128_bf16.txt") HMMA, $(grep -c LDSM "$OUT/sass_fwd_hdim128_bf16.txt") LDSM, $(grep -cE 'STL|LDL' "$OUT/sass_fwd_hdim128_bf16.txt") local ld/st")
    grep -A2 "flash_fwd_kernel.*Li128E" "$OUT/ptxas.txt" | grep -E "registers|spill" | head -n 4 | sed 's/^/    fwd hdim128 ptxas: /' >"$OUT/ptxas_fwd128.txt"
    while read -r l; do summary+=("$l"); done <"$OUT/ptxas_fwd128.txt"
  fi
fi
if [[ " $STEPS " == *" build "* ]]; then
  # SASS of the sm90 (Hopper) forward, hdim 128: warpgroup MMA (HGMMA) and TMA load (UTMALDG) counts.
  obj=$(find build -name 'flash_fwd_hdim128_bf16_sm90.o' | head -n 1)
  if [ -n "$obj" ]; then
    cuobjdump --dump-sass "$obj" >"$OUT/sass_fwd_hdim128_bf16_sm90.txt" 2>&1
    summary+=("SASS sm90 fwd hdim128 bf16: $(grep -c HGMMA "$OUT/sass_fwd_hdim128_bf16_sm90.txt") HGMMA, $(grep -c UTMALDG "$OUT/sass_fwd_hdim128_bf16_sm90.txt") UTMALDG, $(grep -cE 'STL|LDL' "$OUT/sass_fwd_hdim128_bf16_sm90.txt") local ld/st")
  fi
fi
$PY -c "import flash_attn_ext as f; print(f.build_info())" | tee -a "$OUT/gpu.txt"

if [[ " $STEPS " == *" test "* ]]; then
  TESTS=${TESTS:-tests}
  [ -n "${SHARD:-}" ] && export FLASH_ATTN_EXT_TEST_SHARD=$SHARD
  export FLASH_ATTN_EXT_TEST_GPU_ONLY=${GPU_ONLY:-1}
  # PYTEST_X= (empty) runs past the first failure; the step's bound (TEST_TIMEOUT_S and CALL_S) ends
  # it by an interrupt (SIGINT), on which pytest stops and still lists the failures so far (a plain
  # kill leaves only the progress dots), then a kill 20 s later. pytest.log lists the 30 slowest
  # tests (--durations): where the suite's time goes.
  s=$(step_s "${TEST_TIMEOUT_S:-0}")
  if [ "$s" -lt 0 ]; then
    summary+=("pytest${SHARD:+ shard $SHARD}: skipped (CALL_S=$CALL_S spent)")
  else
    timeout -s INT -k 20 "$s" $PY -m pytest ${PYTEST_X--x} -rfs --durations=30 -p no:cacheprovider $TESTS ${PYTEST_ARGS:-} 2>&1 \
      | tee "$OUT/pytest.log" | tail -n 40
    interrupted=$(grep -q KeyboardInterrupt "$OUT/pytest.log" && echo " INTERRUPTED after ${s} s: not every test ran")
    summary+=("pytest${SHARD:+ shard $SHARD}: $(grep -E '(passed|failed|error)' "$OUT/pytest.log" | tail -n 1)$interrupted")
  fi
  pack
fi

if [[ " $STEPS " == *" sanitize "* ]]; then
  for tool in memcheck racecheck synccheck; do
    s=$(step_s "${SAN_S:-0}")
    if [ "$s" -lt 0 ]; then summary+=("compute-sanitizer $tool: skipped (CALL_S=$CALL_S spent)"); continue; fi
    timeout "$s" compute-sanitizer --tool $tool --error-exitcode 9 $PY scripts/sanitize_case.py \
      >"$OUT/sanitize_$tool.log" 2>&1
    rc=$?
    summary+=("compute-sanitizer $tool: rc=$rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -n 1)")
  done
fi

if [[ " $STEPS " == *" memory "* ]]; then
  $PY scripts/peak_memory.py >"$OUT/memory.txt" 2>&1
  summary+=("$(tail -n 1 "$OUT/memory.txt")")
fi
if [[ " $STEPS " == *" hf "* ]]; then
  # A Hugging Face model end to end (scripts/hf_bench.py; HF_ARGS), then with the mask analysed in
  # every layer (what flash_attn_ext.masked's kept plans save).
  $PY scripts/hf_bench.py ${HF_ARGS:-} >"$OUT/hf.txt" 2>&1
  $PY scripts/hf_bench.py ${HF_ARGS:-} --no-plan-cache --layouts right,left >"$OUT/hf_no_plan_cache.txt" 2>&1
  summary+=("hf_bench: rc=$? (hf.txt, hf_no_plan_cache.txt)")
fi

if [[ " $STEPS " == *" ncu "* ]]; then
  # Tensor-pipe utilization of the forward at hdim 128, N = 8192 (bf16, batch 2, 16 heads), one
  # profiled launch; clocks left alone (--clock-control none).
  ncu --clock-control none --kernel-name regex:flash_fwd_kernel --launch-skip 3 --launch-count 1 \
    --metrics sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum \
    $PY -c "
import torch, flash_attn_ext
q, k, v = (torch.randn(2, 8192, 16, 128, device='cuda', dtype=torch.bfloat16) for _ in range(3))
for causal in (False, False, False, False):
    flash_attn_ext.flash_attn_func(q, k, v, causal=causal)
torch.cuda.synchronize()" >"$OUT/ncu.txt" 2>&1
  summary+=("ncu fwd hdim128 N=8192: $(grep -E 'hgmma_qgmma_cycles_active|gpu__time_duration' "$OUT/ncu.txt" | awk '{print $1, $(NF)}' | tr '\n' ' ')")
fi

if [[ " $STEPS " == *" bench "* ]]; then
  # SM clock, power and temperature every 200 ms while the sweeps run (clocks.csv): the tune
  # harness's short runs hold the boost clock, a long sweep may not (power-capped), which is the
  # first thing to rule out when a kernel's harness and benchmark rates disagree.
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits \
    -lms 200 >"$OUT/clocks.csv" 2>/dev/null &
  smi_pid=$!
  bounded "${BENCH_S:-0}" $PY -m flash_attn_ext.benchmark --out "$OUT/bench" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  summary+=("benchmark: rc=$? (bench.log, bench/)")
  pack
  # Decode (KV cache: issue 14's B x Nk cases, contiguous and paged) and varlen (64 mixed-length
  # sequences, fwd and bwd) against SDPA flash / cuDNN and FA4; short timing (decode calls are
  # microseconds to a few ms). Skipped with a note where the build lacks the entries. Two rounds:
  # a ~20 us decode call is host-bound whenever the host's flush + call outlast the GPU's (the lent
  # H200's CPU takes 18-160 us for one small eager call; docs/PERF_NOTES.md, 2026-12-04 fourteenth
  # session), so one timing of the first cases reads 0.5-1.7 TB/s at B1 8k; every peer gets the
  # same two rotated rounds and keeps its median-time (here: faster) one.
  BENCH3_ARGS=${BENCH3_ARGS-"--no-progress --no-plots --mode decode,varlen_fwd,varlen_bwd --peers sdpa-flash,sdpa-cudnn,flash-attn4 --rep-ms 50 --warmup-ms 10 --rounds 2"}
  if [ -n "$BENCH3_ARGS" ]; then
    bounded "${BENCH3_S:-${BENCH_S:-0}}" $PY -m flash_attn_ext.benchmark --out "$OUT/bench3" $BENCH3_ARGS >"$OUT/bench3.log" 2>&1
    rc3=$?
    summary+=("benchmark decode/varlen: rc=$rc3 (bench3.log, bench3/)")
    pack
  fi
  # The decode cases again as CUDA graph replays (--decode-graph): the GPU's time of a step, as
  # serving engines issue it, without the host's launch cost; DECODE_GRAPH_ARGS= skips it.
  DECODE_GRAPH_ARGS=${DECODE_GRAPH_ARGS-"--no-progress --no-plots --mode decode --decode-graph --peers sdpa-flash,sdpa-cudnn,flash-attn4 --rep-ms 50 --warmup-ms 10 --rounds 2"}
  if [ -n "$DECODE_GRAPH_ARGS" ]; then
    bounded "${BENCH3_S:-${BENCH_S:-0}}" $PY -m flash_attn_ext.benchmark --out "$OUT/bench_graph" $DECODE_GRAPH_ARGS >"$OUT/bench_graph.log" 2>&1
    summary+=("benchmark decode as CUDA graphs: rc=$? (bench_graph.log, bench_graph/)")
    pack
  fi
  if [ -n "${BENCH2_ARGS:-}" ]; then  # a second sweep (e.g. fp16), kept apart
    bounded "${BENCH_S:-0}" $PY -m flash_attn_ext.benchmark --out "$OUT/bench2" $BENCH2_ARGS >"$OUT/bench2.log" 2>&1
    summary+=("benchmark 2: rc=$? (bench2.log, bench2/)")
    pack
  fi
  kill "$smi_pid" 2>/dev/null
  summary+=("clocks during the sweeps, min / median / max: $($PY -c "
import csv, statistics as st, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) == 4]
cols = [sorted(float(r[i]) for r in rows) for i in (1, 2, 3)]
print(', '.join('%.0f / %.0f / %.0f %s' % (c[0], st.median(c), c[-1], u) for c, u in zip(cols, ('MHz', 'W', 'C'))) if rows else 'none')
" "$OUT/clocks.csv")")
  # The clocks while each implementation was timed (its rows' windows joined with clocks.csv):
  # whether a few-percent ratio came with a clock or power difference.
  peer=$(echo "${BENCH_ARGS:-}" | grep -o 'flash-attn4' | head -n 1)
  if $PY scripts/clocks_by_impl.py "$OUT/bench" "$OUT/clocks.csv" ${peer:+--peer $peer} >"$OUT/clocks_by_impl.txt" 2>&1; then
    summary+=("clocks by implementation (clocks_by_impl.txt): $(sed -n '/^mode/,/^$/p' "$OUT/clocks_by_impl.txt" | tail -n +2 | awk 'NF==4 {printf "%s%s %s %s MHz %s W", sep, $1, $2, $3, $4; sep="; "} NF==3 {printf "%s%s %s MHz %s W", sep, $1, $2, $3; sep="; "}')")
  fi
  # Every cell the open issues' "must show" names, from the sweeps of this call (issue_bars.txt).
  bench_dirs=(); for d in bench bench3 bench_graph bench2; do [ -f "$OUT/$d/results.csv" ] && bench_dirs+=("$OUT/$d"); done
  if [ ${#bench_dirs[@]} -gt 0 ] && $PY scripts/issue_bars.py "${bench_dirs[@]}" >"$OUT/issue_bars.txt" 2>&1; then
    while read -r l; do summary+=("$l"); done < <(grep '^issue ' "$OUT/issue_bars.txt")
  fi
  sed -n '/^| dtype/,$p' "$OUT/bench.log" | head -n 60
  [ -n "${BENCH2_ARGS:-}" ] && sed -n '/^| dtype/,$p' "$OUT/bench2.log" | head -n 70
  if [ -n "$BENCH3_ARGS" ]; then  # the decode / varlen tables (with the notes above them) last
    sed -n '/^not measured\|^note: /p; /^Decode (KV cache)\|^Varlen: /,$p' "$OUT/bench3.log" | head -n 80
    [ "$rc3" != 0 ] && tail -n 8 "$OUT/bench3.log"
  fi
fi

echo
echo "== gpu_run summary ($(( $(date +%s) - t0 )) s) =="
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
if [ -n "$DEST" ]; then
  tar czf "$DEST/gpu_out.tgz" -C "$PWD" gpu_out && cp "$OUT/summary.txt" "$DEST/"
fi
