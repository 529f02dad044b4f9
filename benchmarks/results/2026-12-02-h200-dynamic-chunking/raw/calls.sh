# 2026-12-02 (session 45), one H200, one lease, main at f168335 with 5350c5c's vllm_device.sh (the same tree but for
# the steps stage's budget names).
# Carried (benchmarks/vllm_carry.sh's split): .carry/data and the SHA256SUMS of .carry/qwen and .carry/vllm, then one
# part a call: the 23 parts of vLLM 0.26.0's wheels (`vllm bench serve` is the client) and the 24 of
# Qwen2.5-Coder-0.5B-Instruct's GGUF. The machine went back once while idle between two calls (its 30 s), so the parts
# carried before were carried again.
# the call with the last part: install, convert the GGUF once
bash benchmarks/vllm_device.sh setup 150
# call 74: dynamic chunking at the default budget, Full KV then CHESS -> raw/8192-dynamic; then Full KV at 4,096,
# whose client was cut at the call's deadline (not kept)
STEP_BUDGETS="8192-dynamic 4096" bash benchmarks/vllm_device.sh steps 575 --servers "full,chess[anchor=queries]"
# call 75: the web process's stall while it tokenizes long prompts -> raw/long_prompts.txt
bash benchmarks/vllm_device.sh long_prompts 200
# call 76: the default budget without dynamic chunking -> raw/8192 (the machine kept call 74's runs: its steps.tgz
# holds both folders)
STEP_BUDGETS="8192" bash benchmarks/vllm_device.sh steps 250 --servers "full"
# here: call 76's steps.tgz, client JSONs with times rounded to the microsecond, then every file but server.json,
# device.txt, long_prompts.txt and this one gzipped; the tables:
for run in 8192-dynamic 8192; do
  python benchmarks/vllm_page.py --serve benchmarks/results/2026-12-02-h200-dynamic-chunking/raw/$run
done
