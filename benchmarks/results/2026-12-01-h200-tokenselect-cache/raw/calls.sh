# 2026-12-01 (session 40), one H200, one lease, main at 753211e. Carried: call 1 .carry/data, .carry/gguf, the
# SHA256SUMS of .carry/qwen and .carry/vllm (benchmarks/vllm_carry.sh's split), then one part a call: the 24 parts of
# Qwen2.5-Coder-0.5B-Instruct's GGUF and the 23 of vLLM 0.26.0's wheels (vLLM's `vllm bench serve` is the client).
# call 48 (with the last part): install, convert the GGUF once, then RULER at 8k with TokenSelect's variants
bash benchmarks/vllm_device.sh setup 150
bash benchmarks/vllm_device.sh ruler 380 --lengths 8192 --budgets 0.1 --methods "full,tokenselect[prefill=full],\
tokenselect[prefill=full,theta=1.0],tokenselect[prefill=full,theta=0.95],tokenselect[prefill=full,scope=kv_head],\
tokenselect[prefill=full,selection=top_k]"
# call 49: serve/ (section 3)
bash benchmarks/vllm_device.sh serve 585 --servers "chunkkv[neighbours=3],chess[anchor=queries]" \
  --phases shared_first,shared_followup
# call 50: RULER at 16k and 31k (cut by its time; call 51 resumed the folder), then modes_bench/ (section 2)
bash benchmarks/vllm_device.sh ruler 270 --lengths 8192,16384,31744 --budgets 0.1 \
  --methods "full,tokenselect[prefill=full,theta=0.95],tokenselect[prefill=full,theta=0.95,score_keys=int8]"
bash benchmarks/vllm_device.sh modes_bench 285 \
  --methods "full,tokenselect,tokenselect[theta=0.95],tokenselect[theta=0.95,score_keys=int8]"
# call 51: the RULER grid completed (ruler/: every row of calls 48, 50 and 51)
bash benchmarks/vllm_device.sh ruler 300 --lengths 8192,16384,31744 --budgets 0.1 --methods "full,\
tokenselect[prefill=full],tokenselect[prefill=full,theta=0.95],tokenselect[prefill=full,theta=0.95,score_keys=int8]"
# here: client JSONs gzipped with times rounded to the microsecond, logs and /metrics gzipped; the tables:
python benchmarks/vllm_page.py --serve benchmarks/results/2026-12-01-h200-tokenselect-cache/raw/serve
