#!/usr/bin/env bash
# serve load on the device: install the serve stack from carried wheels, then benchmarks/serve_load.py
set -uo pipefail
out=${OUT:-/tmp/out}
python -V; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $out/device.txt
python -m pip install -q --no-index --find-links .gpu/wheels fastapi uvicorn prometheus_client openai 2>&1 | tail -2
export PYTHONUNBUFFERED=1
python benchmarks/serve_load.py --shape qwen2.5-0.5b --tokenizer .gpu/tok --text-file .gpu/essays.txt \
  --out $out/serve "$@" 2>&1 | tail -30
tail -5 $out/serve/server.log
