#!/usr/bin/env bash
# Issue 28: the RULER suite on real weights (Qwen2.5-Coder-0.5B-Instruct GGUF) and its decode speed, on one GPU.
# Jobs run in order; each is resumable (semkv eval skips rows it has) and leaves a marker when done, so a call that
# reaches its time limit is continued by the next call on the same machine (results kept in .gpu/suite while warm).
# Usage: suite.sh SECONDS   (the call's time for jobs)
W=.gpu/suite PARTS=".gpu/q/part_0*"
source benchmarks/device_jobs.sh "$@"
Q="--model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched"
M8="full,chess,chunkkv,snapkv,quest,sentencekv,dynsplit"
B="python -m semkv.cli.main bench"
job q31 $E $Q --task ruler --lengths 31744 --methods $M8 --budgets 0.1 --param chess.anchor=queries --out $W/q31
BQ="$B --model /tmp/qwen.gguf --budget 0.1 --param chess.anchor=queries --contexts 31744 --steps 24"
# each method at its own largest batch, then every method at Full KV's largest batch (N); HF at N
job bench_max_a $BQ --methods full,chess,snapkv,quest,tokenselect --batches max --hf maxx31744 \
  --hf-attention sdpa,sdpa-flash --out $W/bench_qwen_max_a
job bench_max_b $BQ --methods chunkkv,sentencekv,dynsplit --batches max --out $W/bench_qwen_max_b
if [ -f $W/bench_max_a.done ]; then
  N=$(python -c "import json; print(json.load(open('$W/bench_qwen_max_a/results.json'))['max_batch']['31744'])")
  job bench_n_a $BQ --methods full,chess,snapkv,quest,tokenselect --batches $N --out $W/bench_qwen_n_a
  job bench_n_b $BQ --methods chunkkv,sentencekv,dynsplit --batches $N --out $W/bench_qwen_n_b
fi
# HF transformers (SDPA without cuDNN's kernel: its fastest decode) on four of the tasks' prompts: its speed beside
# Full KV's, and its answers as a cross-check; the KV pool takes less of the card so that HF's batch fits beside it
job hf31 $E $Q --task ruler_niah_single_1,ruler_niah_multivalue,ruler_vt,ruler_qa_1 --lengths 31744 --methods full \
  --hf --hf-attention sdpa-flash --gpu-memory-utilization 0.4 --out $W/q31
job q31_ts $E $Q --task ruler --lengths 31744 --methods tokenselect --budgets 0.1 --out $W/q31
job q8_16 $E $Q --task ruler --lengths 8192,16384 --methods $M8,tokenselect --budgets 0.1 --param chess.anchor=queries \
  --out $W/q8_16
job q31_chess_paper $E $Q --task ruler --lengths 31744 --methods chess --budgets 0.1 --out $W/q31_chess_paper
job q31_3pct $E $Q --task ruler --lengths 31744 --methods $M8,tokenselect --budgets 0.03 --param chess.anchor=queries \
  --out $W/q31_3pct
for d in q31 q8_16 q31_chess_paper q31_3pct; do
  [ -d $W/$d ] && python -m semkv.cli.main report $W/$d > $W/$d.report.log 2>&1
done
tar czf $out/suite.tgz -C $W . && ls -la $out
