#!/usr/bin/env bash
# The second device call behind 2026-11-27-h100-prefill-floor.md (the committed code; default chunk 32768, H2O's
# tile 64x128 with 4 warps): one machine of 4 x H100 80GB HBM3, one job list per GPU in parallel. Output in $W,
# packed into $OUT/pf2.tgz.
set -uo pipefail
W=.gpu/pf2
mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
HERE=benchmarks/results/2026-11-27-h100-prefill-floor/commands
nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv,noheader > $W/device.txt
# GPU 0: the TTFT table
(export CUDA_VISIBLE_DEVICES=0
 python -m semkv.cli.main bench --shape llama3-8b --methods full,snapkv,chunkkv,h2o --budget 0.1 --contexts 32k,128k \
   --batches 1 --steps 2 --ttft --out $W/ttft > $W/ttft.log 2>&1) &
# GPU 1: the kernel profile of a 32k prefill (Full KV, H2O); the GEMM rate, burst and sustained
(export CUDA_VISIBLE_DEVICES=1
 python $HERE/profile_prefill.py full,h2o > $W/profile_prefill.log 2>&1
 python $HERE/gemm_rate.py > $W/gemm_rate.log 2>&1) &
# GPU 2: the kernel equality rows; H2O's tiles around the first call's best
(export CUDA_VISIBLE_DEVICES=2
 python benchmarks/kernel_check.py > $W/kernel_check.log 2>&1
 python $HERE/h2o_tiles.py --second --before .gpu/orig/semkv/methods/h2o/triton_attention_scores.py \
   > $W/h2o_tiles.log 2>&1) &
# GPU 3: TokenSelect's selective chunk; its sparse prefill's TTFT in the engine (budget 2688, chunk 512)
(export CUDA_VISIBLE_DEVICES=3
 python benchmarks/studies/tokenselect_attention.py --lengths 131072 1048576 --out $W/tokenselect_attention.json \
   > $W/tokenselect_attention.log 2>&1
 python -m semkv.cli.main bench --shape llama3-8b --methods tokenselect --budget 2688 --contexts 32k,128k \
   --batches 1 --steps 2 --ttft --out $W/ttft_tokenselect > $W/ttft_tokenselect.log 2>&1) &
wait
nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader >> $W/device.txt
tar czf ${OUT:-/tmp/out}/pf2.tgz -C .gpu pf2
ls -la $W
