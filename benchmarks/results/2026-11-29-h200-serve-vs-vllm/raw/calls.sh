# One H200 (one lease, 2026-11-29 session 28), from the repository root; tree 1d2385a plus f5966b5's fix of the
# prompts' encoding (the first serve call stopped on it: `'Text' object has no attribute 'tokens'`).
# Carrying: `bash benchmarks/vllm_carry.sh --part-mib 26` here (parts of 30 MiB were refused: the tracked tree is
# 33 MiB), then .carry/data with the SHA256SUMS files, then one call per part (.carry/vllm 18 parts, .carry/qwen 19).
# call 43: the last part, then
bash benchmarks/vllm_device.sh setup       # wheels installed in 13 s, GGUF converted in 87 s, ready in 103 s
# call 44: vLLM, every phase but the follow-ups (its start took 238 s; shared_followup not reached by the deadline)
bash benchmarks/vllm_device.sh serve 585 --servers vllm --phases prefill,c1,c16,c64,shared_first,shared_followup
# call 45: semkv Full KV with the engine's own prefill rate first (`semkv bench --ttft`, engine_ttft/), then CHESS
# and ChunkKV, then what the first two commands left (vLLM's follow-ups were skipped: no time for its start)
t0=$SECONDS; S=benchmarks/vllm_device.sh
bash $S serve 250 --servers full --phases prefill,c1,c16,c64,shared_first,shared_followup --engine-ttft
bash $S serve $((440 - SECONDS + t0)) --servers "chess[anchor=queries],chunkkv[neighbours=3]" --phases c64,c16
bash $S serve $((585 - SECONDS + t0)) --servers "vllm,full,chess[anchor=queries],chunkkv[neighbours=3]" \
  --phases shared_followup,prefill,c1,c16,c64
# call 46: ChunkKV's c64 and first questions (its follow-ups and CHESS's not reached by the deadline)
bash benchmarks/vllm_device.sh serve 200 --servers "chunkkv[neighbours=3],chess[anchor=queries]" \
  --phases c64,shared_first,shared_followup
# call 47: CHESS's first questions (its follow-ups not reached; the session's device time was then spent)
bash benchmarks/vllm_device.sh serve 150 --servers "chess[anchor=queries]" --phases shared_first,shared_followup
# here: the client's JSON gzipped with its per-token times rounded to the microsecond, logs and /metrics gzipped;
# server_c16_c64.log.gz is CHESS's server log of call 45 (server.log: its start in call 47). The tables:
python benchmarks/vllm_page.py --serve benchmarks/results/2026-11-29-h200-serve-vs-vllm/raw/serve
