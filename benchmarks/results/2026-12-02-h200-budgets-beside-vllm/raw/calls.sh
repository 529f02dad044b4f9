# 2026-12-02 (session 44), one H200, one lease, main at 7c80d8d.
# Carried: the first call .carry/data and the SHA256SUMS of .carry/qwen and .carry/vllm (benchmarks/vllm_carry.sh's
# split); then one part a call: the 23 parts of vLLM 0.26.0's wheels (its server, and `vllm bench serve` as the client)
# and the 24 of Qwen2.5-Coder-0.5B-Instruct's GGUF.
# the call with the last part: install, convert the GGUF once
bash benchmarks/vllm_device.sh setup 150
# call 49: budget 4,096, c64 (vLLM's first start compiles: ready after 274 s, so semkv's servers were left for the
# next call) -> raw/4096/vllm
STEP_BUDGETS="4096" bash benchmarks/vllm_device.sh steps 570 --servers "vllm,full,chess[anchor=queries]"
# call 50: the same (vLLM's run kept) -> raw/4096/semkv-*
STEP_BUDGETS="4096" bash benchmarks/vllm_device.sh steps 400 --servers "vllm,full,chess[anchor=queries]"
# call 51: budget 2,048 (vLLM not started: too little time left) -> raw/2048
STEP_BUDGETS="2048" bash benchmarks/vllm_device.sh steps 480 --servers "full,chess[anchor=queries],vllm"
# here: call 51's steps.tgz (the work folder kept while warm holds every run), client JSONs with times rounded to the
# microsecond, then every file but server.json gzipped; the tables:
for run in 4096 2048; do
  python benchmarks/vllm_page.py --serve benchmarks/results/2026-12-02-h200-budgets-beside-vllm/raw/$run
done
