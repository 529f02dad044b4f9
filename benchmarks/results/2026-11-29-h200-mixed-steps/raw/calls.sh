# session 27 (2026-11-29), one H200 lease after another; calls numbered as the device tool's folders
# calls 1-2: p1.sh (call 1 profiled steps 300-329 of a 96-request session: decode-only; call 2 steps 100-123, below)
# on 19a47ea plus first_steps.py --profile; calls 3-4, 22 on this tree (call 4: before ChunkKV's fix), call 21: 693d8db's engine

## .carry/run/p1.sh
# session 27: where a mixed step's time goes (random weights, qwen2.5-0.5b shape): Full KV, 96 x 32,000, 64 at a time
set -u
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
export PYTHONPATH=$PWD:$PWD/benchmarks TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $OUT/device.txt
TOK=.carry/data/smollm2-tokenizer
timeout 400 python3 benchmarks/first_steps.py --shape qwen2.5-0.5b --tokenizer $TOK --text-file /tmp/essays.txt \
  --requests 96 --max-num-seqs 64 --runs 1 --profile $OUT/prof64 --profile-from 300 --profile-steps 30 > $OUT/p64.log 2>&1
echo "rc=$?"; grep '^{' $OUT/p64.log | cut -c1-400

## .carry/run/p2.sh
# session 27: the decode step's end after the running prompts' chunks (this tree) against 19a47ea (.carry/old),
# random weights of qwen2.5-0.5b's shape, 96 x 32,000 tokens, 512 new, budget 8,192; each tree its own process
set -u
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $OUT/device.txt
TOK=.carry/data/smollm2-tokenizer
one() {  # name tree seqs extra...
  local name=$1 tree=$2 seqs=$3; shift 3
  PYTHONPATH=$tree:$PWD/benchmarks TRITON_CACHE_DIR=/tmp/tc_$(basename $tree) timeout 200 python3 benchmarks/first_steps.py \
    --shape qwen2.5-0.5b --tokenizer $TOK --text-file /tmp/essays.txt --requests 96 --max-num-seqs $seqs --runs 2 "$@" \
    > $OUT/$name.log 2>&1
  echo "== $name rc=$?"; grep '^{"run' $OUT/$name.log | cut -c1-330
}
one old64 $PWD/.carry/old 64 --requests 64
one new64 $PWD 64 --requests 64
one old16 $PWD/.carry/old 16 --requests 32
one new16 $PWD 16 --requests 32

## .carry/run/p3.sh
# session 27: the new tree's mixed steps under the profiler (Full KV, 96 x 32,000, 64 at a time, steps 100-123), and
# ChunkKV neighbours=3 at 10% against Full KV in first_steps (64 x 32,000, 64 at a time), this tree against 19a47ea
set -u
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $OUT/device.txt
TOK=.carry/data/smollm2-tokenizer
one() {  # name tree seqs extra...
  local name=$1 tree=$2 seqs=$3; shift 3
  PYTHONPATH=$tree:$PWD/benchmarks TRITON_CACHE_DIR=/tmp/tc_$(basename $tree) timeout 200 python3 benchmarks/first_steps.py \
    --shape qwen2.5-0.5b --tokenizer $TOK --text-file /tmp/essays.txt --max-num-seqs $seqs "$@" > $OUT/$name.log 2>&1
  echo "== $name rc=$?"; grep '^{"run' $OUT/$name.log | cut -c1-330
}
one prof64 $PWD 64 --requests 96 --runs 1 --profile $OUT/prof64 --profile-from 100 --profile-steps 24
grep '^{"step' $OUT/prof64.log | cut -c1-200
one chunkkv_new $PWD 64 --requests 64 --runs 2 --method chunkkv --param neighbours=3
one chunkkv_old $PWD/.carry/old 64 --requests 64 --runs 2 --method chunkkv --param neighbours=3

