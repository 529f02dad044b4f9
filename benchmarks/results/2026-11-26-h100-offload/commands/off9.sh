#!/usr/bin/env bash
# Issue 29, final call: tokens equal on the GPU, working_set kernel check, 11 x 32k resident vs offloaded (both
# methods, Full KV beside them) and 15 x 32k offloaded, all with the committed code.
set -uo pipefail
out=${OUT:-/tmp/out}
raw=/tmp/raw; mkdir -p $raw
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $raw/device.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 150 python .gpu/off_smoke.py > $raw/off_smoke.log 2>&1; grep -E "offload ==|held|Error" $raw/off_smoke.log | cut -c1-200
timeout 200 python -c "
import json, torch
import benchmarks.kernel_check as kc
gen = torch.Generator(device='cuda').manual_seed(0)
print(json.dumps(kc.check_working_set(gen), indent=1))
" > $raw/kernel_working_set.log 2>&1; grep -E "err|ms" $raw/kernel_working_set.log
B() { python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16 "$@"; }
on="--param sentencekv.offload=True --param dynsplit.offload=True"
B --methods full,sentencekv,dynsplit --budget 0.1 --batches 11 --contexts 32k --out $raw/a_resident > $raw/a_resident.log 2>&1
grep -E "TPOT|Error" $raw/a_resident.log | tail -4
B --methods sentencekv,dynsplit --budget 0.1 --batches 11,15 --contexts 32k $on --out $raw/a_offload > $raw/a_offload.log 2>&1
grep -E "TPOT|Error" $raw/a_offload.log | tail -6
tar czf $out/raw.tgz -C /tmp raw
