#!/usr/bin/env bash
# Device call 39 (one H200, after .carry/data, the gguf wheel and .carry/qwen's 16 parts were carried): the ranking
# and slot-list kernels, issue 55's modes at 16 rows on the model, and the follow-up questions' steps of the tree at
# the session's start (9425d43, in .old/) against this one (random weights of the model's shape).
set -u
mkdir -p .old && tar xzf .oldtgz/old.tgz
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/pp TRITON_CACHE_DIR=/tmp/tc SEMKV_CACHE_DIR=/tmp/sc
pip install -q --no-deps --target /tmp/pp .whl/vllm-carry/gguf-0.19.0-py3-none-any.whl 2>&1 | tail -1
cat .carry/qwen/qwen.gguf.?? > /tmp/qwen.gguf && sha256sum /tmp/qwen.gguf | cut -c1-12
python3 -c "import json; print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" \
  > /tmp/essays.txt
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $OUT/device.txt
timeout 90 python3 benchmarks/kernel_check.py --buckets-only > $OUT/kernels.txt 2>&1; grep '^|' $OUT/kernels.txt
timeout 240 python3 -m semkv.cli.main bench --model /tmp/qwen.gguf --text-file /tmp/essays.txt --contexts 31744 \
  --budget 0.1 --steps 16 --batches 16 --methods full,sentencekv,dynsplit,chess --param chess.anchor=queries \
  --param sentencekv.retain=sentences --param sentencekv.score=tokens --param sentencekv.query=current \
  --param sentencekv.keep_factor=1 --param dynsplit.score=tokens --out $OUT/modes_bench > $OUT/modes_bench.log 2>&1
grep -v '^{' $OUT/modes_bench.log | tail -n 12
for v in new old; do
  P=$PWD; [ $v = old ] && P=$PWD/.old
  PYTHONPATH=$P:$PWD/benchmarks TRITON_CACHE_DIR=/tmp/tc_$v timeout 110 python3 benchmarks/followup_steps.py \
    --shape qwen2.5-0.5b --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --context 32000 \
    --documents 8 --questions 7 --new-tokens 128 --concurrency 8 > $OUT/followup_$v.txt 2>&1
  echo "== $v"; grep '^{' $OUT/followup_$v.txt | cut -c1-700
done
timeout 100 python3 benchmarks/profile_step.py --model /tmp/qwen.gguf --text-file /tmp/essays.txt --budget 0.1 \
  --batch 16 --context 31744 --steps 24 --method sentencekv --param sentencekv.retain=sentences \
  --param sentencekv.score=tokens --param sentencekv.query=current --param sentencekv.keep_factor=1 \
  --out $OUT/profile_sentencekv > $OUT/profile_sentencekv.log 2>&1; grep '^{' $OUT/profile_sentencekv.log | tail -1
rm -f $OUT/profile_sentencekv/*_trace.json
