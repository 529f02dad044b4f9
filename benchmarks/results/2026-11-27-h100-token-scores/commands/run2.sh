#!/usr/bin/env bash
# Issue 28, session 9, second machine: the fused chunk_best kernel of DynSplit-KV's score="tokens" (kernel check and
# decode speed at Full KV's largest batch at 31k, against Full KV and TokenSelect in the same process), then the
# rest of run.sh's grid (the 31k rows at 3% it did not reach, the five non-NIAH tasks at 10%), resumed into the
# directories run.sh returned (carried in .gpu/tok_in).  Usage: run2.sh SECONDS [JOB...]
W=.gpu/tok2 PARTS=".gpu/q5/part_*"
source benchmarks/device_jobs.sh "$@"
[ -d $W/q31 ] || cp -r .gpu/tok_in/q31 $W/q31
[ -d $W/n8_16 ] || cp -r .gpu/tok_in/n8_16 $W/n8_16
M="--model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --param chess.anchor=queries"
BASE="streaming_llm,h2o,snapkv,pyramidkv,quest,keydiff,infllm"
NEW="chunkkv[neighbours=3],dynsplit[score=tokens],sentencekv[retain=sentences,score=tokens]"
OTHER=ruler_vt,ruler_cwe,ruler_fwe,ruler_qa_1,ruler_qa_2
BQ="python -m semkv.cli.main bench --model /tmp/qwen.gguf --budget 0.1 --contexts 31744 --steps 24"
job kernels python benchmarks/kernel_check.py
job bench185 $BQ --methods full,dynsplit,tokenselect --batches 185 --param dynsplit.score=tokens \
  --out $W/bench_tokens_185_fused
job low31 $E $M --budgets 0.03 --task $NIAH --lengths 31744 --methods "$BASE,$NEW" --out $W/q31
job other $E $M --budgets 0.1 --task $OTHER --lengths 8192,16384 --methods "$BASE,$NEW" --out $W/n8_16
job other31 $E $M --budgets 0.1 --task $OTHER --lengths 31744 --methods "$BASE,$NEW" --out $W/q31
tar czf $out/tok2.tgz -C $W --exclude='*.gguf' . && ls -la $out
