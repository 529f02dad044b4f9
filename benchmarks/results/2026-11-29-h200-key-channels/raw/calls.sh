# The calls of this page, as they ran (one H200; the device tool's run command, and the scripts it ran). Each call ran
# from the repository root of a copy of the working tree, .carry/ carried (the essays and RULER data, SmolLM2's
# tokenizer, the GGUF of Qwen2.5-Coder-0.5B-Instruct in 16 parts of 30 MiB over 16 quick calls, the gguf wheel).
# chunk_sweep.py and bucket_sweep.py beside this file are their last versions (call 3's and call 2's); call 1's
# chunk_sweep.py timed exact keys at block 64 and channels at blocks 64-512 with four warps (and compared outputs with
# torch.equal), call 2's timed exact keys at 64/128/256 and channels at 64/128/256 with four warps (its error fields
# subtract infinities and read NaN: ignore them; call 3's compare finite entries).
# Trees: main a641010 plus, call 1: DynSplit-KV's key channels (the old chunk_best with fold_max); call 2: fold_runs
# with one program a KV head (the committed kernel); call 3: one program for both KV heads (slower, not kept); calls
# 20-22 and 39: the committed tree but for `channels`, 8 by default then (16 now; call 21's second DynSplit-KV row and
# call 22's dynsplit_ch16 passed 16).

### calls 1-3: bash .carry/run/d1.sh   (call 3 without its bucket sweep line)
# session 26, call 1: chunk_best with exact keys against key channels (random keys, no model)
set -u
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $OUT/device.txt
PYTHONPATH=$PWD TRITON_CACHE_DIR=/tmp/tc timeout 200 python3 .carry/run/chunk_sweep.py 2>&1 | tee $OUT/chunk_sweep.jsonl | tail -4
PYTHONPATH=$PWD TRITON_CACHE_DIR=/tmp/tc timeout 200 python3 .carry/run/sweep.py 2>&1 | tee $OUT/bucket_sweep.jsonl | tail -20

### calls 4-19: the qwen parts (ls .carry/qwen | wc -l, carrying .carry/qwen/qwen.gguf.NN); call 20: bash .carry/run/d2.sh
# session 26: DynSplit-KV score="tokens", score_keys="channels" and SentenceKV's retrieving mode against Full KV at 16 rows and Full KV's largest batch,
# Qwen2.5-Coder-0.5B real weights, real prefills of the essays, one semkv bench call
set -u
(cd .carry/qwen && cat qwen.gguf.?? > /tmp/qwen.gguf) && [ "$(sha256sum < /tmp/qwen.gguf | cut -d' ' -f1)" = "$(head -1 .carry/qwen/SHA256SUMS | cut -d' ' -f1)" ] || { echo "qwen.gguf: bad sum"; exit 1; }
pip install -q --no-deps --target /tmp/pp .whl/vllm-carry/gguf-0.19.0-py3-none-any.whl
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $OUT/device.txt
export PYTHONPATH=$PWD:/tmp/pp SEMKV_CACHE_DIR=/tmp/sc TRITON_CACHE_DIR=/tmp/tc
timeout ${BENCH_S:-500} python3 -m semkv.cli.main bench --model /tmp/qwen.gguf --text-file /tmp/essays.txt --contexts 31744 \
  --budget 0.1 --steps 16 --batches 16,fullmax --methods ${METHODS:-full,sentencekv,dynsplit} --param dynsplit.score=tokens \
  --param dynsplit.score_keys=channels --param sentencekv.retain=sentences --param sentencekv.score=tokens \
  --param sentencekv.query=current --param sentencekv.keep_factor=1 --out /tmp/bench > /tmp/bench.log 2>&1
echo "rc=$?"; grep -v '^{' /tmp/bench.log | tail -n 12
cd /tmp && tar czf $OUT/bench.tgz --exclude='*.png' bench bench.log

### call 21: bash .carry/run/d3.sh (the machine still warm: /tmp/qwen.gguf of call 20)
# session 26: RULER NIAH (8 tasks, 20 samples, 8k/16k/31k, 10%) of Full KV and DynSplit-KV's token scores, exact keys
# and key channels, on the judge's GGUF (joined by d2.sh)
set -u
export PYTHONPATH=$PWD:/tmp/pp SEMKV_CACHE_DIR=/tmp/sc TRITON_CACHE_DIR=/tmp/tc
niah=ruler_niah_single_1,ruler_niah_single_2,ruler_niah_single_3,ruler_niah_multikey_1,ruler_niah_multikey_2
timeout ${RULER_S:-560} python3 -m semkv.cli.main eval --model /tmp/qwen.gguf --data-dir .carry/data --samples 20 --batched \
  --task $niah,ruler_niah_multikey_3,ruler_niah_multivalue,ruler_niah_multiquery --out /tmp/ruler \
  --lengths 8192,16384,31744 --budgets 0.1 \
  --methods "${RMETHODS:-full,dynsplit[score=tokens,score_keys=channels],dynsplit[score=tokens,score_keys=channels,channels=16]}" > /tmp/ruler.log 2>&1
