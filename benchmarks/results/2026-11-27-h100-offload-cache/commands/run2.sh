#!/usr/bin/env bash
# The second device call behind 2026-11-27-h100-offload-cache.md: one H100 80GB HBM3, one process at a time (in the
# first call, three processes pinning tens of GiB of host memory at once slowed each other's host work). Resident
# Full KV and both methods at 11 x 32k; both methods offloaded with cache_factor 2 at 11 x 32k; SentenceKV offloaded
# with cache_factor 2 at its largest batch. Output in $W, packed into $OUT/oc2.tgz.
set -uo pipefail
W=.gpu/oc2
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > $W/device.txt
B="python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16 --budget 0.1 --contexts 32k"
on="--param sentencekv.offload=True --param dynsplit.offload=True --param sentencekv.cache_factor=2.0
    --param dynsplit.cache_factor=2.0"
timeout 150 $B --methods full,sentencekv,dynsplit --batches 11 --out $W/resident > $W/resident.log 2>&1
timeout 150 $B --methods sentencekv,dynsplit --batches 11 $on --out $W/offload_2.0 > $W/offload_2.0.log 2>&1
timeout 240 $B --methods sentencekv --batches max --param sentencekv.offload=True --param sentencekv.cache_factor=2.0 \
  --gpu-memory-utilization 0.8 --out $W/max_2.0 > $W/max_2.0.log 2>&1
tar czf ${OUT:-/tmp/out}/oc2.tgz -C .gpu oc2
grep -h "TPOT" $W/*.log | cut -c1-220
