#!/usr/bin/env bash
set -uo pipefail
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $out/device.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
B() { python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16 "$@"; }
B --methods sentencekv --budget 0.1 --batches max --contexts 32k --param sentencekv.offload=True \
  --gpu-memory-utilization 0.8 --out $out/b_max_sentencekv > $out/b_max_sentencekv.log 2>&1
grep -E "TPOT|Error|skipped" $out/b_max_sentencekv.log | tail -4
