# One H200 (session 35, 2026-11-30), from the repository root; one lease.
# call 1 (raw/call1/): followup_steps.py on main's e1f01a2 (this tree at the time) and on e1f01a2 with 80416d6's
# scheduler (.carry/old/semkv = `git archive e1f01a2 semkv` plus that scheduler.py), random weights of the
# Qwen2.5-0.5B shape, no vLLM installed; .carry/data, .carry/watch (this script), .carry/old and the SHA256SUMS carried
bash raw/followup_ab.sh        # was .carry/watch/run4.sh
# then: .carry/data with the SHA256SUMS files in one call, one part a call (23 of .carry/vllm, 24 of .carry/qwen:
# `benchmarks/vllm_carry.sh --part-mib 20`; parts of 26 MiB were refused beside the 36 MiB tracked tree), about 6 s of
# held time a call; then the set-up and the served phases (raw/serve/), on the tree of 80416d6
bash benchmarks/vllm_device.sh setup 150  # wheels installed in 14 s, GGUF converted in 89 s, ready in 102 s
bash benchmarks/vllm_device.sh serve 360 --servers "chunkkv[neighbours=3]" --phases shared_first,shared_followup
bash benchmarks/vllm_device.sh serve 480 --servers "full,chess[anchor=queries]" --phases shared_first,shared_followup
bash benchmarks/vllm_device.sh serve 300 --servers vllm --phases shared_first,shared_followup  # cut before its phases
# here: each client JSON gzipped with its times rounded to the microsecond, logs and /metrics gzipped; the tables:
python benchmarks/vllm_page.py --serve benchmarks/results/2026-11-30-h200-served-follow-ups/raw/serve
