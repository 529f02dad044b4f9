#!/usr/bin/env bash
# Stages of vllm_device.sh side by side on a machine of several GPUs, one stage a GPU, in one device call:
#   bash benchmarks/vllm_parallel.sh SECONDS "STAGE [ARGS...]" "STAGE [ARGS...]" ...
# Job i runs on GPU i (CUDA_VISIBLE_DEVICES=i) with its work in /tmp/w<i> (kept while the machine is warm: a job cut
# short resumes there) and its archive and log in $OUT/g<i>/. Run `bash benchmarks/vllm_device.sh setup` first.
# Ratios compare runs of one job (one card); jobs share the host's CPUs and disk.
set -uo pipefail
case ${1:-} in -h|--help|"") sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;; esac
seconds=$1; shift
out=${OUT:-/tmp/out} jobs=("$@")
for i in "${!jobs[@]}"; do
  mkdir -p $out/g$i
  read -ra words <<< "${jobs[$i]}"  # the stage, then its arguments
  CUDA_VISIBLE_DEVICES=$i VLLM_WORK=/tmp/w$i OUT=$out/g$i \
    bash benchmarks/vllm_device.sh "${words[0]}" "$seconds" "${words[@]:1}" > $out/g$i/log.txt 2>&1 &
done
wait
for i in "${!jobs[@]}"; do echo "=== GPU $i: ${jobs[$i]}"; tail -n 30 $out/g$i/log.txt; done
