# One H200 (session 30, 2026-11-30), from the repository root. Lease 1 (2026-11-29 23:4x, random weights of the
# Qwen2.5-0.5B shape, no vLLM installed, tree 4e51016 plus followup_steps.py's --stagger/--trace; its logs are not
# kept: the profile it gave is described on the page) then lease 2, tree 5c3d2a1-to-be (b558916 + the ab stage's
# change), all numbers on the page from lease 2.
# lease 1, call 2:
export PYTHONPATH=$PWD:$PWD/benchmarks
A="--shape qwen2.5-0.5b --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --documents 8 --questions 7 --concurrency 8 --new-tokens 128"
python3 benchmarks/followup_steps.py $A --stagger 16 --trace 8 --trace-dir $OUT/trace
python3 benchmarks/followup_steps.py $A
# lease 2: .carry/old/semkv held `git archive 4e51016 semkv benchmarks` (less benchmarks/results); carrying as on
# the 2026-11-29-h200-packed-prefill page (call 1 data, SHA256SUMS and .carry/old; one part a call)
bash benchmarks/vllm_device.sh setup   # wheels installed in 14 s, GGUF converted in 89 s, ready in 101 s
# call 40: this tree's followup_steps.py / first_steps.py over each tree's semkv (raw/ab/)
bash benchmarks/vllm_device.sh ab 430
# call 41: semkv Full KV (`semkv bench --ttft` first: raw/serve/engine_ttft*)
bash benchmarks/vllm_device.sh serve 470 --servers full --phases prefill,shared_first,shared_followup --engine-ttft
# call 42: vLLM 0.26.0 (ready after 184 s)
bash benchmarks/vllm_device.sh serve 345 --servers vllm --phases shared_first,shared_followup
# call 43, 44: ChunkKV, CHESS
bash benchmarks/vllm_device.sh serve 330 --servers "chunkkv[neighbours=3]" --phases shared_first,shared_followup
bash benchmarks/vllm_device.sh serve 250 --servers "chess[anchor=queries]" --phases shared_first,shared_followup
# here: each client JSON gzipped with its times rounded to the microsecond, logs and /metrics gzipped; the tables:
python benchmarks/vllm_page.py --serve benchmarks/results/2026-11-30-h200-followup-admission/raw/serve
# lease 3 (one call, a fresh machine, random weights, no vLLM): tree 0a0b19c (the window's mass kernels) against
# 6149860 in .carry/old/semkv (`git archive 6149860 semkv benchmarks`), raw/window/
export PYTHONPATH=$PWD:$PWD/benchmarks R=$PWD
python3 benchmarks/kernel_check.py --window-only > $OUT/window.txt
A="--shape qwen2.5-0.5b --tokenizer $R/.carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --documents 8 --questions 7 --concurrency 8 --new-tokens 64 --method chunkkv"
(cd .carry/old/semkv && PYTHONPATH=$PWD:$R/benchmarks python3 $R/benchmarks/followup_steps.py $A > $OUT/chunkkv_old.log)
python3 benchmarks/followup_steps.py $A > $OUT/chunkkv_new.log
