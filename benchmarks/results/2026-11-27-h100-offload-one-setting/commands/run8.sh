#!/usr/bin/env bash
# The eighth device call behind 2026-11-27-h100-offload-one-setting.md (one H100, one process at a time): `_load`
# runs about a thousand programs whatever the batch, each looping over its share of the tiles (call 7 ran one program
# per tile). The working-set kernels against their reference (batch 16 and 1); same tokens as resident
# (same_tokens.py); DynSplit-KV's step profile at 256k; batch 1 at 32k and 256k for both methods. Output in $W,
# packed into $OUT/o8.tgz.
set -uo pipefail
W=.gpu/o8
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
timeout 150 python $HERE/profile_step.py .gpu/tok dynsplit 3277 1 262144 offload=True > $W/profile_dynsplit_262144.log 2>&1
B="python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16"
on="--param sentencekv.offload=True --param dynsplit.offload=True"
timeout 200 $B --methods sentencekv,dynsplit --budget 3277 --batches 1 --contexts 32k,256k $on --out $W/batch1 \
  > $W/batch1.log 2>&1
tar czf ${OUT:-/tmp/out}/o8.tgz -C .gpu o8
grep -h '"err\|_ms\|same\|Error' $W/kernel_working_set.log $W/same_tokens.log | cut -c1-160
grep -h -A8 "device time per step" $W/profile_*.log | cut -c1-120
grep -h "TPOT" $W/batch1.log | cut -c1-220
