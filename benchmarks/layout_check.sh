#!/usr/bin/env bash
# A behaviour-preserving refactor on the device, in one call: every Triton kernel against its torch reference
# (kernel_check.py), then one `semkv bench` point (Full KV, CHESS, SentenceKV; Llama-3.1-8B shape, random weights,
# 11 x 32k, budget 10%) with the new code, the code before the change and the new code again, same machine.
# Before the call, put the old package and a tokenizer folder in the ignored folder .gpu/:
#   mkdir -p .gpu/orig .gpu/tok && git archive BASE semkv | tar -x -C .gpu/orig
#   cp ~/.cache/semkv/gguf/*/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/tok/
# then run `bash benchmarks/layout_check.sh` on the device with `.gpu` carried; files land in $OUT.
case ${1:-} in -h|--help) sed -n "2,8p" "$0" | sed "s/^# \{0,1\}//"; exit 0;; esac
set -uo pipefail
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/device.txt"
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD python benchmarks/kernel_check.py > "$out/kernel_check.log" 2>&1; tail -3 "$out/kernel_check.log"
for version in after before after2; do
  root=$PWD
  [ "$version" = before ] && root=$PWD/.gpu/orig
  PYTHONPATH=$root python -m semkv.cli.main bench --shape llama3-8b --methods full,chess,sentencekv --budget 0.1 \
    --tokenizer .gpu/tok --batches 11 --contexts 32k --steps 24 --out "$out/bench_$version" > "$out/bench_$version.log" 2>&1
  tail -8 "$out/bench_$version.log"
done
