#!/usr/bin/env bash
# Issue 28, session 11: the rest of item 2 and SentenceKV's target, on four GPUs of one host at once. Each GPU runs one
# `semkv eval` process after another into a directory of its own (so each directory's speed rows come from a process
# alone on its card); the copies of the 8k/16k and 31k directories of the earlier pages (carried in .gpu/suite_in)
# are merged afterwards on the CPU (merge.py). SentenceKV's two CPU candidates (query="current", keep_factor=1) and
# both together on the eight NIAH tasks at 8k/16k/31k at 10%, and their decode speed at Full KV's largest batch (185 x
# 31,744); every method on the five non-NIAH tasks at 3%; CHESS's presets and TokenSelect's 2,688 on the five tasks;
# the paper's TokenSelect at 3% on the last four NIAH tasks at 31k. Real weights (Qwen2.5-Coder-0.5B-Instruct GGUF,
# carried in parts). The job runner and the shared settings (M, NIAH, OTHER, BASE, PAPER, OPT):
# benchmarks/device_jobs.sh.  Usage: run.sh SECONDS
W=.gpu/final PARTS=".gpu/q6/part_*"
source benchmarks/device_jobs.sh "$@"
for d in q31 q31b q31c; do [ -d $W/$d ] || cp -r .gpu/suite_in/q31 $W/$d; done
for d in n8_16 n8_16b; do [ -d $W/$d ] || cp -r .gpu/suite_in/n8_16 $W/$d; done
S="sentencekv[retain=sentences,score=tokens"
SK="$S,query=current],$S,keep_factor=1],$S,query=current,keep_factor=1]"
PRESETS="chess[preset=aggressive]@0.01,chess[preset=moderate]@0.392,chess[preset=conservative]@0.729"
TS2688="tokenselect@2688,tokenselect[prefill=full]@2688"
B="python -m semkv.cli.main bench --model /tmp/qwen.gguf --budget 0.1 --contexts 31744 --steps 24 --batches 185"
B="$B --methods sentencekv --param sentencekv.retain=sentences --param sentencekv.score=tokens"
(
  export CUDA_VISIBLE_DEVICES=0
  job sk31 $E $M --budgets 0.1 --task $NIAH --lengths 31744 --methods "$SK" --out $W/q31
  job ts31 $E $M --budgets 0.03 --task $NIAH --lengths 31744 --methods tokenselect --out $W/q31
  job ts2688o31 $E $M --budgets 0.1 --task $OTHER --lengths 31744 --methods "$TS2688" --out $W/q31
) > $W/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  job lowo31 $E $M --budgets 0.03 --task $OTHER --lengths 31744 --methods "$OPT,$PAPER,$BASE" --out $W/q31b
) > $W/gpu1.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=2
  job sk $E $M --budgets 0.1 --task $NIAH --lengths 8192,16384 --methods "$SK" --out $W/n8_16
  job lowo $E $M --budgets 0.03 --task $OTHER --lengths 8192,16384 --methods "$PAPER,$OPT,$BASE" --out $W/n8_16
) > $W/gpu2.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=3
  job bench_tokens $B --methods full,sentencekv --out $W/bench_tokens
  job bench_current $B --param sentencekv.query=current --out $W/bench_current
  job bench_keep1 $B --param sentencekv.keep_factor=1 --out $W/bench_keep1
  job bench_both $B --param sentencekv.query=current --param sentencekv.keep_factor=1 --out $W/bench_both
  job presets $E $M --task $OTHER --lengths 8192,16384 --methods "$PRESETS" --out $W/n8_16b
  job ts2688o $E $M --budgets 0.1 --task $OTHER --lengths 8192,16384 --methods "$TS2688" --out $W/n8_16b
  job presets31 $E $M --task $OTHER --lengths 31744 --methods "$PRESETS" --out $W/q31c
) > $W/gpu3.log 2>&1 &
wait
cat $W/gpu*.log
# the directories are merged and the reports written afterwards on the CPU (merge.py, `semkv report DIR`)
for d in q31 q31b q31c n8_16 n8_16b; do tar czf $out/$d.tgz -C $W $d; done  # one archive each: 16 MiB a file
tar czf $out/rest.tgz -C $W --exclude='q31*' --exclude='n8_16*' . && ls -la $out
