#!/usr/bin/env bash
# Issue 28, session 8: the baselines (StreamingLLM, H2O, SnapKV, PyramidKV, Quest, KeyDiff, InfLLM) on the 13-task
# suite at 10% and on the NIAH tasks at 3%, opt-in settings of ChunkKV and SentenceKV that keep a uuid needle whole,
# CHESS's moderate and conservative presets at 31k and the paper's TokenSelect where it is missing, on real weights
# (Qwen2.5-Coder-0.5B-Instruct GGUF) on one GPU, in order of importance (the job runner: benchmarks/device_jobs.sh).
# The runs grow copies of the 8k/16k and 31k directories of the earlier pages (same prompts, same fixed settings).
# Usage: run.sh SECONDS [JOB...]   (the call's time for jobs; only the named jobs, default all).
W=.gpu/base PARTS=".gpu/q3/part_*"
source benchmarks/device_jobs.sh "$@"
[ -d $W/q31 ] || cp -r benchmarks/results/2026-11-26-h100-suite/eval_qwen_31k $W/q31
[ -d $W/n8_16 ] || cp -r benchmarks/results/2026-11-26-h100-niah/eval_qwen_8k_16k $W/n8_16
M="--model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --param chess.anchor=queries"
OPT="chunkkv[neighbours=3],chunkkv[chunk_size=20,neighbours=1],sentencekv[retain=sentences,keep_factor=8]"
OTHER=ruler_vt,ruler_cwe,ruler_fwe,ruler_qa_1,ruler_qa_2
BASE="streaming_llm,h2o,pyramidkv,keydiff,infllm"   # SnapKV and Quest have their 31k rows at 10% already
job opt $E $M --budgets 0.1 --task $NIAH --lengths 8192,16384 --methods "$OPT" --out $W/n8_16
job opt31 $E $M --budgets 0.1 --task $NIAH --lengths 31744 --methods "$OPT" --out $W/q31
job base $E $M --budgets 0.1 --task $NIAH --lengths 8192,16384 --methods "$BASE,snapkv,quest" --out $W/n8_16
job base31 $E $M --budgets 0.1 --task $NIAH --lengths 31744 --methods "$BASE" --out $W/q31
job moder31 $E $M --budgets 0.392 --task $NIAH --lengths 31744 --methods "chess[preset=moderate]" --out $W/q31
job cons31 $E $M --budgets 0.729 --task $NIAH --lengths 31744 --methods "chess[preset=conservative]" --out $W/q31
job other $E $M --budgets 0.1 --task $OTHER --lengths 8192,16384 --methods "$BASE,snapkv,quest" --out $W/n8_16
job other31 $E $M --budgets 0.1 --task $OTHER --lengths 31744 --methods "$BASE" --out $W/q31
job base3 $E $M --budgets 0.03 --task $NIAH --lengths 8192,16384 --methods "$BASE,snapkv,quest" --out $W/n8_16
job base3_31 $E $M --budgets 0.03 --task $NIAH --lengths 31744 --methods "$BASE,snapkv,quest" --out $W/q31
job ts2688_31 $E $M --budgets 2688 --task $NIAH --lengths 31744 --methods tokenselect --out $W/q31
job ts3 $E $M --budgets 0.03 --task $NIAH --lengths 8192,16384 --methods tokenselect --out $W/n8_16
job ts3_31 $E $M --budgets 0.03 --task $NIAH --lengths 31744 --methods tokenselect --out $W/q31
# the reports (`semkv report DIR`) are written afterwards on the CPU, from the returned directories
tar czf $out/base.tgz -C $W --exclude='*.gguf' . && ls -la $out
