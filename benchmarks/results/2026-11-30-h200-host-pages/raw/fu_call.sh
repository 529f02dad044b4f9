# one call: old (.carry/old/semkv) and new (this tree) followup_steps, three methods, then cProfile of the new ChunkKV
nvidia-smi --query-gpu=name --format=csv,noheader
TREES="old new" METHODS="full chunkkv:neighbours=3 chess:anchor=queries" bash benchmarks/fu_ab.sh
export PYTHONPATH=$PWD:$PWD/benchmarks
timeout 150 python3 benchmarks/followup_steps.py --shape qwen2.5-0.5b --tokenizer .carry/data/smollm2-tokenizer \
  --text-file /tmp/essays.txt --method chunkkv --param neighbours=3 --documents 8 --questions 7 --concurrency 8 \
  --new-tokens 64 --profile > $OUT/chunkkv_new_prof.log 2>&1; echo prof rc=$?
