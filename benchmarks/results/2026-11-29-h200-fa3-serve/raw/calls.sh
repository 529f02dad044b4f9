# One H200 (one lease, 2026-11-29 session 23), from the repository root; the tree of this change (FlashAttention 3 as
# the prefill attention, `kernels.fa3_prefill`, chosen by SEMKV_PREFILL_ATTENTION=auto when vLLM is installed).
# Carrying: `bash benchmarks/vllm_carry.sh` here, then one call per 30 MiB part (.carry/vllm 16 parts, .carry/qwen 16
# parts; .carry/data and the SHA256SUMS files in the first calls).
bash benchmarks/vllm_device.sh setup                       # wheels installed in 12 s, GGUF converted, ready in 89 s
# call 40: FlashAttention 3 against cuDNN (fa3/: kernels.txt, then first_steps.py with each path, 2 sessions each)
bash benchmarks/vllm_device.sh fa3 560
# call 41: vLLM's c16 and c64 phases (semkv's not reached: the script's deadline)
bash benchmarks/vllm_device.sh serve 575 --servers vllm,full --phases c16,c64
# call 42: semkv Full KV, CHESS and ChunkKV, c16 and c64 (vLLM's phases found done, not run again)
bash benchmarks/vllm_device.sh serve 580 --servers "vllm,full,chess[anchor=queries],chunkkv[neighbours=3]" --phases c16,c64
# call 43: vLLM's c1 and shared-document phases (vLLM started again: 76 s with its caches on disk); semkv's not
# reached (deadline); the device time of the session was then spent
bash benchmarks/vllm_device.sh serve 400 --servers "vllm,full" --phases c1,shared_first,shared_followup
# here: the client's JSON gzipped with inter-token latencies rounded to the microsecond, the tables
python benchmarks/vllm_page.py --serve benchmarks/results/2026-11-29-h200-fa3-serve/raw/serve
