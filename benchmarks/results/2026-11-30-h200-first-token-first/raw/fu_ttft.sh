# one call: followup_steps on two trees (old: .carry/old/semkv = main's HEAD; new: this working tree), with each
# follow-up's time to its first token; 8 follow-ups admitted together
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
for m in ${METHODS:-chunkkv:neighbours=3 full chess:anchor=queries}; do name=${m%%:*}; param=${m#*:}; [ "$param" = "$m" ] && param= || param="--param $param"
  for tree in ${TREES:-old new}; do
    root=$PWD; [ $tree = old ] && root=$PWD/.carry/old/semkv
    PYTHONPATH=$root:$PWD/benchmarks timeout ${LIMIT:-200} python3 benchmarks/followup_steps.py --shape qwen2.5-0.5b \
      --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --method $name $param --documents 8 \
      --questions 7 --concurrency 8 --new-tokens 64 $EXTRA > $OUT/${name}_${tree}${TAG}.log 2>&1
    echo $name $tree rc=$?; grep '^{' $OUT/${name}_${tree}${TAG}.log | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print(d['seconds'], d['wall_ms'], d['ttft_ms'])"
  done
done
