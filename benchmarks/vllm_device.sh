#!/usr/bin/env bash
# One device call of the vLLM comparison (issues 54 and 53), from the repository root on the device machine:
#   bash benchmarks/vllm_device.sh STAGE [SECONDS] [ARGS...]
# STAGE: status (which carried parts are there), setup (install vLLM, convert the model: benchmarks/vllm_setup.sh),
# offline (vllm_offline.py; the vLLM run also answers vllm_quality.py's NIAH samples), quality (vllm_quality.py,
# semkv's side), serve (vllm_serve.py), serve8b (vllm_serve.py on the random Llama-3.1-8B shape), reliability
# (issue 52: memory_soak.py's 5 generates of 32k a method and compare of every method over 3 prompts, then
# `semkv bench --batches max` at 32k for every method and both offloading modes, on the model and the 8B shape;
# ARGS: reliability_device.sh's parts, default all), profile (session_prefill.py on the model: the engine's rate
# against the server's scheduler without the web process, with cProfile and torch.profiler), modes (issue 55:
# profile_step.py on the model for Full KV and every retrieving mode at 10%, 16 x 31,744 with real prefills: where a
# decode step's device and host time go), modes_bench (issue 55's targets: `semkv bench` with real prefills at
# 31,744, batch 16 and Full KV's largest batch, Full KV, CHESS, ChunkKV, the retrieving modes, TokenSelect at
# theta=0.95 (its setting at Full KV's RULER score) and its int8 key sketch, with each one's served tokens/s;
# ARGS: e.g. --methods full,sentencekv to run fewer), kernels (kernel_check.py: each Triton kernel against its
# reference and its speed), decode (issue 54: full decode attention through FlashAttention 3, vLLM's, against the
# Triton kernel: kernel_check.py's decode rows, then `semkv bench` with real prefills at 31,744, batches 16 and 64,
# Full KV and ChunkKV neighbours=3 at 10%, SEMKV_DECODE_ATTENTION=triton then auto, each its own process), fa3
# (FlashAttention 3, vLLM's, against cuDNN as the prefill attention: kernel_check.py's prefill rows,
# then first_steps.py's server sessions on the model with SEMKV_PREFILL_ATTENTION=cudnn and auto, 32 x 32k with 512
# new tokens and 128 x 2k with 64), syncs (first_steps.py --sync-debug on the model, 32 x 32k, 16 at a time, for
# Full KV, CHESS anchor="queries" and ChunkKV neighbours=3 at 10%: every wait of the host for the device in a
# server's session, by call site, and the steps' times), ruler (`semkv eval` of the eight RULER NIAH tasks, 20
# samples, batched, into $W/ruler; ARGS: its --methods, --lengths, --budgets...; a rerun resumes), ab (this tree's
# scheduler against another's, `git archive REV semkv benchmarks | tar -x -C .carry/old/semkv` less
# benchmarks/results, carried: followup_steps.py's follow-ups on 8 cached documents, admitted one at a time
# (--stagger 16) and eight at a time, and first_steps.py's prompt rate, 64 x 32,000 tokens with 1 new token 64 at a
# time, and 32 x 32,000 with 512 new tokens 16 at a time (the decode steps; dynsplit_steps: the same under DynSplit-KV
# score="tokens" at 10%); this tree's scripts over each tree's
# semkv, each in its own process, old then new, on the model; a run done while the machine is warm is kept; ARGS:
# the runs to make, e.g. decode_steps, default all), ab_serve (the serve stage's phases, shared_first and
# shared_followup by default, under the server of the tree in .carry/old/semkv, then of this tree, each with its own
# vllm_serve.py: a served change against the machine's host; ChunkKV neighbours=3 at 10% unless ARGS, vllm_serve.py's,
# name --servers; AB_ROUND=N keeps a repeat in folders of its own, old<N> and new<N>), steps
# (issue 53: Full KV's and ChunkKV's servers at c64 with step budgets of 2,048 and 4,096 tokens,
# --max-num-batched-tokens: ITL p99 / p50 against the prompt rate; a budget written 8192-dynamic with dynamic chunking),
# long_prompts (serve_overhead.py long-prompts on the model: a stream's gaps while long prompts, refused after the web
# process tokenized them, arrive). SECONDS (default 540): the stage's time, so
# the archive of its results is written inside the call's 10 minutes; ARGS go to the stage's script (e.g. --runs
# full,vllm, --servers vllm,full, --phases c64). Work stays in /tmp/w while the machine is warm: a stage cut short
# resumes where it stopped when called again. Each stage ends by packing its folder into $OUT/<stage>.tgz (prompts
# left out: they are remade from the essays) and printing its tables.
set -uo pipefail
stage=${1:?usage: vllm_device.sh status|setup|offline|quality|serve|serve8b|reliability|profile|modes|modes_bench|kernels|decode|fa3|syncs|ruler|ab|ab_serve|steps|long_prompts [SECONDS] [ARGS...]}
shift
case $stage in -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;; esac
seconds=540
if [[ ${1:-} =~ ^[0-9]+$ ]]; then seconds=$1; shift; fi
W=${VLLM_WORK:-/tmp/w} out=${OUT:-/tmp/out} start=$(date +%s)
mkdir -p $W $out
if [ "$stage" = status ]; then bash benchmarks/vllm_setup.sh status; exit 0; fi
source benchmarks/vllm_setup.sh install || exit 1  # (an argument, so that it does not see this script's)
[ "$stage" = setup ] && exit 0
nvidia-smi -i ${CUDA_VISIBLE_DEVICES:-0} --query-gpu=index,name,memory.used,memory.total --format=csv,noheader | tee -a $W/device.txt
essays() {  # the RULER essays as one text file, $W/essays.txt (what the real prefills read)
  python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['text'])" \
    $DATA/paul_graham/ruler_PaulGrahamEssays.json > $W/essays.txt
}
pack() {  # the stage's folder into $OUT, then its tables
  tar czf $out/$1.tgz -C $W --exclude=prompts --exclude=prompts.json.gz $1 device.txt && ls -la $out/$1.tgz
  python3 benchmarks/vllm_page.py --$2 $W/$1
}
case $stage in
offline)
  python3 benchmarks/vllm_offline.py --model $QWEN --data $DATA --out $W/offline --niah $W/quality \
    --deadline $((seconds - 15)) "$@"
  tar czf $out/quality_vllm.tgz -C $W quality 2>/dev/null
  pack offline offline ;;
