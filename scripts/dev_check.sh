#!/usr/bin/env bash
# Dev: build (HDIMS), the forward / large-magnitude / sm90 tests, compute-sanitizer on
# scripts/sanitize_case.py; each step bounded in time. Logs to $OUT (or ./dev_out).
set -uo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-$PWD/dev_out}; mkdir -p "$O"
export FLASH_ATTN_EXT_CUDA_ARCHS=90a FLASH_ATTN_EXT_PTX=0 FLASH_ATTN_EXT_PTXAS_V=1 MAX_JOBS=$(nproc) PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -n "${HDIMS:-}" ] && export FLASH_ATTN_EXT_HDIMS=$HDIMS
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
t0=$(date +%s)
timeout 330 python3 setup.py build_ext --inplace >"$O/build.log" 2>&1 || { tail -n 40 "$O/build.log"; echo BUILD FAILED; exit 1; }
echo "build $(( $(date +%s) - t0 )) s; kernels with spills: $(grep -cE '[1-9][0-9]* bytes spill' "$O/build.log")"
timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_sm90_forward.py tests/test_cuda_forward.py tests/test_large_magnitude.py} 2>&1 | tail -n 6
for tool in memcheck racecheck synccheck; do
  timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_case.py >"$O/sanitize_$tool.log" 2>&1
  echo "compute-sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$O/sanitize_$tool.log" | tail -n 1)"
done
grep -E "Race reported" "$O/sanitize_racecheck.log" | head -n 6
echo "total $(( $(date +%s) - t0 )) s"
