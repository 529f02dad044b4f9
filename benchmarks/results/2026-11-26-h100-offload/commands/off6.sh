#!/usr/bin/env bash
# Issue 29, call Z: batch 1 at 32k and 256k (int budget), each method at its largest batch at 32k.
set -uo pipefail
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $out/device.txt
free -g | tee $out/host_mem.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
B() { python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16 "$@"; }
on="--param sentencekv.offload=True --param dynsplit.offload=True"
B --methods full --batches max --contexts 32k --out $out/b_full > $out/b_full.log 2>&1
grep -E "TPOT|Error|skipped" $out/b_full.log | tail -3
B --methods sentencekv,dynsplit --budget 0.1 --batches max --contexts 32k $on --gpu-memory-utilization 0.8 \
  --out $out/b_max > $out/b_max.log 2>&1
grep -E "TPOT|Error|skipped" $out/b_max.log | tail -4
B --methods sentencekv,dynsplit --budget 3277 --batches 1 --contexts 32k,256k $on --gpu-memory-utilization 0.75 \
  --out $out/c_long > $out/c_long.log 2>&1
grep -E "TPOT|Error|skipped" $out/c_long.log | tail -6