quality)
  timeout $seconds python3 benchmarks/vllm_quality.py --model $QWEN --data $DATA --out $W/quality --sides semkv "$@"
  pack quality quality ;;
serve)  # into $W/serve, or $W/$SERVE_RUN (another call's runs of the same servers, kept apart)
  run=${SERVE_RUN:-serve}
  python3 benchmarks/vllm_serve.py --model $QWEN --data $DATA --out $W/$run --deadline $((seconds - 15)) "$@"
  pack $run serve ;;
steps)  # issue 53's ITL p99 / p50 against the step budget: semkv's servers at c64 with --max-num-batched-tokens of
  # 2048, 4096 (the default 8192 is the serve stage's; STEP_BUDGETS="2048 8192" names others, and a budget written
  # 8192-dynamic runs semkv's servers with --enable-dynamic-chunking, into steps/8192-dynamic); ARGS: e.g. --servers
  # full, --servers "vllm,chess[anchor=queries]" (vLLM at the same budget), or the 8B shape at 16 requests: --shape
  # llama3-8b --phases c16 --concurrency 16 --requests 32 (a budget done is kept)
  runs=${STEP_BUDGETS:-2048 4096}
  for run in $runs; do
    budget=${run%-dynamic} dynamic=()
    [ "$run" != "$budget" ] && dynamic=(--semkv-flag=--enable-dynamic-chunking)
    python3 benchmarks/vllm_serve.py --model $QWEN --data $DATA --out $W/steps/$run --phases c64 \
      --servers "full,chunkkv[neighbours=3]" --semkv-flag=--max-num-batched-tokens=$budget "${dynamic[@]}" \
      --vllm-flag=--max-num-batched-tokens=$budget \
      --deadline $(( seconds - 15 - ($(date +%s) - start) )) "$@"
  done
  tar czf $out/steps.tgz -C $W --exclude=prompts --exclude=prompts.json.gz steps device.txt
  for run in $runs; do
    echo "== $run"; python3 benchmarks/vllm_page.py --serve $W/steps/$run | grep -A12 '^\*\*c[0-9]'
  done ;;
