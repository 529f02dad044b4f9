#!/usr/bin/env bash
# The device call behind 2026-11-27-h100-prefill-floor.md: one machine of 4 x H100 80GB HBM3, one job list per GPU,
# run in parallel from the repository root. .gpu/orig holds the code before this page (`git archive` of 23c56c1's
# semkv/ and benchmarks/*.py), for the "before" rows measured in the same call. Logs and JSON land in $W, packed
# into $OUT/pf.tgz at the end.
set -uo pipefail
W=.gpu/pf
mkdir -p $W
export PYTHONUNBUFFERED=1
HERE=benchmarks/results/2026-11-27-h100-prefill-floor/commands
BENCH="-m semkv.cli.main bench --shape llama3-8b --methods full,snapkv,chunkkv,h2o --budget 0.1 --contexts 32k,128k
  --batches 1 --steps 2 --ttft"
nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv,noheader > $W/device.txt
# GPU 0: this page's code, default chunk (32768): the TTFT table
(export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD
 python $BENCH --prefill-chunk 32768 --out $W/ttft > $W/ttft.log 2>&1) &
# GPU 1: the code before this page (its default chunk, 16384): the same table
(export CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PWD/.gpu/orig
 cd .gpu/orig && python $BENCH --out ../../$W/ttft_before > ../../$W/ttft_before.log 2>&1) &
# GPU 2: Full KV and H2O by chunk; the kernel profile of a 32k prefill
(export CUDA_VISIBLE_DEVICES=2 PYTHONPATH=$PWD
 python $HERE/ttft_chunks.py 16384,32768,65536 full,h2o > $W/ttft_chunks.log 2>&1
 python $HERE/profile_prefill.py full,h2o > $W/profile_prefill.log 2>&1) &
# GPU 3: H2O's column-sum tiles; TokenSelect's selective chunk after and before; the kernel equality rows
(export CUDA_VISIBLE_DEVICES=3 PYTHONPATH=$PWD
 python $HERE/h2o_tiles.py --before .gpu/orig/semkv/methods/h2o/triton_attention_scores.py > $W/h2o_tiles.log 2>&1
 python benchmarks/studies/tokenselect_attention.py --lengths 131072 1048576 --out $W/tokenselect_attention.json \
   > $W/tokenselect_attention.log 2>&1
 (cd .gpu/orig && PYTHONPATH=$PWD python ../../benchmarks/studies/tokenselect_attention.py --lengths 131072 1048576 \
   --out ../../$W/tokenselect_attention_before.json > ../../$W/tokenselect_attention_before.log 2>&1)
 python benchmarks/kernel_check.py > $W/kernel_check.log 2>&1) &
wait
nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader >> $W/device.txt
tar czf ${OUT:-/tmp/out}/pf.tgz -C .gpu pf
ls -la $W
