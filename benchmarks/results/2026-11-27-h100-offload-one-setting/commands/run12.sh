#!/usr/bin/env bash
# The twelfth device call behind 2026-11-27-h100-offload-one-setting.md (the H100 of call 11, whose 512k runs at
# budget 0.1, 52k tokens a head, ran out of device memory): SentenceKV and DynSplit-KV offloaded, batch 1, budget 3277
# tokens (10% of 32k, as target 3), every prompt prefilled for real (random weights, real_prefill_peak.py,
# utilization 0.75: room for the prompt's hidden states): 32k, then 512k, prefilled by layer. Full KV's 64 GiB of
# K/V at 512k do not fit an H100. Output in $W, packed into $OUT/o12.tgz.
set -uo pipefail
W=.gpu/o12
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
HERE=benchmarks/results/2026-11-27-h100-offload-one-setting/commands
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > $W/device.txt
for ctx in 32768 524288; do
  CONTEXT=$ctx BUDGET=3277 UTIL=0.75 timeout 500 python $HERE/real_prefill_peak.py .gpu/tok sentencekv:1:1.5 \
    dynsplit:1:1.0 > $W/prefill_$ctx.log 2>&1
done
tar czf ${OUT:-/tmp/out}/o12.tgz -C .gpu o12
grep -ho '"case": "[^"]*"\|"run_s": [0-9.]*\|"peak_memory_gib": [0-9.]*\|"tpot_ms": [0-9.]*\|"host_gib": [0-9.]*\|"error": "[^"]*"\|"held": [^]]*]' $W/prefill_*.log
