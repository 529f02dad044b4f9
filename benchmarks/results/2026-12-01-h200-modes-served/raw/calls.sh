# 2026-12-01, one H200 (two leases), the working tree of this page's commit. Carried: .carry/data (the essays, the
# SmolLM2 tokenizer), .carry/gguf (gguf 0.19.0's wheel: semkv's stages without vLLM, benchmarks/vllm_setup.sh), then
# .carry/qwen's 24 parts of Qwen2.5-Coder-0.5B-Instruct's GGUF one a call (benchmarks/vllm_carry.sh's split).

# lease 1, call 1: followups/ (random Qwen2.5-0.5B shape; no model carried yet)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/gguf/*.whl
export PYTHONPATH=/tmp/site TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
python3 -c "import json; print(json.load(open('.carry/data/paul_graham/ruler_PaulGrahamEssays.json'))['text'])" \
  > /tmp/essays.txt
A="--shape qwen2.5-0.5b --tokenizer $PWD/.carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --new-tokens 64"
for run in "chunkkv --param neighbours=3" "chess --param anchor=queries" "full"; do
  PYTHONPATH=$PWD:$PWD/benchmarks:$PYTHONPATH python3 benchmarks/followup_steps.py $A --method $run --profile \
    --trace 2 --trace-dir /tmp/fu_${run%% *} > fu_${run%% *}.log 2>&1
done

# lease 1, after the parts: the model converted once, then modes_a/ and modes_b/ (real weights, real prefills)
bash benchmarks/vllm_device.sh setup 150
bash benchmarks/vllm_device.sh modes_bench 570 \
  --methods "full,dynsplit,tokenselect,tokenselect[score_keys=int8],sentencekv"
bash benchmarks/vllm_device.sh modes_bench 400 --methods "full,chess,chunkkv" --batches 16,fullmax

# lease 1: bench8b/ (random Llama-3.1-8B shape, synthetic ids: a random shape has no real queries)
source benchmarks/vllm_setup.sh
python3 -m semkv.cli.main bench --shape llama3-8b --tokenizer $DATA/smollm2-tokenizer --contexts 31744 --budget 0.1 \
  --steps 16 --batches 11,fullmax \
  --methods "full,chess,chunkkv,sentencekv,dynsplit,tokenselect,tokenselect[score_keys=int8]" \
  --param chess.anchor=queries --param chunkkv.neighbours=3 --param sentencekv.retain=sentences \
  --param sentencekv.score=tokens --param sentencekv.query=current --param sentencekv.keep_factor=1 \
  --param dynsplit.score=tokens --param tokenselect.prefill=full --out bench8b

# lease 2: profiles/ (random weights), each one process
T=$PWD/.carry/data/smollm2-tokenizer
for shape in "llama3-8b 11" "qwen2.5-0.5b 16"; do
  set -- $shape
  for run in "full" "dynsplit --param dynsplit.score=tokens" "tokenselect --param tokenselect.prefill=full" \
             "tokenselect --param tokenselect.prefill=full --param tokenselect.score_keys=int8"; do
    python3 benchmarks/profile_step.py --shape $1 --batch $2 --context 31744 --budget 0.1 --steps 20 \
      --tokenizer $T --method $run --out prof/$1
  done
done

# lease 2, call 2: sweep/ (.carry/run/sweep.sh): the scoring kernels' launch settings, then DynSplit-KV's step with
# chunk_best's group mean on the tensor cores (a change tried and reverted)
python3 benchmarks/decode_kernel_sweep.py --only scoring --best 6 > sweep.txt
for shape in "llama3-8b 11" "qwen2.5-0.5b 16"; do
  set -- $shape
  python3 benchmarks/profile_step.py --shape $1 --batch $2 --context 31744 --budget 0.1 --steps 20 \
    --tokenizer $T --method dynsplit --param dynsplit.score=tokens --out prof/$1 > prof_dynsplit_mean_dot_$1.log
done

# lease 3: int8/ (random weights): the 8B shape at 0.9 (with the exact keys and Full KV first: 8b_gmu09; alone:
# 8b_gmu09_alone), the 0.5B shape's largest batches (05b_max), then the 8B shape at 0.8 (8b_gmu08)
B="--contexts 31744 --budget 0.1 --steps 16 --tokenizer $T --param tokenselect.prefill=full"
python3 -m semkv.cli.main bench --shape llama3-8b --batches 11 $B \
  --methods "full,tokenselect,tokenselect[score_keys=int8]"
python3 -m semkv.cli.main bench --shape llama3-8b --batches 11 $B --methods "tokenselect[score_keys=int8],full"
python3 -m semkv.cli.main bench --shape qwen2.5-0.5b --batches max $B --methods "full,tokenselect[score_keys=int8]"
python3 -m semkv.cli.main bench --shape llama3-8b --batches 11 $B --gpu-memory-utilization 0.8 \
  --methods "full,tokenselect,tokenselect[score_keys=int8]"