echo "rc=$?"; tail -n 8 /tmp/ruler.log
cd /tmp && tar czf $OUT/ruler.tgz ruler ruler.log

### call 22 (a fresh machine, random weights): bash .carry/run/d4.sh
# session 26: the kernels against their references; profiles at 16 rows (random weights, qwen2.5-0.5b shape, real
# prefills of the essays): Full KV, SentenceKV's retrieving mode, DynSplit-KV token scores exact and from 16 channels
set -u
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
export PYTHONPATH=$PWD:$PWD/benchmarks TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $OUT/device.txt
timeout 150 python3 benchmarks/kernel_check.py --buckets-only > $OUT/kernels.txt 2>&1; echo "kernels rc=$?"; tail -4 $OUT/kernels.txt
TOK=.carry/data/smollm2-tokenizer
run() {  # name timeout args...
  local name=$1 t=$2; shift 2
  timeout $t python3 benchmarks/profile_step.py --shape qwen2.5-0.5b --tokenizer $TOK --budget 0.1 --batch ${BATCH:-16} \
    --context 31744 --steps 20 --warmup 4 --text-file /tmp/essays.txt --out /tmp/prof/$name "$@" > /tmp/prof_$name.log 2>&1
  echo "== $name rc=$?"; grep '^{' /tmp/prof_$name.log | tail -1
}
mkdir -p /tmp/prof
run full 90 --method full
run sentencekv 100 --method sentencekv --param sentencekv.retain=sentences --param sentencekv.score=tokens --param sentencekv.query=current --param sentencekv.keep_factor=1
run dynsplit 100 --method dynsplit --param dynsplit.score=tokens
run dynsplit_ch16 100 --method dynsplit --param dynsplit.score=tokens --param dynsplit.score_keys=channels --param dynsplit.channels=16
cd /tmp && tar czf $OUT/d4.tgz prof/*/*.md prof_*.log

### calls 23-38: the qwen parts again; call 39: bash .carry/run/d5.sh (its bench of 16 rows stopped at its
### 110 s after Full KV; its RULER at 330 s, before multiquery and SentenceKV's multivalue at 31k)
# session 26, last call: DynSplit-KV's 16 key channels at 16 rows beside Full KV (bench), then RULER NIAH of Full KV and
# SentenceKV's retrieving mode with the new bucket_best (real weights; d2.sh's joined GGUF)
set -u
(cd .carry/qwen && cat qwen.gguf.?? > /tmp/qwen.gguf) && [ "$(sha256sum < /tmp/qwen.gguf | cut -d' ' -f1)" = "$(head -1 .carry/qwen/SHA256SUMS | cut -d' ' -f1)" ] || { echo "qwen.gguf: bad sum"; exit 1; }
pip install -q --no-deps --target /tmp/pp .whl/vllm-carry/gguf-0.19.0-py3-none-any.whl
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $OUT/device.txt
export PYTHONPATH=$PWD:/tmp/pp SEMKV_CACHE_DIR=/tmp/sc TRITON_CACHE_DIR=/tmp/tc
timeout 150 python3 -m semkv.cli.main bench --model /tmp/qwen.gguf --text-file /tmp/essays.txt --contexts 31744 \
  --budget 0.1 --steps 16 --batches 16 --methods full,dynsplit --param dynsplit.score=tokens \
  --param dynsplit.score_keys=channels --out /tmp/bench16 > /tmp/bench16.log 2>&1
echo "bench rc=$?"; grep '^| ' /tmp/bench16/results.md | grep -E "^\| (full|dynsplit) " | head -4
niah=ruler_niah_single_1,ruler_niah_single_2,ruler_niah_single_3,ruler_niah_multikey_1,ruler_niah_multikey_2
timeout 380 python3 -m semkv.cli.main eval --model /tmp/qwen.gguf --data-dir .carry/data --samples 20 --batched \
  --task $niah,ruler_niah_multikey_3,ruler_niah_multivalue,ruler_niah_multiquery --out /tmp/ruler5 \
  --lengths 8192,16384,31744 --budgets 0.1 \
  --methods "full,sentencekv[retain=sentences,score=tokens,query=current,keep_factor=1]" > /tmp/ruler5.log 2>&1
echo "ruler rc=$?"; tail -n 5 /tmp/ruler5.log
cd /tmp && tar czf $OUT/d5.tgz --exclude='*.png' bench16 bench16.log ruler5 ruler5.log
