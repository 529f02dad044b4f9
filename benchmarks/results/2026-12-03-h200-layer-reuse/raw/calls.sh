# 2026-12-03 (session 50), one NVIDIA H200 (device.txt); main at 9cac6f8 (reuse_layers) for every call.
# call 1, random weights (carried: .carry/data, .carry/gguf, .carry/run) -> random/ (the script is raw/random.sh):
bash .carry/run/random50.sh 330
# calls 2-33: Qwen2.5-Coder-0.5B-Instruct's GGUF in 32 parts (benchmarks/vllm_carry.sh --part-mib 15), one a call; the
# last one with:
bash benchmarks/vllm_device.sh setup 150
# call 34 -> ruler/ (Full KV's scores: the same suite on the same weights in 2026-12-03-h200-pages-quality's call 3,
# 92.0 / 83.4 / 74.8, the same to the sample as in the call before it)
bash benchmarks/vllm_device.sh ruler 575 --lengths 8192,16384,31744 --budgets 0.1 --methods \
  "tokenselect[prefill=full,theta=0.95,reuse_layers=3],dynsplit[score=tokens,reuse_layers=3],\
tokenselect[prefill=full,theta=0.95,score_keys=pages,reuse_layers=3]"
# here, on the CPU (inspect/; prompt.txt: 2026-11-28-h200x4-modes-servers/raw/inspect/prompt.txt.gz; qwen.gguf the
# 32 parts concatenated), for R in 2 3 (and score_keys=pages at 3):
semkv inspect --device cpu --model qwen.gguf --method tokenselect --budget 0.1 --param prefill=full \
  --param theta=0.95 --param reuse_layers=$R --prompt-file prompt.txt \
  --question "What is the special magic number for the blue fox?" \
  --needle "The special magic number for the blue fox is 7391." --answer 7391 --steps 8 --max-new-tokens 16
semkv inspect --device cpu --model qwen.gguf --method dynsplit --budget 0.1 --param score=tokens \
  --param reuse_layers=$R --prompt-file prompt.txt \
  --question "What is the special magic number for the blue fox?" \
  --needle "The special magic number for the blue fox is 7391." --answer 7391 --steps 8 --max-new-tokens 16
# logs: progress bars dropped, gzipped
# second machine of the session: call 35 (.carry/data, .carry/gguf, .carry/run), calls 36-67 the model's parts again,
# the last one with (-> ruler_r2/; cut off at its time: 7 tasks at 8k, 6 at 16k and 31k):
bash benchmarks/vllm_device.sh setup 150 && bash benchmarks/vllm_device.sh ruler 230 --lengths 8192,16384,31744 \
  --budgets 0.1 --methods "tokenselect[prefill=full,theta=0.95,reuse_layers=2]"
# call 68: the same ruler stage again for 160 s (to resume); it added no run before its time ran out
# here, on the CPU (section 3; qwen.gguf as above, ../shared/data the evaluation data):
PYTHONPATH=$PWD python benchmarks/studies/tokenselect_layer_reuse.py --model qwen.gguf --data ../shared/data \
  --context 8192 --prompts 2 --steps 8 --out benchmarks/results/tokenselect_layer_reuse.json
