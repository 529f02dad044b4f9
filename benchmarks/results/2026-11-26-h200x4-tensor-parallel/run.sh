export PYTHONPATH=$PWD
nvidia-smi -L
python benchmarks/tp_tokens.py --model .gpu/tiny --device cuda --dtype float32 --sizes 2 --out $OUT/tp_tokens.json 2>&1 | grep -v Warn | tail -4
for n in 1 2; do
  python -m semkv.cli.main bench --shape llama3-8b --contexts 32k --batches max --steps 16 --methods full,chunkkv,snapkv,quest --budget 0.1 --tensor-parallel-size $n --out $OUT/llama3-8b-tp$n 2>&1 | grep -E "B=|rror|Traceback"
done
export PYTHONPATH=$PWD
python -m semkv.cli.main bench --shape llama3-8b --contexts 32k --batches max --steps 16 --methods full,chunkkv,snapkv,quest --budget 0.1 --tensor-parallel-size 4 --out $OUT/llama3-8b-tp4 2>&1 | grep -E "B=|rror|Traceback"
python -m semkv.cli.main bench --shape llama3-70b --contexts 32k --batches max --steps 16 --methods full,chunkkv --budget 0.1 --tensor-parallel-size 4 --out $OUT/llama3-70b-tp4 2>&1 | grep -E "B=|rror|Traceback"
export PYTHONPATH=$PWD
for n in 1 2 4; do
python -m semkv.cli.main bench --shape llama3-8b --contexts 32k --batches 1,25 --steps 16 --methods full,chunkkv --budget 0.1 --tensor-parallel-size $n --out $OUT/strong-tp$n 2>&1 | grep -E "B=|rror|Traceback"
done
