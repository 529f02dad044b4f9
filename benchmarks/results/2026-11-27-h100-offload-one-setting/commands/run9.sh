#!/usr/bin/env bash
# The ninth device call behind 2026-11-27-h100-offload-one-setting.md (the same H100 as the eighth, one process at a
# time): Full KV and both methods resident at 11 x 32k, both offloaded at their defaults at 11 x 32k, SentenceKV
# offloaded at its largest batch (utilization 0.8). Output in $W, packed into $OUT/o9.tgz.
set -uo pipefail
W=.gpu/o9
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
B="python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16 --budget 0.1 --contexts 32k"
on="--param sentencekv.offload=True --param dynsplit.offload=True"
timeout 130 $B --methods full,sentencekv,dynsplit --batches 11 --out $W/resident > $W/resident.log 2>&1
timeout 130 $B --methods sentencekv,dynsplit --batches 11 $on --out $W/offload_11 > $W/offload_11.log 2>&1
timeout 220 $B --methods sentencekv --batches max --param sentencekv.offload=True --gpu-memory-utilization 0.8 \
  --out $W/max > $W/max.log 2>&1
tar czf ${OUT:-/tmp/out}/o9.tgz -C .gpu o9
grep -h "TPOT" $W/*.log | cut -c1-220
