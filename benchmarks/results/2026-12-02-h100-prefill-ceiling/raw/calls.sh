# 2026-12-02 (session 47), one H100 80GB HBM3, one lease, main at d9f7b55 with SERVE_RUN (this commit).
# Carried: .carry/data and the SHA256SUMS, then one part a call: vLLM 0.26.0's wheels (31 parts of 15 MiB) and
# Qwen2.5-Coder-0.5B-Instruct's GGUF (32 parts; parts of 20 MiB were refused this time, see vllm_carry.sh).
bash benchmarks/vllm_carry.sh --part-mib 15   # here
bash benchmarks/vllm_device.sh setup 150      # the call with the last part
# call A: vLLM at its defaults, then CHESS; each: 128 prompts of 32,000 tokens at once with 1 new token (prefill),
# then 128 with 512 new tokens 64 at a time (c64; CHESS's c64 not started: too little of the call left) -> raw/serve
bash benchmarks/vllm_device.sh serve 585 --servers "vllm,chess[anchor=queries]" --phases prefill,c64 --prefill 128
# call B, same machine: Full KV, CHESS, ChunkKV at semkv serve's defaults (ChunkKV's c64 not started) -> raw/serve_b
SERVE_RUN=serve_b bash benchmarks/vllm_device.sh serve 585 \
  --servers "full,chess[anchor=queries],chunkkv[neighbours=3]" --phases prefill,c64 --prefill 128
# here: every file but server.json and device.txt gzipped; the tables:
python benchmarks/vllm_page.py --serve benchmarks/results/2026-12-02-h100-prefill-ceiling/raw/serve_b
