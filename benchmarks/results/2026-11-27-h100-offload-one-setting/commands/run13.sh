#!/usr/bin/env bash
# The thirteenth device call behind 2026-11-27-h100-offload-one-setting.md (the H100 of calls 11-12; call 12 ran 32k and its 512k
# runs ran out of memory at utilization 0.75 when the first layer was scored and offloaded): SentenceKV and DynSplit-KV offloaded, batch 1, budget 3277
# tokens (10% of 32k, as target 3), every prompt prefilled for real (random weights, real_prefill_peak.py,
# utilization 0.6: room for the hidden states and a layer's scoring): 512k, prefilled by layer. Full KV's 64 GiB of
# K/V at 512k do not fit an H100. Output in $W, packed into $OUT/o13.tgz.
set -uo pipefail
W=.gpu/o13
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
HERE=benchmarks/results/2026-11-27-h100-offload-one-setting/commands
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > $W/device.txt
for ctx in 524288; do
  CONTEXT=$ctx BUDGET=3277 UTIL=0.6 timeout 560 python $HERE/real_prefill_peak.py .gpu/tok sentencekv:1:1.5 \
    dynsplit:1:1.0 > $W/prefill_$ctx.log 2>&1
done
tar czf ${OUT:-/tmp/out}/o13.tgz -C .gpu o13
grep -ho '"case": "[^"]*"\|"run_s": [0-9.]*\|"peak_memory_gib": [0-9.]*\|"tpot_ms": [0-9.]*\|"host_gib": [0-9.]*\|"error": "[^"]*"\|"held": [^]]*]' $W/prefill_*.log
