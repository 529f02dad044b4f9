#!/usr/bin/env bash
# Issue 28, session 7: the rest of the suite on real weights (Qwen2.5-Coder-0.5B-Instruct GGUF) on one GPU. QA at
# 8k/16k, the methods' recommended settings (CHESS's presets at their Table 1 budgets, TokenSelect's 2688 tokens),
# DynSplit-KV with attention sinks, budget 3% at 31k (the five NIAH tasks not yet run) and at 8k/16k, and a float32
# check of Full KV against HF transformers at 31k, in order of importance (the job runner: benchmarks/device_jobs.sh).
# The runs grow copies of the 8k/16k and 31k directories of the earlier pages (same prompts, same fixed settings).
# Usage: run.sh SECONDS [JOB...]   (the call's time for jobs; only the named jobs, default all). Machine 1 ran ds to
# ts2688 in three calls; machine 2 started from its .gpu/set (carried back) and ran the rest in three calls, the last
# `run.sh 550 cons pct3_8_16p pct3_31ts ts2688_31`.
W=.gpu/set
source benchmarks/device_jobs.sh "$@"
[ -d $W/q31 ] || cp -r benchmarks/results/2026-11-26-h100-suite/eval_qwen_31k $W/q31
[ -d $W/n8_16 ] || cp -r benchmarks/results/2026-11-26-h100-niah/eval_qwen_8k_16k $W/n8_16
M="--model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --param chess.anchor=queries"
REST=ruler_niah_multikey_1,ruler_niah_multikey_2,ruler_niah_multikey_3,ruler_niah_multivalue,ruler_niah_multiquery
TS="tokenselect[prefill=full]"
PAPER="full,chess,chunkkv,sentencekv,dynsplit,tokenselect"
OPT="chunkkv[neighbours=1],sentencekv[retain=sentences],$TS"
FAST="chess,$OPT,chunkkv,sentencekv,dynsplit"   # every arm of the 3% runs but the paper's TokenSelect (slow prefill)
DS="dynsplit[n_sink=4]"
DS2="dynsplit[n_sink=16,n_recent=64]"
job ds $E $M --budgets 0.1 --task $NIAH --lengths 8192,16384 --methods "$DS,$DS2" --out $W/n8_16
job qa8_16 $E $M --budgets 0.1 --task ruler_qa_1,ruler_qa_2 --lengths 8192,16384 --methods "$PAPER,$OPT" --out $W/n8_16
job pct3_31 $E $M --budgets 0.03 --task $REST --lengths 31744 --methods "$FAST" --out $W/q31
job ds31 $E $M --budgets 0.1 --task $NIAH --lengths 31744 --methods "$DS" --out $W/q31
job aggr $E $M --budgets 0.01 --task $NIAH --lengths 8192,16384 --methods "chess[preset=aggressive]" --out $W/n8_16
job aggr31 $E $M --budgets 0.01 --task $NIAH --lengths 31744 --methods "chess[preset=aggressive]" --out $W/q31
job ts2688 $E $M --budgets 2688 --task $NIAH --lengths 8192,16384 --methods "$TS,tokenselect" --out $W/n8_16
job ts2688_31 $E $M --budgets 2688 --task $NIAH --lengths 31744 --methods "$TS" --out $W/q31
job f32 $E --model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --dtype float32 --hf \
  --task ruler_vt,ruler_qa_1 --lengths 31744 --methods full --out $W/f32_31
job pct3_8_16 $E $M --budgets 0.03 --task $NIAH --lengths 8192,16384 --methods "chess,$OPT" --out $W/n8_16
job moder $E $M --budgets 0.392 --task $NIAH --lengths 8192,16384 --methods "chess[preset=moderate]" --out $W/n8_16
job cons $E $M --budgets 0.729 --task $NIAH --lengths 8192,16384 --methods "chess[preset=conservative]" --out $W/n8_16
job pct3_8_16p $E $M --budgets 0.03 --task $NIAH --lengths 8192,16384 --methods "chunkkv,sentencekv,dynsplit" \
  --out $W/n8_16
job pct3_31ts $E $M --budgets 0.03 --task ruler_niah_single_3,$REST --lengths 31744 --methods tokenselect --out $W/q31
# the reports (`semkv report DIR`) are written afterwards on the CPU, from the returned directories
tar czf $out/set.tgz -C $W --exclude='*.gguf' . && ls -la $out
