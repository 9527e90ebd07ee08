#!/usr/bin/env bash
# The GPU benchmark (issue 5) as one script: both random-weight shapes, bf16, CUDA graphs on, the GPU plan
# (short windows). About 4 minutes per shape on an H200. Results go to $OUT when set (the device tool's
# output folder), else to benchmarks/results. Needs no tokenizer and no network.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
out="${OUT:-benchmarks/results}"
py="${PYTHON:-python}"
status=0
for model in random:smollm2-135m random:llama-1b; do
  "$py" benchmarks/run.py --device cuda --dtype bfloat16 --model "$model" --out-dir "$out" "$@" || status=1
done
exit "$status"
