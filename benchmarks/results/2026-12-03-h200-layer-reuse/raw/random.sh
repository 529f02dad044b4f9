#!/usr/bin/env bash
# session 50, call 1 (random weights, no model carried): reuse_layers at 16 rows of the 0.5B shape, then the 8B shape at 11
set -u
export PYTHONPATH=$PWD
T=$PWD/.carry/data/smollm2-tokenizer
R=$OUT/random; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/device.txt
end=$(( $(date +%s) + ${1:-300} ))
B="--contexts 31744 --budget 0.1 --steps 16 --tokenizer $T --param tokenselect.prefill=full --param tokenselect.theta=0.95 --param dynsplit.score=tokens"
timeout $(( end - $(date +%s) - 150 )) python3 -m semkv.cli.main bench --shape qwen2.5-0.5b --batches 16 $B \
  --methods "full,tokenselect[reuse_layers=3],tokenselect[score_keys=pages,reuse_layers=3],dynsplit[reuse_layers=3]" \
  --out $R/bench16 > $R/bench16.log 2>&1; grep -v '^{' $R/bench16.log | tr '\r' '\n' | grep -v '%|' | tail -14
timeout $(( end - $(date +%s) )) python3 -m semkv.cli.main bench --shape llama3-8b --batches 11 $B \
  --methods "full,tokenselect[reuse_layers=3],dynsplit[reuse_layers=3]" \
  --out $R/bench8b > $R/bench8b.log 2>&1; grep -v '^{' $R/bench8b.log | tr '\r' '\n' | grep -v '%|' | tail -12
for f in $R/*.log; do tr '\r' '\n' < $f | grep -v '%|' | gzip > $f.gz; rm $f; done
