#!/usr/bin/env bash
# The sixth device call behind 2026-11-27-h100-offload-one-setting.md (one H100): DynSplit-KV offloaded, batch 1,
# budget 3277: the device time of a decode step kernel by kernel at 32k and 256k (profile_step.py), and SentenceKV's
# at 256k beside it. Output in $W, packed into $OUT/o6.tgz.
set -uo pipefail
W=.gpu/o6
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
HERE=benchmarks/results/2026-11-27-h100-offload-one-setting/commands
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > $W/device.txt
for ctx in 32768 262144; do
  timeout 200 python $HERE/profile_step.py .gpu/tok dynsplit 3277 1 $ctx offload=True > $W/dynsplit_$ctx.log 2>&1
done
timeout 150 python $HERE/profile_step.py .gpu/tok sentencekv 3277 1 262144 offload=True > $W/sentencekv_262144.log 2>&1
tar czf ${OUT:-/tmp/out}/o6.tgz -C .gpu o6
grep -h -A14 "device time per step" $W/*.log | cut -c1-150
