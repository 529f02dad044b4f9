#!/usr/bin/env bash
# Issue 28, the rest of the suite on real weights (Qwen2.5-Coder-0.5B-Instruct GGUF) on one GPU: TokenSelect with a
# full prefill (opt-in prefill="full") beside its paper mode, the 16k multiquery rows, DynSplit-KV with the max over a
# KV group's heads, the five non-NIAH tasks at 8k/16k and budget 3% at 31k. Jobs run in order; each is resumable
# (semkv eval skips rows it has) and leaves a marker when done, so a call that reaches its time limit is continued by
# the next call on the same machine (results kept in .gpu/rest while warm). The runs grow copies of the NIAH page's
# 8k/16k directory and the suite's 31k directory (same prompts, same fixed settings).
# Usage: rest.sh SECONDS [JOB...]   (the call's time for jobs; only the named jobs, default all). Machine 1 ran
# ts8_16, ts31, mq16, ds8 and most of other8_16; machine 2 (the first went back after 30 minutes held) started from
# the directories as machine 1 returned them: `rest.sh 560 pct3_31 other8_16`.
W=.gpu/rest
source benchmarks/device_jobs.sh "$@"
[ -d $W/q31 ] || cp -r benchmarks/results/2026-11-26-h100-suite/eval_qwen_31k $W/q31
[ -d $W/n8_16 ] || cp -r benchmarks/results/2026-11-26-h100-niah/eval_qwen_8k_16k $W/n8_16
Q="--model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --budgets 0.1 --param chess.anchor=queries"
OTHER=ruler_vt,ruler_cwe,ruler_fwe,ruler_qa_1,ruler_qa_2
TS="tokenselect[prefill=full]"
PAPER="full,chess,chunkkv,sentencekv,dynsplit,tokenselect"
OPT="chunkkv[neighbours=1],sentencekv[retain=sentences],$TS"
job ts8_16 $E $Q --task $NIAH --lengths 8192,16384 --methods "$TS" --out $W/n8_16
job ts31 $E $Q --task ruler --lengths 31744 --methods "$TS" --out $W/q31
job mq16 $E $Q --task ruler_niah_multiquery --lengths 16384 --methods "$PAPER,$OPT" --out $W/n8_16
job ds8 $E $Q --task $NIAH --lengths 8192 --methods "dynsplit[group_reduce=max]" --out $W/n8_16
job pct3_31 $E --model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --budgets 0.03 \
  --param chess.anchor=queries --task $NIAH --lengths 31744 --methods "chess,$OPT,${PAPER#full,chess,}" --out $W/q31
job other8_16 $E $Q --task $OTHER --lengths 8192,16384 --methods "$PAPER,$OPT" --out $W/n8_16
# the reports (`semkv report DIR`) are written afterwards on the CPU, from the returned directories
tar czf $out/rest.tgz -C $W --exclude='*.gguf' . && ls -la $out
