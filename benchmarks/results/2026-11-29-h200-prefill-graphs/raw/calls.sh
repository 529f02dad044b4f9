# call 1
set -x
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
export PYTHONPATH=$PWD:$PWD/benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 .hostparts.py > $OUT/hostparts.txt 2>&1; tail -40 $OUT/hostparts.txt
for v in new old; do P=$PWD; [ $v = old ] && P=$PWD/.old
  TRITON_CACHE_DIR=/tmp/tc_$v PYTHONPATH=$P:$PWD/benchmarks timeout 200 python3 benchmarks/first_steps.py \
    --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --runs 2 > $OUT/first_steps_$v.jsonl 2>$OUT/first_steps_$v.err; cat $OUT/first_steps_$v.jsonl; tail -3 $OUT/first_steps_$v.err; done
python3 - <<'P'
import glob, json, os
for f in sorted(glob.glob('/tmp/tc_new/*/*.json'), key=os.path.getmtime):
    if os.path.basename(f).startswith('__grp__'): continue
    d = json.load(open(f)); print(os.path.getmtime(f), d.get('name'), {k: v for k, v in d.items() if k in ('constants', 'signature', 'attrs', 'num_warps', 'num_stages')})
P
# call 2
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
export PYTHONPATH=$PWD:$PWD/benchmarks
timeout 150 python3 .gcheck.py qwen2.5-0.5b 2>&1 | grep -v Warn | tee $OUT/gcheck.txt
for v in new old; do P=$PWD; [ $v = old ] && P=$PWD/.old
  TRITON_CACHE_DIR=/tmp/tc_$v PYTHONPATH=$P:$PWD/benchmarks timeout 170 python3 benchmarks/first_steps.py \
    --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --runs 2 > $OUT/first_steps_$v.jsonl 2>$OUT/first_steps_$v.err; cat $OUT/first_steps_$v.jsonl; tail -2 $OUT/first_steps_$v.err; done
A="--shape qwen2.5-0.5b --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --context 32000 --requests 32 --methods full"
for v in new old; do P=$PWD; [ $v = old ] && P=$PWD/.old
  PYTHONPATH=$P:$PWD/benchmarks timeout 120 python3 benchmarks/session_prefill.py $A --new-tokens 1 --budgets 8192,2048 --profile "" --out $OUT/prefill_$v > $OUT/prefill_$v.log 2>&1; tail -8 $OUT/prefill_$v.log; done
# call 3
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
export PYTHONPATH=$PWD:$PWD/benchmarks
timeout 120 python3 .gcheck.py qwen2.5-0.5b 2>&1 | grep -v "Warn\|allocator_settings\|shards" | tee $OUT/gcheck.txt
for v in new old; do P=$PWD; [ $v = old ] && P=$PWD/.old
  TRITON_CACHE_DIR=/tmp/tc_$v PYTHONPATH=$P:$PWD/benchmarks timeout 100 python3 benchmarks/first_steps.py \
    --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --runs 2 --context 2000 --requests 128 --new-tokens 64 --max-num-seqs 32 > $OUT/short_$v.jsonl 2>$OUT/short_$v.err; cat $OUT/short_$v.jsonl; done
A="--shape qwen2.5-0.5b --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --context 32000 --requests 32 --methods full"
timeout 150 python3 benchmarks/session_prefill.py $A --new-tokens 512 --max-num-seqs 16 --budgets 8192 --profile 8192 --out $OUT/c16 > $OUT/c16.log 2>&1; tail -8 $OUT/c16.log; ls $OUT/c16
# call 4
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
export PYTHONPATH=$PWD:$PWD/benchmarks
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 200 python3 .gcheck.py llama3-8b 2>&1 | grep -v "Warn\|allocator_settings\|shards" | tee $OUT/gcheck8b.txt
for v in new old; do P=$PWD; [ $v = old ] && P=$PWD/.old
  TRITON_CACHE_DIR=/tmp/tc_$v PYTHONPATH=$P:$PWD/benchmarks timeout 130 python3 benchmarks/first_steps.py --shape llama3-8b \
    --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --runs 2 --context 2000 --requests 64 --new-tokens 64 --max-num-seqs 32 > $OUT/short8b_$v.jsonl 2>$OUT/short8b_$v.err; cat $OUT/short8b_$v.jsonl; tail -2 $OUT/short8b_$v.err; done
# call 5 (the cuDNN path of HEAD~ saved as .oldcudnn.py: git show f6562e2:semkv/kernels/cudnn_prefill.py)
timeout 230 python3 .ab.py | tee $OUT/ab.txt
# call 6 (.old: git archive f6562e2 semkv; new: 0b546ca's tree)
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
for v in new old; do P=$PWD; [ $v = old ] && P=$PWD/.old
  TRITON_CACHE_DIR=/tmp/tc_$v PYTHONPATH=$P:$PWD/benchmarks timeout 95 python3 benchmarks/first_steps.py \
    --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --runs 2 > $OUT/first_steps_$v.jsonl 2>$OUT/first_steps_$v.err; cat $OUT/first_steps_$v.jsonl; done
