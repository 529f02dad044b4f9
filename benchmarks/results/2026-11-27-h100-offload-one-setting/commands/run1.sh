#!/usr/bin/env bash
# The first device call behind 2026-11-27-h100-offload-one-setting.md: one H100, one process at a time. The page
# offload writes the pinned store from the device (`kernels.put_host`); synthetic K/V are evicted layer by layer as a
# one-chunk prefill does. Same tokens as resident on the GPU (same_tokens.py); Full KV and SentenceKV resident at
# 11 x 32k; SentenceKV offloaded with cache_factor 1.5 at 11 and 15 x 32k, DynSplit-KV offloaded at 15 x 32k; peak
# memory with real prefills (real_prefill_peak.py). Output in $W, packed into $OUT/o1.tgz.
set -uo pipefail
W=.gpu/o1
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
HERE=benchmarks/results/2026-11-27-h100-offload-one-setting/commands
nvidia-smi --query-gpu=index,name,memory.total,power.limit --format=csv,noheader > $W/device.txt
B="python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16 --budget 0.1 --contexts 32k"
timeout 90 python benchmarks/results/2026-11-27-h100-offload-cache/commands/same_tokens.py .gpu/tok > $W/same_tokens.log 2>&1
timeout 100 $B --methods full,sentencekv --batches 11 --out $W/resident > $W/resident.log 2>&1
timeout 150 $B --methods sentencekv --batches 11,15 --param sentencekv.offload=True --param sentencekv.cache_factor=1.5 \
  --out $W/sentencekv_1.5 > $W/sentencekv_1.5.log 2>&1
timeout 90 $B --methods dynsplit --batches 15 --param dynsplit.offload=True --out $W/dynsplit_1.0 > $W/dynsplit_1.0.log 2>&1
timeout 150 python $HERE/real_prefill_peak.py .gpu/tok full:11 sentencekv:15:1.5 dynsplit:15:1.0 > $W/real_prefill.log 2>&1
tar czf ${OUT:-/tmp/out}/o1.tgz -C .gpu o1
grep -h "same\|Error" $W/same_tokens.log | cut -c1-200
grep -h "TPOT\|peak" $W/*.log | cut -c1-220
grep -ho '"case": "[^"]*"\|"peak_memory_gib": [0-9.]*\|"tpot_ms": [0-9.]*\|"error": "[^"]*"' $W/real_prefill.log
