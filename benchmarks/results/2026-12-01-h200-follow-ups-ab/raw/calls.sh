# 2026-12-01 (session 41), one H200, one lease, main at 8065bc6 (vllm_device.sh's ab_serve as committed after it).
# Carried: call 1 .carry/data, .carry/old (`git archive 80416d6 semkv benchmarks | tar -x -C .carry/old/semkv`, less
# benchmarks/results), the SHA256SUMS of .carry/qwen and .carry/vllm (benchmarks/vllm_carry.sh's split); then one
# part a call: the 24 parts of Qwen2.5-Coder-0.5B-Instruct's GGUF and the 23 of vLLM 0.26.0's wheels (`vllm bench
# serve` is the client).
# call 48 (with the last part): install, convert the GGUF once
bash benchmarks/vllm_device.sh setup 150
# call 49: ab_serve/new (its old run failed: this tree's vllm_serve.py over 80416d6's semkv)
bash benchmarks/vllm_device.sh ab_serve 570
# call 50: ab_serve/new2, new3 (old2 and old3 not started: too little time for the old script's start check)
AB_ROUND=2 bash benchmarks/vllm_device.sh ab_serve 280
AB_ROUND=3 bash benchmarks/vllm_device.sh ab_serve 280
# call 51: ab_serve/old4, new4
AB_ROUND=4 bash benchmarks/vllm_device.sh ab_serve 540
# here: client JSONs gzipped with times rounded to the microsecond, logs and /metrics gzipped; the tables:
for run in new new2 new3 old4 new4; do
  python benchmarks/vllm_page.py --serve benchmarks/results/2026-12-01-h200-follow-ups-ab/raw/ab_serve/$run
done
