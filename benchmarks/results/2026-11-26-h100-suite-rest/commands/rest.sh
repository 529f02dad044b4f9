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
set -uo pipefail
out=${OUT:-/tmp/out}
W=.gpu/rest
mkdir -p $W
deadline=$(( $(date +%s) + ${1:-560} ))
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $W/device.txt
if [ ! -f /tmp/qwen.gguf ]; then
  cat .gpu/q2/part_* > /tmp/qwen.gguf && sha256sum /tmp/qwen.gguf | tee $W/sha.txt
fi
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/gw/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d $W/q31 ] || cp -r benchmarks/results/2026-11-26-h100-suite/eval_qwen_31k $W/q31
[ -d $W/n8_16 ] || cp -r benchmarks/results/2026-11-26-h100-niah/eval_qwen_8k_16k $W/n8_16
Q="--model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --budgets 0.1 --param chess.anchor=queries"
NIAH=ruler_niah_single_1,ruler_niah_single_2,ruler_niah_single_3,ruler_niah_multikey_1,ruler_niah_multikey_2
NIAH=$NIAH,ruler_niah_multikey_3,ruler_niah_multivalue,ruler_niah_multiquery
OTHER=ruler_vt,ruler_cwe,ruler_fwe,ruler_qa_1,ruler_qa_2
TS="tokenselect[prefill=full]"
PAPER="full,chess,chunkkv,sentencekv,dynsplit,tokenselect"
OPT="chunkkv[neighbours=1],sentencekv[retain=sentences],$TS"
only=" ${*:2} "
job() {  # job NAME COMMAND...: run unless done or not asked for, within the deadline
  local name=$1; shift
  [ -f $W/$name.done ] && return 0
  [ "$only" = "  " ] || [[ "$only" == *" $name "* ]] || return 0
  local left=$(( deadline - $(date +%s) ))
  [ $left -lt 60 ] && { echo "skip $name: ${left}s left"; return 1; }
  echo "== $name ($left s left) $(date -u +%T)" | tee -a $W/jobs.log
  timeout $left "$@" >> $W/$name.log 2>&1 && touch $W/$name.done
  echo "== $name rc=$? $(date -u +%T)" | tee -a $W/jobs.log
}
E="python -m semkv.cli.main eval"
job ts8_16 $E $Q --task $NIAH --lengths 8192,16384 --methods "$TS" --out $W/n8_16
job ts31 $E $Q --task ruler --lengths 31744 --methods "$TS" --out $W/q31
job mq16 $E $Q --task ruler_niah_multiquery --lengths 16384 --methods "$PAPER,$OPT" --out $W/n8_16
job ds8 $E $Q --task $NIAH --lengths 8192 --methods "dynsplit[group_reduce=max]" --out $W/n8_16
job pct3_31 $E --model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --budgets 0.03 \
  --param chess.anchor=queries --task $NIAH --lengths 31744 --methods "chess,$OPT,${PAPER#full,chess,}" --out $W/q31
job other8_16 $E $Q --task $OTHER --lengths 8192,16384 --methods "$PAPER,$OPT" --out $W/n8_16
# the reports (`semkv report DIR`) are written afterwards on the CPU, from the returned directories
tar czf $out/rest.tgz -C $W --exclude='*.gguf' . && ls -la $out
