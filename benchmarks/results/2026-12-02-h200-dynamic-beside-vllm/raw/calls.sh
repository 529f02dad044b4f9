# 2026-12-02 (session 46), one H200, one lease, main at d3071b0 (calls 49 and 50).
# Carried (benchmarks/vllm_carry.sh's split): .carry/data and the SHA256SUMS of .carry/qwen and .carry/vllm, then one
# part a call: the 23 parts of vLLM 0.26.0's wheels (its server, and `vllm bench serve` as the client) and the 24 of
# Qwen2.5-Coder-0.5B-Instruct's GGUF.
# the call with the last part: install, convert the GGUF once
bash benchmarks/vllm_device.sh setup 150
# call 49: vLLM at its default budget (8,192, named), then semkv Full KV with dynamic chunking at the same budget;
# CHESS was not started (too little of the call left) -> raw/8192-dynamic/vllm, raw/8192-dynamic/semkv-full
STEP_BUDGETS="8192-dynamic" bash benchmarks/vllm_device.sh steps 585 --servers "vllm,full,chess[anchor=queries]"
# call 50: the same (the machine kept call 49's runs), CHESS anchor="queries" at 10% with dynamic chunking
# -> raw/8192-dynamic/semkv-chess_anchor_queries_@0.1; then the stream's gaps while long prompts arrive, tokenized in
# the web process's threads and in a tokenizer process -> raw/long_prompts_qwen_before.txt
STEP_BUDGETS="8192-dynamic" bash benchmarks/vllm_device.sh steps 390 --servers "vllm,full,chess[anchor=queries]"; \
  bash benchmarks/vllm_device.sh long_prompts 180
# call 51, a fresh machine (the last one went back while idle), the tree at d3071b0 with the first form of 4164c90 (the
# server answers once its tokenizer processes have loaded; 4164c90 then starts them before the web process loads its
# own tokenizer): .whl/serve (fastapi 0.136.3, starlette 1.10.0, pydantic 2.14.4, pydantic-core 2.50.5,
# annotated-types 0.8.0, typing-inspection 0.4.5, uvicorn 0.54.0, pyzmq 27.3.0, openai 3.57.0, httpx2 2.16.2,
# httpcore2 2.16.2, truststore 0.10.5, jiter 0.19.0, distro 1.9.0, sniffio 1.3.1, gguf 0.19.0: the versions of vLLM's
# set) and .carry/data/smollm2-tokenizer carried; a random-weight SmolLM2-135M shape with SmolLM2's tokenizer (Qwen's
# GGUF not carried again) -> raw/long_prompts_after.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/serve/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
python3 -c "import sys; sys.path.insert(0,'benchmarks'); from vllm_servers import shape_folder; \
print(shape_folder('smollm2-135m','.carry/data/smollm2-tokenizer'))" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/long_prompts.txt
for n in 0 1; do echo "--tokenizer-processes $n"; timeout 120 python3 benchmarks/serve_overhead.py long-prompts \
  --model /tmp/shape-smollm2-135m --device cuda --tokens 4000 --serve-flag=--tokenizer-processes=$n; done 2>&1 \
  | tee -a $OUT/long_prompts.txt
# here: call 50's steps.tgz (the work folder kept while warm holds every run), client JSONs with times rounded to the
# microsecond, then every file but server.json, device.txt and the .txt files gzipped; the tables:
python benchmarks/vllm_page.py --serve benchmarks/results/2026-12-02-h200-dynamic-beside-vllm/raw/8192-dynamic
# ITL p10 / p90 from the client JSONs' itls (numpy.percentile over every gap of every request)
