#!/usr/bin/env bash
# Second call of a closing GPU session (after `STEPS="build test" bash scripts/gpu_run.sh` left the
# build in place, and FlashAttention-4's libraries were unpacked to /tmp/site: ../shared/scripts/
# fa4_bundle.sh): installs FA4 from .fa4/whl, then the benchmark with SDPA flash / cuDNN / FA4 as
# peers, a forward sweep of every sm90 head dim in fp16 and bf16 against cuDNN, then ncu, peak
# memory and compute-sanitizer, each bounded in time. Logs into $OUT (or ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-$PWD/gpu_out}; mkdir -p "$O"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -d .fa4/whl ]; then
  pip install -q --no-deps --target /tmp/site2 .fa4/whl/*.whl >"$O/fa4_install.log" 2>&1 \
    && cp -a /tmp/site/nvidia_cutlass_dsl/. /tmp/site2/nvidia_cutlass_dsl/ \
    && export PYTHONPATH=$PWD:/tmp/site2:/tmp/site2/nvidia_cutlass_dsl/dsl_packages
fi
b() { timeout "$1" python3 -m flash_attn_ext.benchmark --no-progress --out "$O/$2" "${@:3}" >"$O/$2.log" 2>&1; echo "bench $2 rc=$?"; }
b ${BENCH_S:-330} bench --peers sdpa-flash,sdpa-cudnn,flash-attn4 --seqlen 1024,2048,4096,8192,16384 --ref-max-seqlen 2048
b ${BENCH2_S:-90} bench2 --hdim 64,96,128,192,256 --dtype bf16,fp16 --mode fwd --seqlen 1024,4096,8192 --peers sdpa-cudnn --ref-max-seqlen 0 --no-plots
timeout 60 ncu --clock-control none --kernel-name regex:flash_fwd_kernel --launch-skip 3 --launch-count 1 \
  --metrics sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum \
  python3 -c "
import torch, flash_attn_ext
q, k, v = (torch.randn(2, 8192, 16, 128, device='cuda', dtype=torch.bfloat16) for _ in range(3))
for _ in range(5):
    flash_attn_ext.flash_attn_func(q, k, v)
torch.cuda.synchronize()" >"$O/ncu.txt" 2>&1; echo "ncu rc=$?"; grep -E "gmma|throughput|duration" "$O/ncu.txt"
timeout 60 python3 scripts/peak_memory.py >"$O/memory.txt" 2>&1; tail -n 1 "$O/memory.txt"
for tool in memcheck racecheck synccheck; do
  timeout ${SAN_S:-70} compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_case.py >"$O/sanitize_$tool.log" 2>&1
  echo "compute-sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$O/sanitize_$tool.log" | tail -n 1)"
done
sed -n '/^| dtype/,$p' "$O/bench.log" | head -n 60
sed -n '/^| dtype/,$p' "$O/bench2.log" | head -n 70
