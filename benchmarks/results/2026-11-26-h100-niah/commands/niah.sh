#!/usr/bin/env bash
# Issue 28: the eight RULER NIAH tasks at 8k, 16k and 31k on real weights (Qwen2.5-Coder-0.5B-Instruct GGUF), budget
# 10%, each paper method beside its opt-in mode (a variant arm of the same run: name[param=value]), on one GPU.
# Jobs run in order; each is resumable (semkv eval skips rows it has) and leaves a marker when done, so a call that
# reaches its time limit is continued by the next call on the same machine (results kept in .gpu/niah while warm).
# The 31k arms join a copy of the previous suite's results directory (same prompts, Full KV and the paper modes).
# Usage: niah.sh SECONDS   (the call's time for jobs)
W=.gpu/niah
source benchmarks/device_jobs.sh "$@"
[ -d $W/q31 ] || cp -r benchmarks/results/2026-11-26-h100-suite/eval_qwen_31k $W/q31
Q="--model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --budgets 0.1 --param chess.anchor=queries"
OPT="chunkkv[neighbours=1],sentencekv[retain=sentences],dynsplit[neighbours=1],tokenselect[neighbours=${TS_N:-8}]"
PAPER="full,chess,chunkkv,sentencekv,dynsplit,tokenselect"
job opt31 $E $Q --task $NIAH --lengths 31744 --methods "$OPT" --out $W/q31
# machine 2 (the first went back after 30 minutes held): the 8k/16k run went on with the two opt-ins that paid at 31k
# (the first machine's rows of the other two stay in the directory)
OPT2="chunkkv[neighbours=1],sentencekv[retain=sentences]"
job niah8_16 $E $Q --task $NIAH --lengths 8192,16384 --methods "$PAPER,$OPT2" --out $W/n8_16
job pct3_31 $E --model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --budgets 0.03 \
  --param chess.anchor=queries --task $NIAH --lengths 31744 --methods "chess,$OPT,${PAPER#full,chess,}" --out $W/q31
# the reports (`semkv report DIR`) were written afterwards on the CPU, from the returned directories
tar czf $out/niah.tgz -C $W --exclude='*.gguf' . && ls -la $out
