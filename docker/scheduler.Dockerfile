# syntax=docker/dockerfile:1
# The scheduler: queues, KV block manager, step planner, serving.v1 + admin.v1 gRPC.
# CPU only: no torch, no triton, no CUDA. Build from the repository root:
#   docker build -f docker/scheduler.Dockerfile -t pagedserve-scheduler .

# Generated gRPC stubs are not in git: make them in a throw-away stage so the
# final image does not carry grpcio-tools.
FROM python:3.11-slim AS stubs
RUN pip install --no-cache-dir grpcio-tools==1.85.1
WORKDIR /src
COPY proto/*.proto proto/
RUN python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. \
        proto/worker.proto proto/serving.proto proto/admin.proto

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/app
COPY docker/requirements-scheduler.txt /tmp/requirements.txt
# /secrets: where docker-compose.yml's `secrets` service writes (a named volume
# takes this directory's owner when it is first mounted).
RUN pip install --no-cache-dir -r /tmp/requirements.txt && rm /tmp/requirements.txt \
    && useradd --system --uid 10001 --no-create-home pagedserve \
    && mkdir /secrets && chown pagedserve /secrets
WORKDIR /app
COPY proto/__init__.py proto/
COPY --from=stubs /src/proto/*_pb2*.py proto/
COPY svc_common/ svc_common/
COPY scheduler_svc/ scheduler_svc/
# The one-shot certificate and key maker (python -m tools.certs).
COPY tools/__init__.py tools/certs.py tools/
COPY docker/healthcheck.py /usr/local/bin/pagedserve-healthcheck
USER pagedserve
# Inside a container the service must listen on all interfaces to be reachable
# from the other containers; outside containers every service defaults to 127.0.0.1.
ENV PAGEDSERVE_SCHEDULER_HOST=0.0.0.0 \
    PAGEDSERVE_SCHEDULER_PORT=50051 \
    PAGEDSERVE_SCHEDULER_MODEL=/models/model \
    PAGEDSERVE_SCHEDULER_LOG_FORMAT=json
EXPOSE 50051
HEALTHCHECK --interval=10s --timeout=6s --start-period=120s --retries=3 \
    CMD ["python", "/usr/local/bin/pagedserve-healthcheck", "grpc", "127.0.0.1:50051"]
ENTRYPOINT ["python", "-m", "scheduler_svc"]
