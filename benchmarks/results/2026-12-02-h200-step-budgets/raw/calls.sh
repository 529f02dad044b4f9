# 2026-12-02 (session 43), one H200, one lease, main at 6ef072a.
# Carried: call 1 .carry/data and the SHA256SUMS of .carry/qwen and .carry/vllm (benchmarks/vllm_carry.sh's split);
# then one part a call: the 23 parts of vLLM 0.26.0's wheels (`vllm bench serve` is the client) and the 24 of
# Qwen2.5-Coder-0.5B-Instruct's GGUF.
# call 48 (with the last part): install, convert the GGUF once
bash benchmarks/vllm_device.sh setup 150
# call 49: the model, c64, budget 4,096 -> raw/qwen-0.5b/4096
STEP_BUDGETS="4096" bash benchmarks/vllm_device.sh steps 420
# call 50: the 8B shape, budgets 4,096 and 8,192 (8,192's c16 stopped at the deadline) -> raw/llama3-8b/{4096,8192}
STEP_BUDGETS="4096 8192" bash benchmarks/vllm_device.sh steps 560 --shape llama3-8b --servers full \
  --phases prefill,c16 --concurrency 16 --requests 32 --prefill 16 --engine-ttft
# call 51: the 8B shape, budget 1,024 -> raw/llama3-8b/1024
STEP_BUDGETS="1024" bash benchmarks/vllm_device.sh steps 370 --shape llama3-8b --servers full --phases c16 \
  --concurrency 16 --requests 32
# here: call 51's steps.tgz (the work folder kept while warm: the model's and the 8B shape's 4,096 runs shared
# steps/4096; the model's files from call 49's archive, the 8B shape's c64-less rest from call 51's), client JSONs
# gzipped with times rounded to the microsecond, logs and /metrics gzipped, engine_ttft's plot left out; the tables:
for run in qwen-0.5b/4096 llama3-8b/4096 llama3-8b/1024 llama3-8b/8192; do
  python benchmarks/vllm_page.py --serve benchmarks/results/2026-12-02-h200-step-budgets/raw/$run
done
