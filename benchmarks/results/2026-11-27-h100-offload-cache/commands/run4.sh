#!/usr/bin/env bash
# The fourth device call behind 2026-11-27-h100-offload-cache.md: one H100 80GB HBM3, one process at a time, with
# the page offload as a device write into the pinned store (`kernels.put_host`, no wait for the device): the code of
# put_host.patch beside this file before its two fixes (a 64-bit cast of the addresses, no integer specialisation);
# that code is not in the repository. Same
# tokens as resident on the GPU (same_tokens.py); SentenceKV and DynSplit-KV offloaded with cache_factor 2 at 11 x
# 32k; SentenceKV offloaded with cache_factor 2 at its largest batch; Full KV and SentenceKV resident at 11 x 32k.
# Output in $W, packed into $OUT/oc4.tgz.
set -uo pipefail
W=.gpu/oc4
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
HERE=benchmarks/results/2026-11-27-h100-offload-cache/commands
B="python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16 --budget 0.1 --contexts 32k"
timeout 90 python $HERE/same_tokens.py .gpu/tok > $W/same_tokens.log 2>&1
timeout 120 $B --methods sentencekv,dynsplit --batches 11 --param sentencekv.offload=True --param dynsplit.offload=True \
  --param sentencekv.cache_factor=2.0 --param dynsplit.cache_factor=2.0 --out $W/offload_2.0 > $W/offload_2.0.log 2>&1
timeout 200 $B --methods sentencekv --batches max --param sentencekv.offload=True --param sentencekv.cache_factor=2.0 \
  --gpu-memory-utilization 0.8 --out $W/max_2.0 > $W/max_2.0.log 2>&1
timeout 100 $B --methods full,sentencekv --batches 11 --out $W/resident > $W/resident.log 2>&1
tar czf ${OUT:-/tmp/out}/oc4.tgz -C .gpu oc4
grep -h "same\|Error" $W/same_tokens.log | cut -c1-200
grep -h "TPOT" $W/*.log | cut -c1-220
