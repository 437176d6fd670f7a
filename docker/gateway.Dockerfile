# syntax=docker/dockerfile:1
# The OpenAI-compatible HTTP gateway (FastAPI), a gRPC client of the scheduler.
# No torch. Build from the repository root:
#   docker build -f docker/gateway.Dockerfile -t pagedserve-gateway .

FROM python:3.11-slim AS stubs
RUN pip install --no-cache-dir grpcio-tools==1.85.1
WORKDIR /src
COPY proto/*.proto proto/
RUN python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. proto/serving.proto

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/app
COPY docker/requirements-gateway.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt && rm /tmp/requirements.txt \
    && useradd --system --uid 10001 --no-create-home pagedserve
WORKDIR /app
COPY proto/__init__.py proto/
COPY --from=stubs /src/proto/*_pb2*.py proto/
COPY svc_common/ svc_common/
COPY gateway_svc/ gateway_svc/
COPY docker/healthcheck.py /usr/local/bin/pagedserve-healthcheck
USER pagedserve
ENV PAGEDSERVE_GATEWAY_HOST=0.0.0.0 \
    PAGEDSERVE_GATEWAY_PORT=8000 \
    PAGEDSERVE_GATEWAY_MODEL_DIR=/models/model \
    PAGEDSERVE_GATEWAY_LOG_FORMAT=json
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=6s --start-period=30s --retries=3 \
    CMD ["python", "/usr/local/bin/pagedserve-healthcheck", "http", "http://127.0.0.1:8000/health"]
ENTRYPOINT ["python", "-m", "gateway_svc"]
