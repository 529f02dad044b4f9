#!/usr/bin/env bash
# The third device call behind 2026-11-27-h100-prefill-floor.md (the committed code; the bench now also measures the
# GEMM rate the card sustains): the TTFT table on each of the four H100s of one machine at once. Output in $W,
# packed into $OUT/pf3.tgz.
set -uo pipefail
W=.gpu/pf3
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv,noheader > $W/device.txt
for gpu in 0 1 2 3; do
  (export CUDA_VISIBLE_DEVICES=$gpu
   python -m semkv.cli.main bench --shape llama3-8b --methods full,snapkv,chunkkv,h2o --budget 0.1 \
     --contexts 32k,128k --batches 1 --steps 2 --ttft --out $W/ttft_gpu$gpu > $W/ttft_gpu$gpu.log 2>&1) &
done
sleep 60; nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader >> $W/device.txt
sleep 60; nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader >> $W/device.txt
wait
tar czf ${OUT:-/tmp/out}/pf3.tgz -C .gpu pf3
ls -la $W
