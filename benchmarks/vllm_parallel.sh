#!/usr/bin/env bash
# Stages of vllm_device.sh side by side on a machine of several GPUs, one stage a GPU, in one device call:
#   bash benchmarks/vllm_parallel.sh SECONDS "STAGE [ARGS...] [+ STAGE [ARGS...]]..." ...
# Job i runs on GPU i (CUDA_VISIBLE_DEVICES=i) with its work in /tmp/w<i> (kept while the machine is warm: a job cut
# short resumes there) and its archive and log in $OUT/g<i>/; a job of several stages joined by " + " runs them in
# turn, each with the seconds left. Run `bash benchmarks/vllm_device.sh setup` first.
# Ratios compare runs of one job (one card); jobs share the host's CPUs and disk.
set -uo pipefail
case ${1:-} in -h|--help|"") sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;; esac
seconds=$1; shift
out=${OUT:-/tmp/out} jobs=("$@")
end=$(( $(date +%s) + seconds ))
job() {  # GPU, then its stages joined by " + "
  local gpu=$1 stage words
  IFS=$'\n' read -d '' -ra stages < <(echo "${2// + /$'\n'}")
  for stage in "${stages[@]}"; do
    read -ra words <<< "$stage"  # the stage, then its arguments
    CUDA_VISIBLE_DEVICES=$gpu VLLM_WORK=/tmp/w$gpu OUT=$out/g$gpu \
      bash benchmarks/vllm_device.sh "${words[0]}" $(( end - $(date +%s) )) "${words[@]:1}"
  done
}
for i in "${!jobs[@]}"; do
  mkdir -p $out/g$i
  job $i "${jobs[$i]}" > $out/g$i/log.txt 2>&1 &
done
wait
for i in "${!jobs[@]}"; do echo "=== GPU $i: ${jobs[$i]}"; tail -n 30 $out/g$i/log.txt; done
