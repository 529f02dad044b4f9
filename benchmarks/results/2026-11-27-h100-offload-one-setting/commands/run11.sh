#!/usr/bin/env bash
# The eleventh device call behind 2026-11-27-h100-offload-one-setting.md (one H100): the offloading methods prefill a
# prompt of several chunks layer after layer. A prefill by layer against chunk after chunk on the GPU (by_layer.py);
# then 512k-token prompts prefilled for real (random weights) with SentenceKV and DynSplit-KV offloaded, batch 1,
# budget 0.1 (real_prefill_peak.py, utilization 0.75: room for the prompt's hidden states). Full KV's 64 GiB of K/V
# at 512k do not fit an H100. Output in $W, packed into $OUT/o11.tgz.
set -uo pipefail
W=.gpu/o11
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
HERE=benchmarks/results/2026-11-27-h100-offload-one-setting/commands
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > $W/device.txt
timeout 60 python $HERE/by_layer.py .gpu/tok > $W/by_layer.log 2>&1
CONTEXT=524288 UTIL=0.75 timeout 520 python $HERE/real_prefill_peak.py .gpu/tok sentencekv:1:1.5 dynsplit:1:1.0 \
  > $W/prefill_512k.log 2>&1
tar czf ${OUT:-/tmp/out}/o11.tgz -C .gpu o11
grep -h "method\|Error" $W/by_layer.log | cut -c1-200
grep -ho '"case": "[^"]*"\|"run_s": [0-9.]*\|"peak_memory_gib": [0-9.]*\|"tpot_ms": [0-9.]*\|"host_gib": [0-9.]*\|"error": "[^"]*"\|"held": [^]]*]' $W/prefill_512k.log
tail -3 $W/prefill_512k.log | cut -c1-300
