#!/usr/bin/env bash
# The GPU measurements of the speed issue, in stages that each fit one device call (~10 min):
#   bash benchmarks/gpu_session.sh kernels OUT   # kernel equality + timing, TokenSelect's paged dot kernel
#   bash benchmarks/gpu_session.sh attention OUT # TokenSelect's selective attention vs our full kernel, 8k..1M
#   bash benchmarks/gpu_session.sh grid OUT      # semkv bench: methods x batches x contexts, HF eager points
#   bash benchmarks/gpu_session.sh long OUT      # TPOT over 6000 generated tokens after 32k; offload peak memory
#   bash benchmarks/gpu_session.sh speed OUT     # targets 1-3: Full KV at B=1 4k-32k; Full KV, CHESS, TokenSelect
#                                                # at 32k, B=16 and the largest batch Full KV fits (max), HF eager;
#                                                # TokenSelect's Selection Cache bound (every lookup hits);
#                                                # a CHESS profile at that batch
# Llama-3.1-8B shape with random weights, bf16. TOK: a tokenizer folder for the methods that read token text.
case ${1:-} in -h|--help) sed -n "2,11p" "$0" | sed "s/^# \{0,1\}//"; exit 0;; esac
set -euo pipefail
stage=$1 out=$2
mkdir -p "$out"
export PYTHONPATH=$PWD
bench="python -m semkv.cli.main bench --shape llama3-8b"
case $stage in
kernels)
  python benchmarks/kernel_check.py 2>&1 | tee "$out/kernel_check.log"
  (cd benchmarks/studies && python tokenselect_kernels.py --lengths 32768 1048576 --out "$out/tokenselect_kernels.json") \
    2>&1 | tee "$out/tokenselect_kernels.log"
  ;;
attention)
  (cd benchmarks/studies && python tokenselect_attention.py --lengths 8192 32768 131072 524288 1048576 \
    --out "$out/tokenselect_attention.json") 2>&1 | tee "$out/tokenselect_attention.log"
  ;;
grid)
  $bench --methods full,chess,tokenselect,quest --budget 0.01 --param chess.preset=aggressive \
    --param tokenselect.budget=2688 --batches 1,8,16,24,28 \
    --contexts 4k,8k,16k,32k --steps 24 --hf 1x4k,1x32k,16x32k --out "$out/grid" 2>&1 | tee "$out/grid.log"
  ;;
long)
  $bench --methods full,chess,tokenselect --budget 0.01 --param chess.preset=aggressive \
    --param tokenselect.budget=2688 --batches 1 --contexts 32k --steps 16 \
    --long-gen 6000 --out "$out/long" 2>&1 | tee "$out/long.log"
  $bench --methods full,sentencekv,dynsplit --budget 0.1 --param sentencekv.offload=True \
    --param dynsplit.offload=True --tokenizer "${TOK:-.gpu/tok}" --batches 15 --contexts 32k --steps 8 \
    --out "$out/offload" 2>&1 | tee "$out/offload.log"
  ;;
speed)
  python benchmarks/kernel_check.py 2>&1 | tee "$out/kernel_check.log"
  $bench --methods full --batches 1 --contexts 4k,8k,16k,32k --steps 64 --out "$out/speed_b1" 2>&1 \
    | tee "$out/speed_b1.log"
  $bench --methods full,chess,tokenselect --budget 0.01 --param chess.preset=aggressive \
    --param tokenselect.budget=2688 --batches 16,max --contexts 32k \
    --steps 64 --hf 16x32k,20x32k,maxx32k --out "$out/speed" 2>&1 | tee "$out/speed.log"
  # TokenSelect's Selection Cache: random weights make consecutive queries unlike each other (no hits at theta 0.5
  # or 0.9), so theta -1 (every lookup hits) gives the cache's bound; the paper's budget and 1% of the context
  for cfg in "2688 -1" "328 0.9" "328 -1"; do
    set -- $cfg
    $bench --methods tokenselect --param tokenselect.budget=$1 --param tokenselect.theta=$2 --batches max \
      --contexts 32k --steps 64 --out "$out/speed_ts$1_theta$2" 2>&1 | tee "$out/speed_ts$1_theta$2.log"
  done
  # CHESS at the re-selection rate of its periodic mode (every 6 generated pages, Appendix C) instead of every page
  # (random weights keep the model uncertain, so the dynamic trigger fires at every page)
  $bench --methods chess --budget 0.01 --param chess.preset=aggressive --param chess.mode=periodic \
    --batches max --contexts 32k --steps 192 --out "$out/speed_periodic" 2>&1 | tee "$out/speed_periodic.log"
  python benchmarks/profile_step.py --method chess --budget 0.01 --param chess.preset=aggressive --batch max \
    --context 32k --steps 40 --out "$out/profile" 2>&1 | tail -60 | tee "$out/profile.log"
  ;;
*) echo "stage: kernels | attention | grid | long | speed" >&2; exit 2 ;;
esac
