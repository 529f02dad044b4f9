# 2026-12-03 (session 49), one NVIDIA H200, one machine; two earlier calls found none. Tree T3 (calls 1b-5):
# commit f2ec835 (the fused select of section 4, reverted by 110d112 / e95a24e) with three edits then uncommitted:
# page_bound's default block_w 64, one KV head a program, and _vote_select's loop variables renamed (call 1's compile
# error). main (eaa5c95 on) keeps the first two, as a rule: 4,096 summary elements a program.
# call 1 (random inputs; .carry/data, .carry/qwen/SHA256SUMS, gguf's wheel in .carry/gguf carried):
PYTHONPATH=$PWD python3 benchmarks/kernel_check.py --page-bound-sweep > raw/kernels/page_bound_sweep.txt
#   (that call's tree had the sweep's extra layouts: KV heads a program, pages_first; then block_w=64 was set)
# call 1b, carrying part 00 of the model:
PYTHONPATH=$PWD python3 benchmarks/kernel_check.py --tokenselect-only > raw/kernels/tokenselect.txt
# parts 01..31 of Qwen2.5-Coder-0.5B-Instruct's GGUF (benchmarks/vllm_carry.sh --part-mib 15), one a call; the last:
bash benchmarks/vllm_device.sh setup 150
# call 2 -> raw/modes_bench (section 3)
bash benchmarks/vllm_device.sh modes_bench 470 \
  --methods "full,tokenselect[theta=0.95,score_keys=pages,superset=2],dynsplit[score_keys=pages]" --batches 16,max
# call 3 -> raw/ruler (section 2)
bash benchmarks/vllm_device.sh ruler 560 --lengths 8192,16384,31744 --budgets 0.1 \
  --methods "tokenselect[prefill=full,theta=0.95,score_keys=pages,superset=2],\
dynsplit[score=tokens,score_keys=pages],full"
# call 4 -> raw/random/bench8b.* and profile_16.md (sections 3, 5)
export PYTHONPATH=$PWD T=$PWD/.carry/data/smollm2-tokenizer
python3 -m semkv.cli.main bench --shape llama3-8b --batches 11 --contexts 31744 --budget 0.1 --steps 16 --tokenizer $T \
  --param tokenselect.prefill=full --param dynsplit.score=tokens \
  --methods "full,tokenselect[theta=0.95,score_keys=pages,superset=2],dynsplit[score_keys=pages]" --out bench8b
python3 benchmarks/profile_step.py --shape qwen2.5-0.5b --batch 16 --context 31744 --budget 0.1 --steps 16 \
  --tokenizer $T --method tokenselect --param tokenselect.prefill=full --param tokenselect.score_keys=pages \
  --param tokenselect.superset=2 --out prof16
# call 5 -> raw/random/profile_334.md (sections 1, 4)
python3 benchmarks/profile_step.py --shape qwen2.5-0.5b --batch 334 --context 31744 --budget 0.1 --steps 12 \
  --tokenizer $T --method tokenselect --param tokenselect.prefill=full --param tokenselect.score_keys=pages \
  --param tokenselect.superset=2 --param tokenselect.theta=0.95 --out prof334
# logs: progress bars dropped, gzipped