reliability)  # benchmarks/reliability_device.sh on the converted model and the 8B shape
  bash benchmarks/reliability_device.sh $seconds ${*:-soak bench offload bench:llama3-8b offload:llama3-8b} ;;
long_prompts)  # whether the web process's tokenizing of long prompts stalls the others' tokens (serve_overhead.py),
  # tokenized in the web process's threads (--tokenizer-processes 0) and in a tokenizer process (the default)
  for n in 0 1; do
    echo "--tokenizer-processes $n" | tee -a $out/long_prompts.txt
    timeout $(( seconds / 2 )) python3 benchmarks/serve_overhead.py long-prompts --model $QWEN --device cuda \
      --tokens 4000 --serve-flag=--tokenizer-processes=$n "$@" | tee -a $out/long_prompts.txt
  done ;;
profile)  # where the server's time goes, without the web process
  essays
  timeout $seconds python3 benchmarks/session_prefill.py --model $QWEN --text-file $W/essays.txt --out $W/profile "$@"
  tar czf $out/profile.tgz -C $W profile device.txt ;;
modes)  # issue 55's modes, one profile each (a mode profiled before while the machine is warm is not run again)
  essays
  end=$(( $(date +%s) + seconds - 20 ))
  for mode in "full" "chess --param chess.anchor=queries" "chunkkv --param chunkkv.neighbours=3" \
      "sentencekv --param sentencekv.retain=sentences --param sentencekv.score=tokens \
       --param sentencekv.query=current --param sentencekv.keep_factor=1" \
      "dynsplit --param dynsplit.score=tokens" "tokenselect --param tokenselect.prefill=full"; do
    read -ra words <<< "$mode"
    [ -f $W/modes/${words[0]}/${words[0]}_profile.md ] && continue
    (( $(date +%s) + 60 > end )) && { echo "modes: ${words[0]} not started: too little time left"; continue; }
    timeout $(( end - $(date +%s) )) python3 benchmarks/profile_step.py --model $QWEN --text-file $W/essays.txt \
      --budget 0.1 --batch 16 --context 31744 --steps 24 --method "${words[@]}" --out $W/modes/${words[0]} \
      > $W/modes_${words[0]}.log 2>&1
    mkdir -p $W/modes && mv $W/modes_${words[0]}.log $W/modes/${words[0]}.log
    grep '^{' $W/modes/${words[0]}.log | tail -1
  done
  tar czf $out/modes.tgz -C $W --exclude='*_trace.json' modes device.txt ;;
modes_bench)  # issue 55's targets, one bench call (the rows of the methods it reached if cut short)
  essays
  timeout $((seconds - 15)) python3 -m semkv.cli.main bench --model $QWEN --text-file $W/essays.txt --contexts 31744 \
    --budget 0.1 --steps 16 --batches 16,fullmax \
    --methods "full,sentencekv,dynsplit,tokenselect,tokenselect[theta=0.95],chess,chunkkv,\
tokenselect[score_keys=int8]" \
    --param chess.anchor=queries --param chunkkv.neighbours=3 --param sentencekv.retain=sentences \
    --param sentencekv.score=tokens --param sentencekv.query=current --param sentencekv.keep_factor=1 \
    --param dynsplit.score=tokens --param tokenselect.prefill=full --out $W/modes_bench "$@" > $W/modes_bench.log 2>&1
  grep -v '^{' $W/modes_bench.log | tail -n 20
  tar czf $out/modes_bench.tgz -C $W --exclude='*.png' modes_bench modes_bench.log device.txt ;;
kernels)  # benchmarks/kernel_check.py: every Triton kernel against its reference, then its speed
  timeout $seconds python3 benchmarks/kernel_check.py "$@" | tee $out/kernels.txt ;;
