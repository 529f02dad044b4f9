#!/usr/bin/env bash
# Issue 28, session 10: what item 2 still lacked, on two GPUs of one host at once (one eval directory per GPU, so
# each directory's speed rows come from a process alone on its card): SentenceKV's opt-in modes with more tokens
# kept at prefill (keep_factor 4 and 10 with retain="sentences", score="tokens"), the paper's TokenSelect at its
# recommended 2,688 tokens at 31k and at 3%, the baselines and opt-in modes on the five non-NIAH tasks at 10%, and
# every method on them at 3%. Real weights (Qwen2.5-Coder-0.5B-Instruct GGUF, carried in parts). The runs grow
# copies of the 8k/16k and 31k directories of the earlier pages (carried in .gpu/suite_in; same prompts, same fixed
# settings). The job runner: benchmarks/device_jobs.sh.  Usage: run.sh SECONDS
W=.gpu/done PARTS=".gpu/q6/part_*"
source benchmarks/device_jobs.sh "$@"
[ -d $W/q31 ] || cp -r .gpu/suite_in/q31 $W/q31
[ -d $W/n8_16 ] || cp -r .gpu/suite_in/n8_16 $W/n8_16
M="--model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --param chess.anchor=queries"
SK="sentencekv[retain=sentences,score=tokens,keep_factor=4],sentencekv[retain=sentences,score=tokens,keep_factor=10]"
BASE="streaming_llm,h2o,snapkv,pyramidkv,quest,keydiff,infllm"
NEW="chunkkv[neighbours=3],dynsplit[score=tokens],sentencekv[retain=sentences,score=tokens]"
PAPER="chess,chunkkv,sentencekv,dynsplit,tokenselect"
OPT="chunkkv[neighbours=3],sentencekv[retain=sentences,score=tokens],dynsplit[score=tokens],tokenselect[prefill=full]"
OTHER=ruler_vt,ruler_qa_1,ruler_qa_2,ruler_fwe,ruler_cwe
(
  export CUDA_VISIBLE_DEVICES=0
  job sk31 $E $M --budgets 0.1 --task $NIAH --lengths 31744 --methods "$SK,tokenselect@2688" --out $W/q31
  job other31 $E $M --budgets 0.1 --task $OTHER --lengths 31744 --methods "$BASE,$NEW,tokenselect" --out $W/q31
  job ts31 $E $M --budgets 0.03 --task $NIAH --lengths 31744 --methods tokenselect --out $W/q31
  job lowo31 $E $M --budgets 0.03 --task $OTHER --lengths 31744 --methods "$PAPER,$OPT,$BASE" --out $W/q31
) > $W/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  job sk $E $M --budgets 0.1 --task $NIAH --lengths 8192,16384 --methods "$SK" --out $W/n8_16
  job other $E $M --budgets 0.1 --task $OTHER --lengths 8192,16384 --methods "$BASE,$NEW" --out $W/n8_16
  job ts $E $M --budgets 0.03 --task $NIAH --lengths 8192,16384 --methods tokenselect --out $W/n8_16
  job lowo $E $M --budgets 0.03 --task $OTHER --lengths 8192,16384 --methods "$PAPER,$OPT,$BASE" --out $W/n8_16
  job ts2688o $E $M --budgets 0.1 --task $OTHER --lengths 8192,16384 --methods "tokenselect@2688,tokenselect[prefill=full]@2688" \
    --out $W/n8_16
) > $W/gpu1.log 2>&1 &
wait
cat $W/gpu0.log $W/gpu1.log
# the reports (`semkv report DIR`) are written afterwards on the CPU, from the returned directories
tar czf $out/done.tgz -C $W --exclude='*.gguf' . && ls -la $out
