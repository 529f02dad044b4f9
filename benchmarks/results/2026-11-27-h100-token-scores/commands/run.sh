#!/usr/bin/env bash
# Issue 28, session 9: the opt-in score="tokens" of DynSplit-KV and SentenceKV (a chunk / sentence scores its best
# token's query . key) on the RULER NIAH tasks at 8k-31k and its decode speed at Full KV's largest batch at 31k; then
# what item 2 still lacked: CHESS's moderate and conservative presets at 31k, every baseline at 3%, the five non-NIAH
# tasks at 10%. Real weights (Qwen2.5-Coder-0.5B-Instruct GGUF) on one GPU, in order of importance (the job runner:
# benchmarks/device_jobs.sh). The runs grow copies of the 8k/16k and 31k directories of the earlier pages (same
# prompts, same fixed settings).  Usage: run.sh SECONDS [JOB...]
W=.gpu/tok PARTS=".gpu/q5/part_*"
source benchmarks/device_jobs.sh "$@"
[ -d $W/q31 ] || cp -r benchmarks/results/2026-11-26-h100-suite/eval_qwen_31k $W/q31
[ -d $W/n8_16 ] || cp -r benchmarks/results/2026-11-26-h100-niah/eval_qwen_8k_16k $W/n8_16
M="--model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --param chess.anchor=queries"
TOK="dynsplit[score=tokens],sentencekv[retain=sentences,score=tokens]"
PRESETS="chess[preset=moderate]@0.392,chess[preset=conservative]@0.729"
BASE="streaming_llm,h2o,snapkv,pyramidkv,quest,keydiff,infllm"
NEW="chunkkv[neighbours=3],dynsplit[score=tokens],sentencekv[retain=sentences,score=tokens]"
OTHER=ruler_vt,ruler_cwe,ruler_fwe,ruler_qa_1,ruler_qa_2
BQ="python -m semkv.cli.main bench --model /tmp/qwen.gguf --budget 0.1 --contexts 31744 --steps 24"
job tok $E $M --budgets 0.1 --task $NIAH --lengths 8192,16384 --methods "$TOK" --out $W/n8_16
job tok31 $E $M --budgets 0.1 --task $NIAH --lengths 31744 --methods "$TOK,$PRESETS" --out $W/q31
# Full KV's largest batch at 31744 on an H100 is 185 (2026-11-26-h100-suite.md)
job bench185 $BQ --methods full,dynsplit,sentencekv,tokenselect --batches 185 --param dynsplit.score=tokens \
  --param sentencekv.score=tokens --param sentencekv.retain=sentences --out $W/bench_tokens_185
job low $E $M --budgets 0.03 --task $NIAH --lengths 8192,16384 --methods "$BASE,$NEW" --out $W/n8_16
job low31 $E $M --budgets 0.03 --task $NIAH --lengths 31744 --methods "$BASE,$NEW" --out $W/q31
job other $E $M --budgets 0.1 --task $OTHER --lengths 8192,16384 --methods "$BASE,$NEW" --out $W/n8_16
job other31 $E $M --budgets 0.1 --task $OTHER --lengths 31744 --methods "$BASE,$NEW" --out $W/q31
# the reports (`semkv report DIR`) are written afterwards on the CPU, from the returned directories
tar czf $out/tok.tgz -C $W --exclude='*.gguf' . && ls -la $out