decode)  # full decode attention: FlashAttention 3 against the Triton kernel, kernels then benches (a path done is kept)
  essays
  mkdir -p $W/decode
  end=$(( $(date +%s) + seconds - 20 ))
  [ -f $W/decode/kernels.txt ] || timeout 120 python3 benchmarks/kernel_check.py --decode-only \
    > $W/decode/kernels.txt 2>&1
  grep '^| decode' $W/decode/kernels.txt
  for path in triton auto; do
    log=$W/decode/bench_$path.log
    [ -f $log ] && continue
    (( $(date +%s) + 60 > end )) && { echo "decode: $path not started: too little time left"; continue; }
    SEMKV_DECODE_ATTENTION=$path timeout $(( end - $(date +%s) )) python3 -m semkv.cli.main bench --model $QWEN \
      --text-file $W/essays.txt --contexts 31744 --budget 0.1 --steps 32 --batches 16,64 --methods full,chunkkv \
      --param chunkkv.neighbours=3 --out $W/decode/$path "$@" > $log.part 2>&1 && mv $log.part $log
    echo "== $path"; grep -v '^{' $log* | tail -n 8
  done
  tar czf $out/decode.tgz -C $W --exclude='*.png' decode device.txt ;;
fa3)  # the prefill attention of full chunks: FlashAttention 3 against cuDNN, kernels then sessions, pairs in turn
  essays
  mkdir -p $W/fa3
  end=$(( $(date +%s) + seconds - 20 ))
  [ -f $W/fa3/kernels.txt ] || timeout 150 python3 benchmarks/kernel_check.py --prefill-only > $W/fa3/kernels.txt 2>&1
  grep '^| prefill' $W/fa3/kernels.txt
  for shape in "--context 32000 --requests 32 --new-tokens 512 --max-num-seqs 16" \
               "--context 2000 --requests 128 --new-tokens 64 --max-num-seqs 32"; do
    for path in cudnn auto; do
      read -ra words <<< "$shape"
      log=$W/fa3/${path}_${words[1]}.log
      [ -f $log ] && continue
      (( $(date +%s) + 90 > end )) && { echo "fa3: $path ${words[1]} not started: too little time left"; continue; }
      SEMKV_PREFILL_ATTENTION=$path TRITON_CACHE_DIR=$W/tc-$path PYTHONPATH=$PYTHONPATH:$PWD/benchmarks \
        timeout $(( end - $(date +%s) )) python3 benchmarks/first_steps.py --model $QWEN --text-file $W/essays.txt \
        --runs 2 "${words[@]}" > $log.part 2>&1 && mv $log.part $log
      echo "== $path ${words[*]}"; grep '^{' $log* | cut -c1-400
    done
  done
  tar czf $out/fa3.tgz -C $W fa3 device.txt ;;
syncs)  # where a server's session waits for the device, per method (a method done while the machine is warm is kept)
  essays
  mkdir -p $W/syncs
  end=$(( $(date +%s) + seconds - 20 ))
  for mode in "full" "chess --param anchor=queries" "chunkkv --param neighbours=3"; do
    read -ra words <<< "$mode"
    log=$W/syncs/${words[0]}.log
    [ -f $log ] && continue
    (( $(date +%s) + 90 > end )) && { echo "syncs: ${words[0]} not started: too little time left"; continue; }
    TRITON_CACHE_DIR=$W/tc-syncs PYTHONPATH=$PYTHONPATH:$PWD/benchmarks timeout $(( end - $(date +%s) )) \
      python3 benchmarks/first_steps.py --model $QWEN --text-file $W/essays.txt --runs 2 --context 32000 \
      --requests 32 --new-tokens 512 --max-num-seqs 16 --sync-debug --method "${words[@]}" > $log.part 2>&1 \
      && mv $log.part $log
    echo "== ${words[*]}"; grep '^{"run": 1' $log* | cut -c1-1500
  done
  tar czf $out/syncs.tgz -C $W syncs device.txt ;;
ruler)  # RULER NIAH quality of the modes named in ARGS (the suite pages' tasks and samples)
  niah=ruler_niah_single_1,ruler_niah_single_2,ruler_niah_single_3,ruler_niah_multikey_1,ruler_niah_multikey_2
  timeout $((seconds - 15)) python3 -m semkv.cli.main eval --model $QWEN --data-dir $DATA --samples 20 --batched \
    --task $niah,ruler_niah_multikey_3,ruler_niah_multivalue,ruler_niah_multiquery --out $W/ruler "$@" \
    > $W/ruler.log 2>&1
  tail -n 5 $W/ruler.log
  tar czf $out/ruler.tgz -C $W ruler ruler.log device.txt ;;
