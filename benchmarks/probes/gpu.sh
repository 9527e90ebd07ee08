#!/usr/bin/env bash
# The GPU measurements as one prepared script for a lent device (issue 12): the engine checks (exactness on
# CUDA, bf16 agreement, graphs on/off), the issue's figures for three random-weight shapes (gpu_perf.py:
# nano-vllm's workload in-process and over gRPC, decode step times and the GPU's idle share), the host side's
# ceiling (frontend.py), then the 32-client ladder in SmolLM2-135M's shape. Results go to $OUT when set (the
# device tool's output folder), else to benchmarks/results. Needs no tokenizer and no network; the device image
# lacks grpcio-health-checking, grpcio-reflection, grpcio-status and prometheus-client, which travel as wheels
# (device README). Every part runs through benchmarks/run.py, which makes a bare checkout importable.
# Not yet timed on a GPU as a whole: run the parts one by one first if the device time is short.
set -uo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
out="${OUT:-benchmarks/results}"
py="${PYTHON:-python}"
status=0
"$py" benchmarks/run.py --mode gpu-check --out "$out" || status=1
"$py" benchmarks/run.py --mode gpu-perf --out "$out" || status=1
# The host side's ceiling on this machine's CPU (model call stubbed): in-process vs over gRPC, about a minute.
"$py" benchmarks/run.py --mode frontend --json "$out/frontend.json" || status=1
"$py" benchmarks/run.py --device cuda --dtype bfloat16 --model random:smollm2-135m \
  --systems dynamic,hf_continuous,llmserve --out-dir "$out" "$@" || status=1
exit "$status"
