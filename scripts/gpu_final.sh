#!/usr/bin/env bash
# Last call of a closing GPU session, right after the test calls (`STEPS="build test" SHARD=1/4 bash
# scripts/gpu_run.sh`, then SHARD=2/4, 3/4 and 4/4 with STEPS=test: the build stays in place while
# the machine is warm) and with FlashAttention-4's libraries unpacked to
# /tmp/site (../shared/scripts/fa4_bundle.sh, step 1): installs FA4 from .fa4/whl (step 2), then
# gpu_run.sh's sanitize, memory, ncu and bench steps: the benchmark with SDPA flash / cuDNN / FA4 as
# peers, issue 14's decode (KV cache, contiguous and paged) and varlen tables against the same
# peers (bench3/, bounded by BENCH3_S), and a forward sweep of every sm90 head dim in fp16 and
# bf16 against cuDNN (last: the first thing to drop, BENCH2_ARGS= , when the call runs short; gpu_run.sh's
# CALL_S cuts or skips what the call has no time left for, the install's seconds counted).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .fa4/whl ]; then
  pip install -q --no-deps --target /tmp/site2 .fa4/whl/*.whl >/tmp/fa4_install.log 2>&1 \
    && cp -a /tmp/site/nvidia_cutlass_dsl/. /tmp/site2/nvidia_cutlass_dsl/ \
    && export PYTHONPATH=/tmp/site2:/tmp/site2/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
fi
STEPS="sanitize memory ncu bench" CALL_S=${CALL_S:-530} SAN_S=${SAN_S:-90} BENCH_S=${BENCH_S:-330} BENCH3_S=${BENCH3_S:-180} \
  BENCH_ARGS="--no-progress --peers sdpa-flash,sdpa-cudnn,flash-attn4 --seqlen 1024,2048,4096,8192,16384 --ref-max-seqlen 2048" \
  BENCH3_ARGS="${BENCH3_ARGS-"--no-progress --no-plots --mode decode,varlen_fwd,varlen_bwd --peers sdpa-flash,sdpa-cudnn,flash-attn4 --rep-ms 50 --warmup-ms 10 --rounds 2"}" \
  BENCH2_ARGS="${BENCH2_ARGS-"--no-progress --hdim 64,96,128,192,256 --dtype bf16,fp16 --mode fwd --seqlen 1024,4096,8192 --peers sdpa-cudnn --ref-max-seqlen 0 --no-plots"}" \
  bash scripts/gpu_run.sh
