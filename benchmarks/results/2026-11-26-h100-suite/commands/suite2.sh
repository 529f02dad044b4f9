#!/usr/bin/env bash
# Issue 28, second machine: decode speed of every method at Full KV's largest batch (graphed: CUDA-graph batches now
# reach 1024), the evicting methods at their own largest batch, HF transformers in the eval run, and TokenSelect's
# remaining 31k tasks. Same job/marker scheme as suite.sh (q31's rows and marker come along in .gpu/suite).
# Usage: suite2.sh SECONDS
W=.gpu/suite PARTS=".gpu/q/part_0*" TAG=2
source benchmarks/device_jobs.sh "$@"
B="python -m semkv.cli.main bench"
Q="--model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched"
BQ="$B --model /tmp/qwen.gguf --budget 0.1 --param chess.anchor=queries --contexts 31744 --steps 24"
N=185  # Full KV's largest batch at 31744 on this card (bench_qwen_max_a)
job bench185 $BQ --methods full,chess,snapkv,chunkkv,tokenselect,sentencekv,dynsplit --batches $N --hf ${N}x31744 \
  --hf-attention sdpa,sdpa-flash --out $W/bench_qwen_185
# HF beside Full KV in one process (bench185 stopped at DynSplit-KV's out-of-memory before its HF runs)
job bench185_hf $BQ --methods full --batches $N --hf ${N}x31744 --hf-attention sdpa,sdpa-flash --out $W/bench_qwen_185_hf
job hf31 $E $Q --task ruler_niah_single_1,ruler_niah_multivalue,ruler_vt,ruler_qa_1 --lengths 31744 --methods full \
  --hf --hf-attention sdpa-flash --gpu-memory-utilization 0.4 --param chess.anchor=queries --out $W/q31
job q31_ts $E $Q --task ruler --lengths 31744 --methods tokenselect --budgets 0.1 --param chess.anchor=queries \
  --out $W/q31
job bench_own $BQ --methods full,snapkv,chunkkv,sentencekv --batches max --out $W/bench_qwen_own
job bench185_quest $BQ --methods full,quest --batches $N --out $W/bench_qwen_185_quest
for d in q31; do python -m semkv.cli.main report $W/$d > $W/$d.report.log 2>&1; done
tar czf $out/suite2.tgz -C $W . && ls -la $out
