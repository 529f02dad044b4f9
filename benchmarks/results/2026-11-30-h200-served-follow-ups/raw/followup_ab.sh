# follow-ups arriving in 2 groups a round: main (this tree) and main + the branch's scheduler (.carry/old), warm-up on
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
export TRITON_CACHE_DIR=/tmp/tc_shared
for run in ${RUNS:-chunkkv:main chunkkv:branch chunkkv:branch chunkkv:main chess:main chess:branch}; do
  m=${run%%:*}; tree=${run#*:}; root=$PWD; [ $tree = branch ] && root=$PWD/.carry/old
  param="--param neighbours=3"; [ $m = chess ] && param="--param anchor=queries"
  i=$((i+1)); PYTHONPATH=$root python3 -c "import semkv.engine.scheduler as s; print(s.__file__)"
  PYTHONPATH=$root:$PWD/benchmarks timeout ${LIMIT:-90} python3 benchmarks/followup_steps.py --shape qwen2.5-0.5b \
    --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --method $m $param \
    --documents 8 --questions 7 --concurrency 8 --new-tokens 64 --stagger 1 --groups 2 --warm-up > $OUT/${i}_${m}_$tree.log 2>&1
  echo $i $m $tree rc=$?; grep '^{' $OUT/${i}_${m}_$tree.log | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print(d['seconds'], d['warm_up_seconds'], d['wall_ms'], d['ttft_ms'])"
done
