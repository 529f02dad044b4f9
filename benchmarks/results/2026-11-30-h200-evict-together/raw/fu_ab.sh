# followup_steps on two trees (old: .carry/old/semkv = main's HEAD; new: this working tree), one call
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
for tree in $TREES; do
  root=$PWD; [ $tree = old ] && root=$PWD/.carry/old/semkv
  for m in $METHODS; do name=${m%%:*}; param=${m#*:}; [ "$param" = "$m" ] && param= || param="--param $param"
    PYTHONPATH=$root:$PWD/benchmarks timeout 200 python3 benchmarks/followup_steps.py --shape qwen2.5-0.5b \
      --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --method $name $param --documents 8 \
      --questions 7 --concurrency 8 --new-tokens 64 $EXTRA > $OUT/${name}_${tree}${TAG}.log 2>&1
    echo $name $tree rc=$?; grep '^{' $OUT/${name}_${tree}${TAG}.log | cut -c1-200
  done
done
