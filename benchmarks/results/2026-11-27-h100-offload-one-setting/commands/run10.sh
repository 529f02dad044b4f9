#!/usr/bin/env bash
# The tenth device call behind 2026-11-27-h100-offload-one-setting.md, on one H200 (Full KV's 512k cache alone is 64
# GiB, and the prompt is held on the device while it prefills): SentenceKV (default cache_factor 1.5) and DynSplit-KV
# (cache_factor 1) offloaded, batch 1, at 32k and 512k, budget 3277 tokens (10% of 32k). Output in $W, packed into
# $OUT/o10.tgz (the final code: the working-set copy of calls 8-9).
set -uo pipefail
W=.gpu/o10
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=index,name,memory.total,power.limit --format=csv,noheader > $W/device.txt
B="python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16 --budget 3277 --batches 1"
timeout 270 $B --methods sentencekv --contexts 32k,512k --param sentencekv.offload=True --gpu-memory-utilization 0.8 \
  --out $W/sentencekv_512k > $W/sentencekv_512k.log 2>&1
timeout 270 $B --methods dynsplit --contexts 32k,512k --param dynsplit.offload=True --gpu-memory-utilization 0.8 \
  --out $W/dynsplit_512k > $W/dynsplit_512k.log 2>&1
tar czf ${OUT:-/tmp/out}/o10.tgz -C .gpu o10
cat $W/device.txt
grep -h "TPOT\|Error" $W/*.log | cut -c1-220
