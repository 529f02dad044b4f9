python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
for m in ${METHODS:-chunkkv:neighbours=3 chess:anchor=queries full}; do name=${m%%:*}; param=${m#*:}; [ "$param" = "$m" ] && param= || param="--param $param"
 for w in ${WARM:-cold warm}; do flag=; [ $w = warm ] && flag=--warm-up
  export TRITON_CACHE_DIR=/tmp/tc_${name}_$w; rm -rf $TRITON_CACHE_DIR
  PYTHONPATH=$PWD:$PWD/benchmarks timeout ${LIMIT:-200} python3 .carry/watch/compile_watch.py benchmarks/followup_steps.py --shape qwen2.5-0.5b \
    --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --method $name $param --documents 8 \
    --questions 7 --concurrency 8 --new-tokens 64 $flag $EXTRA > $OUT/${name}_$w.log 2>&1
  echo $name $w rc=$?; grep -c COMPILE $OUT/${name}_$w.log; grep '^{' $OUT/${name}_$w.log | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print(d['seconds'], d['warm_up_seconds'], d['wall_ms'], d['ttft_ms'])"; grep END $OUT/${name}_$w.log
 done
done
