#!/usr/bin/env bash
# Issue 29: quality of the offloaded SentenceKV and DynSplit-KV on real weights (Qwen2.5-Coder-0.5B), six RULER
# NIAH tasks at 31k, 20 samples each, budget 0.1, continuous batching (the same tokens as without offload).
set -uo pipefail
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $out/device.txt
cat .gpu/q/part_0* > /tmp/qwen.gguf && sha256sum /tmp/qwen.gguf | tee $out/sha.txt
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/gw/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 560 python -m semkv.cli.main eval --model /tmp/qwen.gguf \
  --task ruler_niah_single_1,ruler_niah_single_2,ruler_niah_multikey_1,ruler_niah_multikey_2,ruler_niah_multivalue,ruler_niah_multiquery \
  --lengths 31744 --samples 20 --methods sentencekv,dynsplit --budgets 0.1 --param sentencekv.offload=True \
  --param dynsplit.offload=True --batched --data-dir .gpu/data --out $out/eval_qwen_31k_offload > $out/eval.log 2>&1
tail -5 $out/eval.log
python -m semkv.cli.main report $out/eval_qwen_31k_offload > $out/report.log 2>&1; tail -30 $out/report.log
