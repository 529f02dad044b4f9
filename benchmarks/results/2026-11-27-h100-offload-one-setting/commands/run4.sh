#!/usr/bin/env bash
# The fourth device call behind 2026-11-27-h100-offload-one-setting.md (the same H100 as the third): SentenceKV
# offloaded at its default cache_factor (1.5): batch 1 at 32k and 256k (budget 3277 tokens, 10% of 32k), and 15 x
# 32k. Output in $W, packed into $OUT/o4.tgz.
set -uo pipefail
W=.gpu/o4
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
B="python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16 --param sentencekv.offload=True"
timeout 100 $B --methods sentencekv --budget 0.1 --batches 15 --contexts 32k --out $W/sentencekv_15 \
  > $W/sentencekv_15.log 2>&1
timeout 300 $B --methods sentencekv --budget 3277 --batches 1 --contexts 32k,256k --out $W/sentencekv_256k \
  > $W/sentencekv_256k.log 2>&1
tar czf ${OUT:-/tmp/out}/o4.tgz -C .gpu o4
grep -h "TPOT\|Error" $W/*.log | cut -c1-220
