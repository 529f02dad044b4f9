#!/usr/bin/env bash
# The seventh device call behind 2026-11-27-h100-offload-one-setting.md (one H100, one process at a time): the
# working-set kernel copies the listed tokens in a second kernel with one program per row, KV head and tile
# (`_load`); DynSplit-KV ranks chunks without the unused cumulative sum. The working-set kernel against its reference
# (batch 16 and 1); same tokens as resident (same_tokens.py); DynSplit-KV's step profile at 32k and 256k; batch 1
# at 32k and 256k for both methods; both at 11 x 32k. Output in $W, packed into $OUT/o7.tgz.
set -uo pipefail
W=.gpu/o7
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
HERE=benchmarks/results/2026-11-27-h100-offload-one-setting/commands
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > $W/device.txt
timeout 120 python -c "
import json, torch
import benchmarks.kernel_check as kc
for batch in (16, 1):
    print(json.dumps(kc.check_working_set(torch.Generator(device='cuda').manual_seed(0), batch=batch), indent=1))
" > $W/kernel_working_set.log 2>&1
timeout 90 python benchmarks/results/2026-11-27-h100-offload-cache/commands/same_tokens.py .gpu/tok > $W/same_tokens.log 2>&1
for ctx in 32768 262144; do
  timeout 150 python $HERE/profile_step.py .gpu/tok dynsplit 3277 1 $ctx offload=True > $W/profile_dynsplit_$ctx.log 2>&1
done
B="python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16"
on="--param sentencekv.offload=True --param dynsplit.offload=True"
timeout 200 $B --methods sentencekv,dynsplit --budget 3277 --batches 1 --contexts 32k,256k $on --out $W/batch1 \
  > $W/batch1.log 2>&1
timeout 150 $B --methods sentencekv,dynsplit --budget 0.1 --batches 11 --contexts 32k $on --out $W/offload_11 \
  > $W/offload_11.log 2>&1
tar czf ${OUT:-/tmp/out}/o7.tgz -C .gpu o7
grep -h '"err\|_ms\|same\|Error' $W/kernel_working_set.log $W/same_tokens.log | cut -c1-160
grep -h -A8 "device time per step" $W/profile_*.log | cut -c1-120
grep -h "TPOT" $W/batch1.log $W/offload_11.log | cut -c1-220
