#!/usr/bin/env bash
# The third device call behind 2026-11-27-h100-offload-cache.md (the same H100 as the second, one process at a
# time): SentenceKV resident at 11 x 32k; offloaded with cache_factor 1.5 at 11 and 15 x 32k and with cache_factor 2
# at 15 x 32k (peak device memory). Output in $W, packed into $OUT/oc3.tgz.
set -uo pipefail
W=.gpu/oc3
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
B="python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16 --budget 0.1 --contexts 32k"
timeout 100 $B --methods sentencekv --batches 11 --out $W/resident > $W/resident.log 2>&1
timeout 150 $B --methods sentencekv --batches 11,15 --param sentencekv.offload=True --param sentencekv.cache_factor=1.5 \
  --out $W/offload_1.5 > $W/offload_1.5.log 2>&1
timeout 120 $B --methods sentencekv --batches 15 --param sentencekv.offload=True --param sentencekv.cache_factor=2.0 \
  --out $W/offload_2.0 > $W/offload_2.0.log 2>&1
tar czf ${OUT:-/tmp/out}/oc3.tgz -C .gpu oc3
grep -h "TPOT" $W/*.log | cut -c1-220
