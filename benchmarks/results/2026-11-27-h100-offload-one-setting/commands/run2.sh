#!/usr/bin/env bash
# The second device call behind 2026-11-27-h100-offload-one-setting.md (the same H100 as the first, one process at a
# time): Full KV at its largest batch at 32k (11) and SentenceKV offloaded at its own largest batch with cache_factor
# 1.5 and 2 (utilization 0.8, room for its state beside the pool). Output in $W, packed into $OUT/o2.tgz.
set -uo pipefail
W=.gpu/o2
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
B="python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16 --budget 0.1 --contexts 32k"
timeout 80 $B --methods full --batches max --out $W/full_max > $W/full_max.log 2>&1
for f in 1.5 2.0; do
  timeout 230 $B --methods sentencekv --batches max --param sentencekv.offload=True --param sentencekv.cache_factor=$f \
    --gpu-memory-utilization 0.8 --out $W/max_$f > $W/max_$f.log 2>&1
done
tar czf ${OUT:-/tmp/out}/o2.tgz -C .gpu o2
grep -h "TPOT\|batch" $W/*.log | cut -c1-220
