#!/usr/bin/env bash
# The device call behind 2026-11-27-h100-offload-cache.md: one machine of 4 x H100 80GB HBM3, one job list per GPU,
# all at once. .gpu/tok holds the embedded model's tokenizer (the sentence and delimiter rules read it). GPU 0: Full
# KV and both methods resident at 11 x 32k, then the working-set kernel against its reference; GPUs 1-3: both methods offloaded at 11 x 32k, then SentenceKV offloaded
# at its largest batch, with the working set 1, 1.5 and 2 times a step's selection (`cache_factor`). Output in $W,
# packed into $OUT/oc.tgz.
set -uo pipefail
W=.gpu/oc
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > $W/device.txt
B() { python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16 --budget 0.1 --contexts 32k "$@"; }
(export CUDA_VISIBLE_DEVICES=0
 B --methods full,sentencekv,dynsplit --batches 11 --out $W/resident > $W/resident.log 2>&1
 python -c "
import json, torch
import benchmarks.kernel_check as kc
print(json.dumps(kc.check_working_set(torch.Generator(device='cuda').manual_seed(0)), indent=1))
" > $W/kernel_working_set.log 2>&1) &
for gpu in 1 2 3; do
  f=$(echo "1.0 1.5 2.0" | cut -d' ' -f$gpu)
  on="--param sentencekv.offload=True --param dynsplit.offload=True --param sentencekv.cache_factor=$f
      --param dynsplit.cache_factor=$f"
  (export CUDA_VISIBLE_DEVICES=$gpu
   B --methods sentencekv,dynsplit --batches 11 $on --out $W/offload_$f > $W/offload_$f.log 2>&1
   timeout 420 python -m semkv.cli.main bench --shape llama3-8b --tokenizer .gpu/tok --steps 16 --budget 0.1 \
     --contexts 32k --methods sentencekv --batches max --param sentencekv.offload=True \
     --param sentencekv.cache_factor=$f --gpu-memory-utilization 0.8 --out $W/max_$f > $W/max_$f.log 2>&1) &
done
sleep 90; nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader >> $W/device.txt
wait
tar czf ${OUT:-/tmp/out}/oc.tgz -C .gpu oc
grep -h "TPOT" $W/*.log | cut -c1-220
