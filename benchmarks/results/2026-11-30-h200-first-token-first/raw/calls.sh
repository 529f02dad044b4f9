# One H200 (session 33, 2026-11-30), from the repository root; two leases.
# lease 1, call 1 (raw/call1/): followup_steps.py on main's 1b27fdb (.carry/old/semkv = `git archive 1b27fdb semkv`)
# and on 5722630 (this tree), random weights of the Qwen2.5-0.5B shape, no vLLM installed; .carry/data and .carry/old
# carried
bash raw/fu_ttft.sh            # copied into benchmarks/ for the call
# lease 1, then: carrying as on the 2026-11-30-h200-followup-admission page (.carry/data with the SHA256SUMS files in
# one call, then one part a call: 18 of .carry/vllm, 19 of .carry/qwen), then set-up and the served phases (raw/serve/)
bash benchmarks/vllm_device.sh setup   # wheels installed in 16 s, GGUF converted in 119 s, ready in 135 s
bash benchmarks/vllm_device.sh serve 330 --servers "chunkkv[neighbours=3]" --phases shared_first,shared_followup
bash benchmarks/vllm_device.sh serve 250 --servers "chess[anchor=queries]" --phases shared_first,shared_followup
bash benchmarks/vllm_device.sh serve 190 --servers full --phases shared_first,shared_followup  # cut: its follow-ups
bash benchmarks/vllm_device.sh serve 230 --servers full --phases shared_first,shared_followup  # both phases again
# here: each client JSON gzipped with its times rounded to the microsecond, logs and /metrics gzipped; the tables:
python benchmarks/vllm_page.py --serve benchmarks/results/2026-11-30-h200-first-token-first/raw/serve
# lease 2, call 3 (raw/call3/): the same script on 5722630 (.carry/old/semkv = `git archive 5722630 semkv`) and on
# 5722630 plus a step of at most 2,048 prompt tokens reading its first tokens before it ends (not kept)
LIMIT=120 METHODS="chunkkv:neighbours=3 full" bash raw/fu_ttft.sh
