#!/usr/bin/env bash
# Everything issue 34 measures on a GPU, as one prepared command for a lent H200 (about 10 minutes), in the order
# that matters if the device time runs out: what a CUDA start costs (the Triton kernel's first compile, the graphs'
# memory estimate, the captures), exactness (gpu_check.py: greedy equals generate in float64; bf16 agreement; one
# Embed call to an encoder on the device against sentence-transformers; a Q4_1 GGUF served dequantized to bf16, the
# CUDA path of --dtype auto, its greedy agreement), then per shape (SmolLM2-135M's, Qwen3-0.6B's, random bf16
# weights) nano-vllm's workload in-process, decode step times at batch 1/32/256 with the GPU's idle share, the same
# workload over gRPC against `python -m llmserve` (the engine process) and with --engine-in-process, steps mixing a
# prompt chunk with decodes under each --mixed-steps candidate, and last the 32-client ladder against
# transformers' continuous batching.
#
#   bash benchmarks/probes/gpu.sh --fetch-wheels   # here, once: the wheels the device image lacks, into .whl/
#   OUT=... bash benchmarks/probes/gpu.sh          # there (device tool: carry .whl); results under $OUT
#   bash benchmarks/probes/gpu.sh --dry-run        # here: every part on the CPU at tiny sizes (a test runs it)
#
# Each part runs under its own time limit (a part cut short keeps what it wrote: gpu_perf.py writes its summary,
# latest-gpu.json, after every part) and the script goes on; it exits 1 when any part failed. Needs no tokenizer,
# no weights and no network (the encoder and the GGUF are built in process where their packages are missing, as on
# the device: neither fits in a call's 64 MiB). Every part runs through benchmarks/run.py, which makes a bare
# checkout importable.
set -uo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
mode="gpu"
case "${1:-}" in
  --dry-run) mode="dry"; shift ;;
  --fetch-wheels) mode="wheels"; shift ;;
esac

# What the device image lacks or holds at another version than the pins (device README, KINDS.md's package list),
# for its Python 3.12: installed there with --no-deps into /tmp/site, first on PYTHONPATH.
WHEELS=(
  grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-status==1.85.3
  googleapis-common-protos==1.76.0 protobuf==7.36.2 transformers==5.23.0 llguidance==1.9.1 redis==8.1.0
  smg-grpc-proto==0.4.28 gguf==0.19.0
)
if [ "$mode" = wheels ]; then
  mkdir -p .whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>"$(git rev-parse --git-path info/exclude)"
  exec "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"
fi
if [ "$mode" = gpu ] && compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

out="${OUT:-benchmarks/results}"
mkdir -p "$out"
status=0
part() {  # part SECONDS NAME COMMAND...: one part under its time limit; its output to $out/gpu-NAME.log too
  local limit=$1 name=$2
  shift 2
  case " ${GPU_PARTS:-$name} " in *" $name "*) ;; *) echo "== $name: skipped (GPU_PARTS)"; return ;; esac
  local t0=$SECONDS
  echo "== $name (limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/gpu-$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
}

if [ "$mode" = dry ]; then
  export TRITON_INTERPRET=1  # the varlen kernel through Triton's interpreter, as the tests run it
  # The parts as below at tiny sizes, in one Python (run_parts.py prints each part's "== NAME: exit N"): a process
  # per part pays ~7 s of CPU to start torch and transformers, more than most of these parts' own work. On the
  # 2-core machine (loaded, two runs each): 87 and 95 s of CPU as three processes, 79 and 77 s as one, the check's
  # Embed and GGUF steps included.
  o=$(printf %q "$out")
  part 500 dry "$py" benchmarks/probes/run_parts.py \
    "check: --mode gpu-check --device cpu --smoke --shapes none --out $o" \
    "perf: --mode gpu-perf --device cpu --smoke --cap-s 30 --shapes smollm2-135m --out $o
      --parts start,inprocess,decode,grpc,mixed" \
    "ladder: --device cpu --model random:tiny --plan tiny --isolation inline --systems hf_continuous,llmserve
      --out-dir $o --name gpu-ladder-dry"
  exit "$status"
fi

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$out/gpu-smi.log"
# The limits add up to 580 s, within one device call's 600 with the wheels' install (start it with timeout_s 600;
# a part that runs to its limit leaves less to the ladder, last). A rerun of some parts: GPU_PARTS="grpc mixed"
# (names as below; inprocess-SHAPE per shape). The check's Embed and GGUF steps (the GGUF written in SmolLM2-135M's
# shape, ~98 MB, and converted on the host: ~40 s of the 2-core CPU machine) take it from 60 s to 100.
perf=("$py" benchmarks/run.py --mode gpu-perf --cap-s 45 --out "$out")
part 50 start "${perf[@]}" --shapes smollm2-135m --parts start
part 100 check "$py" benchmarks/run.py --mode gpu-check --shapes none --out "$out"
for shape in smollm2-135m qwen3-0.6b; do
  part 70 "inprocess-$shape" "${perf[@]}" --shapes "$shape" --parts inprocess,decode
done
part 100 grpc "${perf[@]}" --shapes smollm2-135m --parts grpc --cap-s 30
part 110 mixed "${perf[@]}" --shapes smollm2-135m --parts mixed
part 80 ladder "$py" benchmarks/run.py --device cuda --dtype bfloat16 --model random:smollm2-135m \
  --systems hf_continuous,llmserve --out-dir "$out" --name gpu-ladder "$@"
exit "$status"
