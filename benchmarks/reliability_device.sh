#!/usr/bin/env bash
# Issue 52's device checks, from the repository root on a device machine:
#   bash benchmarks/reliability_device.sh SECONDS PART...
# PART: soak (memory_soak.py: 5 generates of 32k tokens a method, then compare of every method over 3 prompts),
# bench (`semkv bench --batches max` at 32k for every method, one run a method: a call cut short resumes at the
# next), offload (the same for SentenceKV and DynSplit-KV with offload=True); PART:SHAPE runs it on a random-weight
# shape of semkv bench (qwen2.5-0.5b, llama3-8b...) with the carried tokenizer, PART alone on MODEL (a local model
# folder, default $QWEN from vllm_setup.sh). DATA: the carried data (.carry/data). METHODS: the bench part's methods
# (default every method). Results and logs in $W/reliability (W: VLLM_WORK, default /tmp/w; a run done is not run
# again while the machine is warm), archived into $OUT/reliability.tgz; a bench row skipped for memory names where.
set -uo pipefail
case ${1:-} in -h|--help|"") sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;; esac
seconds=$1; shift
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the scripts import semkv from this checkout
W=${VLLM_WORK:-/tmp/w} out=${OUT:-/tmp/out} DATA=${DATA:-$PWD/.carry/data} MODEL=${MODEL:-${QWEN:-}}
R=$W/reliability; mkdir -p $R $out; end=$(( $(date +%s) + seconds - 20 ))
[ -f $R/essays.txt ] || python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['text'])" \
  $DATA/paul_graham/ruler_PaulGrahamEssays.json > $R/essays.txt
ALL=${METHODS:-$(python3 -c "from semkv.methods.specs import SPECS; print(','.join(SPECS))")}
B="python3 -m semkv.cli.main bench --batches max --contexts 32000 --budget 0.1 --steps 8"
OFF="--methods sentencekv,dynsplit --param sentencekv.offload=True --param dynsplit.offload=True"
left() { echo $(( end - $(date +%s) )); }
run() { [ -f $R/$1.done ] && return; [ $(left) -lt 60 ] && { echo "skip $1"; return; }; echo "== $1"
        timeout $(left) "${@:2}" > $R/$1.log 2>&1 && touch $R/$1.done; grep -v '^{' $R/$1.log | tail -n 40; }
for part in "$@"; do
  name=${part%%:*} shape=${part#*:}
  if [ "$shape" = "$part" ]; then
    [ -n "$MODEL" ] || { echo "part $part needs MODEL (or QWEN: a model folder), or name a shape: $part:SHAPE" >&2; exit 2; }
    src="--model $MODEL" tag=model; else
    src="--shape $shape --tokenizer $DATA/smollm2-tokenizer" tag=$shape; fi
  case $name in
  soak) run soak_$tag python3 benchmarks/memory_soak.py $src --text-file $R/essays.txt --requests 5 --per-call 1 \
          --prompts 3 --context 32000 --new-tokens 16 --time-limit 200 --out $R/soak_$tag ;;
  bench) for m in ${ALL//,/ }; do run bench_${tag}_$m $B $src --methods $m --out $R/bench_${tag}_$m; done ;;
  offload) run offload_$tag $B $src $OFF --out $R/offload_$tag ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
tar czf $out/reliability.tgz -C $W --exclude=essays.txt reliability && ls -la $out/reliability.tgz
