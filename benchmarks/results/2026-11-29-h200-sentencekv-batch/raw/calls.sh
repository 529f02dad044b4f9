# The calls of this page, as they ran (one H200; the device tool's run command, and the scripts it ran).
# Each call ran from the repository root of a copy of the working tree, .carry/ carried (the essays, SmolLM2's
# tokenizer, the GGUF of Qwen2.5-Coder-0.5B-Instruct in 16 parts over 16 quick calls, the gguf wheel).
# (The 'git log -1' line of s3.sh printed the device copy's base commit, 2141c5d, whatever tree it ran:
# the trees are named on the results page.)

### call 1: bash .carry/run/s1.sh   (tree 2141c5d)
# session 1: where SentenceKV / DynSplit / CHESS stand at Full KV's largest batch (random weights, qwen2.5-0.5b shape)
set -u
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
export PYTHONPATH=$PWD:$PWD/benchmarks TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $OUT/device.txt
TOK=.carry/data/smollm2-tokenizer
run() {  # name timeout args...
  local name=$1 t=$2; shift 2
  timeout $t python3 benchmarks/profile_step.py --shape qwen2.5-0.5b --tokenizer $TOK --budget 0.1 --batch ${BATCH:-max} \
    --context 31744 --steps 10 --warmup 4 --out /tmp/prof/$name "$@" > /tmp/prof_$name.log 2>&1
  echo "== $name rc=$?"; grep '^{' /tmp/prof_$name.log | tail -1
}
mkdir -p /tmp/prof
run full 150 --method full
run sentencekv 200 --method sentencekv --text-file /tmp/essays.txt --param sentencekv.retain=sentences --param sentencekv.score=tokens --param sentencekv.query=current --param sentencekv.keep_factor=1
run dynsplit 200 --method dynsplit --text-file /tmp/essays.txt --param dynsplit.score=tokens
cd /tmp && tar czf $OUT/s1.tgz prof/*/*.md prof_*.log

### call 2: bash .carry/run/s2.sh   (tree 0bb83a8; .carry/run/old = git archive 2141c5d semkv)
# session 2: bucket_best sweep; Full KV and SentenceKV at Full KV's largest batch, this tree and HEAD's (random weights)
set -u
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $OUT/device.txt
PYTHONPATH=$PWD TRITON_CACHE_DIR=/tmp/tc timeout 150 python3 .carry/run/sweep.py > $OUT/sweep.jsonl 2>&1; tail -3 $OUT/sweep.jsonl
TOK=.carry/data/smollm2-tokenizer
SK="--method sentencekv --text-file /tmp/essays.txt --param sentencekv.retain=sentences --param sentencekv.score=tokens --param sentencekv.query=current --param sentencekv.keep_factor=1"
run() {  # tree name timeout args...
  local tree=$1 name=$2 t=$3; shift 3
  PYTHONPATH=$tree:$PWD/benchmarks TRITON_CACHE_DIR=/tmp/tc_$(basename $tree) timeout $t python3 benchmarks/profile_step.py \
    --shape qwen2.5-0.5b --tokenizer $TOK --budget 0.1 --batch 335 --context 31744 --steps 20 --warmup 4 \
    --out /tmp/prof/$name "$@" > /tmp/prof_$name.log 2>&1
  echo "== $name rc=$?"; grep '^{' /tmp/prof_$name.log | tail -1
}
mkdir -p /tmp/prof
run $PWD full_new 130 --method full
run $PWD sentencekv_new 170 $SK
run $PWD/.carry/run/old sentencekv_old 170 $SK
cd /tmp && tar czf $OUT/s2.tgz prof/*/*.md prof_*.log

### call 20: bash .carry/run/s3.sh   (tree 0bb83a8)
# session 3: issue 55 at Qwen2.5-Coder-0.5B real weights, real prefills of the essays, 31,744 tokens: Full KV and
# SentenceKV's retrieving mode at 16 rows and at Full KV's largest batch, one semkv bench call
set -u
(cd .carry/qwen && cat qwen.gguf.?? > /tmp/qwen.gguf) && [ "$(sha256sum < /tmp/qwen.gguf | cut -d' ' -f1)" = "$(head -1 .carry/qwen/SHA256SUMS | cut -d' ' -f1)" ] || { echo "qwen.gguf: bad sum"; exit 1; }
pip install -q --no-deps --target /tmp/pp .whl/vllm-carry/gguf-0.19.0-py3-none-any.whl
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $OUT/device.txt
git log -1 --format=%H 2>/dev/null | tee -a $OUT/device.txt
export PYTHONPATH=$PWD:/tmp/pp SEMKV_CACHE_DIR=/tmp/sc TRITON_CACHE_DIR=/tmp/tc
timeout 540 python3 -m semkv.cli.main bench --model /tmp/qwen.gguf --text-file /tmp/essays.txt --contexts 31744 \
  --budget 0.1 --steps 16 --batches 16,fullmax --methods full,sentencekv --param sentencekv.retain=sentences \
  --param sentencekv.score=tokens --param sentencekv.query=current --param sentencekv.keep_factor=1 \
  --out /tmp/bench > /tmp/bench.log 2>&1
echo "rc=$?"; grep -v '^{' /tmp/bench.log | tail -n 12
cd /tmp && tar czf $OUT/bench.tgz --exclude='*.png' bench bench.log

### call 21 (same machine, warm, tree 0bb83a8):
export PYTHONPATH=$PWD:/tmp/pp SEMKV_CACHE_DIR=/tmp/sc TRITON_CACHE_DIR=/tmp/tc; timeout 560 python3 -m semkv.cli.main bench --model /tmp/qwen.gguf --text-file /tmp/essays.txt --contexts 31744 --budget 0.1 --steps 16 --batches 16,fullmax --methods full,dynsplit,tokenselect --param dynsplit.score=tokens --param tokenselect.prefill=full --out /tmp/bench2 > /tmp/bench2.log 2>&1

### call 38: bash .carry/run/s4.sh   (tree cf38502; sweep.py as in this folder, then s3.sh)
set -u
PYTHONPATH=$PWD TRITON_CACHE_DIR=/tmp/tc timeout 60 python3 .carry/run/sweep.py > $OUT/sweep.jsonl 2>&1; grep '^{' $OUT/sweep.jsonl
bash .carry/run/s3.sh
