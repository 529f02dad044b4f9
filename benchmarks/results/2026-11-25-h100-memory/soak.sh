#!/usr/bin/env bash
# memory soak on the device: $1 = code root (. or .gpu/orig), $2 = tag, then memory_soak.py arguments
set -uo pipefail
out=${OUT:-/tmp/out}
root=$1; tag=$2; shift 2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $out/device_$tag.txt
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD/$root python benchmarks/memory_soak.py --shape qwen2.5-0.5b --tokenizer .gpu/tok \
  --text-file .gpu/essays.txt --out $out/$tag "$@" > $out/soak_$tag.log 2>&1
echo "rc=$?"
grep -v '^{' $out/soak_$tag.log | tail -25
