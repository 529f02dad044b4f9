#!/usr/bin/env bash
# Issue 28: the eight RULER NIAH tasks at 8k, 16k and 31k on real weights (Qwen2.5-Coder-0.5B-Instruct GGUF), budget
# 10%, each paper method beside its opt-in mode (a variant arm of the same run: name[param=value]), on one GPU.
# Jobs run in order; each is resumable (semkv eval skips rows it has) and leaves a marker when done, so a call that
# reaches its time limit is continued by the next call on the same machine (results kept in .gpu/niah while warm).
# The 31k arms join a copy of the previous suite's results directory (same prompts, Full KV and the paper modes).
# Usage: niah.sh SECONDS   (the call's time for jobs)
set -uo pipefail
out=${OUT:-/tmp/out}
W=.gpu/niah
mkdir -p $W
deadline=$(( $(date +%s) + ${1:-560} ))
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $W/device.txt
if [ ! -f /tmp/qwen.gguf ]; then
  cat .gpu/q2/part_* > /tmp/qwen.gguf && sha256sum /tmp/qwen.gguf | tee $W/sha.txt
fi
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/gw/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d $W/q31 ] || cp -r benchmarks/results/2026-11-26-h100-suite/eval_qwen_31k $W/q31
Q="--model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --budgets 0.1 --param chess.anchor=queries"
NIAH=ruler_niah_single_1,ruler_niah_single_2,ruler_niah_single_3,ruler_niah_multikey_1,ruler_niah_multikey_2
NIAH=$NIAH,ruler_niah_multikey_3,ruler_niah_multivalue,ruler_niah_multiquery
OPT="chunkkv[neighbours=1],sentencekv[retain=sentences],dynsplit[neighbours=1],tokenselect[neighbours=${TS_N:-8}]"
PAPER="full,chess,chunkkv,sentencekv,dynsplit,tokenselect"
job() {  # job NAME COMMAND...: run unless done, within the deadline
  local name=$1; shift
  [ -f $W/$name.done ] && return 0
  local left=$(( deadline - $(date +%s) ))
  [ $left -lt 60 ] && { echo "skip $name: ${left}s left"; return 1; }
  echo "== $name ($left s left) $(date -u +%T)" | tee -a $W/jobs.log
  timeout $left "$@" >> $W/$name.log 2>&1 && touch $W/$name.done
  echo "== $name rc=$? $(date -u +%T)" | tee -a $W/jobs.log
}
E="python -m semkv.cli.main eval"
job opt31 $E $Q --task $NIAH --lengths 31744 --methods "$OPT" --out $W/q31
# machine 2 (the first went back after 30 minutes held): the 8k/16k run went on with the two opt-ins that paid at 31k
# (the first machine's rows of the other two stay in the directory)
OPT2="chunkkv[neighbours=1],sentencekv[retain=sentences]"
job niah8_16 $E $Q --task $NIAH --lengths 8192,16384 --methods "$PAPER,$OPT2" --out $W/n8_16
job pct3_31 $E --model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --budgets 0.03 \
  --param chess.anchor=queries --task $NIAH --lengths 31744 --methods "chess,$OPT,${PAPER#full,chess,}" --out $W/q31
# the reports (`semkv report DIR`) were written afterwards on the CPU, from the returned directories
tar czf $out/niah.tgz -C $W --exclude='*.gguf' . && ls -la $out
