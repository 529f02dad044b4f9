# One H200 (one lease, 2026-11-29 session 29), from the repository root, tree c8af01e (packed prompt chunks) as it
# was committed after these calls; .carry/old/semkv held `git archive 8525a9a semkv benchmarks` (less
# benchmarks/results): the tree before the packing.
# Carrying: parts made by `bash benchmarks/vllm_carry.sh --part-mib 26` earlier; call 1 carried .carry/data, both
# SHA256SUMS and .carry/old; calls 2-36 one part each (.carry/qwen's 19, then .carry/vllm's; qwen.gguf.18, 0.6 MiB,
# travelled with wheels.tar.00 in call 20).
# call 37: the last part, then
bash benchmarks/vllm_device.sh setup   # wheels installed in 13 s, GGUF converted in 83 s, ready in 97 s
# call 38: FlashAttention 3's packed call against the float32 reference and against one call a chunk
source benchmarks/vllm_setup.sh; cd benchmarks && python3 -c "
import json, torch, kernel_check as k
for r in k.check_packed_prefill(torch.Generator(device='cuda').manual_seed(0)): print(json.dumps(r))"
# call 39: vLLM (ready after 236 s); its prefill and c1 phases left out to fit the call
bash benchmarks/vllm_device.sh serve 585 --servers vllm --phases c16,c64,shared_first,shared_followup
# call 40: semkv Full KV, `semkv bench --ttft` first (serve/engine_ttft*)
bash benchmarks/vllm_device.sh serve 585 --servers full --phases prefill,c1,c16,c64,shared_first,shared_followup \
  --engine-ttft
# call 41: followup_steps.py on this tree (followups/followup_steps_c8af01e.log)
python3 benchmarks/followup_steps.py --model $QWEN --text-file /tmp/w/essays.txt --documents 8 --questions 7 \
  --concurrency 8 --new-tokens 128
# call 42: the same on the tree before (followups/followup_steps_8525a9a.log), then ChunkKV's shared phases
(cd .carry/old/semkv && PYTHONPATH=$PWD:$PYTHONPATH:$PWD/benchmarks python3 benchmarks/followup_steps.py \
  --model $QWEN --text-file /tmp/w/essays.txt --documents 8 --questions 7 --concurrency 8 --new-tokens 128)
bash benchmarks/vllm_device.sh serve 380 --servers "chunkkv[neighbours=3]" --phases shared_first,shared_followup
# call 43: CHESS's shared phases (the session's device time then ended)
bash benchmarks/vllm_device.sh serve 300 --servers "chess[anchor=queries]" --phases shared_first,shared_followup
# here: each client JSON gzipped with its times rounded to the microsecond, logs and /metrics gzipped; the tables:
python benchmarks/vllm_page.py --serve benchmarks/results/2026-11-29-h200-packed-prefill/raw/serve