## .carry/run/p4.sh
# session 27: semkv bench (random weights of qwen2.5-0.5b's shape, real prefills of the essays, 31,744 tokens, 10%):
# Full KV, SentenceKV's retrieving mode, DynSplit-KV exact token scores at 16 rows and Full KV's largest batch; then
# ChunkKV neighbours=3's whole-prompt prefill under the profiler (8 x 32,000, second session)
set -u
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $OUT/device.txt
export PYTHONPATH=$PWD:$PWD/benchmarks TRITON_CACHE_DIR=/tmp/tc
TOK=.carry/data/smollm2-tokenizer
timeout 330 python3 -m semkv.cli.main bench --shape qwen2.5-0.5b --tokenizer $TOK --text-file /tmp/essays.txt \
  --contexts 31744 --budget 0.1 --steps 16 --batches 16,fullmax --methods full,sentencekv,dynsplit \
  --param dynsplit.score=tokens --param sentencekv.retain=sentences --param sentencekv.score=tokens \
  --param sentencekv.query=current --param sentencekv.keep_factor=1 --out $OUT/bench > $OUT/bench.log 2>&1
echo "bench rc=$?"; grep -v '^{' $OUT/bench.log | grep -v "it/s\]" | tail -n 14
timeout 150 python3 benchmarks/first_steps.py --shape qwen2.5-0.5b --tokenizer $TOK --text-file /tmp/essays.txt \
  --requests 8 --max-num-seqs 8 --new-tokens 64 --runs 2 --method chunkkv --param neighbours=3 \
  --profile $OUT/chunkkv --profile-from 0 --profile-steps 5 > $OUT/chunkkv.log 2>&1
echo "chunkkv rc=$?"; grep '^{"step' $OUT/chunkkv.log | cut -c1-200

## .carry/run/p5.sh
# session 27: the host's waits in ChunkKV neighbours=3's prefills (first_steps --sync-debug, 4 x 32,000, 2 sessions)
set -u
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
export PYTHONPATH=$PWD:$PWD/benchmarks TRITON_CACHE_DIR=/tmp/tc
timeout 150 python3 benchmarks/first_steps.py --shape qwen2.5-0.5b --tokenizer .carry/data/smollm2-tokenizer \
  --text-file /tmp/essays.txt --requests 4 --max-num-seqs 4 --new-tokens 16 --runs 2 --method chunkkv \
  --param neighbours=3 --sync-debug > $OUT/sync.log 2>&1
echo "rc=$?"; grep '^{"run' $OUT/sync.log | tail -1 | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print(json.dumps(d.get('syncs'), indent=0)); print(d.get('syncs_total'), d['step_ms'])"

## .carry/run/next.sh
# next session: after the Qwen carry (d2.sh's join), measure the unmeasured: e1fbc7c/852afa5 on SentenceKV at 16 rows,
# DynSplit-KV exact tokens with fold_runs end to end, at 16 rows and Full KV's largest batch (real weights)
set -u
(cd .carry/qwen && cat qwen.gguf.?? > /tmp/qwen.gguf) && [ "$(sha256sum < /tmp/qwen.gguf | cut -d' ' -f1)" = "$(head -1 .carry/qwen/SHA256SUMS | cut -d' ' -f1)" ] || { echo "qwen.gguf: bad sum"; exit 1; }
pip install -q --no-deps --target /tmp/pp .whl/vllm-carry/gguf-0.19.0-py3-none-any.whl
python3 -c "import json;print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" > /tmp/essays.txt
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $OUT/device.txt
export PYTHONPATH=$PWD:/tmp/pp SEMKV_CACHE_DIR=/tmp/sc TRITON_CACHE_DIR=/tmp/tc
timeout 450 python3 -m semkv.cli.main bench --model /tmp/qwen.gguf --text-file /tmp/essays.txt --contexts 31744 \
  --budget 0.1 --steps 16 --batches 16,fullmax --methods full,sentencekv,dynsplit --param dynsplit.score=tokens \
  --param sentencekv.retain=sentences --param sentencekv.score=tokens \
  --param sentencekv.query=current --param sentencekv.keep_factor=1 --out /tmp/benchn > /tmp/benchn.log 2>&1
echo "rc=$?"; grep -v '^{' /tmp/benchn.log | tail -n 12
cd /tmp && tar czf $OUT/next.tgz --exclude='*.png' benchn benchn.log

## calls 6-20 carried .carry/qwen/qwen.gguf.00-14 (one part a call), call 21 the last part with next.sh
