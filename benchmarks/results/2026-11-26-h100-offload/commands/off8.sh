#!/usr/bin/env bash
# Issue 29, H200: batch 1 at 32k and 512k (int budget), where Full KV's 512k cache does not fit an H100.
set -uo pipefail
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $out/device.txt
free -g | tee $out/host_mem.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
B() { python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16 "$@"; }
B --methods sentencekv,dynsplit --budget 3277 --batches 1 --contexts 32k,512k --param sentencekv.offload=True \
  --param dynsplit.offload=True --gpu-memory-utilization 0.8 --out $out/c_512k > $out/c_512k.log 2>&1
grep -E "TPOT|Error|skipped" $out/c_512k.log | tail -6
