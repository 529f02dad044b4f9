# followup_steps for three methods, admitted together (stagger 0) and one at a time (stagger 16)
export PYTHONPATH=$PWD:$PWD/benchmarks
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
nvidia-smi --query-gpu=name --format=csv,noheader
for m in ${METHODS:-full chunkkv:neighbours=3 chess:anchor=queries}; do name=${m%%:*}; param=${m#*:}; [ "$param" = "$m" ] && param= || param="--param $param"
  for st in ${STAGGERS:-0 16}; do
    timeout ${LIMIT:-150} python3 benchmarks/followup_steps.py --shape qwen2.5-0.5b \
      --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --method $name $param --documents 8 \
      --questions 7 --concurrency 8 --new-tokens ${NEW:-128} --stagger $st $EXTRA > $OUT/${name}_s${st}${TAG}.log 2>&1
    echo $name s$st rc=$?; grep '^{' $OUT/${name}_s${st}${TAG}.log | cut -c1-600
  done
done
