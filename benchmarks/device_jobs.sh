# Sourced by the device scripts of the quality pages (results/*/commands/*.sh) as `source benchmarks/device_jobs.sh
# "$@"`: the set-up of one device call and the resumable job runner. The caller sets W (its working folder under .gpu/,
# kept while the machine is warm) and may set PARTS (the model's parts, default .gpu/q2/part_*) and TAG (a suffix of
# the device and checksum logs). Arguments: SECONDS [JOB...]: the call's time for jobs, and the only jobs to run
# (default all). It sets out ($OUT or /tmp/out), E (semkv eval), NIAH (the eight RULER NIAH tasks) and `job NAME
# COMMAND...`: run unless done or not asked for, within the deadline. A finished job leaves NAME.done in W, so a call
# that reaches its time limit is continued by the next call on the same machine. The quality pages' shared settings:
# M (the eval flags of the Qwen suite: the carried model, 20 samples, batched, CHESS anchored on the queries), OTHER
# (the five non-NIAH RULER tasks), BASE (the seven baselines), PAPER (the five paper methods as published) and OPT
# (their opt-in modes that retrieve).
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p $W
deadline=$(( $(date +%s) + ${1:-560} ))
only=" ${*:2} "
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $W/device${TAG:-}.txt
if [ ! -f /tmp/qwen.gguf ]; then
  cat ${PARTS:-.gpu/q2/part_*} > /tmp/qwen.gguf && sha256sum /tmp/qwen.gguf | tee $W/sha${TAG:-}.txt
fi
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/gw/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
E="python -m semkv.cli.main eval"
NIAH=ruler_niah_single_1,ruler_niah_single_2,ruler_niah_single_3,ruler_niah_multikey_1,ruler_niah_multikey_2
NIAH=$NIAH,ruler_niah_multikey_3,ruler_niah_multivalue,ruler_niah_multiquery
OTHER=ruler_vt,ruler_qa_1,ruler_qa_2,ruler_fwe,ruler_cwe
M="--model /tmp/qwen.gguf --data-dir .gpu/data --samples 20 --batched --param chess.anchor=queries"
BASE="streaming_llm,h2o,snapkv,pyramidkv,quest,keydiff,infllm"
PAPER="chess,chunkkv,sentencekv,dynsplit,tokenselect"
OPT="chunkkv[neighbours=3],sentencekv[retain=sentences,score=tokens],dynsplit[score=tokens],tokenselect[prefill=full]"
job() {
  local name=$1; shift
  [ -f $W/$name.done ] && return 0
  [ "$only" = "  " ] || [[ "$only" == *" $name "* ]] || return 0
  local left=$(( deadline - $(date +%s) ))
  [ $left -lt 60 ] && { echo "skip $name: ${left}s left"; return 1; }
  echo "== $name ($left s left) $(date -u +%T)" | tee -a $W/jobs.log
  timeout $left "$@" >> $W/$name.log 2>&1 && touch $W/$name.done
  echo "== $name rc=$? $(date -u +%T)" | tee -a $W/jobs.log
}