ab)  # the scheduler of this tree against another's: prompt rate and follow-ups, each tree in its own process
  essays
  mkdir -p $W/ab
  end=$(( $(date +%s) + seconds - 20 ))
  [ -d .carry/old/semkv/semkv ] || { echo "ab: no tree in .carry/old/semkv"; exit 2; }
  # each run: a log name, then this tree's script and its arguments (the old tree's semkv imported first for "old")
  followups="followup_steps.py --documents 8 --questions 7 --concurrency 8 --new-tokens 128"
  for run in "followup_stagger $followups --stagger 16" "followup_steps $followups" \
             "first_steps first_steps.py --context 32000 --requests 64 --new-tokens 1 --max-num-seqs 64 --runs 2" \
             "decode_steps first_steps.py --context 32000 --requests 32 --new-tokens 512 --max-num-seqs 16 --runs 2" \
             "dynsplit_steps first_steps.py --context 32000 --requests 32 --new-tokens 512 --max-num-seqs 16 --runs 2 \
              --method dynsplit --param score=tokens"; do
    for tree in old new; do
      read -ra words <<< "$run"
      [ $# -gt 0 ] && [[ " $* " != *" ${words[0]} "* ]] && continue
      root=$PWD; [ $tree = old ] && root=$PWD/.carry/old/semkv
      log=$W/ab/${words[0]}_$tree.log
      [ -f $log ] && continue
      (( $(date +%s) + 90 > end )) && { echo "ab: ${words[0]} $tree not started: too little time left"; continue; }
      (cd $root && PYTHONPATH=$root:$PYTHONPATH:$root/benchmarks TRITON_CACHE_DIR=$W/tc-$tree \
        timeout $(( end - $(date +%s) )) python3 $OLDPWD/benchmarks/${words[1]} --model $QWEN \
        --text-file $W/essays.txt "${words[@]:2}") > $log.part 2>&1 && mv $log.part $log
      echo "== $tree ${words[*]}"; grep '^{' $log* | cut -c1-900
    done
  done
  tar czf $out/ab.tgz -C $W ab device.txt ;;
ab_serve)  # the serve stage's phases under the old tree's server, then this tree's (a phase done is kept)
  [ -d .carry/old/semkv/semkv ] || { echo "ab_serve: no tree in .carry/old/semkv"; exit 2; }
  mkdir -p $W/ab_serve
  end=$(( $(date +%s) + seconds - 20 ))
  for tree in old new; do
    root=$PWD left=$(( end - $(date +%s) )) name=$tree${AB_ROUND:-}
    [ $tree = old ] && root=$PWD/.carry/old/semkv left=$(( left / 2 ))  # half the time each
    # each tree's own vllm_serve.py (the workload's helpers import its semkv)
    (cd $root && PYTHONPATH=$root:$PYTHONPATH:$root/benchmarks python3 benchmarks/vllm_serve.py --model $QWEN \
      --data $DATA --out $W/ab_serve/$name --phases shared_first,shared_followup --servers "chunkkv[neighbours=3]" \
      --deadline $left "$@") \
      > $W/ab_serve/$name.log 2>&1
    echo "== $name"; python3 benchmarks/vllm_page.py --serve $W/ab_serve/$name | grep -A6 'shared_.*\*\*'
  done
  tar czf $out/ab_serve.tgz -C $W --exclude=prompts --exclude=prompts.json.gz ab_serve device.txt ;;
serve8b)  # semkv's servers (vLLM's detokenizer meets ids past the small tokenizer's), phases sized for 4 GiB of K/V
  # a request: 16 at once
  python3 benchmarks/vllm_serve.py --shape llama3-8b --data $DATA --out $W/serve8b --deadline $((seconds - 15)) \
    --servers "full,chess[anchor=queries],chunkkv[neighbours=3]" --prefill 16 --concurrency 16 --requests 32 "$@"
  pack serve8b serve ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac
